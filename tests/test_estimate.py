"""`tracekit estimate`: the figures from the source material, exact parameter counts, and our own recordings."""
from __future__ import annotations

import json

import pytest

from tracekit.analysis.categories import CATEGORIES

from tracekit.analysis.estimate import Setup, estimate, from_hf_config, load_shape, preset_names
from tracekit.analysis.estimate import deepspeed
from tracekit.analysis.estimate.presets import preset_config
from tracekit.analysis.estimate.shapes import ParamCount
from tracekit.cli import main

GiB, TiB, MiB = 2**30, 2**40, 2**20


def close(a, b, rel):
    return abs(a - b) <= rel * abs(b)


def run_json(capsys, *args):
    main(["estimate", *args, "--json"])
    return json.loads(capsys.readouterr().out)


# -- the ZeRO paper (Rajbhandari et al. 2020), Figure 1: Ψ = 7.5 B, K = 12, Nd = 64 -------------------------------
@pytest.mark.parametrize("stage,gb", [(0, 120), (1, 31.4), (2, 16.6), (3, 1.9)])
def test_zero_paper_model_states(stage, gb):
    est = estimate(ParamCount(7_500_000_000), Setup(precision="mixed", optimizer="adam", zero=stage, dp=64))
    g = est.per_gpu
    states = g["parameter"] + g["gradient"] + g["optimizer_state"]
    assert close(states / 1e9, gb, 0.01 if stage < 3 else 0.05)  # the paper rounds 1.875 to 1.9
    assert g["total"] == states  # no activations without a sequence length


def test_zero_paper_via_cli(capsys):
    out = run_json(capsys, "--params", "7.5B", "--precision", "mixed", "--optimizer", "adam", "--zero", "2",
                   "--dp", "64")
    assert close(out["per_gpu"]["total"] / 1e9, 16.6, 0.01)
    assert set(out["per_gpu"]) == set(CATEGORIES) | {"total"}  # every category a recording has, kv_cache too


# -- DeepSpeed's estimate_zero3_model_states_mem_needs_all_live, its docs' example ----------------------------------
# DeepSpeed prints "2783M total params, 65M largest layer params" by truncation; every figure it prints
# (70.00, 62.23, 1.47, 11.91, 0.25, 1.54 "GB") pins the model to 2,783.91-2,783.98 M and 65.77-65.99 M.
TOTAL, LARGEST = 2_783_940_000, 65_880_000


@pytest.mark.parametrize("op,oo,zi,cpu,gpu", [
    (True, True, True, 70.00, 0.25),
    (False, True, True, 62.23, 1.54),
    (False, False, True, 1.47, 11.91),
    (False, False, False, 62.23, 11.91),
])
def test_deepspeed_zero3(op, oo, zi, cpu, gpu):
    c, g = deepspeed.zero3(TOTAL, LARGEST, gpus_per_node=4, nodes=1, offload_optimizer=oo, offload_param=op,
                           zero_init=zi)
    assert close(c / GiB, cpu, 0.01) and close(g / GiB, gpu, 0.01 if gpu > 1 else 0.03)
    assert f"{c / GiB:.2f}" == f"{cpu:.2f}" and f"{g / GiB:.2f}" == f"{gpu:.2f}"  # as DeepSpeed prints them


def test_deepspeed_table_from_cli(capsys):
    out = run_json(capsys, "--params", str(TOTAL), "--largest-layer", str(LARGEST), "--zero", "3", "--dp", "4",
                   "--deepspeed")
    rows = out["deepspeed"]["rows"]
    assert len(rows) == 6
    assert [round(r["per_cpu"] / GiB, 2) for r in rows] == [70.0, 70.0, 62.23, 62.23, 1.47, 62.23]
    assert [round(r["per_gpu"] / GiB, 2) for r in rows] == [0.25, 0.25, 1.54, 1.54, 11.91, 11.91]


def test_deepspeed_zero2_independent():
    # the ZeRO-2 formula: 2Ψ on the GPU with offload; 4Ψ + 16Ψ/N without (fp16 params and grads + sharded states)
    n = 1_000_000_000
    assert deepspeed.zero2(n, 8, 1, cpu_offload=True) == (int(n * 32 * 1.5), 2 * n)
    assert deepspeed.zero2(n, 8, 1, cpu_offload=False) == (int(n * 32 * 1.5), 4 * n + 2 * n)


# -- the course's interactive calculator: "Llama 3 8B" shape, micro-batch 100, seq 1024, fp32, eager --------------
def test_calculator_activations(capsys):
    out = run_json(capsys, "--hidden", "4096", "--ffn", "16384", "--layers", "32", "--heads", "32",
                   "--vocab", "32000", "--activation-fn", "swiglu", "--precision", "fp32", "--optimizer", "adam",
                   "--batch", "100", "--seq", "1024", "--attention", "eager", "--dropout", "0.1")
    assert close(out["per_gpu"]["activation"] / TiB, 2.09, 0.01)
    # the slide's total (2.15) uses the GPT-style parameter count; ours counts SwiGLU's third matrix exactly
    assert out["params"] == 32 * (4 * 4096**2 + 3 * 4096 * 16384 + 2 * 2 * 4096) + 2 * 32000 * 4096 + 2 * 4096
    assert out["per_gpu"]["total"] > out["per_gpu"]["activation"]


def test_calculator_note_in_text(capsys):
    main(["estimate", "--hidden", "4096", "--ffn", "16384", "--layers", "32", "--heads", "32", "--vocab", "32000",
          "--batch", "1", "--seq", "16"])
    text = capsys.readouterr().out
    assert "GPT-style napkin count" in text and "activation" in text


# -- exact parameter counts ----------------------------------------------------------------------------------------
def test_llama3_8b_exact():
    assert load_shape("llama-3-8b").params() == 8_030_261_248


def test_phi3_mini_16_layers_fp16_on_gpu():
    # measured torch.cuda.memory_allocated() after .to("cuda"): 4,018,347,520 bytes
    est = estimate(load_shape("phi-3-mini").with_(layers=16), Setup(mode="inference", precision="fp16"))
    assert close(est.per_gpu["parameter"], 4_018_347_520, 0.001)


@pytest.mark.parametrize("name,mib", [("llama-3.1-8b", 8679), ("mistral-7b", 7364), ("phi-3-mini", 3878),
                                      ("phi-3-mini@16", 2131)])
def test_bitsandbytes_8bit(name, mib):
    name, _, layers = name.partition("@")
    shape = load_shape(name).with_(layers=int(layers) if layers else None)
    est = estimate(shape, Setup(mode="inference", precision="fp16", quant="8bit"))
    assert close(est.per_gpu["total"] / MiB, mib, 0.03)


def test_napkin_rule():
    shape = ParamCount(100_000_000)
    weights = estimate(shape, Setup(mode="inference", precision="fp32")).per_gpu["total"]
    momentum = estimate(shape, Setup(precision="fp32", optimizer="sgd-momentum"))
    adam = estimate(shape, Setup(precision="fp32", optimizer="adam"))
    states = [sum(e.held()[c] for c in ("parameter", "gradient", "optimizer_state")) for e in (momentum, adam)]
    assert (weights, *states) == (400_000_000, 1_200_000_000, 1_600_000_000)
    # the peak: SGD's step is in place; foreach Adam's step adds sqrt(exp_avg_sq) for every parameter (fp32)
    assert momentum.per_gpu["total"] == 1_200_000_000 and momentum.peak_moment["name"] == "end of backward"
    assert adam.per_gpu["total"] == 2_000_000_000 and adam.peak_moment["name"] == "optimizer step"
    fused = estimate(shape, Setup(precision="fp32", optimizer="adam", fused_optimizer=True))
    assert fused.per_gpu["total"] == 1_600_000_000


def _reference(name, cfg):
    """The same architecture built independently in plain torch on the meta device."""
    import torch

    from tests.estimate_models import GPT2, Llama, NeoX, count

    with torch.device("meta"):
        mt = cfg["model_type"]
        if mt == "gpt2":
            return count(GPT2(cfg["vocab_size"], cfg["n_embd"], cfg["n_layer"], cfg["n_head"], cfg["n_positions"]))
        if mt == "gpt_neox":
            return count(NeoX(cfg))
        return count(Llama(dict(cfg, qkv_bias=mt == "qwen2", qk_norm=mt == "qwen3", fused=mt == "phi3")))


@pytest.mark.parametrize("name", preset_names())
def test_preset_counts_match_plain_torch(name):
    pytest.importorskip("torch")
    cfg = preset_config(name)
    assert load_shape(name).params() == _reference(name, cfg)


@pytest.mark.parametrize("name,n", [("gpt2", 124_439_808), ("phi-3-mini", 3_821_079_552),
                                    ("tinyllama-1.1b", 1_100_048_384), ("mistral-7b", 7_241_732_096),
                                    ("qwen2.5-7b", 7_615_616_512), ("pythia-160m", 162_322_944),
                                    ("llama-3.1-70b", 70_553_706_496), ("llama-2-7b", 6_738_415_616)])
def test_published_counts(name, n):
    assert load_shape(name).params() == n


def test_config_file_and_overrides(tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(preset_config("tinyllama-1.1b")))
    a = run_json(capsys, "--config", str(path))
    b = run_json(capsys, "--config", str(tmp_path), "--layers", "11")
    assert a["params"] == 1_100_048_384
    per_layer = (a["params"] - b["params"]) // 11
    assert per_layer == 2 * 2048**2 + 2 * 2048 * 256 + 3 * 2048 * 5632 + 2 * 2048


# -- knobs ---------------------------------------------------------------------------------------------------------
def test_lora_and_qlora():
    shape = load_shape("llama-3-8b")
    est = estimate(shape, Setup(precision="bf16", optimizer="adamw", lora_rank=16, quant="4bit"))
    r = 16 * 32 * ((4096 + 4096) * 2 + (4096 + 1024) * 2)  # q, o: 4096 -> 4096; k, v: 4096 -> 1024
    assert est.trainable_params == r
    assert est.per_gpu["gradient"] == r * 4 and est.per_gpu["optimizer_state"] == r * 8
    lin = shape.linear_params()
    expected = lin * 0.5 + lin / 64 * 4 + (shape.params() - lin) * 2 + r * 4
    assert close(est.per_gpu["parameter"], expected, 1e-9)


def test_checkpointing_and_flash_shrink_activations():
    shape = load_shape("llama-3-8b")
    acts = {}
    for ck in ("none", "selective", "full"):
        for att in ("eager", "flash"):
            s = Setup(precision="bf16", batch=1, seq=4096, checkpointing=ck, attention=att)
            acts[ck, att] = estimate(shape, s).held()["activation"]
    assert acts["none", "eager"] > acts["selective", "eager"] > acts["full", "eager"]
    assert acts["none", "flash"] < acts["none", "eager"]
    # full checkpointing keeps each layer's input: seq × hidden × 2 B × 32 layers (+ one layer and the loss)
    assert acts["full", "flash"] > 4096 * 4096 * 2 * 32


def test_inference_kv_cache():
    shape = load_shape("llama-3-8b")
    base = estimate(shape, Setup(mode="inference", precision="bf16", batch=2, seq=100))
    gen = estimate(shape, Setup(mode="inference", precision="bf16", batch=2, seq=100, generate=28))
    blocks = estimate(shape, Setup(mode="inference", precision="bf16", batch=2, seq=100, generate=28,
                                   kv_block_size=100))
    kv = 32 * 2 * 8 * 128 * 128 * 2 * 2
    assert gen.per_gpu["kv_cache"] - base.per_gpu["kv_cache"] == kv
    unused = [ln.bytes for ln in blocks.lines if ln.formula.startswith("KV cache blocks")]
    assert unused == [32 * 2 * 8 * 128 * 72 * 2 * 2]  # 200-token blocks hold 72 unused slots


def test_offload_and_tp():
    shape = load_shape("llama-3-8b")
    est = estimate(shape, Setup(precision="mixed", optimizer="adam", zero=3, dp=8, offload_optimizer=True,
                                offload_param=True))
    assert est.per_cpu["optimizer_state"] == shape.params() * 12 // 8
    assert est.per_gpu["parameter"] == shape.largest_layer_params() * 2
    tp = estimate(shape, Setup(precision="mixed", optimizer="adam", tp=4))
    assert close(tp.per_gpu["total"], estimate(shape, Setup(precision="mixed", optimizer="adam")).per_gpu["total"] / 4,
                 1e-9)


@pytest.mark.parametrize("args,msg", [
    (["--config", "no-such-model"], "no preset"),
    (["--config", "/no/such/config.json"], "no such file"),
    (["--hidden", "64"], "--layers"),
    (["--params", "1e6", "--seq", "128"], "shape"),
    (["--config", "gpt2", "--quant", "4bit"], "LoRA"),
    (["--config", "gpt2", "--heads", "5"], "multiple"),
    (["--config", "gpt2", "--offload-param", "cpu"], "--zero 3"),
    ([], "which model"),
])
def test_bad_input_one_line(capsys, args, msg):
    with pytest.raises(SystemExit) as e:
        main(["estimate", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert msg in err and err.count("\n") == 1


def test_not_a_config(tmp_path, capsys):
    p = tmp_path / "c.json"
    p.write_text('{"foo": 1}')
    with pytest.raises(SystemExit) as e:
        main(["estimate", "--config", str(p)])
    assert e.value.code == 2 and "missing" in capsys.readouterr().err


# -- a real CUDA snapshot recorded by someone else: CS336 "small" LM, fp32 forward under no_grad, batch 4 × 128 -----
REAL = __import__("pathlib").Path(__file__).parent / "fixtures" / "real"
CS336_SMALL = {"model_type": "llama", "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
               "num_attention_heads": 12, "vocab_size": 10000, "tie_word_embeddings": False}


@pytest.mark.skipif(not (REAL / "truth.json").exists(), reason="real fixtures missing")
def test_real_cuda_snapshot_with_estimate_config(tmp_path, capsys):
    truth = json.loads((REAL / "truth.json").read_text())["snapshot_cpp_frames_fp32_forward_no_grad.pickle"]
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(CS336_SMALL))
    assert from_hf_config(CS336_SMALL).params() == 128_625_408  # SOURCES.md / truth.json
    main(["report", str(REAL / "snapshot_cpp_frames_fp32_forward_no_grad.pickle"), "--estimate-config", str(cfg),
          "--mode", "inference", "--precision", "fp32", "--batch", "4", "--seq", "128", "--json", "--no-cache"])
    dev = json.loads(capsys.readouterr().out)["devices"][0]
    e = dev["estimate"]
    rows = {r["category"]: r for r in e["categories"]}
    # weights: the independent truth (blocks + RoPE buffers) within 1%
    assert close(rows["parameter"]["predicted"], truth["truth"]["parameter"], 0.01)
    assert e["peak_allocated"] == truth["peak_bytes"]
    assert sum(g["bytes"] for g in e["gap_at_peak"]) == e["peak_difference"]
    assert e["reserved_unused_at_peak"] == dev["fragmentation_at_peak_bytes"] and e["not_visible"]


@pytest.mark.parametrize("cfg", [
    {"hidden_size": "wide", "num_hidden_layers": 2, "num_attention_heads": 2, "vocab_size": 10},
    {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "vocab_size": 10, "intermediate_size": -1},
    {"hidden_size": 64, "num_hidden_layers": 0, "num_attention_heads": 2, "vocab_size": 10},
    {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2, "vocab_size": 10, "attn_pdrop": "x"},
    [1, 2, 3],
])
def test_bad_configs_one_line(tmp_path, capsys, cfg):
    p = tmp_path / "config.json"
    p.write_text(json.dumps(cfg))
    with pytest.raises(SystemExit) as e:
        main(["estimate", "--config", str(p)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("tracekit: ") and err.count("\n") == 1
