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
import time
import warnings

from .marks import now_us

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
    """Records with torch.profiler, restarted every `chunk_seconds` (at a phase boundary) so that its
    results are converted as they come and memory stays bounded by `max_entries` (ring.py).

    A torch.profiler of the user's own cannot run beside ours (one profiler
    per process): while one runs, ours is paused, its memory events (when it
    has ``profile_memory=True``) fill the pause, and the pause is written in
    the file's ``gaps`` (coexist.py).
    """

    name = "cpu"
    chunk_seconds = 1.0  # None: one profiler session for the whole recording

    def __init__(self, stacks="python", max_entries=None):
        self.stacks = stacks
        self.max_entries = max_entries
        self.gaps = []  # {start_us, end_us, reason, filled}: times our profiler was paused for the user's
        self._prof = None
        self._ring = None
        self._metadata = []  # [(time_us, metadata string)] in time order, pruned to the ring's window
        self._chunk_start = 0.0
        self._watch = None  # coexist.OtherProfilers
        self._ranges = None  # coexist.OpenRanges: no restart while a record_function range is open
        self._paused = None  # the open gap while the user's profiler runs
        self.origins = None  # origins.Origins: forward origins and modules, fed each session (origins.py)

    # -- recording ---------------------------------------------------------
    def device_of(self, tensor):
        """The trace device a tensor's storage lives on, or None if this backend does not see it."""
        return CPU_DEVICE if tensor.device.type == "cpu" else None

    def start(self, preexisting=()):
        """Start recording; `preexisting` [(addr, size)]: storages live now (their frees are found later)."""
        from .coexist import OpenRanges, OtherProfilers, profiler_running
        from .ring import Ring

        self._ring = Ring(self.max_entries, [(a, s, []) for a, s in preexisting])
        self._watch = OtherProfilers(self._other_started, self._other_stopped)
        self._watch.install()
        self._ranges = OpenRanges()
        self._ranges.install()
        if profiler_running():
            self._pause("your torch.profiler was already running when tracekit began", inside=False)
        else:
            self._start_session()

    def set_metadata(self, time_us, metadata):
        self._metadata.append((time_us, metadata))
        if (self._prof is not None and self.chunk_seconds is not None and not len(self._ranges)
                and time.monotonic() - self._chunk_start >= self.chunk_seconds):
            self._stop_session()
            self._start_session()

    def stop(self):
        self._stop_session()
        if self._paused is not None:
            self._close_gap(now_us(), filled=False)
        self._remove_watch()

    def restore(self):
        """Stop the profiler if it still runs, and stop watching for the user's."""
        try:
            if self._prof is not None:
                prof, self._prof = self._prof, None
                with self._watch.ours(), quiet_stderr():
                    prof.stop()
        except Exception:
            pass
        self._remove_watch()

    # -- sessions ----------------------------------------------------------
    def _new_profile(self):
        from torch.profiler import ProfilerActivity, profile

        return profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True,
                       record_shapes=False)

    def _start_session(self):
        prof = self._new_profile()
        with self._watch.ours(), quiet_stderr():
            prof.start()
        self._prof = prof
        self._chunk_start = time.monotonic()

    def _stop_session(self):
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        with self._watch.ours(), quiet_stderr():
            prof.stop()
        self._take(prof.profiler.kineto_results)
        prof.profiler = None  # the profile object sits in a reference cycle: let its results go now, not at gc

    def _take(self, results, since_us=None):
        """Convert a profiler result's allocation events into the ring, then let the result go."""
        if self.origins is not None:
            from .origins import take
            take(self.origins, results)
        events = allocation_events(results, with_ops=self.stacks == "all")
        if since_us is not None:
            events = [e for e in events if e[0] // 1000 >= since_us]
        self._ring.add(events, self._metadata)
        first = self._ring.first_time()
        if first is not None:  # metadata older than the ring's window is no longer needed
            i = bisect.bisect_right([t for t, _ in self._metadata], first) - 1
            if i > 0:
                del self._metadata[:i]

    # -- the user's own profiler (coexist.OtherProfilers) ------------------
    def _other_started(self):
        if self._paused is None:
            self._stop_session()
            self._pause("your torch.profiler started while tracekit was recording", inside=True)

    def _other_stopped(self, results):
        if self._paused is None:
            return
        filled = False
        try:
            before = self._ring.total
            # theirs began inside ours: all of it is ours to take; else only what came after we began
            since = None if self._paused["inside"] else self._paused["start_us"]
            self._take(results, since_us=since)
            filled = self._ring.total > before
        except Exception:
            pass
        self._close_gap(now_us(), filled)
        self._start_session()

    def _pause(self, reason, inside):
        self._paused = {"start_us": now_us(), "end_us": None, "reason": reason, "filled": False, "inside": inside}
        warnings.warn(f"tracekit: {reason}; one profiler runs at a time, so tracekit pauses until yours stops "
                      "(with profile_memory=True, its memory events fill the pause); the pause is in the file's "
                      "gaps", RuntimeWarning, stacklevel=4)

    def _close_gap(self, end_us, filled):
        gap, self._paused = self._paused, None
        gap["end_us"] = end_us
        gap["filled"] = filled
        del gap["inside"]
        self.gaps.append(gap)

    def _remove_watch(self):
        if self._watch is not None:
            self._watch.remove()
        if self._ranges is not None:
            self._ranges.remove()

    # -- the snapshot ------------------------------------------------------
    def snapshot(self, preexisting=(), freed=None):
        """The snapshot dict. `freed` {addr: time_us}: pre-existing storages seen to die while recording
        (the profiler drops their frees); see `PreexistingFrees`."""
        return self._ring.snapshot(freed or {}, self._metadata)

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
    entries = []
    for time_ns, _, ptr, size, key in events:
        t = time_ns // 1000
        frames = frame_lists.get(key)
        if frames is None:
            frames = frame_lists[key] = frame_list(key)
        i = bisect.bisect_right(meta_times, t) - 1
        meta = metadata[i][1] if i >= 0 else ""
        if size > 0:
            entries += allocation_entries(ptr, size, t, frames, meta)
        else:
            entries += free_entries(ptr, -size, t, frames, meta)
    return entries


def frame_list(key):
    return [{"filename": f, "line": l, "name": n} for f, l, n in key]


def allocation_entries(addr, size, t, frames, meta):
    """What the CUDA allocator writes for a block that is its own segment: segment_alloc, alloc."""
    return [_entry("segment_alloc", addr, size, t, frames, meta), _entry("alloc", addr, size, t, frames, meta)]


def free_entries(addr, size, t, frames, meta):
    return [_entry(action, addr, size, t, frames, meta) for action in ("free_requested", "free_completed",
                                                                       "segment_free")]


class PreexistingFrees:
    """When the trace frees the storages [(addr, size, frames)] that were live when recording began.

    The profiler never reports the free of a block allocated before it
    started. Fed the trace's allocations and frees in time order, this says
    (`inserts`) when each pre-existing storage was freed:

    - at `freed[addr]` (the time its death was seen, on the entries' clock),
    - but no later than the first traced allocation that overlaps its bytes
      (the memory was free again by then),
    - and not at all when the trace already frees it (a free at its address
      before any allocation there) or neither is known (still live).
    """

    def __init__(self, preexisting):
        self.spans = sorted((a, s) for a, s, _ in preexisting)
        self._starts = [a for a, _ in self.spans]
        self._addrs = set(self._starts)
        self._sizes = dict(self.spans)
        self._first_reuse = {}  # addr -> time_us of the first traced alloc overlapping it
        self._traced_free = set()
        self._touched = set()  # pre-existing addresses the trace allocates or frees at

    def allocated(self, addr, size, t):
        if not self.spans:
            return
        spans = self.spans
        j = bisect.bisect_left(self._starts, addr + size) - 1
        while j >= 0 and spans[j][0] + spans[j][1] > addr:
            self._first_reuse.setdefault(spans[j][0], t)
            j -= 1
        if addr in self._addrs:
            self._touched.add(addr)

    def freed(self, addr, size, t):
        if addr in self._addrs:
            self._touched.add(addr)
            if addr not in self._first_reuse:
                if size == self._sizes[addr]:
                    self._traced_free.add(addr)
                else:  # not this storage's free: a block allocated there unseen (between two profiler sessions)
                    self._first_reuse[addr] = t

    def touched(self, addr):
        return addr in self._touched

    def inserts(self, freed, metadata=()):
        """[(time_us, addr, size, metadata string)] of the frees to write, in time order."""
        meta_times = [t for t, _ in metadata]
        out = []
        for addr, size in self.spans:
            if addr in self._traced_free:
                continue
            t = freed.get(addr)
            r = self._first_reuse.get(addr)
            if r is not None:
                t = r if t is None else min(t, r)
            if t is None:
                continue
            k = bisect.bisect_right(meta_times, t) - 1
            out.append((t, addr, size, metadata[k][1] if k >= 0 else ""))
        out.sort(key=lambda x: x[:2])
        return out


def add_preexisting_frees(entries, preexisting, freed, metadata=()):
    """`entries` with the free entries of each pre-existing storage freed (see `PreexistingFrees`).

    They go before every entry of the same or a later `time_us`, so the
    pairs the trace writes at one time stay together.
    """
    if not preexisting:
        return entries
    state = PreexistingFrees(preexisting)
    for e in entries:
        if e["action"] == "alloc":
            state.allocated(e["addr"], e["size"], e["time_us"])
        elif e["action"] == "free_completed":
            state.freed(e["addr"], e["size"], e["time_us"])
    inserts = state.inserts(freed, metadata)
    if not inserts:
        return entries
    times = [e["time_us"] for e in entries]
    out, prev = [], 0
    for t, addr, size, meta in inserts:
        pos = bisect.bisect_left(times, t)
        out.extend(entries[prev:pos])
        out.extend(free_entries(addr, size, t, [], meta))
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
    return [segment(addr, size, frames) for addr, (size, frames) in sorted(live.items())]


def segment(addr, size, frames):
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
