"""Trace entries and segments as the CUDA allocator writes them, for the CPU backend.

Shared by the CPU backend (cpu.py), its ring of converted chunks (ring.py) and the profiler session
(ranges.py): `alloc`/`free_*` entries of a block that is its own segment, the frees of storages that
existed before recording (which the profiler never reports), and the final segments. There is no caching allocator on the CPU, so each allocation is
its own segment: a ``segment_alloc`` precedes each ``alloc`` and a ``segment_free`` follows each
``free_completed`` (reserved == allocated at every time). Device 0 is the CPU.
"""
from __future__ import annotations

import bisect
import contextlib
import os
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


def _entry(action, addr, size, time_us, frames, meta):
    return {
        "action": action, "addr": addr, "size": size, "stream": 0,
        "time_us": time_us, "frames": frames, "user_metadata": meta,
    }


def segment(addr, size, frames):
    block = {"address": addr, "size": size, "requested_size": size, "state": "active_allocated", "frames": frames}
    return {
        "device": CPU_DEVICE, "address": addr, "total_size": size, "allocated_size": size,
        "active_size": size, "requested_size": size, "stream": 0, "segment_type": "cpu",
        "segment_pool_id": (0, 0), "is_expandable": False, "frames": frames, "blocks": [block],
    }
