"""Types of the compiled allocator replay (_replay.c). Call it through compiled.py's `compiled_replay`, which names
every argument; the order here is the C function's."""
import numpy as np

# the constants, equal to config.py's (tests/test_allocator_compiled.py)
MIN_BLOCK: int
SMALL_SIZE: int
SMALL_BUFFER: int
LARGE_BUFFER: int
MIN_LARGE_ALLOC: int
ROUND_LARGE: int
POWER2_START_LOG2: int
INTERVALS: int
# the action codes, equal to tracekit.model's
A_ALLOC: int
A_FREE_REQUESTED: int
A_FREE_COMPLETED: int
A_SEGMENT_ALLOC: int
A_SEGMENT_FREE: int
A_SEGMENT_MAP: int
A_SEGMENT_UNMAP: int
A_OOM: int
# why an entry could not be followed, in the order the counts come back (model_replay.REASONS begins with these)
REASONS: tuple[str, ...]

def replay(action: np.ndarray, addr: np.ndarray, size: np.ndarray, stream: np.ndarray,
           blk_addr: np.ndarray, blk_size: np.ndarray, blk_stream: np.ndarray, blk_state: np.ndarray,
           blk_small: np.ndarray, blk_seg: np.ndarray, blk_requested: np.ndarray,
           seg_start: np.ndarray, seg_size: np.ndarray,
           divisions: np.ndarray, max_split_size: int, max_non_split_rounding: int,
           out_allocated: np.ndarray, out_reserved: np.ndarray, out_block: np.ndarray, stop: int = ...,
           out_entries: np.ndarray | None = ..., /
           ) -> tuple[int, int, list[int], int, int, list[tuple[int, int, int, int]]]:
    """Replay one device's entries (action int8, addr uint64, size int64, stream int64) from the state at the first
    entry (its blocks by address: state 0 free, 1 allocated, 2 pending; small 0/1; seg: its segment's start; and its
    segments), under these settings (divisions: INTERVALS int64); writes allocated and reserved bytes and each
    alloc's block size after every entry into the out_ buffers (int64): out_reserved may be one value where no entry
    is a segment_alloc or segment_free; with `out_entries` (int32 or int64), out_block is sparse: the blocks the
    allocs got, in order, and their entries in out_entries (both at least as long as the alloc entries). Stops
    after entry `stop` (-1: the end).
    -> (placed, slack, count per reason, allocated at the start, reserved at the start,
        [(address, size, state, first block of its segment)] the blocks at the end)."""

def first_touches(action: np.ndarray, addr: np.ndarray, /) -> tuple[bytes, bytes, bytes]:
    """(addresses uint64, index of the first alloc/free entry of each int64, its action int8), in order of entry."""

def pair_lifetimes(addr: np.ndarray, size: np.ndarray, stack: np.ndarray, is_alloc: np.ndarray, is_free: np.ndarray,
                   blk_addr: np.ndarray = ..., blk_size: np.ndarray = ..., blk_stack: np.ndarray = ...,
                   /) -> tuple[bytearray, ...] | None:
    """(addr, size, alloc_index, free_index, stack_id, free_stack_id, origin) of one device's lifetimes, in order of
    their first entry, then (given the final segments' live blocks) one allocated before the trace for each block
    whose address no entry names; then (last_addr, last_is_alloc, last_size): each address named, whether its last
    alloc or free entry is an alloc, and that entry's size, in no order. None when an address is
    2**64 - 1 or there are 2**31 - 2 entries or more. `size`, `stack` and `blk_stack` may be one value for all."""

def running_sum(size: np.ndarray, up: np.ndarray, down: np.ndarray, initial: int, out: np.ndarray, /) -> None:
    """out[i] = initial + size[j] summed over j <= i where up[j], less where down[j] (int64, wrapping); `size` may be
    one value for every entry."""

def change_steps(alloc_index: np.ndarray, free_index: np.ndarray, size: np.ndarray, cls: np.ndarray, ncls: int, /
                 ) -> tuple[list[int], list[tuple[bytearray, bytearray]]] | None:
    """Per class of `cls` (signed ints, 1 to 8 bytes; rows outside [0, ncls) left out): the bytes of its allocations
    made before the trace, and its changes in entry order (entries int32, running sum of +size at an alloc and -size
    at a free int64), from one walk of the entries (alloc_index, free_index, size: int64 per allocation). None when
    two changes share an entry, the allocations are not in order of their first entry, an entry is 2**31 - 1 or
    more, or there are 2**30 allocations or more."""

def group_peaks(alloc_index: np.ndarray, free_index: np.ndarray, size: np.ndarray, group: np.ndarray, ngroups: int, /
                ) -> bytearray | None:
    """The most bytes each group in [0, ngroups) held live at once (int64 per group; 0 without allocations): made
    before the trace first, then the entries in order, then the frees of those never freed. None as change_steps."""
