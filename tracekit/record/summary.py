"""Small summaries of a model and an optimizer for the "tracekit" key (what `estimate` needs to compare)."""
from __future__ import annotations

from typing import Any

MAX_SHAPES = 2000


def qualified_name(obj) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def model_summary(model, input_shape=None) -> dict:
    params = list(model.parameters())  # parameters() already skips shared duplicates
    trainable = [p for p in params if p.requires_grad]
    dtypes: dict
    shapes: dict
    dtypes, shapes = {}, {}
    for p in params:
        dtypes[str(p.dtype).replace("torch.", "")] = dtypes.get(str(p.dtype).replace("torch.", ""), 0) + p.numel()
    for p in trainable:
        key = "x".join(map(str, p.shape))
        shapes[key] = shapes.get(key, 0) + 1
    return {
        "class": qualified_name(model),
        "parameters": sum(p.numel() for p in params),
        "parameter_bytes": sum(p.numel() * p.element_size() for p in params),
        "trainable_parameters": sum(p.numel() for p in trainable),
        "trainable_parameter_bytes": sum(p.numel() * p.element_size() for p in trainable),
        "buffer_bytes": sum(b.numel() * b.element_size() for b in model.buffers()),
        "repeated_blocks": max((len(m) for m in model.modules() if type(m).__name__ == "ModuleList"), default=0),
        "dtypes": dtypes,
        "trainable_shapes": [[k, v] for k, v in list(shapes.items())[:MAX_SHAPES]],
        "config": hf_config(model),
        "input_shape": input_shape,
    }


def hf_config(model) -> dict | None:
    """The scalar fields of a Hugging Face model's `config` (hidden size, layers, heads...), if it has one."""
    cfg = getattr(model, "config", None)
    to_dict = getattr(cfg, "to_dict", None)
    if not callable(to_dict):
        return None
    try:
        d = to_dict()
    except Exception:
        return None
    out = {k: v for k, v in d.items() if isinstance(k, str) and (v is None or isinstance(v, (bool, int, float, str)))}
    attn = getattr(cfg, "_attn_implementation", None)  # not in to_dict(); what `estimate` needs for attention
    if isinstance(attn, str):
        out.setdefault("_attn_implementation", attn)
    return out


def input_shape(args, kwargs) -> list | None:
    """Shape of a forward's first tensor argument (the batch: [batch, seq] for token ids)."""
    for value in list(args) + list((kwargs or {}).values()):
        shape = getattr(value, "shape", None)
        if shape is not None and hasattr(value, "dtype"):
            return [int(n) for n in shape]
    return None


def optimizer_summary(optimizer) -> dict:
    defaults: dict[str, Any] = {}
    for k, v in getattr(optimizer, "defaults", {}).items():
        if isinstance(v, (bool, int, float, str)) or v is None:
            defaults[k] = v
        elif isinstance(v, tuple) and all(isinstance(x, (int, float)) for x in v):
            defaults[k] = list(v)
    return {"class": qualified_name(optimizer), "param_groups": len(optimizer.param_groups), "defaults": defaults}
