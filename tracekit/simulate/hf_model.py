"""Build a Hugging Face model from a config.json dict on the meta device: no weights, no download.

Used twice: `exact_count` counts the parameters of the model transformers would build (tied
weights once), and the simulator (record/fake.py) turns the same meta model into fake tensors.
torch and transformers are imported only when a function here is called; the hub is switched
off first (HF_HUB_OFFLINE=1), and remote code is never run.
"""
from __future__ import annotations

import contextlib
import os
import warnings

from ..errors import TracekitError

# Keys of a config.json that say "run this repository's own Python code": refused, never run.
REMOTE_CODE_KEYS = ("auto_map",)


def transformers_version() -> str | None:
    """The installed transformers' version, or None (without importing it)."""
    try:
        from importlib.metadata import PackageNotFoundError, version
        return version("transformers")
    except PackageNotFoundError:
        return None
    except Exception:
        return None


def _offline():
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")


@contextlib.contextmanager
def _quiet():
    """transformers and torch warn about things that do not concern a simulation (no weights...)."""
    import logging
    names = ("transformers", "torch")
    saved = [(logging.getLogger(n), logging.getLogger(n).level) for n in names]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for lg, _ in saved:
            lg.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for lg, level in saved:
                lg.setLevel(level)


def import_transformers():
    """(torch, transformers) or a TracekitError saying how to install them."""
    _offline()
    try:
        import torch
    except ImportError:
        raise TracekitError("building the model needs torch: pip install 'torch-tracekit[hf]'") from None
    try:
        with _quiet():
            import transformers
    except ImportError:
        raise TracekitError("building the model needs transformers: pip install 'torch-tracekit[hf]'") from None
    except Exception as e:  # a broken install: one line, not a traceback
        raise TracekitError(f"transformers cannot be imported here ({type(e).__name__}: {e})") from None
    return torch, transformers


def hf_config(config: dict):
    """The transformers config object for a config.json dict; TracekitError for what cannot be built."""
    torch, transformers = import_transformers()
    if not isinstance(config, dict):
        raise TracekitError("the config is not a JSON object")
    model_type = config.get("model_type")
    if not model_type:
        raise TracekitError("the config has no model_type, so transformers cannot say which model it is")
    if any(k in config for k in REMOTE_CODE_KEYS):
        raise TracekitError(f"model_type {model_type!r} needs the repository's own code (auto_map); "
                            "tracekit never runs remote code")
    from transformers import CONFIG_MAPPING
    if model_type not in CONFIG_MAPPING:
        raise TracekitError(f"unknown model_type {model_type!r} (transformers {transformers.__version__} "
                            f"knows {len(list(CONFIG_MAPPING.keys()))} types)")
    kwargs = {k: v for k, v in config.items() if k not in ("model_type", "transformers_version", "_name_or_path")}
    try:
        with _quiet():
            return CONFIG_MAPPING[model_type](**kwargs)
    except Exception as e:
        raise TracekitError(f"transformers cannot make a {model_type} config from it ({_one_line(e)})") from None


def _one_line(e) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def _model_class(cfg, transformers):
    """The class transformers would instantiate: the config's architectures[0] when transformers has
    it, else the causal-LM auto class, else the base model."""
    for arch in getattr(cfg, "architectures", None) or []:
        cls = getattr(transformers, arch, None)
        if isinstance(cls, type):
            return cls
    from transformers import AutoModel, AutoModelForCausalLM
    for auto in (AutoModelForCausalLM, AutoModel):
        mapping = getattr(auto, "_model_mapping", None)
        try:
            if mapping is not None and type(cfg) in mapping:
                return auto
        except Exception:
            continue
    raise TracekitError(f"transformers has no model class for model_type {cfg.model_type!r}")


def build_meta(config: dict, attn_implementation: str = "sdpa"):
    """The model transformers builds from `config`, with every tensor on the meta device (no memory,
    no init, no download). Tied weights are tied as in the real model."""
    torch, transformers = import_transformers()
    cfg = hf_config(config)
    cls = _model_class(cfg, transformers)
    try:
        with _quiet(), torch.device("meta"):
            if hasattr(cls, "from_config"):
                model = cls.from_config(cfg, attn_implementation=attn_implementation)
            else:
                model = cls._from_config(cfg, attn_implementation=attn_implementation)
    except TracekitError:
        raise
    except Exception as e:
        if attn_implementation != "eager" and "attn" in str(e).lower():
            return build_meta(config, "eager")  # an architecture without an SDPA path
        raise TracekitError(f"transformers cannot build {cfg.model_type!r} from this config ({_one_line(e)})") from None
    model.train()
    return model


def unique_parameters(model) -> list:
    """The model's parameters, each once (a tied weight is one parameter)."""
    seen, out = set(), []
    for _, p in model.named_parameters(remove_duplicate=False):
        if id(p) not in seen:
            seen.add(id(p))
            out.append(p)
    return out


def exact_count(config: dict) -> dict:
    """Parameters of the model transformers builds from `config`, counted on the meta device.

    {"params", "trainable_params", "buffers", "tied": [(name, name)...], "path", "transformers"}."""
    model = build_meta(config)
    params = unique_parameters(model)
    first: dict = {}
    tied = []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in first:
            tied.append((first[id(p)], name))
        else:
            first[id(p)] = name
    _, transformers = import_transformers()
    return {
        "params": int(sum(p.numel() for p in params)),
        "trainable_params": int(sum(p.numel() for p in params if p.requires_grad)),
        "buffers": int(sum(b.numel() for b in model.buffers())),
        "tied": tied,
        "model_class": type(model).__name__,
        "path": f"meta-device build (transformers {transformers.__version__})",
        "transformers": transformers.__version__,
    }
