"""A model of PyTorch's native CUDA caching allocator (one device): segments, blocks, pools.

It makes the allocator's decisions the way c10/cuda/CUDACachingAllocator.cpp makes
them (torch 2.0 to 2.11; docs/allocator.md lists the rules and where each comes from):

- a request is rounded (`AllocatorConfig.round_size`) and goes to the small pool
  (<= 1 MiB) or the large pool; each pool keeps its free blocks ordered by
  (stream, size, address) and hands out the first one of the same stream that is
  at least as large (best fit), never an oversize block (>= max_split_size) to a
  smaller request, nor one `max_non_split_rounding` or more bigger to an oversize one;
- the block is split when the remainder is worth keeping (small pool or
  expandable segments: >= 512 B; large pool: > 1 MiB, and only below max_split_size);
- with no fitting block it asks the device for a segment: 2 MiB for the small pool,
  20 MiB for requests under 10 MiB, else the request rounded up to 2 MiB
  (expandable segments instead map 2 MiB / 20 MiB pages at the lowest free address
  of one growing segment per stream and pool); when that fails it frees cached
  oversize blocks (max_split_size set), then every unsplit cached block, retrying
  after each, and only then reports out of memory;
- a freed block merges with free neighbours of its segment; a block used on other
  streams (record_stream) is only reusable after its free completes;
- with garbage_collection_threshold and a per-process memory fraction, cached
  unsplit blocks are freed oldest first before a new segment would pass the threshold.

Addresses come from a `Device`: real ones replayed from a trace, or made up for a
what-if. No torch, no CUDA: plain Python over integers.
"""
from __future__ import annotations

from bisect import bisect_left, insort

from .config import (DEFAULT, DEFAULT_TOTAL_MEMORY, LARGE_BUFFER, MIN_BLOCK, MIN_LARGE_ALLOC, NO_LIMIT, ROUND_LARGE,
                     SMALL_BUFFER, SMALL_SIZE, AllocatorConfig, expandable_pages)


class Block:
    __slots__ = ("addr", "size", "stream", "pool", "prev", "next", "allocated", "pending", "mapped", "es",
                 "requested", "gc_base", "seg")

    def __init__(self, addr, size, stream, pool, seg, es=None, mapped=True):
        self.addr = addr
        self.size = size
        self.stream = stream
        self.pool = pool
        self.prev = None
        self.next = None
        self.allocated = False  # handed out and not yet freed
        self.pending = False  # freed, waiting for other streams' events (free_requested, no free_completed yet)
        self.mapped = mapped
        self.es = es  # the ExpandableSegment it lies in, or None
        self.requested = 0
        self.gc_base = 0
        self.seg = seg  # start address of its segment (cudaMalloc'ed) or of its expandable segment

    @property
    def free(self) -> bool:
        return not self.allocated and not self.pending

    def is_split(self) -> bool:
        return self.prev is not None or self.next is not None

    def __repr__(self):
        state = "allocated" if self.allocated else "pending" if self.pending else "free" if self.mapped else "unmapped"
        return f"Block({self.addr:#x}, {self.size}, {state})"


class Pool:
    """Free (mapped) blocks by (stream, size, address), unmapped expandable blocks by (stream, address)."""

    __slots__ = ("small", "pool_id", "keys", "unmapped", "calls")

    def __init__(self, small: bool, pool_id=""):
        self.small = small
        self.pool_id = pool_id
        self.keys: list = []  # sorted [(stream, size, addr)]
        self.unmapped: list = []  # sorted [(stream, addr)]
        self.calls = 0  # get_free_block calls (garbage collection ages blocks by them)

    def insert(self, b: Block):
        b.gc_base = self.calls
        insort(self.keys, (b.stream, b.size, b.addr))

    def remove(self, b: Block):
        k = (b.stream, b.size, b.addr)
        i = bisect_left(self.keys, k)
        if i < len(self.keys) and self.keys[i] == k:
            del self.keys[i]
            return True
        return False


class ExpandableSegment:
    """One growing segment: a range of addresses of which whole pages are mapped."""

    __slots__ = ("base", "page", "pages", "mapped", "stream", "small")

    def __init__(self, base, page, pages, stream, small):
        self.base = base
        self.page = page
        self.pages = pages  # how many pages the address range holds
        self.mapped = set()  # page numbers mapped
        self.stream = stream
        self.small = small

    @property
    def size(self):
        return self.page * self.pages


class OutOfMemory(Exception):
    """The request could not be served (the allocator would raise torch.OutOfMemoryError)."""


class Device:
    """What the allocator asks CUDA for: segments (addresses), pages, and whether memory is left.

    `capacity`: bytes this process may hold reserved (None: no limit); `addresses(size, stream,
    small, expandable)` gives the address of a new segment (default: fresh ones, 2 MiB aligned)."""

    def __init__(self, capacity=None, total_memory=DEFAULT_TOTAL_MEMORY, addresses=None):
        self.capacity = capacity
        self.total_memory = total_memory
        self._next = 1 << 44
        self.addresses = addresses

    def new_address(self, size, stream, small, expandable):
        if self.addresses is not None:
            a = self.addresses(size, stream, small, expandable)
            if a is not None:
                return a
        a = self._next
        self._next += -(-(size + ROUND_LARGE) // ROUND_LARGE) * ROUND_LARGE
        return a

    def fits(self, reserved, size) -> bool:
        return self.capacity is None or reserved + size <= self.capacity


class Allocator:
    """One device's caching allocator. Events it makes go to `self.log` as (action, addr, size, stream)
    when `log` is a list: "segment_alloc", "segment_free", "segment_map", "segment_unmap", "oom"."""

    def __init__(self, config: AllocatorConfig = DEFAULT, device: Device | None = None,
                 memory_fraction_bytes=None, log=None):
        self.config = config
        self.device = device or Device()
        self.allowed = memory_fraction_bytes  # set_per_process_memory_fraction(f) * total, or None
        self.pools: dict = {}
        self.blocks: dict = {}  # addr -> Block (every block: allocated, pending, free, unmapped)
        self.segments: dict = {}  # start -> size of cudaMalloc'ed segments
        self.expandable: dict = {}  # base -> ExpandableSegment
        self.allocated = 0  # bytes in allocated blocks (torch.cuda.memory_allocated)
        self.reserved = 0  # bytes in segments and mapped pages (torch.cuda.memory_reserved)
        self.peak_allocated = 0
        self.peak_reserved = 0
        self.log = log
        self.retries = 0
        self.ooms = 0
        self._seg_starts: list[int] | None = None  # sorted segment starts, rebuilt when segments change

    # ---- pools and sizes -------------------------------------------------------------------------

    def pool(self, small: bool, pool_id="") -> Pool:
        key = (pool_id, small)
        p = self.pools.get(key)
        if p is None:
            p = self.pools[key] = Pool(small, pool_id)
        return p

    @staticmethod
    def allocation_size(size: int) -> int:
        """The segment cudaMalloc is asked for when no cached block fits a request of `size` (rounded)."""
        if size <= SMALL_SIZE:
            return SMALL_BUFFER
        if size < MIN_LARGE_ALLOC:
            return LARGE_BUFFER
        return -(-size // ROUND_LARGE) * ROUND_LARGE

    def should_split(self, block: Block, size: int) -> bool:
        remaining = block.size - size
        if block.pool.small or self.config.expandable_segments:
            return remaining >= MIN_BLOCK
        return size < self.config.max_split_size and remaining > SMALL_SIZE

    def _note(self, action, addr, size, stream):
        if self.log is not None:
            self.log.append((action, addr, size, stream))

    def _grow(self, n):
        self.reserved += n
        if self.reserved > self.peak_reserved:
            self.peak_reserved = self.reserved

    # ---- best fit ----------------------------------------------------------------------------------

    def get_free_block(self, pool: Pool, size: int, stream, take=True) -> Block | None:
        """The cached block this request gets (best fit), removed from the pool if `take`."""
        cfg = self.config
        if self.allowed is not None and cfg.garbage_collection_threshold > 0:
            pool.calls += 1
        keys = pool.keys
        i = bisect_left(keys, (stream, size, -1))
        n = len(keys)
        if i == n or keys[i][0] != stream:
            return None
        b = self.blocks[keys[i][2]]
        if b.es is not None:
            if cfg.expandable_segments:
                # a block at the end of a growing segment counts as the size it can grow to
                j = i + 1
                while b.es is not None and j < n and keys[j][0] == stream:
                    c = self.blocks[keys[j][2]]
                    if _grows_to(c) < _grows_to(b):
                        b, i = c, j
                        j += 1
                    else:
                        break
            else:  # expandable segments turned off: only ordinary blocks
                i += 1
                while i < n and keys[i][0] == stream and self.blocks[keys[i][2]].es is not None:
                    i += 1
                if i == n or keys[i][0] != stream:
                    return None
                b = self.blocks[keys[i][2]]
        mss = cfg.max_split_size
        if size < mss and b.size >= mss:
            return None  # no oversize block for a smaller request
        if size >= mss and b.size >= size + cfg.max_non_split_rounding:
            return None  # an oversize request may round up only so far
        if take:
            del keys[i]
        return b

    # ---- malloc / free -----------------------------------------------------------------------------

    def malloc(self, orig_size: int, stream=0, pool_id="") -> Block:
        """Serve a request of `orig_size` bytes on `stream`; OutOfMemory when the allocator would raise."""
        size = self.config.round_size(orig_size)
        pool = self.pool(size <= SMALL_SIZE, pool_id)
        alloc_size = self.allocation_size(size)
        block = self.get_free_block(pool, size, stream)
        if block is None:
            if self.allowed is not None and self.config.garbage_collection_threshold > 0:
                self.garbage_collect_cached_blocks()
            block = self.alloc_block(pool, size, alloc_size, stream)
            if block is None and self.release_available_cached_blocks(pool, size, stream):
                block = self.alloc_block(pool, size, alloc_size, stream)
            if block is None:
                self.release_cached()
                self.retries += 1
                block = self.alloc_block(pool, size, alloc_size, stream)
            if block is None:
                self.ooms += 1
                self._note("oom", 0, size, stream)
                raise OutOfMemory(size)
        return self.alloc_found_block(block, size, orig_size)

    def splice(self, block: Block, size: int) -> Block:
        """Cut `block` to its first `size` bytes; the rest becomes a new block right after it in its segment, in
        the same state of mapping (returned, in no pool). Every split of the model is this one (alloc_found_block's
        remainder, map_block's and unmap_block's page boundaries, a replay following the file's address)."""
        rest = Block(block.addr + size, block.size - size, block.stream, block.pool, block.seg, block.es,
                     mapped=block.mapped)
        rest.prev, rest.next = block, block.next
        if block.next is not None:
            block.next.prev = rest
        block.next = rest
        block.size = size
        self.blocks[rest.addr] = rest
        return rest

    def try_merge_blocks(self, dst: Block, src: Block | None) -> int:
        """Merge `src`, a neighbour of `dst` in its segment, into `dst` if it is free and in the same state of
        mapping (taken out of its pool's index); the bytes merged, 0 if it was not. `dst` keeps its identity and
        grows to cover both."""
        if src is None or not src.free or src.mapped != dst.mapped:
            return 0
        pool = src.pool
        if src.mapped:
            pool.remove(src)
        else:
            _remove_sorted(pool.unmapped, (src.stream, src.addr))
        if src is dst.prev:
            del self.blocks[dst.addr]
            dst.addr, dst.prev = src.addr, src.prev
            if src.prev is not None:
                src.prev.next = dst
            self.blocks[dst.addr] = dst
        else:
            del self.blocks[src.addr]
            dst.next = src.next
            if src.next is not None:
                src.next.prev = dst
        dst.size += src.size
        return src.size

    def alloc_found_block(self, block: Block, size: int, orig_size: int) -> Block:
        """Hand out `block` (already out of its pool), splitting off what is worth keeping."""
        if self.should_split(block, size):
            block.pool.insert(self.splice(block, size))
        block.allocated = True
        block.requested = orig_size
        self.allocated += block.size
        if self.allocated > self.peak_allocated:
            self.peak_allocated = self.allocated
        return block

    def free(self, block: Block, completed=True):
        """free(): the block stops counting as allocated; back in its pool now (`completed`) or at
        `complete_free` (used on other streams: its free_completed comes later)."""
        if not block.allocated:
            return
        block.allocated = False
        self.allocated -= block.size
        if completed:
            self.free_block(block)
        else:
            block.pending = True

    def complete_free(self, block: Block):
        if block.pending:
            block.pending = False
            self.free_block(block)

    def free_block(self, block: Block):
        """Merge with free neighbours of the same mapping state, put back in the pool."""
        self.try_merge_blocks(block, block.prev)
        self.try_merge_blocks(block, block.next)
        block.pool.insert(block)

    # ---- new memory ----------------------------------------------------------------------------------

    def alloc_block(self, pool: Pool, size: int, alloc_size: int, stream) -> Block | None:
        """A new segment (or newly mapped pages) for the request; None if the device refuses."""
        if self.allowed is not None and self.reserved + alloc_size > self.allowed:
            return None
        if self.config.expandable_segments:
            return self.try_allocate_expandable_block(pool, size, stream)
        if not self.device.fits(self.reserved, alloc_size):
            return None
        addr = self.device.new_address(alloc_size, stream, pool.small, False)
        return self.add_segment(addr, alloc_size, stream, pool)

    def add_segment(self, addr, size, stream, pool: Pool, counted: bool = True) -> Block:
        """A new cudaMalloc'ed segment at `addr`: one free block, not yet in the pool. `counted=False`: its bytes
        are already in `reserved` (a replay counts a recorded segment_alloc when it comes, the block later)."""
        b = Block(addr, size, stream, pool, addr)
        self.blocks[addr] = b
        self.segments[addr] = size
        self._seg_starts = None
        if counted:
            self._grow(size)
            self._note("segment_alloc", addr, size, stream)
        return b

    def release_available_cached_blocks(self, pool: Pool, size: int, stream) -> bool:
        """Free cached oversize blocks, the smallest that covers the
        request or else the largest ones until enough is freed (only when max_split_size is set)."""
        mss = self.config.max_split_size
        if mss == NO_LIMIT:
            return False
        want = max(size, mss)
        keys = pool.keys
        i = bisect_left(keys, (stream, want, -1))
        if i < len(keys) and keys[i][0] == stream:
            b = self.blocks[keys[i][2]]
            if b.es is not None:
                return False  # torch asserts here; a growing segment's pages are unmapped instead
            self.release_block(b)
            return True
        if i == 0:
            return False
        released = 0
        i -= 1
        while released < want and i >= 0:
            b = self.blocks[keys[i][2]]
            if b.size < mss or b.stream != stream or b.es is not None:
                break
            released += b.size
            self.release_block(b)
            i -= 1
        return released >= want

    def release_cached(self):
        """release_cached_blocks (also empty_cache): finish pending frees, then give back every cached
        block that is a whole segment, and the free pages of growing segments."""
        for b in sorted((b for b in self.blocks.values() if b.pending), key=lambda b: b.addr):
            self._note("free_completed", b.addr, b.requested, b.stream)
            self.complete_free(b)
        for key in sorted(self.pools, key=lambda k: (k[0], k[1])):  # large before small, as torch does
            pool = self.pools[key]
            to_unmap = []
            for stream, size, addr in list(pool.keys):
                b = self.blocks.get(addr)
                if b is None or not b.free or b.size != size:
                    continue
                if b.es is not None:
                    to_unmap.append(b)
                elif b.prev is None and b.next is None:
                    self.release_block(b)
            for b in to_unmap:
                b = self.unmap_block(b)
                if b is not None and b.prev is None and b.next is None:
                    self._drop_expandable(b)

    def release_block(self, b: Block):
        """cudaFree a whole-segment cached block."""
        b.pool.remove(b)
        del self.blocks[b.addr]
        self.segments.pop(b.addr, None)
        self._seg_starts = None
        self.reserved -= b.size
        self._note("segment_free", b.addr, b.size, b.stream)

    def garbage_collect_cached_blocks(self):
        """Over threshold x allowed, free unsplit large cached blocks
        that waited at least the average number of searches, oldest first, until under it."""
        threshold = int(self.config.garbage_collection_threshold * self.allowed)
        if self.reserved <= threshold:
            return
        target = self.reserved - threshold
        reclaimed = 0
        large = [p for (pid, small), p in self.pools.items() if not small and not pid]
        for pool in large:
            ages = [pool.calls - self.blocks[a].gc_base for s, z, a in pool.keys
                    if not self.blocks[a].is_split() and self.blocks[a].es is None]
            total, count = sum(ages), len(ages)
            freed = True
            while reclaimed < target and freed and count > 0:
                threshold_age = total / count
                freed = False
                for s, z, a in list(pool.keys):
                    b = self.blocks.get(a)
                    if b is None or b.is_split() or b.es is not None or not b.free:
                        continue
                    age = pool.calls - b.gc_base
                    if age >= threshold_age:
                        freed = True
                        reclaimed += b.size
                        total -= age
                        count -= 1
                        self.release_block(b)

    # ---- expandable segments ---------------------------------------------------------------------

    def try_allocate_expandable_block(self, pool: Pool, size: int, stream) -> Block | None:
        """Map pages at the lowest place with room in this stream's segment."""
        c = self._expandable_candidate(pool, size, stream)
        if not c.mapped:
            mapped = self.map_block(c, min(c.size, size))
            if mapped is None:
                return None
            c = mapped
        while c.size < size:
            nxt = c.next
            c2 = self.map_block(nxt, min(size - c.size, nxt.size))
            if c2 is None:
                return None
            c = c2
        pool.remove(c)
        return c

    def _expandable_candidate(self, pool: Pool, size: int, stream) -> Block:
        i = bisect_left(pool.unmapped, (stream, -1))
        while i < len(pool.unmapped) and pool.unmapped[i][0] == stream:
            c = self.blocks[pool.unmapped[i][1]]
            if c.prev is not None and c.prev.free:
                c = c.prev
            room, b = 0, c
            while room < size and b is not None and b.free:
                room += b.size
                b = b.next
            if room >= size:
                return c
            i += 1
        page = SMALL_BUFFER if pool.small else LARGE_BUFFER
        pages = expandable_pages(self.device.total_memory, page)
        base = self.device.new_address(page * pages, stream, pool.small, True)
        return self.add_expandable(base, page, pages, stream, pool)

    def add_expandable(self, base, page, pages, stream, pool: Pool) -> Block:
        es = ExpandableSegment(base, page, pages, stream, pool.small)
        self.expandable[base] = es
        b = Block(base, es.size, stream, pool, base, es, mapped=False)
        self.blocks[base] = b
        insort(pool.unmapped, (stream, base))
        return b

    def map_block(self, b: Block, size: int) -> Block | None:
        """Back [b.addr, b.addr + size) with pages (rounded up); the mapped part merges with free
        mapped neighbours. None if the device has no room."""
        es, pool = b.es, b.pool
        first = (b.addr - es.base) // es.page
        last = -(-(b.addr + size - es.base) // es.page)
        nbytes = (last - first) * es.page
        if not self.device.fits(self.reserved, nbytes):
            return None
        es.mapped.update(range(first, last))
        _remove_sorted(pool.unmapped, (b.stream, b.addr))
        if nbytes < b.size:
            rest = self.splice(b, nbytes)
            insort(pool.unmapped, (rest.stream, rest.addr))
        b.mapped = True
        addr = b.addr
        self._grow(nbytes)
        self._note("segment_map", addr, nbytes, b.stream)
        self.free_block(b)  # merge with free mapped neighbours (b grows in place), into the pool
        return b

    def unmap_block(self, b: Block) -> Block | None:
        """Give back the whole pages inside a free block; what is left of it stays cached."""
        es, pool = b.es, b.pool
        first = -(-(b.addr - es.base) // es.page)
        last = (b.addr + b.size - es.base) // es.page
        if first >= last:
            return None
        pool.remove(b)
        start, end = es.base + first * es.page, es.base + last * es.page
        if start > b.addr:  # the part before the first whole page stays cached
            before, b = b, self.splice(b, start - b.addr)
            pool.insert(before)
        if b.addr + b.size > end:  # and the part after the last
            pool.insert(self.splice(b, end - b.addr))
        b.mapped = False
        es.mapped.difference_update(range(first, last))
        self.reserved -= end - start
        self._note("segment_unmap", start, end - start, b.stream)
        self.try_merge_blocks(b, b.prev)  # merge with unmapped neighbours
        self.try_merge_blocks(b, b.next)
        insort(pool.unmapped, (b.stream, b.addr))
        return b

    def _drop_expandable(self, b: Block):
        _remove_sorted(b.pool.unmapped, (b.stream, b.addr))
        del self.blocks[b.addr]
        self.expandable.pop(b.es.base, None)

    # ---- views -----------------------------------------------------------------------------------

    def segment_of(self, addr) -> int | None:
        """Start of the cudaMalloc'ed segment holding `addr`, or None."""
        if self._seg_starts is None:
            self._seg_starts = sorted(self.segments)
        starts: list[int] = self._seg_starts
        i = bisect_left(starts, addr + 1) - 1
        if i >= 0 and addr < starts[i] + self.segments[starts[i]]:
            return starts[i]
        return None

    def block_at(self, addr) -> Block | None:
        """The block holding address `addr` (any state), or None."""
        b = self.blocks.get(addr)
        if b is not None:
            return b
        start = self.segment_of(addr)
        if start is None:
            for es in self.expandable.values():
                if es.base <= addr < es.base + es.size:
                    start = es.base
                    break
            else:
                return None
        b = self.blocks.get(start)
        while b is not None and b.prev is not None:
            b = b.prev
        while b is not None and not (b.addr <= addr < b.addr + b.size):
            b = b.next
        return b

    def snapshot(self) -> list[dict]:
        """Segments as torch's snapshot reports them (expandable: one per contiguous mapped range),
        by address, each with its blocks."""
        heads = [b for b in self.blocks.values() if b.prev is None]
        out = []
        for h in heads:
            b = h
            seg = None
            while b is not None:
                if b.mapped:
                    if seg is None:
                        seg = {"address": b.addr, "total_size": 0, "stream": b.stream,
                               "segment_type": "small" if b.pool.small else "large",
                               "is_expandable": b.es is not None, "blocks": []}
                        out.append(seg)
                    state = "active_allocated" if b.allocated else "active_pending_free" if b.pending else "inactive"
                    seg["blocks"].append({"address": b.addr, "size": b.size, "state": state,
                                          "requested_size": b.requested if b.allocated or b.pending else 0})
                    seg["total_size"] += b.size
                else:
                    seg = None
                b = b.next
        out.sort(key=lambda s: s["address"])
        return out

    def largest_free(self) -> int:
        """The largest cached free block (torch.cuda.memory's "largest free block" in cacheInfo)."""
        best = 0
        for pool in self.pools.values():
            for k in pool.keys:
                if k[1] > best:
                    best = k[1]
        return best


def _grows_to(b: Block) -> int:
    n = b.next
    return b.size + (n.size if n is not None and not n.mapped else 0)


def _remove_sorted(lst, key):
    i = bisect_left(lst, key)
    if i < len(lst) and lst[i] == key:
        del lst[i]



def check(alloc: Allocator) -> list[str]:
    """The model's own invariants, as a list of what is wrong (empty when all hold): blocks tile each
    segment without gap or overlap, linked both ways; no two free blocks of the same mapping side by side;
    the pools hold exactly the free mapped blocks (and unmapped ones); the byte counters add up."""
    bad = []
    seen = set()
    allocated = reserved = 0
    heads = [b for b in alloc.blocks.values() if b.prev is None]
    for h in heads:
        b, end = h, None
        while b is not None:
            if alloc.blocks.get(b.addr) is not b:
                bad.append(f"{b} is not in the address index")
            if id(b) in seen:
                bad.append(f"{b} is linked twice")
                break
            seen.add(id(b))
            if end is not None and b.addr != end:
                bad.append(f"{b} does not start where the block before it ends ({end:#x})")
            if b.next is not None and b.next.prev is not b:
                bad.append(f"{b}: its next block does not point back")
            if b.next is not None and b.free and b.next.free and b.mapped == b.next.mapped:
                bad.append(f"{b} and {b.next} are free side by side")
            if b.size <= 0:
                bad.append(f"{b} has no size")
            if b.allocated:
                allocated += b.size
            if b.mapped:
                reserved += b.size
            end = b.addr + b.size
            b = b.next
    if len(seen) != len(alloc.blocks):
        bad.append(f"{len(alloc.blocks) - len(seen)} blocks are not reachable from a segment's first block")
    for pool in alloc.pools.values():
        for s, z, a in pool.keys:
            b = alloc.blocks.get(a)
            if b is None or not b.free or not b.mapped or b.size != z or b.stream != s or b.pool is not pool:
                bad.append(f"pool key {(s, z, a)} does not match a free block ({b})")
        for s, a in pool.unmapped:
            b = alloc.blocks.get(a)
            if b is None or b.mapped or b.pool is not pool:
                bad.append(f"unmapped key {(s, a)} does not match an unmapped block ({b})")
    keys = sum(len(p.keys) for p in alloc.pools.values())
    free = sum(1 for b in alloc.blocks.values() if b.free and b.mapped)
    if keys != free:
        bad.append(f"{free} free blocks but {keys} pool keys")
    if allocated != alloc.allocated:
        bad.append(f"allocated counter {alloc.allocated} != {allocated} in allocated blocks")
    if reserved != alloc.reserved:
        bad.append(f"reserved counter {alloc.reserved} != {reserved} in mapped blocks")
    return bad
