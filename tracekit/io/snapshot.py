"""PyTorch memory snapshots (any version, as a dict from pickle or JSON) -> Trace.

Tolerant of every layout in DESIGN.md §3: torch 2.0 bare segment lists and
block `history`, optional `time_us`, expandable segments, several devices and
streams, `oom` entries, unknown future actions and keys. Structural problems
raise `SnapshotError` with a sentence saying where and what.
"""
from __future__ import annotations

from operator import itemgetter

import numpy as np

from ..model import (ACTION, BLOCK_STATE, NO_TIME, OOM, OTHER, Blocks, Events, Segments, Trace, constant_column,
                     index_column)
from .columns import MAX_DEVICE, MAX_SIZE, MAX_TIME, MAX_TOTAL, FramesError, Interner, check_sizes, int_column
from .extras import check_extras
from .limits import shown, text


class SnapshotError(ValueError):
    """The data is not a usable memory snapshot; the message says why."""


KNOWN_TOP_KEYS = {"segments", "device_traces", "allocator_settings", "external_annotations", "tracekit"}


def is_snapshot(obj) -> bool:
    if isinstance(obj, dict):
        return "segments" in obj
    return isinstance(obj, list) and all(isinstance(s, dict) and "blocks" in s for s in obj[:5]) and bool(obj)


def snapshot_to_trace(obj, path, progress=None, columns_of=None) -> Trace:
    """Convert a snapshot dict (or torch 2.0's bare list of segments) to a Trace.

    `columns_of(device, interner, present, unknown)`, when given, makes each device's event columns
    instead of its entry dicts (the streaming reader, stream.py, which has no entry dicts)."""
    bare_list = isinstance(obj, list)
    if bare_list:
        obj = {"segments": obj}
    if not isinstance(obj, dict) or "segments" not in obj:
        raise SnapshotError("it has no 'segments', so it is not a PyTorch memory snapshot")
    segments = obj["segments"]
    traces = obj.get("device_traces") or []
    if not isinstance(segments, list):
        raise SnapshotError(f"'segments' is a {type(segments).__name__}, not a list")
    if not isinstance(traces, list) or not all(isinstance(t, list) for t in traces):
        raise SnapshotError("'device_traces' is not a list of lists (one list of entries per device)")

    check_extras(obj)
    it = Interner()
    meta = {k: obj[k] for k in ("allocator_settings", "external_annotations", "tracekit") if k in obj}
    meta["other_keys"] = sorted(text(k)[:100] for k in obj if k not in KNOWN_TOP_KEYS)
    labels = (obj.get("tracekit_export") or {}).get("devices") if isinstance(obj.get("tracekit_export"), dict) else None
    if isinstance(labels, list):  # a profiler trace converted by `tracekit export`: its device names
        meta["device_labels"] = {d["index"]: d["label"] for d in labels if isinstance(d, dict)
                                 and isinstance(d.get("index"), int) and isinstance(d.get("label"), str)}
    meta["bare_list"] = bare_list
    present: set
    unknown: set
    columns, present, unknown = [], set(), set()
    if len(traces) > MAX_DEVICE:
        raise SnapshotError(f"'device_traces' has {len(traces)} lists, more than torch has device numbers "
                            f"({MAX_DEVICE})")
    total = sum(len(t) for t in traces) or 1
    done = 0
    for device, entries in enumerate(traces):
        if columns_of is not None:
            col = columns_of(device, it, present, unknown)
            columns += [col] if col is not None else []
        elif entries:
            try:
                columns.append(_events_of(device, entries, it, present, unknown))
            except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
                raise SnapshotError(_explain_entries(device, entries, e)) from None
        done += len(entries)
        if progress:
            progress(done / total, "converting entries")
    segs, blocks = _segments_of(segments, it)
    devices = sorted({int(c["device"][0]) for c in columns} | set(int(d) for d in np.unique(segs["device"])))
    meta.update(present_fields=sorted(present), unknown_actions=sorted(unknown),
                has_segments=True, max_device_trace_index=len(traces) - 1)
    return Trace(
        path=str(path), format="snapshot", devices=devices, strings=it.strings,
        frames=it.frames(), stacks=it.stacks(), events=_concat_events(columns),
        segments=Segments(**{k: segs[k] for k in Segments.__dataclass_fields__}),
        blocks=Blocks(**blocks), meta=meta,
    )


def _events_of(device, entries, it, present, unknown) -> dict:
    n = len(entries)
    if not all(type(e) is dict for e in entries):
        raise TypeError("an entry is not a dict")
    keys = set().union(*entries)
    present.update(text(k)[:100] for k in keys)
    actions = _values(entries, "action", keys, None)
    if not set(map(type, actions)) <= {str}:  # checked before hashing: a deep tuple's hash can crash CPython
        i = next(i for i, a in enumerate(actions) if type(a) is not str)
        raise ValueError(f"device_traces[{device}][{i}] has action={shown(actions[i])}, not a string")
    code = {a: ACTION.get(a, OTHER) for a in set(actions)}
    unknown.update(text(a)[:100] for a in code if code[a] == OTHER and a != "other")
    action = np.fromiter(map(code.__getitem__, actions), dtype=np.int8, count=n)
    what = f"device {device} entry"
    col = {
        "device": np.full(n, device, dtype=np.int32),
        "index": index_column(n),
        "action": action,
        "addr": int_column(_values(entries, "addr", keys, 0), np.uint64, what),
        "size": int_column(_values(entries, "size", keys, 0), np.int64, what),
        "stream": _stream_column(_values(entries, "stream", keys, 0)),
        "time_us": int_column(_values(entries, "time_us", keys, NO_TIME), np.int64, what + " time_us"),
        "stack_id": _stack_column(_values(entries, "frames", keys, None), it),
        "user_metadata": _string_column(_values(entries, "user_metadata", keys, ""), it),
        "compile_context": _string_column(_values(entries, "compile_context", keys, ""), it),
        "category": _string_column(_values(entries, "category", keys, ""), it),
        "device_free": np.zeros(n, dtype=np.int64),
        "forward_stack_id": _stack_column(_values(entries, "forward_frames", keys, None), it),
        "module": _string_column(_values(entries, "module", keys, ""), it),
    }
    for i in np.flatnonzero(action == OOM).tolist():
        free = entries[i].get("device_free", 0)
        if free is not None and (isinstance(free, bool) or not isinstance(free, int) or not 0 <= free < MAX_TOTAL):
            raise ValueError(f"device_traces[{device}][{i}] has device_free={shown(free)}, not a byte count")
        col["device_free"][i] = free or 0
    check_sizes(col["size"], what)
    t = col["time_us"]
    bad = (t != NO_TIME) & ((t >= MAX_TIME) | (t <= -MAX_TIME))
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise ValueError(f"device_traces[{device}][{i}] has time_us={int(t[i])}, too far from any real time")
    return col


def _values(entries, key, keys, default) -> list:
    """entries[i][key] for all i, fast when every entry has the key."""
    if key not in keys:
        return [default] * len(entries)
    try:
        return list(map(itemgetter(key), entries))
    except KeyError:
        return [e.get(key, default) for e in entries]


def _string_column(values, it) -> np.ndarray:
    """Intern only the distinct values (most entries share a handful)."""
    if not set(map(type, values)) <= {str}:  # anything else as its short text (never hashed as is)
        values = [text(v) for v in values]
    distinct = set(values)
    ids = {v: it.strings.intern(text(v)) for v in distinct}
    return np.fromiter(map(ids.__getitem__, values), dtype=np.int32, count=len(values))


def _stack_column(frames, it) -> np.ndarray:
    return np.array(it.stack_ids(frames), dtype=np.int32)


def _stream_column(values):
    try:
        return np.array(values, dtype=np.int64)
    except (OverflowError, TypeError, ValueError):
        # raw stream pointers beyond int64, or junk: keep distinct values distinct
        ids = {}
        return np.array([ids.setdefault(text(v), len(ids)) for v in values], dtype=np.int64)


def _explain_entries(device, entries, error) -> str:
    """Find the first entry that breaks conversion and say what is wrong with it."""
    for i, e in enumerate(entries):
        if not isinstance(e, dict):
            return f"device_traces[{device}][{i}] is a {type(e).__name__}, not a trace entry (dict)"
        if "action" not in e:
            return f"device_traces[{device}][{i}] has no 'action'"
        if type(e["action"]) is not str:  # never hash it: a deep tuple's hash can crash CPython
            return f"device_traces[{device}][{i}] has action={shown(e['action'])}, not a string"
        for key in ("addr", "size", "time_us"):
            v = e.get(key, 0)
            if isinstance(v, bool) or not isinstance(v, int) or not (0 if key == "addr" else -(2**63)) <= v < 2**64:
                return f"device_traces[{device}][{i}] has {key}={shown(v)}, not an integer in range"
        frames = e.get("frames")
        if frames and not isinstance(frames, (list, tuple)):
            return f"device_traces[{device}][{i}] has 'frames' of type {type(frames).__name__}, not a list"
    if isinstance(error, FramesError):
        return f"device_traces[{device}]: {error}"
    if isinstance(error, (ValueError, OverflowError)) and str(error):  # our own messages name the entry
        return str(error)[:300]
    return f"device_traces[{device}] could not be read ({type(error).__name__}: {text(str(error))[:200]})"


def _concat_events(columns) -> Events:
    if not columns:
        empty = {k: np.zeros(0, dtype=t) for k, t in _EVENT_DTYPES.items()}
        return Events(**empty)
    if len(columns) == 1:  # one device: its columns as they are (no copy of a large trace)
        return Events(**{k: np.asarray(columns[0][k], dtype=t) for k, t in _EVENT_DTYPES.items()})
    return Events(**{k: _concat_column([c[k] for c in columns], t) for k, t in _EVENT_DTYPES.items()})


def _concat_column(parts, dtype):
    """The devices' columns end to end; one value throughout stays a constant column (no memory)."""
    parts = [np.asarray(p) for p in parts]
    if all(p.strides == (0,) for p in parts if len(p) > 1):
        values = {p[0].item() for p in parts if len(p)}
        if len(values) == 1 and len({p.dtype for p in parts}) == 1:
            return constant_column(values.pop(), sum(len(p) for p in parts), parts[0].dtype)
    return np.concatenate(parts)


_EVENT_DTYPES = {
    "device": np.int32, "index": np.int32, "action": np.int8, "addr": np.uint64, "size": np.int64,
    "stream": np.int64, "time_us": np.int64, "stack_id": np.int32, "user_metadata": np.int32,
    "compile_context": np.int32, "category": np.int32, "device_free": np.int64,
    "forward_stack_id": np.int32, "module": np.int32,
}


def _segments_of(segments, it):
    seg = {k: [] for k in ("device", "address", "total_size", "stream", "segment_type", "pool_id", "is_expandable", "stack_id")}
    blk = {k: [] for k in ("device", "segment", "addr", "size", "requested_size", "state", "stack_id")}
    intern = it.strings.intern
    for si, s in enumerate(segments):
        where = f"segments[{si}]"
        if not isinstance(s, dict):
            raise SnapshotError(f"{where} is a {type(s).__name__}, not a segment (dict)")
        device = _int(s.get("device", 0), where, "device")
        if device >= MAX_DEVICE:
            raise SnapshotError(f"{where} has device={device}, beyond torch's device numbers (0-{MAX_DEVICE - 1})")
        address = _int(s.get("address", 0), where, "address")
        blocks = s.get("blocks", [])
        if not isinstance(blocks, list):
            raise SnapshotError(f"{where}.blocks is not a list")
        total = s.get("total_size")
        if total is None:
            total = sum(_size(b.get("size", 0), where, "block size") for b in blocks if isinstance(b, dict))
        seg["device"].append(device)
        seg["address"].append(address)
        seg["total_size"].append(_size(total, where, "total_size"))
        stream = s.get("stream", 0)
        seg["stream"].append(stream if isinstance(stream, int) and -(2**63) <= stream < 2**63 else 0)
        seg["segment_type"].append(intern(text(s.get("segment_type", ""))))
        seg["pool_id"].append(intern(_pool(s.get("segment_pool_id"))))
        seg["is_expandable"].append(s.get("is_expandable") is True)
        seg["stack_id"].append(_stack(it, s.get("frames"), where))
        offset = address
        for bi, b in enumerate(blocks):
            bw = f"{where}.blocks[{bi}]"
            if not isinstance(b, dict):
                raise SnapshotError(f"{bw} is a {type(b).__name__}, not a block (dict)")
            size = _size(b.get("size", 0), bw, "size")
            addr = _int(b["address"], bw, "address") if "address" in b else offset
            offset = addr + size
            frames = b.get("frames")
            if frames is None and isinstance(b.get("history"), list) and b["history"]:
                last = b["history"][-1]
                frames = last.get("frames") if isinstance(last, dict) else None
            state = b.get("state")
            blk["device"].append(device)
            blk["segment"].append(si)
            blk["addr"].append(addr)
            blk["size"].append(size)
            blk["requested_size"].append(_size(b.get("requested_size", size), bw, "requested_size"))
            blk["state"].append(BLOCK_STATE.get(state, BLOCK_STATE["unknown"]) if isinstance(state, str)
                                else BLOCK_STATE["unknown"])
            blk["stack_id"].append(_stack(it, frames, bw))
    dtypes = {"device": np.int32, "address": np.uint64, "total_size": np.int64, "stream": np.int64,
              "segment_type": np.int32, "pool_id": np.int32, "is_expandable": bool, "stack_id": np.int32,
              "segment": np.int32, "addr": np.uint64, "size": np.int64, "requested_size": np.int64, "state": np.int8}
    try:
        seg = {k: np.array(v, dtype=dtypes[k]) for k, v in seg.items()}
        blk = {k: np.array(v, dtype=dtypes[k]) for k, v in blk.items()}
    except (OverflowError, ValueError) as e:
        raise SnapshotError(f"a segment or block field is out of range ({e})") from None
    for what, sizes in (("segments' total_size", seg["total_size"]), ("blocks' size", blk["size"])):
        if float(sizes.sum(dtype=np.float64)) >= MAX_TOTAL:
            raise SnapshotError(f"the {what} add up to more than 2**62 bytes")
    return seg, blk


def _stack(it, frames, where) -> int:
    try:
        return it.stack_id(frames)
    except FramesError as e:
        raise SnapshotError(f"{where}: {e}") from None


def _size(v, where, what) -> int:
    v = _int(v, where, what)
    if v > MAX_SIZE:
        raise SnapshotError(f"{where} has {what}={v}, larger than any device (1 PiB)")
    return v


def _int(v, where, what) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise SnapshotError(f"{where} has {what}={shown(v)}, not an integer")
    if v >= 2**64:
        raise SnapshotError(f"{where} has {what}={shown(v)}, out of range")
    if v < 0:
        raise SnapshotError(f"{where} has a negative {what} ({v})")
    return v


def _pool(p) -> str:
    if p is None:
        return ""
    if isinstance(p, (list, tuple)):
        return ",".join(text(x) for x in p[:8])
    return text(p)
