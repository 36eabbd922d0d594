"""Memory budgets: what in a report is over the limits a user set (`tracekit check`, the pytest markers)."""
from __future__ import annotations

from ..units import fmt_bytes


def over_budget(report, max_peak, max_reserved, budgets, no_leaks) -> list[dict]:
    """What is over budget, as [{"what", "device", "bytes", "limit", "message"}]."""
    out = []

    def add(what, d, got, limit, text):
        out.append({"what": what, "device": d["device"], "bytes": got, "limit": limit,
                    "message": f"{d['label']}: {text} {fmt_bytes(got)} > {fmt_bytes(limit)} "
                               f"(over by {fmt_bytes(got - limit)})"})

    for d in report["devices"]:
        if max_peak is not None and (d["peak_allocated_bytes"] or 0) > max_peak:
            add("peak", d, d["peak_allocated_bytes"], max_peak, "peak allocated")
            top = (d.get("top_stacks_at_peak") or [{}])[0]
            if top.get("where"):
                out[-1]["message"] += f"; largest site at the peak: {fmt_bytes(top['bytes'])} from {top['where']}"
        if max_reserved is not None and (d["peak_reserved_bytes"] or 0) > max_reserved:
            add("reserved", d, d["peak_reserved_bytes"], max_reserved, "peak reserved")
        at_peak = d.get("categories_at_peak", {})
        for name, limit in budgets.items():
            got = at_peak.get(name, 0)
            if got > limit:
                add(name, d, got, limit, f"{name} at the peak")
    if no_leaks:
        labels = {d["device"]: d["label"] for d in report["devices"]}
        for f in report["findings"]:
            if f["kind"] == "leak":
                out.append({"what": "leak", "device": f["device"], "bytes": f["bytes"], "limit": 0,
                            "message": f"{labels.get(f['device'], f['device'])}: leak: {f['summary']}"})
    return out
