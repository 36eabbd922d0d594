"""A time axis two recordings share: phase and iteration, not seconds.

Each recorded iteration (the n-th of the file, whatever its number) takes
the span [5n, 5n + 5): slot 0 what runs between steps before its forward
pass, 1 the forward pass, 2 backward, 3 the optimizer step, 4 what runs
after it (a gap between two phases joins the phase before it); entries
spread evenly over their slot in trace order. The same
point of the step then has the same x in both files, however long each
took. Iterations whose phases do not come in that order (gradient
accumulation: forward, backward, forward, ...) spread over their whole span
in order instead; files without phases spread over [0, 5).
"""
from __future__ import annotations

import numpy as np

from ..model import Trace
from .phases import BACKWARD, FORWARD, NONE, OPTIMIZER, phases
from .replay import replay
from .timeline import category_series

SLOTS = 5
SLOT_NAMES = ("between", "forward", "backward", "optimizer", "after")
_SLOT = {FORWARD: 1, BACKWARD: 2, OPTIMIZER: 3}


def aligned_x(trace: Trace, device: int) -> np.ndarray:
    """x of each of a device's trace entries on the shared axis (float64)."""
    ph = phases(trace)[device]
    n = ph.n
    x = np.zeros(n, np.float64)
    if not n:
        return x
    if ph.source == "none" or (ph.iteration < 0).all():
        return SLOTS * np.arange(n) / n
    its = ph.iteration
    order = {it: k for k, it in enumerate(sorted(set(its[its >= 0].tolist())))}
    ordinal = np.array([order.get(i, -1) for i in its.tolist()], np.int64) if len(order) < 4096 else \
        np.searchsorted(np.array(sorted(order)), its)
    starts = np.flatnonzero(np.diff(ordinal, prepend=ordinal[0] - 1))
    ends = np.append(starts[1:], n)
    for s, e in zip(starts.tolist(), ends.tolist()):
        x[s:e] = SLOTS * int(ordinal[s]) + _within(ph.phase[s:e])
    return x


def _within(phase: np.ndarray) -> np.ndarray:
    """Positions in [0, SLOTS) of one iteration's entries."""
    n = len(phase)
    slot = np.zeros(n, np.int64)
    for code, k in _SLOT.items():
        slot[phase == code] = k
    worked = np.flatnonzero(phase != NONE)
    if len(worked):  # gaps between phases join the phase before them; what follows the last one is "after"
        idx = np.arange(n)
        prev = np.maximum.accumulate(np.where(phase != NONE, idx, -1))
        gap = (phase == NONE) & (prev >= 0)
        slot[gap] = slot[prev[gap]]
        slot[(phase == NONE) & (idx > worked[-1])] = 4
    if (np.diff(slot) < 0).any():  # phases out of order: spread the iteration as it ran
        return SLOTS * np.arange(n) / n
    out = np.empty(n, np.float64)
    for k in np.unique(slot).tolist():
        rows = np.flatnonzero(slot == k)
        out[rows] = k + np.arange(len(rows)) / len(rows)
    return out


def aligned_series(trace: Trace, device: int, max_points: int = 3000, rules=None) -> dict:
    """{"x", "by_category" {name: bytes}, "total", "iterations" [(x, number)]} for plotting on the shared axis."""
    rep = replay(trace)[device]
    s = category_series(trace, device, max_points=max_points, rules=rules)
    x = aligned_x(trace, device)
    idx = s.index[s.index >= 0]
    ph = phases(trace)[device]
    marks = [(float(x[lo]) // SLOTS * SLOTS, it) for it, lo, _ in ph.iterations()] if rep.n else []
    return {"x": x[idx] if len(idx) else np.zeros(0),
            "by_category": {k: v[s.index >= 0] for k, v in s.by_category.items()},
            "total": s.total[s.index >= 0], "iterations": marks}


def aligned_difference(a: dict, b: dict, points: int = 1500) -> dict:
    """B − A per category on a common grid of the shared axis: {"x", "by_category" {name: bytes}, "total"}.

    `a` and `b` are `aligned_series` results; each is read as a step function (the value after the last
    point at or before x), over the span both cover."""
    if not len(a["x"]) or not len(b["x"]):
        return {"x": np.zeros(0), "by_category": {}, "total": np.zeros(0, np.int64)}
    lo, hi = max(a["x"][0], b["x"][0]), min(a["x"][-1], b["x"][-1])
    x = np.linspace(lo, hi, points) if hi > lo else np.array([lo])

    def at(s, values):
        k = np.clip(np.searchsorted(s["x"], x, side="right") - 1, 0, len(s["x"]) - 1)
        return np.asarray(values, np.int64)[k]

    names = list(a["by_category"]) + [n for n in b["by_category"] if n not in a["by_category"]]
    zero_a, zero_b = np.zeros(len(a["x"]), np.int64), np.zeros(len(b["x"]), np.int64)
    by = {n: at(b, b["by_category"].get(n, zero_b)) - at(a, a["by_category"].get(n, zero_a)) for n in names}
    return {"x": x, "by_category": {n: v for n, v in by.items() if v.any()},
            "total": at(b, b["total"]) - at(a, a["total"])}
