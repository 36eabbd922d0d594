"""The optional top-level keys of a snapshot, checked before anything uses them.

`tracekit` (our recorder's data, docs/format.md), `allocator_settings` (a dict,
torch >= 2.4) and `external_annotations` (record_function ranges, torch >= 2.5)
are used by the analyses as plain data; a wrong shape would surface as a
traceback deep inside one. `check_extras` refuses it up front with a message
naming the field. Fields not listed here pass through unchecked (only their
nesting depth is bounded), so newer recorders may add keys freely.
"""
from __future__ import annotations

import math

from .limits import check_depth, shown


class ShapeError(ValueError):
    """A known field has the wrong type; the message names it."""


INT_RANGE = (-(2**63), 2**64)


def _int(v, where):
    if isinstance(v, bool) or not isinstance(v, int) or not INT_RANGE[0] <= v < INT_RANGE[1]:
        raise ShapeError(f"{where} is {shown(v)}, not an integer")


def _time(v, where):
    """A time in µs: an integer, or a finite float (JSON writers may emit 1.7e15)."""
    if isinstance(v, float) and math.isfinite(v) and abs(v) < 2**62:
        return
    if isinstance(v, float):
        raise ShapeError(f"{where} is {shown(v)}, not a time in microseconds")
    _int(v, where)
    if abs(v) >= 2**62:
        raise ShapeError(f"{where} is {shown(v)}, too large to be a time in microseconds")


def _str(v, where):
    if not isinstance(v, str):
        raise ShapeError(f"{where} is {shown(v)}, not a string")


def _dict(fields):
    def check(v, where):
        if not isinstance(v, dict):
            raise ShapeError(f"{where} is {_kind(v)}, not a dict")
        for k, fn in fields.items():
            if v.get(k) is not None:
                fn(v[k], f"{where}.{k}")
    return check


def _list(item):
    def check(v, where):
        if not isinstance(v, (list, tuple)):
            raise ShapeError(f"{where} is {_kind(v)}, not a list")
        for i, x in enumerate(v):
            item(x, f"{where}[{i}]")
    return check


def _kind(v) -> str:
    return f"a {type(v).__name__} ({shown(v)})" if not isinstance(v, (list, tuple, dict)) else f"a {type(v).__name__}"


TRACEKIT = _dict({
    "version": _int, "backend": _str, "torch_version": _str, "python_version": _str,
    "devices": _list(_dict({"index": _int, "type": _str, "name": _str, "total_memory": _int})),
    "model": _dict({"class": _str, "parameters": _int, "parameter_bytes": _int, "trainable_parameters": _int,
                    "buffer_bytes": _int}),
    "optimizer": _dict({"class": _str, "param_groups": _int}),
    "phases": _list(_dict({"iteration": _int, "phase": _str, "start_us": _time, "end_us": _time})),
    "iterations": _list(_dict({"iteration": _int, "start_us": _time, "end_us": _time})),
    "tags": _list(_dict({"addr": _int, "size": _int, "device": _int, "time_us": _time, "kind": _str, "name": _str})),
    "command": _list(_str), "exit_code": _int, "error": _str, "settings": _dict({}),
})
ALLOCATOR_SETTINGS = _dict({})
EXTERNAL_ANNOTATIONS = _list(_dict({"name": _str, "stage": _str, "device": _int, "time_us": _time}))
CHECKS = {"tracekit": TRACEKIT, "allocator_settings": ALLOCATOR_SETTINGS, "external_annotations": EXTERNAL_ANNOTATIONS}


def check_extras(obj: dict) -> None:
    """Raise ShapeError (or LimitExceeded for deep nesting) if a known optional key is wrongly shaped."""
    for key, check in CHECKS.items():
        if obj.get(key) is not None:
            check_depth(obj[key], f"'{key}'")
            check(obj[key], f"'{key}'")


__all__ = ["check_extras", "ShapeError"]
