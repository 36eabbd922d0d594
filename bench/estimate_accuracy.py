#!/usr/bin/env python3
"""How close `tracekit estimate`'s formulas come: the table in docs/estimate.md, recomputed.

1. Parameter counts of the public configs in tests/fixtures/configs: the formula (no transformers), the
   model transformers builds from the same config on the meta device (when transformers is installed),
   and the published count (tests/fixtures/configs/published.json, with what it counts).
2. The H100 recordings in tests/fixtures/cuda (truth.json): the predicted peak (the largest moment of
   the step) against torch.cuda.max_memory_allocated(), and the peak's composition against torch's
   MemTracker at its peak.

Prints Markdown. Usage: python bench/estimate_accuracy.py [--no-meta]
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tracekit.analysis.estimate import Setup, estimate, from_hf_config  # noqa: E402

FIX = ROOT / "tests" / "fixtures"
MiB = 2**20


def meta_count(cfg: dict) -> int | None:
    try:
        import torch
        import transformers
    except ImportError:
        return None
    transformers.logging.set_verbosity_error()
    values = {k: v for k, v in cfg.items() if k != "model_type" and not k.startswith("_")}
    values.pop("quantization_config", None)
    config = transformers.AutoConfig.for_model(cfg["model_type"], **values)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())


def counts(meta=True) -> list[str]:
    published = json.loads((FIX / "configs" / "published.json").read_text())
    out = ["| config | model_type | formula | meta-device build | formula vs build | published | counts |",
           "|---|---|---:|---:|---:|---:|---|"]
    for path in sorted((FIX / "configs").glob("*.json")):
        if path.name == "published.json":
            continue
        cfg = json.loads(path.read_text())
        n = from_hf_config(cfg, path.stem).params()
        m = meta_count(cfg) if meta else None
        pub = published[path.stem]
        diff = "—" if m is None else ("exact" if m == n else f"{(n - m) / m:+.4%}")
        out.append(f"| {path.stem} | {cfg['model_type']} | {n:,} | {'—' if m is None else f'{m:,}'} | {diff} | "
                   f"{pub['params']:,} | {pub['counts']} |")
    return out


def peaks() -> list[str]:
    truth = json.loads((FIX / "cuda" / "truth.json").read_text())["files"]
    out = ["| recording | max_allocated | predicted peak (moment) | error | "
           "parameter / optimizer_state / activation / temporary vs MemTracker |",
           "|---|---:|---:|---:|---|"]
    for name, t in truth.items():
        shape = from_hf_config(t["config"], name)
        if "adamw" in name:
            est = estimate(shape, Setup(precision="amp", optimizer="adamw", batch=t["batch"], seq=t["seq"]))
        else:
            est = estimate(shape, Setup(mode="inference", precision="bf16", batch=t["batch"], seq=t["prompt"],
                                        generate=t["new_tokens"]))
        p, m = est.per_gpu, t["max_allocated"]
        mt = t.get("memtracker_at_peak")
        cats = " / ".join(f"{(p[c] - mt[c]) / mt[c]:+.2%}" for c in ("parameter", "optimizer_state", "activation",
                                                                     "temporary")) if mt else "—"
        out.append(f"| {name} | {m / MiB:,.1f} MiB | {p['total'] / MiB:,.1f} MiB ({est.peak_moment['name']}) | "
                   f"{(p['total'] - m) / m:+.2%} | {cats} |")
    return out


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--no-meta", action="store_true", help="skip the meta-device builds (no transformers needed)")
    args = ap.parse_args(argv)
    print("\n".join(counts(meta=not args.no_meta)))
    print()
    print("\n".join(peaks()))


if __name__ == "__main__":
    main()
