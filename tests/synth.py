"""Small, self-consistent synthetic snapshots for the shapes the real fixtures lack.

`Sim` is a toy allocator: each allocation gets its own segment (or a slice of
one expandable segment), frees leave inactive blocks, and the final segments
always agree with the trace, exactly as PyTorch's would.
"""
import itertools

MiB = 2**20


class Sim:
    def __init__(self, devices=1, expandable=False, times=True, streams=(0,)):
        self.expandable = expandable
        self.times = times
        self.streams = streams
        self.traces = [[] for _ in range(devices)]
        self.segments = []  # dicts as in a snapshot, blocks keyed by address while building
        self.clock = itertools.count(1_700_000_000_000_000, 7)
        self.next_addr = [0x7F0000000000 + d * 0x10000000000 for d in range(devices)]
        self.exp = {}  # device -> expandable segment
        self.live = {}  # (device, addr) -> block dict

    def _entry(self, device, action, addr, size, stream=0, **extra):
        e = {"action": action, "addr": addr, "size": size, "stream": stream}
        if self.times:
            e["time_us"] = next(self.clock)
        e.update(extra)
        self.traces[device].append(e)

    def alloc(self, size, device=0, stream=None, frames=None):
        stream = self.streams[0] if stream is None else stream
        frames = frames if frames is not None else [{"filename": "train.py", "line": 10, "name": "step"}]
        addr = self.next_addr[device]
        self.next_addr[device] += size
        block = {"address": addr, "size": size, "requested_size": size, "state": "active_allocated", "frames": frames}
        if self.expandable:
            seg = self.exp.get(device)
            if seg is None:
                seg = self.exp[device] = self._segment(device, addr, 0, stream, expandable=True)
            self._entry(device, "segment_map", addr, size, stream)
            seg["total_size"] += size
        else:
            seg = self._segment(device, addr, size, stream)
            self._entry(device, "segment_alloc", addr, size, stream)
        seg["blocks"].append(block)
        self._entry(device, "alloc", addr, size, stream, frames=frames)
        self.live[(device, addr)] = block
        return addr

    def free(self, addr, device=0, complete=True):
        block = self.live[(device, addr)]
        self._entry(device, "free_requested", addr, block["size"])
        if complete:
            self._entry(device, "free_completed", addr, block["size"])
            block["state"] = "inactive"
            del self.live[(device, addr)]
        else:
            block["state"] = "active_pending_free"

    def oom(self, size, device_free, device=0):
        self._entry(device, "oom", 0, size, device_free=device_free)

    def unknown(self, device=0):
        self._entry(device, "future_action_from_torch_3", 0, 0, some_new_field=[1, 2])

    def _segment(self, device, addr, size, stream, expandable=False):
        seg = {"device": device, "address": addr, "total_size": size, "allocated_size": 0, "active_size": 0,
               "requested_size": 0, "stream": stream, "segment_type": "large", "segment_pool_id": (0, 0),
               "is_expandable": expandable, "frames": [], "blocks": []}
        self.segments.append(seg)
        return seg

    def snapshot(self, drop_first=0):
        """The snapshot dict; drop_first simulates a ring buffer that lost its oldest entries."""
        traces = [t[drop_first:] if i == 0 else t for i, t in enumerate(self.traces)]
        return {"segments": self.segments, "device_traces": traces}
