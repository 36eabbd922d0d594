"""Bundled model configs (real Hugging Face config.json values, no download) and config loading."""
from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from ...errors import TracekitError
from .shapes import ModelShape, from_hf_config


def preset_names() -> list[str]:
    folder = resources.files("tracekit.data") / "presets"
    return sorted(p.name[:-5] for p in folder.iterdir() if p.name.endswith(".json"))


def preset_config(name: str) -> dict:
    path = resources.files("tracekit.data") / "presets" / f"{name.lower()}.json"
    if not path.is_file():
        raise TracekitError(f"no preset {name!r}; presets: {', '.join(preset_names())}")
    return json.loads(path.read_text())


def read_config(path_or_preset: str) -> dict:
    """A config.json dict from a path (a file, or a folder holding config.json) or a preset name, checked by
    `check_config`: whatever it holds, the estimate and the simulation get sizes they can compute with, or
    the user one line (TracekitError)."""
    p = Path(path_or_preset)
    if p.is_dir():
        p = p / "config.json"
    if not p.exists():
        if "/" in path_or_preset or path_or_preset.endswith(".json"):
            raise TracekitError(f"{_cut(path_or_preset)}: no such file (and not a preset: {', '.join(preset_names())})")
        return check_config(preset_config(path_or_preset), path_or_preset)
    try:
        with open(p, "rb") as f:
            text = f.read(10 * 2**20 + 1)
        if len(text) > 10 * 2**20:
            raise TracekitError(f"{p}: over 10 MiB, not a config.json")
        cfg = json.loads(text, parse_constant=_refuse_constant, parse_int=_whole, parse_float=_finite)
    except _Refused as e:
        raise TracekitError(f"{p}: {e}") from None
    except RecursionError:
        raise TracekitError(f"{p}: nested too deeply to be a config.json") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TracekitError(f"{p}: not a JSON config ({e})") from None
    except OSError as e:
        raise TracekitError(f"{p}: cannot read ({e.strerror})") from None
    return check_config(cfg, str(p))


class _Refused(ValueError):
    """A JSON value no config holds (NaN, Infinity, a number of hundreds of digits)."""


def _refuse_constant(name):
    raise _Refused(f"{name} is not a value a config.json holds")


def _whole(text):
    if len(text.lstrip("-")) > 30:
        raise _Refused(f"the integer {text[:20]}... ({len(text)} digits) is not a value a config.json holds")
    return int(text)


def _finite(text):
    v = float(text)
    if v != v or v in (float("inf"), float("-inf")):
        raise _Refused(f"the number {text[:40]} is too large for a config.json")
    return v


def _cut(text, n=80) -> str:
    return text if len(text) <= n else text[:n] + "..."


# The sizes a config may give, with the largest value any real model is far below (the largest known: hidden
# 25600, 126 layers, 262144 vocabulary, 10M positions): past these the figures mean nothing and the
# simulation would ask for tensors of petabytes (or, for layers, minutes of work for one estimate).
SIZE_LIMITS = {
    **dict.fromkeys(("hidden_size", "n_embd", "d_model", "n_embed"), 1 << 20),
    **dict.fromkeys(("intermediate_size", "ffn_dim", "n_inner", "ffn_hidden_size", "moe_intermediate_size",
                     "shared_expert_intermediate_size", "d_ff"), 1 << 22),
    **dict.fromkeys(("num_hidden_layers", "n_layer", "num_layers", "n_layers"), 1024),
    **dict.fromkeys(("num_attention_heads", "n_head", "n_heads", "num_heads", "num_key_value_heads", "head_dim",
                     "num_experts", "n_routed_experts", "num_local_experts", "n_shared_experts",
                     "num_experts_per_tok"), 1 << 16),
    **dict.fromkeys(("vocab_size", "padded_vocab_size"), 1 << 24),
    "max_position_embeddings": 1 << 27,
}
MAX_TENSOR = 1 << 40  # elements of one weight (hidden x vocab, hidden x intermediate): 1 Ti (the largest real: 2^32)


def check_config(cfg, name: str, labels=None) -> dict:
    """`cfg` if it is a JSON object whose sizes are whole numbers in range (the top level and any object in
    it, such as text_config); else TracekitError, one line naming the key (`labels`: the name to say for a
    key, e.g. {"num_hidden_layers": "--layers"} for the command's shape flags)."""
    name = _cut(name)
    say = (labels or {}).get
    if not isinstance(cfg, dict):
        raise TracekitError(f"{name}: a config must be a JSON object, not a {type(cfg).__name__}")
    for where, d in [("", cfg)] + [(f"{k}.", v) for k, v in cfg.items() if isinstance(v, dict)]:
        mt = d.get("model_type")
        if mt is not None and not isinstance(mt, str):
            raise TracekitError(f"{name}: {where}model_type must be a string (got a {type(mt).__name__})")
        for key, top in SIZE_LIMITS.items():
            v = d.get(key)
            if v is None:
                continue
            if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v:
                raise TracekitError(f"{name}: {where}{say(key, key)} must be a whole number (got {_cut(repr(v), 40)})")
            if v < 0:
                raise TracekitError(f"{name}: {where}{say(key, key)} cannot be negative (got {int(v)})")
            if v > top:
                raise TracekitError(f"{name}: {where}{say(key, key)} is {int(v):,}, past any model this estimator can count "
                                    f"(at most {top:,})")
        kv = d.get("num_key_value_heads")
        if isinstance(kv, (int, float)) and not isinstance(kv, bool) and kv <= 0:
            raise TracekitError(f"{name}: {where}{say('num_key_value_heads', 'num_key_value_heads')} is {kv}: a model has "
                                "at least one key/value head (leave it out for as many as the attention heads)")
        hidden = _first(d, "hidden_size", "n_embd", "d_model", "n_embed")
        for key in ("vocab_size", "padded_vocab_size", "intermediate_size", "ffn_dim", "n_inner",
                    "moe_intermediate_size"):
            v = d.get(key)
            if hidden and isinstance(v, (int, float)) and not isinstance(v, bool) and hidden * v > MAX_TENSOR:
                raise TracekitError(f"{name}: {where}hidden size {int(hidden):,} x {say(key, key)} {int(v):,} is one weight of "
                                    f"{int(hidden * v):,} elements, past any model this estimator can count")
    return cfg


def _first(d, *keys):
    for k in keys:
        v = d.get(k)
        if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0:
            return v
    return None


def load_shape(path_or_preset: str) -> ModelShape:
    return from_hf_config(read_config(path_or_preset), name=str(path_or_preset))
