"""torch.profiler outputs -> Trace: Chrome/Kineto traces with `[memory]` events,
and the raw memory timeline (`export_memory_timeline_raw`).

Neither has allocator segments, so reserved memory comes from the
`Total Reserved` field (as synthetic segment events) and the replay invariant
does not apply; traces without `Addr` (torch 1.9) give totals but no lifetimes.
"""
from __future__ import annotations

import numpy as np

from ..model import ALLOC, FREE_COMPLETED, NO_TIME, SEGMENT_ALLOC, SEGMENT_FREE, Blocks, Events, Segments, Trace
from .columns import Interner

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
    mem = [e for e in events if isinstance(e, dict) and e.get("name") == "[memory]" and isinstance(e.get("args"), dict)]
    if not mem:
        raise ValueError("it is a profiler trace without [memory] events: record it with profile_memory=True")
    mem.sort(key=lambda e: e.get("ts", 0))
    has_addr = all("Addr" in e["args"] for e in mem)
    has_totals = all("Total Allocated" in e["args"] for e in mem)
    rows = {k: [] for k in ("device", "action", "addr", "size", "time_us")}
    reserved = {}
    ever_reserved = set()
    initial = {}
    for e in mem:
        a = e["args"]
        dev = int(a.get("Device Id", 0)) if int(a.get("Device Type", 0)) == 1 else CPU_DEVICE
        nbytes = int(a.get("Bytes", 0))
        ts = int(round(float(e.get("ts", 0))))
        if has_totals and dev not in initial:
            initial[dev] = int(a["Total Allocated"]) - nbytes
        if "Total Reserved" in a:
            r = int(a["Total Reserved"])
            if r:
                ever_reserved.add(dev)
            prev = reserved.get(dev)
            if prev is not None and r != prev:
                _row(rows, dev, SEGMENT_ALLOC if r > prev else SEGMENT_FREE, 0, abs(r - prev), ts)
            reserved[dev] = r
        addr = int(a.get("Addr", 0)) % 2**64
        _row(rows, dev, ALLOC if nbytes >= 0 else FREE_COMPLETED, addr, abs(nbytes), ts)
    first_reserved = {}
    for e in mem:
        a = e["args"]
        dev = int(a.get("Device Id", 0)) if int(a.get("Device Type", 0)) == 1 else CPU_DEVICE
        if "Total Reserved" in a and dev not in first_reserved:
            first_reserved[dev] = int(a["Total Reserved"])
    # a device whose Total Reserved is always 0 (CPU memory) has no reserved figure
    first_reserved = {dev: r for dev, r in first_reserved.items() if dev in ever_reserved}
    meta = {"has_addresses": has_addr, "has_segments": False, "initial_allocated": initial,
            "initial_reserved": first_reserved, "present_fields": sorted({k for e in mem for k in e["args"]}),
            "kineto_events": len(events), "device_labels": {CPU_DEVICE: "cpu"}}
    return _trace(path, "kineto", rows, meta)


def memory_timeline_to_trace(rows_in, path) -> Trace:
    rows = {k: [] for k in ("device", "action", "addr", "size", "time_us")}
    cats = []
    for t, action, nbytes, cat in rows_in:
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
    index = np.zeros(n, dtype=np.int64)
    sorted_dev = dev[order]
    for d in np.unique(sorted_dev):
        m = sorted_dev == d
        index[m] = np.arange(int(m.sum()))
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
