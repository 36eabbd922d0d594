"""What is live at one moment, by category and allocation site.

This is all a file without a timeline can show (a bare snapshot: segments
only, or a trace with no alloc/free entries): no time axis, just what was
live, grouped by category and by the line that allocated it.
"""
from __future__ import annotations

import numpy as np

from ..model import ALLOC, FREE_COMPLETED, Trace
from .categories import categorize
from .replay import replay
from .sites import allocation_where


def has_timeline(trace: Trace, device: int) -> bool:
    """Whether the device's trace allocates or frees anything (else memory never changes in it)."""
    action = trace.events.action[trace.device_events(device)]
    return bool(np.isin(action, (ALLOC, FREE_COMPLETED)).any())


def live_by_site(trace: Trace, device: int, index: int | None = None, rules=None) -> list[dict]:
    """Allocations live just after trace entry `index` (default: the end), grouped by category and site.

    Rows {category, site, bytes, count}: categories in stacking order, sites by
    bytes (largest first) within each category.
    """
    rep = replay(trace)[device]
    cats = categorize(trace, rules)[device]
    al = rep.allocations
    live = al.live_at(rep.n - 1 if index is None else index)
    strings, ids = allocation_where(trace, rep)  # the same sites as the report (sites.py)
    labels, sizes, stacks = cats.labels[live].astype(np.int64), al.size[live], ids[live]
    rows = []
    for code, name in enumerate(cats.names):
        mine = labels == code
        if not mine.any():
            continue
        uniq, inv = np.unique(stacks[mine], return_inverse=True)
        by_stack = np.bincount(inv, weights=sizes[mine].astype(np.float64))
        counts = np.bincount(inv)
        per_site: dict[str, list] = {}
        for s, b, c in zip(uniq, by_stack, counts):
            row = per_site.setdefault(strings[s], [0, 0])
            row[0] += int(round(b))
            row[1] += int(c)
        for where_, (b, c) in sorted(per_site.items(), key=lambda kv: -kv[1][0]):
            rows.append({"category": name, "site": where_, "bytes": b, "count": c})
    return rows
