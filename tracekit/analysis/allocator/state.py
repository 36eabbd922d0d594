"""The allocator's state when a trace begins, from the final segments minus what the trace did.

- Segments: the final ones, less those the trace created (segment_alloc / segment_map),
  plus those it gave back (segment_free / segment_unmap), walking the trace backwards.
- Blocks held when the trace begins: final live blocks whose address the trace never
  touches (their size is in the file), and addresses whose first trace entry frees
  them (allocated before the trace; the entry gives the requested size only).
- Everything else in those segments is cached free memory; free blocks always merge,
  so each free region is one block from one held block to the next.

The size of a block allocated before the trace is its rounded request plus the
remainder the allocator did not split off: none in the small pool or with expandable
segments (remainders of 512 B or more are split); in the large pool, a remainder of at
most 1 MiB (smaller free blocks cannot exist there, so a gap of <= 1 MiB up to the next
held block belongs to this one). A larger gap leaves up to 1 MiB open, unless the
trace's first allocation in that gap shows where the block ends; what stays open is
reported as `uncertain_bytes`, never guessed.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ...model import (ALLOC, BLOCK_STATE, FREE_COMPLETED, FREE_REQUESTED, SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP,
                      SEGMENT_UNMAP, Trace)
from ...model import isin_few, isin_ints
from .config import LARGE_BUFFER, SMALL_BUFFER, SMALL_SIZE, AllocatorConfig, expandable_pages
from .core import Allocator, Block

HELD, PENDING = 1, 2  # a block allocated when the trace begins; one freed but waiting for other streams


@dataclass
class Region:
    """A cudaMalloc'ed segment, or a mapped range of a growing (expandable) segment."""

    addr: int
    size: int
    stream: int
    small: bool
    expandable: bool = False
    pool_id: str = ""


@dataclass
class Held:
    addr: int
    size: int
    stream: int
    state: int  # HELD or PENDING
    requested: int
    known: bool  # size read from the final segments (else inferred from the request)
    open_bytes: int = 0  # how much larger it may be than `size` (0: exact)


@dataclass
class InitialState:
    regions: list[Region] = field(default_factory=list)
    held: list[Held] = field(default_factory=list)
    problems: dict[str, int] = field(default_factory=dict)  # what did not add up, by kind: count

    @property
    def allocated(self) -> int:
        return sum(h.size for h in self.held if h.state == HELD)

    @property
    def reserved(self) -> int:
        return sum(r.size for r in self.regions)

    @property
    def open_bytes(self) -> int:
        return sum(h.open_bytes for h in self.held if h.state == HELD)

    def problem(self, kind, n=1):
        self.problems[kind] = self.problems.get(kind, 0) + n


def initial_state(trace: Trace, device: int, config: AllocatorConfig) -> InitialState:
    """Reconstruct the device's segments and held blocks at the trace's first entry: once per trace, device
    and settings (callers read it, never change it). Kept beside the trace's memo, not in it: the analysis
    cache stores the memo, and this is an intermediate of the replays it stores."""
    memo = trace.__dict__.setdefault("_allocator_initial", {})
    key = (device, config)
    if key not in memo:
        memo[key] = _initial_state(trace, device, config)
    return memo[key]


def _initial_state(trace: Trace, device: int, config: AllocatorConfig) -> InitialState:
    ev = trace.events
    sl = ev.device_slice(device)
    action = ev.action[sl]
    addr = _int64(ev.addr[sl])
    size, stream = ev.size[sl], ev.stream[sl]
    st = InitialState()
    seg, blk = trace.segments, trace.blocks
    smask = seg.device == device
    seg_rows = np.flatnonzero(smask)
    final = {}
    for r in seg_rows.tolist():
        final[int(seg.address[r])] = Region(
            int(seg.address[r]), int(seg.total_size[r]), int(seg.stream[r]),
            trace.strings[seg.segment_type[r]] == "small" if trace.strings[seg.segment_type[r]] in ("small", "large")
            else int(seg.total_size[r]) == SMALL_BUFFER,
            bool(seg.is_expandable[r]), _pool(trace.strings[seg.pool_id[r]]))

    # segments: walk the trace's segment events backwards from the final ones
    plain = {a: r for a, r in final.items() if not r.expandable}
    mapped = _Ranges([(r.addr, r.addr + r.size, r) for r in final.values() if r.expandable])
    seg_ev = np.flatnonzero(isin_few(action, (SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP)))
    for i in seg_ev[::-1].tolist():
        a, z, s, act = int(addr[i]), int(size[i]), int(stream[i]), int(action[i])
        if act == SEGMENT_ALLOC:
            if plain.pop(a, None) is None:
                st.problem("segment_alloc of a segment that is not there afterwards")
        elif act == SEGMENT_FREE:
            if a in plain:
                st.problem("segment_free of a segment that is there afterwards")
            plain[a] = Region(a, z, s, z == SMALL_BUFFER)
        elif act == SEGMENT_MAP:
            if not mapped.remove(a, a + z):
                st.problem("segment_map of pages not mapped afterwards")
        else:
            mapped.add(a, a + z, Region(a, z, s, z % LARGE_BUFFER != 0))
    st.regions = sorted(list(plain.values()) + mapped.regions(), key=lambda r: r.addr)
    starts = [r.addr for r in st.regions]

    def region_of(a):
        k = bisect_right(starts, a) - 1
        if k >= 0 and a < st.regions[k].addr + st.regions[k].size:
            return st.regions[k]
        return None

    # blocks held at the start
    uniq, firsts, fa = first_touches(action, addr, ordered=False)
    freed = np.flatnonzero(fa != ALLOC)  # addresses whose first entry frees them: allocated before the trace
    held = []
    first_free = {}  # their first entries
    for a, i, act in zip(uniq[freed].tolist(), firsts[freed].tolist(), fa[freed].tolist()):
        held.append(Held(a, 0, int(stream[i]), HELD if act == FREE_REQUESTED else PENDING, int(size[i]), False))
        first_free[a] = i
    live_states = (BLOCK_STATE["active_allocated"], BLOCK_STATE["active_pending_free"])
    bmask = (blk.device == device) & np.isin(blk.state, live_states)
    b_addr = blk.addr[bmask].astype(np.int64)
    untouched = ~isin_ints(b_addr, uniq)
    for a, z, req, state, seg_row in zip(b_addr[untouched].tolist(), blk.size[bmask][untouched].tolist(),
                                          blk.requested_size[bmask][untouched].tolist(),
                                          blk.state[bmask][untouched].tolist(), blk.segment[bmask][untouched].tolist()):
        s = int(seg.stream[seg_row]) if 0 <= seg_row < len(seg.stream) else 0
        held.append(Held(a, int(z), s, HELD if state == live_states[0] else PENDING, int(req), True))
    held.sort(key=lambda h: h.addr)

    # sizes of blocks the file does not give: up to the next held block when the gap cannot be free
    allocs = _Allocs(action, addr)
    kept = []
    for k, h in enumerate(held):
        reg = region_of(h.addr)
        if reg is None:
            st.problem("block outside the segments")
            continue
        end = reg.addr + reg.size
        nxt = end
        if k + 1 < len(held) and held[k + 1].addr < end:
            nxt = held[k + 1].addr
        if h.known:
            if h.addr + h.size > nxt:
                st.problem("blocks overlap")
            kept.append(h)
            continue
        base = config.round_size(h.requested) if h.requested > 0 else 512
        if h.addr + base > nxt:
            st.problem("a freed block is larger than the room it had")
            h.size = max(nxt - h.addr, 0)
            h.open_bytes = 0
            kept.append(h)
            continue
        gap = nxt - (h.addr + base)
        if reg.small or reg.expandable or config.expandable_segments or gap == 0:
            h.size = base
        elif base >= config.max_split_size:
            h.size = min(nxt - h.addr, base + config.max_non_split_rounding - 512)  # oversize: never split
        elif gap <= SMALL_SIZE:
            h.size = base + gap  # a remainder this small is never split off
        else:
            # the first allocation inside the gap before this block's free starts where the block ends
            first = allocs.first_in(h.addr + base, min(h.addr + base + SMALL_SIZE, nxt),
                                    first_free.get(h.addr, 1 << 62))
            if first is not None:
                p = int(addr[first])
                h.size = p - h.addr
            else:
                h.size = base
                h.open_bytes = min(SMALL_SIZE, gap - SMALL_SIZE - 512)
        kept.append(h)
    st.held = kept
    return st


class _Allocs:
    """The trace's alloc entries, to ask which came first inside an address range (sorted on first use)."""

    def __init__(self, action, addr):
        self.action, self.addr = action, addr
        self.sorted = None

    def first_in(self, lo, hi, before):
        """The earliest alloc entry (index) with lo <= addr <= hi and index < before, or None."""
        self.asked = getattr(self, "asked", 0) + 1
        if self.sorted is None and self.asked <= 8:  # a few questions: a scan each is cheaper than a sort
            a = self.addr[:before]
            hit = np.flatnonzero((a >= lo) & (a <= hi) & (self.action[:before] == ALLOC))
            return int(hit[0]) if len(hit) else None
        if self.sorted is None:
            rows = np.flatnonzero(self.action == ALLOC)
            order = np.argsort(self.addr[rows], kind="stable")
            self.sorted = (self.addr[rows][order], rows[order])
        addrs, rows = self.sorted
        cand = rows[np.searchsorted(addrs, lo, "left"):np.searchsorted(addrs, hi, "right")]
        cand = cand[cand < before]
        return int(cand.min()) if len(cand) else None


def _int64(addr: np.ndarray) -> np.ndarray:
    """Addresses as int64: a 64-bit column seen as int64 (what astype gives, without its copy of every entry)."""
    addr = np.asarray(addr)
    if addr.dtype.kind in "iu" and addr.dtype.itemsize == 8:
        return addr.view(np.int64)
    return addr.astype(np.int64)


def first_touches(action, addr, ordered: bool = True):
    """(addresses, index of the first alloc/free entry naming each, that entry's action), by address; unless
    `ordered`, in whatever order is quickest (the compiled pass gives them in order of those entries)."""
    compiled: Callable[..., tuple[bytes, bytes, bytes]] | None
    try:
        from ._replay import first_touches as compiled
    except ImportError:
        compiled = None
    if compiled is not None:
        # 64-bit addresses are read as they are (an int64 column seen as uint64), not copied to uint64
        got = compiled(np.ascontiguousarray(action, np.int8), np.ascontiguousarray(_int64(addr)).view(np.uint64))
        a, i, c = np.frombuffer(got[0], np.int64), np.frombuffer(got[1], np.int64), np.frombuffer(got[2], np.int8)
        if not ordered:
            return a, i, c
        order = np.argsort(a)
        return a[order], i[order], c[order]
    t_idx = np.flatnonzero(np.isin(action, (ALLOC, FREE_REQUESTED, FREE_COMPLETED)))
    uniq, first = np.unique(addr[t_idx], return_index=True)
    firsts = t_idx[first]
    return uniq, firsts, action[firsts]


def _pool(text: str) -> str:
    """A segment's private pool id ("" for the default pools; "0,0" is how torch writes none)."""
    text = (text or "").strip()
    return "" if text in ("", "0,0", "(0, 0)", "0") else text


class _Ranges:
    """Mapped address ranges of growing segments: disjoint [start, end) with the region (stream, pool)
    they belong to; touching ranges of the same stream and pool are kept as one."""

    def __init__(self, items):
        self.items = []
        for a, b, r in sorted(items, key=lambda x: x[0]):
            self.add(a, b, r)

    def remove(self, lo, hi) -> bool:
        """Unmap [lo, hi): False (and nothing changed) unless all of it is mapped."""
        over = [k for k, (a, b, _) in enumerate(self.items) if a < hi and lo < b]
        if not over:
            return False
        pos = lo
        for k in over:
            a, b, _ = self.items[k]
            if a > pos:
                return False
            pos = max(pos, b)
        if pos < hi:
            return False
        parts = []
        for k in over:
            a, b, r = self.items[k]
            if a < lo:
                parts.append([a, lo, r])
            if hi < b:
                parts.append([hi, b, r])
        self.items[over[0]:over[-1] + 1] = parts
        return True

    def add(self, lo, hi, region):
        self.items.append([lo, hi, region])
        self.items.sort(key=lambda x: x[0])
        merged = []
        for a, b, r in self.items:
            if merged and merged[-1][1] >= a and merged[-1][2].stream == r.stream and merged[-1][2].small == r.small:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b, r])
        self.items = merged

    def regions(self) -> list:
        return [Region(a, b - a, r.stream, r.small, True, r.pool_id) for a, b, r in self.items]


def load(alloc: Allocator, st: InitialState) -> dict:
    """Put the initial state into a fresh allocator; returns {addr: Block} of the held blocks."""
    held_by_region: dict = {}
    starts = [r.addr for r in st.regions]
    for h in st.held:
        k = bisect_right(starts, h.addr) - 1
        held_by_region.setdefault(k, []).append(h)
    live = {}
    expandable_done: set = set()
    for k, reg in enumerate(st.regions):
        pool = alloc.pool(reg.small, reg.pool_id)
        if reg.expandable:
            es = _expandable_for(alloc, st, reg, expandable_done)
            pieces = _carve(reg, held_by_region.get(k, []), pool, es, alloc)
        else:
            alloc.segments[reg.addr] = reg.size
            alloc._seg_starts = None
            pieces = _carve(reg, held_by_region.get(k, []), pool, None, alloc)
        for b, h in pieces:
            if h is not None:
                live[b.addr] = b
        alloc.reserved += reg.size
    for es in alloc.expandable.values():
        _link_expandable(alloc, es)
    alloc.peak_reserved = alloc.reserved
    alloc.peak_allocated = alloc.allocated
    return live


def _carve(reg: Region, held: list, pool, es, alloc: Allocator):
    """Blocks of one region: held ones where the state says, free blocks in the gaps."""
    out = []
    pos = reg.addr
    end = reg.addr + reg.size
    seg = es.base if es is not None else reg.addr
    for h in sorted(held, key=lambda h: h.addr):
        if h.addr > pos:
            out.append((Block(pos, h.addr - pos, reg.stream, pool, seg, es), None))
        z = max(min(h.size, end - h.addr), 0)
        if z == 0:
            continue
        b = Block(h.addr, z, h.stream, pool, seg, es)
        b.requested = h.requested
        if h.state == HELD:
            b.allocated = True
            alloc.allocated += z
        else:
            b.pending = True
        out.append((b, h))
        pos = h.addr + z
    if pos < end:
        out.append((Block(pos, end - pos, reg.stream, pool, seg, es), None))
    prev = None
    for b, h in out:
        alloc.blocks[b.addr] = b
        b.prev = prev
        if prev is not None:
            prev.next = b
        prev = b
        if h is None:
            pool.insert(b)
    return out


def _expandable_for(alloc: Allocator, st: InitialState, reg: Region, done: set):
    """The growing segment a mapped range belongs to: one per stream and pool; its start is taken as the
    lowest mapped address seen (the allocator maps a new growing segment from its start)."""
    for es in alloc.expandable.values():
        if es.stream == reg.stream and es.small == reg.small and es.base <= reg.addr < es.base + es.size:
            return es
    page = SMALL_BUFFER if reg.small else LARGE_BUFFER
    pages = expandable_pages(alloc.device.total_memory, page)
    from .core import ExpandableSegment

    es = ExpandableSegment(reg.addr, page, pages, reg.stream, reg.small)
    alloc.expandable[reg.addr] = es
    return es


def _link_expandable(alloc: Allocator, es):
    """Fill a growing segment's unmapped gaps with unmapped blocks and link its pieces in address order."""
    from bisect import insort

    inside = sorted((b for b in alloc.blocks.values() if b.es is es), key=lambda b: b.addr)
    pool = inside[0].pool if inside else alloc.pool(es.small)
    pieces, pos = [], es.base
    for b in inside:
        if b.addr > pos:
            pieces.append(Block(pos, b.addr - pos, es.stream, pool, es.base, es, mapped=False))
        pieces.append(b)
        pos = b.addr + b.size
        es.mapped.update(range((b.addr - es.base) // es.page, -(-(b.addr + b.size - es.base) // es.page)))
    if pos < es.base + es.size:
        pieces.append(Block(pos, es.base + es.size - pos, es.stream, pool, es.base, es, mapped=False))
    prev = None
    for b in pieces:
        alloc.blocks[b.addr] = b
        b.prev = prev
        b.next = None
        if prev is not None:
            prev.next = b
        prev = b
        if not b.mapped:
            insort(pool.unmapped, (b.stream, b.addr))
