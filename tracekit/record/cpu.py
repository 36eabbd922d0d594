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
(preexisting.py) and `entries.add_preexisting_frees` writes their frees. The
entries themselves are built in entries.py. Device 0 is the CPU.
"""
from __future__ import annotations

import bisect
import os
import platform
import time
import warnings

from .entries import CPU_DEVICE, allocation_events, quiet_stderr
from .marks import now_us


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
