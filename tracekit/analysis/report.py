"""The report: per-device figures and the findings, as one plain dict (what `report --json` prints)."""
from __future__ import annotations

from typing import Any

import numpy as np

from ..model import OOM, SNAPSHOT, Trace, isin_few, same_column
from .replay import DeviceReplay, replay, time_of
from .phases import when
from .sites import group_sites, public, site_info

TOP_STACKS = 10
LIBRARY_ROWS = 30  # library_sites_at_peak rows kept in the report


def build_report(trace: Trace, rules=None, estimate=None, lean: bool = False) -> dict:
    """Everything `tracekit report` shows, as JSON-ready builtins (sizes in bytes).

    `rules`: a user rules file (path) or `Rules`, applied on top of the categories.
    `estimate`: what `estimate.measured.add_estimates` takes (None: from the recording).
    `lean`: let go of memoised analyses once the rest of the report no longer reads them (the CLI, which
    throws the trace away after: a 10M-entry trace's report then peaks lower); the viewer keeps them."""
    from .rules import Rules

    if rules is not None and not isinstance(rules, Rules):
        rules = Rules.load(rules)
    trim = _trim if lean else _no_trim
    reps = replay(trace)
    trim()
    if lean:  # the phases' temporaries before the allocator model's curves are held (the summaries read both)
        from .phases import phases

        phases(trace)
        trim()
    _share_reserved(trace, reps)
    trim()
    from .estimate.measured import add_estimates, wants_estimates  # predicted vs measured, per device (issue 12)

    # the categories over time are read by the summaries and the estimate (an oom finding makes its own): lean,
    # they are let go once read, before each summary goes on to the library lines
    forget_steps = lean and not wants_estimates(trace, estimate)
    # the allocator model's figures of every device first: lean, the model and the entries' addresses then go
    # before the categories' and the sites' temporaries come (a 10M-entry trace: 190 MiB less under them)
    heads = {d: _summary(trace, reps[d]) for d in trace.devices}
    if forget_steps:
        _forget_allocator(trace)
        trim()
        if all(reps[d].n > EXPANDABLE_REPLAY_MAX_ENTRIES for d in trace.devices):  # else a finding replays them
            _forget_columns(trace, rules)
            trim()
    devices = []
    for d in trace.devices:
        devices.append(device_summary(trace, reps[d], rules, forget_steps=forget_steps, head=heads.pop(d)))
        trim()
    add_estimates(trace, devices, estimate, rules)
    if lean:
        _forget_steps(trace)
        _forget_allocator(trace)
    trim()
    from .modules import add_modules  # per nn.Module (issue 11)
    add_modules(trace, devices, reps)
    trim()
    from .holds import add_distributed  # what a rank of a sharded / data-parallel job holds (issue 33)
    add_distributed(trace, devices)
    findings = []
    shape = (estimate or {}).get("shape")
    for d, summary in zip(trace.devices, devices):
        findings += device_findings(trace, reps[d], rules, summary, shape)
    return {"file": trace.path, "format": trace.format, "devices": devices, "findings": findings}


def _trim() -> None:
    """Give the heap's free pages back to the system (glibc's malloc_trim; nothing elsewhere), between the
    stages of a lean report: glibc keeps freed blocks below its growing mmap threshold in the heap, so one
    stage's freed temporaries would otherwise stay in the process's memory under the next stage's own."""
    global _malloc_trim
    if _malloc_trim is None:
        _malloc_trim = _no_trim
        try:
            import ctypes

            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            pass
    _malloc_trim(0)


def _no_trim(*_) -> None:
    pass


_malloc_trim: Any = None


def _share_reserved(trace: Trace, reps: dict) -> None:
    """The allocator model's reserved curve is most often the trace's own (its segment entries), entry for
    entry: then the model keeps the replay's array, and a big trace holds one copy, not two."""
    from .allocator.summary import allocator_replays

    for d, model in allocator_replays(trace).items():
        rep = reps.get(d)
        if (rep is not None and rep.reserved is not None and model.reserved is not rep.reserved
                and model.reserved.shape == rep.reserved.shape and same_column(model.reserved, rep.reserved)):
            model.reserved = rep.reserved


def _forget_columns(trace: Trace, rules) -> None:
    """Let go of two of the entries' columns in a lean report, once the replays are made: their positions (the
    viewer's: its tables, a window's numbering; no report reads them) and their addresses (they pair allocations
    with their frees, place blocks in the allocator model and find what a failed request was in the categories,
    made here first). On a 10M-entry trace that is 114 MiB held under every later stage. A read after this fails
    loudly (None), never silently."""
    from .categories import categorize

    trace.events.index = None  # type: ignore[assignment]
    categorize(trace, rules)
    trace.events.addr = None  # type: ignore[assignment]


def _forget_steps(trace: Trace) -> None:
    from .memo import forget
    from .timeline import _allocation_steps, _event_category_steps

    forget(trace, _allocation_steps)
    forget(trace, _event_category_steps)


def _forget_allocator(trace: Trace) -> None:
    """Let go of the allocator model's replays (read by the summaries and the estimate only) before the module
    tables and the findings: a 10M-entry trace's model holds a curve per entry and its block sizes."""
    from .allocator.summary import _replays, allocator_replays
    from .memo import forget

    forget(trace, allocator_replays)
    forget(trace, _replays)


def device_summary(trace: Trace, rep: DeviceReplay, rules=None, forget_steps: bool = False,
                   head: dict | None = None) -> dict:
    """The report's figures of one device (`forget_steps`: let go of the categories' step functions once read;
    `head`: its _summary, made already)."""
    p = rep.peak_index
    from .libraries import library_sites

    out = {**(head or _summary(trace, rep)), "top_stacks_at_peak": top_stacks(trace, rep, p),
           **category_tables(trace, rep, rules, steps=not forget_steps)}
    if forget_steps:
        _forget_steps(trace)
    # the third-party line (transformers, peft, ...) that holds the memory, per category (issue 22)
    out["library_sites_at_peak"] = library_sites(trace, rep.device, rep.allocations.live_at(p), rules,
                                                 limit=LIBRARY_ROWS)
    from .generation import generation_summary, kv_cache, workload

    out["workload"], out["workload_evidence"] = workload(trace, rep.device)
    out["kv_cache"] = kv_cache(trace, rep.device, rules)  # null unless a generation
    out["generation"] = generation_summary(trace, rep.device, rules)
    return out


def _summary(trace, rep) -> dict:
    """The figures of a device that the replays and the allocator model make (device_summary's first keys)."""
    from .allocator.summary import allocator_replays, allocator_summary

    p = rep.peak_index
    reserved_at_peak = rep.reserved_at(p)
    ev = trace.events
    from .replay import allocator_bytes

    model = allocator_replays(trace).get(rep.device)  # the caching allocator's own figures (issue 24)
    blocks = allocator_bytes(trace, rep) if model is None else model
    phase, iteration, during = when(trace, rep.device, p)
    stats = next((d.get("allocator_stats") for d in (trace.recorder or {}).get("devices") or []
                  if isinstance(d, dict) and d.get("index") == rep.device and d.get("type") == "cuda"), None)
    from .allocator.summary import headline_peak

    head = headline_peak(trace, rep.device, rep)  # what the text, check and the viewer lead with (issue 31)
    hp, hi, hd = when(trace, rep.device, head["index"]) if head["index"] != p else (phase, iteration, during)
    head.update(time_us=time_of(trace, rep, head["index"]), phase=hp, iteration=hi, during=hd or None)
    return {
        "device": rep.device,
        "label": trace.device_label(rep.device),
        "entries": rep.n,
        "headline_peak": head,
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
        "peak_reserved_bytes": rep.peak_reserved if model is None else model.peak_reserved,
        "peak_reserved_event_index": rep.peak_reserved_index if model is None else model.peak_reserved_index,
        "allocator": allocator_summary(trace, rep.device),
        "allocated_before_trace_bytes": rep.initial_allocated,
        "final_allocated_bytes": rep.final_allocated,
        "final_reserved_bytes": rep.final_reserved,
        "reserved_at_peak_bytes": reserved_at_peak,
        "fragmentation_at_peak_bytes": None if reserved_at_peak is None else reserved_at_peak - rep.peak_allocated,
        "oom_count": int((ev.action[rep.events] == OOM).sum()),
        "history_entries": int((ev.action[rep.events] != SNAPSHOT).sum()),  # allocator history, not dump markers
        **_demand(trace, rep),
        "replay_invariant": {"checked": rep.invariant.checked, "ok": rep.invariant.ok,
                             "problems": [{"addr": a, "size": s, "what": w} for a, s, w in rep.invariant.problems]},
    }


def _demand(trace, rep) -> dict:
    """What the run needed on this device (oom.demand): the peak, or, after an out-of-memory error, a lower
    bound above it; `out_of_memory` counts every OOM the file records (trace entries and the recorder's marker)."""
    from .oom import counted_ooms, demand

    d = demand(trace, rep.device)
    return {"out_of_memory": d["oom_count"], "demand_bytes": d["bytes"], "demand_is_lower_bound": d["lower_bound"],
            "demand_why": d["why"], "allocator_counted_ooms": counted_ooms(trace).get(rep.device, 0)}


def top_stacks(trace: Trace, rep: DeviceReplay, index: int, limit: int = TOP_STACKS) -> list[dict]:
    """Allocation sites holding the most bytes just after entry `index`, largest first (see sites.py)."""
    return [public(g) for g in group_sites(trace, rep, rep.allocations.live_at(index), limit)]


def category_tables(trace: Trace, rep: DeviceReplay, rules=None, steps: bool = True) -> dict:
    """Categories at the peak and at the end, per phase and per iteration; each row sums to allocated (`steps`:
    read from the categories' step functions, else summed at these points: timeline.categories_at)."""
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
        for code, (count, i) in enumerate(_phase_peaks(ph.phase, rep.allocated, len(PHASES))):
            if count:
                phase_rows.append({"phase": PHASES[code] if code != NONE else "between", "entries": count,
                                   "peak_bytes": int(rep.allocated[i]), "peak_index": i})
                points.append(i)
    iteration_rows = []
    for it, lo, hi in ph.iterations() if rep.n else []:
        i = lo + int(np.argmax(rep.allocated[lo:hi + 1]))
        iteration_rows.append({"iteration": it, "start_index": lo, "end_index": hi,
                               "peak_bytes": int(rep.allocated[i]), "peak_index": i,
                               "end_bytes": int(rep.allocated[hi])})
        points += [i, hi]
    values = categories_at(trace, rep.device, points, rules, steps=steps)

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


def _phase_peaks(phase: np.ndarray, curve: np.ndarray, codes: int, chunk: int = 1 << 20) -> list[tuple[int, int]]:
    """Per phase code: (its entries, the first entry where `curve` is highest among them), read a chunk at a
    time, so that a 10M-entry trace makes no per-entry temporaries."""
    out = [[0, -1] for _ in range(codes)]
    for lo in range(0, len(phase), chunk):
        ph, c = phase[lo:lo + chunk], curve[lo:lo + chunk]
        for code in range(codes):
            idx = np.flatnonzero(ph == code)
            if len(idx):
                j = lo + int(idx[np.argmax(c[idx])])
                row = out[code]
                if row[1] < 0 or curve[j] > curve[row[1]]:  # strictly higher: the first of equal peaks stays
                    row[1] = j
                row[0] += len(idx)
    return [(count, i) for count, i in out]


def device_findings(trace: Trace, rep: DeviceReplay, rules=None, summary=None, shape=None) -> list[dict]:
    from .advice import advice_findings
    from .leaks import leak_findings
    from .spikes import spike_findings

    summary = summary or device_summary(trace, rep, rules)
    peak = peak_finding(trace, rep, summary.get("headline_peak"))  # the summary's: the model is not read again
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
    if shape is None and ((trace.recorder or {}).get("model") or {}).get("config"):
        from .estimate.measured import recorded_setup
        from .estimate.shapes import ModelShape

        rshape = recorded_setup(trace)[0]
        shape = rshape if isinstance(rshape, ModelShape) else None
    found += advice_findings(trace, rep.device, summary["categories_at_peak"], rep.peak_allocated,
                             rep.peak_index, spikes, summary=summary, shape=shape, rules=rules)
    for f in found:
        f["label"] = trace.device_label(rep.device)  # every finding names its device
        f.setdefault("evidence", evidence_of(f))
    return found


RULES = {
    "peak": "the most bytes allocated after any trace entry (alloc +size, free_completed -size, from what was live "
            "when the trace began)",
    "spike": "allocations made and freed within one phase (or a short window) rising at least 10% of the peak above "
             "what the other allocations hold",
    "leak": "memory at each iteration's end grows step after step, and the growth is allocations made in one "
            "iteration still live iterations later, from the same site",
    "fragmentation": "reserved minus allocated at the peak, and just before the allocator reserved more (or failed)",
}


def evidence_of(f: dict) -> dict:
    """What a finding rests on: the rule that made it, the trace entries it points at, the frames of its site."""
    kind = f["kind"]
    events = []
    for k in ("start_index", "index", "worst_index", "end_index"):
        v = f.get(k)
        if isinstance(v, int) and v >= 0 and v not in events:
            events.append(v)
    if kind == "leak":
        events = [int(x) for x in f.get("iteration_end_indices") or events]
    return {"rule": RULES.get(kind, kind), "events": events, "frames": list(f.get("frames") or [])[:8]}


def shares(by_category: dict, limit=4) -> str:
    """"activation 61%, parameter 20%, ..." for the largest categories."""
    total = sum(by_category.values()) or 1
    top = sorted(by_category.items(), key=lambda kv: -kv[1])[:limit]
    return ", ".join(f"{k} {v / total:.0%}" for k, v in top if v > 0)


def peak_finding(trace: Trace, rep: DeviceReplay, head: dict | None = None) -> dict:
    """The peak's finding; `head`: the device summary's headline_peak when there is one (else made here)."""
    from ..units import fmt_bytes

    p = rep.peak_index
    stacks = top_stacks(trace, rep, p, limit=5)
    phase, iteration, during = when(trace, rep.device, p)
    at = "before the first trace entry" if p < 0 else f"at trace entry {p}"
    largest = f"; largest site: {fmt_bytes(stacks[0]['bytes'])} from {stacks[0]['where']}" if stacks else ""
    from .allocator.summary import headline_peak

    if head is None:  # the allocator's counter first, as the report's headline
        head = headline_peak(trace, rep.device, rep)
    counted = (f"{fmt_bytes(head['bytes'])} allocated ({'exact, ' if head['exact'] else ''}as "
               f"torch.cuda.max_memory_allocated counts it; tensors requested {fmt_bytes(rep.peak_allocated)})"
               if head["measure"] == "blocks" else f"{fmt_bytes(rep.peak_allocated)} allocated")
    return {"kind": "peak", "device": rep.device, "bytes": rep.peak_allocated, "index": p,
            "headline_bytes": head["bytes"],
            "time_us": time_of(trace, rep, p), "phase": phase, "iteration": iteration,
            "summary": f"{trace.device_label(rep.device)} peaks at {counted} {at}"
                       f"{' ' + during if during else ''}{largest}",
            "frames": stacks[0]["frames"] if stacks else [], "where": stacks[0]["where"] if stacks else None,
            "top_stacks": stacks}


MIN_FRAGMENTATION_SHARE = 0.05  # of peak reserved, at the peak or at its worst
# the fragmentation finding replays the requests with expandable segments (two runs of the allocator model, in
# Python) for traces up to this long; longer ones point to `whatif --alloc-conf` instead
EXPANDABLE_REPLAY_MAX_ENTRIES = 200_000


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
    size, chunk = trace.events.size[rep.events], 1 << 20  # a chunk of entries at a time: no per-entry masks
    grows = np.concatenate([np.zeros(0, np.int64)] + [
        lo + np.flatnonzero(isin_few(action[lo:lo + chunk], (SEGMENT_ALLOC, SEGMENT_MAP))
                            & (size[lo:lo + chunk] > 2 << 20)) for lo in range(0, rep.n, chunk)])
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
    remedy, expandable = "", None
    if not settings.get("expandable_segments") and rep.n <= EXPANDABLE_REPLAY_MAX_ENTRIES:
        from .allocator.settings_replay import expandable_saving

        expandable = expandable_saving(trace, rep.device)
        if expandable is not None and expandable["saves_bytes"] > 0:
            remedy = f" {expandable['text']}."
        elif expandable is not None:
            remedy = f" {expandable['text']}: expandable segments would not help here."
    elif not settings.get("expandable_segments"):  # a long trace: the replay is whatif's, on request
        remedy = (" For what PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True would save, replay the requests: "
                  "tracekit whatif FILE --alloc-conf expandable_segments:True.")
    why = "at an out-of-memory error" if worst in set(ooms.tolist()) else "when the allocator had to reserve more"
    worst_text = f"; {fmt_bytes(worst_bytes)} unused {why} (entry {worst})" if worst != p else ""
    return {"kind": "fragmentation", "device": rep.device, "bytes": int(at_peak), "index": p,
            "worst_index": worst, "worst_bytes": worst_bytes, "share_at_peak": round(share, 4),
            "summary": (f"{fmt_bytes(at_peak)} reserved but not allocated at the peak ({share:.0%} of reserved)"
                        f"{worst_text}.{remedy}"),
            "expandable_segments_saves_bytes": None if expandable is None else expandable["saves_bytes"],
            "frames": []}



def oom_findings(trace: Trace, rep: DeviceReplay, rules=None) -> list[dict]:
    """Each out-of-memory error on this device (oom.py: trace entries and the recorder's exception marker):
    the request, what the device had free, the cap, what was live by site and category, and what the run
    needed at least."""
    from .categories import categorize
    from .oom import out_of_memory
    from .timeline import categories_at
    from ..units import fmt_bytes, fmt_pair

    cats = categorize(trace, rules)[rep.device]
    out = []
    for o in out_of_memory(trace):
        if o["device"] != rep.device:
            continue
        i = o["index"]
        at = i if i is not None else rep.n - 1
        asked = site_info(trace, o["stack_id"]) if o["stack_id"] >= 0 else {"where": "the recorded code",
                                                                          "frames": []}
        by_cat = ({k: int(v[0]) for k, v in categories_at(trace, rep.device, [at], rules).items() if v[0]}
                  if rep.n else {})
        groups = group_sites(trace, rep, rep.allocations.live_at(at), limit=5) if rep.n else []
        for g in groups:
            g["by_category"] = {k: v for k, v in cats.bytes_by_category(rep.allocations.size, _rows_mask(cats, g)).items() if v}
        held = "; ".join(f"{fmt_bytes(g['bytes'])} from {g['where']} ({shares(g['by_category'], 2)})" for g in groups[:3])
        _, _, during = when(trace, rep.device, at) if rep.n else (None, None, "")
        request, free, limit = o["request_bytes"], o["device_free_bytes"], o["limit_bytes"]
        live = o["allocated_bytes"]
        need_text, limit_text = fmt_pair(o["needed_bytes"], limit) if limit is not None else (
            fmt_bytes(o["needed_bytes"]), "")
        capped = (f" (but this process may use only {limit_text}: "
                  "torch.cuda.set_per_process_memory_fraction)") if limit is not None and (free is None or limit < free) else ""
        free_text = f"with {fmt_bytes(free)} free on the device" if free is not None else "(free memory not recorded)"
        asked_text = f"asked for {fmt_bytes(request)}" if request is not None else "asked for more (size not recorded)"
        need = f"; the run needed at least {need_text}" if request else ""
        where_at = (f"at entry {i}" if i is not None and o["source"] == "trace entry"
                    else "when the recording ended (the recorder's exception; the trace holds no oom entry)")
        out.append({"kind": "oom", "device": rep.device, "bytes": request or 0, "index": i,
                    "time_us": time_of(trace, rep, i) if i is not None else None,
                    "device_free_bytes": free, "allocated_bytes": live,
                    "reserved_bytes": o["reserved_bytes"], "live_by_category": by_cat, "limit_bytes": limit,
                    "total_bytes": o["total_bytes"], "request_bytes": request, "needed_bytes": o["needed_bytes"],
                    "source": o["source"], "message": o["message"],
                    "summary": (f"out of memory {where_at}{' ' + during if during else ''}: "
                                f"{asked['where']} {asked_text} {free_text}{capped} and {fmt_bytes(live)} allocated"
                                f"{' (' + shares(by_cat) + ')' if by_cat else ''}{need}"
                                f"{'; live: ' + held if held else ''}"),
                    "frames": asked["frames"], "where": asked["where"],
                    "top_stacks": [public(g) for g in groups], "evidence": o["evidence"]})
    return out


def allocator_limit(trace: Trace, device: int) -> int | None:
    """The caching allocator's own cap on this device (oom.allocator_limit)."""
    from .oom import allocator_limit as limit

    return limit(trace, device)


def _rows_mask(cats, group) -> np.ndarray:
    m = np.zeros(len(cats.labels), bool)
    m[group["rows"]] = True
    return m
