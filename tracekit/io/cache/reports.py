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

from . import folder
from .folder import code_stamp


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
            with folder.open_regular(rules) as f:
                rules_id = hashlib.sha256(f.read()).hexdigest()
    except (OSError, TypeError, ValueError):
        return None
    return f"report code={code_stamp()} window={window!r} rules={rules_id} estimate={overrides}"


def file_report(path, open_trace, analyse, use_cache=True, window=None, rules=None, estimate=None,
                want_trace=False):
    """(report, trace): the report of `path` cut to `window` (with a "window" entry when cut), and the
    trace it is about (None when the report came from the cache and `want_trace` is false).
    `open_trace(path, no_cache, window)` loads and cuts the trace (it may write the cache's entry on a thread:
    traces.write_soon); `analyse(trace, rules=, estimate=)`
    makes the report (tracekit.analysis.report.build_report)."""
    with folder.hashed_once():  # a file not seen before is hashed once, not before and in load
        try:
            return _file_report(path, open_trace, analyse, use_cache, window, rules, estimate, want_trace)
        finally:
            folder.wait_written()  # an entry open_trace writes beside the analysis is whole when this returns


def _file_report(path, open_trace, analyse, use_cache, window, rules, estimate, want_trace):
    name = result_name(window, rules, estimate) if use_cache else None
    pending = _key_soon(path) if name else None
    key = pending.result() if pending is not None and pending.done() else None
    if key:
        hit = folder.result(key, name)
        if isinstance(hit, dict) and "file" in hit:
            trace = open_trace(path, False, window) if want_trace else None
            return {**hit, "file": os.fsdecode(os.fspath(path))}, trace
    trace = open_trace(path, not use_cache, window)  # a big file not opened before: hashed meanwhile (load)
    if pending is not None and not key:
        key = pending.result()
        hit = folder.result(key, name) if key else None  # (a copy of a file whose report is kept)
        if isinstance(hit, dict) and "file" in hit:
            return {**hit, "file": os.fsdecode(os.fspath(path))}, trace if want_trace else None
    report = analyse(trace, rules=rules, estimate=estimate)
    cut = trace.meta.get("window")
    # how the window was read (window.read: only its entries, or the whole file and why) is said by the text
    # report, info and the viewer; the JSON report is the same however the file was read (and cached)
    out = {**report, "window": {k: v for k, v in cut.items() if k != "read"}} if cut else report
    if trace.meta.get("names_cut"):  # the report served from the cache says so too (the warning line)
        out = {**out, "names_cut": trace.meta["names_cut"]}
    folder.wait_written()  # the trace's entry, which the result is kept beside
    if key and _key(path) == key:  # the file did not change while it was read
        try:
            folder.store_result(key, name, json.loads(json.dumps(out)))
        except (TypeError, ValueError):
            pass
    return out, trace


def _key_soon(path):
    try:
        return folder.key_soon(os.fsdecode(os.fspath(path)))
    except (OSError, ValueError):
        return None


def _key(path):
    try:
        return folder.key_for(os.fsdecode(os.fspath(path)), None)
    except (OSError, ValueError):
        return None
