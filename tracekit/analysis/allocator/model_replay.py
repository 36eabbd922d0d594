"""Replay a device's trace through the allocator model, checked entry by entry against the file: the Python loop,
the reference the compiled one (compiled.py, _replay.c) is checked against; both are exact.

Starting from the state at the trace's first entry (state.py), each `alloc` is served
by the model's best fit and compared with the address the allocator really gave; a new
segment is taken from the trace's own segment_alloc (its address is CUDA's choice, not
the allocator's) and checked for size; segment_free / unmap entries give memory back
where the trace says (empty_cache, or the allocator's own retries). Where the model
and the file disagree the replay follows the file (the block at the recorded address)
and counts the entry as not placed. What comes out:

- allocated bytes after every entry as torch.cuda.memory_allocated counts them: blocks,
  not requests, dropping at free_requested (a block used on other streams stays out of
  the cache until its free_completed, but no longer counts);
- reserved bytes after every entry (segments and mapped pages);
- the block each allocation got, and whether the replayed end state equals the file's
  final segments block for block.
"""
from __future__ import annotations

from bisect import insort
from dataclasses import dataclass, field

import numpy as np

from ...model import (ALLOC, FREE_COMPLETED, FREE_REQUESTED, OOM, SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP,
                      SEGMENT_UNMAP, Trace)
from ..replay import peak_of
from .config import (DEFAULT_TOTAL_MEMORY, LARGE_BUFFER, SMALL_BUFFER, SMALL_SIZE, AllocatorConfig, expandable_pages,
                     from_settings)
from .core import Allocator, Block, Device, _remove_sorted
from .state import InitialState, initial_state, load


# why an entry could not be followed (the compiled loop counts the first ones in this order: _replay.REASONS)
REASONS = (
    "a new segment where the model had a cached block",
    "segment of another size than the model asks for",
    "request not at its new segment",
    "best fit differs from the recorded address",
    "no cached block in the model where the allocator found one",
    "address outside the known free memory",
    "recorded block smaller than the request",
    "allocated twice without a free",
    "free of an address not allocated",
    "free_completed without free_requested",
    "segment_free of a segment that is not free in the model",
    "out of memory where the model had a cached block",
    "segment_map of pages the model has mapped",
    "segment_unmap of pages that are not free in the model",
)


@dataclass
class AllocatorReplay:
    device: int
    config: AllocatorConfig
    allocated: np.ndarray  # int64 per entry: block bytes allocated after it
    reserved: np.ndarray  # int64 per entry
    initial_allocated: int
    initial_reserved: int
    # the block each alloc entry got, kept for the entries that got one (of a 10M-entry trace, a third): their
    # positions in the device's trace, ascending (int32 below 2**31 entries), and the block sizes (int64);
    # `block_size` is the whole per-entry column, made when asked for
    block_entries: np.ndarray
    block_sizes: np.ndarray
    placed: int  # alloc entries served where the allocator served them
    unplaced: dict[str, int]  # entries the model could not follow, by reason: count
    open_bytes: int  # allocated figures may be up to this much higher (pre-trace block sizes not determined)
    final_mismatch: int  # final blocks the replayed state does not reproduce (-1: not checked)
    initial: InitialState = field(default_factory=InitialState)
    notes: list[str] = field(default_factory=list)
    unplaced_slack: int = 0  # how much larger the blocks of allocations it could not place may be
    engine: str = "python"

    @property
    def block_size(self) -> np.ndarray:
        """int64 per entry: the block an alloc entry got (0 for other entries)."""
        out = np.zeros(len(self.allocated), np.int64)
        out[self.block_entries] = self.block_sizes
        return out

    def block_size_at(self, entries) -> np.ndarray:
        """block_size[entries] (int64), without making the whole column."""
        entries = np.asarray(entries)
        pos = np.searchsorted(self.block_entries, entries)
        out = np.zeros(entries.shape, np.int64)
        if len(self.block_entries):
            pos = np.minimum(pos, len(self.block_entries) - 1)
            hit = self.block_entries[pos] == entries
            out[hit] = self.block_sizes[pos[hit]]
        return out

    @property
    def unplaced_events(self) -> int:
        return sum(self.unplaced.values())

    @property
    def exact(self) -> bool:
        return (self.unplaced_events == 0 and self.open_bytes == 0 and self.final_mismatch == 0
                and not self.initial.problems)

    def _peak(self, curve, initial):
        return peak_of(curve, initial, ties_to_start=True)

    @property
    def peak_allocated(self) -> int:
        return self._peak(self.allocated, self.initial_allocated)[0]

    @property
    def peak_index(self) -> int:
        return self._peak(self.allocated, self.initial_allocated)[1]

    @property
    def peak_reserved(self) -> int:
        return self._peak(self.reserved, self.initial_reserved)[0]

    @property
    def peak_reserved_index(self) -> int:
        return self._peak(self.reserved, self.initial_reserved)[1]

    @property
    def final_allocated(self) -> int:
        return int(self.allocated[-1]) if len(self.allocated) else self.initial_allocated

    peak = peak_allocated  # the names replay.AllocatorBytes uses
    final = final_allocated

    def allocated_at(self, i) -> int:
        return self.initial_allocated if i < 0 else int(self.allocated[i])

    def reserved_at(self, i) -> int:
        return self.initial_reserved if i < 0 else int(self.reserved[i])


def sparse_blocks(block_size: np.ndarray) -> dict:
    """AllocatorReplay's block_entries and block_sizes from a per-entry column of block sizes."""
    n = len(block_size)
    k = int(np.count_nonzero(block_size))
    entries, sizes = np.empty(k, np.int32 if n < 2**31 else np.int64), np.empty(k, np.int64)
    at = 0
    for lo in range(0, n, SPARSE_CHUNK):  # a chunk at a time: no int64 index per block entry beside them
        part = block_size[lo:lo + SPARSE_CHUNK]
        nz = np.flatnonzero(part)
        entries[at:at + len(nz)] = nz + lo
        sizes[at:at + len(nz)] = part[nz]
        at += len(nz)
    return {"block_entries": entries, "block_sizes": sizes}


SPARSE_CHUNK = 1 << 20


def settings_of(trace: Trace) -> tuple[AllocatorConfig, list]:
    return from_settings(trace.meta.get("allocator_settings"))


def total_memory(trace: Trace, device: int) -> int:
    for d in (trace.recorder or {}).get("devices") or []:
        if isinstance(d, dict) and d.get("index") == device and isinstance(d.get("total_memory"), int):
            return d["total_memory"]
    return DEFAULT_TOTAL_MEMORY


def replay_device_in_python(trace: Trace, device: int, config: AllocatorConfig | None = None,
                            stop_after: int | None = None, keep=False):
    """Replay one device in Python (compiled.replay_device picks the compiled loop when it can).
    `stop_after`: stop after that entry and also return the Allocator (for views of the state there);
    `keep`: return the Allocator at the end as well."""
    notes: list = []
    if config is None:
        config, notes = settings_of(trace)
    init = initial_state(trace, device, config)
    alloc = Allocator(config, Device(total_memory=total_memory(trace, device)))
    live = load(alloc, init)
    ev = trace.events
    sl = ev.device_slice(device)
    action = ev.action[sl].tolist()
    addr = ev.addr[sl].tolist()
    size = ev.size[sl].tolist()
    stream = ev.stream[sl].tolist()
    n = len(action) if stop_after is None else min(len(action), stop_after + 1)
    allocated = np.zeros(n, np.int64)
    reserved = np.zeros(n, np.int64)
    block_size = np.zeros(n, np.int64)
    unplaced: dict = {}
    fresh: dict = {}  # stream -> [(addr, size)] segments created for the next request on that stream
    mapped_for = set()  # streams whose next request was served by newly mapped pages
    placed = slack = 0
    round_size = config.round_size
    get_free_block = alloc.get_free_block
    pools = {True: alloc.pool(True), False: alloc.pool(False)}
    init_alloc, init_res = alloc.allocated, alloc.reserved

    def miss(kind):
        unplaced[kind] = unplaced.get(kind, 0) + 1

    for i in range(n):
        a = action[i]
        if a == ALLOC:
            p, r, s = addr[i], size[i], stream[i]
            sz = round_size(r)
            pool = pools[sz <= SMALL_SIZE]
            b = None
            segs = fresh.get(s)
            if segs:
                seg_addr, seg_size = segs.pop(0)
                if get_free_block(pool, sz, s, take=False) is not None:
                    miss("a new segment where the model had a cached block")
                nb = alloc.add_segment(seg_addr, seg_size, s, pool, counted=False)
                if seg_size != alloc.allocation_size(sz) and not config.expandable_segments:
                    miss("segment of another size than the model asks for")
                if seg_addr == p:
                    b = nb
                    placed += 1
                else:
                    pool.insert(nb)
                    miss("request not at its new segment")
            elif s in mapped_for:
                mapped_for.discard(s)
                b = _at(alloc, p)
                if b is not None:
                    pool.remove(b)
                    placed += 1
            else:
                c = get_free_block(pool, sz, s, take=False)
                if c is not None and c.addr == p:
                    pool.remove(c)
                    b = c
                    placed += 1
                else:
                    miss("best fit differs from the recorded address" if c is not None
                         else "no cached block in the model where the allocator found one")
            if b is None:
                slack += 0 if sz <= SMALL_SIZE else (config.max_non_split_rounding if sz >= config.max_split_size
                                                     else SMALL_SIZE)
                b = _resync(alloc, p, sz, pool)
                if b is None:
                    miss("address outside the known free memory")
                    b = _phantom(alloc, p, sz, s, pool)
                    live[p] = b
                    block_size[i] = b.size
                    allocated[i], reserved[i] = alloc.allocated, alloc.reserved
                    continue
            if b.size < sz:
                miss("recorded block smaller than the request")
                sz = b.size
            alloc.alloc_found_block(b, sz, r)
            old = live.get(p)
            if old is not None and (old.allocated or old.pending):
                miss("allocated twice without a free")
            live[p] = b
            block_size[i] = b.size
        elif a == FREE_REQUESTED:
            b = live.get(addr[i])
            if b is None or not b.allocated:
                miss("free of an address not allocated")
            else:
                alloc.free(b, completed=False)
        elif a == FREE_COMPLETED:
            b = live.pop(addr[i], None)
            if b is None:
                miss("free of an address not allocated")
            elif b.seg is None:  # a phantom: nothing to give back
                if b.allocated:
                    alloc.allocated -= b.size
            elif b.allocated:  # free_completed without its free_requested (entries lost)
                miss("free_completed without free_requested")
                alloc.free(b, completed=True)
            else:
                alloc.complete_free(b)
        elif a == SEGMENT_ALLOC:
            fresh.setdefault(stream[i], []).append((addr[i], size[i]))
            alloc._grow(size[i])  # counted now; the block is made when its request comes
        elif a == SEGMENT_FREE:
            _flush(alloc, fresh, stream[i])
            if not _release(alloc, addr[i], size[i], live):
                miss("segment_free of a segment that is not free in the model")
        elif a == SEGMENT_MAP:
            if not _map(alloc, addr[i], size[i], stream[i]):
                miss("segment_map of pages the model has mapped")
            mapped_for.add(stream[i])
        elif a == SEGMENT_UNMAP:
            if not _unmap(alloc, addr[i], size[i]):
                miss("segment_unmap of pages that are not free in the model")
        elif a == OOM:
            # the allocator looks for a cached block before it waits for frees in flight or gives memory
            # back (entries just before this one), and not again after
            sz = size[i]
            k = i - 1
            while k >= 0 and action[k] in (FREE_COMPLETED, SEGMENT_FREE, SEGMENT_UNMAP):
                k -= 1
            if k == i - 1 and get_free_block(pools[sz <= SMALL_SIZE], sz, stream[i], take=False) is not None:
                miss("out of memory where the model had a cached block")
        allocated[i] = alloc.allocated
        reserved[i] = alloc.reserved
    for s in list(fresh):
        _flush(alloc, fresh, s)
    mismatch = -1
    if stop_after is None and trace.meta.get("has_segments", True):
        mismatch = _compare_final(trace, device, alloc)
    res = AllocatorReplay(device=device, config=config, allocated=allocated, reserved=reserved,
                          initial_allocated=init_alloc, initial_reserved=init_res, **sparse_blocks(block_size),
                          placed=placed, unplaced=unplaced, open_bytes=init.open_bytes, final_mismatch=mismatch,
                          initial=init, notes=notes, unplaced_slack=slack)
    return (res, alloc) if (stop_after is not None or keep) else res


def _flush(alloc, fresh, stream):
    """Segments made for a request that never came (the trace lost it): cache them as free."""
    for seg_addr, seg_size in fresh.pop(stream, []):
        pool = alloc.pool(seg_size == SMALL_BUFFER)
        pool.insert(alloc.add_segment(seg_addr, seg_size, stream, pool, counted=False))


def _at(alloc: Allocator, addr) -> Block | None:
    b = alloc.blocks.get(addr)
    return b if b is not None and b.free and b.mapped else None


def _resync(alloc: Allocator, addr, size, pool) -> Block | None:
    """Follow the file: the free memory at `addr` (split off the front of a free block if it starts there)."""
    b = alloc.block_at(addr)
    if b is None or not b.free or not b.mapped or b.addr + b.size < addr + size:
        return None
    b.pool.remove(b)
    if b.addr < addr:
        head, b = b, alloc.splice(b, addr - b.addr)
        head.pool.insert(head)
    return b


def _phantom(alloc: Allocator, addr, size, stream, pool) -> Block:
    """A block the model cannot place: counted as allocated at its rounded size, in no segment."""
    b = Block(addr, size, stream, pool, None)
    b.allocated = True
    alloc.allocated += size
    if alloc.allocated > alloc.peak_allocated:
        alloc.peak_allocated = alloc.allocated
    return b


def _release(alloc: Allocator, addr, size, live) -> bool:
    b = alloc.blocks.get(addr)
    if b is not None and b.free and b.prev is None and b.next is None and b.size == size and b.es is None:
        alloc.release_block(b)
        return True
    # the model disagrees: drop whatever it holds there, so the replay follows the file
    start = alloc.segment_of(addr)
    if start is not None:
        c = alloc.blocks.get(start)
        while c is not None:
            nxt = c.next
            if c.free:
                c.pool.remove(c)
            elif c.allocated:
                alloc.allocated -= c.size
                c.allocated = False
            for k in [k for k, v in live.items() if v is c]:
                del live[k]
            alloc.blocks.pop(c.addr, None)
            c = nxt
        alloc.reserved -= alloc.segments.pop(start)
        alloc._seg_starts = None
    else:
        alloc.reserved -= size
    return False


def _map(alloc: Allocator, addr, size, stream) -> bool:
    """Map [addr, addr + size) as the trace says; a growing segment starts at its first mapped page."""
    b = alloc.blocks.get(addr)
    if b is None or b.mapped or b.es is None:
        es = next((e for e in alloc.expandable.values() if e.base <= addr < e.base + e.size), None)
        if es is None:
            page = SMALL_BUFFER if size % LARGE_BUFFER else LARGE_BUFFER
            pages = expandable_pages(alloc.device.total_memory, page)
            b = alloc.add_expandable(addr, page, pages, stream, alloc.pool(page == SMALL_BUFFER))
        else:
            b = alloc.block_at(addr)
            if b is None or b.mapped:
                alloc._grow(size)
                return False
            if b.addr < addr:  # split the unmapped block so the mapping starts where the trace says
                _remove_sorted(b.pool.unmapped, (b.stream, b.addr))
                head, b = b, alloc.splice(b, addr - b.addr)
                insort(b.pool.unmapped, (head.stream, head.addr))
                insort(b.pool.unmapped, (b.stream, b.addr))
    ok = b.size >= size
    if alloc.map_block(b, min(size, b.size)) is None:
        alloc._grow(size)
        return False
    return ok


def _unmap(alloc: Allocator, addr, size) -> bool:
    b = alloc.block_at(addr)
    if b is None or not b.free or not b.mapped or b.es is None or b.addr + b.size < addr + size:
        alloc.reserved -= size
        return False
    got = alloc.unmap_block(b)
    return got is not None and got.addr <= addr and addr + size <= got.addr + got.size


def _compare_final(trace: Trace, device: int, alloc: Allocator) -> int:
    got = {}
    for seg in alloc.snapshot():
        for b in seg["blocks"]:
            got[b["address"]] = (b["size"], b["state"])
    return compare_final(trace, device, got, bool(alloc.segments or alloc.expandable))


def compare_final(trace: Trace, device: int, got: dict, had_segments: bool) -> int:
    """Blocks of the file's final segments that the replayed state does not have, by (address, size, state),
    plus replayed blocks the file does not have; -1 when the file has no blocks to compare with."""
    blk = trace.blocks
    m = blk.device == device
    if not m.any():
        return 0 if not had_segments else -1
    from ...model import BLOCK_STATES

    want = {}
    for a, z, st in zip(blk.addr[m].tolist(), blk.size[m].tolist(), blk.state[m].tolist()):
        name = BLOCK_STATES[st]
        want[int(a)] = (int(z), "inactive" if name == "unknown" else name)
    return sum(1 for a, v in want.items() if got.get(a) != v) + sum(1 for a in got if a not in want)
