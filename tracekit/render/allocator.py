"""`tracekit whatif FILE --alloc-conf ...` as text: the same requests under other caching-allocator
settings (tracekit.analysis.allocator.settings_replay.compare), recorded vs the model as recorded vs the what-if."""
from __future__ import annotations

from ..units import fmt_bytes
from . import Reporter


def alloc_whatif_text(result: dict) -> str:
    lines = [f"{result['file']}: the same requests under other caching-allocator settings",
             f"recorded with: {result['recorded_settings']}; what if: {result['whatif_settings']}"]
    for d in result["devices"]:
        lines.append("")
        if not d.get("modelled"):
            lines.append(f"{d['label']}: not modelled ({d['why']})")
            continue
        base, what, rec = d["baseline"], d["whatif"], d["recorded"]
        lines.append(f"{d['label']}")
        rows = [("", "recorded", "model, as recorded", "model, what if"),
                ("peak reserved", fmt_bytes(rec["peak_reserved_bytes"]), fmt_bytes(base["peak_reserved_bytes"]),
                 fmt_bytes(what["peak_reserved_bytes"])),
                ("peak allocated", fmt_bytes(rec["peak_allocated_bytes"]), fmt_bytes(base["peak_allocated_bytes"]),
                 fmt_bytes(what["peak_allocated_bytes"])),
                ("at the reserved peak: unused", "", fmt_bytes(base["fragmentation_at_peak_bytes"]),
                 fmt_bytes(what["fragmentation_at_peak_bytes"])),
                ("  largest free block", "", fmt_bytes(base["largest_free_block_at_peak_bytes"]),
                 fmt_bytes(what["largest_free_block_at_peak_bytes"])),
                ("  segments", "", str(base["segments_at_peak"]), str(what["segments_at_peak"])),
                ("device allocations", "", str(base["device_allocations"]), str(what["device_allocations"])),
                ("requests that failed", "", str(base["failed_request_count"]), str(what["failed_request_count"]))]
        widths = [max(len(r[k]) for r in rows) for k in range(4)]
        for r in rows:
            lines.append("  " + r[0].ljust(widths[0]) + "  " + "  ".join(c.rjust(w) for c, w in zip(r[1:], widths[1:])))
        saved = d["saved_reserved_bytes"]
        verdict = (f"saves {fmt_bytes(saved)} of reserved memory at the peak" if saved > 0 else
                   f"costs {fmt_bytes(-saved)} more reserved memory at the peak" if saved < 0 else
                   "the same reserved peak")
        lines.append(f"  {result['whatif_settings']}: {verdict} (model against model, same start)")
        if d.get("oom"):
            o = d["oom"]
            fits = {True: "would fit", False: "would still fail", None: "not tried"}
            lines.append(f"  the request that ran out of memory ({fmt_bytes(o['request_bytes'])} at entry "
                         f"{o['index']}): "
                         f"{fits[o['whatif_fits']]} (as recorded, the model: {fits[o['baseline_fits']]})")
        limits = []
        if d.get("device_memory_bytes") is not None:
            limits.append(f"device memory {fmt_bytes(d['device_memory_bytes'])} ({d['device_memory_source']})")
        else:
            limits.append("device memory: no limit (the file does not say; --device-memory)")
        if d.get("memory_limit_bytes") is not None:
            limits.append(f"per-process cap {fmt_bytes(d['memory_limit_bytes'])} ({d['memory_limit_source']})")
        lines.append("  " + "; ".join(limits))
        if not rec["exact"]:
            lines.append("  (the recorded figures are the replay's, not exact for this file: "
                         "see `tracekit report --json`)")
        for note in d.get("notes") or []:
            lines.append(f"  note: {note}")
    return "\n".join(lines)


class AllocWhatifText(Reporter):
    """`whatif --alloc-conf` as text."""

    kind, format = "alloc_whatif", "text"

    def render(self, result) -> str:
        return alloc_whatif_text(result)
