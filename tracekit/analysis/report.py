"""The report: per-device figures and the findings, as one plain dict (what `report --json` prints)."""
from __future__ import annotations

import numpy as np

from ..model import OOM, Trace
from .frames import user_frames
from .replay import DeviceReplay, replay, time_of

TOP_STACKS = 10


def build_report(trace: Trace) -> dict:
    """Everything `tracekit report` shows, as JSON-ready builtins (sizes in bytes)."""
    reps = replay(trace)
    devices = [device_summary(trace, reps[d]) for d in trace.devices]
    findings = []
    for d in trace.devices:
        findings += device_findings(trace, reps[d])
    return {"file": trace.path, "format": trace.format, "devices": devices, "findings": findings}


def device_summary(trace: Trace, rep: DeviceReplay) -> dict:
    p = rep.peak_index
    reserved_at_peak = rep.reserved_at(p)
    ev = trace.events
    return {
        "device": rep.device,
        "label": trace.device_label(rep.device),
        "entries": rep.n,
        "peak_allocated_bytes": rep.peak_allocated,
        "peak_event_index": p,
        "peak_time_us": time_of(trace, rep, p),
        "peak_reserved_bytes": rep.peak_reserved,
        "peak_reserved_event_index": rep.peak_reserved_index,
        "allocated_before_trace_bytes": rep.initial_allocated,
        "final_allocated_bytes": rep.final_allocated,
        "final_reserved_bytes": rep.final_reserved,
        "reserved_at_peak_bytes": reserved_at_peak,
        "fragmentation_at_peak_bytes": None if reserved_at_peak is None else reserved_at_peak - rep.peak_allocated,
        "oom_count": int((ev.action[rep.events] == OOM).sum()),
        "replay_invariant": {"checked": rep.invariant.checked, "ok": rep.invariant.ok,
                             "problems": [{"addr": a, "size": s, "what": w} for a, s, w in rep.invariant.problems]},
        "top_stacks_at_peak": top_stacks(trace, rep, p),
    }


def top_stacks(trace: Trace, rep: DeviceReplay, index: int, limit: int = TOP_STACKS) -> list[dict]:
    """Allocation stacks holding the most bytes just after entry `index`, largest first."""
    al = rep.allocations
    live = al.live_at(index)
    if not live.any():
        return []
    sid = al.stack_id[live].astype(np.int64) + 1  # shift -1 ("no stack") to 0
    nbytes = np.bincount(sid, weights=al.size[live].astype(np.float64))
    count = np.bincount(sid)
    order = np.argsort(-nbytes, kind="stable")[:limit]
    out = []
    for s in order:
        if nbytes[s] <= 0:
            break
        out.append({"bytes": int(nbytes[s]), "count": int(count[s]), "frames": user_frames(trace, int(s) - 1)})
    return out


def device_findings(trace: Trace, rep: DeviceReplay) -> list[dict]:
    found = [peak_finding(trace, rep)]
    frag = fragmentation_finding(trace, rep)
    if frag:
        found.append(frag)
    found += oom_findings(trace, rep)
    return found


def peak_finding(trace: Trace, rep: DeviceReplay) -> dict:
    from .units import fmt_bytes

    p = rep.peak_index
    stacks = top_stacks(trace, rep, p, limit=5)
    when = "before the first trace entry" if p < 0 else f"at trace entry {p}"
    return {"kind": "peak", "device": rep.device, "bytes": rep.peak_allocated, "index": p,
            "time_us": time_of(trace, rep, p),
            "summary": f"{trace.device_label(rep.device)} peaks at {fmt_bytes(rep.peak_allocated)} allocated {when}",
            "frames": stacks[0]["frames"] if stacks else [], "top_stacks": stacks}


def fragmentation_finding(trace: Trace, rep: DeviceReplay) -> dict | None:
    """Reserved but unallocated memory at the peak and at its worst; None if reserved is unknown."""
    from .units import fmt_bytes

    if rep.reserved is None or rep.n == 0 or not rep.reserved.any():
        return None
    waste = rep.reserved - rep.allocated
    worst = int(np.argmax(waste))
    p = rep.peak_index
    at_peak = (rep.reserved_at(p) or 0) - rep.peak_allocated
    reserved_peak = rep.reserved_at(p) or 0
    share = at_peak / reserved_peak if reserved_peak else 0.0
    settings = trace.meta.get("allocator_settings") or {}
    remedy = ""
    if share >= 0.2 and at_peak >= 256 * 2**20 and not settings.get("expandable_segments"):
        remedy = (" Setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lets segments grow in place "
                  "and usually returns most of this.")
    return {"kind": "fragmentation", "device": rep.device, "bytes": int(at_peak), "index": p,
            "worst_index": worst, "worst_bytes": int(waste[worst]), "share_at_peak": round(share, 4),
            "mean_bytes": int(waste.mean()),
            "summary": (f"{fmt_bytes(at_peak)} reserved but not allocated at the peak ({share:.0%} of reserved); "
                        f"at worst {fmt_bytes(waste[worst])} at entry {worst}.{remedy}"),
            "frames": []}


def oom_findings(trace: Trace, rep: DeviceReplay) -> list[dict]:
    from .units import fmt_bytes

    ev = trace.events
    sl = rep.events
    out = []
    for i in np.flatnonzero(ev.action[sl] == OOM):
        i = int(i)
        row = sl.start + i
        request, free = int(ev.size[row]), int(ev.device_free[row])
        live = rep.allocated_at(i)
        frames = user_frames(trace, int(ev.stack_id[row]))
        out.append({"kind": "oom", "device": rep.device, "bytes": request, "index": i,
                    "time_us": time_of(trace, rep, i), "device_free_bytes": free, "allocated_bytes": live,
                    "reserved_bytes": rep.reserved_at(i),
                    "summary": (f"out of memory at entry {i}: asked for {fmt_bytes(request)} with "
                                f"{fmt_bytes(free)} free on the device and {fmt_bytes(live)} allocated"),
                    "frames": frames, "top_stacks": top_stacks(trace, rep, i, limit=5)})
    return out
