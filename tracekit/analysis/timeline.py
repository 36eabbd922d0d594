"""Memory over time, stacked by category: what the viewer plots and the report tabulates.

Every category's bytes change only at its allocations' alloc (+size) and
free (-size) entries, so each series is a cumulative sum over those change
points, read at the entries asked for. The categories sum exactly to the
allocated curve at every entry: allocations that replay cannot attribute
(profiler traces without addresses) count as "other".
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..model import ALLOC, FREE_COMPLETED, NO_TIME, Trace
from .categories import CATEGORIES, OTHER, PROFILER_NAMES, categorize
from .memo import per_trace
from .replay import replay

try:  # the walk of the entries (analysis/allocator/_replay.c), when it is built
    from .allocator._replay import change_steps as _steps_compiled
except ImportError:  # pragma: no cover - no C compiler where it was installed
    _steps_compiled = None  # type: ignore[assignment]


def time_origin(trace: Trace) -> int | None:
    """The time base of every time shown: the trace's first entry with a time, on any device (µs).

    The report and the viewer both show times as seconds since this, so one
    entry reads the same in both, and devices of one file share one axis."""
    t = trace.events.time_us
    t = t[t != NO_TIME]
    return int(t.min()) if len(t) else None


@dataclass
class Series:
    """Bytes per category at selected trace entries of one device."""

    index: np.ndarray  # int64 entry indices (ascending)
    time_us: np.ndarray | None  # int64 per point, None when the file has no times
    by_category: dict  # name -> int64 bytes per point, in `names` order
    total: np.ndarray  # int64 allocated bytes per point
    reserved: np.ndarray | None  # int64 per point, None when the file does not say
    # downsampled (see envelope): True where a point is the highest of its bucket; None: every entry is a point
    peaks: np.ndarray | None = None

    @property
    def names(self) -> list:
        return list(self.by_category)


def category_series(trace: Trace, device: int, max_points=None, start=None, end=None, rules=None) -> Series:
    """Category bytes over entries [start, end), at most `max_points` points.

    Downsampling keeps, for each bucket of entries, the entry with the least
    and the one with the most allocated bytes, so peaks stay visible.
    """
    rep = replay(trace)[device]
    n = rep.n
    lo = 0 if start is None else max(0, min(int(start), n))
    hi = n if end is None else max(lo, min(int(end), n))
    idx = envelope(rep.allocated, lo, hi, max_points)
    out = _series_at(trace, device, idx, rules)
    if max_points is not None and max_points >= 2 and hi - lo > max_points:
        out.peaks = bucket_peaks(out.total, idx, lo, hi, max_points)
    return out


def categories_at(trace: Trace, device: int, indices, rules=None, steps: bool = True) -> dict:
    """{name: int64 array of bytes} just after each entry in `indices` (-1: before the first entry).
    `steps`: read the categories' step functions (made once and kept: the viewer asks again and again); False:
    add up the allocations live at these few points instead (a lean report: no step function made or held)."""
    idx = np.asarray(indices, np.int64)
    if steps or trace.format == "memory_timeline" or not trace.meta.get("has_addresses", True):
        return _series_at(trace, device, idx, rules).by_category
    return _live_by_category(trace, device, idx, rules)


def _live_by_category(trace: Trace, device: int, idx: np.ndarray, rules, chunk: int = 1 << 20) -> dict:
    """categories_at from the allocations, without step functions: each allocation adds its size to the sorted
    points from the first at or after its entry to the first at or after its free (Allocations.live_at), as
    int64 differences per category summed along the points; a chunk of allocations at a time."""
    rep = replay(trace)[device]
    cats = categorize(trace, rules)[device]
    al = rep.allocations
    pts = np.unique(idx)
    k, width = len(cats.names), len(pts) + 1
    acc = np.zeros(k * width, np.int64)
    for lo in range(0, len(al), chunk):
        lab = cats.labels[lo:lo + chunk].astype(np.int64)
        keep = (lab >= 0) & (lab < k)
        a, f = al.alloc_index[lo:lo + chunk][keep], al.free_index[lo:lo + chunk][keep]
        size = np.asarray(al.size[lo:lo + chunk][keep], np.int64)
        base = lab[keep] * width
        np.add.at(acc, base + np.searchsorted(pts, a, "left"), size)
        np.subtract.at(acc, base + np.where(f < 0, len(pts), np.searchsorted(pts, f, "left")), size)
    per_point = np.cumsum(acc.reshape(k, width), axis=1)[:, :-1]
    at = np.searchsorted(pts, idx)
    return {name: per_point[c][at] + (rep.unattributed_bytes if c == OTHER else 0) for c, name in enumerate(cats.names)}


def category_maxima(trace: Trace, device: int, rules=None) -> dict:
    """{name: the most bytes of the category just after any entry} (0 without entries): the maxima of
    category_series(trace, device) read from the step functions, without making a point per entry."""
    rep = replay(trace)[device]
    if trace.format == "memory_timeline" or not trace.meta.get("has_addresses", True):
        steps = _event_category_steps(trace, device)
    else:
        steps = _allocation_steps(trace, device, rules)
    out = {}
    for name, (initial, p, c) in steps.items():
        if not rep.n:
            out[name] = 0
            continue
        # the value after an entry is the last change at or before it: the last of equal positions counts
        last = np.ones(len(p), bool)
        last[:-1] = p[1:] != p[:-1]
        inside = last & (p < rep.n)
        best = int(initial + c[inside].max()) if inside.any() else None
        if not len(p) or p[0] > 0 or best is None:  # entries before the first change hold the initial bytes
            best = int(initial) if best is None else max(best, int(initial))
        out[name] = best
    return out


def _series_at(trace, device, idx, rules) -> Series:
    rep = replay(trace)[device]
    if trace.format == "memory_timeline" or not trace.meta.get("has_addresses", True):
        by_cat = _from_event_categories(trace, rep, idx)
    else:
        by_cat = _from_allocations(trace, rep, idx, rules)
    total = np.where(idx >= 0, rep.allocated[np.maximum(idx, 0)] if rep.n else 0, rep.initial_allocated)
    total = total.astype(np.int64)
    reserved = None
    if rep.reserved is not None:
        reserved = np.where(idx >= 0, rep.reserved[np.maximum(idx, 0)] if rep.n else 0,
                            rep.initial_reserved or 0).astype(np.int64)
    time_us = None
    if trace.has_time and rep.n:
        t = trace.events.time_us[rep.events]
        time_us = np.where(idx >= 0, t[np.maximum(idx, 0)], NO_TIME).astype(np.int64)
    return Series(index=idx, time_us=time_us, by_category=by_cat, total=total, reserved=reserved)


def _steps(pos, delta, initial):
    """A step function: (initial, sorted change positions, cumulative change after each)."""
    order = np.argsort(pos, kind="stable")
    return initial, pos[order], np.cumsum(delta[order]).astype(np.int64)


def _read_steps(steps, idx):
    """Value of a step function just after each entry in idx (-1: before the first)."""
    initial, p, c = steps
    if p.dtype != idx.dtype and len(idx) and p.dtype.kind == idx.dtype.kind == "i" \
            and np.iinfo(p.dtype).min <= int(idx.min()) and int(idx.max()) <= np.iinfo(p.dtype).max:
        idx = idx.astype(p.dtype)  # the few points in the positions' type: searchsorted would copy all of them
    k = np.searchsorted(p, idx, side="right") - 1
    return (initial + np.where(k >= 0, c[np.maximum(k, 0)] if len(c) else 0, 0)).astype(np.int64)


def _from_allocations(trace, rep, idx, rules):
    return {name: _read_steps(st, idx) for name, st in _allocation_steps(trace, rep.device, rules).items()}


@per_trace
def _allocation_steps(trace, device, rules):
    """Per category, its bytes as a step function of the entry index (made once, read per query)."""
    rep = replay(trace)[device]
    cats = categorize(trace, rules)[device]
    al = rep.allocations
    a, f, size, lab = al.alloc_index, al.free_index, np.asarray(al.size, np.int64), cats.labels
    count = len(cats.names)
    steps = _walked_steps(a, f, size, lab, count, rep.n)
    if steps is None:
        steps = _sorted_steps(a, f, size, lab, count, rep.n)
    return {name: (initial + (rep.unattributed_bytes if k == OTHER else 0), pos, cum)
            for k, (name, (initial, pos, cum)) in enumerate(zip(cats.names, steps))}


def _walked_steps(a, f, size, lab, count: int, n: int) -> list | None:
    """[(bytes made before the trace, entries int32, cumulative bytes int64)] per category 0..count-1 of `lab`,
    from one walk of the entries in order (_replay.change_steps): each entry is at most one change, so the changes
    come in entry order without a sort. None without the compiled walk, or where it gives up (two changes at one
    entry, allocations not in order of their first entry, 2**31 entries): _sorted_steps is the rule then."""
    if _steps_compiled is None or lab.dtype.kind != "i" or n >= 2**31:
        return None
    got = _steps_compiled(np.ascontiguousarray(a, np.int64), np.ascontiguousarray(f, np.int64),
                          np.ascontiguousarray(size, np.int64), np.ascontiguousarray(lab), count)
    if got is None:
        return None
    initial, cols = got
    return [(i, np.frombuffer(p, np.int32), np.frombuffer(c, np.int64)) for i, (p, c) in zip(initial, cols)]


def _sorted_steps(a, f, size, lab, count: int, n: int) -> list:
    """_walked_steps by a sort of each category's changes by entry (entries int64 from 2**31 entries)."""
    out = []
    for k in range(count):
        m = lab == k
        initial = int(size[m & (a < 0)].sum())
        am, fm = m & (a >= 0), m & (f >= 0)
        del m
        packed = _packed_changes(a, f, size, am, fm, n)
        if packed is not None:
            pos, delta = packed
            out.append((initial, pos, np.cumsum(delta, out=delta)))
            continue
        na, nf = int(np.count_nonzero(am)), int(np.count_nonzero(fm))
        pos, delta = np.empty(na + nf, np.int64), np.empty(na + nf, np.int64)  # filled in place: no parts
        np.compress(am, a, out=pos[:na])
        np.compress(fm, f, out=pos[na:])
        np.compress(am, size, out=delta[:na])
        np.compress(fm, size, out=delta[na:])
        np.negative(delta[na:], out=delta[na:])
        del am, fm
        pos, delta = _sorted_changes(pos, delta)
        # entry positions in int32 below 2**31 entries (half the memory the viewer and the report keep)
        pos = pos.astype(np.int32 if n < 2**31 else np.int64, copy=False)
        out.append((initial, pos, np.cumsum(delta, out=delta)))
    return out


def _packed_changes(a, f, size, am, fm, n: int, chunk: int = 1 << 20):
    """(pos, delta) of the changes of the allocations `am` (made at `a`) and `fm` (freed at `f`), ordered by
    entry, or None where they do not pack. One int64 key per change: its entry, its allocation's row, whether
    it is the free; sorted in place, then read a chunk at a time into the entries (int32) and the signed sizes,
    gathered from `size` by row (no column of the changes' sizes beside the keys). Each entry is one change
    (an alloc or a free of one allocation), so the order by entry is the one a stable sort makes."""
    m = len(size)
    row_bits = max(1, (m - 1).bit_length()) + 1
    if n >= 2**31 or max(1, n).bit_length() + row_bits > 62:
        return None
    k = int(np.count_nonzero(am)) + int(np.count_nonzero(fm))
    key = np.empty(k, np.int64)
    at = 0
    for lo in range(0, m, chunk):
        for mask, idx, flag in ((am, a, 0), (fm, f, 1)):
            r = np.flatnonzero(mask[lo:lo + chunk])
            part = key[at:at + len(r)]
            np.take(idx[lo:lo + chunk], r, out=part, mode="clip")
            part <<= row_bits
            r += lo
            r <<= 1
            r |= flag
            part |= r
            at += len(r)
    key.sort()
    pos, delta = np.empty(k, np.int32), np.empty(k, np.int64)
    row_mask = (1 << row_bits) - 1
    for lo in range(0, k, chunk):
        c = key[lo:lo + chunk]
        rows = c & row_mask
        d = size[rows >> 1]
        d[(rows & 1) == 1] *= -1  # a free: its size off
        delta[lo:lo + chunk] = d
        c >>= row_bits
        pos[lo:lo + chunk] = c
    return pos, delta


def _sorted_changes(pos: np.ndarray, delta: np.ndarray, chunk: int = 1 << 20) -> tuple[np.ndarray, np.ndarray]:
    """(pos, delta) ordered by pos as a stable argsort orders them. Each change's number goes in the low bits
    of its position, so that the keys are distinct and sort in place (no index array, no sort buffer); then
    the deltas are gathered a chunk at a time. `pos` (int64, not negative) is reused."""
    k = len(pos)
    bits = max(1, (k - 1).bit_length())
    if not k or pos.dtype != np.int64 or int(pos.min()) < 0 or int(pos.max()) >= 1 << (62 - bits):
        order = np.argsort(pos, kind="stable")
        return pos[order], delta[order]
    pos <<= bits
    for lo in range(0, k, chunk):  # each change's number, a chunk at a time (no int64 per change beside pos)
        pos[lo:lo + chunk] |= np.arange(lo, min(lo + chunk, k), dtype=np.int64)
    pos.sort()
    out = np.empty_like(delta)
    mask = (1 << bits) - 1
    for lo in range(0, k, chunk):
        p = pos[lo:lo + chunk]
        out[lo:lo + chunk] = delta[p & mask]
        p >>= bits
    return pos, out


def _from_event_categories(trace, rep, idx):
    return {name: _read_steps(st, idx) for name, st in _event_category_steps(trace, rep.device).items()}


@per_trace
def _event_category_steps(trace, device):
    """Files without addresses: the per-event category column (torch.profiler memory timelines)."""
    rep = replay(trace)[device]
    ev = trace.events
    sl = rep.events
    action, size, cat = ev.action[sl], ev.size[sl].astype(np.int64), ev.category[sl]
    delta = np.where(action == ALLOC, size, 0) - np.where(action == FREE_COMPLETED, size, 0)
    names = list(CATEGORIES)
    per_id = {}
    for i in np.unique(cat).tolist():
        name = trace.strings[i]
        name = PROFILER_NAMES.get(name, name)
        if name not in names:
            names.append(name)
        per_id[i] = name
    out = {}
    for name in names:
        ids = [i for i, nm in per_id.items() if nm == name]
        m = np.isin(cat, ids) & (delta != 0)
        initial = rep.initial_allocated if name == "other" else 0
        out[name] = _steps(np.flatnonzero(m), delta[m], initial)
    return out


def bucket_peaks(values, idx, lo, hi, max_points) -> np.ndarray:
    """Of envelope(curve, lo, hi, max_points)'s points `idx` with `values` = curve[idx]: True where a point
    holds its bucket's most (both points of a flat bucket)."""
    if not len(idx):
        return np.zeros(0, bool)
    bucket = (idx - lo) // _bucket_width(hi - lo, max_points)
    starts = np.flatnonzero(np.diff(bucket, prepend=-1))
    top = np.maximum.reduceat(values, starts)
    return values >= np.repeat(top, np.diff(np.append(starts, len(idx))))


def _bucket_width(count, max_points) -> int:
    """Entries per bucket of envelope(): two points (least and most) a bucket, `max_points` at most."""
    return -(-int(count) // (int(max_points) // 2))


def envelope(curve, lo, hi, max_points) -> np.ndarray:
    """Entry indices in [lo, hi): all of them, or per bucket the min and max of `curve`."""
    count = hi - lo
    if max_points is None or count <= max_points:
        return np.arange(lo, hi, dtype=np.int64)
    if max_points < 2:
        return np.array([lo + int(np.argmax(curve[lo:hi]))], np.int64)
    buckets = int(max_points) // 2
    width = _bucket_width(count, max_points)
    seg = curve[lo:hi]
    pad = width * buckets - count
    if pad:
        seg = np.concatenate([seg, np.full(pad, seg[-1])])
    seg = seg.reshape(buckets, width)
    base = lo + np.arange(buckets) * width
    pick = np.concatenate([base + np.argmin(seg, axis=1), base + np.argmax(seg, axis=1)])
    pick = np.unique(np.minimum(pick, hi - 1))
    return pick.astype(np.int64)
