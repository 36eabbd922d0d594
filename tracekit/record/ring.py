"""The CPU backend's bounded trace: allocation events kept as compact numpy rows, newest `max_entries`.

Each chunk of joined events (cpu.py) is one structured array of rows (time_us, addr, size, stack,
forward stack, module, metadata; size < 0: a free). The ring keeps the newest rows worth `max_entries`
trace entries (an allocation writes two, a free three), as PyTorch's allocator history keeps its newest
entries. What must outlive the ring is kept beside it, bounded by what is live rather than by how long
the run was: the blocks live now (the final segments) and, when frees of pre-existing storages are not
seen directly (the profiler source), the state of those storages (`entries.PreexistingFrees`).
"""
from __future__ import annotations

from collections import deque

import numpy as np

from .entries import PreexistingFrees, allocation_entries, free_entries, segment

ROW = np.dtype([("t", "<i8"), ("addr", "<u8"), ("size", "<i8"), ("stack", "<i4"), ("fstack", "<i4"),
                ("module", "<i4"), ("meta", "<i4")])


class Ring:
    def __init__(self, max_entries=None, preexisting=(), exact_frees=True):
        self.max_entries = max_entries
        self.chunks = deque()
        self.entries = 0  # trace entries the kept rows make
        self.total = 0  # rows ever added
        self.dropped = 0  # entries dropped off the front
        self.live = {}  # addr -> (size, stack) of blocks live now (stack -1: pre-existing, no frames)
        self.preexisting = list(preexisting)  # [(addr, size, frames)] live when recording began
        self.exact_frees = exact_frees
        self.pre = None if exact_frees else PreexistingFrees(self.preexisting)
        if exact_frees:
            for addr, size, _ in self.preexisting:
                self.live[addr] = (size, -1)
        self.metas = []  # metadata strings, by id
        self._meta_ids = {}

    def meta_id(self, s: str) -> int:
        k = self._meta_ids.get(s)
        if k is None:
            k = self._meta_ids[s] = len(self.metas)
            self.metas.append(s)
        return k

    def compact_metas(self):
        """Keep only the metadata strings the kept rows use (one per phase: bounded on long runs)."""
        if len(self.metas) < 4096:
            return
        used = np.unique(np.concatenate([c["meta"] for c in self.chunks])) if self.chunks else np.zeros(0, int)
        used = used[used >= 0]
        remap = np.full(len(self.metas) + 1, -1, np.int32)
        remap[used] = np.arange(len(used), dtype=np.int32)
        self.metas = [self.metas[i] for i in used.tolist()]
        self._meta_ids = {m: i for i, m in enumerate(self.metas)}
        for i, c in enumerate(self.chunks):
            c = c.copy()
            c["meta"] = np.where(c["meta"] >= 0, remap[c["meta"]], -1)
            self.chunks[i] = c

    def add(self, rows: np.ndarray):
        if not len(rows):
            return
        live, pre = self.live, self.pre
        if pre is not None:  # the profiler source: pre-existing storages' state needs every event, in order
            for t, addr, size, stack in zip(rows["t"].tolist(), rows["addr"].tolist(), rows["size"].tolist(),
                                            rows["stack"].tolist()):
                if size > 0:
                    live[addr] = (size, stack)
                    pre.allocated(addr, size, t)
                else:
                    live.pop(addr, None)
                    pre.freed(addr, -size, t)
        else:  # only the last event at each address decides whether it is live after this chunk
            addr = rows["addr"]
            rev = addr[::-1]
            _, first_in_rev = np.unique(rev, return_index=True)
            last = len(addr) - 1 - first_in_rev
            for a, size, stack in zip(addr[last].tolist(), rows["size"][last].tolist(), rows["stack"][last].tolist()):
                if size > 0:
                    live[a] = (size, stack)
                else:
                    live.pop(a, None)
        self.chunks.append(rows)
        self.total += len(rows)
        self.entries += int(np.where(rows["size"] > 0, 2, 3).sum())
        self._trim()

    def forget_older(self):
        """Drop every kept row (events after them were lost: the kept window must be contiguous)."""
        for c in self.chunks:
            self.dropped += int(np.where(c["size"] > 0, 2, 3).sum())
        self.chunks.clear()
        self.entries = 0

    def _trim(self):
        """Drop the oldest rows while what is left still makes at least `max_entries` entries (the
        snapshot then keeps exactly the newest `max_entries`)."""
        if self.max_entries is None:
            return
        while self.chunks and self.entries > self.max_entries:
            c = self.chunks[0]
            cum = np.cumsum(np.where(c["size"] > 0, 2, 3))
            k = int(np.searchsorted(cum, self.entries - self.max_entries, side="right"))  # rows that may go
            if k == 0:
                return
            if k >= len(c):
                self.chunks.popleft()
            else:
                self.chunks[0] = c[k:]
            self.entries -= int(cum[k - 1])
            self.dropped += int(cum[k - 1])

    def first_time(self):
        return int(self.chunks[0]["t"][0]) if self.chunks else None

    def rows(self):
        return np.concatenate(list(self.chunks)) if self.chunks else np.zeros(0, ROW)

    def snapshot(self, frames_of, module_name, freed=None, metadata=()):
        """{"segments", "device_traces"}: the kept entries (newest `max_entries`) and the blocks live at the end.

        frames_of(stack id) -> frames list; module_name(id) -> str ("" none). `freed` {addr: time_us}:
        pre-existing storages seen to die by the profiler source's watch; each gets its free entries.
        """
        inserts = self.pre.inserts(freed or {}, metadata) if self.pre is not None else []
        rows = self.rows()
        first_t = int(rows["t"][0]) if len(rows) else None
        metas = self.metas
        entries, k = [], 0
        for t, addr, size, stack, fstack, module, meta in zip(
                rows["t"].tolist(), rows["addr"].tolist(), rows["size"].tolist(), rows["stack"].tolist(),
                rows["fstack"].tolist(), rows["module"].tolist(), rows["meta"].tolist()):
            while k < len(inserts) and inserts[k][0] <= t:
                k = self._insert(entries, inserts[k], first_t, k)
            md = metas[meta] if meta >= 0 else ""
            if size > 0:
                pair = allocation_entries(addr, size, t, frames_of(stack), md)
                if fstack >= 0:
                    ff = frames_of(fstack)
                    if ff:
                        pair[0]["forward_frames"] = pair[1]["forward_frames"] = ff
                if module > 0:
                    name = module_name(module)
                    if name:
                        pair[0]["module"] = pair[1]["module"] = name
                entries += pair
            else:
                entries += free_entries(addr, -size, t, frames_of(stack), md)
        while k < len(inserts):
            k = self._insert(entries, inserts[k], first_t, k)
        if self.max_entries is not None and len(entries) > self.max_entries:
            entries = entries[len(entries) - self.max_entries:]
        live = {addr: (size, frames_of(stack) if stack >= 0 else []) for addr, (size, stack) in self.live.items()}
        if self.pre is not None:
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
