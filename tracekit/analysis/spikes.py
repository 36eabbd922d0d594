"""Spikes: short-lived allocations that pile up on top of the long-lived memory.

An allocation is *transient* when it is freed in the same phase run it was
made in (forward, backward or optimizer step of one iteration; without
phases: within 1% of the trace). The running baseline is what the other
allocations hold; a spike is a point where transient bytes rise far above
it. Each spike names the allocations live at its top, grouped by stack, the
user's line first: e.g. logits upcast to fp32 inside a loss.
"""
from __future__ import annotations


import numpy as np

from ..model import Trace
from .phases import phases, when
from .replay import DeviceReplay, replay
from .sites import group_sites, public
from ..units import fmt_bytes

MIN_SHARE = 0.10  # of the device's peak
MIN_BYTES = 64 * 1024
MAX_SPIKES = 3
CHUNK = 1 << 18  # allocations whose changes transient_curve adds at a time


def transient_mask(trace: Trace, rep: DeviceReplay) -> np.ndarray:
    """Per allocation: made and freed within one phase run (or a short window without phases).

    What is live at an out-of-memory error is a build-up, freed only because
    the error unwound the step: never transient."""
    from ..model import OOM

    al = rep.allocations
    a, f = al.alloc_index, al.free_index
    both = (a >= 0) & (f >= 0)
    for i in np.flatnonzero(trace.events.action[rep.events] == OOM).tolist():
        both &= ~((a <= i) & (f > i))
    p = phases(trace)[rep.device]
    if p.source == "none" or not rep.n:
        return both & (f - a <= max(16, rep.n // 100))
    return both & (p.run_of(np.maximum(a, 0)) == p.run_of(np.maximum(f, 0)))  # no run id per entry


def transient_curve(rep: DeviceReplay, mask) -> np.ndarray:
    """Bytes of the masked allocations live just after each entry."""
    al = rep.allocations
    delta = np.zeros(rep.n + 1, np.int64)
    for lo in range(0, len(mask), CHUNK):  # a chunk of allocations at a time: few temporaries (sums are exact)
        m = mask[lo:lo + CHUNK]
        size = al.size[lo:lo + CHUNK][m]
        np.add.at(delta, al.alloc_index[lo:lo + CHUNK][m], size)
        np.negative(size, out=size)
        np.add.at(delta, al.free_index[lo:lo + CHUNK][m], size)
    return np.cumsum(delta, out=delta)[:-1]  # in place: one curve's memory, not two


def spike_findings(trace: Trace, device: int) -> list[dict]:
    rep = replay(trace)[device]
    if not rep.n or not len(rep.allocations):
        return []
    mask = transient_mask(trace, rep)
    curve = transient_curve(rep, mask)
    peak = max(rep.peak_allocated, 1)
    floor = max(MIN_SHARE * peak, MIN_BYTES)
    p = phases(trace)[device]
    # the highest point of transient bytes in each run, largest first
    if p.source != "none":
        starts = p.run_starts()  # where p.runs() changes, without its run id per entry
    else:
        runs = np.arange(rep.n) // max(16, rep.n // 100)
        starts = np.flatnonzero(np.r_[True, runs[1:] != runs[:-1]])  # runs[0] >= 0: a run starts at 0
    tops = starts + np.array([int(np.argmax(c)) for c in np.split(curve, starts[1:])])
    tops = tops[curve[tops] >= floor]
    tops = tops[np.argsort(-curve[tops], kind="stable")]
    seen: dict
    found, seen = [], {}
    for i in tops.tolist():
        groups = _groups_at(trace, rep, mask, i)
        key = (int(p.phase[i]), groups[0]["where"] if groups else "")
        if key in seen:  # the same spike in another iteration
            seen[key]["repeats"] += 1
            continue
        f = _finding(trace, rep, mask, curve, i, groups)
        seen[key] = f
        found.append(f)
        if len(found) >= MAX_SPIKES:
            break
    for f in found:
        if f["repeats"] > 1:
            f["summary"] += f" (it recurs in {f['repeats']} iterations)"
    return found


def _groups_at(trace, rep, mask, i, limit=5):
    return group_sites(trace, rep, mask & rep.allocations.live_at(i), limit)


def _finding(trace, rep, mask, curve, i, groups):
    al = rep.allocations
    live = mask & al.live_at(i)
    spike = int(curve[i])
    base = rep.allocated_at(i) - spike
    p = phases(trace)[rep.device]
    phase, _, when_text = when(trace, rep.device, i)
    frames = groups[0]["frames"] if groups else []
    at_peak = rep.allocated_at(i) >= rep.peak_allocated
    summary = (f"{fmt_bytes(spike)} of short-lived allocations on top of {fmt_bytes(base)} at entry {i}"
               f"{' ' + when_text if when_text else ''}{' (this is the peak)' if at_peak else ''}; "
               f"largest: {fmt_bytes(groups[0]['bytes'])} from {groups[0]['where']}" if groups else "")
    from .libraries import library_sites, library_where

    libs = library_sites(trace, rep.device, live, limit=1)  # the third-party line, as the report's peak has it
    library_line = library_where(libs[0]) if libs else None
    if libs and summary:
        summary += f"; largest library line: {fmt_bytes(libs[0]['bytes'])} {libs[0]['category']} from {library_line}"
    return {
        "kind": "spike", "device": rep.device, "bytes": spike, "index": int(i), "library_line": library_line,
        "start_index": int(al.alloc_index[live].min()), "end_index": int(al.free_index[live].max()),
        "baseline_bytes": int(base), "allocated_bytes": rep.allocated_at(i), "phase": phase,
        "iteration": int(p.iteration[i]) if p.source != "none" else None, "at_peak": bool(at_peak),
        "repeats": 1, "summary": summary, "frames": frames, "where": groups[0]["where"] if groups else None,
        "top_stacks": [public(g) for g in groups],
    }
