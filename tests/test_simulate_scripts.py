"""`tracekit simulate -- python SCRIPT`: our own scripts (tests/simulate_scripts/) run unmodified as if torch.cuda had
the card. Every figure is checked against an independent computation: the model's own parameter count, the
allocator's 512-byte blocks, the script's own counters against `tracekit report` of its own dump, 1/N shards."""
from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

HERE = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(HERE, "simulate_scripts")
ROOT = os.path.dirname(HERE)
MiB = 1 << 20


def simulate(*args, cwd=None, expect=0):
    cmd = [sys.executable, "-m", "tracekit", "simulate", *args]
    r = subprocess.run(cmd, cwd=cwd or SCRIPTS, capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=ROOT, HF_HUB_OFFLINE="1"))
    assert r.returncode == expect, (r.returncode, r.stdout[-2000:], r.stderr[-3000:])
    res = [json.loads(line[7:]) for line in r.stdout.splitlines() if line.startswith("RESULT ")]
    return (res[-1] if res else None), r


def blocks(nbytes):
    return (nbytes + 511) // 512 * 512


def report_json(path):
    r = subprocess.run([sys.executable, "-m", "tracekit", "report", "--json", "--no-cache", path], capture_output=True,
                       text=True, timeout=300, env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_plain_training_loop_answers_as_the_card(tmp_path):
    dump = str(tmp_path / "dump.pickle")
    res, r = simulate("--gpu", "A100-40GB", "-o", str(tmp_path / "run.pickle"), "--", "python", "train_mlp.py",
                      "--dump", dump)
    # torch.cuda answers as the card
    assert res["name"] == "NVIDIA A100-SXM4-40GB" and res["total"] == 40960 * MiB
    assert res["device"] == "cuda:0" and res["is_cuda"] is True
    # the model on the device: each parameter one block of the caching allocator (512-byte multiples)
    import torch  # noqa: F401 - the parameter shapes, counted here from the script's own definition
    shapes = [(512 * 4, 512), (512 * 4,), (512, 512 * 4), (512,)] * 4 + [(10, 512), (10,)]
    import math
    assert res["param_bytes"] == sum(4 * math.prod(s) for s in shapes)
    assert res["after_model"] == sum(blocks(4 * math.prod(s)) for s in shapes)
    # AdamW's two moments per parameter
    assert res["state_bytes"] == 2 * res["param_bytes"]
    assert res["stats_peak"] == res["max_allocated"] and res["max_reserved"] >= res["max_allocated"]
    # a no_grad forward keeps only its output
    assert res["no_grad_delta"] == blocks(res["probe_bytes"])
    assert "read as 0.0" in r.stderr and "train_mlp.py" in r.stderr  # the loss's placeholder, said once with its line
    # the script's own dump is a PyTorch snapshot: tracekit's report of it gives the script's own counter
    snap = pickle.load(open(dump, "rb"))
    assert {"segments", "device_traces"} <= set(snap) and snap["device_traces"][0]
    assert all("tracekit" not in str(e.get("user_metadata")) for e in snap["device_traces"][0])
    rep = report_json(dump)["devices"][0]
    assert rep["peak_allocated_block_bytes"] == res["max_allocated"]
    # -o: the whole run as tracekit record writes it, with tags: parameters and AdamW state by the model's count
    run = pickle.load(open(tmp_path / "run.pickle", "rb"))
    tags = run["tracekit"]["tags"]
    params = {(t["addr"], t["time_us"]): t["size"] for t in tags if t["kind"] == "parameter"}
    assert sum(params.values()) == res["param_bytes"]
    states = {(t["addr"], t["time_us"]): t["size"] for t in tags if t["kind"] == "optimizer_state"}
    assert sum(states.values()) == 2 * res["param_bytes"]
    assert [i["iteration"] for i in run["tracekit"]["iterations"]] == [0, 1]
    rep = report_json(str(tmp_path / "run.pickle"))["devices"][0]
    assert rep["peak_allocated_block_bytes"] == res["max_allocated"]


def test_autocast_gradscaler_checkpointing_and_accumulation():
    base, _ = simulate("--", "python", "train_mlp.py", "--amp", "bf16")
    ck, _ = simulate("--", "python", "train_mlp.py", "--amp", "bf16", "--ckpt", "nonreentrant")
    # checkpointing keeps one block's input instead of its activations: a smaller peak, the same state
    assert ck["max_allocated"] < base["max_allocated"] and ck["state_bytes"] == base["state_bytes"]
    # fp16 + GradScaler: the step is not skipped (found_inf reads as 0), SGD keeps no state
    res, r = simulate("--", "python", "train_mlp.py", "--amp", "fp16", "--opt", "sgd", "--accum", "2",
                      "--set-to-none", "0")
    assert res["state_bytes"] == 0
    # grads kept (zero_grad(set_to_none=False)): parameters + gradients + the cuBLAS workspaces stay allocated
    assert res["allocated"] >= 2 * res["param_bytes"]


def test_out_of_memory_raises_pytorchs_error_and_runs_the_observers():
    res, _ = simulate("--gpu", "T4", "--", "python", "oom.py")
    total = 15360 * MiB
    assert res["total"] == total
    usable = total - 512 * MiB  # the CUDA context's share (gpus.py)
    assert res["chunks"] == usable // (1 << 30)
    assert res["message"].startswith("CUDA out of memory. Tried to allocate 1024.00 MiB. GPU 0 has a total capacity")
    assert res["observer"] == {"alloc": 1 << 30}
    _, r = simulate("--gpu", "T4", "--", "python", "oom.py", "--uncaught", expect=1)
    assert "torch.OutOfMemoryError: CUDA out of memory" in r.stderr and "1 out-of-memory error" in r.stderr


def test_streams_have_pools_of_their_own():
    res, _ = simulate("--", "python", "streams.py")
    # 3 MiB on the default stream, freed: its 20 MiB segment is cached; the side stream needs a segment of its own
    assert res == {"reserved": 40 * MiB, "allocated": 3 * MiB}


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generation_runs_to_max_new_tokens(cache):
    res, r = simulate("--", "python", "generate_hf.py", cache)
    assert res["tokens"] == 32 + 16
    assert "generation runs to max_new_tokens" in r.stderr


def test_fsdp2_rank_holds_its_shard():
    for world, rank in ((2, 0), (4, 3)):
        res, r = simulate("--world-size", str(world), "--rank", str(rank), "--", "python", "fsdp2_train.py")
        assert (res["rank"], res["world"], res["device"]) == (rank, world, rank)
        assert res["local_bytes"] * world == res["full_bytes"]  # 4P/N in fp32
        assert res["state_bytes"] == 2 * res["local_bytes"]  # AdamW: 8P/N
        assert f"cuda:{rank}" in r.stderr and "fake process group" in r.stderr


# small Llama-style configs where different moments of FSDP2's step hold the peak: a layer's backward (wide layers,
# small vocabulary, untied) and the loss's backward (tied embeddings, bf16 mixed precision, layers kept unsharded)
FSDP_LLAMA = {"model_type": "llama", "hidden_size": 1024, "intermediate_size": 4096, "num_hidden_layers": 4,
              "num_attention_heads": 16, "num_key_value_heads": 4, "head_dim": 64, "vocab_size": 4096,
              "tie_word_embeddings": False, "rms_norm_eps": 1e-5, "max_position_embeddings": 2048}


@pytest.mark.slow
@pytest.mark.parametrize("cfg,batch,seq,script,flags,moment", [
    ({}, 1, 128, [], ["--precision", "fp32"], "layer 2 backward, end"),
    ({"hidden_size": 512, "intermediate_size": 1536, "num_attention_heads": 8, "num_key_value_heads": 2,
      "vocab_size": 32000, "tie_word_embeddings": True}, 2, 256, ["--mp", "bf16", "--no-reshard"],
     ["--precision", "mixed", "--no-reshard-after-forward"], "loss backward"),
])
def test_fsdp2_estimate_agrees_with_the_simulation(tmp_path, cfg, batch, seq, script, flags, moment):
    """`estimate --fsdp 8` (FSDP2's step moment by moment) within 3% of the simulated rank 0's peak."""
    from click.testing import CliRunner

    from tracekit.cli import cli as main

    path = tmp_path / "config.json"
    path.write_text(json.dumps({**FSDP_LLAMA, **cfg}))
    res, _ = simulate("--world-size", "8", "--", "python", "fsdp2_llama.py", str(path), str(batch), str(seq), *script)
    out = CliRunner().invoke(main, ["estimate", "--config", str(path), "--fsdp", "8", "--batch", str(batch), "--seq",
                                    str(seq), "--loss-only", "--json", *flags])  # the script keeps only the loss
    assert out.exit_code == 0, out.output
    got = json.loads(out.output)
    assert got["peak_moment"] == moment
    assert abs(got["per_gpu"]["total"] - res["max_allocated"]) <= 0.03 * res["max_allocated"], (got["per_gpu"], res)


def test_ddp_buckets_and_bucket_views():
    plain, _ = simulate("--world-size", "2", "--", "python", "ddp_train.py")
    view, _ = simulate("--world-size", "2", "--", "python", "ddp_train.py", "--view")
    # gradient_as_bucket_view saves one copy of the gradients (= the parameters' bytes, here in 512 B blocks)
    assert plain["allocated"] - view["allocated"] == pytest.approx(plain["param_bytes"], rel=0.001)


def test_moe_and_lora_run():
    res, r = simulate("--", "python", "moe.py")
    assert res["max_allocated"] > 0 and "tokens spread evenly over the experts" in r.stderr
    pytest.importorskip("peft")
    res, _ = simulate("--", "python", "lora.py")
    # LoRA r=8 on q_proj and v_proj (256 -> 256) of 2 layers: (256*8 + 8*256) * 2 * 2 trainable; AdamW 2 x 4 B each
    assert res["trainable"] == (256 * 8 + 8 * 256) * 2 * 2
    assert res["state_bytes"] == 8 * res["trainable"]


def test_weights_from_disk_become_device_tensors(tmp_path):
    make = ("import torch, transformers, sys\n"
            "cfg = transformers.Qwen2Config(hidden_size=64, intermediate_size=128, num_hidden_layers=2, "
            "num_attention_heads=4, num_key_value_heads=2, vocab_size=500)\n"
            "m = transformers.Qwen2ForCausalLM(cfg); m.save_pretrained(sys.argv[1] + '/tiny')\n"
            "torch.save(m.state_dict(), sys.argv[1] + '/sd.pt')\n")
    subprocess.run([sys.executable, "-c", make, str(tmp_path)], check=True, capture_output=True, timeout=300)
    res, _ = simulate("--", "python", "load_weights.py", str(tmp_path))
    assert res["dev"] == "cuda:0" and res["sd_cuda"] is True
    # every tensor read becomes one block of the same bytes on the card
    assert res["torch_load"] == res["sd_blocks"] and res["safetensors"] == res["st_blocks"] > 0


def test_qlora_from_pretrained_with_a_device_map(tmp_path):
    """QLoRA as written for a GPU: from_pretrained of a local folder with a BitsAndBytesConfig and device_map (0,
    "auto"), peft's k-bit preparation, LoRA, AdamW. The weights land on the card packed: 4-bit two per byte, 8-bit
    one byte each plus a float per row, beside the 16-bit embeddings and norms, counted here from the config."""
    pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    make = ("import torch, transformers, sys\n"
            "cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, "
            "num_attention_heads=4, num_key_value_heads=4, vocab_size=1000, max_position_embeddings=256)\n"
            "transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(sys.argv[1])\n")
    subprocess.run([sys.executable, "-c", make, str(tmp_path / "tiny")], check=True, capture_output=True, timeout=300)
    H, I, L, V = 256, 512, 2, 1000
    linear = L * (4 * H * H + 3 * I * H)  # q, k, v, o and the MLP's three: quantized
    rows = L * (4 * H + 2 * I + H)  # their output features
    rest = 2 * blocks(2 * V * H) + (2 * L + 1) * blocks(2 * H)  # embeddings, lm_head, norms: bf16, not quantized
    lora = L * 4 * (H * 8 + 8 * H)
    res4, r = simulate("--", "python", "qlora.py", str(tmp_path / "tiny"))
    assert res4["weight"] == ["Params4bit", "torch.uint8", [H * H // 2, 1], "cuda:0"]
    # packed weights, then bitsandbytes' quantization state (absmax per 64, double-quantized): a few percent
    assert rest + linear // 2 < res4["after_load"] < rest + linear // 2 * 1.1
    assert res4["trainable"] == lora and res4["state_bytes"] == 8 * lora
    res8, _ = simulate("--", "python", "qlora.py", str(tmp_path / "tiny"), "--8bit", "--device-map", "auto")
    assert res8["weight"] == ["Int8Params", "torch.int8", [H, H], "cuda:0"]
    assert rest + linear + 4 * rows <= res8["after_load"] <= rest + linear + 4 * rows + 14 * 512
    assert res8["trainable"] == lora and res8["max_allocated"] > res8["after_load"]


def test_hf_trainer_runs_on_the_card():
    res, _ = simulate("--", "python", "trainer_hf.py")
    assert res["device"] == "cuda:0" and res["steps"] == 2 and res["max_allocated"] > 0


def test_an_op_without_a_fake_kernel_is_one_line(tmp_path):
    op = tmp_path / "op.py"
    op.write_text("import torch\n@torch.library.custom_op('tk_test::double', mutates_args=())\n"
                  "def double(x: torch.Tensor) -> torch.Tensor:\n    return x * 2\n"
                  "y = double(torch.ones(4, device='cuda'))\n")
    _, r = simulate("--", "python", str(op), cwd=str(tmp_path), expect=2)
    line = [x for x in r.stderr.splitlines() if "no fake kernel" in x]
    assert line and "tk_test.double" in line[0] and "op.py:5" in line[0] and "Traceback" not in r.stderr


def test_a_failing_script_fails_its_own_way(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("import torch\nx = torch.zeros(3, device='cuda')\nraise ValueError('mine')\n")
    _, r = simulate("--", "python", str(bad), cwd=str(tmp_path), expect=1)
    assert "ValueError: mine" in r.stderr and 'bad.py", line 3' in r.stderr
    ex = tmp_path / "exit.py"
    ex.write_text("import sys, torch\ntorch.ones(2, device='cuda')\nsys.exit(3)\n")
    simulate("--", "python", str(ex), cwd=str(tmp_path), expect=3)
    res, _ = simulate("--", "python", "-c", "import json, torch; print('RESULT ' + json.dumps("
                      "{'available': torch.cuda.is_available(), 'count': torch.cuda.device_count()}))", cwd=str(tmp_path))
    assert res == {"available": True, "count": 1}
    _, r = simulate("--", "notpython", "x.py", cwd=str(tmp_path), expect=2)
    assert r.stderr.count("\n") <= 2 and "Traceback" not in r.stderr


def test_a_checkout_on_the_path_answers_its_own_version(tmp_path):
    """A project run from its checkout (no `pip install -e .`) that asks importlib.metadata for its own version at
    import gets its pyproject.toml's version, and says so; a name that is nowhere still raises as it would."""
    (tmp_path / "pyproject.toml").write_text('[project]\nname = "My-Proj"\nversion = "1.2.3"\n')
    (tmp_path / "my_proj").mkdir()
    (tmp_path / "my_proj" / "__init__.py").write_text(
        "import importlib.metadata\n__version__ = importlib.metadata.version('my_proj')\n")
    (tmp_path / "run.py").write_text(
        "import importlib.metadata, json, torch, my_proj\n"
        "try:\n    importlib.metadata.version('no-such-dist-anywhere')\n    missing = False\n"
        "except importlib.metadata.PackageNotFoundError:\n    missing = True\n"
        "x = torch.ones(1024, device='cuda')\n"
        "print('RESULT ' + json.dumps({'v': my_proj.__version__, 'missing': missing,"
        " 'alloc': torch.cuda.memory_allocated()}))\n")
    res, r = simulate("--", "python", "run.py", cwd=str(tmp_path))
    assert res == {"v": "1.2.3", "missing": True, "alloc": 4096}
    assert "my_proj is the checkout on the path" in r.stderr


def test_estimate_simulate_runs_a_mixtral_under_amp(tmp_path):
    """estimate --simulate is one user of the same machinery: an MoE under bf16 autocast runs (grouped_mm takes fp32
    weights on CUDA; its meta kernel asks for bf16), no fallback to the formulas."""
    cfg = json.load(open(os.path.join(HERE, "fixtures", "configs", "mixtral-8x7b.json")))
    cfg.update(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    path = tmp_path / "mixtral_tiny.json"
    path.write_text(json.dumps(cfg))
    r = subprocess.run([sys.executable, "-m", "tracekit", "estimate", "--config", str(path), "--batch", "2", "--seq", "64",
                        "--precision", "amp", "--simulate", "--json"], capture_output=True, text=True, timeout=600,
                       env=dict(os.environ, PYTHONPATH=ROOT))
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["simulated"] is not None and "simulation_error" not in out
    sim = out["simulated"]
    assert sim["peak_allocated_bytes"] > 0 and sim["categories_at_peak"]["optimizer_state"] == \
        pytest.approx(8 * out["param_count"]["params"], rel=0.03)  # AdamW: two fp32 moments, in blocks
