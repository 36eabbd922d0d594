"""The report of one file (what `report --json` prints), kept in the cache beside the file's columns.

The report is a pure function of the file's content, the window, the user rules and the estimate
options, and of tracekit's own code; so it is stored under the file's cache key with a name made of
all of those (the code by the size and mtime of every module in the package), and a second
`report --json` of an unchanged file reads it instead of loading and analysing the trace.
"""
from __future__ import annotations

import hashlib
import json
import os

from . import cachefiles as cache

_STAMP = None
_STAMPS = {}


def code_stamp(root=None) -> str:
    """A hash of the name, size and mtime of every module of the installed tracekit package (or of the
    package folder `root`, for code outside tracekit whose results are stored too: the viewer's)."""
    global _STAMP
    if root is None and _STAMP is not None:
        return _STAMP
    folder0 = root or os.path.dirname(os.path.abspath(__file__))
    if folder0 not in _STAMPS:
        h = hashlib.sha256(str(cache.VERSION).encode())
        for folder, dirs, files in os.walk(folder0):
            dirs.sort()
            for name in sorted(files):
                if name.endswith((".py", ".so", ".pyd", ".toml", ".json")):
                    st = os.stat(os.path.join(folder, name))
                    h.update(f"{os.path.relpath(os.path.join(folder, name), folder0)} {st.st_size} {st.st_mtime_ns}\n"
                             .encode())
        _STAMPS[folder0] = h.hexdigest()[:16]
    if root is None:
        _STAMP = _STAMPS[folder0]
    return _STAMPS[folder0]


def result_name(window=None, rules=None, estimate=None) -> str | None:
    """What, besides the file, the report depends on, as the name it is stored under; None when the
    options cannot be named exactly (then the report is computed every time)."""
    try:
        if estimate and (estimate.get("shape") is not None or set(estimate) - {"shape", "overrides"}):
            return None
        overrides = json.dumps((estimate or {}).get("overrides") or {}, sort_keys=True)
        rules_id = "none"
        if rules is not None:
            if not isinstance(rules, (str, os.PathLike)):
                return None
            with cache.open_regular(rules) as f:
                rules_id = hashlib.sha256(f.read()).hexdigest()
    except (OSError, TypeError, ValueError):
        return None
    return f"report code={code_stamp()} window={window!r} rules={rules_id} estimate={overrides}"


def file_report(path, open_trace, use_cache=True, window=None, rules=None, estimate=None, want_trace=False):
    """(report, trace): the report of `path` cut to `window` (with a "window" entry when cut), and the
    trace it is about (None when the report came from the cache and `want_trace` is false).
    `open_trace(path, no_cache, window)` loads and cuts the trace."""
    name = result_name(window, rules, estimate) if use_cache else None
    key = _key(path) if name else None
    if key:
        hit = cache.result(key, name)
        if isinstance(hit, dict) and "file" in hit:
            trace = open_trace(path, False, window) if want_trace else None
            return {**hit, "file": os.fsdecode(os.fspath(path))}, trace
    from .analysis.report import build_report

    trace = open_trace(path, not use_cache, window)
    report = build_report(trace, rules=rules, estimate=estimate)
    cut = trace.meta.get("window")
    out = {**report, "window": cut} if cut else report
    if key and _key(path) == key:  # the file did not change while it was read
        try:
            cache.store_result(key, name, json.loads(json.dumps(out)))
        except (TypeError, ValueError):
            pass
    return out, trace


def _key(path):
    try:
        return cache.key_for(os.fsdecode(os.fspath(path)), None)
    except (OSError, ValueError):
        return None
