"""The in-memory trace: columnar numpy tables with interned strings, frames and stacks.

A `Trace` holds what a file says and nothing computed from it; the analyses in
`tracekit.analysis` derive everything else. Events of all devices sit in one
table sorted by (device, index), so each device's trace is a contiguous slice.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

# Trace entry actions, as codes. Unknown future actions keep their name in
# Trace.meta["unknown_actions"] and get the code OTHER (they change nothing).
ACTIONS = (
    "alloc", "free_requested", "free_completed", "segment_alloc", "segment_free",
    "segment_map", "segment_unmap", "snapshot", "oom", "other",
)
ACTION = {name: code for code, name in enumerate(ACTIONS)}
ALLOC, FREE_REQUESTED, FREE_COMPLETED = ACTION["alloc"], ACTION["free_requested"], ACTION["free_completed"]
SEGMENT_ALLOC, SEGMENT_FREE = ACTION["segment_alloc"], ACTION["segment_free"]
SEGMENT_MAP, SEGMENT_UNMAP = ACTION["segment_map"], ACTION["segment_unmap"]
SNAPSHOT, OOM, OTHER = ACTION["snapshot"], ACTION["oom"], ACTION["other"]

_UNSET = np.zeros(0, np.int32)  # a column not given (Events fills it in __post_init__)

# Final block states.
BLOCK_STATES = ("active_allocated", "active_pending_free", "inactive", "unknown")
BLOCK_STATE = {name: code for code, name in enumerate(BLOCK_STATES)}

def isin_ints(a, b) -> np.ndarray:
    """np.isin(a, b) for integer arrays of one dtype, by a sort of `b` and a binary search: np.isin hashes a
    wide-ranged `b` (addresses), which can take a second for a few hundred thousand values. Other inputs go
    to np.isin. Same result."""
    a, b = np.asarray(a), np.asarray(b)
    if a.dtype != b.dtype or a.dtype.kind not in "iu" or a.ndim != 1:
        return np.isin(a, b)
    if not len(a) or not len(b):
        return np.zeros(a.shape, bool)
    if len(b) > 4 * len(a):  # a few values asked of many (blocks among addresses): sort the few, search the many
        s = np.unique(a)
        pos = np.minimum(np.searchsorted(s, b), len(s) - 1)
        hit = np.zeros(len(s), bool)
        hit[pos[s[pos] == b]] = True
        return hit[np.searchsorted(s, a)]
    s = np.sort(b)
    return s[np.minimum(np.searchsorted(s, a), len(s) - 1)] == a


def isin_few(a, values) -> np.ndarray:
    """np.isin(a, values) for a few values (codes): a comparison with each, OR-ed in place. np.isin sorts or
    tabulates, which on a 10M-entry column makes several temporaries of its size. Same result."""
    a = np.asarray(a)
    out = np.zeros(a.shape, bool)
    for v in values:
        out |= a == v
    return out


def unique_ids(values, return_index: bool = False, return_inverse: bool = False):
    """np.unique for integer ids and codes (string, stack, module ids: a range not much wider than their
    count), in linear time with a table over the range instead of a sort; any other input goes to
    np.unique. Same results: sorted distinct values, the first index of each, the inverse."""
    v = np.asarray(values).reshape(-1)
    if v.dtype.kind not in "iu" or not len(v):
        # numpy's stub overloads np.unique on literal flags only
        return np.unique(v, return_index=return_index, return_inverse=return_inverse)  # type: ignore[call-overload]
    lo, hi = int(v.min()), int(v.max())
    if hi - lo > 4 * len(v) + 65536:
        return np.unique(v, return_index=return_index, return_inverse=return_inverse)  # type: ignore[call-overload]
    if not lo:
        off = v.astype(np.intp, copy=False)
    elif v.dtype.kind == "u":  # in the unsigned type first: a value above 2**63 survives
        off = (v - v.dtype.type(lo)).astype(np.intp)
    else:
        off = v.astype(np.int64) - lo
    present = np.zeros(hi - lo + 1, bool)
    present[off] = True
    out = [np.flatnonzero(present).astype(v.dtype) + v.dtype.type(lo)]
    if return_index:
        first = np.full(len(present), len(v), np.intp)
        np.minimum.at(first, off, np.arange(len(v), dtype=np.intp))
        out.append(first[present])
    if return_inverse:
        rank = np.cumsum(present, dtype=np.intp) - 1
        out.append(rank[off])
    return out[0] if len(out) == 1 else tuple(out)



def unique_rows(key: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """np.unique(key, axis=0, return_inverse=True) (the inverse flat) for a 2-d array of integers, without
    sorting rows: each column is made codes 0..k-1 in its sorted order (unique_ids), the codes of a row
    packed into one int64 (which keeps the rows' lexicographic order) and those made unique. Same results
    (rows in int64) as numpy's, which sorts the rows as records, many times slower on millions of rows."""
    key = np.asarray(key)
    if key.ndim != 2 or key.dtype.kind not in "iu" or not len(key) or not key.shape[1]:
        uniq, inv = np.unique(key, axis=0, return_inverse=True)
        return uniq, inv.reshape(-1)
    values, codes, span = [], [], 1.0
    for c in range(key.shape[1]):
        u, inv = unique_ids(key[:, c], return_inverse=True)
        values.append(u)
        codes.append(inv)
        span *= len(u)
    if span >= 2.0**62:
        uniq, inv = np.unique(key, axis=0, return_inverse=True)
        return uniq, inv.reshape(-1)
    packed = codes[0].astype(np.int64)
    for c in range(1, key.shape[1]):
        packed *= len(values[c])
        packed += codes[c]
    codes.clear()
    u, inv = unique_ids(packed, return_inverse=True) if span <= 4 * len(key) + 65536 else \
        np.unique(packed, return_inverse=True)
    del packed
    rows = np.empty((len(u), key.shape[1]), np.int64 if key.dtype.kind == "i" or key.dtype.itemsize < 8
                    else key.dtype)
    for c in range(key.shape[1] - 1, -1, -1):
        rows[:, c] = values[c][u % len(values[c])]
        u = u // len(values[c])
    return rows.astype(key.dtype, copy=False), inv.reshape(-1)

NO_TIME = np.iinfo(np.int64).min  # time_us of an entry that has none


MAX_DEVICE_ENTRIES = 2**31 - 1  # entries a device's trace may hold: positions are int32 (a file that big is ~200 GB)


def index_column(n: int) -> np.ndarray:
    """Positions 0..n-1 of a device's entries, as Events.index holds them (int32: 38 MiB less at 10M entries)."""
    if n > MAX_DEVICE_ENTRIES:
        from .errors import TracekitError

        raise TracekitError(f"a device's trace holds {n:,} entries, more than tracekit reads ({MAX_DEVICE_ENTRIES:,})")
    return np.arange(n, dtype=np.int32)


def constant_column(value, n: int, dtype) -> np.ndarray:
    """A read-only column of `n` equal values that takes no memory (a zero-stride view of one value): most
    of a big trace's columns (device, stream, user_metadata, device_free, ...) hold one value throughout."""
    return np.broadcast_to(np.asarray(value, dtype=dtype), (n,))


def is_constant(a: np.ndarray) -> bool:
    """Whether `a` is a constant_column: a zero-stride view of one value, more than one entry long."""
    return a.ndim == 1 and len(a) > 1 and a.strides == (0,)


def one_or_all(column: np.ndarray, dtype) -> np.ndarray:
    """A column as the compiled loops read it: contiguous in `dtype` (no copy when it already is), or its one
    value when it is a constant column (not copied out to one per entry)."""
    return np.ascontiguousarray(column[:1] if is_constant(column) else column, dtype)


def same_column(a: np.ndarray, b: np.ndarray) -> bool:
    """np.array_equal of two columns; two constant columns by their one value, not entry by entry."""
    if is_constant(a) and is_constant(b):
        return len(a) == len(b) and bool(a[0] == b[0])
    return np.array_equal(a, b)


def compact_column(a: np.ndarray) -> np.ndarray:
    """`a`, or the constant_column of its one value when all its values are equal (so that it is freed)."""
    if a.ndim == 1 and len(a) > 1 and not is_constant(a) and (a == a[0]).all():
        return constant_column(a[0], len(a), a.dtype)
    return a
NO_ID = -1  # stack_id / string id of "nothing"


class Strings:
    """Interned strings: id <-> str. Id 0 is always the empty string."""

    def __init__(self, items=("",)):
        self.items = list(items)
        self.index = {s: i for i, s in enumerate(self.items)}

    def intern(self, s) -> int:
        i = self.index.get(s)
        if i is None:
            i = self.index[s] = len(self.items)
            self.items.append(s)
        return i

    def __getitem__(self, i) -> str:
        return self.items[i]

    def __len__(self):
        return len(self.items)


@dataclass
class Frames:
    """Interned frames: filename and name are string ids."""

    filename: np.ndarray  # int32
    line: np.ndarray  # int32
    name: np.ndarray  # int32

    def __len__(self):
        return len(self.line)


@dataclass
class Stacks:
    """Interned stacks, innermost frame first (as PyTorch records them).

    Stack i is frame ids `frame_ids[offsets[i]:offsets[i+1]]`. Stack 0 is empty.
    """

    offsets: np.ndarray  # int64, len = n + 1
    frame_ids: np.ndarray  # int32

    def __len__(self):
        return len(self.offsets) - 1

    def frames_of(self, stack_id) -> np.ndarray:
        if stack_id < 0:
            return self.frame_ids[:0]
        return self.frame_ids[self.offsets[stack_id]:self.offsets[stack_id + 1]]


@dataclass
class Events:
    """One row per trace entry, sorted by (device, index)."""

    device: np.ndarray  # int32
    index: np.ndarray  # int32: position in its device's trace (index_column)
    action: np.ndarray  # int8: ACTION codes
    addr: np.ndarray  # uint64
    size: np.ndarray  # int64
    stream: np.ndarray  # int64 (raw stream pointer, as recorded)
    time_us: np.ndarray  # int64, NO_TIME where absent
    stack_id: np.ndarray  # int32, NO_ID where no frames
    user_metadata: np.ndarray  # int32 string id (0 = "")
    compile_context: np.ndarray  # int32 string id
    category: np.ndarray  # int32 string id written by tracekit (0 = none)
    device_free: np.ndarray  # int64, oom entries only (else 0)
    # the forward op's stack that caused a backward allocation (NO_ID: none), and the nn.Module path
    # running when it was made (string id, 0 = none); written by our recorder (docs/format.md)
    forward_stack_id: np.ndarray = field(default_factory=lambda: _UNSET)  # int32
    module: np.ndarray = field(default_factory=lambda: _UNSET)  # int32 string id

    def __post_init__(self):
        n = len(self.action)
        if self.forward_stack_id is None or self.forward_stack_id is _UNSET:
            self.forward_stack_id = constant_column(NO_ID, n, np.int32)
        if self.module is None or self.module is _UNSET:
            self.module = constant_column(0, n, np.int32)

    def __len__(self):
        return len(self.action)

    def device_slice(self, device) -> slice:
        # the needles in the column's own type: a list of Python ints would copy the whole column to int64
        lo = np.searchsorted(self.device, self.device.dtype.type(device), "left")
        hi = np.searchsorted(self.device, self.device.dtype.type(device), "right")
        return slice(int(lo), int(hi))


@dataclass
class Segments:
    """The final segments (reserved memory at the end of the trace)."""

    device: np.ndarray  # int32
    address: np.ndarray  # uint64
    total_size: np.ndarray  # int64
    stream: np.ndarray  # int64
    segment_type: np.ndarray  # int32 string id ("large", "small", ...)
    pool_id: np.ndarray  # int32 string id ("" when absent)
    is_expandable: np.ndarray  # bool
    stack_id: np.ndarray  # int32

    def __len__(self):
        return len(self.total_size)


@dataclass
class Blocks:
    """The blocks of the final segments."""

    device: np.ndarray  # int32
    segment: np.ndarray  # int32: row in Segments
    addr: np.ndarray  # uint64
    size: np.ndarray  # int64
    requested_size: np.ndarray  # int64
    state: np.ndarray  # int8: BLOCK_STATE codes
    stack_id: np.ndarray  # int32

    def __len__(self):
        return len(self.size)


@dataclass
class Trace:
    """Everything a memory file says, in columns."""

    path: str
    format: str  # "snapshot", "kineto", "memory_timeline"
    devices: list  # device numbers present, ascending
    strings: Strings
    frames: Frames
    stacks: Stacks
    events: Events
    segments: Segments
    blocks: Blocks
    # Everything else the file holds: "tracekit" (our recorder's data),
    # "allocator_settings", "external_annotations", "present_fields",
    # "unknown_actions", "has_segments" and whatever a loader adds.
    meta: dict = field(default_factory=dict)

    @property
    def has_time(self) -> bool:
        """Whether any entry has a time (asked on every viewer frame: kept for the column it was asked of)."""
        t = self.events.time_us
        known = self.__dict__.get("_has_time")
        if known is None or known[0] is not t:
            known = self.__dict__["_has_time"] = (t, bool(len(t)) and bool((t != NO_TIME).any()))
        return known[1]

    @property
    def recorder(self) -> dict | None:
        """Our recorder's data (the file's top-level "tracekit" key), if any."""
        return self.meta.get("tracekit")

    def frame(self, frame_id) -> dict:
        f = self.frames
        return {
            "filename": self.strings[f.filename[frame_id]],
            "line": int(f.line[frame_id]),
            "name": self.strings[f.name[frame_id]],
        }

    def stack(self, stack_id) -> list[dict]:
        """Frames of a stack as dicts, innermost first."""
        return [self.frame(i) for i in self.stacks.frames_of(stack_id)]

    def device_label(self, device) -> str:
        """"cuda:0", "cpu", ... for reports."""
        labels = self.meta.get("device_labels") or {}
        if device in labels:
            return labels[device]
        for d in (self.recorder or {}).get("devices") or []:
            if isinstance(d, dict) and d.get("index") == device and d.get("type"):
                return d["type"] if d["type"] == "cpu" else f"{d['type']}:{device}"
        return f"cuda:{device}"

    def device_events(self, device) -> slice:
        return self.events.device_slice(device)
