"""Plain-text rendering of the report and info dicts for the terminal."""
from __future__ import annotations

from ..analysis.frames import where
from ..units import fmt_bytes, fmt_bytes_exact
from . import Reporter


def _rows(pairs, indent="  ") -> list[str]:
    width = max((len(k) for k, _ in pairs), default=0)
    return [f"{indent}{k:<{width}}  {v}" for k, v in pairs]


def _when(index, time_us, t0) -> str:
    if index is None or index < 0:
        return "before the first entry"
    if time_us is not None and t0 is not None:
        return f"at entry {index} (+{(time_us - t0) / 1e6:.3f} s)"
    return f"at entry {index}"


def _during(phase, iteration, generation_text=None) -> str:
    if generation_text:
        return f", {generation_text}"
    if not phase:
        return ""
    out = {"between": ", between steps", "optimizer": ", in the optimizer step"}.get(phase, f", in the {phase} pass")
    return out + (f" of iteration {iteration}" if iteration is not None else "")


def headline_words(head: dict) -> str:
    """What the headline peak is, in words: "exact, as torch.cuda.max_memory_allocated() counts it (blocks);
    tensors requested 1.1 GiB (3.4 MiB less)" (the same words in the report and the viewer)."""
    if head.get("measure") != "blocks":
        return "requested by tensors (no caching allocator modelled here)"
    more = (head.get("upper_bound_bytes") or head["bytes"]) - head["bytes"]
    sure = "exact" if head.get("exact") else (f"not exact: up to {fmt_bytes(more)} more" if more > 0 else "not exact")
    gap = head["bytes"] - head["requested_bytes"]
    gap_text = f" ({fmt_bytes(abs(gap))} {'less' if gap > 0 else 'more'})" if gap else ""
    return (f"{sure}, as {head['counter']} counts it (blocks); tensors requested "
            f"{fmt_bytes(head['requested_bytes'])}{gap_text}")


def report_text(report: dict, t0_by_device=None) -> str:
    t0_by_device = t0_by_device or {}
    out = [f"{report['file']}  ({report['format']})", ""]
    for d in report["devices"]:
        t0 = t0_by_device.get(d["device"])
        out.append(f"Device {d['label']}  ({d['entries']} trace entries)")
        during = {"between": ", between steps", "optimizer": ", in the optimizer step"}.get(
            d.get("peak_phase"), f", in the {d.get('peak_phase')} pass") if d.get("peak_phase") else ""
        if during and d.get("peak_iteration") is not None:
            during += f" of iteration {d['peak_iteration']}"
        if d.get("peak_during") and d.get("generation"):
            during = f", {d['peak_during']}"
        head = d.get("headline_peak")
        if head:  # the allocator's counter first, the bytes tensors requested beside it (issue 31)
            during = _during(head.get("phase"), head.get("iteration"), head.get("during") if d.get("generation") else None)
            peak_row = (f"{fmt_bytes(head['bytes']):>10}  {headline_words(head)}; "
                        f"{_when(head['index'], head.get('time_us'), t0)}{during}")
        else:
            peak_row = f"{fmt_bytes(d['peak_allocated_bytes']):>10}  {_when(d['peak_event_index'], d['peak_time_us'], t0)}{during}"
        pairs = [
            ("peak allocated", peak_row),

            ("peak reserved", f"{fmt_bytes(d['peak_reserved_bytes']):>10}"),
            ("before the trace", f"{fmt_bytes(d['allocated_before_trace_bytes']):>10}  allocated when recording began"),
            ("final allocated", f"{fmt_bytes(d['final_allocated_bytes']):>10}"),
            ("final reserved", f"{fmt_bytes(d['final_reserved_bytes']):>10}"),
        ]
        if d.get("fragmentation_at_peak_bytes") is not None and d["label"] != "cpu":  # no caching on the CPU
            r = d["reserved_at_peak_bytes"] or 0
            share = d["fragmentation_at_peak_bytes"] / r if r else 0
            pairs.append(("unused at peak", f"{fmt_bytes(d['fragmentation_at_peak_bytes']):>10}  "
                                            f"reserved but not allocated ({share:.0%})"))
        if (d["label"] != "cpu" and d.get("peak_allocated_block_bytes") is not None
                and (head or {}).get("measure") != "blocks"):  # no caching allocator on the CPU
            pairs.insert(1, ("in blocks", f"{fmt_bytes(d['peak_allocated_block_bytes']):>10}  an estimate of the peak "
                                          f"as the caching allocator counts it (requests rounded to its blocks)"))
        stats = d.get("allocator_stats") or {}
        if stats.get("max_memory_allocated") is not None:
            pairs.append(("allocator says", f"{fmt_bytes(stats['max_memory_allocated']):>10}  "
                                             f"torch.cuda.max_memory_allocated() when recording stopped"))
        ooms = d.get("out_of_memory", d["oom_count"])
        if ooms:
            n = d["oom_count"]
            entries = f" ({n} oom entr{'ies' if n > 1 else 'y'} in the trace)" if n else " (the recorder's exception)"
            pairs.append(("out of memory", f"{ooms:>10}  the run failed: out of memory{entries}"))
        if d.get("demand_is_lower_bound"):
            pairs.insert(1, ("needed", f"{'≥ ' + fmt_bytes_exact(d['demand_bytes'], 2):>10}  {d['demand_why']} "
                                       "(a lower bound: the run died before its real peak)"))
        elif d.get("allocator_counted_ooms"):
            pairs.append(("allocator says", f"{d['allocator_counted_ooms']:>10}  out-of-memory errors counted in this "
                                             "process (torch.cuda.memory_stats num_ooms; maybe before recording)"))
        inv = d["replay_invariant"]
        if inv["checked"] and not inv["ok"]:
            pairs.append(("replay check", f"FAILED: {inv['problems'][0]['what']} (and {len(inv['problems']) - 1} more)"))
        out += _rows(pairs)
        if d.get("categories_at_peak"):
            out.append("  at the peak, by category:")
            total = sum(d["categories_at_peak"].values()) or 1
            cats = sorted(d["categories_at_peak"].items(), key=lambda kv: -kv[1])
            why: dict = {}
            for r in d.get("reasons_at_peak") or []:  # largest first: the main reason of each category
                why.setdefault(r["category"], r["reason"])
            out += _rows([(c, f"{fmt_bytes(b):>10}  {b / total:4.0%}  {why.get(c, '')}".rstrip()) for c, b in cats if b],
                         indent="    ")
        if d.get("distributed"):  # what this rank of a sharded / data-parallel job holds (issue 33)
            out.append(f"  {d['distributed']['summary']}")
        out += _phase_rows(d)
        if d.get("estimate"):  # predicted vs measured (render/estimate.py)
            from .estimate import comparison_lines
            out += comparison_lines(d["estimate"])
        if d["top_stacks_at_peak"]:
            out.append("  live at the peak, by allocation site:")
            out += _rows([(f"{fmt_bytes(s['bytes']):>10}", f"{s['count']:>5}×  {_site(s)}")
                          for s in d["top_stacks_at_peak"]], indent="    ")
        out += library_lines(d.get("library_sites_at_peak"), d.get("categories_at_peak") or {})
        from .modules import module_lines  # per module (issue 11)
        out += module_lines(d.get("modules"))
        out.append("")
    others = [f for f in report["findings"] if f["kind"] != "peak"]
    if others:
        out.append("Findings")
        for f in others:
            out += finding_lines(f)
        out.append("")
    return "\n".join(out).rstrip() + "\n"


def trace_report_text(trace, report: dict) -> str:
    """`report_text` with times as seconds since the trace's first timed entry (the viewer's time base)."""
    from ..analysis.timeline import time_origin

    t0 = time_origin(trace)
    return report_text(report, t0_by_device={d: t0 for d in trace.devices})


def library_lines(rows, at_peak: dict, limit=8) -> list[str]:
    """The third-party lines (transformers, peft, ...) holding memory at the peak (analysis/libraries.py)."""
    from ..analysis.libraries import library_where

    if not rows:
        return []
    covered = sum(r["bytes"] for r in rows if r["category"] in ("activation", "temporary"))
    act = at_peak.get("activation", 0) + at_peak.get("temporary", 0)
    share = f"; {covered / act:.0%} of activations and temporaries" if act else ""
    out = [f"  live at the peak, by library line{share}:"]
    out += _rows([(f"{fmt_bytes(r['bytes']):>10}", f"{r['count']:>5}×  {r['category']:<10} {library_where(r)}")
                  for r in rows[:limit]], indent="    ")
    return out


def _shares(by_category: dict, limit=3) -> str:
    total = sum(by_category.values()) or 1
    top = sorted(by_category.items(), key=lambda kv: -kv[1])[:limit]
    return ", ".join(f"{k} {v / total:.0%}" for k, v in top if v > 0)


def _phase_rows(d: dict) -> list[str]:
    out = []
    if d.get("phases"):
        out.append(f"  by phase ({d.get('phase_source', '')}):")
        out += _rows([(p["phase"], f"peak {fmt_bytes(p['peak_bytes']):>10}  {_shares(p['categories_at_peak'])}")
                      for p in d["phases"]], indent="    ")
    its = d.get("iterations") or []
    if d.get("generation"):
        return out + generation_lines(d)
    if len(its) > 1:
        out.append("  by iteration:")
        rows = [(f"{it['iteration']}", f"peak {fmt_bytes(it['peak_bytes']):>10}   end {fmt_bytes(it['end_bytes']):>10}"
                                       f"  {_shares(it['categories_at_end'])}") for it in its[:12]]
        if len(its) > 12:
            rows.append(("...", f"{len(its) - 12} more"))
        out += _rows(rows, indent="    ")
    return out


def generation_lines(d: dict) -> list[str]:
    """A generation's prefill and decoding steps, and its KV cache (analysis/generation.py)."""
    g = d["generation"]
    out = [f"  generation: {g['prefills']} prefill{'s' if g['prefills'] != 1 else ''} + {g['decode_steps']} decoding "
           f"steps ({g['model_calls']} model calls)"]
    kv = d.get("kv_cache") or {}
    if kv:
        first = "the prefill" if g["prefills"] else "the first step shown"
        out.append(f"    KV cache {fmt_bytes(kv['bytes_at_peak'])} at the peak; {fmt_bytes(kv['bytes_at_prefill'])} after "
                   f"{first}, +{fmt_bytes(kv['bytes_per_step'])} per decoding step, {fmt_bytes(kv['bytes_final'])} "
                   f"after the last ({kv['steps']} steps)")
    steps = g.get("steps") or []
    shown = steps if len(steps) <= 6 else steps[:3] + steps[-2:]
    rows = []
    for i, c in enumerate(shown):
        if len(steps) > 6 and i == 3:
            rows.append(("...", f"{len(steps) - 5} more"))
        name = "prefill" if c["kind"] == "prefill" else f"decode {c['step']}"
        rows.append((name, f"peak {fmt_bytes(c['peak_bytes']):>10}   KV cache at its end "
                           f"{fmt_bytes(c.get('kv_cache_bytes_end', 0)):>10}"))
    return out + _rows(rows, indent="    ")


def finding_lines(f: dict) -> list[str]:
    """A finding as text: its summary, where, and its details."""
    label = f" {f['label']}" if f.get("label") else ""
    out = [f"  [{f['kind']}{label}] {f['summary']}"]
    if f.get("frames"):
        out.append(f"      at {_site(f)}")
    if f["kind"] in ("spike", "leak", "oom"):
        for s in [s for s in f.get("top_stacks", [])[1:3] if s["bytes"] >= 0.01 * max(f["bytes"], 1)]:
            out.append(f"      {fmt_bytes(s['bytes']):>10}  {s['count']:>4}×  {_site(s)}")
    if f["kind"] == "leak":
        out.append("      retained per iteration: " + ", ".join(fmt_bytes(b) for b in f["bytes_per_iteration"]))
    if f["kind"] == "advice":
        out.append(f"      assumes {f['assumes']}")
    ev = f.get("evidence") or {}
    if ev.get("rule"):
        entries = ev.get("events") or []
        shown = ", ".join(str(e) for e in entries[:6]) + (", ..." if len(entries) > 6 else "")
        out.append(f"      evidence: {ev['rule']}" + (f" (entr{'ies' if len(entries) > 1 else 'y'} {shown})"
                                                       if entries else ""))
    return out


def _site(s: dict) -> str:
    """The one-line site of a finding or site group (older JSON without "where": from its frames)."""
    return s.get("where") or where(s.get("frames") or [])


def info_text(info: dict) -> str:
    pairs = [
        ("file", info["file"]),
        ("size", fmt_bytes(info["file_bytes"])),
        ("format", f"{info['format']} ({info['container']})"),
        *([("read by", info["reader"])] if info.get("reader") else []),
        ("recorded by", info["recorded_by"]),
        ("devices", ", ".join(info["device_labels"]) or "none"),
        ("segments", f"{info['segments']} ({info['blocks']} blocks)"),
        ("fields present", ", ".join(info["present_fields"]) or "none"),
        ("top-level keys", ", ".join(info["top_level"]) or "none"),
    ]
    if info.get("window"):
        pairs.append(("window", info["window"] + " (entries renumbered from 0)"))
        if info.get("window_read"):
            pairs.append(("read", info["window_read"]))
    if info["unknown_actions"]:
        pairs.append(("unknown actions", ", ".join(info["unknown_actions"]) + " (skipped)"))
    out = _rows(pairs, indent="")
    for d in info["devices"]:
        out.append("")
        out.append(f"Device {d['label']}")
        span = "no times recorded" if d["duration_s"] is None else f"{d['duration_s']:.3f} s"
        actions = ", ".join(f"{k} {v}" for k, v in d["actions"].items())
        out += _rows([
            ("entries", f"{d['entries']}  ({actions or 'none'})"),
            ("time span", span),
            ("streams", str(d["streams"])),
            ("frames", f"{d['entries_with_frames']} of {d['entries']} entries have a stack ({d['frames_coverage']:.0%})"),
            ("before the trace", f"{d['frees_before_trace']} frees of allocations made before recording "
                                 f"({fmt_bytes(d['freed_before_trace_bytes'])}); "
                                 f"{fmt_bytes(d['allocated_before_trace_bytes'])} live when it began"),
            ("truncated?", d["truncation"]),
            ("replay check", d["replay_check"]),
        ])
    return "\n".join(out) + "\n"


class ReportText(Reporter):
    """The report as the terminal shows it. Context: `t0_by_device` {device: time_us of the trace's first
    entry} for times in seconds (or `trace`, to take it from the trace, as the viewer does)."""

    kind, format = "report", "text"

    def render(self, report, t0_by_device=None, trace=None) -> str:
        if trace is not None:
            return trace_report_text(trace, report)
        return report_text(report, t0_by_device)


class InfoText(Reporter):
    """`tracekit info` as text."""

    kind, format = "info", "text"

    def render(self, info) -> str:
        return info_text(info)
