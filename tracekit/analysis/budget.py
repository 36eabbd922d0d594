"""Memory budgets: what in a report fails the limits a user set (`tracekit check`, the pytest markers).

An out-of-memory error always fails, whatever the budgets: a run that died did not fit. Its demand
(report: `demand_bytes`, a lower bound: what was live when a request failed plus that request) stands
for its peak in the peak budget. Sizes in messages have enough digits that "A > B" never reads
"1.0 GiB > 1.0 GiB".
"""
from __future__ import annotations

from ..units import fmt_bytes, fmt_pair

MAX_OOMS_SHOWN = 3  # per device; the rest are counted


def oom_problems(report) -> list[dict]:
    """One problem per out-of-memory error in the report (at most MAX_OOMS_SHOWN per device, then a count)."""
    labels = {d["device"]: d for d in report["devices"]}
    seen: dict
    out, seen = [], {}
    for f in report["findings"]:
        if f["kind"] != "oom":
            continue
        d = labels.get(f["device"], {})
        seen[f["device"]] = seen.get(f["device"], 0) + 1
        if seen[f["device"]] > MAX_OOMS_SHOWN:
            continue
        out.append({"what": "oom", "device": f["device"], "bytes": f.get("needed_bytes") or f["allocated_bytes"],
                    "limit": f.get("limit_bytes"), "message": f"{d.get('label', f['device'])}: {oom_message(f)}",
                    "evidence": f.get("evidence")})
    for dev, n in seen.items():
        if n > MAX_OOMS_SHOWN:
            label = labels.get(dev, {}).get("label", dev)
            out.append({"what": "oom", "device": dev, "bytes": 0, "limit": None,
                        "message": f"{label}: and {n - MAX_OOMS_SHOWN} more out-of-memory errors "
                                   f"({n} in all; tracekit report lists them)",
                        "evidence": {"rule": "more `oom` entries in the allocator's trace", "events": [], "frames": []}})
    return out


def oom_message(f: dict) -> str:
    """One line: out of memory, the failed request, free memory then, the cap, what the run needed, the top holders."""
    request, free, limit = f.get("request_bytes"), f.get("device_free_bytes"), f.get("limit_bytes")
    where = f.get("where") or "the recorded code"
    at = (f"at entry {f['index']}" if f.get("index") is not None and f.get("source") != "recorder error"
          else "when the recording ended (the recorder's exception; the trace holds no oom entry)")
    parts = [f"out of memory {at}: {where} asked for "
             + (fmt_bytes(request) if request is not None else "more memory (the size is not recorded)")]
    parts.append(f"{fmt_bytes(free)} was free on the device" if free is not None else "free memory not recorded")
    need = f.get("needed_bytes")
    if limit is not None:
        need_s, limit_s = fmt_pair(need, limit) if need else (None, fmt_bytes(limit))
        parts.append(f"the process was capped at {limit_s} (torch.cuda.set_per_process_memory_fraction)")
    else:
        need_s = fmt_bytes(need) if need else None
    parts.append(f"{fmt_bytes(f.get('allocated_bytes'))} was allocated")
    if request and need_s:
        parts.append(f"the run needs at least {need_s}")
    holders = [s for s in f.get("top_stacks") or []][:3]
    if holders:
        parts.append("top holders: " + ", ".join(
            f"{fmt_bytes(s['bytes'])} from {s['where']}" + (f" ({_main(s)})" if _main(s) else "") for s in holders))
    return "; ".join(parts)


def _main(site: dict) -> str:
    cats = site.get("by_category") or {}
    return max(cats, key=lambda c: cats[c]) if cats else ""


def over_budget(report, max_peak, max_reserved, budgets, no_leaks) -> list[dict]:
    """What fails, as [{"what", "device", "bytes", "limit", "message", "evidence"}]: every out-of-memory error
    first, then what is over the budgets given (and leaks with `no_leaks`)."""
    out = oom_problems(report)

    def add(what, d, got, limit, text, evidence, lower=False):
        a, b = fmt_pair(got, limit)
        out.append({"what": what, "device": d["device"], "bytes": got, "limit": limit,
                    "message": f"{d['label']}: {text} {'at least ' if lower else ''}{a} > {b} "
                               f"(over by {'at least ' if lower else ''}{fmt_bytes(got - limit)})",
                    "evidence": evidence})

    for d in report["devices"]:
        head = d.get("headline_peak") or {"bytes": d["peak_allocated_bytes"], "index": d.get("peak_event_index"),
                                          "measure": "requested"}
        lower = bool(d.get("demand_is_lower_bound"))
        # the report's headline (the allocator's counter where modelled), or after an OOM what the run needed
        demand = (d.get("demand_bytes") or 0) if lower else (head["bytes"] or 0)
        if max_peak is not None and demand > max_peak:
            blocks = head.get("measure") == "blocks"
            what = ("needed (the run died of out of memory: its demand, a lower bound)" if lower
                    else "peak allocated" + (" (max_memory_allocated)" if blocks else ""))
            add("peak", d, demand, max_peak, what,
                {"rule": d.get("demand_why") if lower else
                 ("the most bytes in the caching allocator's blocks after any trace entry (the allocator model's "
                  "replay, as torch.cuda.max_memory_allocated counts them)" if blocks
                  else "the most bytes allocated after any trace entry"),
                 "events": _entry(d.get("peak_event_index") if lower else head.get("index")),
                 "frames": ((d.get("top_stacks_at_peak") or [{}])[0]).get("frames", [])[:8]}, lower)
            top = (d.get("top_stacks_at_peak") or [{}])[0]
            if top.get("where"):
                out[-1]["message"] += f"; largest site at the peak: {fmt_bytes(top['bytes'])} from {top['where']}"
        if max_reserved is not None and (d["peak_reserved_bytes"] or 0) > max_reserved:
            add("reserved", d, d["peak_reserved_bytes"], max_reserved, "peak reserved",
                {"rule": "the most bytes reserved by the caching allocator (segments) after any trace entry",
                 "events": _entry(d.get("peak_reserved_event_index")),
                 "frames": []})
        at_peak = d.get("categories_at_peak", {})
        for name, limit in budgets.items():
            got = at_peak.get(name, 0)
            if got > limit:
                add(name, d, got, limit, f"{name} at the peak",
                    {"rule": f"bytes of the allocations classified {name} live at the peak "
                             f"(reasons: {_reasons(d, name)})",
                     "events": _entry(d.get("peak_event_index")), "frames": []})
    if no_leaks:
        labels = {d["device"]: d["label"] for d in report["devices"]}
        for f in report["findings"]:
            if f["kind"] == "leak":
                out.append({"what": "leak", "device": f["device"], "bytes": f["bytes"], "limit": 0,
                            "message": f"{labels.get(f['device'], f['device'])}: leak: {f['summary']}",
                            "evidence": f.get("evidence")})
    return out


def _entry(index) -> list:
    return [int(index)] if isinstance(index, int) and index >= 0 else []


def _reasons(d: dict, name: str) -> str:
    rs = [r["reason"] for r in d.get("reasons_at_peak") or [] if r["category"] == name][:2]
    return "; ".join(rs) or "none recorded"


def check(report, max_peak=None, max_reserved=None, budgets=None, no_leaks=False) -> dict:
    """`tracekit check`: {"ok", "problems", "checked", "not_checked", "notes", "defaults"}.

    With no criterion the defaults are checked: no out-of-memory error and no leak. An out-of-memory error
    fails whatever the criteria."""
    budgets = budgets or {}
    defaults = max_peak is None and max_reserved is None and not budgets and not no_leaks
    leaks = no_leaks or defaults
    problems = over_budget(report, max_peak, max_reserved, budgets, leaks)
    ooms = sum(d.get("out_of_memory", d.get("oom_count", 0)) for d in report["devices"])
    checked = [f"out of memory: {'none recorded' if not ooms else f'{ooms} recorded (fails)'}"]
    not_checked, notes = [], []
    blind = [d["label"] for d in report["devices"] if not d.get("history_entries", 1) and not d.get("out_of_memory")]
    if blind:
        not_checked.append(f"out-of-memory errors on {', '.join(blind)}: the file holds no allocator history (only "
                           "its segments, or the `snapshot` entry of a one-entry ring buffer such as torch 2.0's "
                           "default), so an OOM-observer dump cannot be told from any other snapshot")
    if max_peak is not None:
        checked.append(f"peak allocated (as torch.cuda.max_memory_allocated counts it where the allocator is "
                       f"modelled; the demand, after an out-of-memory error) <= {fmt_bytes(max_peak)}")
    else:
        not_checked.append("peak allocated (--max-peak SIZE)")
    if max_reserved is not None:
        checked.append(f"peak reserved <= {fmt_bytes(max_reserved)}")
    else:
        not_checked.append("peak reserved (--max-reserved SIZE)")
    if budgets:
        checked += [f"{k} at the peak <= {fmt_bytes(v)}" for k, v in budgets.items()]
    else:
        not_checked.append("categories at the peak (--max CATEGORY=SIZE)")
    if leaks:
        short = [d["label"] for d in report["devices"] if len(d.get("iterations") or []) < 3]
        checked.append("leaks" + (" (by default)" if defaults else ""))
        if short:
            not_checked.append(f"leaks on {', '.join(short)}: fewer than 3 iterations recorded, growth cannot be told "
                               "from a step's own memory")
    else:
        not_checked.append("leaks (--no-leaks)")
    for d in report["devices"]:
        if not d.get("out_of_memory") and d.get("allocator_counted_ooms"):
            notes.append(f"{d['label']}: the allocator counted {d['allocator_counted_ooms']} out-of-memory error(s) "
                         "in this process (torch.cuda.memory_stats num_ooms) that this recording does not hold: "
                         "they may predate it")
        inv = d.get("replay_invariant") or {}
        if inv.get("checked") and not inv.get("ok"):
            notes.append(f"{d['label']}: the replay check failed: figures may be off")
    return {"ok": not problems, "problems": problems, "checked": checked, "not_checked": not_checked,
            "notes": notes, "defaults": defaults}
