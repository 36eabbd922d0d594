"""Predicted vs measured on our own CPU recordings: five small real models and optimizers, one training step each.

The measured side is the recorder's exact categories (tags on parameters,
gradients, optimizer state, saved tensors); the predicted side is the
estimator's formulas from a Hugging Face-style config of the same model.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

import torch.nn.functional as F  # noqa: E402

import tracekit  # noqa: E402
from tracekit.analysis.estimate import Setup, estimate, from_hf_config  # noqa: E402
from tracekit.analysis.estimate.measured import measured_max  # noqa: E402
from tracekit.analysis.report import build_report  # noqa: E402
from tracekit.io import load  # noqa: E402
from tracekit.record.toy import TinyGPT  # noqa: E402
from tests.estimate_models import GPT2, Llama  # noqa: E402

V = 1024
LLAMA = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": V, "tie_word_embeddings": False}
MHA3 = dict(LLAMA, num_key_value_heads=4, num_hidden_layers=3)
GPT2_TIED = {"model_type": "gpt2", "n_embd": 128, "n_layer": 2, "n_head": 4, "n_positions": 64, "vocab_size": V,
             "attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0}
TINY = {"model_type": "gpt2", "n_embd": 128, "n_layer": 2, "n_head": 4, "n_positions": 128, "vocab_size": 2048,
        "tie_word_embeddings": False}

CASES = {  # name: (model factory, config, optimizer factory, estimator's optimizer, dtype, precision, batch, seq)
    "llama_gqa_adam": (lambda: Llama(LLAMA), LLAMA, lambda p: torch.optim.Adam(p), "adam", torch.float32, "fp32",
                       4, 64),
    "llama_mha_sgd": (lambda: Llama(MHA3), MHA3, lambda p: torch.optim.SGD(p, lr=0.1), "sgd", torch.float32,
                      "fp32", 4, 64),
    "gpt2_tied_adafactor": (lambda: GPT2(V, 128, 2, 4, 64), GPT2_TIED, lambda p: torch.optim.Adafactor(p),
                            "adafactor", torch.float32, "fp32", 4, 64),
    "tinygpt_momentum": (lambda: TinyGPT(2048, 128, 2, 4, 128), TINY,
                         lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9), "sgd-momentum", torch.float32, "fp32",
                         4, 128),
    "llama_bf16_adamw": (lambda: Llama(LLAMA), LLAMA, lambda p: torch.optim.AdamW(p), "adamw", torch.bfloat16,
                         "bf16", 4, 64),
}


@pytest.fixture(scope="module")
def recordings(tmp_path_factory):
    out = {}
    folder = tmp_path_factory.mktemp("estimate")
    for name, (make, cfg, make_opt, _, dtype, _, batch, seq) in CASES.items():
        torch.manual_seed(0)
        model = make().to(dtype)
        opt = make_opt(model.parameters())
        vocab = cfg["vocab_size"]
        gen = torch.Generator().manual_seed(1)

        def step():
            tok = torch.randint(vocab, (batch, seq + 1), generator=gen)
            loss = F.cross_entropy(model(tok[:, :-1]).float().reshape(-1, vocab), tok[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        path = tracekit.record_steps(step, steps=1, warmup=1, path=str(folder / f"{name}.pickle"),
                                     model=model, optimizer=opt, backend="cpu")
        out[name] = load(path, use_cache=False)
    return out


@pytest.mark.parametrize("name", list(CASES))
def test_predicted_within_tolerance(recordings, name):
    _, cfg, _, kind, _, precision, batch, seq = CASES[name]
    trace = recordings[name]
    measured = measured_max(trace, trace.devices[0])
    predicted = estimate(from_hf_config(cfg), Setup(precision=precision, optimizer=kind, batch=batch, seq=seq)).per_gpu
    for cat in ("parameter", "gradient", "optimizer_state"):
        assert abs(measured[cat] - predicted[cat]) <= 0.01 * max(predicted[cat], 1), (cat, measured, predicted)
    assert predicted["activation"] > 0
    assert abs(measured["activation"] - predicted["activation"]) <= 0.15 * predicted["activation"]


def test_recorder_stores_what_the_estimate_needs(recordings):
    model = recordings["llama_bf16_adamw"].recorder["model"]
    assert model["input_shape"] == [4, 64]
    assert model["dtypes"] == {"bfloat16": model["parameters"]}
    assert model["trainable_parameter_bytes"] == 2 * model["parameters"]
    opt = recordings["tinygpt_momentum"].recorder["optimizer"]
    assert opt["defaults"]["momentum"] == 0.9


def test_report_estimate_from_recording_alone(recordings):
    trace = recordings["tinygpt_momentum"]
    dev = build_report(trace)["devices"][0]
    e = dev["estimate"]
    rows = {r["category"]: r for r in e["categories"]}
    assert e["setup"]["optimizer"] == "sgd-momentum" and e["setup"]["batch"] == 4
    model = trace.recorder["model"]
    assert rows["parameter"]["predicted"] == model["parameter_bytes"]
    assert rows["optimizer_state"]["predicted"] == model["trainable_parameter_bytes"]
    assert rows["activation"]["predicted"] == 0  # no shape in the file: no activation prediction, said so
    assert any("--estimate-config" in a for a in e["assumptions"])


def test_report_estimate_config_itemizes_the_gap(recordings, tmp_path):
    import json

    from tracekit.cli import main

    trace = recordings["gpt2_tied_adafactor"]
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(GPT2_TIED))
    spec = {"shape": from_hf_config(GPT2_TIED), "overrides": {}}
    dev = build_report(trace, estimate=spec)["devices"][0]
    e = dev["estimate"]
    # the gap at the peak, category by category, adds up to peak allocated - predicted total (CPU: nothing reserved)
    assert sum(g["bytes"] for g in e["gap_at_peak"]) == e["peak_difference"]
    assert sum(dev["categories_at_peak"].values()) == dev["peak_allocated_bytes"]
    rows = {r["category"]: r for r in e["categories"]}
    assert abs(rows["activation"]["difference"]) <= 0.15 * rows["activation"]["predicted"]
    # the same through the CLI, text and JSON
    assert main(["report", trace.path, "--estimate-config", str(cfg), "--no-cache"]) in (0, None)
    assert main(["report", trace.path, "--estimate-config", "gpt2", "--seq", "64", "--json", "--no-cache"]) in (0, None)
