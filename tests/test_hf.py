"""Hugging Face models as people record them (issue 22), on the CUDA fixtures recorded with torch's own API.

The truth is independent of tracekit: tests/fixtures/cuda/truth.json holds each model's config, torch's
MemTracker categories at its peak (a separate run of the same workload) and, for the generation, the
analytic KV-cache bytes; the module counts come from the configs (num_hidden_layers).
"""
import gzip
import json
import os
import re
import textwrap

import numpy as np
import pytest

from tracekit.analysis.categories import categorize, requested_sizes
from tracekit.analysis.frames import LIB, OP, USER, frame_kind, package_of, stack_roles
from tracekit.analysis.generation import kv_cache, workload
from tracekit.analysis.libraries import library_sites, node_op, op_matches
from tracekit.analysis.modtree import BY_FILE, BY_SOURCE, SHIFTED, stack_modules
from tracekit.analysis.phases import DECODE, PREFILL, phases
from tracekit.analysis.replay import replay
from tracekit.analysis.report import build_report
from tracekit.io import load
from tracekit.io.snapshot import snapshot_to_trace
from tracekit.io.unpickle import restricted_load
from tracekit.render import reporter

from .synth import MiB, Sim

CUDA = os.path.join(os.path.dirname(__file__), "fixtures", "cuda")
TRUTH = json.load(open(os.path.join(CUDA, "truth.json")))["files"]
TRAINING = sorted(k for k, v in TRUTH.items() if "memtracker_at_peak" in v)
GENERATION = sorted(k for k, v in TRUTH.items() if "kv_bytes_per_step" in v)


def _cuda(name):
    return load(os.path.join(CUDA, name))


def _report(name):
    return build_report(_cuda(name))


# -- packages and frames ----------------------------------------------------------------------------

@pytest.mark.parametrize("path,package,how", [
    ("/opt/conda/lib/python3.10/site-packages/transformers/models/gpt2/modeling_gpt2.py", "transformers",
     "site-packages"),
    ("C:\\Users\\me\\miniconda3\\Lib\\site-packages\\transformers\\models\\gpt2\\modeling_gpt2.py", "transformers",
     "site-packages"),
    ("/usr/lib/python3/dist-packages/peft/tuners/lora/layer.py", "peft", "site-packages"),
    ("/x/site-packages/flash_attn-2.5.0-py3.10-linux-x86_64.egg/flash_attn/flash_attn_interface.py", "flash_attn",
     "site-packages"),
    ("/opt/torch/.venv/lib/python3.12/site-packages/transformers/models/qwen2/modeling_qwen2.py", "transformers",
     "site-packages"),  # a venv under a folder named torch is not torch
    ("/home/me/transformers/src/transformers/models/llama/modeling_llama.py", "transformers",
     "known package in the path"),  # an editable install
    ("/home/me/code/vllm/vllm/worker/model_runner.py", "vllm", "known package in the path"),
    ("/home/me/transformers/examples/pytorch/run_clm.py", None, ""),  # the user's copy of an example script
    ("/home/me/peft/train.py", None, ""),
    ("/home/me/run/train.py", None, ""),
    ("", None, ""),
    ("memory_snapshot.cpp", None, ""),
])
def test_package_of_a_path_from_any_machine(path, package, how):
    assert package_of(path) == (package, how)


def test_frame_kinds_of_libraries_wherever_installed():
    venv = "/opt/torch/.venv/lib/python3.12/site-packages/"
    assert frame_kind(venv + "transformers/models/qwen2/modeling_qwen2.py", "forward", 249) == LIB
    assert frame_kind(venv + "torch/nn/modules/module.py", "_call_impl", 1790) == OP
    assert frame_kind("/home/me/transformers/src/transformers/models/llama/modeling_llama.py", "forward", 3) == LIB
    assert frame_kind("/home/user/run/train_hf.py", "step", 64) == USER


@pytest.mark.parametrize("node,op", [("NllLossBackward0", "nll_loss"), ("LogSoftmaxBackward0", "log_softmax"),
                                     ("ScaledDotProductCudnnAttentionBackward0", "scaled_dot_product_cudnn_attention"),
                                     ("MmBackward0", "mm"), ("ToCopyBackward0", "to_copy"), ("SiluBackward0", "silu")])
def test_an_autograd_node_names_its_forward_op(node, op):
    assert node_op(node) == op


def test_op_names_match_with_their_overloads_only():
    assert op_matches("nll_loss_forward", "nll_loss") and op_matches("_log_softmax", "log_softmax")
    assert op_matches("mul_Tensor", "mul") and op_matches("_to_copy", "to_copy")
    assert not op_matches("addmm", "add") and not op_matches("multiply", "mul") and not op_matches("mm", "addmm")


# -- library lines ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", TRAINING)
def test_library_lines_hold_the_activations_and_temporaries_at_the_peak(name):
    report = _report(name)
    dev = report["devices"][0]
    cats = dev["categories_at_peak"]
    rows = dev["library_sites_at_peak"]
    act = cats.get("activation", 0) + cats.get("temporary", 0)
    tied = sum(r["bytes"] for r in rows if r["library_frame"]["package"] == "transformers"
               and r["category"] in ("activation", "temporary"))
    assert tied >= 0.8 * act
    assert [r["bytes"] for r in rows] == sorted((r["bytes"] for r in rows), reverse=True)
    top = rows[0]
    model_type = TRUTH[name]["config"]["model_type"]
    assert re.search(rf"modeling_{model_type}\.py$", top["library_frame"]["filename"])
    assert set(top) >= {"bytes", "count", "library_frame", "user_frame", "category"}
    assert set(top["library_frame"]) >= {"filename", "line", "name", "package"}
    assert top["user_frame"]["filename"].endswith("train_hf.py")
    # the text report names that line
    text = reporter("report", "text").render(report)
    assert f"modeling_{model_type}.py:{top['library_frame']['line']} in forward (transformers)" in text


def test_backward_memory_takes_its_forward_ops_library_line():
    """The peak's two 125 MiB temporaries are made by autograd's engine (C++ frames only): the cross-entropy's
    backward; they take the loss line of the model and say how that was found."""
    trace = _cuda("qwen2_amp_adamw_b4_s256.pickle.gz")
    rep = replay(trace)[0]
    rows = library_sites(trace, 0, rep.allocations.live_at(rep.peak_index))
    bwd = [r for r in rows if r["pass"] == "backward"]
    assert bwd and bwd[0]["bytes"] == 2 * 125 * MiB
    assert bwd[0]["inner_frame"]["filename"].endswith("loss_utils.py")
    assert "autograd node" in bwd[0]["how"]


# -- categories: pre-trace memory by evidence -------------------------------------------------------

@pytest.mark.parametrize("name", TRAINING)
def test_categories_at_the_peak_agree_with_memtracker(name):
    cats = _report(name)["devices"][0]["categories_at_peak"]
    mt = TRUTH[name]["memtracker_at_peak"]
    got = {"parameter": cats.get("parameter", 0), "gradient": cats.get("gradient", 0),
           "optimizer_state": cats.get("optimizer_state", 0),
           "activation": cats.get("activation", 0) + cats.get("input", 0), "temporary": cats.get("temporary", 0)}
    agreement = 1 - sum(abs(got[k] - mt[k]) for k in mt) / (2 * sum(mt.values()))
    assert agreement >= 0.995, (got, mt)
    assert got["parameter"] == mt["parameter"]  # weights + buffers, to the byte (MemTracker rounds to 512 B)


@pytest.mark.parametrize("name", TRAINING)
def test_pre_trace_blocks_are_told_apart_by_their_requested_sizes(name):
    """The Adam moment in a 66,584,576-byte block that asked for 65,536,000 (vocab x hidden x 4 B) is optimizer
    state; the two frameless 32 MiB blocks (one cuBLAS workspace per thread) are workspaces, not weights."""
    trace = _cuda(name)
    rep = replay(trace)[0]
    cats = categorize(trace)[0]
    al = rep.allocations
    req = requested_sizes(trace, rep)
    cfg = TRUTH[name]["config"]
    embed = cfg["vocab_size"] * cfg["hidden_size"] * 4
    before = al.alloc_index < 0
    names = np.array(cats.names)[cats.labels]
    moment = before & (req == embed) & (al.size > embed)
    assert moment.sum() == 1 and names[moment][0] == "optimizer_state"
    ws = before & (req == 32 * MiB)
    assert ws.sum() == 2 and set(names[ws]) == {"workspace"}
    assert all("workspace" in cats.reasons[r] for r in cats.reason[ws])


@pytest.mark.parametrize("name", TRAINING)
def test_training_is_training(name):
    dev = _report(name)["devices"][0]
    assert dev["workload"] == "training" and dev["workload_evidence"]
    assert dev["kv_cache"] is None and dev["generation"] is None


# -- generation -------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", GENERATION)
def test_generation_has_a_prefill_and_decoding_steps(name):
    t = TRUTH[name]
    trace = _cuda(name)
    ph = phases(trace)[0]
    assert ph.generation is not None
    # one model call per new token: the prefill makes the first
    assert ph.generation["prefills"] == 1 and ph.generation["decode_steps"] == t["new_tokens"] - 1
    assert (ph.phase == PREFILL).any() and (ph.phase == DECODE).any()
    dev = build_report(trace)["devices"][0]
    assert dev["workload"] == "generation" and dev["peak_phase"] in ("prefill", "decode")
    steps = dev["generation"]["steps"]
    assert [s["kind"] for s in steps[:2]] == ["prefill", "decode"] and steps[-1]["step"] == t["new_tokens"] - 1
    # nothing of a generation is kept for a backward pass: no activations, gradients or optimizer state
    assert not {"activation", "gradient", "optimizer_state"} & set(dev["categories_at_peak"])
    assert dev["phases"] and {p["phase"] for p in dev["phases"]} >= {"prefill", "decode"}


@pytest.mark.parametrize("name", GENERATION)
def test_kv_cache_against_the_analytic_formula(name):
    t = TRUTH[name]
    cfg = t["config"]
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * t["batch"] * cfg["num_key_value_heads"] * head_dim * 2  # bf16
    trace = _cuda(name)
    kv = kv_cache(trace, 0)
    assert per_token == t["kv_bytes_per_step"]
    assert abs(kv["bytes_per_step"] - per_token) <= 0.01 * per_token
    assert kv["steps"] == t["new_tokens"] - 1
    assert kv["bytes_at_prefill"] == per_token * t["prompt"]
    # the peak is in the prefill: the cache holds the prompt's keys and values then, exactly
    assert kv["bytes_at_peak"] == t["kv_bytes_at_prefill"]
    # the last generated token is never fed back, so the cache ends one token short of prompt + new tokens
    assert kv["bytes_final"] == per_token * (t["prompt"] + t["new_tokens"] - 1)
    assert build_report(trace)["devices"][0]["categories_at_peak"]["kv_cache"] == t["kv_bytes_at_prefill"]


@pytest.mark.parametrize("name", GENERATION)
def test_workspaces_in_a_generation_are_the_handles_own(name):
    """The 32 MiB cuBLAS workspace (setWorkspaceForHandle) and the 1 MiB cuBLASLt one are workspaces, alive
    to the end; no other allocation is."""
    trace = _cuda(name)
    rep = replay(trace)[0]
    cats = categorize(trace)[0]
    al = rep.allocations
    ws = cats.labels == cats.names.index("workspace")
    assert sorted(al.size[ws].tolist()) == [1 * MiB, 32 * MiB]
    assert (al.free_index[ws] < 0).all()
    dev = build_report(trace)["devices"][0]
    sites = {s["where"]: s for s in dev["top_stacks_at_peak"]}
    labelled = [w for w in sites if "cuBLAS workspace" in w]
    assert len(labelled) == 1 and sites[labelled[0]]["bytes"] == 33 * MiB


# -- modules from the stacks ------------------------------------------------------------------------

@pytest.mark.parametrize("name", TRAINING + GENERATION)
def test_modules_from_the_stacks_fold_the_models_layers(name):
    cfg = TRUTH[name]["config"]
    table = _report(name)["devices"][0]["modules"]
    assert table and table["source"] == "stacks" and table["rows"]
    layers = [g for g in table["layers"] if g.get("classes")]
    n = cfg["num_hidden_layers"]
    assert layers and all(g["layers"] == n for g in layers if re.fullmatch(r"[\w.]*layers\.\*", g["pattern"]))
    assert any(f"×{n}" in g["classes"] for g in layers)
    arch = {"qwen2": "Qwen2ForCausalLM", "opt": "OPTForCausalLM", "gpt_neox": "GPTNeoXForCausalLM"}[cfg["model_type"]]
    assert all(g["classes"].startswith(arch + " > ") for g in layers)


def _package(tmp_path, body):
    pkg = tmp_path / "site" / "toylib"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text("raise SystemExit('tracekit must never import this')\n")
    (pkg / "modeling_toy.py").write_text(textwrap.dedent(body))
    return pkg / "modeling_toy.py"


TOY = """\
class Block:
    def __init__(self):
        self.attn = Attention()

    def forward(self, x):
        y = self.attn(x)
        return y + 1


class Attention:
    def __init__(self):
        self.q = Linear()

    def forward(self, x):
        return x * 2


class Model:
    def __init__(self):
        self.layers = ModuleList([Block() for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x
"""


def _toy_trace(path, shift=0):
    """A generation-free forward of Model: two layers, each allocating in Attention.forward and Block.forward,
    with frames pointing at `path` (lines moved by `shift`, as another version would have them)."""
    sim = Sim()
    f = str(path)

    def frames(*chain):
        return [{"filename": f, "line": ln + shift, "name": "forward"} for ln in reversed(chain)] + \
            [{"filename": "/home/me/train.py", "line": 9, "name": "main"}]
    for _ in range(2):
        sim.alloc(1 * MiB, frames=frames(24, 6, 15))  # Model.forward -> Block.forward -> Attention.forward
        sim.alloc(2 * MiB, frames=frames(24, 7))  # Block.forward's own line
    return snapshot_to_trace(sim.snapshot(), "<toy>")


def test_module_names_from_the_source_are_read_never_imported(tmp_path):
    path = _package(tmp_path, TOY)
    trace = _toy_trace(path)
    sm = stack_modules(trace)
    names = {(n.name, n.cls, n.looped, n.how) for n in sm.nodes}
    assert ("Model", "Model", False, BY_SOURCE) in names
    assert ("layers", "Block", True, BY_SOURCE) in names
    assert ("attn", "Attention", False, BY_SOURCE) in names
    rows = build_report(trace)["devices"][0]["modules"]["rows"]
    assert {r["module"] for r in rows} == {"layers.0", "layers.1", "layers.0.attn", "layers.1.attn"}


def test_module_names_when_another_version_is_installed(tmp_path, monkeypatch):
    """The recorded file is gone; the installed copy (found on sys.path, same package path) has 3 lines more."""
    installed = _package(tmp_path, "# a\n# newer\n# version\n" + TOY)
    monkeypatch.syspath_prepend(str(installed.parent.parent))
    recorded = "/elsewhere/site-packages/toylib/modeling_toy.py"
    trace = _toy_trace(recorded)
    sm = stack_modules(trace)
    assert {(n.name, n.cls, n.how) for n in sm.nodes} >= {("layers", "Block", SHIFTED), ("attn", "Attention", SHIFTED)}


def test_module_names_by_file_and_function_without_a_source(tmp_path):
    trace = _toy_trace("/nowhere/site-packages/toylib/modeling_toy.py")
    sm = stack_modules(trace)
    assert all(n.how == BY_FILE for n in sm.nodes)
    assert sm.nodes[0].name == "forward@modeling_toy.py"
    table = build_report(trace)["devices"][0]["modules"]
    assert table["source"] == "stacks"


def test_a_source_that_is_not_python_gives_no_names_and_no_error(tmp_path):
    path = _package(tmp_path, "class (:\n")
    trace = _toy_trace(path)
    assert all(n.how == BY_FILE for n in stack_modules(trace).nodes)


# -- bad input --------------------------------------------------------------------------------------

BAD_STACKS = {
    "no frames": [],
    "no python frames": [{"filename": "??", "line": 0, "name": "at::_ops::mm::call(at::Tensor const&)"}],
    "no filename": [{"filename": "", "line": 3, "name": "forward"}, {"filename": "", "line": 0, "name": ""}],
    "truncated": [{"filename": "/x/site-packages/transformers/models/m/modeling_m.py", "line": 10 ** 9,
                   "name": "forward"}],
    "unknown package": [{"filename": "/x/site-packages/somethingnew/thing.py", "line": 4, "name": "forward"},
                        {"filename": "/home/me/t.py", "line": 1, "name": "main"}],
    "torch only": [{"filename": "/x/site-packages/torch/nn/modules/linear.py", "line": 125, "name": "forward"}],
}


@pytest.mark.parametrize("what", sorted(BAD_STACKS))
def test_odd_stacks_give_a_best_effort_report(what):
    sim = Sim()
    a = sim.alloc(4 * MiB, frames=BAD_STACKS[what])
    sim.alloc(1 * MiB, frames=BAD_STACKS[what])
    sim.free(a)
    trace = snapshot_to_trace(sim.snapshot(), "<bad>")
    report = build_report(trace)
    dev = report["devices"][0]
    assert dev["workload"] in (None, "training", "inference", "generation")
    for row in dev["library_sites_at_peak"]:
        assert row["library_frame"]["package"]
    reporter("report", "text").render(report)
    json.dumps(report)


def test_stack_roles_of_the_fixture_frames():
    trace = _cuda("qwen2_generate_b2_p256_n128.pickle.gz")
    roles = stack_roles(trace)
    ops = {trace.strings[i] for i in roles.op.tolist() if i}
    assert {"aten::linear", "aten::cat", "aten::scaled_dot_product_attention"} <= ops


def test_the_fixtures_are_read_as_plain_data():
    with gzip.open(os.path.join(CUDA, GENERATION[0])) as f:
        snap = restricted_load(f)
    assert isinstance(snap, dict) and snap["device_traces"]


def test_pre_trace_state_and_gradients_kept_in_place():
    """Recorded after a warm-up with zero_grad(set_to_none=False): the trace makes no gradient and no
    state (both updated in place); AdamW (named by the annotation) keeps 2 moments, so each trainable weight
    is 4 blocks of its size live throughout, besides two frameless cuBLAS workspaces."""
    cpp = [{"filename": "CUDACachingAllocator.cpp", "line": 0, "name": "c10::cuda::CUDACachingAllocator::malloc"}]
    fwd = cpp + [{"filename": "??", "line": 0, "name": "at::_ops::mm::call(...)"},
                 {"filename": "/home/me/model.py", "line": 20, "name": "forward"},
                 {"filename": "/home/me/train.py", "line": 6, "name": "main"}]
    engine = cpp + [{"filename": "??", "line": 0, "name": "torch::autograd::generated::MmBackward0::apply(...)"},
                    {"filename": "??", "line": 0, "name": "torch::autograd::Engine::thread_main(...)"}]
    step = cpp + [{"filename": "??", "line": 0, "name": "at::_ops::_foreach_mul::call(...)"},
                  {"filename": "/home/me/train.py", "line": 9, "name": "main"}]
    sim = Sim()
    sizes = [4 * MiB] * 3 + [1 * MiB] * 2
    for s in sizes * 4:  # weight, .grad, exp_avg, exp_avg_sq of each
        sim.alloc(s, frames=[])
    sim.alloc(8519680, frames=[])
    sim.alloc(8519680, frames=[])
    before = len(sim.traces[0])
    a = sim.alloc(16 * MiB, frames=fwd)
    t = sim.alloc(8 * MiB, frames=engine)
    sim.free(t)
    sim.free(a)
    t0 = sim.traces[0][-1]["time_us"] + 1
    tmp = sim.alloc(2 * MiB, frames=step)
    sim.free(tmp)
    snap = sim.snapshot(drop_first=before)
    snap["external_annotations"] = [{"name": "Optimizer.step#AdamW.step", "stage": "START", "device": 0, "time_us": t0},
                                    {"name": "Optimizer.step#AdamW.step", "stage": "END", "device": 0,
                                     "time_us": sim.traces[0][-1]["time_us"] + 1}]
    trace = snapshot_to_trace(snap, "<warm, set_to_none=False>")
    rep = replay(trace)[0]
    by = categorize(trace)[0].bytes_by_category(rep.allocations.size, rep.allocations.alloc_index < 0)
    weights = sum(sizes)
    assert by["parameter"] == weights and by["gradient"] == weights and by["optimizer_state"] == 2 * weights
    assert by["workspace"] == 2 * 8519680


@pytest.mark.parametrize("name", GENERATION)
def test_a_window_inside_a_generation_has_no_prefill(name):
    """Decoding steps 3..5 only: the first call already replaces cached keys and values, so it is a step."""
    from tracekit.analysis.window import Window, select, parse_iterations

    t = TRUTH[name]
    trace = select(_cuda(name), Window(iterations=parse_iterations("3..5")))
    ph = phases(trace)[0]
    assert ph.generation["prefills"] == 0 and ph.generation["decode_steps"] == 3
    kv = kv_cache(trace, 0)
    assert kv["bytes_per_step"] == t["kv_bytes_per_step"] and kv["steps"] == 2
