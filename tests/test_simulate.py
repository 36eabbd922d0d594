"""`tracekit estimate --simulate`: a training step on fake tensors against the H100 recordings of the same steps.

Independent truth: tests/fixtures/cuda/truth.json (torch.cuda.max_memory_allocated measured on an H100), the
recorded request streams themselves (what is live at their peak, line by line), the published parameter counts
of public configs (tests/fixtures/configs), and the model's own parameter count.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

import tracekit  # noqa: E402
from tracekit.analysis.estimate import simulate as sim  # noqa: E402
from tracekit.analysis.replay import replay  # noqa: E402
from tracekit.io import to_trace  # noqa: E402
from tracekit.simulate import kernels as ck  # noqa: E402
from tracekit.simulate.workload import SimulationError, Workload, simulate  # noqa: E402
from tracekit.simulate.hf_model import exact_count  # noqa: E402

CUDA = Path(__file__).parent / "fixtures" / "cuda"
CONFIGS = Path(__file__).parent / "fixtures" / "configs"
TRUTH = json.loads((CUDA / "truth.json").read_text())["files"]
TRAINING = [name for name, t in TRUTH.items() if t.get("optimizer") == "adamw"]


def run(config, **kw) -> tuple:
    snap = simulate(Workload(config=config, **kw))
    return snap, to_trace(snap, "<simulated>")


@pytest.fixture(scope="module")
def fixture_runs():
    """Each H100 training workload of truth.json, simulated once for the module."""
    out = {}
    for name in TRAINING:
        t = TRUTH[name]
        out[name] = run(t["config"], batch=t["batch"], seq=t["seq"], precision="amp", optimizer="adamw")
    return out


# -- the target: max_memory_allocated within 3% -----------------------------------------------------------------

@pytest.mark.parametrize("name", TRAINING)
def test_peak_matches_the_h100(fixture_runs, name):
    _, trace = fixture_runs[name]
    peak = sim.simulated_peak(trace)
    measured = TRUTH[name]["max_allocated"]
    assert abs(peak.peak_allocated_bytes - measured) <= 0.03 * measured, (peak.peak_allocated_bytes, measured)
    assert peak.phase == "backward" and peak.iteration == 1
    # reserved: the stream served by the caching-allocator model from an empty allocator (analysis/allocator)
    reserved = TRUTH[name]["max_reserved"]
    assert abs(peak.peak_reserved_bytes - reserved) <= 0.03 * reserved, (peak.peak_reserved_bytes, reserved)
    assert "caching-allocator model" in peak.how["peak_reserved_bytes"]


@pytest.mark.parametrize("name", TRAINING)
def test_what_is_live_at_the_peak_is_the_recorded_set(fixture_runs, name):
    """The requests live at the recorded peak (its pre-trace blocks at their requested size, plus the traced ones)
    are the simulated ones, line by line: the same stream, not a fitted total."""
    _, trace = fixture_runs[name]
    recorded = tracekit.load(CUDA / name)
    c = sim.compare(trace, recorded)
    assert abs(c["requested_difference_bytes"]) <= 0.002 * c["recorded"]["peak_requested_bytes"], c["itemized"]

    def by_function(groups):  # line numbers move between transformers versions (5.17 recorded, this one here)
        out = {}
        for g in groups:
            key = tuple(g["key"][:2])
            out[key] = out.get(key, 0) + g["bytes"]
        return out
    simulated = by_function(sim.simulated_peak(trace, lines=1000).lines_at_peak)
    rec = by_function(sim.recorded_peak(recorded)["lines_at_peak"])
    big = {k: v for k, v in rec.items() if v >= 4 << 20 and "step" not in k}
    assert len(big) >= 4
    for key, nbytes in big.items():  # every large function at the recorded peak, within 1%
        assert abs(simulated.get(key, 0) - nbytes) <= 0.01 * nbytes, (key, simulated.get(key), nbytes)


@pytest.mark.parametrize("name", TRAINING)
def test_categories_at_the_peak_against_memtracker(fixture_runs, name):
    """torch's MemTracker (truth.json) sees the same tensors at its peak: parameters, optimizer state, the
    activations (autocast's saved weight copies included) and the loss's temporaries."""
    _, trace = fixture_runs[name]
    peak = sim.simulated_peak(trace, lines=100000)
    cats = peak.categories_at_peak
    mt = TRUTH[name]["memtracker_at_peak"]
    # the categories are in the allocator's blocks, MemTracker's in tensor bytes: a block is never smaller than the
    # tensor it holds, and larger by at most the allocator's rounding (512 B, or an unsplit remainder of <= 1 MiB)
    for c in ("parameter", "optimizer_state"):
        blocks = sum(g["count"] for g in peak.lines_at_peak if g["category"] == c)
        assert 0 <= cats[c] - mt[c] <= blocks * (1 << 20), (c, cats[c], mt[c], blocks)
    assert abs(cats["activation"] - mt["activation"]) <= 0.02 * mt["activation"]
    assert abs(cats["temporary"] - mt["temporary"]) <= 0.01 * mt["temporary"]
    assert cats.get("gradient", 0) == mt["gradient"] == 0  # zero_grad(set_to_none=True) freed them


# -- the stream is a recording's ----------------------------------------------------------------------------------

def test_stream_is_a_faithful_snapshot(fixture_runs):
    name = TRAINING[0]
    snap, trace = fixture_runs[name]
    rep = replay(trace)[0]
    assert rep.invariant.checked and rep.invariant.ok
    entries = snap["device_traces"][0]
    allocs = [e for e in entries if e["action"] == "alloc"]
    assert all(e["frames"] and e["size"] > 0 and e["stream"] == 0 for e in allocs)
    assert {e["category"] for e in allocs} <= {"parameter", "gradient", "optimizer_state", "activation", "temporary",
                                                "input", "workspace", "other"}
    phases = {(p["iteration"], p["phase"]) for p in snap["tracekit"]["phases"]}
    assert phases == {(i, p) for i in (0, 1) for p in ("forward", "backward", "optimizer")}
    assert any(e["user_metadata"] == "tracekit:iter=1:phase=backward" for e in allocs)
    # every free follows its alloc, once
    live = set()
    for e in entries:
        if e["action"] == "alloc":
            assert e["addr"] not in live
            live.add(e["addr"])
        elif e["action"] == "free_completed":
            live.remove(e["addr"])
    # the optimizer's step counters stay on the host in a CUDA run: none of AdamW's 4-byte scalars is in the stream
    opt = [e for e in allocs if e["user_metadata"].endswith("phase=optimizer") and e["size"] == 4]
    assert opt == []


def test_model_states_match_the_models_own_count(fixture_runs):
    """Parameters (+ buffers) at setup, gradients after backward, AdamW's two states: from the model's own count."""
    name = TRAINING[0]
    snap, trace = fixture_runs[name]
    t = TRUTH[name]
    tags = snap["tracekit"]["tags"]
    # an allocation is (address, time): the allocator model reuses a freed block's address, as CUDA's does
    params = {(x["addr"], x["time_us"]): x["size"] for x in tags if x["kind"] == "parameter"}
    assert sum(params.values()) == t["param_bytes"] == 4 * snap["tracekit"]["simulated"]["params"]
    grads = {(x["addr"], x["time_us"]): x["size"] for x in tags if x["kind"] == "gradient"}
    states = {(x["addr"], x["time_us"]): x["size"] for x in tags if x["kind"] == "optimizer_state"}
    assert sum(states.values()) == 2 * t["param_bytes"]
    # one gradient per parameter per step (2 steps); each as large as its parameter
    assert sum(grads.values()) == 2 * t["param_bytes"]


def test_workspaces_follow_the_gpu():
    """cuBLAS: one workspace per thread's handle (forward thread, autograd thread), 32 MiB on sm90, 8 MiB + 128 KiB on
    sm80 (CublasHandlePool.cpp); cuBLASLt's 1 MiB for addmm with a bias on the forward thread."""
    assert ck.cublas_workspace_bytes((9, 0)) == 32 << 20
    assert ck.cublas_workspace_bytes((8, 0)) == (8 << 20) + (128 << 10)
    cfg = dict(TRUTH[TRAINING[0]]["config"], num_hidden_layers=1)
    for sm, ws in (((9, 0), 32 << 20), ((8, 0), (8 << 20) + (128 << 10))):
        snap, _ = run(cfg, batch=1, seq=16, precision="amp", sm=sm)
        frames = [e for e in snap["device_traces"][0] if e["action"] == "alloc"
                  and "Workspace" in e["frames"][0]["name"]]
        sizes = sorted(e["size"] for e in frames)
        assert sizes == sorted([ws, ws, ck.CUBLASLT_WORKSPACE_BYTES])


# -- CUDA's choices, as facts -----------------------------------------------------------------------------------

def test_autocast_policy_covers_cudas_op_list():
    """Every op with an AutocastCUDA kernel in this torch has a policy here (autocast_mode.h), and nothing more."""
    registered = {n[len("aten::"):] for n in ck.registered_ops("AutocastCUDA")}
    policy = {n for n in ck.cuda_policy() if ck._overload(n) is not None}
    assert registered == policy


def _qkv(b, h, s, d, dtype, kv_heads=None, grad=True):
    from torch._subclasses.fake_tensor import FakeTensorMode
    with FakeTensorMode():
        q = torch.empty(b, h, s, d, dtype=dtype, requires_grad=grad)
        k = torch.empty(b, kv_heads or h, s, d, dtype=dtype, requires_grad=grad)
    return q, k, k


@pytest.mark.parametrize("sm,dtype,dropout,mask,backend", [
    ((9, 0), torch.bfloat16, 0.0, False, ck.CUDNN),  # cuDNN first on sm90 (check_prefer_cudnn_attention)
    ((9, 0), torch.bfloat16, 0.1, False, ck.FLASH),  # cuDNN takes dropout in steps of 1/16 only
    ((9, 0), torch.float32, 0.0, False, ck.EFFICIENT),  # flash and cuDNN are 16-bit only
    ((8, 0), torch.bfloat16, 0.0, False, ck.FLASH),  # flash first elsewhere
    ((8, 0), torch.bfloat16, 0.0, True, ck.EFFICIENT),  # flash takes no mask
    ((7, 5), torch.float16, 0.0, False, ck.EFFICIENT),  # flash needs sm80
    ((7, 5), torch.bfloat16, 0.0, False, ck.MATH),  # before sm80 the efficient kernel has no bf16
])
def test_sdpa_backend(sm, dtype, dropout, mask, backend):
    q, k, v = _qkv(2, 8, 64, 64, dtype)
    m = q.new_empty((64, 64), dtype=torch.bool) if mask else None
    assert ck.select_backend(sm, q, k, v, m, dropout, not mask, False) == backend


def test_gqa_needs_enable_gqa():
    q, k, v = _qkv(2, 8, 64, 64, torch.bfloat16, kv_heads=2)
    assert ck.select_backend((9, 0), q, k, v, None, 0.0, True, True) == ck.CUDNN
    assert ck.select_backend((9, 0), q, k, v, None, 0.0, True, False) == ck.MATH


# -- exact parameter counts ------------------------------------------------------------------------------------------

PUBLISHED = {k: v for k, v in json.loads((CONFIGS / "published.json").read_text()).items() if not k.startswith("_")}
EXACT = sorted(k for k, v in PUBLISHED.items() if v["counts"] != "nominal")


@pytest.mark.parametrize("name", EXACT)
def test_published_parameter_counts(name):
    """The meta-device build counts what the model card publishes (a checkpoint that stores a tied output layer
    a second time publishes vocab x hidden more than the modules hold)."""
    cfg = json.loads((CONFIGS / f"{name}.json").read_text())
    got = exact_count(cfg)
    pub = PUBLISHED[name]
    extra = 0
    if pub["counts"] == "stored":
        extra = cfg["vocab_size"] * cfg.get("hidden_size", cfg.get("n_embd", 0))
    assert got["params"] + extra == pub["params"]
    assert got["path"].startswith("meta-device build")


@pytest.mark.parametrize("name", TRAINING)
def test_fixture_parameter_counts(name):
    assert exact_count(TRUTH[name]["config"])["params"] == TRUTH[name]["params"]


# -- other workloads: checkpointing, fp32, GPT-2 -----------------------------------------------------------------

def test_checkpointing_keeps_only_layer_inputs():
    cfg = TRUTH[TRAINING[0]]["config"]
    plain = sim.simulated_peak(run(cfg, batch=4, seq=256, precision="amp")[1])
    ckpt = sim.simulated_peak(run(cfg, batch=4, seq=256, precision="amp", checkpointing="full")[1])
    assert ckpt.peak_allocated_bytes < plain.peak_allocated_bytes
    layers, hidden = cfg["num_hidden_layers"], cfg["hidden_size"]
    # what the per-layer activations were, less what checkpointing keeps of them (each layer's fp32 input)
    saved = plain.categories_at_peak["activation"] - ckpt.categories_at_peak["activation"]
    assert saved > 0 and ckpt.categories_at_peak["activation"] >= layers * 4 * 256 * hidden * 4


def test_gpt2_tied_head_fp32():
    cfg = json.loads((CONFIGS / "gpt2.json").read_text())
    snap, trace = run(cfg, batch=1, seq=64, precision="fp32")
    p = sim.simulated_peak(trace)
    sizes = [x["size"] for x in snap["tracekit"]["tags"] if x["kind"] == "parameter"]
    assert sum(sizes) == 4 * 124_439_808  # the head is the embedding, as in the real model
    assert p.categories_at_peak["optimizer_state"] == 2 * int(sim.block_sizes(sizes).sum())  # AdamW's two states
    assert snap["tracekit"]["simulated"]["sdpa_backends"] == {ck.EFFICIENT: 12}  # fp32 on sm90


# -- bad input -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("config,says", [
    ({"model_type": "no-such-model", "hidden_size": 8}, "unknown model_type"),
    ({"hidden_size": 8}, "no model_type"),
    ({"model_type": "llama", "hidden_size": 10, "num_attention_heads": 3, "num_hidden_layers": 1,
      "vocab_size": 10, "intermediate_size": 8}, "cannot"),
    ({"model_type": "llama", "auto_map": {"AutoModel": "x.Y"}}, "remote code"),
])
def test_bad_configs_say_one_line(config, says):
    with pytest.raises(tracekit.errors.TracekitError) as e:
        simulate(Workload(config=config, batch=1, seq=8))
    assert says in str(e.value) and "\n" not in str(e.value)


def test_an_operator_without_fake_kernel_is_one_line(monkeypatch):
    from torch._subclasses.fake_tensor import UnsupportedOperatorException

    from tracekit.simulate import hf_step as fake_step

    def boom(self, i):
        raise UnsupportedOperatorException(torch.ops.aten.nonzero.default)
    monkeypatch.setattr(fake_step.TrainingStep, "step", boom)
    with pytest.raises(SimulationError) as e:
        simulate(Workload(config=dict(TRUTH[TRAINING[0]]["config"], num_hidden_layers=1), batch=1, seq=8))
    assert "no fake implementation" in str(e.value) and "formulas" in str(e.value)


# -- largest batch by bisection ----------------------------------------------------------------------------------

@pytest.mark.parametrize("peak", [lambda n: 1000 + 37 * n, lambda n: 500 + 3 * n * n, lambda n: 10_000 + n])
@pytest.mark.parametrize("budget", [999, 1037, 5_000, 123_456])
def test_largest_fitting_is_exact(peak, budget):
    got = sim.largest_fitting(peak, budget, start=4, limit=1 << 12)
    brute = max((n for n in range(1, (1 << 12) + 1) if peak(n) <= budget), default=None)
    assert got["largest"] == brute
    if brute is not None and brute < (1 << 12):
        runs = {t["value"]: t["fits"] for t in got["tries"]}
        assert runs[brute] and not runs[brute + 1]  # both sides of the answer were simulated
    assert len(got["tries"]) <= 2 * np.log2(1 << 12) + 4


def test_cuda_autocast_policy_on_fake_cpu_tensors():
    """What torch.autocast("cuda", bfloat16) does, on fake CPU tensors: matmuls in bf16, softmax to fp32 (its dtype
    argument set, positionally or not), weights cast once per region from a cache cleared at the region's end, and
    none of CPU autocast's own choices (CPU promotes cat; CUDA does not)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    casts = []
    ac = ck.CudaAutocast(on_cast=lambda on, weight: casts.append(weight) if on else None)
    with ac.installed(), FakeTensorMode():
        w = torch.nn.Parameter(torch.empty(8, 8))
        x = torch.empty(4, 8)
        with ac.region(torch.bfloat16):
            y = torch.nn.functional.linear(x, w)
            y2 = torch.nn.functional.linear(x, w)
            assert y.dtype == y2.dtype == torch.bfloat16
            assert len(ac.cache) == 1 and casts.count(True) == 1  # the weight once, the input twice
            assert torch.softmax(y, -1).dtype == torch.float32
            assert torch.ops.aten.softmax.int(y, -1, None).dtype == torch.float32
            assert torch.cat([y, x]).dtype == torch.float32  # plain type promotion, no autocast cast
            assert torch.is_autocast_enabled("cuda")
        assert ac.cache == {} and not torch.is_autocast_enabled("cuda")
        assert torch.nn.functional.linear(x, w).dtype == torch.float32  # outside the region


def test_the_analysis_side_needs_no_torch():
    """analysis/ never imports torch: the simulated stream's figures, the comparison and the GPU table are plain replay."""
    import subprocess
    import sys
    code = ("import sys; import tracekit.analysis.estimate.simulate, tracekit.analysis.estimate.gpus, "
            "tracekit.render.simulate, tracekit.commands.estimate; "
            "bad = [m for m in ('torch', 'transformers') if m in sys.modules]; print(bad); sys.exit(bool(bad))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
