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


def forget(trace, fn) -> None:
    """Drop what the memoised `fn` (a per_trace function) remembered on `trace`, for every argument: for a
    caller that knows nothing reads it again (a report that is printed and thrown away)."""
    cache = trace.__dict__.get("_memo")
    if not cache:
        return
    for key in [k for k in cache if k[:2] == (fn.__module__, fn.__qualname__)]:
        del cache[key]
