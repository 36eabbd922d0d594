"""What-if: fit how the peak grows with the micro-batch (or sequence), find what fits a budget, price the levers.

With two recordings at different sizes the fit is the line through their
peaks (fixed + per-unit × size). With one, the categories at its peak say
what grows (activations, temporaries, inputs) and what does not. Levers are
priced with the estimator: each changes one knob of the setup and the
saving is the difference in predicted bytes, applied to the measured peak.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ...errors import TracekitError
from .memory import Setup, estimate
from .shapes import ModelShape

GROWING = ("activation", "temporary", "input")


@dataclass
class Point:
    file: str
    size: int  # the micro-batch (or sequence length) of the recording
    peak: int  # peak allocated bytes (the largest device)
    reserved: int | None  # peak reserved bytes, where the file has a caching allocator
    by_category: dict  # categories at the peak
    fragmentation: int = 0  # reserved but unallocated at the peak


def fit(points: list[Point], by="batch") -> dict:
    """{fixed, per_unit, method, assumptions}: peak ≈ fixed + per_unit × size."""
    notes = []
    if len(points) >= 2:
        a, b = sorted(points[:2], key=lambda p: p.size)
        if a.size == b.size:
            raise TracekitError(f"both recordings have {by} {a.size}: what-if needs two different sizes")
        per = (b.peak - a.peak) / (b.size - a.size)
        fixed = a.peak - per * a.size
        method = f"the line through two recordings ({by} {a.size} and {b.size})"
        if by == "seq":
            notes.append("eager attention scores grow with seq²: a line through two sequence lengths "
                         "underestimates beyond them")
    else:
        p = points[0]
        growing = sum(p.by_category.get(c, 0) for c in GROWING)
        per = growing / p.size
        fixed = p.peak - growing
        method = f"one recording's categories at the peak ({', '.join(GROWING)} grow with the {by}; the rest is fixed)"
        notes.append("from one recording: record a second at another size for a measured slope")
    notes.append("peak allocated bytes; the CUDA context and the allocator's reserve come on top")
    return {"fixed_bytes": int(fixed), "per_unit_bytes": int(per), "method": method, "by": by, "assumptions": notes}


def largest_fitting(f: dict, budget: int, headroom: int = 0) -> int | None:
    """The largest size whose fitted peak (+ headroom) is within budget; None when the peak does not grow."""
    if f["per_unit_bytes"] <= 0:
        return None
    return max(0, int((budget - headroom - f["fixed_bytes"]) // f["per_unit_bytes"]))


def levers(shape, setup: Setup, peak: int, budget: int, fragmentation: int = 0) -> list[dict]:
    """The usual levers, each priced by the estimator against `setup`, applied to the measured `peak`."""
    base = estimate(shape, setup).per_gpu["total"]
    tries = []
    if setup.batch > 1:
        tries.append((f"gradient accumulation: micro-batch {setup.batch // 2}, accumulate ×{setup.grad_accum * 2}",
                      replace(setup, batch=setup.batch // 2, grad_accum=setup.grad_accum * 2)))
    if setup.seq and setup.checkpointing != "full":
        tries.append(("activation checkpointing (full)", replace(setup, checkpointing="full")))
    if setup.seq and setup.checkpointing == "none" and setup.attention == "eager":
        tries.append(("selective checkpointing (recompute attention scores)", replace(setup, checkpointing="selective")))
        tries.append(("fused / flash attention (SDPA)", replace(setup, attention="flash")))
    if setup.precision == "fp32":
        tries.append(("mixed precision: bf16 autocast (amp)", replace(setup, precision="amp")))
        tries.append(("pure bf16 weights and optimizer state", replace(setup, precision="bf16")))
    if setup.optimizer in ("adam", "adamw"):
        tries.append(("8-bit Adam (bitsandbytes)", replace(setup, optimizer="adam8bit")))
    if isinstance(shape, ModelShape) and not setup.lora_rank and setup.mode == "train":
        tries.append(("LoRA rank 16 on q, k, v, o", replace(setup, lora_rank=16)))
    if setup.dp > 1:
        for stage in range(setup.zero + 1, 4):
            tries.append((f"ZeRO-{stage} over dp {setup.dp}", replace(setup, zero=stage)))
    out = []
    for name, s in tries:
        try:
            saved = base - estimate(shape, s).per_gpu["total"]
        except TracekitError:
            continue  # a lever this model cannot take (e.g. needs its shape)
        if saved > 0:
            out.append({"lever": name, "saves_bytes": int(saved), "peak_after": int(peak - saved),
                        "fits": peak - saved <= budget})
    if fragmentation > 0:
        out.append({"lever": "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (reserved-but-unused at the peak)",
                    "saves_bytes": int(fragmentation), "peak_after": int(peak), "fits": peak <= budget,
                    "note": "saves reserved, not allocated, memory"})
    return sorted(out, key=lambda r: -r["saves_bytes"])


def whatif(points: list[Point], budget: int, by="batch", shape=None, setup: Setup | None = None) -> dict:
    """The fit, the largest size within `budget`, and the levers (when the model's shape is known)."""
    if not points:
        raise TracekitError("what-if needs at least one recording")
    f = fit(points, by)
    largest = largest_fitting(f, budget)
    biggest = max(points, key=lambda p: p.size)
    result = {"points": [vars(p) for p in points], "budget": int(budget), "fit": f,
              f"largest_{by}": largest,
              "peak_at_largest": None if largest is None else int(f["fixed_bytes"] + f["per_unit_bytes"] * largest),
              "levers": [], "levers_assumptions": []}
    if shape is not None and setup is not None:
        setup = replace(setup, **{by: biggest.size})
        result["levers"] = levers(shape, setup, biggest.peak, budget, biggest.fragmentation)
        result["levers_for"] = {"file": biggest.file, by: biggest.size, "setup": vars(setup)}
        result["levers_assumptions"] = ["each lever's saving is the estimator's predicted difference, "
                                        "applied to the measured peak of the largest recording"]
    else:
        result["levers_assumptions"] = ["levers need the model's shape: a recording of a Hugging Face model, "
                                        "or --config / shape flags"]
    return result
