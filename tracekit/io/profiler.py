"""torch.profiler outputs -> Trace: Chrome/Kineto traces with `[memory]` events,
and the raw memory timeline (`export_memory_timeline_raw`).

Neither has allocator segments, so reserved memory comes from the
`Total Reserved` field (as synthetic segment events) and the replay invariant
does not apply; traces without `Addr` (torch 1.9) give totals but no lifetimes.
"""
from __future__ import annotations

import math

import numpy as np

from ..model import (ALLOC, FREE_COMPLETED, NO_TIME, SEGMENT_ALLOC, SEGMENT_FREE, Blocks, Events, Segments, Trace,
                     index_column)
from .columns import MAX_DEVICE, MAX_SIZE, MAX_TIME, MAX_TOTAL, Interner, check_sizes
from .limits import shown, text

CPU_DEVICE = -1  # profiler traces number CPU memory as device -1 (labelled "cpu")

# torch.profiler._memory_profiler: _CATEGORY_TO_INDEX and Action values
TIMELINE_CATEGORIES = ("parameter", "optimizer_state", "input", "temporary", "activation",
                       "gradient", "autograd_detail", "other")


def is_kineto(obj) -> bool:
    return isinstance(obj, dict) and "traceEvents" in obj


def is_memory_timeline(obj) -> bool:
    return (isinstance(obj, list) and bool(obj)
            and all(isinstance(r, list) and len(r) == 4 and all(isinstance(x, int) for x in r) for r in obj[:50]))


def kineto_to_trace(obj, path) -> Trace:
    events = obj["traceEvents"]
    if not isinstance(events, list):
        raise ValueError("'traceEvents' is not a list")
    mem = [(i, e) for i, e in enumerate(events)
           if isinstance(e, dict) and e.get("name") == "[memory]" and isinstance(e.get("args"), dict)]
    if not mem:
        raise ValueError("it is a profiler trace without [memory] events: record it with profile_memory=True")
    rows_in = [_memory_event(i, e) for i, e in mem]
    rows_in.sort(key=lambda r: r["order"])
    has_addr = all(r["addr"] is not None for r in rows_in)
    has_totals = all(r["total_allocated"] is not None for r in rows_in)
    rows: dict[str, list]
    rows = {k: [] for k in ("device", "action", "addr", "size", "time_us")}
    reserved: dict = {}
    ever_reserved = set()
    initial = {}
    first_reserved: dict = {}
    for r in rows_in:
        dev, nbytes, ts = r["device"], r["bytes"], r["ts"]
        if has_totals and dev not in initial:
            initial[dev] = r["total_allocated"] - nbytes
        res = r["total_reserved"]
        if res is not None:
            first_reserved.setdefault(dev, res)
            if res:
                ever_reserved.add(dev)
            prev = reserved.get(dev)
            if prev is not None and res != prev:
                _row(rows, dev, SEGMENT_ALLOC if res > prev else SEGMENT_FREE, 0, abs(res - prev), ts)
            reserved[dev] = res
        _row(rows, dev, ALLOC if nbytes >= 0 else FREE_COMPLETED, (r["addr"] or 0) % 2**64, abs(nbytes), ts)
    # a device whose Total Reserved is always 0 (CPU memory) has no reserved figure
    first_reserved = {dev: r for dev, r in first_reserved.items() if dev in ever_reserved}
    meta = {"has_addresses": has_addr, "has_segments": False, "initial_allocated": initial,
            "initial_reserved": first_reserved,
            "present_fields": sorted({text(k)[:100] for _, e in mem for k in e["args"]}),
            "kineto_events": len(events), "device_labels": {CPU_DEVICE: "cpu"}}
    return _trace(path, "kineto", rows, meta)


def _memory_event(i, e) -> dict:
    """The fields of one `[memory]` event, checked: ValueError naming the event and field otherwise."""
    a = e["args"]
    where = f"traceEvents[{i}]"
    dev_type = _number(a, "Device Type", where, 0, 0, 2**16)
    dev = _number(a, "Device Id", where, 0, -1, MAX_DEVICE) if dev_type == 1 else CPU_DEVICE
    return {
        "device": dev,
        "bytes": _number(a, "Bytes", where, 0, -MAX_SIZE, MAX_SIZE),
        "ts": _number(e, "ts", where, 0, -MAX_TIME, MAX_TIME),
        "order": e.get("ts", 0),  # sort by the exact time, as written (checked just above)
        "addr": _number(a, "Addr", where, None, -(2**63), 2**64),
        "total_allocated": _number(a, "Total Allocated", where, None, -MAX_TOTAL, MAX_TOTAL),
        "total_reserved": _number(a, "Total Reserved", where, None, -MAX_TOTAL, MAX_TOTAL),
    }


def _number(d, key, where, default, lo, hi):
    """d[key] as an int in [lo, hi) (floats rounded), `default` when absent."""
    if key not in d:
        return default
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (isinstance(v, float) and not math.isfinite(v)):
        raise ValueError(f"{where} has {key!r}={shown(v)}, not a number")
    if not lo <= v < hi:
        raise ValueError(f"{where} has {key!r}={shown(v)}, out of range")
    return int(round(v)) if isinstance(v, float) else v


def memory_timeline_to_trace(rows_in, path) -> Trace:
    rows: dict[str, list]
    rows = {k: [] for k in ("device", "action", "addr", "size", "time_us")}
    cats = []
    for i, r in enumerate(rows_in):
        if not (isinstance(r, list) and len(r) == 4 and all(isinstance(x, int) and not isinstance(x, bool) for x in r)):
            raise ValueError(f"row {i} of the memory timeline is {shown(r)}, not [time_ns, action, bytes, category]")
        t, action, nbytes, cat = r
        if not (-MAX_TIME < t < MAX_TIME and -MAX_SIZE <= nbytes <= MAX_SIZE):
            raise ValueError(f"row {i} of the memory timeline is {shown(r)}: time or bytes out of range")
        _row(rows, 0, ALLOC if nbytes >= 0 else FREE_COMPLETED, 0, abs(nbytes), t // 1000 if t >= 0 else NO_TIME)
        cats.append(TIMELINE_CATEGORIES[cat] if 0 <= cat < len(TIMELINE_CATEGORIES) else "other")
    meta = {"has_addresses": False, "has_segments": False, "initial_allocated": {0: 0},
            "present_fields": ["time_ns", "action", "bytes", "category"],
            "category_source": "torch.profiler._memory_profiler",
            # the raw export names no device (export_memory_timeline picks cpu or cuda:0 itself): say so
            "device_labels": {0: "(device not in file)"}}
    return _trace(path, "memory_timeline", rows, meta, categories=cats)


def _row(rows, dev, action, addr, size, ts):
    rows["device"].append(dev)
    rows["action"].append(action)
    rows["addr"].append(addr)
    rows["size"].append(size)
    rows["time_us"].append(ts)


def _trace(path, fmt, rows, meta, categories=None) -> Trace:
    it = Interner()
    dev = np.array(rows["device"], dtype=np.int32)
    order = np.argsort(dev, kind="stable")
    n = len(dev)
    index = index_column(n)  # each device's own positions, below
    sorted_dev = dev[order]
    for d in np.unique(sorted_dev):
        m = sorted_dev == d
        index[m] = np.arange(int(m.sum()))
    for d in np.unique(dev):
        check_sizes(np.array(rows["size"], dtype=np.int64)[dev == d], f"device {int(d)} memory event")
    cat = np.zeros(n, dtype=np.int32)
    if categories is not None:
        cat = np.array([it.strings.intern(c) for c in categories], dtype=np.int32)[order]
    ev = Events(
        device=sorted_dev, index=index,
        action=np.array(rows["action"], dtype=np.int8)[order],
        addr=np.array(rows["addr"], dtype=np.uint64)[order],
        size=np.array(rows["size"], dtype=np.int64)[order],
        stream=np.zeros(n, dtype=np.int64),
        time_us=np.array(rows["time_us"], dtype=np.int64)[order],
        stack_id=np.full(n, -1, dtype=np.int32),
        user_metadata=np.zeros(n, dtype=np.int32), compile_context=np.zeros(n, dtype=np.int32),
        category=cat, device_free=np.zeros(n, dtype=np.int64),
    )
    empty_i32, empty_u64, empty_i64 = (np.zeros(0, dtype=t) for t in (np.int32, np.uint64, np.int64))
    segs = Segments(device=empty_i32, address=empty_u64, total_size=empty_i64, stream=empty_i64,
                    segment_type=empty_i32, pool_id=empty_i32, is_expandable=np.zeros(0, bool), stack_id=empty_i32)
    blocks = Blocks(device=empty_i32, segment=empty_i32, addr=empty_u64, size=empty_i64,
                    requested_size=empty_i64, state=np.zeros(0, np.int8), stack_id=empty_i32)
    return Trace(path=str(path), format=fmt, devices=sorted(int(d) for d in np.unique(dev)),
                 strings=it.strings, frames=it.frames(), stacks=it.stacks(), events=ev,
                 segments=segs, blocks=blocks, meta=meta)
