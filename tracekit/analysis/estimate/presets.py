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
    """A config.json dict from a path (a file, or a folder holding config.json) or a preset name."""
    p = Path(path_or_preset)
    if p.is_dir():
        p = p / "config.json"
    if not p.exists():
        if "/" in path_or_preset or path_or_preset.endswith(".json"):
            raise TracekitError(f"{path_or_preset}: no such file (and not a preset: {', '.join(preset_names())})")
        return preset_config(path_or_preset)
    try:
        with open(p, "rb") as f:
            text = f.read(10 * 2**20 + 1)
        if len(text) > 10 * 2**20:
            raise TracekitError(f"{p}: over 10 MiB, not a config.json")
        return json.loads(text)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise TracekitError(f"{p}: not a JSON config ({e})") from None
    except OSError as e:
        raise TracekitError(f"{p}: cannot read ({e.strerror})") from None


def load_shape(path_or_preset: str) -> ModelShape:
    return from_hf_config(read_config(path_or_preset), name=str(path_or_preset))
