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
from tests.estimate_models import GPT2, Llama, with_lora  # noqa: E402

V = 1024
LLAMA = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 352, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": V, "tie_word_embeddings": False,
         "_attn_implementation": "eager"}  # the plain-torch Llama computes attention eagerly
MHA3 = dict(LLAMA, num_key_value_heads=4, num_hidden_layers=3)
LORA = dict(LLAMA, num_hidden_layers=4)
# GPT-2's shapes with the GELU these plain-torch models call (F.gelu, tanh or exact), not GPT-2's gelu_new
GPT2_TIED = {"model_type": "gpt2", "n_embd": 128, "n_layer": 2, "n_head": 4, "n_positions": 64, "vocab_size": V,
             "attn_pdrop": 0.0, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "activation_function": "gelu_pytorch_tanh"}
TINY = {"model_type": "gpt2", "n_embd": 128, "n_layer": 2, "n_head": 4, "n_positions": 128, "vocab_size": 2048,
        "tie_word_embeddings": False, "activation_function": "gelu", "attn_pdrop": 0.0, "resid_pdrop": 0.0,
        "embd_pdrop": 0.0}

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
    "llama_lora_adamw": (lambda: with_lora(Llama(LORA), 8), LORA,
                         lambda p: torch.optim.AdamW([q for q in p if q.requires_grad]), "adamw", torch.float32,
                         "fp32", 4, 64),
    "llama_amp_adamw": (lambda: Llama(LLAMA), LLAMA, lambda p: torch.optim.AdamW(p), "adamw", torch.float32,
                        "amp", 4, 64),
}
SETUP = {"llama_lora_adamw": {"lora_rank": 8, "lora_targets": ("q_proj", "v_proj")}}
AUTOCAST = {"llama_amp_adamw"}  # forward and loss under torch.autocast("cpu", bfloat16)


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

        def step(autocast=name in AUTOCAST):
            tok = torch.randint(vocab, (batch, seq + 1), generator=gen)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
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
    setup = Setup(precision=precision, optimizer=kind, batch=batch, seq=seq, attention="eager", cublas_workspace=0,
                  loss_only=True, **SETUP.get(name, {}))  # the step keeps only the loss; CPU: no cuBLAS
    predicted = estimate(from_hf_config(cfg), setup).held("gpu")  # each category when held, as measured_max
    for cat in ("parameter", "gradient", "optimizer_state"):
        assert abs(measured[cat] - predicted[cat]) <= 0.01 * max(predicted[cat], 1), (cat, measured, predicted)
    assert predicted["activation"] > 0
    # what autograd saves, tensor by tensor (autocast included); LoRA's first layer keeps less (its input needs no
    # gradient), which the formula does not follow
    tolerance = 0.05 if "lora" in name else 0.01
    assert abs(measured["activation"] - predicted["activation"]) <= tolerance * predicted["activation"]


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


@pytest.fixture(scope="module")
def batches(tmp_path_factory):
    """The same Llama-style model and AdamW recorded at micro-batch 2, 6 and 12."""
    folder = tmp_path_factory.mktemp("whatif")
    out = {}
    for b in (2, 6, 12):
        torch.manual_seed(0)
        model = Llama(LLAMA)
        opt = torch.optim.AdamW(model.parameters())

        def step():
            tok = torch.randint(V, (b, 65))
            F.cross_entropy(model(tok[:, :-1]).reshape(-1, V), tok[:, 1:].reshape(-1)).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        out[b] = tracekit.record_steps(step, steps=1, warmup=1, path=str(folder / f"bs{b}.pickle"), model=model,
                                       optimizer=opt, backend="cpu")
    return out


def test_whatif_fit_predicts_a_third_recording(batches, capsys):
    import json

    from tracekit.analysis.replay import replay
    from tracekit.cli import main

    peak12 = replay(load(batches[12], use_cache=False))[0].peak_allocated
    main(["whatif", batches[2], batches[6], "--budget", f"{peak12}B", "--json", "--no-cache"])
    r = json.loads(capsys.readouterr().out)
    f = r["fit"]
    assert abs(f["fixed_bytes"] + 12 * f["per_unit_bytes"] - peak12) <= 0.02 * peak12
    assert r["largest_batch"] in (11, 12)
    # one recording alone: the slope from its categories agrees with the two-point slope
    main(["whatif", batches[6], "--budget", "1GiB", "--json", "--no-cache"])
    one = json.loads(capsys.readouterr().out)
    assert abs(one["fit"]["per_unit_bytes"] - f["per_unit_bytes"]) <= 0.1 * f["per_unit_bytes"]
    assert one["levers"] and one["levers_for"]["setup"]["seq"] == 64  # the file's config and batch shape
    # with the model's shape the levers are priced; halving the micro-batch saves what the fit says it should
    cfg = pytest.importorskip("json").dumps(LLAMA)
    path = str(batches[12]) + ".json"
    open(path, "w").write(cfg)
    # --loss-only: the recorded step keeps only the loss, not the logits
    main(["whatif", batches[12], "--budget", "1MiB", "--config", path, "--loss-only", "--json", "--no-cache"])
    lv = {x["lever"].split(":")[0]: x for x in json.loads(capsys.readouterr().out)["levers"]}
    # half the micro-batch's activations, less the gradients now held while the second micro-batch runs forward
    grads = load(batches[12], use_cache=False).recorder["model"]["trainable_parameter_bytes"]
    expected = 6 * f["per_unit_bytes"] - grads
    assert abs(lv["gradient accumulation"]["saves_bytes"] - expected) <= 0.05 * expected
    assert not any(x["fits"] for x in lv.values())


def test_whatif_bad_input(batches, capsys):
    from tracekit.cli import main

    for args in (["--budget", "lots"], ["--budget", "1GiB", "--sizes", "4,8"], ["--budget", "1GiB", "--sizes", "x"]):
        with pytest.raises(SystemExit) as e:
            main(["whatif", batches[2], *args])
        assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["whatif", batches[2], batches[2], "--budget", "1GiB", "--no-cache"])
    assert e.value.code == 2 and "two different sizes" in capsys.readouterr().err


def test_report_from_a_recorded_config(recordings):
    """A model with a Hugging Face-style `config`: the recorder stores it and the batch shape, so the report
    predicts activations with no flags."""
    trace = recordings["llama_gqa_adam"]
    assert trace.recorder["model"]["config"]["hidden_size"] == 128
    e = build_report(trace)["devices"][0]["estimate"]
    rows = {r["category"]: r for r in e["categories"]}
    assert (e["setup"]["batch"], e["setup"]["seq"], e["setup"]["optimizer"]) == (4, 64, "adam")
    assert "model shape from the recorded Hugging Face config" in e["notes"]
    for cat in ("parameter", "gradient", "optimizer_state"):
        assert abs(rows[cat]["difference"]) <= 0.01 * rows[cat]["predicted"]
    assert rows["activation"]["predicted"] and abs(rows["activation"]["difference"]) <= 0.15 * rows["activation"]["predicted"]


def test_whatif_levers_need_no_shape(recordings, capsys):
    """The levers are measured on the file (the report's advice computation), so a file without the model's
    shape still gets them, each saying what it assumed."""
    import json

    from tracekit.cli import main

    trace = recordings["tinygpt_momentum"]
    main(["whatif", trace.path, "--budget", "1GiB", "--json", "--no-cache"])
    r = json.loads(capsys.readouterr().out)
    assert r["points"][0]["size"] == 4  # the recorded micro-batch
    assert r["levers"] and all(lv["assumes"] and lv["evidence"]["rule"] for lv in r["levers"])
    at_peak = build_report(trace)["devices"][0]["categories_at_peak"]
    growing = sum(at_peak.get(c, 0) for c in ("activation", "input", "temporary", "kv_cache"))
    lv = {x["technique"]: x for x in r["levers"]}
    # half of what grows with the batch, less the gradients that accumulation keeps live between micro-batches
    # (the most the gradient category holds at any entry, from the timeline, minus what it holds at the peak)
    from tracekit.analysis.timeline import category_series

    most_grads = int(category_series(trace, 0).by_category["gradient"].max())
    held = most_grads - at_peak.get("gradient", 0)
    assert held > 0  # this loop's peak is early in backward, before the gradients exist
    assert lv["gradient accumulation"]["saves_bytes"] == int(growing / 2 - held)
    assert lv["gradient accumulation"]["lever"].startswith("gradient accumulation: micro-batch 2")
