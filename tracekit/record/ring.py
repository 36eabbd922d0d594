"""The CPU backend's bounded trace: allocation events kept as a ring buffer, converted as they come.

The profiler is stopped and restarted every second or so (`cpu.CpuBackend`);
each stretch's allocation events are turned at once into compact rows
``(time_us, addr, size, frames_key, metadata)`` (size < 0: a free) and the
profiler's own results are dropped. The ring keeps the newest rows worth
`max_entries` trace entries (an allocation writes two, a free three), as
PyTorch's allocator history keeps its newest entries. What must outlive the
ring is kept beside it, bounded by what is live rather than by how long the
run was: the blocks live now (the final segments) and the state of the
storages that existed before recording (`entries.PreexistingFrees`).
"""
from __future__ import annotations

import bisect
from collections import deque

from .entries import PreexistingFrees, allocation_entries, free_entries, frame_list, segment


class Ring:
    def __init__(self, max_entries=None, preexisting=()):
        self.max_entries = max_entries
        self.rows = deque()
        self.entries = 0  # trace entries the rows make
        self.total = 0  # rows ever added
        self.dropped = 0  # entries dropped off the front
        self.live = {}  # addr -> (size, frames_key) of blocks allocated in the trace and not freed
        self.preexisting = list(preexisting)  # [(addr, size, frames)] live when recording began
        self.pre = PreexistingFrees(self.preexisting)

    def add(self, events, metadata):
        """Append profiler events [(time_ns, order, addr, size, frames_key)]; metadata [(time_us, str)]."""
        meta_times = [t for t, _ in metadata]
        rows, live, pre = self.rows, self.live, self.pre
        for time_ns, _, addr, size, key in events:
            t = time_ns // 1000
            i = bisect.bisect_right(meta_times, t) - 1
            rows.append((t, addr, size, key, metadata[i][1] if i >= 0 else ""))
            self.total += 1
            if size > 0:
                live[addr] = (size, key)
                self.entries += 2
                pre.allocated(addr, size, t)
            else:
                live.pop(addr, None)
                self.entries += 3
                pre.freed(addr, -size, t)
        self._trim()

    def _trim(self):
        if self.max_entries is None:
            return
        rows = self.rows
        while rows:
            cost = 2 if rows[0][2] > 0 else 3
            if self.entries - cost < self.max_entries:
                break
            rows.popleft()
            self.entries -= cost
            self.dropped += cost

    def first_time(self):
        return self.rows[0][0] if self.rows else None

    def snapshot(self, freed=None, metadata=()):
        """{"segments", "device_traces"}: the kept entries (newest `max_entries`) and the blocks live at the end.

        `freed` {addr: time_us}: pre-existing storages seen to die (the
        profiler drops their frees); each gets its free entries at that time.
        """
        frames = {}

        def frames_of(key):
            f = frames.get(key)
            if f is None:
                f = frames[key] = frame_list(key)
            return f

        inserts = self.pre.inserts(freed or {}, metadata)
        first_t = self.rows[0][0] if self.rows else None
        entries, k = [], 0
        for t, addr, size, key, meta in self.rows:
            while k < len(inserts) and inserts[k][0] <= t:
                k = self._insert(entries, inserts[k], first_t, k)
            if size > 0:
                entries += allocation_entries(addr, size, t, frames_of(key), meta)
            else:
                entries += free_entries(addr, -size, t, frames_of(key), meta)
        while k < len(inserts):
            k = self._insert(entries, inserts[k], first_t, k)
        if self.max_entries is not None and len(entries) > self.max_entries:
            entries = entries[len(entries) - self.max_entries:]
        live = {addr: (size, frames_of(key)) for addr, (size, key) in self.live.items()}
        gone = {addr for _, addr, _, _ in inserts}
        for addr, size, f in self.preexisting:
            if not self.pre.touched(addr) and addr not in gone:
                live.setdefault(addr, (size, f))
        segments = [segment(addr, size, f) for addr, (size, f) in sorted(live.items())]
        return {"segments": segments, "device_traces": [entries]}

    def _insert(self, entries, insert, first_t, k):
        t, addr, size, meta = insert
        if not (self.dropped and first_t is not None and t < first_t):  # else: before the kept window
            entries += free_entries(addr, size, t, [], meta)
        return k + 1
