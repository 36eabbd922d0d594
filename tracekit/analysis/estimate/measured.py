"""Predicted beside measured: an estimate for a recording, per category, with the gap itemized.

The setup comes from what our recorder stored (parameter count and dtypes,
trainable parameters, optimizer class and defaults, the batch shape, a
Hugging Face config and its attention implementation when the model has
one) or from the user (`report --estimate-config`). Measured is each
category's largest live bytes over the recording, beside each category's
predicted bytes when held; the predicted peak (the largest moment of the
step) is compared with the measured peak, category by category, plus
what the allocator adds (reserved but unused) and what a recording cannot
see (CUDA context, NCCL).
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ...model import Trace
from .memory import Setup, estimate
from .shapes import ModelShape, ParamCount, from_hf_config

OPTIMIZER_CLASSES = (("8bit", "adam8bit"), ("adafactor", "adafactor"), ("adamw", "adamw"), ("adam", "adam"),
                     ("sgd", "sgd"))


def recorded_setup(trace: Trace):
    """(shape, Setup, notes) from the recorder's data; shape None when the file says nothing about the model."""
    rec = trace.recorder or {}
    model, opt = rec.get("model") or {}, rec.get("optimizer") or {}
    notes: list = []
    if not model.get("parameters"):
        return None, None, notes
    dtypes = model.get("dtypes") or {"float32": model["parameters"]}
    main = max(dtypes, key=lambda t: dtypes[t])
    precision = {"bfloat16": "bf16", "float16": "fp16"}.get(main, "fp32")
    name = (opt.get("class") or "").lower()
    kind = next((k for key, k in OPTIMIZER_CLASSES if key in name.rsplit(".", 1)[-1]), "none")
    if kind == "sgd" and (opt.get("defaults") or {}).get("momentum"):
        kind = "sgd-momentum"
    if opt and kind == "none":
        notes.append(f"optimizer {opt.get('class')} is not one the estimator knows: no state predicted")
    shape_in = model.get("input_shape") or []
    batch, seq = (shape_in[0], shape_in[1]) if len(shape_in) == 2 else (1, 0)
    cfg = model.get("config")
    attention = {"eager": "eager", "sdpa": "sdpa", "flash_attention_2": "flash", "flash_attention_3": "flash"}.get(
        str((cfg or {}).get("_attn_implementation") or "sdpa"), "sdpa")
    setup = Setup(precision=precision, optimizer=kind, batch=batch, seq=seq, attention=attention,
                  **_distributed_setup(rec.get("distributed"), notes))
    if cfg:
        try:
            shape: ModelShape | ParamCount = from_hf_config(cfg, name=cfg.get("_name_or_path") or model.get("class", "model"))
            if shape.params() == model["parameters"]:
                notes.append("model shape from the recorded Hugging Face config")
                return shape, setup, notes
            notes.append(f"the recorded config counts {shape.params():,} parameters, the model has "
                         f"{model['parameters']:,}: model states from the recorded count")
        except Exception as e:  # a config this estimator does not know: fall back to the counts
            notes.append(f"recorded config not usable ({e})")
    trainable = model.get("trainable_parameters", model["parameters"])
    units = [u.get("parameters") or 0 for u in (rec.get("distributed") or {}).get("units") or []]
    shape = ParamCount(model["parameters"], name=model.get("class", "model"), trainable=trainable,
                       factored=_factored(model.get("trainable_shapes")), largest=max(units, default=0))
    notes.append("model states from the recorder's parameter count; without the model's shape activations are "
                 "not predicted: give --estimate-config")
    return shape, replace(setup, optimizer=kind if kind != "adafactor" or shape.factored else "none"), notes


def _distributed_setup(info, notes) -> dict:
    """Setup fields for a rank of a sharded or data-parallel job (record/distributed.py): FSDP shards parameters,
    gradients and optimizer state over the ranks (ZeRO-3), DDP keeps whole copies (dp only)."""
    if not isinstance(info, dict) or not isinstance(info.get("world_size"), int) or info["world_size"] < 2:
        return {}
    world, strategy = info["world_size"], info.get("strategy")
    if strategy == "fsdp2" or (strategy == "fsdp" and info.get("sharding_strategy", "FULL_SHARD") in
                               ("FULL_SHARD", "HYBRID_SHARD")):
        notes.append(f"{strategy.upper()} over {world} ranks (the recorder): parameters, gradients and optimizer "
                     "state sharded, units all-gathered for compute")
        return {"zero": 3, "dp": world, "fsdp": True}
    if strategy == "fsdp" and info.get("sharding_strategy") == "SHARD_GRAD_OP":
        return {"zero": 2, "dp": world}
    if strategy == "deepspeed" and isinstance(info.get("zero_stage"), int):
        return {"zero": info["zero_stage"], "dp": world}
    notes.append(f"{strategy or 'data parallel'} over {world} ranks (the recorder): whole parameters, gradients "
                 "and optimizer state on every rank")
    return {"dp": world}


def _factored(shapes) -> int | None:
    if not shapes:
        return None
    n = 0
    for key, count in shapes:
        dims = [int(x) for x in str(key).split("x") if x]
        n += count * (dims[0] + int(np.prod(dims[1:])) if len(dims) >= 2 else int(np.prod(dims or [1])))
    return n


def measured_max(trace: Trace, device: int, rules=None) -> dict:
    """Each category's largest live bytes over the recording."""
    from ..timeline import category_maxima

    return category_maxima(trace, device, rules)  # not the whole series: a point per entry, per category


def wants_estimates(trace: Trace, spec=None) -> bool:
    """Whether add_estimates(trace, devices, spec) estimates anything: a shape given, or the recorder's model."""
    return (spec or {}).get("shape") is not None or bool(((trace.recorder or {}).get("model") or {}).get("parameters"))


def add_estimates(trace: Trace, devices: list, spec=None, rules=None):
    """Put "estimate" (predicted vs measured) in each device's report dict, where something says what the model is.

    spec: None (what the recorder stored) or {"shape": ModelShape | None, "overrides": {Setup field: value}}."""
    spec = spec or {}
    if not wants_estimates(trace, spec):
        return
    for d in devices:
        result = compare(trace, d["device"], d, spec.get("shape"), spec.get("overrides"), rules)
        if result is not None:
            d["estimate"] = result


UNPREDICTED_WITHOUT_TOKENS = ("activation", "input", "kv_cache")


def compare(trace: Trace, device: int, summary: dict, shape=None, overrides=None, rules=None) -> dict | None:
    """Predicted vs measured for one device (`summary`: its report dict). None when nothing says what the model is."""
    rshape, setup, notes = recorded_setup(trace)
    if shape is None:
        shape = rshape
    elif rshape is not None:
        notes = ["model shape from --estimate-config; the batch and precision from the recording unless given"]
    if shape is None:
        return None
    setup = replace(setup or Setup(), **{k: v for k, v in (overrides or {}).items() if v is not None})
    if isinstance(shape, ParamCount) and setup.seq:
        setup = replace(setup, seq=0)
    est = estimate(shape, setup)
    held, at_predicted_peak = est.held("gpu"), est.per_gpu
    measured = measured_max(trace, device, rules)
    at_peak = summary.get("categories_at_peak", {})
    cats = [c for c in held if c != "total"] + [c for c in measured if c not in held]
    how = _how_classified(trace, device, summary.get("peak_event_index"), rules)
    # predicted (each category when held) vs measured (its largest live bytes); and the predicted peak moment's
    # composition vs the measured peak's
    rows = [{"category": c, "predicted": held.get(c, 0), "measured": measured.get(c, 0),
             "predicted_at_peak": at_predicted_peak.get(c, 0), "at_peak": at_peak.get(c, 0),
             "difference": measured.get(c, 0) - held.get(c, 0), "inferred_share": how.get(c)} for c in cats]
    if isinstance(shape, ModelShape) and not setup.seq:
        # the config is known, the tokens are not (the recorder saw no input shape): what grows with the batch and
        # the sequence is not predicted, rather than predicted as 0 B (issue 31)
        for r in rows:
            if r["category"] in UNPREDICTED_WITHOUT_TOKENS:
                r["predicted"] = r["predicted_at_peak"] = r["difference"] = None
        notes = notes + ["activations, inputs and the KV cache are not predicted: the file does not say the batch "
                         "and the sequence length (give --batch and --seq with --estimate-config to predict them)"]
    peak = summary["peak_allocated_bytes"]
    gap = [{"what": f"{r['category']} at the peak vs predicted at the peak ({est.peak_moment['name']})",
            "bytes": r["at_peak"] - r["predicted_at_peak"]}
           for r in rows if r["predicted_at_peak"] is not None and r["at_peak"] != r["predicted_at_peak"]]
    cpu = (trace.recorder or {}).get("backend") == "cpu" or summary.get("label") == "cpu"
    reserved_unused = None if cpu else summary.get("fragmentation_at_peak_bytes")
    rounding = None if cpu else _rounding_at_peak(trace, device, summary["peak_event_index"])
    outside = ("the CUDA context, kernels and NCCL buffers live outside the allocator: "
               "a recording cannot see them (typically 0.3-1 GiB per process)") if not cpu else None
    inferred = [r["category"] for r in rows if (r["inferred_share"] or 0) > 0 and (r["measured"] or r["at_peak"])]
    total_at_peak = sum(at_peak.values()) or 1
    share = sum(at_peak.get(c, 0) * (how.get(c) or 0) for c in at_peak) / total_at_peak
    if inferred:
        notes = [f"the measured split is inferred, not measured by tags, for {share:.0%} of the bytes at the peak "
                 f"({', '.join(inferred)}: from phases, lifetimes and stacks, see docs/categories.md); a difference "
                 "there may be the inference's, not the estimate's"] + notes
    return {"model": shape.name, "params": est.params, "trainable_params": est.trainable_params,
            "measured_split": {"inferred_share_at_peak": round(share, 4), "inferred_categories": inferred},
            "setup": est.to_dict()["setup"], "measured_is": "each category's largest live bytes in the recording",
            "categories": rows, "predicted_total": at_predicted_peak["total"],
            "predicted_peak_moment": est.peak_moment["name"], "peak_allocated": peak,
            "peak_difference": peak - at_predicted_peak["total"], "gap_at_peak": gap, "not_visible": outside,
            "allocator_rounding_at_peak": rounding, "reserved_unused_at_peak": reserved_unused,
            "notes": notes, "assumptions": notes + est.assumptions, "lines": est.to_dict()["lines"]}


def _how_classified(trace: Trace, device: int, index, rules=None) -> dict:
    """{category: share of its bytes live at `index` whose category was inferred (not a tag or a user rule)}."""
    from ..categories import INFERRED, categorize
    from ..replay import replay

    if index is None:
        return {}
    rep = replay(trace)[device]
    al = rep.allocations
    if not len(al):
        return {}
    cats = categorize(trace, rules)[device]
    live = al.live_at(index)
    out = {}
    for k, name in enumerate(cats.names):
        rows = live & (cats.labels == k)
        total = float(al.size[rows].sum())
        if total:
            out[name] = round(float(al.size[rows & (cats.method == INFERRED)].sum()) / total, 4)
    return out


ROUND = 512  # the CUDA caching allocator's size granularity


def _rounding_at_peak(trace: Trace, device: int, index: int) -> int:
    """Bytes the allocator adds at the peak by rounding live sizes up to 512 B (0 where sizes are blocks already)."""
    from ..replay import replay

    al = replay(trace)[device].allocations
    sizes = al.size[al.live_at(index)].astype(np.int64)
    return int((-sizes % ROUND).sum())
