"""Replay a device's trace: allocation lifetimes, allocated and reserved bytes over time.

Allocated memory changes at `alloc` (+size) and `free_completed` (−size), so
a block freed with `free_requested` still counts until its `free_completed`.
The state before the first entry is the final segments' live blocks that the
trace never touches (at their block size) plus what it frees without
allocating (allocations made before recording began, at the size the trace
gives), so the allocations table sums exactly to the curve at every entry. The *replay invariant*: the live set replayed to the
end equals the final segments' active blocks, block for block.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from ..model import (ALLOC, BLOCK_STATE, FREE_COMPLETED, NO_TIME, SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP,
                     SEGMENT_UNMAP, Trace, constant_column, isin_few, isin_ints, one_or_all)
from .memo import per_trace

LIVE_STATES = (BLOCK_STATE["active_allocated"], BLOCK_STATE["active_pending_free"])
TRACED, BEFORE_TRACE = 0, 1
ORIGINS = ("traced", "before_trace")


@dataclass
class Allocations:
    """One row per allocation lifetime on a device.

    alloc_index / free_index are positions in the device's trace: -1 means
    "before the trace began" / "still live at the end".
    """

    addr: np.ndarray  # uint64
    size: np.ndarray  # int64
    alloc_index: np.ndarray  # int64
    free_index: np.ndarray  # int64
    stack_id: np.ndarray  # int32: where it was allocated (-1 unknown)
    free_stack_id: np.ndarray  # int32: where it was freed (-1 none)
    origin: np.ndarray  # int8: TRACED or BEFORE_TRACE

    def __len__(self):
        return len(self.size)

    def live_at(self, index) -> np.ndarray:
        """Boolean mask of allocations live just after trace entry `index` (-1: before the first)."""
        born = self.alloc_index <= index
        alive = (self.free_index == -1) | (self.free_index > index)
        return born & alive


@dataclass
class Invariant:
    checked: bool  # False when the file has no final segments to check against
    ok: bool
    problems: list[tuple[int, int, str]] = field(default_factory=list)  # [(addr, size, what)] first few


def peak_of(curve, initial, ties_to_start: bool = False) -> tuple:
    """(peak, index of the entry after which the curve first reaches it; -1: the start, `initial`). A tie
    with the start counts as the start when `ties_to_start`. No curve (None): (None, -1)."""
    if curve is None:
        return None, -1
    if len(curve) == 0 or initial > curve.max() or (ties_to_start and initial >= curve.max()):
        return (int(initial) if initial is not None else None), -1
    i = int(np.argmax(curve))
    return int(curve[i]), i


@dataclass
class DeviceReplay:
    device: int
    events: slice  # this device's rows in trace.events
    allocated: np.ndarray  # int64: allocated bytes just after each entry
    reserved: np.ndarray | None  # int64 per entry, None when the file does not say
    initial_allocated: int
    initial_reserved: int | None
    allocations: Allocations
    invariant: Invariant
    unattributed_bytes: int  # live at start but not known as allocations (profiler traces)

    @property
    def n(self) -> int:
        return len(self.allocated)

    def _peak(self, curve, initial):
        """peak_of(curve, initial), remembered per curve: the report asks for the peak a few dozen times, and
        each is two passes over a 10M-entry curve."""
        if curve is None or len(curve) < 65536:
            return peak_of(curve, initial)
        name = "allocated" if curve is self.allocated else "reserved" if curve is self.reserved else None
        if name is None:
            return peak_of(curve, initial)
        # by name, not by id: stored with the replay (io/cache/memo.py), the figures stay true of its curves,
        # which are never changed once replayed
        memo = self.__dict__.setdefault("_peaks", {})
        key = (name, initial)
        if key not in memo:
            memo[key] = peak_of(curve, initial)
        return memo[key]

    @property
    def peak_allocated(self) -> int:
        return self._peak(self.allocated, self.initial_allocated)[0]

    @property
    def peak_index(self) -> int:
        """Trace entry after which allocated memory first reached its peak (-1: before the first)."""
        return self._peak(self.allocated, self.initial_allocated)[1]

    @property
    def peak_reserved(self) -> int | None:
        return self._peak(self.reserved, self.initial_reserved)[0]

    @property
    def peak_reserved_index(self) -> int:
        return self._peak(self.reserved, self.initial_reserved)[1]

    @property
    def final_allocated(self) -> int:
        return int(self.allocated[-1]) if self.n else self.initial_allocated

    @property
    def final_reserved(self) -> int | None:
        if self.reserved is None:
            return None
        return int(self.reserved[-1]) if self.n else self.initial_reserved

    def allocated_at(self, index) -> int:
        return self.initial_allocated if index < 0 else int(self.allocated[index])

    def reserved_at(self, index) -> int | None:
        if self.reserved is None:
            return None
        return self.initial_reserved if index < 0 else int(self.reserved[index])


@per_trace
def replay(trace: Trace) -> dict[int, DeviceReplay]:
    """Replay every device of the trace (computed once per trace object)."""
    return {d: replay_device(trace, d) for d in trace.devices}


def replay_device(trace: Trace, device: int) -> DeviceReplay:
    sl = trace.events.device_slice(device)
    ev = trace.events
    action, size, addr = ev.action[sl], ev.size[sl], ev.addr[sl]
    stack = ev.stack_id[sl]
    is_alloc, is_free = action == ALLOC, action == FREE_COMPLETED
    has_segments = trace.meta.get("has_segments", True)
    has_addresses = trace.meta.get("has_addresses", True)

    bmask = (trace.blocks.device == device) & np.isin(trace.blocks.state, LIVE_STATES)
    b_addr, b_size, b_stack = trace.blocks.addr[bmask], trace.blocks.size[bmask], trace.blocks.stack_id[bmask]
    b_requested = trace.blocks.requested_size[bmask]

    if has_addresses:
        allocs, last_addr, last_is_alloc, last_size = _lifetimes(addr, size, stack, is_alloc, is_free,
                                                                 (b_addr, b_size, b_stack))
    else:  # every live block was allocated before the trace
        allocs = _before_trace(_empty_allocations(), addr[:0], b_addr, b_size, b_stack)
        last_addr, last_is_alloc, last_size = addr[:0], is_alloc[:0], size[:0]
    live_at_start = int(allocs.size[allocs.alloc_index == -1].sum())
    if has_segments:
        invariant = _check(last_addr, last_is_alloc, last_size, b_addr, b_size, b_requested)
        initial_allocated = live_at_start
    else:
        invariant = Invariant(checked=False, ok=True)
        initial_allocated = int(trace.meta.get("initial_allocated", {}).get(device, live_at_start))
    allocated = _running_sum(size, is_alloc, is_free, initial_allocated)
    del is_alloc, is_free

    reserved, initial_reserved = _reserved(trace, device, action, size, has_segments)
    return DeviceReplay(device=device, events=sl, allocated=allocated, reserved=reserved,
                        initial_allocated=initial_allocated, initial_reserved=initial_reserved,
                        allocations=allocs, invariant=invariant,
                        unattributed_bytes=initial_allocated - live_at_start)


def _running_sum(size, up, down, initial) -> np.ndarray:
    """initial + the cumulative sum of +size where `up`, -size where `down` (disjoint masks), as int64 per entry:
    one pass of the compiled loop into the one array made (a 10M-entry trace makes no other per-entry int64
    temporaries), else numpy's three passes in place."""
    if _running_sum_compiled is not None and len(up):
        out = np.empty(len(up), np.int64)
        _running_sum_compiled(one_or_all(size, np.int64), np.ascontiguousarray(up, bool),
                              np.ascontiguousarray(down, bool), int(initial), out)
        return out
    out = np.where(up, size, 0).astype(np.int64, copy=False)
    np.subtract(out, size, out=out, where=down)
    np.cumsum(out, out=out)
    out += initial
    return out


try:  # the one-pass pairing and running sum (analysis/allocator/_replay.c), when it is built
    from .allocator._replay import pair_lifetimes as _pair_compiled
    from .allocator._replay import running_sum as _running_sum_compiled
except ImportError:  # pragma: no cover - no C compiler where it was installed
    _pair_compiled = None  # type: ignore[assignment]
    _running_sum_compiled = None  # type: ignore[assignment]


def _lifetimes(addr, size, stack, is_alloc, is_free, blocks=None):
    """Pair each alloc with the next entry of its address when that is a free_completed: the compiled pass, else
    the vectorised sort by address (_lifetimes_sorted). `blocks`: (addr, size, stack_id) of the final segments'
    live blocks, whose addresses no entry names are allocations made before the trace (appended, never freed).
    Returns the allocations in order of their first entry (then those blocks) and, per address in no particular
    order, its last entry's address, whether it was an alloc, and its size."""
    got = None
    if _pair_compiled is not None:
        extra = () if blocks is None else (np.ascontiguousarray(blocks[0], np.uint64),
                                           np.ascontiguousarray(blocks[1], np.int64),
                                           one_or_all(blocks[2], np.int32))
        got = _pair_compiled(np.ascontiguousarray(addr, np.uint64), one_or_all(size, np.int64),
                             one_or_all(stack, np.int32), np.ascontiguousarray(is_alloc, bool),
                             np.ascontiguousarray(is_free, bool), *extra)
    if got is None:
        rows, *last = _lifetimes_sorted(addr, size, stack, is_alloc, is_free)
        if blocks is not None:
            rows = _before_trace(rows, last[0], *blocks)
        return (rows, *last)
    cols = [np.frombuffer(b, t) for b, t in zip(got, (np.uint64, np.int64, np.int64, np.int64, np.int32, np.int32,
                                                      np.int8, np.uint64, bool, np.int64))]
    return Allocations(*cols[:7]), *cols[7:]


def _before_trace(rows: Allocations, last_addr, b_addr, b_size, b_stack) -> Allocations:
    """`rows` and, after them, the blocks live at the end whose address the trace never touches: allocated
    before it began (what the compiled pairing appends itself)."""
    untouched = ~isin_ints(b_addr, last_addr)
    k = int(untouched.sum())
    if not k:
        return rows
    return _concat(rows, Allocations(
        addr=b_addr[untouched], size=b_size[untouched], alloc_index=np.full(k, -1, np.int64),
        free_index=np.full(k, -1, np.int64), stack_id=b_stack[untouched], free_stack_id=np.full(k, -1, np.int32),
        origin=np.full(k, BEFORE_TRACE, np.int8)))


def _lifetimes_sorted(addr, size, stack, is_alloc, is_free):
    """Pair each alloc with the next free_completed of its address (vectorised: a stable sort by address)."""
    idx = np.flatnonzero(is_alloc | is_free)
    a, s, al = addr[idx], size[idx], is_alloc[idx]
    order = np.argsort(a, kind="stable")  # by address, then time (idx is ascending: a stable sort keeps it)
    idx = idx[order]  # one column at a time: each old one goes as its sorted copy comes
    a = a[order]
    s = s[order]
    al = al[order]
    del order
    same_next = np.zeros(len(idx), bool)
    same_next[:-1] = a[:-1] == a[1:]
    paired = same_next & al & np.roll(~al, -1)  # an alloc followed by a free of the same address
    paired_free = np.roll(paired, 1)
    lone_alloc = al & ~paired
    lone_free = ~al & ~paired_free
    last = ~same_next  # last event at each address

    pi, li, fi = idx[paired], idx[lone_alloc], idx[lone_free]
    rows = Allocations(
        addr=np.concatenate([a[paired], a[lone_alloc], a[lone_free]]),
        size=np.concatenate([s[paired], s[lone_alloc], s[lone_free]]),
        alloc_index=np.concatenate([pi, li, np.full(len(fi), -1)]).astype(np.int64),
        free_index=np.concatenate([idx[paired_free], np.full(len(li), -1), fi]).astype(np.int64),
        stack_id=np.concatenate([stack[pi], stack[li], np.full(len(fi), -1, np.int32)]).astype(np.int32),
        free_stack_id=np.concatenate([stack[idx[paired_free]], np.full(len(li), -1, np.int32), stack[fi]]).astype(np.int32),
        origin=np.concatenate([np.zeros(len(pi) + len(li), np.int8), np.full(len(fi), BEFORE_TRACE, np.int8)]),
    )
    order = _order_of_distinct(np.where(rows.alloc_index < 0, rows.free_index, rows.alloc_index),
                               len(addr))
    for k in Allocations.__dataclass_fields__:  # one column at a time, as above
        setattr(rows, k, getattr(rows, k)[order])
    return rows, a[last], al[last], s[last]


def _order_of_distinct(key: np.ndarray, bound: int) -> np.ndarray:
    """argsort of distinct integers in [0, bound), in linear time (each entry index is one row's key)."""
    dtype = np.int32 if bound < 2**31 else np.int64  # positions: half the memory below 2**31 entries
    slot = np.full(bound, -1, dtype)
    slot[key] = np.arange(len(key), dtype=dtype)
    return slot[slot >= 0]


def _empty_allocations():
    z = np.zeros(0, np.int64)
    return Allocations(addr=z.astype(np.uint64), size=z, alloc_index=z, free_index=z,
                       stack_id=z.astype(np.int32), free_stack_id=z.astype(np.int32), origin=z.astype(np.int8))


def _concat(a: Allocations, b: Allocations) -> Allocations:
    return Allocations(**{k: np.concatenate([getattr(a, k), getattr(b, k)]) for k in Allocations.__dataclass_fields__})


def _check(last_addr, last_is_alloc, last_size, b_addr, b_size, b_requested) -> Invariant:
    """Compare the replayed end state with the final segments' live blocks.

    Trace entries record the requested size (newer torch) or the block size
    (older), so a live allocation matches a block of the same address with
    either size. Vectorised: each address's block by a binary search among the
    blocks sorted by address (of blocks that share an address, the last one, as
    a dict of them keeps it); the first 20 problems by address.
    """
    last_addr, b_addr = np.asarray(last_addr, np.uint64), np.asarray(b_addr, np.uint64)
    alive = np.asarray(last_is_alloc, bool)
    found = np.zeros(len(last_addr), bool)
    block_of = {}  # address (its position in last_addr) -> its final block, for the few that have one
    bad_found = np.zeros(0, np.intp)
    if len(b_addr) and len(last_addr):
        order = np.argsort(b_addr, kind="stable")
        sorted_addr = b_addr[order]
        keep = np.ones(len(order), bool)
        keep[:-1] = sorted_addr[:-1] != sorted_addr[1:]  # the last of each run of one address
        order, sorted_addr = order[keep], sorted_addr[keep]
        pos = np.searchsorted(sorted_addr, last_addr)
        np.minimum(pos, len(sorted_addr) - 1, out=pos)
        found = sorted_addr[pos] == last_addr
        hit = np.flatnonzero(found)  # at most one address per block
        blk = order[pos[hit]]
        size = last_size[hit]
        wrong_size = alive[hit] & (size != b_size[blk]) & (size != b_requested[blk])
        bad_found = hit[wrong_size | ~alive[hit]]
        block_of = dict(zip(hit.tolist(), blk.tolist()))
    bad = np.concatenate([np.flatnonzero(alive & ~found), bad_found])
    bad = bad[np.argsort(last_addr[bad], kind="stable")[:20]]
    problems = []
    for i in bad.tolist():
        addr, size = int(last_addr[i]), int(last_size[i])
        if i not in block_of:
            problems.append((addr, size, "allocated in the trace and never freed, but not live in the final segments"))
        elif not alive[i]:
            problems.append((addr, int(b_size[block_of[i]]),
                             "freed in the trace and never reallocated, but live in the final segments"))
        else:
            problems.append((addr, size, f"live at the end with size {size}, but the final block has size "
                                         f"{int(b_size[block_of[i]])}"))
    return Invariant(checked=True, ok=not problems, problems=problems)


def _reserved(trace, device, action, size, has_segments):
    """(reserved bytes after each entry, before the first). It changes only at the few segment entries: the
    curve is made from those, one level per run of entries between them, and is a constant column (no memory)
    when it holds one value throughout (a trace that reserves nothing new: a warmed-up step)."""
    at = np.flatnonzero(isin_few(action, (SEGMENT_ALLOC, SEGMENT_MAP, SEGMENT_FREE, SEGMENT_UNMAP)))
    grow = isin_few(action[at], (SEGMENT_ALLOC, SEGMENT_MAP))
    change = np.where(grow, size[at], -size[at]).astype(np.int64, copy=False)
    if has_segments:
        final = int(trace.segments.total_size[trace.segments.device == device].sum())
        # what the segment entries add up to, from the few entries that change it
        initial = final - (int(size[at][grow].sum()) - int(size[at][~grow].sum()))
    else:
        initial = trace.meta.get("initial_reserved", {}).get(device)
        if initial is None:
            return None, None
        initial = int(initial)
    n = len(action)
    levels = np.cumsum(np.concatenate([np.array([initial], np.int64), change]))  # before the first, after each
    runs = np.diff(np.concatenate([[0], at, [n]]))  # entries at each level: up to the first change, from each
    levels = levels[runs > 0]
    if n > 1 and (levels == levels[0]).all():
        return constant_column(levels[0], n, np.int64), initial
    return np.repeat(levels, runs[runs > 0]), initial


MIN_BLOCK = 512  # the caching allocator rounds every request up to a multiple of this
ROUND_LARGE = 2 << 20  # requests of 10 MiB and more get a segment rounded up to this...
MIN_LARGE_ALLOC = 10 << 20
SMALL_SIZE = 1 << 20  # ...whose remainder is not split off when it is no larger than this


def block_size(requested):
    """The block the CUDA caching allocator hands out for a request (array or int), in its usual case.

    Every request is rounded up to 512 bytes; one of 10 MiB or more that gets
    a segment of its own takes the whole segment (rounded up to 2 MiB), as the
    remainder under 1 MiB is not split off. A request served from a larger
    cached block may get less than that; blocks in the final segments give the
    exact figure.
    """
    r = np.maximum(np.asarray(requested, np.int64), 1)
    b = -(-r // MIN_BLOCK) * MIN_BLOCK
    big = -(-r // ROUND_LARGE) * ROUND_LARGE
    return np.where((r >= MIN_LARGE_ALLOC) & (big - b <= SMALL_SIZE), big, b)


@dataclass
class AllocatorBytes:
    """A device's allocated bytes in the allocator's sense (block sizes, as torch.cuda.memory_allocated counts)."""

    sizes: np.ndarray  # int64 per allocation: its block size
    curve: np.ndarray  # int64 per entry
    initial: int

    @property
    def peak(self) -> int:
        return int(max(self.initial, self.curve.max())) if len(self.curve) else self.initial

    @property
    def final(self) -> int:
        return int(self.curve[-1]) if len(self.curve) else self.initial


def allocator_bytes(trace: Trace, rep: DeviceReplay) -> AllocatorBytes:
    """Block sizes: exact for blocks in the final segments, traced requests rounded as the allocator rounds them.

    The end state equals the final segments' active bytes whenever the replay invariant holds."""
    al = rep.allocations
    sizes = block_size(al.size) if len(al) else al.size.copy()
    bmask = (trace.blocks.device == rep.device) & np.isin(trace.blocks.state, LIVE_STATES)
    final = dict(zip(trace.blocks.addr[bmask].tolist(), trace.blocks.size[bmask].tolist()))
    live_end = np.flatnonzero(al.free_index < 0)
    for r in live_end.tolist():
        b = final.get(int(al.addr[r]))
        if b is not None:
            sizes[r] = b
    delta = np.zeros(rep.n + 1, np.int64)
    traced, freed = al.alloc_index >= 0, al.free_index >= 0
    np.add.at(delta, al.alloc_index[traced], sizes[traced])
    np.add.at(delta, al.free_index[freed], -sizes[freed])
    initial = int(sizes[~traced].sum()) + (rep.initial_allocated - int(al.size[~traced].sum()))
    return AllocatorBytes(sizes=sizes, curve=initial + np.cumsum(delta[:-1]), initial=initial)


def time_of(trace: Trace, rep: DeviceReplay, index: int) -> int | None:
    """time_us of a device's trace entry, or None when the file has no times."""
    if index < 0 or index >= rep.n:
        return None
    t = int(trace.events.time_us[rep.events][index])
    return None if t == NO_TIME else t
