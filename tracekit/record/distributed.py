"""What the recorder knows of a sharded or data-parallel job, for the "distributed" part of the file.

Read off the modules the recorder knows at the end of recording (never changing them):

- FSDP2 (`fully_shard`): each unit (param group: the module's fully-qualified name, its parameters and
  their full bytes), whether it reshards after forward, the mixed-precision parameter dtype, CPU offload;
  parameters are DTensors, so this rank's shard is each one's local tensor;
- FSDP1 (`FullyShardedDataParallel`): units and sharding strategy;
- DDP (`DistributedDataParallel`): `gradient_as_bucket_view` and the bucket size;
- DeepSpeed (`DeepSpeedEngine`): the ZeRO stage.

`world_size` and `rank` come from torchrun's environment. Everything here is best effort: a field it cannot
read is left out.
"""
from __future__ import annotations

import os
from typing import Any


def fsdp2_unsharded_grads(group):
    """(parameter name, tensor) for each full (unsharded) gradient an FSDP2 unit (FSDPParamGroup) holds before
    its reduce-scatter: what the recorder and the simulation tag `gradient` at its post_backward."""
    for fp in getattr(group, "fsdp_params", ()):
        try:
            grad = fp._unsharded_param.grad if hasattr(fp, "_unsharded_param") else None
        except Exception:
            grad = None
        for g in (grad, getattr(fp, "unsharded_accumulated_grad", None)):
            if g is not None:
                yield getattr(fp, "_param_fqn", None) or "param", g


def _env_int(name):
    v = os.environ.get(name, "").strip()
    return int(v) if v.isdigit() else None


def _nbytes(t) -> int:
    try:
        return int(t.numel()) * int(t.element_size())
    except Exception:
        return 0


def _local(t):
    local = getattr(t, "_local_tensor", None)
    return local if local is not None else t


def _dtype(d) -> str | None:
    return str(d).replace("torch.", "") if d is not None else None


def summary(roots, unsharded_units=None) -> dict | None:
    """{"strategy", "world_size", "rank", "parameter_bytes" (full), "local_parameter_bytes" (this rank's),
    "units": [...], ...} for the known root modules [(prefix, module)], or None outside a distributed job."""
    world = _env_int("WORLD_SIZE")
    out = {"world_size": world, "rank": _env_int("RANK")}
    strategy = None
    units: list[dict[str, Any]] = []
    full = local = 0
    seen = set()
    for prefix, root in roots:
        for p in root.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            full += _nbytes(p)  # a DTensor's numel is the full parameter's
            local += _nbytes(_local(p))
        for name, m in root.named_modules():
            kind = type(m).__name__
            fsdp2 = any(c.__name__ == "FSDPModule" for c in type(m).__mro__)  # fully_shard's class
            if fsdp2 and strategy in (None, "fsdp2"):
                strategy = "fsdp2"
                try:
                    state = m._get_fsdp_state()
                    groups = list(getattr(state, "_fsdp_param_groups", None) or [])
                except Exception:
                    groups = []
                for g in groups:
                    params = [fp.sharded_param for fp in getattr(g, "fsdp_params", [])]
                    mp = getattr(g, "mp_policy", None)
                    unit: dict[str, Any] = {"name": prefix + name if name else (prefix.rstrip(".") or "(root)"),
                            "parameters": int(sum(int(p.numel()) for p in params)),
                            "bytes": int(sum(_nbytes(p) for p in params)),
                            "local_bytes": int(sum(_nbytes(_local(p)) for p in params)),
                            "param_dtype": _dtype(getattr(mp, "param_dtype", None)),
                            "reduce_dtype": _dtype(getattr(mp, "reduce_dtype", None)),
                            "offload": type(getattr(g, "offload_policy", None)).__name__ == "CPUOffloadPolicy"}
                    try:
                        rf = g._reshard_after_forward
                        unit["reshard_after_forward"] = bool(rf) if isinstance(rf, bool) else rf
                    except Exception:
                        pass
                    units.append(unit)
            elif kind == "FullyShardedDataParallel":
                strategy = strategy or "fsdp"
                handle = getattr(m, "_handle", None)
                flat = getattr(handle, "flat_param", None)
                unit = {"name": prefix + name if name else "(root)"}
                if flat is not None:
                    unit["parameters"] = int(getattr(flat, "_unpadded_unsharded_size", flat.shape).numel())
                    unit["bytes"] = unit["parameters"] * int(flat.element_size())
                    unit["local_bytes"] = _nbytes(flat)
                strat = getattr(m, "sharding_strategy", None)
                if strat is not None:
                    out["sharding_strategy"] = getattr(strat, "name", str(strat))
                units.append(unit)
            elif kind == "DistributedDataParallel":
                strategy = strategy or "ddp"
                out["gradient_as_bucket_view"] = bool(getattr(m, "gradient_as_bucket_view", False))
                cap = getattr(m, "bucket_bytes_cap", None)
                if isinstance(cap, int):
                    out["bucket_bytes"] = cap
            elif kind == "DeepSpeedEngine":
                strategy = strategy or "deepspeed"
                try:
                    out["zero_stage"] = int(m.zero_optimization_stage())
                except Exception:
                    pass
    if strategy is None and not (world and world > 1):
        return None
    out["strategy"] = strategy or "data parallel"
    if strategy == "fsdp2":
        local = sum(u.get("local_bytes", 0) for u in units) or local
    if strategy == "fsdp" and units and all("local_bytes" in u for u in units):
        local = sum(u["local_bytes"] for u in units)
        full = sum(u["bytes"] for u in units) or full
    out["parameter_bytes"] = int(full)
    out["local_parameter_bytes"] = int(local)
    out["units"] = units
    if unsharded_units:
        out["unsharded_units"] = [{"name": k, "bytes": int(v)} for k, v in unsharded_units.items()]
    return out
