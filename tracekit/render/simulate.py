"""Plain-text rendering of `tracekit estimate --simulate` (with --compare and --largest)."""
from __future__ import annotations

from ..units import fmt_bytes
from . import Reporter

PRECISION = {"fp32": "fp32", "amp": "amp (bf16 autocast, fp32 weights)", "bf16": "bf16 weights",
             "fp16": "fp16 weights"}


def _b(n) -> str:
    return "n/a" if n is None else f"{fmt_bytes(n)} ({n:,} bytes)"


def _signed(n) -> str:
    return ("+" if n > 0 else "") + fmt_bytes(n) if n else "0"


def simulate_text(out: dict) -> str:
    s = out["simulated"]
    w = s["workload"]
    gpu = out["gpu"]
    pc = out.get("param_count") or {}
    lines = [f"Simulated training step: {s['model_class']}, {pc.get('params', 0):,} parameters "
             f"(counted by the {pc.get('path', 'formula')})",
             f"  micro-batch {w['batch']} x seq {w['seq']}, precision {PRECISION.get(w['precision'], w['precision'])}, "
             f"optimizer {w['optimizer']}, checkpointing {w['checkpointing']}",
             f"  GPU {gpu['name']} (sm{gpu['compute_capability'][0]}{gpu['compute_capability'][1]}): attention by "
             + (", ".join(f"{k} ({v} calls a step)" for k, v in s["sdpa_backends"].items()) or "no SDPA call")
             + f"; torch {s['torch']}, transformers {s['transformers']}", ""]
    where = f"step {s['iteration']}" + (f", {s['phase']}" if s["phase"] else "") + (f", at {s['at']}" if s["at"] else "")
    lines.append(f"Peak allocated (max_memory_allocated): {_b(s['peak_allocated_bytes'])}")
    lines.append(f"  {where}; requested {fmt_bytes(s['peak_requested_bytes'])} before the allocator's rounding")
    if s["run_peak_allocated_bytes"] > s["peak_allocated_bytes"]:
        lines.append(f"  the warm-up step peaks higher: {_b(s['run_peak_allocated_bytes'])}")
    if s.get("peak_reserved_bytes") is None:
        lines.append("Peak reserved (max_memory_reserved): not modelled for this stream")
    else:
        lines.append(f"Peak reserved (max_memory_reserved): {_b(s['peak_reserved_bytes'])}")
        lines.append(f"  the caching allocator's segments: {fmt_bytes(s['peak_reserved_bytes'] - s['peak_allocated_bytes'])}"
                     " above the allocated peak")
    f = s.get("fits")
    if f:
        what = gpu["name"] if out.get("budget_bytes") is None else f"the budget of {fmt_bytes(f['capacity_bytes'])}"
        if f["fits"]:
            lines.append(f"  fits on {what}: {fmt_bytes(f['margin_bytes'])} to spare of {fmt_bytes(f['capacity_bytes'])} "
                         f"by the {f.get('by', 'allocated')} peak of the whole run"
                         + (" (the CUDA context and the allocator's cached, unused blocks come out of that)"
                            if f.get("by") != "reserved" else " (the CUDA context comes out of that)"))
        else:
            lines.append(f"  does NOT fit on {what}: {fmt_bytes(-f['margin_bytes'])} over its "
                         f"{fmt_bytes(f['capacity_bytes'])}")
    lines += ["", "At the peak, by category"]
    for cat, b in s["categories_at_peak"].items():
        lines.append(f"  {cat:<16} {fmt_bytes(b):>11}")
    lines += ["", "Largest lines at the peak"]
    for g in s["lines_at_peak"]:
        n = g["count"]
        lines.append(f"  {fmt_bytes(g['bytes']):>11}  {g['category']:<15} {g['line']}  ({n} block{'s' if n != 1 else ''})")
    formula = out.get("formula") or {}
    if formula.get("per_gpu"):
        t = formula["per_gpu"]["total"]
        lines += ["", f"Formula estimate (each category's own maximum, added): {fmt_bytes(t)}; "
                      f"the simulation says {_signed(s['peak_allocated_bytes'] - t)} from it"]
    if out.get("saved_trace"):
        lines.append(f"The simulated stream is in {out['saved_trace']} (tracekit report / view open it)")
    if "compare" in out:
        lines += [""] + compare_text(out["compare"])
    if "largest" in out:
        lines += [""] + largest_text(out["largest"], gpu, out.get("budget_bytes"))
    lines += ["", "How", f"  - peak allocated: {s['how']['peak_allocated_bytes']}",
              f"  - {s['how']['window']}", f"  - categories: {s['how']['categories_at_peak']}",
              f"  - peak reserved: {s['how'].get('peak_reserved_bytes')}",
              "  - not modelled: the CUDA context (never in the allocator's peaks), cuDNN's workspaces, "
              "other processes on the GPU"]
    return "\n".join(lines)


def compare_text(c: dict) -> list:
    rec, sim = c["recorded"], c["simulated"]
    out = [f"Beside the recording {c.get('file', '')}",
           f"  peak allocated: simulated {fmt_bytes(sim['peak_allocated_bytes'])}, recorded "
           f"{fmt_bytes(rec['peak_allocated_bytes'])}: {_signed(c['difference_bytes'])} "
           f"({c['difference_percent']:+.2f}%)" if c["difference_percent"] is not None else "",
           f"  requested bytes live at each peak differ by {_signed(c['requested_difference_bytes'])}",
           "", f"  {'category':<16} {'simulated':>11} {'recorded':>11} {'difference':>11}"]
    for r in c["by_category"]:
        out.append(f"  {r['category']:<16} {fmt_bytes(r['simulated']):>11} {fmt_bytes(r['recorded']):>11} "
                   f"{_signed(r['difference']):>11}")
    out += ["", f"  {'simulated':>11} {'recorded':>11}  largest lines at the peaks"]
    for r in c["largest_lines"]:
        out.append(f"  {fmt_bytes(r['simulated']):>11} {fmt_bytes(r['recorded']):>11}  {r['line']}")
    if c["itemized"]:
        out += ["", "  The difference, line by line"]
        for r in c["itemized"]:
            out.append(f"  {_signed(r['difference']):>11}  {r['line']} ({', '.join(r['categories'])})")
    out.append(f"  ({c['note']})")
    return out


def largest_text(got: dict, gpu: dict, budget) -> list:
    what = got["what"]
    fixed = ", ".join(f"{k} {v}" for k, v in got["fixed"].items())
    room = f"the budget of {fmt_bytes(got['budget_bytes'])}" if budget is not None else \
        f"{gpu['name']} ({fmt_bytes(got['budget_bytes'])})"
    if got["largest"] is None:
        first = got["tries"][0] if got["tries"] else None
        head = f"No {what} fits {room} ({fixed})"
        if first:
            head += f": {what} {first['value']} needs {fmt_bytes(first['peak_allocated_bytes'])}"
        out = [head]
    else:
        out = [f"Largest {what} that fits {room} ({fixed}): {got['largest']}"
               + (f" (the limit searched, {got['limit']})" if got.get("limit_reached") else "")]
    out.append(f"  by {len(got['tries'])} simulated runs (a straight line through two runs only places the first "
               "bracket; bisection over runs decides):")
    for t in sorted(got["tries"], key=lambda t: t["value"]):
        out.append(f"    {what} {t['value']:>6}: {fmt_bytes(t['peak_allocated_bytes']):>11}  "
                   f"{'fits' if t['fits'] else 'does not fit'}")
    return out


def formula_extras_text(extras: dict) -> str:
    """The lines `estimate` adds under the formula estimate: who counted the parameters, whether it fits."""
    out = []
    pc = extras.get("param_count")
    if pc:
        if pc["path"] == "formula":
            out.append(f"Parameters counted by the formulas ({pc.get('why', '')})")
        else:
            line = f"Parameters: {pc['params']:,} by a {pc['path']}"
            if pc.get("formula_params") is not None and pc["formula_params"] != pc["params"]:
                d = pc["formula_params"] - pc["params"]
                line += (f"; the formulas above count {pc['formula_params']:,} ({d:+,}, "
                         f"{d / pc['params']:+.2%}), and size the model states from that")
            out.append(line)
    f = extras.get("fits")
    if f:
        g = extras.get("gpu")
        what = g["name"] if g and f["capacity_bytes"] == g["memory_bytes"] else f"the budget of {fmt_bytes(f['capacity_bytes'])}"
        if f["fits"]:
            out.append(f"Fits on {what}: {fmt_bytes(f['margin_bytes'])} to spare of {fmt_bytes(f['capacity_bytes'])} "
                       "(formula total; the CUDA context and the allocator's caching come out of that)")
        else:
            out.append(f"Does NOT fit on {what}: {fmt_bytes(-f['margin_bytes'])} over its {fmt_bytes(f['capacity_bytes'])}")
    return ("\n\n" + "\n".join(out)) if out else ""


class SimulateText(Reporter):
    """`tracekit estimate --simulate` as text: the simulated peak, whether it fits the GPU, beside a recording."""

    kind, format = "simulate", "text"

    def render(self, out) -> str:
        return simulate_text(out)
