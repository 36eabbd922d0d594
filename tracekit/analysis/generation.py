"""What kind of run a device's trace is (training, inference, generation), and a generation's KV cache.

A generation (phases.py recognises it: repeated model calls, no backward pass
and no optimizer step, a library's generation loop or a KV cache in the
stacks) has a prefill and decoding steps 1..N, one model call each. The KV
cache is what the categories call `kv_cache` (Hugging Face `cache_utils.py`
frames, kept past the call that made them); its bytes are read at the
device's peak, at the end of the prefill and of every decoding step, and
its growth per decoding step is the growth from the end of the prefill to
the end of the last decoding step, divided by the steps between them.
"""
from __future__ import annotations

import numpy as np

from ..model import Trace
from .categories import categorize
from .phases import BACKWARD, DECODE, FORWARD, OPTIMIZER, PREFILL, phases
from .replay import replay

WORKLOADS = ("training", "inference", "generation")


def workload(trace: Trace, device: int) -> tuple[str | None, list[str]]:
    """("training" | "inference" | "generation" | None, the evidence for it)."""
    ph = phases(trace)[device]
    if ph.generation is not None:
        return "generation", list(ph.generation["evidence"])
    if ph.source == "none" or not ph.n:
        return None, ["no phase evidence in the trace (no stacks, annotations or recorder marks)"]
    seen = set(np.unique(ph.phase).tolist())
    src = {"metadata": "the recorder's phase marks", "recorder": "the recorder's phase intervals",
           "inferred": "the stacks and annotations"}.get(ph.source, ph.source)
    if BACKWARD in seen or OPTIMIZER in seen:
        ev = [f"a backward pass ({src})"] if BACKWARD in seen else []
        ev += [f"an optimizer step ({src})"] if OPTIMIZER in seen else []
        return "training", ev
    training = _training_without_backward(trace, device, seen)
    if training:
        return "training", training
    if FORWARD in seen:
        return "inference", [f"forward passes only: no backward pass and no optimizer step ({src})"]
    return None, ["no forward, backward or optimizer evidence in the trace"]


def _training_without_backward(trace: Trace, device: int, seen: set) -> list[str]:
    """Evidence that a run with no backward pass in the trace is training all the same (it ran out of memory, or
    the recording stopped, before its first backward): the recorder saw an optimizer; gradients or optimizer state
    are live; tensors were saved for backward; a trainable model ran its forward outside torch.no_grad."""
    rec = trace.recorder or {}
    if rec.get("optimizer"):
        return ["the recorder saw an optimizer (no backward pass recorded yet)"]
    cats = categorize(trace)[device]
    names = list(cats.names)
    for c in ("gradient", "optimizer_state"):
        if c in names and (cats.labels == names.index(c)).any():
            return [f"{c.replace('_', ' ')} in the trace (no backward pass recorded)"]
    model = rec.get("model") or {}
    if (model.get("trainable_parameters") or 0) > 0 and FORWARD in seen:
        from .phases import F_NO_GRAD, stack_flags

        if not len(trace.stacks) or not (stack_flags(trace) & F_NO_GRAD).any():
            return ["the model has trainable parameters and its forward builds an autograd graph (no "
                    "torch.no_grad in the stacks); the run ended before a backward pass"]
    return []


def steps(trace: Trace, device: int) -> list[dict]:
    """A generation's model calls: [{call, kind: prefill|decode, step (0 for a prefill, then 1..N),
    start_index, end_index (the call's last entry inside the model), loop_end_index (the entry before
    the next call: the loop's own code after it included), peak_bytes, peak_index}]; [] when not a
    generation."""
    ph = phases(trace)[device]
    if ph.generation is None:
        return []
    rep = replay(trace)[device]
    starts = np.array(ph.generation["call_starts"], np.int64)
    prefill = set(ph.generation["prefill_calls"])
    loop_ends = np.append(starts[1:] - 1, rep.n - 1)
    inside = np.flatnonzero(np.isin(ph.phase, (PREFILL, DECODE)))
    ends = inside[np.maximum(np.searchsorted(inside, loop_ends, side="right") - 1, 0)] if len(inside) else loop_ends
    out, k = [], 0
    for call, (lo, hi, loop_hi) in enumerate(zip(starts.tolist(), ends.tolist(), loop_ends.tolist())):
        k = 0 if call in prefill else k + 1  # no prefill seen (a window): steps counted from its start
        top = lo + int(np.argmax(rep.allocated[lo:loop_hi + 1])) if loop_hi >= lo else lo
        out.append({"call": call, "kind": "prefill" if call in prefill else "decode", "step": k,
                    "start_index": int(lo), "end_index": int(max(hi, lo)), "loop_end_index": int(loop_hi),
                    "peak_bytes": int(rep.allocated[top]), "peak_index": int(top)})
    return out


def kv_curve(trace: Trace, device: int, rules=None) -> np.ndarray:
    """KV-cache bytes live just after each entry of the device's trace."""
    rep = replay(trace)[device]
    cats = categorize(trace, rules)[device]
    al = rep.allocations
    kv = cats.labels == cats.names.index("kv_cache")
    delta = np.zeros(rep.n + 1, np.int64)
    made, gone = kv & (al.alloc_index >= 0), kv & (al.free_index >= 0)
    np.add.at(delta, al.alloc_index[made], al.size[made])
    np.add.at(delta, al.free_index[gone], -al.size[gone])
    initial = int(al.size[kv & (al.alloc_index < 0)].sum())
    return initial + np.cumsum(delta[:-1])


def kv_cache(trace: Trace, device: int, rules=None) -> dict | None:
    """{bytes_at_peak, bytes_per_step, steps, bytes_final, bytes_at_prefill, bytes_max, per_step, how} of a
    generation's KV cache (None for a run that is not a generation)."""
    rep = replay(trace)[device]
    calls = steps(trace, device)
    if not calls:
        return None
    curve = kv_curve(trace, device, rules)
    at = lambda i: int(curve[i]) if 0 <= i < len(curve) else 0  # noqa: E731
    first = next((i for i, c in enumerate(calls) if c["kind"] == "prefill"), 0)  # a window may have none
    run = [calls[first]]
    for c in calls[first + 1:]:  # the decoding steps of the first generation
        if c["kind"] != "decode":
            break
        run.append(c)
    ends = [at(c["end_index"]) for c in run]
    n = len(run) - 1
    per_step = (ends[-1] - ends[0]) / n if n else 0.0
    diffs = np.diff(ends) if n else np.zeros(0)
    return {
        "bytes_at_peak": at(rep.peak_index),
        "bytes_per_step": int(round(per_step)),
        "steps": n,
        "bytes_at_prefill": ends[0],
        "bytes_final": at(calls[-1]["end_index"]),
        "bytes_max": int(curve.max()) if len(curve) else 0,
        "bytes_per_step_min": int(diffs.min()) if len(diffs) else 0,
        "bytes_per_step_max": int(diffs.max()) if len(diffs) else 0,
        "at_step_end": ends,
        "how": ("KV cache: allocations of a Hugging Face cache (cache_utils.py frames) kept past the model call "
                "that made them; read at the end of the prefill and of each decoding step; bytes_per_step = "
                "(end of the last decoding step - end of the prefill) / steps"),
    }


def generation_summary(trace: Trace, device: int, rules=None) -> dict | None:
    """The report's `generation` block: how it was recognised and each model call (None: not a generation)."""
    ph = phases(trace)[device]
    if ph.generation is None:
        return None
    g = ph.generation
    calls = steps(trace, device)
    curve = kv_curve(trace, device, rules)
    for c in calls:
        c["kv_cache_bytes_end"] = int(curve[c["end_index"]]) if len(curve) else 0
    return {"model_calls": g["model_calls"], "prefills": g["prefills"], "decode_steps": g["decode_steps"],
            "evidence": list(g["evidence"]), "steps": calls}

