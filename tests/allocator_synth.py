"""Snapshots written by the allocator model itself (tracekit.analysis.allocator.core), in torch's format.

Used where no real recording exists (expandable segments, several streams, cross-stream frees,
empty_cache, out of memory, two devices) and for random request streams: the model serves them and
writes the trace entries and final segments torch would write for the same decisions, so a replay of
the file must find every block where the model put it.
"""
import random

from tracekit.analysis.allocator.config import DEFAULT, MB, AllocatorConfig
from tracekit.analysis.allocator.core import Allocator, Device, OutOfMemory

FRAMES = [{"filename": "train.py", "line": 7, "name": "step"}]


class Recorder:
    """Drive an Allocator and keep the trace entries torch would record for it."""

    def __init__(self, config: AllocatorConfig = DEFAULT, capacity=None, memory_fraction_bytes=None, device=0):
        self.alloc = Allocator(config, Device(capacity=capacity), memory_fraction_bytes, log=[])
        self.config = config
        self.device = device
        self.trace = []
        self.live = {}  # addr -> Block
        self._seen = 0

    def _drain(self):
        for action, addr, size, stream in self.alloc.log[self._seen:]:
            if action == "oom":
                continue
            if action == "free_completed":  # empty_cache waited for the frees still in flight
                self.live.pop(addr, None)
            self.trace.append({"action": action, "addr": addr, "size": size, "stream": stream})
        self._seen = len(self.alloc.log)

    def malloc(self, size, stream=0):
        try:
            b = self.alloc.malloc(size, stream)
        except OutOfMemory:
            self._drain()
            free = (self.alloc.device.capacity or 0) - self.alloc.reserved
            self.trace.append({"action": "oom", "addr": 0, "size": self.config.round_size(size), "stream": stream,
                               "device_free": max(free, 0)})
            return None
        self._drain()
        self.trace.append({"action": "alloc", "addr": b.addr, "size": size, "stream": stream, "frames": FRAMES})
        self.live[b.addr] = b
        return b.addr

    def free(self, addr, complete=True):
        b = self.live[addr]
        self.trace.append({"action": "free_requested", "addr": addr, "size": b.requested, "stream": b.stream})
        self.alloc.free(b, completed=complete)
        if complete:
            self.trace.append({"action": "free_completed", "addr": addr, "size": b.requested, "stream": b.stream})
            del self.live[addr]

    def complete(self, addr, block=None):
        b = self.live.get(addr)
        if b is None or not b.pending or (block is not None and b is not block):
            return  # completed already, by an empty_cache
        del self.live[addr]
        self.trace.append({"action": "free_completed", "addr": addr, "size": b.requested, "stream": b.stream})
        self.alloc.complete_free(b)

    def empty_cache(self):
        self.alloc.release_cached()
        self._drain()

    def segments(self):
        out = []
        for s in self.alloc.snapshot():
            blocks = [{"address": b["address"], "size": b["size"], "requested_size": b["requested_size"],
                       "state": b["state"], "frames": FRAMES if b["state"] != "inactive" else []} for b in s["blocks"]]
            out.append({"device": self.device, "address": s["address"], "total_size": s["total_size"],
                        "allocated_size": sum(b["size"] for b in blocks if b["state"] == "active_allocated"),
                        "active_size": sum(b["size"] for b in blocks if b["state"] != "inactive"),
                        "requested_size": 0, "stream": s["stream"], "segment_type": s["segment_type"],
                        "segment_pool_id": (0, 0), "is_expandable": s["is_expandable"], "frames": [],
                        "blocks": blocks})
        return out

    def settings(self):
        c = self.config
        return {"PYTORCH_CUDA_ALLOC_CONF": c.text,
                "max_split_size": -1 if c.max_split_size >= 2**63 else c.max_split_size,
                "garbage_collection_threshold": c.garbage_collection_threshold,
                "expandable_segments": c.expandable_segments,
                "roundup_power2_divisions": {str(1 << i): d for i, d in enumerate(c.roundup_power2_divisions)}}

    def snapshot(self, drop_first=0, settings=True):
        snap = {"segments": self.segments(), "device_traces": [self.trace[drop_first:]]}
        if settings:
            snap["allocator_settings"] = self.settings()
        return snap


SIZES = [512, 700, 4096, 65536, 300_000, 1 * MB, 1 * MB + 1, 3 * MB, 5 * MB + 123, 9 * MB, 10 * MB, 12 * MB + 7,
         24 * MB, 40 * MB, 130 * MB, 300 * MB]


def random_run(seed, config: AllocatorConfig = DEFAULT, steps=400, streams=(0,), capacity=None,
               memory_fraction_bytes=None, pending=0.1, empty_cache=0.01) -> Recorder:
    """A random request stream served by the model: allocations of mixed sizes, frees in random order,
    some completed later (cross-stream use), an occasional empty_cache."""
    rng = random.Random(seed)
    rec = Recorder(config, capacity=capacity, memory_fraction_bytes=memory_fraction_bytes)
    waiting = []
    for _ in range(steps):
        r = rng.random()
        if r < 0.5 or not rec.live:
            size = rng.choice(SIZES) if rng.random() < 0.7 else rng.randint(1, 50 * MB)
            rec.malloc(size, rng.choice(streams))
        elif r < 0.5 + empty_cache:
            rec.empty_cache()
        else:
            addr = rng.choice([a for a, b in rec.live.items() if b.allocated] or [None])
            if addr is None:
                continue
            if rng.random() < pending:
                waiting.append((addr, rec.live[addr]))
                rec.free(addr, complete=False)
            else:
                rec.free(addr)
        if waiting and rng.random() < 0.3:
            rec.complete(*waiting.pop(rng.randrange(len(waiting))))
    return rec
