"""Out of memory: every sign in a file that the run failed for want of memory, and what the run needed.

A file records an out-of-memory error (OOM) in one of three ways:

- an `oom` trace entry: the caching allocator could not serve a request (the request's size, the
  device's free bytes at that moment; PyTorch's OOM-observer dumps end with one, and so does every
  history recorded through an OOM);
- our recorder's exception marker: the `error` it stores when the recorded code raised
  ("OutOfMemoryError: CUDA out of memory. Tried to allocate 512.00 MiB. GPU 0 ... 1024.00 MiB
  allowed ..."; the CPU allocator's "can't allocate memory: you tried to allocate N bytes");
- neither, but the allocator's own counter (`num_ooms` in the recorder's `allocator_stats`) is above
  zero: it counts the whole process, so it may predate the recording and is reported as a note only.

A run that ran out of memory did not show what it needed: it needed at least what was live when the
request failed plus the request (and never less than its recorded peak). That lower bound is its
*demand*, which `check`, `whatif`, `diff`, the rank report and the viewer use in place of the peak.

A torch 2.0 OOM-observer dump recorded with that version's default one-entry ring buffer holds only
the `snapshot` entry the dump itself made (it overwrote the `oom` entry): nothing in such a file says
that it was taken at an OOM, so nothing here claims it was.
"""
from __future__ import annotations

import re

import numpy as np

from ..model import OOM, Trace
from .memo import per_trace
from .replay import replay

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB")
_SIZE = r"(\d+(?:\.\d+)?)\s*(B|KiB|MiB|GiB|TiB|bytes)"
_OOM_TEXT = re.compile(r"out of memory|OutOfMemoryError|can't allocate memory|cannot allocate memory"
                       r"|CUBLAS_STATUS_ALLOC_FAILED|cudaErrorMemoryAllocation", re.I)
_TRIED = re.compile(rf"(?:Tried|tried) to allocate {_SIZE}")
_GPU = re.compile(r"\bGPU (\d+)\b")
_FREE = re.compile(rf"of which {_SIZE} is free|;\s*{_SIZE} free;")
_ALLOWED = re.compile(rf"{_SIZE} allowed")
_CAPACITY = re.compile(rf"total capacity of {_SIZE}|{_SIZE} total capacity")
_BY_PYTORCH = re.compile(rf"{_SIZE} is allocated by PyTorch|{_SIZE} already allocated")
MAX_MESSAGE = 400


def _bytes(number: str, unit: str) -> int:
    if unit == "bytes":
        return int(float(number))
    return int(round(float(number) * 1024 ** _UNITS.index(unit)))


def _find(pattern, text) -> int | None:
    m = pattern.search(text)
    if not m:
        return None
    groups = [g for g in m.groups()]
    for k in range(0, len(groups), 2):
        if groups[k] is not None:
            return _bytes(groups[k], groups[k + 1])
    return None


def parse_error(error) -> dict | None:
    """What an exception message says about an out-of-memory error; None when it is not one.

    {"message", "request_bytes", "gpu", "device_free_bytes", "limit_bytes", "total_bytes",
    "allocated_bytes"}: each None where the message does not say."""
    if error is None:
        return None
    text = error if isinstance(error, str) else repr(error)
    if not _OOM_TEXT.search(text):
        return None
    gpu = _GPU.search(text)
    return {"message": text if len(text) <= MAX_MESSAGE else text[:MAX_MESSAGE] + "...",
            "request_bytes": _find(_TRIED, text), "gpu": int(gpu.group(1)) if gpu else None,
            "device_free_bytes": _find(_FREE, text), "limit_bytes": _find(_ALLOWED, text),
            "total_bytes": _find(_CAPACITY, text), "allocated_bytes": _find(_BY_PYTORCH, text),
            "cpu": bool(re.search(r"CPUAllocator|can't allocate memory: you tried", text))}


def recorded_device(trace: Trace, device: int) -> dict:
    """The recorder's entry for `device` ({} when it stored none)."""
    for d in (trace.recorder or {}).get("devices") or []:
        if isinstance(d, dict) and d.get("index") == device:
            return d
    return {}


def _int(v) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else None


def allocator_limit(trace: Trace, device: int) -> int | None:
    """The caching allocator's cap on this device (a per-process memory fraction), if the file says:
    the recorder stores it; torch's out-of-memory message says "1024.00 MiB allowed"."""
    got = _int(recorded_device(trace, device).get("memory_limit_bytes"))
    if got is not None:
        return got
    parsed = parse_error((trace.recorder or {}).get("error"))
    if parsed and parsed["limit_bytes"] and (parsed["gpu"] is None or parsed["gpu"] == device):
        return parsed["limit_bytes"]
    return None


@per_trace
def out_of_memory(trace: Trace) -> list[dict]:
    """Every out-of-memory error the file records, oldest first per device (see the module's doc).

    Each: {"device", "index" (entry of that device's trace, None when only the marker says), "request_bytes"
    (None: not recorded), "device_free_bytes", "limit_bytes", "total_bytes", "allocated_bytes" (live then),
    "reserved_bytes", "needed_bytes" (allocated + request: what the run needed at that moment), "stack_id",
    "source" ("trace entry" | "recorder error"), "message" (the exception's text, when the recorder kept it),
    "evidence" {"rule", "events", "frames"}}."""
    reps = replay(trace)
    ev = trace.events
    rec = trace.recorder or {}
    parsed = parse_error(rec.get("error"))
    out = []
    for device in trace.devices:
        rep = reps[device]
        sl = rep.events
        rows = np.flatnonzero(ev.action[sl] == OOM)
        limit = allocator_limit(trace, device)
        total = _int(recorded_device(trace, device).get("total_memory"))
        for i in rows.tolist():
            row = sl.start + i
            request = int(ev.size[row])
            live = rep.allocated_at(i)
            out.append({"device": device, "index": int(i), "request_bytes": request if request > 0 else None,
                        "device_free_bytes": int(ev.device_free[row]), "limit_bytes": limit, "total_bytes": total,
                        "allocated_bytes": int(live), "reserved_bytes": rep.reserved_at(i),
                        "needed_bytes": int(live + max(request, 0)), "stack_id": int(ev.stack_id[row]),
                        "source": "trace entry", "message": None,
                        "evidence": {"rule": "an `oom` entry in the allocator's trace: it could not serve a request",
                                     "events": [int(i)], "frames": trace.stack(int(ev.stack_id[row]))[:8]}})
    if parsed is not None:
        device = _marker_device(trace, parsed, reps)
        mine = [o for o in out if o["device"] == device]
        if mine:  # the exception is the last oom entry of its device, raised: one error, not two
            mine[-1]["message"] = parsed["message"]
            mine[-1]["evidence"]["rule"] += "; the recorder's exception says so too"
            if parsed["total_bytes"] and not mine[-1]["total_bytes"]:
                mine[-1]["total_bytes"] = parsed["total_bytes"]
        elif device is not None:
            rep = reps[device]
            last = rep.n - 1
            live = rep.allocated_at(last) if rep.n else rep.initial_allocated
            request = parsed["request_bytes"]
            out.append({"device": device, "index": last if rep.n else None, "request_bytes": request,
                        "device_free_bytes": parsed["device_free_bytes"],
                        "limit_bytes": allocator_limit(trace, device) or parsed["limit_bytes"],
                        "total_bytes": _int(recorded_device(trace, device).get("total_memory"))
                        or parsed["total_bytes"],
                        "allocated_bytes": int(live), "reserved_bytes": rep.reserved_at(last) if rep.n else None,
                        "needed_bytes": int(live + (request or 0)), "stack_id": -1,
                        "source": "recorder error", "message": parsed["message"],
                        "evidence": {"rule": "the recorder's exception marker: the recorded code raised an "
                                             "out-of-memory error (the trace holds no `oom` entry for it)",
                                     "events": [last] if rep.n else [], "frames": []}})
    return out


def _marker_device(trace: Trace, parsed: dict, reps) -> int | None:
    """The device an exception message is about: "GPU N" when it is in the file, the CPU for the CPU
    allocator's message, else the device with the largest peak."""
    if not trace.devices:
        return None
    if parsed["gpu"] is not None and parsed["gpu"] in trace.devices and not parsed["cpu"]:
        return parsed["gpu"]
    if parsed["cpu"]:
        cpu = [d for d in trace.devices if trace.device_label(d) == "cpu"]
        if cpu:
            return cpu[0]
    return max(trace.devices, key=lambda d: reps[d].peak_allocated)


def counted_ooms(trace: Trace) -> dict:
    """{device: n} where the allocator's own counter (stored by the recorder when it stopped) is above 0."""
    out = {}
    for d in (trace.recorder or {}).get("devices") or []:
        if not isinstance(d, dict):
            continue
        stats = (d.get("allocator_stats") or {}) if isinstance(d.get("allocator_stats"), dict) else {}
        n = (stats.get("memory_stats") or {}).get("num_ooms") if isinstance(stats.get("memory_stats"), dict) else None
        if _int(n) and isinstance(d.get("index"), int):
            out[d["index"]] = n
    return out


def demand(trace: Trace, device: int) -> dict:
    """What the run needed on `device`: {"bytes", "lower_bound", "peak_bytes", "oom_count", "why"}.

    Without an OOM: the peak allocated, exactly. With one: at least the largest of the peak and, for each
    OOM, what was live then plus the request that failed (a request the file does not give counts 0)."""
    rep = replay(trace)[device]
    peak = int(rep.peak_allocated)
    mine = [o for o in out_of_memory(trace) if o["device"] == device]
    if not mine:
        return {"bytes": peak, "lower_bound": False, "peak_bytes": peak, "oom_count": 0, "why": "the peak allocated"}
    worst = max(mine, key=lambda o: o["needed_bytes"])
    need = max(peak, worst["needed_bytes"])
    if worst["request_bytes"] is None:
        why = "at least the peak: the failed request's size is not recorded"
    elif need == peak:
        why = "at least the peak (it came before the failed request)"
    else:
        why = "at least what was live when a request failed plus that request"
    return {"bytes": int(need), "lower_bound": True, "peak_bytes": peak, "oom_count": len(mine), "why": why,
            "allocated_at_oom_bytes": worst["allocated_bytes"], "request_bytes": worst["request_bytes"]}


def available_when_failed(o: dict) -> int | None:
    """The memory of the device the request failed on, as a budget reads it: the allocator's cap when one was
    set (or what it held plus the free bytes, if less), else the device's total memory (or what the allocator
    held plus the free bytes, if the file does not give the total); None when the file cannot say."""
    held = o.get("reserved_bytes")
    free = o.get("device_free_bytes")
    room = held + free if held is not None and free is not None else None
    cap = o.get("limit_bytes")
    if cap is not None:
        return cap if room is None else min(cap, room)
    total = o.get("total_bytes")
    if total is not None:
        return max(total, room or 0)
    return room
