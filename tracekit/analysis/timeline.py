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
from .replay import replay


@dataclass
class Series:
    """Bytes per category at selected trace entries of one device."""

    index: np.ndarray  # int64 entry indices (ascending)
    time_us: np.ndarray | None  # int64 per point, None when the file has no times
    by_category: dict  # name -> int64 bytes per point, in `names` order
    total: np.ndarray  # int64 allocated bytes per point
    reserved: np.ndarray | None  # int64 per point, None when the file does not say

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
    return _series_at(trace, device, idx, rules)


def categories_at(trace: Trace, device: int, indices, rules=None) -> dict:
    """{name: int64 array of bytes} just after each entry in `indices` (-1: before the first entry)."""
    return _series_at(trace, device, np.asarray(indices, np.int64), rules).by_category


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


def _step_values(pos, delta, initial, idx):
    """initial + sum of delta[k] for pos[k] <= i, for each i in idx (pos need not be sorted)."""
    order = np.argsort(pos, kind="stable")
    p, c = pos[order], np.cumsum(delta[order])
    k = np.searchsorted(p, idx, side="right") - 1
    return initial + np.where(k >= 0, c[np.maximum(k, 0)] if len(c) else 0, 0)


def _from_allocations(trace, rep, idx, rules):
    cats = categorize(trace, rules)[rep.device]
    al = rep.allocations
    a, f, size, lab = al.alloc_index, al.free_index, al.size.astype(np.int64), cats.labels
    out = {}
    for k, name in enumerate(cats.names):
        m = lab == k
        before = m & (a < 0)
        initial = int(size[before].sum())
        if k == OTHER:
            initial += rep.unattributed_bytes
        am, fm = m & (a >= 0), m & (f >= 0)
        pos = np.concatenate([a[am], f[fm]])
        delta = np.concatenate([size[am], -size[fm]])
        out[name] = _step_values(pos, delta, initial, idx).astype(np.int64)
    return out


def _from_event_categories(trace, rep, idx):
    """Files without addresses: the per-event category column (torch.profiler memory timelines)."""
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
        out[name] = _step_values(np.flatnonzero(m), delta[m], initial, idx).astype(np.int64)
    return out


def envelope(curve, lo, hi, max_points) -> np.ndarray:
    """Entry indices in [lo, hi): all of them, or per bucket the min and max of `curve`."""
    count = hi - lo
    if max_points is None or count <= max_points:
        return np.arange(lo, hi, dtype=np.int64)
    if max_points < 2:
        return np.array([lo + int(np.argmax(curve[lo:hi]))], np.int64)
    buckets = int(max_points) // 2
    width = -(-count // buckets)
    seg = curve[lo:hi]
    pad = width * buckets - count
    if pad:
        seg = np.concatenate([seg, np.full(pad, seg[-1])])
    seg = seg.reshape(buckets, width)
    base = lo + np.arange(buckets) * width
    pick = np.concatenate([base + np.argmin(seg, axis=1), base + np.argmax(seg, axis=1)])
    pick = np.unique(np.minimum(pick, hi - 1))
    return pick.astype(np.int64)
