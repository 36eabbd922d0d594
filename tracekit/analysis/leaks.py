"""Leaks: memory made in one iteration that is still live iterations later, step after step.

In a clean training loop everything an iteration allocates is gone by the end
of the next one (gradients live until the next zero_grad, a prefetched batch
until it is used). An allocation made in iteration k that is still live at
the end of iteration k+1 is *retained*. The first recorded iteration is
skipped (optimizer state, lazily built buffers and other one-off warm-up
live on by design), so are iterations too close to the end to tell. A leak
is a stack that retains memory in (nearly) every eligible iteration: the
retained bytes are grouped by allocation site (sites.py), the user's own line first.
Needs at least three iterations.

Retention alone is not growth: the last batch of a loop, held by its variable
until the next one replaces it, is retained by that definition, and so is any
buffer a model swaps each step. A leak is *sustained growth*: memory at the
iterations' ends rises step after step (from the end of the first eligible
iteration to the last, in most steps and never falling back), by at least half
of what the leaking sites retain. Its rate is that growth per iteration.
"""
from __future__ import annotations

import numpy as np

from ..model import Trace
from .categories import ACTIVATION, categorize
from .phases import phases
from .replay import replay
from .sites import allocation_sites, site_info
from ..units import fmt_bytes

MAX_GROUPS = 5


def retained(trace: Trace, device: int):
    """(mask of retained allocations, birth position among iterations, iterations list)."""
    rep = replay(trace)[device]
    al = rep.allocations
    its = phases(trace)[device].iterations()
    m = len(al)
    if len(its) < 3 or not m:
        return np.zeros(m, bool), np.full(m, -1), its
    starts = np.array([s for _, s, _ in its])
    ends = np.array([e for _, _, e in its])
    a, f = al.alloc_index, al.free_index
    pos = np.searchsorted(starts, a, side="right") - 1  # iteration position of the birth
    pos = np.where((a >= 0) & (pos >= 0) & (a <= ends[np.clip(pos, 0, len(ends) - 1)]), pos, -1)
    eligible = (pos >= 1) & (pos <= len(its) - 2)
    next_end = ends[np.clip(pos + 1, 0, len(ends) - 1)]
    survives = (f < 0) | (f > next_end)
    return eligible & survives, pos, its


# A leak worth a finding reaches LEAK_SHARE of the peak within LEAK_HORIZON iterations.
LEAK_SHARE, LEAK_HORIZON = 0.01, 1000


def leak_findings(trace: Trace, device: int, rules=None) -> list[dict]:
    rep = replay(trace)[device]
    al = rep.allocations
    mask, pos, its = retained(trace, device)
    if not mask.any():
        return []
    eligible_its = list(range(1, len(its) - 1))
    need = len(eligible_its) if len(eligible_its) <= 2 else int(np.ceil(2 * len(eligible_its) / 3))
    sites = allocation_sites(trace, rep)
    sid = sites.key
    groups = []
    for s in np.unique(sid[mask]).tolist():
        rows = mask & (sid == s)
        per_it = np.bincount(pos[rows], weights=al.size[rows].astype(np.float64), minlength=len(its))
        present = [k for k in eligible_its if per_it[k] > 0]
        if len(present) >= need:
            lead = int(np.flatnonzero(rows)[0])
            groups.append({"site": site_info(trace, int(al.stack_id[lead]), int(sites.site_stack[lead])),
                           "rows": rows, "per_iteration": per_it})
    if not groups:
        return []
    groups.sort(key=lambda g: -g["per_iteration"].sum())
    rows = np.zeros(len(al), bool)
    for g in groups:
        rows |= g["rows"]
    per_it = sum(g["per_iteration"] for g in groups)
    per_iteration = [int(per_it[k]) for k in eligible_its]
    boundary = [rep.allocated_at(e) for _, _, e in its]
    growth = sustained_growth(boundary)
    if growth is None or growth < 0.5 * float(np.mean(per_iteration)):
        return []  # retained, but memory does not grow: e.g. the last batch held by its variable
    rate = int(round(growth))
    if rate * LEAK_HORIZON < LEAK_SHARE * rep.peak_allocated:  # e.g. one detached loss kept per step: 4 B
        return []
    live_end = rows & (al.free_index < 0)
    cats = categorize(trace, rules)[device]
    act_share = float(al.size[rows & (cats.labels == ACTIVATION)].sum()) / max(1, float(al.size[rows].sum()))
    top = [{"bytes": int(g["per_iteration"].sum()), "count": int(g["rows"].sum()),
            "bytes_per_iteration": [int(g["per_iteration"][k]) for k in eligible_its],
            **g["site"]} for g in groups[:MAX_GROUPS]]
    hint = (" Most of it is activations: something keeps each step's outputs and their autograd graph "
            "alive (e.g. outputs appended to a list, or `total += loss` instead of `loss.item()`)."
            if act_share >= 0.5 else "")
    where_list = "; ".join(f"{fmt_bytes(t['bytes'])} from {t['where']}" for t in top[:3])
    ends = fmt_distinct(boundary)
    return [{
        "kind": "leak", "device": device, "bytes": rate, "index": its[-1][2],
        "start_index": int(al.alloc_index[rows].min()), "end_index": its[-1][2],
        "bytes_per_iteration": per_iteration, "iterations": [its[k][0] for k in eligible_its],
        "retained_bytes": int(al.size[rows].sum()), "live_at_end_bytes": int(al.size[live_end].sum()),
        "allocated_at_iteration_end": boundary, "iteration_end_indices": [int(e) for _, _, e in its],
        "growth_per_iteration": rate, "activation_share": round(act_share, 3),
        "summary": (f"memory grows by about {fmt_bytes(rate)} per iteration and is never given back "
                    f"(allocated at iteration ends: {', '.join(ends)}): "
                    f"{where_list}.{hint}"),
        "frames": top[0]["frames"], "where": top[0]["where"], "top_stacks": top,
        "evidence": {"rule": "memory at each iteration's end grows step after step (from the end of iteration "
                             f"{its[1][0]} to the last, {rate:,} bytes per iteration), and the growth is "
                             "allocations made in one iteration still live after the next, from the same sites",
                     "events": [int(e) for _, _, e in its], "frames": top[0]["frames"][:8]},
    }]


def sustained_growth(ends: list) -> float | None:
    """Bytes per iteration by which memory at the iterations' ends grows, from the second end (the first is
    warm-up: optimizer state, lazy buffers) to the last; None unless it rises in most steps, gives back at most
    a quarter of what it gained, never falls below where it started, and ends higher."""
    e = [int(x) for x in ends[1:]]
    if len(e) < 2:
        return None
    steps = np.diff(e)
    rises, drops = int(steps[steps > 0].sum()), int(-steps[steps < 0].sum())
    if (e[-1] <= e[0] or min(e) < e[0] or drops > 0.25 * rises
            or (steps > 0).sum() < max(1, int(np.ceil(2 * len(steps) / 3)))):
        return None
    return (e[-1] - e[0]) / (len(e) - 1)


def fmt_distinct(values: list) -> list[str]:
    """Sizes with one unit scale and just enough decimals that different values never read the same."""
    from ..units import fmt_bytes_exact

    for digits in range(1, 7):
        shown = [fmt_bytes_exact(v, digits) for v in values]
        if all((a == b) == (x == y) for (a, x), (b, y) in zip(zip(shown, values), zip(shown[1:], values[1:]))):
            return shown
    return [f"{int(v):,} B" for v in values]
