"""Issue 31: one fact, one figure. Each test runs two front ends on one file and compares what they say,
against an independent figure (torch's own counters in truth.json, or the file's recorded peaks)."""
import json
from pathlib import Path
import subprocess
import sys

import pytest

from .conftest import ROOT, SAMPLES

CUDA = ROOT / "tests" / "fixtures" / "cuda"
REAL = ROOT / "tests" / "fixtures" / "real"
TRUTH = json.loads((CUDA / "truth.json").read_text())["files"]


def tk(*args):
    return subprocess.run([sys.executable, "-m", "tracekit.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def tk_json(*args):
    r = tk(*args, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


# -- units: a byte option without a unit is refused (one line, exit 2, naming the units) -------------------------
@pytest.mark.parametrize("args", [
    ["whatif", SAMPLES / "gpt_adamw_cuda.pickle", "--budget", "80"],
    ["whatif", SAMPLES / "oom_cuda.pickle", "--alloc-conf", "expandable_segments:True", "--memory-limit", "1200"],
    ["whatif", SAMPLES / "oom_cuda.pickle", "--alloc-conf", "expandable_segments:True", "--device-memory", "8e10"],
    ["check", SAMPLES / "gpt_adamw_cuda.pickle", "--max-peak", "80"],
    ["check", SAMPLES / "gpt_adamw_cuda.pickle", "--max", "activation=80"],
    ["estimate", "--config", "gpt2", "--batch", "1", "--seq", "128", "--budget", "80"],
])
def test_a_size_without_a_unit_is_refused(args):
    r = tk(*args)
    assert r.returncode == 2, (args, r.stdout, r.stderr)
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr, r.stderr
    assert "has no unit" in r.stderr and "GiB" in r.stderr and "MiB" in r.stderr and "GB" in r.stderr, r.stderr


def test_a_size_with_a_unit_still_reads_as_before():
    peak = TRUTH["qwen2_amp_adamw_b4_s256.pickle.gz"]["max_allocated"]  # torch.cuda.max_memory_allocated()
    path = CUDA / "qwen2_amp_adamw_b4_s256.pickle.gz"
    assert tk("check", path, "--max-peak", f"{peak}B").returncode == 0
    assert tk("check", path, "--max-peak", f"{peak - 1}B").returncode == 1


# -- the replay's baseline: the file's own settings reproduce the recorded reserved peak ---------------------------
@pytest.mark.parametrize("path", [
    CUDA / "qwen2_amp_adamw_b4_s256.pickle.gz", CUDA / "opt_amp_adamw_b4_s256.pickle.gz",
    CUDA / "neox_amp_adamw_b4_s256.pickle.gz",
    REAL / "snapshot_cpp_frames_adamw_full_step.pickle",  # blocks and segments alive before the trace
    REAL / "snapshot_newest_format_windows_paths.pickle",
])
def test_whatif_baseline_is_the_recorded_reserved_peak(path):
    report = tk_json("report", path, "--no-cache")["devices"][0]
    w = tk_json("whatif", path, "--alloc-conf", "expandable_segments:False", "--no-cache")["devices"][0]
    assert w["baseline"]["peak_reserved_bytes"] == report["peak_reserved_bytes"] == w["recorded"]["peak_reserved_bytes"]
    assert w["baseline_check"]["reproduced"] and w["baseline_check"]["difference_bytes"] == 0
    if path.name in TRUTH:  # and that is torch's own max_memory_reserved()
        assert report["peak_reserved_bytes"] == TRUTH[path.name]["max_reserved"]


def test_a_rebuilt_start_says_why_and_by_how_much_it_misses():
    path = CUDA / "opt_amp_adamw_b4_s256.pickle.gz"  # 476 MiB allocated before the trace
    w = tk_json("whatif", path, "--alloc-conf", "expandable_segments:False", "--start", "rebuilt",
                "--no-cache")["devices"][0]
    check = w["baseline_check"]
    assert check["recorded_peak_reserved_bytes"] == TRUTH[path.name]["max_reserved"]
    assert check["difference_bytes"] == w["baseline"]["peak_reserved_bytes"] - TRUTH[path.name]["max_reserved"] != 0
    assert not check["reproduced"] and "--start recorded reproduces" in check["why"]
    assert any(f"{check['difference_bytes']:+,} bytes" in n for n in w["notes"])


# -- expandable segments: the lever, the report's finding and the replay are one computation ----------------------
def test_expandable_lever_finding_and_replay_say_the_same_bytes():
    path = SAMPLES / "logits_spike_cuda.pickle"
    w = tk_json("whatif", path, "--alloc-conf", "expandable_segments:True", "--no-cache")["devices"][0]
    replay = w["baseline"]["peak_reserved_bytes"] - w["whatif"]["peak_reserved_bytes"]
    assert replay == w["saved_reserved_bytes"] > 100 << 20
    report = tk_json("report", path, "--no-cache")
    frag = next(f for f in report["findings"] if f["kind"] == "fragmentation")
    assert frag["expandable_segments_saves_bytes"] == replay
    budget = tk_json("whatif", path, "--budget", "80GiB", "--no-cache")
    lever = next(lv for lv in budget["levers"] if lv["technique"] == "expandable_segments")
    assert lever["saves_bytes"] == replay
    text = tk("whatif", path, "--budget", "80GiB", "--no-cache").stdout
    assert f"{replay / 2**20:.1f} MiB" in text


def test_no_expandable_lever_where_the_replay_saves_nothing():
    path = REAL / "snapshot_cpp_frames_adamw_full_step.pickle"
    w = tk_json("whatif", path, "--alloc-conf", "expandable_segments:True", "--no-cache")["devices"][0]
    assert w["saved_reserved_bytes"] <= 0
    budget = tk_json("whatif", path, "--budget", "80GiB", "--sizes", "8", "--no-cache")
    assert not any(lv["technique"] == "expandable_segments" for lv in budget["levers"])
    assert any(n.startswith("no expandable-segments lever") for n in budget["levers_not_offered"])
    frag = next(f for f in tk_json("report", path, "--no-cache")["findings"] if f["kind"] == "fragmentation")
    assert frag["expandable_segments_saves_bytes"] == w["saved_reserved_bytes"]
    assert "would not help here" in frag["summary"]


# -- the headline: the allocator's counter, exact where it is, requested bytes beside it -------------------------
@pytest.mark.parametrize("name", ["qwen2_amp_adamw_b4_s256.pickle.gz", "opt_amp_adamw_b4_s256.pickle.gz",
                                  "qwen2_generate_b2_p256_n128.pickle.gz"])
def test_report_text_json_and_check_lead_with_max_memory_allocated(name):
    from tracekit.units import fmt_bytes

    path, truth = CUDA / name, TRUTH[name]["max_allocated"]  # torch.cuda.max_memory_allocated() on the H100
    d = tk_json("report", path)["devices"][0]
    head = d["headline_peak"]
    assert head["bytes"] == truth and head["exact"] and head["measure"] == "blocks"
    assert head["requested_bytes"] == d["peak_allocated_bytes"] < truth  # kept: requested bytes, beside it
    first = tk("report", path).stdout.splitlines()[3]
    assert first.split() [:3] == ["peak", "allocated", fmt_bytes(truth).split()[0]]
    assert f"{fmt_bytes(truth)}  exact, as torch.cuda.max_memory_allocated()" in first
    assert f"tensors requested {fmt_bytes(head['requested_bytes'])}" in first
    assert tk("check", path, "--max-peak", f"{truth}B").returncode == 0
    over = tk("check", path, "--max-peak", f"{truth - 1}B")
    assert over.returncode == 1 and "over by 1 B" in over.stdout


def test_headline_on_a_cpu_recording_is_the_requested_bytes():
    d = tk_json("report", SAMPLES / "gpt_adamw.pickle")["devices"][0]
    assert d["headline_peak"]["measure"] == "requested" and d["headline_peak"]["bytes"] == d["peak_allocated_bytes"]


# -- a cuBLAS workspace is `workspace` and in no module, whatever the tags or the stacks' module say -------------
def _workspaces(path):
    import numpy as np

    from tracekit.analysis.categories import WORKSPACE, categorize
    from tracekit.analysis.replay import replay
    from tracekit.io import load

    trace = load(path, use_cache=False)
    rep = replay(trace)[0]
    ws = np.flatnonzero(categorize(trace)[0].labels == WORKSPACE)
    return trace, rep, sorted(zip(rep.allocations.alloc_index[ws].tolist(), rep.allocations.size[ws].tolist()))


def test_workspaces_without_cpp_frames_are_those_the_cpp_frames_name():
    """gpt_adamw_cuda and gpt_adamw_cpp_stacks_cuda record the same step; the second has C++ frames, which
    name its cuBLAS workspaces (getCurrentCUDABlasHandle / getCUDABlasLtWorkspace): the first, without
    them, must find the same blocks by size and lifetime (they were activation and gradient before)."""
    _, _, truth = _workspaces(SAMPLES / "gpt_adamw_cpp_stacks_cuda.pickle")
    assert truth == [(19, 32 << 20), (20, 1 << 20), (218, 32 << 20)]
    for name in ("gpt_adamw_cuda.pickle", "leak_loop_cuda.pickle", "lora_cuda.pickle"):
        _, _, got = _workspaces(SAMPLES / name)
        assert [s for _, s in got] == [32 << 20, 1 << 20, 32 << 20], (name, got)
    assert _workspaces(SAMPLES / "gpt_adamw_cuda.pickle")[2] == truth
    r = tk_json("report", SAMPLES / "gpt_adamw_cuda.pickle")["devices"][0]
    assert r["categories_at_peak"]["workspace"] == (32 << 20) * 2 + (1 << 20)


def test_no_module_holds_a_workspace_in_the_report_or_the_viewer():
    import numpy as np

    from tracekit.analysis.modules import allocation_module_names

    path = CUDA / "qwen2_generate_b2_p256_n128.pickle.gz"  # torch-recorded: the workspace ran under rotary_emb
    trace, rep, ws = _workspaces(path)
    assert (32 << 20) in [s for _, s in ws]
    strings, ids = allocation_module_names(trace, rep)  # the viewer's "group by module"
    rows = np.flatnonzero(np.isin(rep.allocations.alloc_index, [a for a, _ in ws]))
    assert all(strings[ids[r]] == "" for r in rows)
    mods = tk_json("report", path)["devices"][0]["modules"]["rows"]
    assert mods and max(m["bytes_at_peak"] for m in mods) < 32 << 20
    assert all(m["module"] != "(outside any module)" or m["bytes_at_peak"] < 32 << 20 for m in mods)


# -- whatif from one recording: the interval follows the fit's own slope range -----------------------------------
def test_one_recording_interval_spans_its_slope_range():
    import math

    budget = 80 * 2**30
    r = tk_json("whatif", SAMPLES / "gpt_adamw_cuda.pickle", "--budget", "80GiB", "--no-cache")
    f, p = r["fit"], r["points"][0]
    lo_slope, hi_slope = f["per_unit_range"]
    assert lo_slope < hi_slope
    # independent arithmetic: each moment the fit follows, at its own slope range; the low end also keeps the
    # reserved-but-unused bytes at the peak aside
    def largest(k, b):
        return min(ln["at"] + math.floor((b - ln["bytes"]) / ln["per"][k]) for ln in f["lines"] if ln["per"][k] > 0)
    main = f["lines"][0]
    assert main["per"][0] == pytest.approx(lo_slope, abs=1) and main["per"][2] == pytest.approx(hi_slope, abs=1)
    want = [largest(2, budget - p["fragmentation"]), largest(0, budget)]
    assert r["largest_batch_range"] == want and want[1] - want[0] > 0.2 * want[0]
    text = tk("whatif", SAMPLES / "gpt_adamw_cuda.pickle", "--budget", "80GiB", "--no-cache").stdout
    assert f"largest batch that fits = {want[0]} to {want[1]}" in text


# -- torch.compile: forward phase and modules below the compiled wrapper, from the graph's source nodes ----------
def _compiled_snapshot(tmp_path, with_fx=True):
    """A compiled GPT-2 step as torch records it: forward allocations come from generated code under dynamo's
    wrapper (`fx_generated_*.py`, aot_autograd, eval_frame, the model's own transformed `forward`), each
    generated frame carrying its graph node's source (`fx_original_trace`, as
    torch.cuda.memory._snapshot(augment_with_fx_traces=True) writes it); backward from the compiled backward."""
    import pickle

    import transformers

    from .synth import Sim

    tf = Path(transformers.__file__).parent
    gpt2, utils = str(tf / "models" / "gpt2" / "modeling_gpt2.py"), str(tf / "pytorch_utils.py")
    torch_dir = "/opt/venv/lib/python3.11/site-packages/torch"

    def trace_of(calls):
        return "".join(f'  File "{f}", line {ln}, in {name}\n    code\n' for f, ln, name in calls)

    outer = [{"filename": f"{torch_dir}/_functorch/_aot_autograd/runtime_wrappers.py", "line": 3462, "name": "forward"},
             {"filename": f"{torch_dir}/autograd/function.py", "line": 625, "name": "apply"},
             {"filename": f"{torch_dir}/_dynamo/eval_frame.py", "line": 1446, "name": "_fn"},
             {"filename": gpt2, "line": 683, "name": "forward"},  # the model's forward, running the graph
             {"filename": f"{torch_dir}/nn/modules/module.py", "line": 1884, "name": "_call_impl"},
             {"filename": f"{torch_dir}/nn/modules/module.py", "line": 1778, "name": "_wrapped_call_impl"},
             {"filename": f"{torch_dir}/_dynamo/eval_frame.py", "line": 511, "name": "__call__"},
             {"filename": "/home/u/train.py", "line": 20, "name": "<module>"}]
    lm, model = (gpt2, 683, "forward"), (gpt2, 608, "forward")
    paths = {  # node -> the source lines it came from, outermost first
        "addmm": [lm, model, (gpt2, 277, "forward"), (gpt2, 187, "forward"), (utils, 119, "forward")],
        "addmm_1": [lm, model, (gpt2, 308, "forward"), (gpt2, 241, "forward"), (utils, 119, "forward")],
    }
    sim = Sim()
    made = []
    for layer in range(2):
        for node, calls in paths.items():
            gen = {"filename": "/tmp/fx_generated_abc123.py", "line": 40 + layer, "name": "forward"}
            if with_fx:
                gen.update(fx_node_op="call_function", fx_node_name=node, fx_node_target="aten.addmm",
                           fx_original_trace=trace_of(calls))
            made.append(sim.alloc(4 << 20, frames=[gen] + outer))
    bwd = [{"filename": f"{torch_dir}/_functorch/_aot_autograd/runtime_wrappers.py", "line": 3473, "name": "backward"},
           {"filename": f"{torch_dir}/autograd/function.py", "line": 333, "name": "apply_boxed"}]
    grads = [sim.alloc(2 << 20, frames=bwd) for _ in range(2)]
    for a in made:
        sim.free(a)
    del grads
    path = tmp_path / ("compiled_fx.pickle" if with_fx else "compiled.pickle")
    path.write_bytes(pickle.dumps(sim.snapshot()))
    return path


def test_a_compiled_step_has_a_forward_phase_and_modules_below_the_wrapper(tmp_path):
    path = _compiled_snapshot(tmp_path)
    r = tk_json("report", path, "--no-cache")["devices"][0]
    phases = {p["phase"] for p in r["phases"]}
    assert "forward" in phases and "backward" in phases, phases
    rows = {m["module"]: m for m in r["modules"]["rows"]}
    # the generated code's nodes, named from the source: each layer's attention and MLP projections
    assert {"transformer.h.*.attn.c_attn", "transformer.h.*.mlp.c_fc"} <= {
        row["pattern"] for row in r["modules"]["layers"]}, r["modules"]
    assert rows["transformer.h.0.attn.c_attn"]["peak_bytes"] == 4 << 20
    assert rows["transformer.h.1.mlp.c_fc"]["allocated_bytes"] == 4 << 20
    # the viewer's grouping by module reads the same function
    import numpy as np

    from tracekit.analysis.modules import allocation_module_names
    from tracekit.analysis.replay import replay
    from tracekit.io import load

    trace = load(path, use_cache=False)
    strings, ids = allocation_module_names(trace, replay(trace)[0])
    assert "transformer.h.1.attn.c_attn" in set(strings[np.unique(ids)])


def test_fx_frames_are_found_by_both_readers(tmp_path, monkeypatch):
    from tracekit.analysis.modules import allocation_module_names
    from tracekit.analysis.replay import replay
    from tracekit.io import load

    path = _compiled_snapshot(tmp_path)
    got = []
    for reader in ("auto", "python"):
        monkeypatch.setenv("TRACEKIT_READER", reader)
        trace = load(path, use_cache=False)
        strings, ids = allocation_module_names(trace, replay(trace)[0])
        got.append(sorted(strings[ids].tolist()))
    assert got[0] == got[1] and "transformer.h.0.mlp.c_fc" in got[0]


def test_generated_code_alone_is_a_forward_pass(tmp_path):
    """torch.compile(step_fn): no nn.Module frame, only inductor's kernels (`call` in a torchinductor_ file)
    under dynamo's wrapper (the stack cut there, as torch cuts long ones), then a compiled backward: the first
    is the forward pass."""
    import pickle

    from .synth import Sim

    torch_dir = "/opt/venv/lib/python3.11/site-packages/torch"
    fwd = [{"filename": "/tmp/torchinductor_u/ab/cabcdef.py", "line": 310, "name": "call"},
           {"filename": f"{torch_dir}/_inductor/output_code.py", "line": 584, "name": "__call__"},
           {"filename": f"{torch_dir}/_dynamo/eval_frame.py", "line": 1446, "name": "_fn"}]
    bwd = [{"filename": "/tmp/torchinductor_u/cd/ccdef.py", "line": 90, "name": "call"},
           {"filename": f"{torch_dir}/_functorch/_aot_autograd/runtime_wrappers.py", "line": 3473, "name": "backward"}]
    sim = Sim()
    acts = [sim.alloc(8 << 20, frames=fwd) for _ in range(3)]
    sim.alloc(1 << 20, frames=bwd)
    for a in acts:
        sim.free(a)
    path = tmp_path / "compiled_fn.pickle"
    path.write_bytes(pickle.dumps(sim.snapshot()))
    r = tk_json("report", path, "--no-cache")["devices"][0]
    by_phase = {p["phase"]: p for p in r["phases"]}
    assert by_phase["forward"]["peak_bytes"] == 24 << 20 and "backward" in by_phase
    assert r["categories_at_peak"].get("activation") == 24 << 20


# -- the 4-bit lever on an fp32-weight AMP run: the weights' real width, from the file's evidence ----------------
def test_four_bit_lever_uses_fp32_weights_on_an_amp_run():
    name = "qwen2_amp_adamw_b4_s256.pickle.gz"
    truth = TRUTH[name]
    assert truth["param_bytes"] == 4 * truth["params"]  # recorded with fp32 weights under bf16 autocast
    r = tk_json("whatif", CUDA / name, "--budget", "80GiB", "--sizes", "4", "--no-cache")
    assert r["levers_for"]["facts"]["bytes_per_parameter"] == truth["param_bytes"] / truth["params"]
    lever = next(lv for lv in r["levers"] if lv["technique"] == "4-bit quantized weights")
    params = tk_json("report", CUDA / name)["devices"][0]["categories_at_peak"]["parameter"]
    assert lever["saves_bytes"] == int(params * (1 - 0.5 / 4)) and "fp32" in lever["assumes"]


def test_a_spike_names_the_library_line_the_report_names_at_the_peak():
    r = tk_json("report", CUDA / "qwen2_amp_adamw_b4_s256.pickle.gz")
    peak = next(f for f in r["findings"] if f["kind"] == "peak")
    spike = next(f for f in r["findings"] if f["kind"] == "spike" and f["at_peak"])
    lib = r["devices"][0]["library_sites_at_peak"][0]
    assert spike["library_line"] == peak["library_line"] and "modeling_qwen2.py" in spike["library_line"]
    assert lib["category"] == "temporary"  # the spike is made of temporaries: the same line leads both
    assert f"largest library line: " in spike["summary"] and spike["library_line"] in spike["summary"]


def test_predicted_vs_measured_does_not_predict_zero_activations_when_the_tokens_are_unknown():
    path = ROOT / "tests" / "fixtures" / "recorded" / "qwen2_train_cpu.pickle.gz"  # HF config recorded, no input shape
    e = tk_json("report", path)["devices"][0]["estimate"]
    rows = {r["category"]: r for r in e["categories"]}
    assert rows["activation"]["predicted"] is None and rows["activation"]["measured"] > 0
    assert rows["parameter"]["predicted"] > 0  # the model states are predicted from the config
    text = tk("report", path).stdout
    line = next(ln for ln in text.splitlines() if ln.strip().startswith("activation") and "not predicted" in ln)
    assert " 0 B" not in line.split("activation")[1][:12]
    assert not any("activation at the peak vs predicted" in g["what"] for g in e["gap_at_peak"])


# -- the formula follows what transformers runs ---------------------------------------------------------------
CONFIGS = ROOT / "tests" / "fixtures" / "configs"


def _est(*args):
    return tk_json("estimate", "--batch", "1", "--precision", "bf16", *args)


def test_gemma2_is_estimated_with_eager_attention_as_transformers_runs_it():
    cfg = CONFIGS / "gemma-2-9b.json"
    default, eager, sdpa = (_est("--config", cfg, "--seq", "4096", *a) for a in ((), ("--attention", "eager"),
                                                                                 ("--attention", "sdpa")))
    assert default["setup"]["attention"] == "eager" and default["per_gpu"] == eager["per_gpu"]
    assert any("eager attention: transformers runs gemma2" in a for a in default["assumptions"])
    # the eager score matrix: heads × seq² per layer and more; SDPA keeps none of it
    assert default["per_gpu"]["total"] > sdpa["per_gpu"]["total"] + 16 * 4096 * 4096 * 42
    llama = _est("--config", "llama-3-8b", "--seq", "4096")
    assert llama["setup"]["attention"] == "sdpa"  # other models keep transformers' default, SDPA


def test_phi2_counts_no_embedding_dropout_mask_with_embd_pdrop_0():
    import json as _json

    cfg = CONFIGS / "phi-2.json"
    conf = _json.loads(cfg.read_text())
    assert conf["embd_pdrop"] == 0.0 and conf["resid_pdrop"] > 0
    lines = lambda r: " ".join(str(ln["formula"]) for ln in r["lines"])  # noqa: E731
    default = _est("--config", cfg, "--seq", "2048")
    assert "embedding dropout mask" not in lines(default) and "residual dropout mask" in lines(default)
    forced = _est("--config", cfg, "--seq", "2048", "--dropout", "0.1")  # the user's dropout applies everywhere
    assert "embedding dropout mask" in lines(forced)
    act = lambda r: sum(ln["bytes"] for ln in r["lines"] if ln["category"] == "activation")  # noqa: E731
    assert act(forced) - act(default) == 2048 * conf["hidden_size"]  # one 1-byte mask per token and channel


def test_whatif_on_a_file_that_does_not_say_its_batch_answers_in_multiples_of_it():
    path = REAL / "snapshot_cpp_frames_adamw_full_step.pickle"  # torch-recorded: no batch size in the file
    rel = tk_json("whatif", path, "--budget", "80GiB", "--no-cache")
    given = tk_json("whatif", path, "--budget", "80GiB", "--sizes", "100", "--no-cache")
    lo, hi = given["largest_batch_range"]
    assert rel["largest_batch_multiple_range"] == [lo / 100, hi / 100] and lo < hi
    text = tk("whatif", path, "--budget", "80GiB", "--no-cache").stdout
    assert f"= {lo / 100:.2f}× to {hi / 100:.2f}× the recorded batch" in text
    two = tk("whatif", path, path, "--budget", "80GiB")
    assert two.returncode == 2 and "give --sizes" in two.stderr
