"""The allocator model's figures for the report: peaks in the allocator's own terms, and how sure they are."""
from __future__ import annotations

from typing import TYPE_CHECKING

from ...model import ALLOC, FREE_COMPLETED, FREE_REQUESTED, Trace
from ..memo import per_trace

if TYPE_CHECKING:
    from .model_replay import AllocatorReplay


def why_not_modelled(trace: Trace, device: int) -> str | None:
    """None when the caching-allocator model applies to this device's data, else why not (one phrase)."""
    import os

    if os.environ.get("TRACEKIT_ALLOCATOR") == "off":
        return "turned off (TRACEKIT_ALLOCATOR=off)"
    if trace.format != "snapshot":
        return "not an allocator snapshot (a profiler trace has no segments)"
    if (trace.recorder or {}).get("backend") == "cpu" or trace.device_label(device) == "cpu":
        return "CPU memory: no caching allocator"
    if "window" in trace.meta:  # a window read alone (big files) has no state to start from; to keep every
        # window's report the same however it was read, no window is modelled
        return ("a window of the trace: the allocator model replays whole recordings (report the file without "
                "--from/--to/--last/--iterations for its figures)")
    if not trace.meta.get("has_segments", True):
        return "the file holds no segments"
    if not trace.meta.get("has_addresses", True):
        return "the trace has no addresses"
    return None


@per_trace
def allocator_replays(trace: Trace) -> dict:
    """{device: AllocatorReplay} for the devices the model applies to (computed once per trace)."""
    return {d: r for d, r in _replays(trace).items() if not isinstance(r, str)}


@per_trace
def _replays(trace: Trace) -> dict:
    """{device: AllocatorReplay, or why the model failed there}: a failure of the model never takes the
    report down (its other figures stand); TRACEKIT_DEBUG=1 lets it through, for a bug report."""
    import os

    from .compiled import replay_device

    out: dict[int, AllocatorReplay | str] = {}
    for d in trace.devices:
        if why_not_modelled(trace, d) is not None:
            continue
        try:
            out[d] = replay_device(trace, d)
        except Exception as e:  # noqa: BLE001
            if os.environ.get("TRACEKIT_DEBUG"):
                raise
            out[d] = (f"the allocator model failed on this file ({type(e).__name__}: {e}); this is a bug in "
                      "tracekit, please report it with the file")
    return out


def allocator_summary(trace: Trace, device: int) -> dict:
    """The report's `allocator` object for a device: whether the allocator figures are exact, what the
    replay could not place, the bound where the file leaves bytes open, and the settings it used."""
    why = why_not_modelled(trace, device)
    if why is None and isinstance(_replays(trace).get(device), str):
        why = _replays(trace)[device]
    if why is not None:
        return {"modelled": False, "exact": False, "why": why}
    r = allocator_replays(trace)[device]
    acts = trace.events.action[trace.events.device_slice(device)]
    n_alloc = int((acts == ALLOC).sum())
    reasons = not_exact_because(trace, device, r)
    out = {
        "modelled": True,
        "exact": not reasons,
        "why": "; ".join(reasons) if reasons else None,
        "settings": r.config.describe(),
        "settings_recorded": isinstance(trace.meta.get("allocator_settings"), dict),
        "placed_events": r.placed,
        "alloc_events": n_alloc,
        "unplaced_events": r.unplaced_events,
        "unplaced_by_reason": dict(sorted(r.unplaced.items())),
        "final_state_matches": None if r.final_mismatch < 0 else r.final_mismatch == 0,
        "allocated_before_trace_bytes": r.initial_allocated,
        "reserved_before_trace_bytes": r.initial_reserved,
        "unknown_block_bytes": r.open_bytes,
        "peak_allocated_bytes": r.peak_allocated,
        "peak_allocated_upper_bound_bytes": r.peak_allocated + r.open_bytes + r.unplaced_slack,
        "peak_allocated_index": r.peak_index,
        "peak_reserved_bytes": r.peak_reserved,
        "peak_reserved_index": r.peak_reserved_index,
        "final_allocated_bytes": r.final_allocated,
        "engine": r.engine,
    }
    p = r.peak_index
    out["unused_at_peak_bytes"] = r.reserved_at(p) - r.allocated_at(p)
    out["largest_free_block_at_peak_bytes"], out["free_blocks_at_peak"] = free_at_peak(trace, device)
    if r.notes:
        out["notes"] = list(r.notes)
    return out


@per_trace
def free_at_peak(trace: Trace, device: int) -> tuple[int, int]:
    """(largest free block, free blocks) in the model's segments at its allocated peak: what is cached there and
    how scattered (a replay up to the peak: remembered, so that a lean report can let go of the addresses)."""
    from .compiled import segments_at

    free = [b["size"] for s in segments_at(trace, device, allocator_replays(trace)[device].peak_index)
            for b in s["blocks"] if b["state"] == "inactive"]
    return max(free, default=0), len(free)


def not_exact_because(trace: Trace, device: int, r) -> list:
    """What keeps the replay `r` of this device from being exact (empty: exact to the byte)."""
    acts = trace.events.action[trace.events.device_slice(device)]
    reasons = []
    if r.unplaced_events:
        reasons.append(f"{r.unplaced_events} trace entries the model could not follow")
    if r.open_bytes:
        reasons.append(f"{r.open_bytes} bytes of blocks allocated before the trace have no known size")
    if r.final_mismatch > 0:
        reasons.append(f"{r.final_mismatch} final blocks differ from the replayed state")
    if r.initial.problems:
        reasons += [f"{v} x {k}" for k, v in sorted(r.initial.problems.items())]
    if not (acts == ALLOC).any() and not ((acts == FREE_REQUESTED) | (acts == FREE_COMPLETED)).any():
        reasons.append("the file has no allocation history: the figures are its final state's")
    return reasons


COUNTER = "torch.cuda.max_memory_allocated()"


def headline_peak(trace: Trace, device: int, rep) -> dict:
    """The peak every front end leads with (report text and JSON, `check --max-peak`, the viewer): the caching
    allocator's own counter (`max_memory_allocated`: the most bytes in blocks handed out) where the allocator
    model replays the device, with the bytes the tensors requested (`rep`, the trace's replay) beside it;
    elsewhere (CPU, profiler traces, windows) the requested bytes. {"bytes", "index", "measure": "blocks" |
    "requested", "counter", "exact", "why", "upper_bound_bytes", "requested_bytes", "requested_index"}."""
    requested = {"requested_bytes": int(rep.peak_allocated), "requested_index": int(rep.peak_index)}
    r = allocator_replays(trace).get(device)
    if r is None:
        why = why_not_modelled(trace, device) or _replays(trace).get(device) or "not modelled"
        return {"bytes": int(rep.peak_allocated), "index": int(rep.peak_index), "measure": "requested",
                "counter": None, "exact": None, "why": why, "upper_bound_bytes": None, **requested}
    reasons = not_exact_because(trace, device, r)
    return {"bytes": int(r.peak_allocated), "index": int(r.peak_index), "measure": "blocks", "counter": COUNTER,
            "exact": not reasons, "why": "; ".join(reasons) or None,
            "upper_bound_bytes": int(r.peak_allocated + r.open_bytes + r.unplaced_slack), **requested}
