"""Plain-text rendering of `tracekit diff`: what changed beyond noise, read at a glance."""
from __future__ import annotations

from typing import Any

from ..units import fmt_bytes
from . import Reporter


def relative(c: dict) -> str:
    """"+12%", "-0.4%", "×2.0", "new", "gone" for a change {a, b, change}; "" when it cannot say."""
    a, b, d = c.get("a"), c.get("b"), c.get("change")
    if d is None or not d:
        return ""
    if not a:
        return "new"
    if not b:
        return "gone"
    ratio = b / a
    if ratio >= 10:
        return f"×{ratio:.0f}"
    if ratio >= 2:
        return f"×{ratio:.1f}"
    r = d / a
    return f"{r:+.1%}" if abs(r) < 0.01 or r <= -0.995 else f"{r:+.0%}"


def signed(n) -> str:
    return "" if n is None else ("+" if n > 0 else "") + fmt_bytes(n)


def change_text(c: dict) -> str:
    """"+9.8 MiB (+41%)" for a significant change, "same" otherwise."""
    if c.get("change") is None:
        return "n/a"
    if not c["significant"]:
        return "same"
    rel = relative(c)
    return f"{signed(c['change'])}{f' ({rel})' if rel else ''}"


def _row(name: str, c: dict, width: int, indent: str) -> str:
    return (f"{indent}{name:<{width}}  {fmt_bytes(c['a']):>10}  {fmt_bytes(c['b']):>10}  {change_text(c)}")


def _category_rows(title: str, cats: dict, indent: str) -> list[str]:
    rows = [(k, c) for k, c in cats.items() if c["significant"]]
    if not rows:
        return []
    width = max(len(k) for k, _ in rows)
    rows.sort(key=lambda kc: -abs(kc[1]["change"]))
    return [f"{indent}{title}"] + [_row(k, c, width, indent + "  ") for k, c in rows]


def _keyed_rows(title: str, rows: list, key: str) -> list[str]:
    if not rows:
        return []
    width = max(len(f"{signed(r['change'])} ({relative(r)})") for r in rows)
    cw = max(len(r["category"] or "") for r in rows)
    return [f"  {title}"] + [f"    {signed(r['change']) + ' (' + relative(r) + ')':>{width}}  "
                             f"{r['category'] or '':<{cw}}  {r[key]}" for r in rows]


def diff_text(result: dict) -> str:
    out = [f"A  {result['a']}", f"B  {result['b']}",
           f"Changes are B - A; those under {result['noise_share']:.0%} of the larger peak are left out.", ""]
    for d in result["devices"]:
        out.append(f"Device {d['label']}  (noise: changes under {fmt_bytes(d['noise_bytes'])})")
        head = d.get("headline_peak_bytes") or {}
        req = d["peak_allocated_bytes"]
        first = [("peak allocated", "peak_allocated_bytes")]
        if head.get("a") is not None and head.get("b") is not None:  # the allocator's counter, requested beside it
            first = [("peak allocated", "headline_peak_bytes")] + (
                [("requested by tensors", "peak_allocated_bytes")] if (head["a"], head["b"]) != (req["a"], req["b"])
                else [])
        figures: list[tuple[str, Any]] = first + [("peak reserved", "peak_reserved_bytes"),
                   ("before the trace", "allocated_before_trace_bytes"),
                   ("final allocated", "final_allocated_bytes")]
        figures = [(n, d[k]) for n, k in figures if d[k]["a"] is not None and d[k]["b"] is not None]
        lower = d.get("demand_is_lower_bound") or {}
        width = max([len(n) for n, _ in figures] + [len("needed (out of memory)")] * bool(lower.get("a") or lower.get("b")))
        out.append(f"  {'':<{width}}  {'A':>10}  {'B':>10}  change")
        out += [_row(n, c, width, "  ") for n, c in figures]
        if lower.get("a") or lower.get("b"):
            c = d["demand_bytes"]
            a = ("≥ " if lower.get("a") else "") + fmt_bytes(c["a"])
            b = ("≥ " if lower.get("b") else "") + fmt_bytes(c["b"])
            which = " and ".join(x for x, y in (("A", lower.get("a")), ("B", lower.get("b"))) if y)
            out.append(f"  {'needed (out of memory)':<{width}}  {a:>10}  {b:>10}  {change_text(c)}"
                       f"{' at least' if lower.get('b') and c.get('significant') else ''}"
                       f"  ({which} ran out of memory: what it needed is a lower bound, above its peak)")
        pw = d.get("peak_when") or {}
        if pw.get("a") or pw.get("b"):
            same = pw.get("a") == pw.get("b")
            out.append(f"  the peak comes {pw['a']} in both" if same else
                       f"  the peak comes {pw.get('a') or '(no phases)'} in A, {pw.get('b') or '(no phases)'} in B")
        out += _category_rows("at the peak, by category:", d["categories_at_peak"], "  ")
        out += _category_rows("at the end, by category:", d.get("categories_at_end") or {}, "  ")
        out += _phase_lines(d.get("phases") or [])
        out += _iteration_lines(d.get("iterations") or [])
        out += _keyed_rows("at the peak, by site (your line):", d["sites_at_peak"], "site")
        out += _keyed_rows("at the peak, by module (named tensors, and the module that ran):", d.get("modules_at_peak") or [],
                           "module")
        if not any(c["significant"] for _, c in figures) and not d["sites_at_peak"]:
            out.append("  nothing changed beyond noise")
        out.append("")
    out += _finding_lines(result["findings"])
    return "\n".join(out).rstrip() + "\n"


def _phase_lines(phases: list) -> list[str]:
    moved = [p for p in phases if p["peak_bytes"]["significant"]
             or any(c["significant"] for c in p["categories_at_peak"].values())]
    if not moved:
        return ["  aligned by phase: each phase peaks the same"] if phases else []
    width = max(len(p["phase"]) for p in moved)
    out = ["  aligned by phase (each phase's peak over the recorded iterations; its largest moves):"]
    for p in moved:
        cats = sorted(((k, c) for k, c in p["categories_at_peak"].items() if c["significant"]),
                      key=lambda kc: -abs(kc[1]["change"]))[:3]
        why = ", ".join(f"{k} {signed(c['change'])}" for k, c in cats)
        pk = p["peak_bytes"]
        if pk["a"] is None or pk["b"] is None:  # one file has no entry in this phase at all
            side = "A" if pk["a"] is None else "B"
            shown = [fmt_bytes(v) if v is not None else "-" for v in (pk["a"], pk["b"])]
            out.append(f"    {p['phase']:<{width}}  {shown[0]:>10}  {shown[1]:>10}  "
                       f"({side} allocates nothing in this phase)")
            continue
        out.append(_row(p["phase"], pk, width, "    ") + (f"  ({why})" if why else ""))
    return out


def _iteration_lines(its: list) -> list[str]:
    moved = [i for i in its if i["peak_bytes"]["significant"] or i["end_bytes"]["significant"]]
    if not moved:
        return [f"  aligned by iteration: the {len(its)} paired iterations peak and end the same"] if its else []
    out = ["  aligned by iteration (the n-th recorded iteration of A against the n-th of B):"]
    for i in its:
        name = str(i["iteration_a"]) if i["iteration_a"] == i["iteration_b"] else \
            f"{i['iteration_a']} vs {i['iteration_b']}"
        out.append(f"    {name:<8} peak {fmt_bytes(i['peak_bytes']['a']):>10} -> {fmt_bytes(i['peak_bytes']['b']):>10}"
                   f" {change_text(i['peak_bytes']):<18}  end {fmt_bytes(i['end_bytes']['a']):>10} -> "
                   f"{fmt_bytes(i['end_bytes']['b']):>10} {change_text(i['end_bytes'])}")
    return out


def _finding_lines(f: dict) -> list[str]:
    out = []
    for title, rows in (("new in B", f["added"]), ("gone in B", f["removed"])):
        for r in rows:
            out.append(f"  {title:<9} [{r['kind']}{' ' + r['label'] if r.get('label') else ''}] {r['summary']}")
    for r in f["changed"]:
        where = f" from {r['where']}" if r.get("where") else ""
        out.append(f"  {'changed':<9} [{r['kind']}{' ' + r['label'] if r.get('label') else ''}] "
                   f"{fmt_bytes(r['bytes']['a'])} -> {fmt_bytes(r['bytes']['b'])}, {change_text(r['bytes'])}{where}")
    return (["Findings (other than the peak)"] + out) if out else ["Findings: the same in both"]


class DiffText(Reporter):
    """`tracekit diff` as text: what changed beyond noise."""

    kind, format = "diff", "text"

    def render(self, result) -> str:
        return diff_text(result)
