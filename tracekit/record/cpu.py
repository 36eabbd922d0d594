"""CPU backend: torch.profiler memory events converted to a PyTorch snapshot.

The profiler (``profile_memory=True, with_stack=True``) sees every CPU
allocation and free with its address, size, time and the Python calls around
it. We walk its event tree once and write the same trace entries the CUDA
allocator would (``alloc``, ``free_requested``, ``free_completed``). There is
no caching allocator on the CPU: each allocation is its own segment, so, in
the order the CUDA allocator would write them, a ``segment_alloc`` precedes
each ``alloc`` and a ``segment_free`` follows each ``free_completed`` (at the
same time_us: reserved == allocated at every time), and the final ``segments`` are
synthesized the same way: one segment (``segment_type: "cpu"``) per block
live at the end, including the tensors that existed before recording (known
from the model and the optimizer) and were not freed during it. The profiler
drops the frees of those pre-existing storages; the recorder watches them
(preexisting.py) and `add_preexisting_frees` writes their frees. Device 0 is
the CPU.
"""
from __future__ import annotations

import bisect
import contextlib
import os
import platform
import sys

CPU_DEVICE = 0


@contextlib.contextmanager
def quiet_stderr():
    """Hide what the profiler's C++ side prints on fd 2 when it starts and stops
    ("USDT: ... profiler_start"), so a recorded script's stderr stays its own."""
    try:
        sys.stderr.flush()
        saved, devnull = os.dup(2), os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, 2)
    except (OSError, ValueError):
        yield
        return
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


class CpuBackend:
    name = "cpu"

    def __init__(self, stacks="python", max_entries=None):
        self.stacks = stacks
        self.max_entries = max_entries
        self._prof = None
        self._metadata = []  # [(time_us, metadata string)] in time order

    # -- recording ---------------------------------------------------------
    def device_of(self, tensor):
        """The trace device a tensor's storage lives on, or None if this backend does not see it."""
        return CPU_DEVICE if tensor.device.type == "cpu" else None

    def start(self):
        import torch
        from torch.profiler import ProfilerActivity, profile

        self._torch = torch
        self._prof = profile(
            activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True, record_shapes=False
        )
        with quiet_stderr():
            self._prof.start()

    def set_metadata(self, time_us, metadata):
        self._metadata.append((time_us, metadata))

    def stop(self):
        if self._prof is not None:
            prof, self._prof = self._prof, None
            with quiet_stderr():
                prof.stop()
            self._results = prof.profiler.kineto_results

    def restore(self):
        """Nothing to restore: the profiler is ours alone."""
        if self._prof is not None:
            try:
                self._prof.stop()
            except Exception:
                pass
            self._prof = None

    # -- the snapshot ------------------------------------------------------
    def snapshot(self, preexisting=(), freed=None):
        """The snapshot dict: `preexisting` is [(addr, size, frames)] of storages live at the start.

        `freed` is {addr: time_us} of those known to be freed while recording
        (the profiler drops their frees); see `add_preexisting_frees`.
        """
        events = allocation_events(self._results, with_ops=self.stacks == "all")
        entries = to_entries(events, self._metadata)
        entries = add_preexisting_frees(entries, preexisting, freed or {}, self._metadata)
        segments = final_segments(entries, preexisting)
        if self.max_entries is not None and len(entries) > self.max_entries:
            entries = entries[len(entries) - self.max_entries:]  # a ring buffer keeps the newest
        return {"segments": segments, "device_traces": [entries]}

    def devices(self):
        return [{"index": CPU_DEVICE, "type": "cpu", "name": cpu_name(), "total_memory": total_ram()}]


def allocation_events(kineto_results, with_ops=False):
    """[(time_ns, order, ptr, size, frames_key)] of CPU allocations (size > 0) and frees (size < 0).

    frames_key is a tuple of (filename, line, name), innermost first, shared by
    equal stacks so that the written file stores each stack once.
    """
    from torch._C._profiler import _EventType

    py_tags = (_EventType.PyCall, _EventType.PyCCall)
    torch_op = _EventType.TorchOp
    allocation = _EventType.Allocation
    interned = {}
    out = []
    # Depth-first walk carrying the Python frames above each node (outermost first).
    todo = [(root, (), ()) for root in reversed(kineto_results.experimental_event_tree())]
    while todo:
        node, pyframes, ops = todo.pop()
        tag = node.tag
        if tag in py_tags:
            pyframes = pyframes + ((node, tag),)
            ops = ()
        elif tag == torch_op and with_ops:
            ops = ops + (node.name,)
        elif tag == allocation:
            ef = node.extra_fields
            if ef.device.type == "cpu" and ef.alloc_size != 0 and ef.ptr:
                key = _frames_key(pyframes, ops, _EventType.PyCall)
                key = interned.setdefault(key, key)
                out.append((node.start_time_ns, len(out), ef.ptr, ef.alloc_size, key))
        children = node.children
        for child in reversed(children):
            todo.append((child, pyframes, ops))
    out.sort(key=lambda e: (e[0], e[1]))
    return out


def _frames_key(pyframes, ops, pycall_tag):
    """Python frames innermost first, like a traceback read upwards.

    `pyframes` are the profiler's Python nodes above an allocation, outermost
    first. A PyCall node is one Python frame: `callsite` is that frame (its
    def line, or for a frame already running when profiling began, the line it
    was at), `caller` is the frame it was called from, at the calling line. A
    PyCCall node is a C function called from the frame `caller`; it makes no
    frame of its own.

    So the chain is read from the callers: each PyCall node contributes its
    caller. The innermost node adds the line the allocation came from: a C
    call's caller (the line that called it), or a Python function's own frame
    at its def line (the profiler does not know the current line). A C call
    with Python nodes inside it (exec, a C function calling back into Python,
    the autograd engine running Python hooks) adds nothing: the frame that
    called it is the caller of the Python call inside it, already written.
    The outermost node, a frame already running when profiling began with
    nothing below it, reports itself as its caller; that duplicate is dropped.
    """
    frames = [("", 0, op) for op in reversed(ops)]
    last = len(pyframes) - 1
    for i in range(last, -1, -1):
        node, tag = pyframes[i]
        ef = node.extra_fields
        c = ef.caller
        caller = (c.file_name, c.line_number, c.function_name)
        if tag != pycall_tag:  # a C call
            if i == last:
                frames.append(caller)
            continue
        cs = ef.callsite
        own = (cs.file_name, cs.line_number, cs.function_name)
        if i == last:
            frames.append(own)
        if i == 0 and own == caller:
            continue  # the bottom frame, its own caller
        frames.append(caller)
    return tuple(frames)


def to_entries(events, metadata=()):
    """Trace entries (dicts) from allocation events; metadata [(time_us, str)] tags each entry."""
    meta_times = [t for t, _ in metadata]
    frame_lists = {}

    def frames_of(key):
        frames = frame_lists.get(key)
        if frames is None:
            frames = frame_lists[key] = [{"filename": f, "line": l, "name": n} for f, l, n in key]
        return frames

    def metadata_at(t):
        i = bisect.bisect_right(meta_times, t) - 1
        return metadata[i][1] if i >= 0 else ""

    entries = []
    for time_ns, _, ptr, size, key in events:
        t = time_ns // 1000
        frames = frames_of(key)
        meta = metadata_at(t)
        if size > 0:
            entries.append(_entry("segment_alloc", ptr, size, t, frames, meta))
            entries.append(_entry("alloc", ptr, size, t, frames, meta))
        else:
            entries.append(_entry("free_requested", ptr, -size, t, frames, meta))
            entries.append(_entry("free_completed", ptr, -size, t, frames, meta))
            entries.append(_entry("segment_free", ptr, -size, t, frames, meta))
    return entries


def add_preexisting_frees(entries, preexisting, freed, metadata=()):
    """`entries` with a free (free_requested, free_completed, segment_free) for each pre-existing storage freed.

    The profiler never reports the free of a block allocated before it
    started. A pre-existing storage [(addr, size, frames)] is freed:

    - at `freed[addr]` (the time its death was seen, on the entries' clock),
    - but no later than just before the first traced allocation that
      overlaps its bytes (the memory was free again by then),
    - and not at all when the trace already frees it (a free at its address
      before any allocation there) or neither is known (still live: a final
      segment).

    The three entries go before every entry of the same or a later
    `time_us`, so the pairs the trace writes at one time stay together.
    """
    if not preexisting:
        return entries
    spans = sorted((a, s) for a, s, _ in preexisting)
    starts = [a for a, _ in spans]
    first_reuse = {}  # addr -> index of the first traced alloc overlapping it
    traced_free = set()
    for i, e in enumerate(entries):
        action = e["action"]
        if action == "alloc":
            a, end = e["addr"], e["addr"] + e["size"]
            j = bisect.bisect_left(starts, end) - 1
            while j >= 0 and spans[j][0] + spans[j][1] > a:
                first_reuse.setdefault(spans[j][0], i)
                j -= 1
        elif action == "free_completed":
            a = e["addr"]
            j = bisect.bisect_left(starts, a)
            if j < len(starts) and starts[j] == a and a not in first_reuse:
                traced_free.add(a)
    times = [e["time_us"] for e in entries]
    meta_times = [t for t, _ in metadata]
    inserts = []
    for addr, size in spans:
        if addr in traced_free:
            continue
        t = freed.get(addr)
        r = first_reuse.get(addr)
        if r is not None:
            t = times[r] if t is None else min(t, times[r])
        if t is None:
            continue
        k = bisect.bisect_right(meta_times, t) - 1
        meta = metadata[k][1] if k >= 0 else ""
        inserts.append((bisect.bisect_left(times, t), t, addr, [
            _entry(action, addr, size, t, [], meta)
            for action in ("free_requested", "free_completed", "segment_free")
        ]))
    if not inserts:
        return entries
    inserts.sort(key=lambda x: x[:3])
    out, prev = [], 0
    for pos, _, _, triple in inserts:
        out.extend(entries[prev:pos])
        out.extend(triple)
        prev = pos
    out.extend(entries[prev:])
    return out


def _entry(action, addr, size, time_us, frames, meta):
    return {
        "action": action, "addr": addr, "size": size, "stream": 0,
        "time_us": time_us, "frames": frames, "user_metadata": meta,
    }


def final_segments(entries, preexisting=()):
    """One synthesized segment per block live at the end of `entries`.

    Live at the end: what the trace allocates and does not free, plus the
    `preexisting` storages [(addr, size, frames)] that the trace never frees.
    """
    live = {}  # addr -> (size, frames)
    seen = set()  # a pre-existing storage whose address the trace touches was freed in it
    for e in entries:
        addr = e["addr"]
        if e["action"] == "alloc":
            live[addr] = (e["size"], e["frames"])
        elif e["action"] == "free_completed":
            live.pop(addr, None)
        seen.add(addr)
    for addr, size, frames in preexisting:
        if addr not in seen:
            live[addr] = (size, frames)
    return [_segment(addr, size, frames) for addr, (size, frames) in sorted(live.items())]


def _segment(addr, size, frames):
    block = {"address": addr, "size": size, "requested_size": size, "state": "active_allocated", "frames": frames}
    return {
        "device": CPU_DEVICE, "address": addr, "total_size": size, "allocated_size": size,
        "active_size": size, "requested_size": size, "stream": 0, "segment_type": "cpu",
        "segment_pool_id": (0, 0), "is_expandable": False, "frames": frames, "blocks": [block],
    }


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def total_ram():
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
