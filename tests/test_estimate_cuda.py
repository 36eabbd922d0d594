"""The formulas against the H100 recordings: the predicted peak (the largest moment of the step) vs
torch.cuda.max_memory_allocated(), and its composition vs torch's MemTracker at its peak (truth.json).

Independent of the formulas: truth.json was measured on the GPU (max_allocated) and by MemTracker in a
separate run; the recordings themselves are replayed by tracekit's report.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tracekit.analysis.estimate import Setup, estimate, from_hf_config
from tracekit.cli import main

CUDA = Path(__file__).parent / "fixtures" / "cuda"
TRUTH = json.loads((CUDA / "truth.json").read_text())["files"]
TRAINING = sorted(k for k in TRUTH if "adamw" in k)
MiB = 2**20


def predicted(name, **setup):
    t = TRUTH[name]
    # truth.json: bf16 autocast over fp32 weights, torch.optim.AdamW, HF's default attention (SDPA), H100
    return estimate(from_hf_config(t["config"]), Setup(precision="amp", optimizer="adamw", batch=t["batch"],
                                                       seq=t["seq"], **setup))


@pytest.mark.parametrize("name", TRAINING)
def test_peak_within_2_percent_of_max_allocated(name):
    est, t = predicted(name), TRUTH[name]
    assert abs(est.per_gpu["total"] - t["max_allocated"]) <= 0.02 * t["max_allocated"]
    # the sum of each category's largest bytes is no moment at all: it overshoots by the gradients, the optimizer
    # step's and the tied embedding's temporaries (the issue: 7-13% high)
    assert est.held()["total"] > 1.07 * t["max_allocated"]


@pytest.mark.parametrize("name", TRAINING)
def test_peak_composition_matches_memtracker(name):
    est, mt = predicted(name), TRUTH[name]["memtracker_at_peak"]
    assert est.peak_moment["name"] == "loss backward"
    at = est.per_gpu
    assert at["gradient"] == mt["gradient"] == 0  # zero_grad(set_to_none=True): none live before backward
    for cat in ("parameter", "optimizer_state", "activation", "temporary"):
        assert abs(at[cat] - mt[cat]) <= 0.01 * mt[cat], (cat, at[cat], mt[cat])
    # what MemTracker does not see (tensors only): the two cuBLAS workspaces (forward and backward threads)
    assert at["other"] == 2 * 32 * MiB


@pytest.mark.parametrize("name", TRAINING)
def test_moments_follow_the_recording(name, capsys):
    """The other moments against the recording's own phases (its largest live bytes per phase)."""
    main(["report", str(CUDA / name), "--json", "--no-cache"])
    phases = {p["phase"]: p["peak_bytes"] for p in json.loads(capsys.readouterr().out)["devices"][0]["phases"]}
    moments = {m["name"]: m["per_gpu"]["total"] for m in predicted(name).moments()}
    assert abs(moments["loss forward"] - phases["forward"]) <= 0.01 * phases["forward"]
    assert abs(moments["optimizer step"] - phases["optimizer"]) <= 0.01 * phases["optimizer"]
    assert abs(moments["loss backward"] - phases["backward"]) <= 0.01 * phases["backward"]


def test_loop_keeping_only_the_loss_peaks_lower_by_the_logits():
    name = TRAINING[0]
    t = TRUTH[name]
    kept, only = predicted(name), predicted(name, loss_only=True)
    assert kept.per_gpu["total"] - only.per_gpu["total"] == t["batch"] * t["seq"] * t["config"]["vocab_size"] * 2


def test_report_puts_the_moment_beside_the_recording(tmp_path, capsys):
    name = "qwen2_amp_adamw_b4_s256.pickle.gz"
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TRUTH[name]["config"]))
    main(["report", str(CUDA / name), "--estimate-config", str(cfg), "--precision", "amp", "--optimizer", "adamw",
          "--batch", "4", "--seq", "256", "--json", "--no-cache"])
    e = json.loads(capsys.readouterr().out)["devices"][0]["estimate"]
    assert e["predicted_peak_moment"] == "loss backward"
    assert abs(e["peak_difference"]) <= 0.01 * e["peak_allocated"]
    assert sum(g["bytes"] for g in e["gap_at_peak"]) == e["peak_difference"]
    rows = {r["category"]: r for r in e["categories"]}
    assert rows["gradient"]["predicted_at_peak"] == 0 and rows["gradient"]["predicted"] > 0
    act = rows["activation"]
    assert abs(act["predicted_at_peak"] - act["at_peak"]) <= 0.01 * act["at_peak"]


# -- quantized loading: the unquantized parts as transformers loads them --------------------------------------------
def test_quant_without_precision_is_fp16(capsys):
    main(["estimate", "--config", "mistral-7b", "--mode", "inference", "--quant", "8bit", "--json"])
    auto = json.loads(capsys.readouterr().out)
    main(["estimate", "--config", "mistral-7b", "--mode", "inference", "--quant", "8bit", "--precision", "fp32",
          "--json"])
    fp32 = json.loads(capsys.readouterr().out)
    assert auto["setup"]["precision"] == "fp16" and round(auto["per_gpu"]["total"] / MiB) == 7162
    assert round(fp32["per_gpu"]["total"] / MiB) == 7662
    # the difference is the unquantized parts at 2 B instead of 4: embeddings, lm_head, 2 norms per layer + 1
    v, h, layers = 32000, 4096, 32
    unquantized = 2 * v * h + (2 * layers + 1) * h
    assert fp32["per_gpu"]["total"] - auto["per_gpu"]["total"] == unquantized * 2
    assert any("without --precision" in a for a in auto["assumptions"])


def test_generation_peak_and_kv_cache():
    """Greedy generate() in bf16 with a KV cache: the cache's bytes exactly, the peak (the prompt's forward)
    within 2%."""
    t = TRUTH["qwen2_generate_b2_p256_n128.pickle.gz"]
    est = estimate(from_hf_config(t["config"]), Setup(mode="inference", precision="bf16", batch=t["batch"],
                                                      seq=t["prompt"], generate=t["new_tokens"]))
    assert est.per_gpu["kv_cache"] == t["kv_bytes_final"]
    assert est.per_gpu["parameter"] == t["param_bytes"]
    assert abs(est.per_gpu["total"] - t["max_allocated"]) <= 0.02 * t["max_allocated"]
