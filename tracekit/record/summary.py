"""Small summaries of a model and an optimizer for the "tracekit" key."""
from __future__ import annotations


def qualified_name(obj) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def model_summary(model) -> dict:
    params = list(model.parameters())  # parameters() already skips shared duplicates
    return {
        "class": qualified_name(model),
        "parameters": sum(p.numel() for p in params),
        "parameter_bytes": sum(p.numel() * p.element_size() for p in params),
        "trainable_parameters": sum(p.numel() for p in params if p.requires_grad),
        "buffer_bytes": sum(b.numel() * b.element_size() for b in model.buffers()),
        "repeated_blocks": max((len(m) for m in model.modules() if type(m).__name__ == "ModuleList"), default=0),
    }


def optimizer_summary(optimizer) -> dict:
    return {"class": qualified_name(optimizer), "param_groups": len(optimizer.param_groups)}
