"""Advice: the levers (levers.py) worth a finding, with the bytes each would save at the peak.

The bytes come from `levers.levers`, the one computation `tracekit whatif` and the estimate's levers
use too, so the report and whatif print the same saving for the same lever. Advice is given for a
lever whose category holds a large enough share of the peak (SHARES); each finding says what it
assumed about the file and the evidence it rests on. Savings are at today's peak and do not add up:
after one change the peak may move elsewhere.
"""
from __future__ import annotations

from ..model import Trace
from ..units import fmt_bytes

# Advice is given when what a lever acts on holds at least this share of the peak.
SHARES = {"activation": 0.25, "optimizer_state": 0.15, "training_state": 0.40, "parameter": 0.30, "spike": 0.10,
          "kv_cache": 0.10, "batch": 0.25, "unsharded": 0.10, "communication": 0.10}


def advice_findings(trace: Trace, device: int, at_peak: dict, peak_bytes: int, peak_index: int,
                    spikes=(), summary=None, shape=None, rules=None) -> list[dict]:
    """Advice for one device from its report summary (`summary`: categories at the peak, phases...) and spikes."""
    from .levers import file_facts, growing_bytes, levers

    summary = summary or {"categories_at_peak": at_peak, "label": trace.device_label(device)}
    facts = file_facts(trace, device, summary, shape=shape, rules=rules)
    peak = max(peak_bytes or 0, 1)
    act, state = at_peak.get("activation", 0), at_peak.get("optimizer_state", 0)
    grad, param, kv = at_peak.get("gradient", 0), at_peak.get("parameter", 0), at_peak.get("kv_cache", 0)
    worth = {
        "activation checkpointing": act >= SHARES["activation"] * peak,
        "gradient accumulation": act >= SHARES["activation"] * peak,
        "mixed precision": act >= SHARES["activation"] * peak,
        "fused / flash attention": facts["scores_at_peak_bytes"] >= SHARES["spike"] * peak,
        "8-bit optimizer state": state >= SHARES["optimizer_state"] * peak,
        "shard the optimizer state": state >= SHARES["optimizer_state"] * peak,
        "LoRA adapters": grad > 0 and param + grad + state >= SHARES["training_state"] * peak,
        "4-bit quantized weights": param >= SHARES["parameter"] * peak,
        "chunked loss": True,  # the lever itself asks for a loss spike of SHARES["spike"]
        "quantize the KV cache": kv >= SHARES["kv_cache"] * peak,
        "smaller batch": growing_bytes(at_peak) >= SHARES["batch"] * peak,
        # sharded / data-parallel training (levers._distributed_levers)
        "FSDP prefetch depth": at_peak.get("communication", 0) >= SHARES["communication"] * peak,
        "reshard after forward": at_peak.get("unsharded_parameter", 0) >= SHARES["unsharded"] * peak,
        "FSDP units per layer": at_peak.get("unsharded_parameter", 0) >= SHARES["unsharded"] * peak,
        "FSDP root unit": at_peak.get("unsharded_parameter", 0) >= SHARES["unsharded"] * peak,
        "FSDP mixed-precision parameters": at_peak.get("unsharded_parameter", 0) >= SHARES["unsharded"] * peak,
        "FSDP CPU offload": param + grad + state >= SHARES["training_state"] * peak,
        "shard over more ranks": param + grad + state >= SHARES["training_state"] * peak,
        "DDP gradient_as_bucket_view": at_peak.get("communication", 0) >= SHARES["communication"] * peak,
        "FSDP instead of DDP": param + grad + state >= SHARES["training_state"] * peak,
    }
    out = []
    for lv in levers(facts, at_peak, peak_bytes or 0, 0, spikes):
        if not worth.get(lv["technique"]):
            continue
        saves = lv["saves_bytes"]
        out.append({
            "kind": "advice", "device": device, "bytes": saves, "index": peak_index,
            "category": lv["category"], "technique": lv["technique"], "lever": lv["lever"], "assumes": lv["assumes"],
            "summary": f"{lv['lever']}: saves about {fmt_bytes(saves)} at the peak ({saves / peak:.0%}). {lv['how']}",
            "frames": [],
            "evidence": {"rule": lv["evidence"]["rule"], "events": [peak_index] if peak_index >= 0 else [],
                         "frames": [], "workload": lv["evidence"]["workload"]},
        })
    out.sort(key=lambda f: -f["bytes"])
    return out
