"""Plain-text rendering of estimates, of predicted vs measured, and of what-if answers."""
from __future__ import annotations

from ..units import fmt_bytes
from . import Reporter


def _gb(n) -> str:
    return f"{n / 1e9:.2f} GB"


def estimate_text(est, deepspeed=None) -> str:
    from ..analysis.estimate.shapes import ModelShape, gpt_style_params

    s, shape = est.setup, est.shape
    out = [f"{shape.name}: {est.params:,} parameters ({est.params / 1e9:.3g} B), "
           f"{est.trainable_params:,} trainable"]
    if isinstance(shape, ModelShape):
        out.append(f"  counted by {shape.counted_by}: {shape.describe()}")
    knobs = [s.mode, f"precision {s.precision}"]
    if s.mode == "train":
        knobs.append(f"optimizer {s.optimizer}")
    if s.quant != "none":
        knobs.append(f"weights {s.quant}")
    if s.lora_rank:
        knobs.append(f"LoRA rank {s.lora_rank}")
    if s.seq:
        knobs += [f"micro-batch {s.batch} × seq {s.seq}", f"attention {s.attention}",
                  f"checkpointing {s.checkpointing}"]
    if s.zero or s.dp > 1 or s.tp > 1:
        knobs.append(f"ZeRO-{s.zero}, dp {s.dp}, tp {s.tp}")
    out.append("  " + ", ".join(knobs))
    for where, title in (("gpu", "Per GPU, by category (not all live at once: see the moments below)"),
                         ("cpu", "Per CPU (offloaded)")):
        per = est.held(where)
        if where == "cpu" and not per["total"]:
            continue
        out += ["", title]
        wc = max([16] + [len(c) for c in per if c != "total" and per[c]])  # unsharded_parameter is 19 wide
        for cat in [c for c in per if c != "total"]:
            lines = [ln for ln in est.lines if ln.category == cat and ln.where == where]
            if not per[cat]:
                continue  # JSON keeps every category; text shows what holds bytes
            if len(lines) == 1:
                out.append(f"  {cat:<{wc}} {fmt_bytes(per[cat]):>11}  {lines[0].formula}")
                continue
            out.append(f"  {cat:<{wc}} {fmt_bytes(per[cat]):>11}")
            out += [f"    {fmt_bytes(ln.bytes):>13}  {ln.formula}" for ln in lines]
        if where == "cpu":
            out.append(f"  {'total':<{wc}} {fmt_bytes(per['total']):>11}  ({_gb(per['total'])}, {per['total']:,} bytes)")
            continue
        moments, peak = est.moments(), est.peak_moment
        shown = [c for c in per if c != "total" and any(m["per_gpu"][c] for m in moments)]
        wm = max([20] + [len(m["name"]) + 5 for m in moments])
        out += ["", "Moments of the " + ("step" if s.mode == "train" else "forward") + " (live bytes; the peak is "
                "the largest, not the sum of each category's largest)",
                "  " + f"{'':<{wm}}" + "".join(f"{c[:11]:>12}" for c in shown) + f"{'total':>12}"]
        for m in moments:
            mark = "peak " if m is peak or m["name"] == peak["name"] else ""
            out.append(f"  {mark + m['name']:<{wm}}" + "".join(f"{fmt_bytes(m['per_gpu'][c]):>12}" for c in shown)
                       + f"{fmt_bytes(m['per_gpu']['total']):>12}")
        out.append(f"  {'peak':<16} {fmt_bytes(peak['per_gpu']['total']):>11}  ({_gb(peak['per_gpu']['total'])}, "
                   f"{peak['per_gpu']['total']:,} bytes) at '{peak['name']}': {peak['what']}")
    notes = list(est.assumptions)
    if isinstance(shape, ModelShape):
        napkin = gpt_style_params(shape)
        if abs(napkin - est.params) > 0.001 * est.params:
            notes.append(f"parameters counted exactly for this architecture; the GPT-style napkin count "
                         f"(12·L·h² + 13·L·h + V·h) would say {napkin:,} ({(napkin - est.params) / est.params:+.1%}), "
                         "so calculators that use it differ by that much on model states")
    notes.append("not counted: the CUDA context and kernels (~0.3-1 GiB per process, outside the allocator), "
                 "NCCL buffers, the caching allocator's rounding and fragmentation")
    out += ["", "Assumptions"] + [f"  - {n}" for n in dict.fromkeys(notes)]
    if deepspeed:
        out += ["", deepspeed["title"], "  per CPU  |  per GPU |   Options"]
        for r in deepspeed["rows"]:
            opts = ", ".join(f"{k}={v}" for k, v in r.items() if k not in ("per_cpu", "per_gpu"))
            out.append(f"  {r['per_cpu'] / 2**30:7.2f}GB | {r['per_gpu'] / 2**30:6.2f}GB | {opts}")
        out.append("  (DeepSpeed prints GiB as \"GB\"; model states only, CPU with its 1.5 buffer factor)")
    return "\n".join(out) + "\n"


def deepspeed_rows(est, nodes=1) -> dict:
    """DeepSpeed's estimate_zero{2,3}_model_states_mem_needs_all_live table for this model and --dp GPUs."""
    from ..analysis.estimate import deepspeed
    from ..errors import TracekitError

    s = est.setup
    if nodes < 1 or s.dp % nodes:
        raise TracekitError(f"--nodes {nodes} must divide --dp {s.dp} (GPUs in all)")
    per_node = s.dp // nodes
    stage = 3 if s.zero == 3 else 2
    largest = est.shape.largest_layer_params()
    if stage == 3 and not largest:
        raise TracekitError("DeepSpeed's ZeRO-3 estimate needs the largest layer: give --largest-layer or a config")
    return {"stage": stage, "total_params": est.params, "largest_layer_params": largest,
            "gpus_per_node": per_node, "nodes": nodes,
            "title": (f"DeepSpeed estimate_zero{stage}_model_states_mem_needs_all_live: {nodes} node(s) × "
                      f"{per_node} GPUs, {est.params // 10**6}M total params"
                      + (f", {largest // 10**6}M largest layer params" if stage == 3 else "")),
            "rows": deepspeed.table(stage, est.params, largest, per_node, nodes)}


def _signed(n) -> str:
    return ("+" if n > 0 else "") + fmt_bytes(n) if n else "="


def comparison_lines(e: dict) -> list[str]:
    """Predicted vs measured for one device, for `tracekit report`."""
    s = e["setup"]
    what = f"{s['precision']}, " + (s["optimizer"] if s["mode"] == "train" else "inference") + (
        f", batch {s['batch']} × seq {s['seq']}" if s["seq"] else "")
    if s.get("fsdp") or (s.get("dp") or 1) > 1:
        what += f", {'FSDP' if s.get('fsdp') else 'ZeRO-' + str(s.get('zero', 0))} over {s['dp']} ranks"
    wc = max([16] + [len(r["category"]) for r in e["categories"] if r["predicted"] or r["measured"]])
    out = [f"  predicted vs measured ({e['model']}: {e['params']:,} params; {what}):",
           f"    {'':<{wc}} {'predicted':>11} {'measured':>11} {'difference':>11} {'at the peak':>12} "
           f"{'predicted at peak':>18}"]
    for r in e["categories"]:
        if r["predicted"] is None and r["measured"]:  # not predicted (the file does not say the tokens)
            out.append(f"    {r['category']:<16} {'?':>11} {fmt_bytes(r['measured']):>11} {'?':>11} "
                       f"{fmt_bytes(r['at_peak']):>12} {'?':>18}  (not predicted)")
        elif r["predicted"] or r["measured"]:
            ratio = r["difference"] / r["predicted"] if r["predicted"] else None
            share = f" ({ratio:+.1%})" if ratio and abs(ratio) < 10 else ""
            guess = r.get("inferred_share") or 0
            tag = ("  (inferred)" if guess >= 0.995 else f"  ({guess:.0%} inferred)" if guess > 0 else "")
            out.append(f"    {r['category']:<{wc}} {fmt_bytes(r['predicted']):>11} {fmt_bytes(r['measured']):>11} "
                       f"{_signed(r['difference']):>11} {fmt_bytes(r['at_peak']):>12} "
                       f"{fmt_bytes(r.get('predicted_at_peak', r['predicted'])):>18}{share}{tag}")
    moment = f", predicted at '{e['predicted_peak_moment']}'" if e.get("predicted_peak_moment") else ""
    out.append(f"    {'total':<{wc}} {fmt_bytes(e['predicted_total']):>11} {fmt_bytes(e['peak_allocated']):>11} "
               f"{_signed(e['peak_difference']):>11}   (the peak: measured allocated{moment})")
    if e["gap_at_peak"]:
        out.append("    the difference at the peak:")
        out += [f"      {_signed(g['bytes']):>11}  {g['what']}" for g in e["gap_at_peak"]]
    if e.get("allocator_rounding_at_peak"):
        out.append(f"      {'':>11}  (of these, about {fmt_bytes(e['allocator_rounding_at_peak'])} is the allocator "
                   "rounding sizes up to 512 B)")
    if e.get("reserved_unused_at_peak") or e.get("not_visible"):
        out.append("    on top of the allocated peak:")
    if e.get("reserved_unused_at_peak"):
        out.append(f"      {_signed(e['reserved_unused_at_peak']):>11}  reserved but not allocated "
                   "(fragmentation, the allocator's cache)")
    if e.get("not_visible"):
        out.append(f"      {'?':>11}  {e['not_visible']}")
    out.append(f"    (measured: {e['measured_is']})")
    out += [f"    note: {n}" for n in e.get("notes", [])]
    return out


def _a(word: str) -> str:
    return ("an " if word[:1] in "aeiou" else "a ") + word


def whatif_text(r: dict) -> str:
    if r.get("relative"):
        return _relative_text(r)
    from ..units import fmt_pair

    f = r["fit"]
    by = f["by"]
    out = ["Recordings"]
    for p in r["points"]:
        need = ""
        if p.get("lower_bound"):
            fails = p.get("failures") or []
            avail = next((x["available"] for x in fails if x.get("available") is not None), None)
            a, b = fmt_pair(p["demand"], avail) if avail is not None else (fmt_bytes(p["demand"]), None)
            need = f"  needed ≥ {a} (out of memory" + (f" with {b} available" if b else "") + ")"
        out.append(f"  {by} {p['size']:>6}  peak {fmt_bytes(p['peak']):>10}{need}  {p['file']}")
    lo, hi = f.get("per_unit_range") or [f["per_unit_bytes"]] * 2
    slope = (f"{fmt_bytes(f['per_unit_bytes'])} × {by}" if lo == hi else
             f"{fmt_bytes(f['per_unit_bytes'])} × {by} (between {fmt_bytes(lo)} and {fmt_bytes(hi)} per {by})")
    out += ["", f"Fit: peak ≈ {fmt_bytes(f['fixed_bytes'])} + {slope}", f"  from {f['method']}"]
    out += [f"  - {a}" for a in f["assumptions"]]
    largest, rng, est = r[f"largest_{by}"], r.get(f"largest_{by}_range"), r.get(f"largest_{by}_estimate")
    budget = fmt_bytes(r["budget"])
    out.append("")
    if not r.get("grows", largest is not None) and largest is None:
        out.append(f"The peak does not grow with the {by}: any {by} fits if the fixed part does.")
    elif rng and rng[1] is None:
        out.append(f"Budget {budget}: {by} {rng[0]} or more fits (an extrapolation: only what surely grows with the "
                   f"{by} would leave no limit)")
    elif rng and rng[1] == 0:
        out.append(f"Budget {budget}: even {by} 1 does not fit (the fixed part alone is {fmt_bytes(f['fixed_bytes'])}).")
    elif rng and rng[0] != rng[1]:
        out.append(f"Budget {budget}: largest {by} that fits = {rng[0]} to {rng[1]} (an extrapolation from one "
                   f"recording; {est} by the categories' split, peak ≈ {fmt_bytes(r['peak_at_largest'])} at {rng[0]})")
    else:
        need, lim = fmt_pair(r["peak_at_largest"], r["budget"]) if r.get("peak_at_largest") else ("?", budget)
        how = (f"; an extrapolation from one recording: every split of its categories gives {largest}"
               if f.get("extrapolation") else "")
        out.append(f"Budget {lim}: largest {by} that fits = {largest} (peak ≈ {need}{how})")
    for c in r.get("constraints") or []:
        out.append(f"  - {c['text']}")
    if r["levers"]:
        lf = r["levers_for"]
        big = max(r["points"], key=lambda p: p["size"])
        need = f"needed ≥ {fmt_bytes(big['demand'])}" if big.get("lower_bound") else f"measured peak {fmt_bytes(big['peak'])}"
        facts = lf.get("facts") or {}
        out += ["", f"Levers, for {by} {lf[by]} on {lf.get('device') or big.get('device')} ({need}; "
                    f"{_a(facts.get('workload', 'training'))} run: {facts.get('workload_source', '')}):"]
        if facts.get("workload_note"):
            out.append(f"  note: {facts['workload_note']}")
        for lv in r["levers"]:
            fits = lv.get("fits_text") or ("fits" if lv["fits"] else "over budget")
            out.append(f"  saves {fmt_bytes(lv['saves_bytes']):>10}  -> {fmt_bytes(lv['peak_after']):>10}  "
                       f"{fits:<11}  {lv['lever']}")
            if lv.get("assumes"):
                out.append(f"        assumes {lv['assumes']}")
    for n in r.get("levers_not_offered") or []:
        out.append(f"  - {n}")
    out += [f"  - {a}" for a in r["levers_assumptions"]]
    return "\n".join(out) + "\n"


def _relative_text(r: dict) -> str:
    """whatif_text for a recording that does not say its size: sizes as multiples of the recorded one."""
    rel, f = r["relative"], r["fit"]
    by, unit = f["by"], r["relative"]["unit"]
    mult = lambda v: "?" if v is None else f"{v / unit:.2f}×"  # noqa: E731
    text = whatif_text({**r, "relative": None})
    text = text.replace(f"  {by} {unit:>6}  peak", f"  {by}      ?  peak")
    text = text.replace(f"({by} {unit})", f"(its {by}: not in the file)")
    text = text.replace(f"for {by} {unit} on", f"for {rel['what']} on").replace(f"at {by} {unit} ", f"at {rel['what']} ")
    lo, hi = f.get("per_unit_range") or [f["per_unit_bytes"]] * 2
    slope_old = (f"{fmt_bytes(f['per_unit_bytes'])} × {by}" if lo == hi else
                 f"{fmt_bytes(f['per_unit_bytes'])} × {by} (between {fmt_bytes(lo)} and {fmt_bytes(hi)} per {by})")
    slope_new = (f"{fmt_bytes(f['per_unit_bytes'] * unit)} × (multiple of {rel['what']})" + (
        "" if lo == hi else f" (between {fmt_bytes(lo * unit)} and {fmt_bytes(hi * unit)} per {rel['what']})"))
    text = text.replace(slope_old, slope_new)
    rng, est = r.get(f"largest_{by}_range"), r.get(f"largest_{by}_estimate")
    lines = []
    for line in text.splitlines():
        if line.startswith("  - an extrapolation from one recording (its"):
            mid = f["per_unit_bytes"]
            line = (f"  - an extrapolation from one recording ({rel['what']}: not in the file): {fmt_bytes(mid * unit)} "
                    f"per {rel['what']} by the categories' split, {fmt_bytes(hi * unit)} if the bytes of unknown kind "
                    f"grow too (only what surely grows, activations, inputs and KV cache: {fmt_bytes(lo * unit)}), so "
                    "the answer is an interval; record a second size to measure it")
        if line.startswith("Budget ") and rng:
            budget = fmt_bytes(r["budget"])
            if rng[1] is None:
                line = f"Budget {budget}: {mult(rng[0])} {rel['what']} or more fits"
            else:
                line = (f"Budget {budget}: the largest {by} that fits = {mult(rng[0])} to {mult(rng[1])} {rel['what']} "
                        f"({mult(est)} by the categories' split; {rel['why']})")
        lines.append(line)
    return "\n".join(lines) + "\n"


class EstimateText(Reporter):
    """`tracekit estimate` as text (`deepspeed`: DeepSpeed's estimator rows beside it, deepspeed_rows)."""

    kind, format = "estimate", "text"

    def render(self, est, deepspeed=None) -> str:
        return estimate_text(est, deepspeed)


class WhatifText(Reporter):
    """`tracekit whatif` as text."""

    kind, format = "whatif", "text"

    def render(self, result) -> str:
        return whatif_text(result)
