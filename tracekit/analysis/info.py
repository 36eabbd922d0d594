"""Format facts about a file (`tracekit info`): what it holds, not what it means."""
from __future__ import annotations

import numpy as np

from ..model import ACTIONS, ALLOC, FREE_COMPLETED, NO_TIME, Trace
from .replay import BEFORE_TRACE, replay
from .window import read_note

# Typical max_entries values people pass to _record_memory_history; a trace of
# exactly one of these many entries has probably dropped older ones.
_RING_SIZES = {10**k for k in range(3, 8)} | {2**k for k in range(10, 24)} | {k * 10**5 for k in range(1, 10)}


def file_info(trace: Trace) -> dict:
    reps = replay(trace)
    meta = trace.meta
    rec = trace.recorder
    top = [k for k in ("allocator_settings", "external_annotations", "tracekit") if k in meta] + meta.get("other_keys", [])
    info = {
        "file": trace.path, "file_bytes": meta.get("file_bytes", 0), "format": trace.format,
        "container": meta.get("container", "?"), "reader": meta.get("reader"),
        "recorded_by": f"tracekit recorder v{rec.get('version')} ({rec.get('backend')})" if isinstance(rec, dict)
        else "PyTorch (not tracekit)" if trace.format == "snapshot" else "torch.profiler",
        "device_labels": [trace.device_label(d) for d in trace.devices],
        "segments": len(trace.segments), "blocks": len(trace.blocks),
        "expandable_segments": int(trace.segments.is_expandable.sum()),
        "present_fields": meta.get("present_fields", []), "top_level": top,
        "unknown_actions": meta.get("unknown_actions", []),
        "external_annotations": len(meta.get("external_annotations") or []),
        "window": (meta.get("window") or {}).get("description"),
        "window_read": read_note(meta["window"]) if meta.get("window") else "",
        "devices": [],
    }
    ev = trace.events
    for d in trace.devices:
        rep = reps[d]
        sl = rep.events
        action, times, stacks = ev.action[sl], ev.time_us[sl], ev.stack_id[sl]
        n = len(action)
        counts = np.bincount(action, minlength=len(ACTIONS))
        t = times[times != NO_TIME]
        al = rep.allocations
        pre_free = (al.origin == BEFORE_TRACE) & (al.free_index >= 0)
        with_frames = int((stacks >= 0).sum())
        info["devices"].append({
            "device": d, "label": trace.device_label(d), "entries": n,
            "actions": {ACTIONS[i]: int(c) for i, c in enumerate(counts) if c},
            "first_time_us": int(t.min()) if len(t) else None, "last_time_us": int(t.max()) if len(t) else None,
            "duration_s": (int(t.max()) - int(t.min())) / 1e6 if len(t) else None,
            "streams": int(len(np.unique(ev.stream[sl]))) if n else 0,
            "entries_with_frames": with_frames, "frames_coverage": with_frames / n if n else 0.0,
            "frees_before_trace": int(pre_free.sum()), "freed_before_trace_bytes": int(al.size[pre_free].sum()),
            "allocated_before_trace_bytes": rep.initial_allocated,
            "truncation": _truncation(n, action, pre_free.sum()),
            "replay_check": ("not applicable (no final segments)" if not rep.invariant.checked
                             else "ok: the replayed end state equals the final segments" if rep.invariant.ok
                             else f"FAILED: {len(rep.invariant.problems)} blocks differ"),
        })
    return info


def _truncation(n, action, pre_frees) -> str:
    if n == 0:
        return "no trace entries (segments only)"
    allocs_or_frees = int(((action == ALLOC) | (action == FREE_COMPLETED)).sum())
    if n in _RING_SIZES and pre_frees:
        return f"likely: exactly {n} entries (a usual max_entries) and it starts mid-run"
    if pre_frees and allocs_or_frees:
        return "starts mid-run (frees of earlier allocations), or recording began after the model was built"
    return "no sign of truncation"
