"""The report: per-device figures and the findings, as one plain dict (what `report --json` prints)."""
from __future__ import annotations

import re

import numpy as np

from ..model import OOM, Trace
from .replay import DeviceReplay, replay, time_of
from .phases import when
from .sites import group_sites, public, site_info

TOP_STACKS = 10
LIBRARY_ROWS = 30  # library_sites_at_peak rows kept in the report


def build_report(trace: Trace, rules=None, estimate=None) -> dict:
    """Everything `tracekit report` shows, as JSON-ready builtins (sizes in bytes).

    `rules`: a user rules file (path) or `Rules`, applied on top of the categories.
    `estimate`: what `estimate.measured.add_estimates` takes (None: from the recording)."""
    from .rules import Rules

    if rules is not None and not isinstance(rules, Rules):
        rules = Rules.load(rules)
    reps = replay(trace)
    devices = [device_summary(trace, reps[d], rules) for d in trace.devices]
    from .estimate.measured import add_estimates  # predicted vs measured, per device (issue 12)
    add_estimates(trace, devices, estimate, rules)
    from .modules import add_modules  # per nn.Module (issue 11)
    add_modules(trace, devices, reps)
    findings = []
    for d, summary in zip(trace.devices, devices):
        findings += device_findings(trace, reps[d], rules, summary)
    return {"file": trace.path, "format": trace.format, "devices": devices, "findings": findings}


def device_summary(trace: Trace, rep: DeviceReplay, rules=None) -> dict:
    p = rep.peak_index
    reserved_at_peak = rep.reserved_at(p)
    ev = trace.events
    from .libraries import library_sites

    out = {**_summary(trace, rep, p, reserved_at_peak, ev), **category_tables(trace, rep, rules)}
    # the third-party line (transformers, peft, ...) that holds the memory, per category (issue 22)
    out["library_sites_at_peak"] = library_sites(trace, rep.device, rep.allocations.live_at(p), rules,
                                                 limit=LIBRARY_ROWS)
    from .generation import generation_summary, kv_cache, workload

    out["workload"], out["workload_evidence"] = workload(trace, rep.device)
    out["kv_cache"] = kv_cache(trace, rep.device, rules)  # null unless a generation
    out["generation"] = generation_summary(trace, rep.device, rules)
    return out


def _summary(trace, rep, p, reserved_at_peak, ev) -> dict:
    from .replay import allocator_bytes

    blocks = allocator_bytes(trace, rep)
    phase, iteration, during = when(trace, rep.device, p)
    stats = next((d.get("allocator_stats") for d in (trace.recorder or {}).get("devices") or []
                  if isinstance(d, dict) and d.get("index") == rep.device and d.get("type") == "cuda"), None)
    return {
        "device": rep.device,
        "label": trace.device_label(rep.device),
        "entries": rep.n,
        "peak_allocated_bytes": rep.peak_allocated,
        "peak_event_index": p,
        "peak_time_us": time_of(trace, rep, p),
        "peak_phase": phase,
        "peak_iteration": iteration,
        "peak_during": during or None,  # "in the backward pass of iteration 0", "in decoding step 5"
        # requested bytes (what the trace records) above; the allocator's block sizes here, as
        # torch.cuda.max_memory_allocated counts them (its own figures under allocator_stats when recorded)
        "peak_allocated_block_bytes": blocks.peak,
        "final_allocated_block_bytes": blocks.final,
        "allocator_stats": stats,
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
    """Allocation sites holding the most bytes just after entry `index`, largest first (see sites.py)."""
    return [public(g) for g in group_sites(trace, rep, rep.allocations.live_at(index), limit)]


def category_tables(trace: Trace, rep: DeviceReplay, rules=None) -> dict:
    """Categories at the peak and at the end, per phase and per iteration; each row sums to allocated."""
    from .categories import METHODS, categorize
    from .phases import NONE, PHASES, phases
    from .timeline import categories_at

    cats = categorize(trace, rules)[rep.device]
    ph = phases(trace)[rep.device]
    live = rep.allocations.live_at(rep.peak_index)
    method_bytes = np.bincount(cats.method[live].astype(np.int64), weights=rep.allocations.size[live],
                               minlength=len(METHODS))
    # the points to read: the peak, the end, each phase's and each iteration's peak and end
    points = [rep.peak_index, rep.n - 1]
    phase_rows = []
    if rep.n and ph.source != "none":
        for code in range(len(PHASES)):
            idx = np.flatnonzero(ph.phase == code)
            if len(idx):
                i = int(idx[np.argmax(rep.allocated[idx])])
                phase_rows.append({"phase": PHASES[code] if code != NONE else "between", "entries": int(len(idx)),
                                   "peak_bytes": int(rep.allocated[i]), "peak_index": i})
                points.append(i)
    iteration_rows = []
    for it, lo, hi in ph.iterations() if rep.n else []:
        i = lo + int(np.argmax(rep.allocated[lo:hi + 1]))
        iteration_rows.append({"iteration": it, "start_index": lo, "end_index": hi,
                               "peak_bytes": int(rep.allocated[i]), "peak_index": i,
                               "end_bytes": int(rep.allocated[hi])})
        points += [i, hi]
    values = categories_at(trace, rep.device, points, rules)

    def at(k):
        return {name: int(v[k]) for name, v in values.items() if v[k]}

    k = 2
    for row in phase_rows:
        row["categories_at_peak"] = at(k)
        k += 1
    for row in iteration_rows:
        row["categories_at_peak"], row["categories_at_end"] = at(k), at(k + 1)
        k += 2
    reasons = np.bincount(cats.reason[live].astype(np.int64), weights=rep.allocations.size[live].astype(np.float64),
                          minlength=len(cats.reasons))
    by_reason = []
    for r in np.flatnonzero(reasons > 0)[np.argsort(-reasons[reasons > 0], kind="stable")].tolist():
        rows = live & (cats.reason == r)
        label = int(np.bincount(cats.labels[rows].astype(np.int64)).argmax())
        by_reason.append({"category": cats.names[label], "reason": cats.reasons[r], "bytes": int(reasons[r]),
                          "count": int(rows.sum())})
    return {
        "categories_at_peak": at(0),
        "reasons_at_peak": by_reason,
        "categories_at_end": at(1) if rep.n else at(0),
        "classified_at_peak": {m: int(b) for m, b in zip(METHODS, method_bytes)},
        "category_names": list(cats.names),
        "phase_source": ph.source,
        "phases": phase_rows,
        "iterations": iteration_rows,
    }


def device_findings(trace: Trace, rep: DeviceReplay, rules=None, summary=None) -> list[dict]:
    from .advice import advice_findings
    from .leaks import leak_findings
    from .spikes import spike_findings

    summary = summary or device_summary(trace, rep, rules)
    peak = peak_finding(trace, rep)
    peak["by_category"] = summary["categories_at_peak"]
    if peak["by_category"]:
        peak["summary"] += f" ({shares(peak['by_category'])})"
    libs = summary.get("library_sites_at_peak") or []
    if libs:  # the third-party line that holds the most (issue 22): the model's own line, not only the user's
        from .libraries import library_where
        from ..units import fmt_bytes

        peak["library_line"] = library_where(libs[0])
        peak["summary"] += f"; largest library line: {fmt_bytes(libs[0]['bytes'])} {libs[0]['category']} from " \
                           f"{peak['library_line']}"
    found = [peak]
    spikes = spike_findings(trace, rep.device)
    found += spikes
    found += leak_findings(trace, rep.device, rules)
    frag = fragmentation_finding(trace, rep)
    if frag:
        found.append(frag)
    found += oom_findings(trace, rep, rules)
    found += advice_findings(trace, rep.device, summary["categories_at_peak"], rep.peak_allocated,
                             rep.peak_index, spikes)
    for f in found:
        f["label"] = trace.device_label(rep.device)  # every finding names its device
    return found


def shares(by_category: dict, limit=4) -> str:
    """"activation 61%, parameter 20%, ..." for the largest categories."""
    total = sum(by_category.values()) or 1
    top = sorted(by_category.items(), key=lambda kv: -kv[1])[:limit]
    return ", ".join(f"{k} {v / total:.0%}" for k, v in top if v > 0)


def peak_finding(trace: Trace, rep: DeviceReplay) -> dict:
    from ..units import fmt_bytes

    p = rep.peak_index
    stacks = top_stacks(trace, rep, p, limit=5)
    phase, iteration, during = when(trace, rep.device, p)
    at = "before the first trace entry" if p < 0 else f"at trace entry {p}"
    largest = f"; largest site: {fmt_bytes(stacks[0]['bytes'])} from {stacks[0]['where']}" if stacks else ""
    return {"kind": "peak", "device": rep.device, "bytes": rep.peak_allocated, "index": p,
            "time_us": time_of(trace, rep, p), "phase": phase, "iteration": iteration,
            "summary": f"{trace.device_label(rep.device)} peaks at {fmt_bytes(rep.peak_allocated)} allocated {at}"
                       f"{' ' + during if during else ''}{largest}",
            "frames": stacks[0]["frames"] if stacks else [], "where": stacks[0]["where"] if stacks else None,
            "top_stacks": stacks}


MIN_FRAGMENTATION_SHARE = 0.05  # of peak reserved, at the peak or at its worst


def fragmentation_finding(trace: Trace, rep: DeviceReplay) -> dict | None:
    """Reserved but unallocated memory where it matters: at the peak, and when the cache could not serve a request.

    The cache could not serve a request when the allocator asked CUDA for a
    new segment (the entry before a segment_alloc) or failed (an oom entry):
    what it held unused then was too fragmented to use. Idle moments (after
    an OOM, the first and last entries) are not measured. None if reserved is unknown.
    """
    from ..model import SEGMENT_ALLOC, SEGMENT_MAP
    from ..units import fmt_bytes

    if rep.reserved is None or rep.n == 0 or not rep.reserved.any():
        return None
    if (trace.recorder or {}).get("backend") == "cpu":
        return None  # no caching allocator: CPU "segments" are the blocks themselves
    action = trace.events.action[rep.events]
    # large-pool growth only: a 2 MiB small-pool segment says nothing about large free blocks
    grows = np.flatnonzero(np.isin(action, (SEGMENT_ALLOC, SEGMENT_MAP)) & (trace.events.size[rep.events] > 2 << 20))
    ooms = np.flatnonzero(action == OOM)
    p = rep.peak_index
    reserved_peak = rep.reserved_at(p) or 0
    at_peak = reserved_peak - rep.peak_allocated
    share = at_peak / reserved_peak if reserved_peak else 0.0
    points = np.concatenate([grows[grows > 0] - 1, ooms]).astype(np.int64)
    waste = rep.reserved[points] - rep.allocated[points] if len(points) else np.zeros(0, np.int64)
    k = int(np.argmax(waste)) if len(points) else -1
    worst, worst_bytes = (int(points[k]), int(waste[k])) if k >= 0 and waste[k] > at_peak else (p, int(at_peak))
    if max(at_peak, worst_bytes) < MIN_FRAGMENTATION_SHARE * (rep.peak_reserved or 0):
        return None  # too little to be worth a finding (the device figures still show it)
    settings = trace.meta.get("allocator_settings") or {}
    remedy = ""
    if (share >= 0.2 and at_peak >= 256 * 2**20 or len(ooms)) and not settings.get("expandable_segments"):
        remedy = (" Setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True lets segments grow in place "
                  "and usually returns most of this.")
    why = "at an out-of-memory error" if worst in set(ooms.tolist()) else "when the allocator had to reserve more"
    worst_text = f"; {fmt_bytes(worst_bytes)} unused {why} (entry {worst})" if worst != p else ""
    return {"kind": "fragmentation", "device": rep.device, "bytes": int(at_peak), "index": p,
            "worst_index": worst, "worst_bytes": worst_bytes, "share_at_peak": round(share, 4),
            "summary": (f"{fmt_bytes(at_peak)} reserved but not allocated at the peak ({share:.0%} of reserved)"
                        f"{worst_text}.{remedy}"),
            "frames": []}


def oom_findings(trace: Trace, rep: DeviceReplay, rules=None) -> list[dict]:
    """Each out-of-memory entry: the request, what the device had free, what was live by site and category."""
    from .categories import categorize
    from .timeline import categories_at
    from ..units import fmt_bytes

    ev = trace.events
    sl = rep.events
    cats = categorize(trace, rules)[rep.device]
    out = []
    for i in np.flatnonzero(ev.action[sl] == OOM):
        i = int(i)
        row = sl.start + i
        request, free = int(ev.size[row]), int(ev.device_free[row])
        live = rep.allocated_at(i)
        asked = site_info(trace, int(ev.stack_id[row]))
        by_cat = {k: int(v[0]) for k, v in categories_at(trace, rep.device, [i], rules).items() if v[0]}
        groups = group_sites(trace, rep, rep.allocations.live_at(i), limit=5)
        for g in groups:
            g["by_category"] = {k: v for k, v in cats.bytes_by_category(rep.allocations.size, _rows_mask(cats, g)).items() if v}
        held = "; ".join(f"{fmt_bytes(g['bytes'])} from {g['where']} ({shares(g['by_category'], 2)})" for g in groups[:3])
        _, _, during = when(trace, rep.device, i)
        limit = allocator_limit(trace, rep.device)
        capped = (f" (but this process may use only {fmt_bytes(limit)}: "
                  "torch.cuda.set_per_process_memory_fraction)") if limit is not None and limit < free else ""
        out.append({"kind": "oom", "device": rep.device, "bytes": request, "index": i,
                    "time_us": time_of(trace, rep, i), "device_free_bytes": free, "allocated_bytes": live,
                    "reserved_bytes": rep.reserved_at(i), "live_by_category": by_cat, "limit_bytes": limit,
                    "summary": (f"out of memory at entry {i}{' ' + during if during else ''}: "
                                f"{asked['where']} asked for {fmt_bytes(request)} with {fmt_bytes(free)} free on the "
                                f"device{capped} and {fmt_bytes(live)} allocated"
                                f"{' (' + shares(by_cat) + ')' if by_cat else ''}"
                                f"{'; live: ' + held if held else ''}"),
                    "frames": asked["frames"], "where": asked["where"],
                    "top_stacks": [public(g) for g in groups]})
    return out


_ALLOWED = re.compile(r"(\d+(?:\.\d+)?) (B|KiB|MiB|GiB|TiB) allowed")


def allocator_limit(trace: Trace, device: int) -> int | None:
    """The caching allocator's own cap on this device (a per-process memory fraction), if the file says:
    the recorder stores it; torch's out-of-memory message says "1024.00 MiB allowed"."""
    rec = trace.recorder or {}
    for d in rec.get("devices") or []:
        if isinstance(d, dict) and d.get("index") == device and isinstance(d.get("memory_limit_bytes"), int):
            return d["memory_limit_bytes"]
    m = _ALLOWED.search(str(rec.get("error") or ""))
    if m:
        return int(float(m.group(1)) * 1024 ** ("B", "KiB", "MiB", "GiB", "TiB").index(m.group(2)))
    return None


def _rows_mask(cats, group) -> np.ndarray:
    m = np.zeros(len(cats.labels), bool)
    m[group["rows"]] = True
    return m
