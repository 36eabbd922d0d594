"""Advice: techniques that would shrink the peak, with the bytes each would save.

Each estimate starts from the measured bytes of a category at the device's
peak and applies the technique's usual ratio; the assumption behind the
ratio is part of the finding ("assumes"). Savings are at today's peak and do
not add up: after one change the peak may move elsewhere.
"""
from __future__ import annotations

from ..model import Trace
from ..units import fmt_bytes

# Advice is given for a category holding at least this share of the peak.
SHARES = {"activation": 0.25, "optimizer_state": 0.15, "training_state": 0.40, "parameter": 0.30, "spike": 0.10}


def advice_findings(trace: Trace, device: int, at_peak: dict, peak_bytes: int, peak_index: int,
                    spikes=()) -> list[dict]:
    """Advice for one device from its categories at the peak ({name: bytes}) and its spikes."""
    peak = max(peak_bytes or 0, 1)
    act, inp = at_peak.get("activation", 0), at_peak.get("input", 0)
    state, grad, param = at_peak.get("optimizer_state", 0), at_peak.get("gradient", 0), at_peak.get("parameter", 0)
    rec = trace.recorder or {}
    model = rec.get("model") or {}
    out = []

    def add(category, technique, saves, assumes, how):
        if saves <= 0:
            return
        out.append({
            "kind": "advice", "device": device, "bytes": int(saves), "index": peak_index,
            "category": category, "technique": technique, "assumes": assumes,
            "summary": f"{technique}: saves about {fmt_bytes(saves)} at the peak ({saves / peak:.0%}). {how}",
            "frames": [],
        })

    if act >= SHARES["activation"] * peak:
        blocks = model.get("repeated_blocks") if isinstance(model.get("repeated_blocks"), int) else None
        if blocks and blocks >= 2:
            ratio = max(0.0, 1 - 1 / blocks - 0.1)
            assumes = (f"checkpointing each of the model's {blocks} repeated blocks keeps only their inputs (about "
                       f"10% of their activations) plus one block's recompute")
        else:
            ratio = 0.7
            assumes = ("the model is a stack of 8 or more similar blocks: checkpointing each keeps only their "
                       "inputs plus one block's recompute, about 30% of today's activations")
        add("activation", "activation checkpointing", ratio * act, assumes,
            f"Activations hold {fmt_bytes(act)} at the peak; wrap each block in torch.utils.checkpoint "
            "(costs about one extra forward pass).")
        add("activation", "halve the micro-batch, double gradient accumulation", (act + inp) / 2,
            "activations and inputs grow linearly with the micro-batch; the effective batch stays the same",
            f"Activations and inputs hold {fmt_bytes(act + inp)} at the peak.")
    if state >= SHARES["optimizer_state"] * peak:
        add("optimizer_state", "8-bit optimizer state", 0.75 * state,
            "fp32 optimizer state (e.g. Adam's two moments) stored in 8 bits, as bitsandbytes' AdamW8bit does",
            f"Optimizer state holds {fmt_bytes(state)} at the peak.")
        add("optimizer_state", "shard the optimizer state (ZeRO-1 / FSDP) over 8 GPUs", state * 7 / 8,
            "8 data-parallel ranks, each keeping 1/8 of the state",
            f"Optimizer state holds {fmt_bytes(state)} at the peak.")
    trainable = grad + state
    if grad > 0 and param + trainable >= SHARES["training_state"] * peak:
        add("gradient", "LoRA adapters instead of full fine-tuning", 0.99 * trainable,
            "adapters with about 1% of the parameters: gradients and optimizer state only for them",
            f"Gradients and optimizer state hold {fmt_bytes(trainable)} at the peak.")
    if param >= SHARES["parameter"] * peak:
        width = _bytes_per_parameter(model)
        ratio = 1 - 0.5 / width if width else 0.75
        assumes = (f"weights stored at {width:g} bytes per parameter today, 4-bit after" if width
                   else "16-bit weights today, 4-bit after")
        add("parameter", "4-bit quantized weights (frozen base, e.g. QLoRA)", ratio * param, assumes,
            f"Parameters hold {fmt_bytes(param)} at the peak.")
    for s in spikes:
        if s["bytes"] >= SHARES["spike"] * peak and _looks_like_loss(s):
            add("temporary", "chunked loss", s["bytes"] * 7 / 8,
                "the loss computed over 8 chunks of the batch/sequence (or a fused linear+cross-entropy "
                "kernel), so only one chunk's logits are upcast at a time",
                f"A {fmt_bytes(s['bytes'])} spike comes from the loss.")
            break
    out.sort(key=lambda f: -f["bytes"])
    return out


def _bytes_per_parameter(model: dict):
    try:
        n, b = int(model.get("parameters") or 0), int(model.get("parameter_bytes") or 0)
    except (TypeError, ValueError):
        return None
    return b / n if n and b else None


def _looks_like_loss(spike) -> bool:
    """The spike's largest sites run in a loss (their user frames name it; an attention softmax does not)."""
    words = ("loss", "cross_entropy", "log_softmax", "logits", "nll")
    for g in spike.get("top_stacks", [])[:2]:
        for f in g["frames"][:4]:
            if any(w in f["name"].lower() for w in words):
                return True
    return False
