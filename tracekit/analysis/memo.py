"""Memoise an analysis on the trace it analyses, so its result lives exactly as long as the trace."""
from __future__ import annotations

import functools


def per_trace(fn):
    """Cache fn(trace, *args) in the trace object itself (args must be hashable)."""

    @functools.wraps(fn)
    def wrapper(trace, *args):
        cache = trace.__dict__.setdefault("_memo", {})
        key = (fn.__module__, fn.__qualname__, args)
        if key not in cache:
            cache[key] = fn(trace, *args)
        return cache[key]

    return wrapper
