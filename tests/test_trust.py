"""Issue 23, "never wrong where it counts": an out-of-memory error never passes `check`, `whatif` never
contradicts the file, one answer per lever, leaks are growth, every finding says what it rests on.

Numbers are checked against what the files say by other means: a plain replay of the raw entries
(tests/oracle.py), the recorder's own figures, the exception text, the fixtures' truth.json.
"""
import gzip
import json
import pickle
import random
import subprocess
import sys

import pytest

from tests.conftest import ROOT, SAMPLES, fixture
from tests.oracle import naive_replay
from tests.synth import MiB, Sim
from tracekit.analysis.report import build_report
from tracekit.io import load, read_document, to_trace

OOM = SAMPLES / "oom_cuda.pickle"
CUDA = ROOT / "tests" / "fixtures" / "cuda"
GEN = CUDA / "qwen2_generate_b2_p256_n128.pickle.gz"
QWEN_AMP = CUDA / "qwen2_amp_adamw_b4_s256.pickle.gz"
QWEN_CPU = ROOT / "tests" / "fixtures" / "recorded" / "qwen2_train_cpu.pickle.gz"
TRUTH = json.loads((CUDA / "truth.json").read_text())["files"]


def cli(*args):
    p = subprocess.run([sys.executable, "-m", "tracekit.cli", *map(str, args)], capture_output=True, text=True,
                       timeout=300)
    return p.returncode, p.stdout, p.stderr


def raw(path):
    snap, _ = read_document(str(path))
    return snap


def oom_entry(snap, device=0):
    """(index, entry) of the first oom entry of a device's raw trace."""
    return next((i, e) for i, e in enumerate(snap["device_traces"][device]) if e["action"] == "oom")


def write(tmp_path, name, snap):
    path = tmp_path / name
    path.write_bytes(pickle.dumps(snap, protocol=4))
    return path


# -- 1. an out-of-memory error is a failure, always --------------------------------------------------------------
@pytest.mark.parametrize("budgets", [["--max-peak", "100GiB"], [], ["--max-reserved", "1TiB", "--no-leaks"],
                                     ["--max", "activation=100GiB"]])
def test_oom_sample_fails_check_whatever_the_budgets(budgets):
    code, out, err = cli("check", OOM, *budgets)
    assert code == 1, (out, err)
    assert out.splitlines()[0].endswith("out of memory (the run failed)")
    snap = raw(OOM)
    i, e = oom_entry(snap)
    live = naive_replay(snap)["curve"][i]
    assert e["size"] == 512 * MiB  # the request torch's message names: "Tried to allocate 512.00 MiB"
    line = next(x for x in out.splitlines() if x.startswith("  - "))
    assert f"out of memory at entry {i}" in line and "asked for 512.0 MiB" in line
    assert "77.9 GiB was free" in line  # device_free of the entry: 83,680,755,712 B
    assert "capped at 1.00 GiB" in line  # set_per_process_memory_fraction: "1024.00 MiB allowed"
    assert f"the run needs at least {(live + e['size']) / 2**30:.2f} GiB" in line
    assert "top holders: 274.0 MiB from record/toy.py:52 in forward (activation)" in line


def test_oom_json_says_request_free_cap_need_and_evidence():
    code, out, _ = cli("check", OOM, "--max-peak", "100GiB", "--json")
    assert code == 1
    got = json.loads(out)
    snap = raw(OOM)
    i, e = oom_entry(snap)
    (p,) = [p for p in got["problems"] if p["what"] == "oom"]
    assert p["bytes"] == naive_replay(snap)["curve"][i] + e["size"]
    assert p["limit"] == 1024 * MiB
    assert p["evidence"]["events"] == [i] and "oom" in p["evidence"]["rule"]
    assert p["evidence"]["frames"][0]["line"] == e["frames"][0]["line"]
    assert got["checked"][0] == "out of memory: 1 recorded (fails)"


def test_report_gives_the_demand_as_a_lower_bound():
    snap = raw(OOM)
    i, e = oom_entry(snap)
    d = build_report(load(OOM))["devices"][0]
    oracle = naive_replay(snap)
    assert d["peak_allocated_bytes"] == oracle["peak"]
    assert d["demand_bytes"] == max(oracle["peak"], oracle["curve"][i] + e["size"]) and d["demand_is_lower_bound"]
    assert d["out_of_memory"] == 1
    code, out, _ = cli("report", OOM)
    assert code == 0 and "needed" in out and f"≥ {d['demand_bytes'] / 2**30:.2f} GiB" in out and "a lower bound" in out


def sim_oom(devices=1, oom_device=0, peak_device=0, ooms=1, error=None):
    """A small snapshot: 64 MiB live on `peak_device`, and on `oom_device` requests that fail."""
    sim = Sim(devices=devices)
    a = sim.alloc(64 * MiB, device=peak_device)
    sim.free(a, device=peak_device)
    sim.alloc(8 * MiB, device=oom_device)
    for k in range(ooms):
        sim.oom((k + 1) * 32 * MiB, device_free=MiB, device=oom_device)
    snap = sim.snapshot()
    if error is not None:
        snap["tracekit"] = {"version": 1, "backend": "cuda", "error": error,
                            "devices": [{"index": d, "type": "cuda", "name": "GPU", "total_memory": 80 * 2**30}
                                        for d in range(devices)]}
    return snap


def test_several_ooms_and_an_oom_on_another_device(tmp_path):
    path = write(tmp_path, "two.pickle", sim_oom(devices=2, oom_device=1, peak_device=0, ooms=5))
    code, out, err = cli("check", path, "--max-peak", "100GiB")
    assert code == 1 and "Traceback" not in err
    lines = [x for x in out.splitlines() if x.startswith("  - ")]
    assert all(x.startswith("  - cuda:1: ") for x in lines)  # the device that failed, not the one that peaked
    assert len(lines) == 4 and "and 2 more out-of-memory errors (5 in all" in lines[-1]
    d = {x["device"]: x for x in build_report(load(path))["devices"]}
    assert d[0]["demand_is_lower_bound"] is False and d[0]["demand_bytes"] == 64 * MiB
    assert d[1]["demand_bytes"] == 8 * MiB + 5 * 32 * MiB  # the largest need: live + the largest request
    code, out, _ = cli("whatif", path, "--budget", "100GiB", "--sizes", "4", "--json")
    assert code == 0 and json.loads(out)["points"][0]["device"] == "cuda:1"


def test_the_recorders_exception_marker_alone_is_an_oom(tmp_path):
    msg = ("OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.18 "
           "GiB of which 1.25 GiB is free. Of the allocated memory 76.50 GiB is allocated by PyTorch")
    snap = sim_oom(ooms=0, error=msg)
    path = write(tmp_path, "marker.pickle", snap)
    code, out, _ = cli("check", path, "--max-peak", "100GiB")
    assert code == 1 and "out of memory when the recording ended" in out
    assert "asked for 2.0 GiB" in out and "1.2 GiB was free" in out
    d = build_report(load(path))["devices"][0]
    assert d["demand_bytes"] == 8 * MiB + 2 * 2**30 and d["demand_is_lower_bound"]


@pytest.mark.parametrize("error", ["CUDA out of memory (no sizes at all)", "RuntimeError: DefaultCPUAllocator: can't "
                                   "allocate memory: you tried to allocate 1234 bytes. Error code 12"])
def test_oom_markers_without_details(tmp_path, error):
    path = write(tmp_path, "m.pickle", sim_oom(ooms=0, error=error))
    code, out, err = cli("check", path)
    assert code == 1 and "out of memory" in out and "Traceback" not in err


def test_malformed_oom_markers_are_one_line_not_a_traceback(tmp_path):
    snap = sim_oom(ooms=0, error="x")
    snap["tracekit"]["error"] = {"not": "a string"}
    code, _, err = cli("check", write(tmp_path, "bad.pickle", snap))
    assert code == 2 and "error" in err and "Traceback" not in err and err.count("\n") == 1
    snap = sim_oom(ooms=1)
    del snap["device_traces"][0][-1]["device_free"]
    snap["device_traces"][0][-1]["size"] = 0  # an oom entry that says nothing
    code, out, err = cli("check", write(tmp_path, "bare.pickle", snap))
    assert code in (1, 2) and "Traceback" not in err
    if code == 1:
        assert "out of memory" in out and "size is not recorded" in out


def test_a_clean_file_with_an_allocator_counter_is_not_an_oom(tmp_path):
    snap = sim_oom(ooms=0, error=None)
    snap["tracekit"] = {"version": 1, "backend": "cuda", "devices": [
        {"index": 0, "type": "cuda", "name": "GPU", "total_memory": 2**34,
         "allocator_stats": {"memory_stats": {"num_ooms": 2}}}]}
    code, out, _ = cli("check", write(tmp_path, "c.pickle", snap))
    assert code == 0 and "note: cuda:0: the allocator counted 2 out-of-memory error(s)" in out


# -- 2. check without criteria, and usage errors ----------------------------------------------------------------
def test_check_without_criteria_checks_and_says_the_defaults():
    code, out, _ = cli("check", SAMPLES / "gpt_adamw.pickle")
    assert code == 0
    assert "checked: out of memory: none recorded; leaks (by default)" in out
    assert "not checked: peak allocated (--max-peak SIZE)" in out
    code, out, _ = cli("check", SAMPLES / "leak_loop.pickle")
    assert code == 1 and "leaking" in out.splitlines()[0]


@pytest.mark.parametrize("args,message", [
    (["--max-peak", "0"], "has no unit"), (["--max-reserved", "0B"], "above zero"), (["--max", "activation=0"], "has no unit"),
    (["--max", "activation=0MiB"], "above zero"),
    (["--max-peak", "-2GiB"], "not a size"), (["--max-peek", "1GiB"], "No such option"),
])
def test_usage_errors_exit_2(args, message):
    code, _, err = cli("check", SAMPLES / "gpt_adamw.pickle", *args)
    assert code == 2 and message in err and "Traceback" not in err


# -- 7. sizes with enough digits ----------------------------------------------------------------------------------
def test_over_budget_never_reads_equal():
    code, out, _ = cli("check", QWEN_AMP, "--max-reserved", "1GiB")
    assert code == 1
    reserved = TRUTH["qwen2_amp_adamw_b4_s256.pickle.gz"]["max_reserved"]  # torch.cuda.max_memory_reserved()
    assert reserved == 2**30 + 8 * MiB
    assert "peak reserved 1.01 GiB > 1.00 GiB (over by 8.0 MiB)" in out


def test_fmt_pair_tells_different_sizes_apart():
    from tracekit.units import fmt_pair

    rng = random.Random(23)
    for _ in range(5000):
        a = rng.randrange(1, 2**44)
        b = a + rng.choice([1, 7, 4096, 2**20, rng.randrange(1, 2**30)]) * rng.choice([1, -1])
        if b <= 0:
            continue
        x, y = fmt_pair(a, b)
        assert x != y, (a, b, x, y)
    assert fmt_pair(2**30, 2**30) == ("1.0 GiB", "1.0 GiB")


# -- 3. whatif never contradicts the file -------------------------------------------------------------------------
@pytest.mark.parametrize("budget", ["256MiB", "900MiB", "1GiB", "1000MiB"])
def test_whatif_never_says_the_oomd_batch_fits_its_own_device(budget):
    code, out, err = cli("whatif", OOM, "--budget", budget, "--json")
    assert code == 0, err
    r = json.loads(out)
    assert r["points"][0]["size"] == 8 and r["points"][0]["lower_bound"]
    lo, hi = r["largest_batch_range"]
    assert hi is not None and hi < 8 and r["largest_batch"] < 8  # it ran out of memory at batch 8 under 1 GiB
    assert any(c["kind"] == "failed" for c in r["constraints"])
    assert r["fit"]["extrapolation"] and lo <= r["largest_batch_estimate"] <= hi


def test_whatif_on_an_oomd_file_fits_from_the_demand():
    code, out, _ = cli("whatif", OOM, "--budget", "1GiB")
    assert code == 0
    assert "needed ≥ 1.04 GiB (out of memory with 1.00 GiB available)" in out
    assert "batch 8 and above do not fit 1.00 GiB" in out
    assert "an extrapolation from one recording" in out


def test_whatif_two_files_one_failing_under_the_budget(tmp_path):
    ok, bad = Sim(), Sim()
    ok.alloc(100 * MiB)
    bad.alloc(150 * MiB)
    bad.oom(60 * MiB, device_free=2**33)  # the device had room: the cap (200 MiB) stopped it
    snap_bad = bad.snapshot()
    snap_bad["tracekit"] = {"version": 1, "backend": "cuda", "devices": [
        {"index": 0, "type": "cuda", "name": "GPU", "total_memory": 2**34, "memory_limit_bytes": 200 * MiB}]}
    a, b = write(tmp_path, "a.pickle", ok.snapshot()), write(tmp_path, "b.pickle", snap_bad)
    for budget in ("150MiB", "200MiB", "210MiB"):  # at or under the failing device's cap (and 5% over it)
        code, out, err = cli("whatif", a, b, "--sizes", "4,8", "--budget", budget, "--json")
        assert code == 0, err
        r = json.loads(out)
        assert r["largest_batch"] < 8 and r["largest_batch_range"][1] < 8, budget
    code, out, _ = cli("whatif", a, b, "--sizes", "4,8", "--budget", "150MiB", "--json")
    assert json.loads(out)["largest_batch"] >= 4  # batch 4 ran within 150 MiB (100 MiB): it fits


def test_whatif_generation_grows_the_kv_cache_and_keeps_the_workspace_fixed():
    code, out, err = cli("whatif", GEN, "--sizes", "2", "--mode", "inference", "--budget", "1GiB", "--json")
    assert code == 0, err
    r = json.loads(out)
    truth = TRUTH["qwen2_generate_b2_p256_n128.pickle.gz"]
    cats = r["points"][0]["by_category"]
    assert cats["kv_cache"] == truth["kv_bytes_at_prefill"]  # 2 x layers x batch x kv_heads x head_dim x 2 B x prompt
    growing = sum(cats.get(c, 0) for c in ("activation", "input", "temporary", "kv_cache"))
    assert r["fit"]["per_unit_bytes"] == int(growing / 2)
    assert r["fit"]["per_unit_range"][0] >= truth["kv_bytes_at_prefill"] // 2  # the cache grows with the batch
    assert r["fit"]["fixed_bytes"] >= truth["param_bytes"]  # weights (and the cuBLAS workspace) are fixed
    lo, hi = r["largest_batch_range"]
    assert lo < hi and r["fit"]["extrapolation"]
    techniques = {lv["technique"] for lv in r["levers"]}
    assert not techniques & {"gradient accumulation", "8-bit optimizer state", "shard the optimizer state",
                             "LoRA adapters", "activation checkpointing", "fused / flash attention"}
    kv = next(lv for lv in r["levers"] if lv["technique"] == "quantize the KV cache")
    assert kv["saves_bytes"] == truth["kv_bytes_at_prefill"] // 2
    assert r["levers_for"]["facts"]["workload"] == "generation"
    assert r["levers_for"]["facts"]["attention"] == "flash"  # cuDNN SDPA kernels in the stacks
    assert r["levers_for"]["facts"]["blocks"] == truth["config"]["num_hidden_layers"]


@pytest.mark.parametrize("args,message", [(["--budget", "0B"], "above zero"), (["--budget", "-1GiB"], "not a size"),
                                          ([GEN, "--budget", "1GiB"], "give --sizes")])  # two files need sizes
def test_whatif_bad_input(args, message):
    code, _, err = cli("whatif", GEN, *args)
    assert code == 2 and message in err and "Traceback" not in err


# -- 4. one answer per lever ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("path,size", [(SAMPLES / "gpt_adamw_cuda.pickle", None), (SAMPLES / "gpt_adamw.pickle", None),
                                       (SAMPLES / "logits_spike_cuda.pickle", None), (QWEN_AMP, 4), (QWEN_CPU, 2),
                                       (OOM, None), (GEN, 2)])
def test_report_advice_and_whatif_levers_print_the_same_bytes(path, size):
    advice = {f["technique"]: f for f in build_report(load(path))["findings"] if f["kind"] == "advice"}
    assert advice
    code, out, err = cli("whatif", path, "--budget", "80GiB", "--json", *(["--sizes", size] if size else []))
    assert code == 0, err
    levers = {lv["technique"]: lv for lv in json.loads(out)["levers"]}
    for technique, f in advice.items():
        assert levers[technique]["saves_bytes"] == f["bytes"], technique
        if size is None:  # the same facts; --sizes only adds the batch the report does not know
            assert levers[technique]["assumes"] == f["assumes"]


@pytest.mark.parametrize("path,blocks", [(QWEN_AMP, 4), (CUDA / "opt_amp_adamw_b4_s256.pickle.gz", 6),
                                         (CUDA / "neox_amp_adamw_b4_s256.pickle.gz", 6), (QWEN_CPU, 3),
                                         (SAMPLES / "gpt_adamw_cuda.pickle", 4), (SAMPLES / "gpt_adamw.pickle", 2)])
def test_repeated_blocks_are_counted_from_the_stacks(path, blocks):
    from tracekit.analysis.levers import repeated_blocks

    got = repeated_blocks(load(path), 0)
    assert got["count"] == blocks and got["source"].startswith("the stacks")
    name = path.name
    if name in TRUTH:
        assert TRUTH[name]["config"]["num_hidden_layers"] == blocks


def test_attention_kind_comes_from_the_stacks():
    from tracekit.analysis.levers import attention_kind

    assert attention_kind(load(QWEN_AMP))["kind"] == "flash"  # SDPA (cuDNN) kernels
    assert attention_kind(load(QWEN_CPU))["kind"] == "eager"  # attn_implementation="eager"
    assert attention_kind(load(SAMPLES / "gpt_adamw_cpp_stacks_cuda.pickle"))["kind"] == "eager"  # C++ softmax
    assert attention_kind(load(SAMPLES / "gpt_adamw_cuda.pickle"))["kind"] is None  # Python stacks: no kernel seen
    # a user's own function named like a fused kernel is not one
    assert attention_kind(load(fixture("snapshot_cpp_frames_attention_fwd_bwd.pickle")))["kind"] != "flash"


def test_flash_lever_prices_the_scores_live_at_the_peak():
    """qwen2_train_cpu: eager attention, batch 2, 4 heads, seq 32: each scores tensor is 2 x 4 x 32 x 32 x 4 B."""
    code, out, _ = cli("whatif", QWEN_CPU, "--sizes", "2", "--budget", "1GiB", "--json")
    (f,) = [lv for lv in json.loads(out)["levers"] if lv["technique"] == "fused / flash attention"]
    snap = raw(QWEN_CPU)
    oracle = naive_replay(snap)
    live = {}
    for e in snap["device_traces"][0][:oracle["peak_index"] + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    scores = sum(e["size"] for e in live.values() if e["size"] == 2 * 4 * 32 * 32 * 4
                 and any(fr["name"] == "eager_attention_forward" for fr in e.get("frames", [])))
    assert scores > 0 and f["saves_bytes"] == scores


def test_levers_the_file_contradicts_are_not_offered():
    findings = build_report(load(QWEN_AMP))["findings"]
    assert not [f for f in findings if f.get("technique") == "fused / flash attention"]  # already SDPA
    assert not [f for f in build_report(load(SAMPLES / "gpt_checkpoint_cuda.pickle"))["findings"]
                if f.get("technique") == "activation checkpointing"]  # already checkpointed
    assert not [f for f in build_report(load(SAMPLES / "lora_cuda.pickle"))["findings"]
                if f.get("technique") == "LoRA adapters"]  # already LoRA
    for f in findings:
        if f["kind"] == "advice":
            assert "8 or more" not in f["assumes"]


def test_estimate_config_says_the_measured_split_is_inferred(tmp_path):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(TRUTH["qwen2_amp_adamw_b4_s256.pickle.gz"]["config"]))
    code, out, _ = cli("report", QWEN_AMP, "--estimate-config", cfg, "--precision", "amp", "--batch", "4", "--seq", "256")
    assert code == 0
    block = out.split("predicted vs measured", 1)[1]
    row = next(x for x in block.splitlines() if x.strip().startswith("parameter "))
    assert row.rstrip().endswith("(inferred)")
    assert "the measured split is inferred, not measured by tags, for 100% of the bytes at the peak" in out
    e = build_report(load(SAMPLES / "gpt_adamw.pickle"))["devices"][0]["estimate"]
    rows = {r["category"]: r for r in e["categories"]}
    assert rows["parameter"]["inferred_share"] == 0  # tagged by the recorder


# -- 5. leaks are growth, not noise -------------------------------------------------------------------------------
def test_a_batch_held_by_its_variable_is_not_a_leak():
    code, out, _ = cli("check", QWEN_CPU, "--no-leaks")
    assert code == 0, out
    snap = raw(QWEN_CPU)
    d = build_report(load(QWEN_CPU))["devices"][0]
    curve = naive_replay(snap)["curve"]
    ends = [curve[it["end_index"]] for it in d["iterations"]]
    assert len(ends) == 3 and len(set(ends)) == 1  # memory at the iteration ends is the same to the byte


def test_a_real_leak_is_still_found_with_its_rate_and_line():
    (f,) = [f for f in build_report(load(SAMPLES / "leak_loop.pickle"))["findings"] if f["kind"] == "leak"]
    curve = naive_replay(raw(SAMPLES / "leak_loop.pickle"))["curve"]
    ends = [curve[i] for i in f["iteration_end_indices"]]
    assert f["bytes"] == round((ends[-1] - ends[1]) / (len(ends) - 2))
    assert f["bytes"] >= 2 * MiB and f["frames"] and f["evidence"]["events"] == f["iteration_end_indices"]


def test_sustained_growth():
    from tracekit.analysis.leaks import fmt_distinct, sustained_growth

    assert sustained_growth([5, 10, 10, 10]) is None
    assert sustained_growth([5, 10, 12, 14, 16]) == 2
    assert sustained_growth([5, 10, 30, 10, 11]) is None  # one jump that falls back is not sustained
    assert fmt_distinct([2**20, 2**20 + 512, 2**20 + 1024]) == ["1.0000 MiB", "1.0005 MiB", "1.0010 MiB"]


# -- 6. every finding carries its evidence -----------------------------------------------------------------------
@pytest.mark.parametrize("path", [OOM, SAMPLES / "leak_loop.pickle", SAMPLES / "logits_spike_cuda.pickle", QWEN_CPU])
def test_every_finding_has_evidence(path):
    report = build_report(load(path))
    n = {d["device"]: d["entries"] for d in report["devices"]}
    for f in report["findings"]:
        ev = f["evidence"]
        assert ev["rule"], f["kind"]
        assert all(0 <= i < n[f["device"]] for i in ev["events"]), f["kind"]
    code, out, _ = cli("report", path)
    assert out.count("evidence: ") == len([f for f in report["findings"] if f["kind"] != "peak"])


# -- the other front ends ------------------------------------------------------------------------------------------
def test_diff_and_ranks_show_the_demand(tmp_path):
    code, out, _ = cli("diff", SAMPLES / "gpt_adamw_cuda.pickle", OOM)
    assert code == 0 and "needed (out of memory)" in out and "≥ 1.0 GiB" in out
    from tracekit.analysis.ranks import rank_table, summarize

    rows = rank_table([summarize(load(SAMPLES / "gpt_adamw_cuda.pickle")), summarize(load(OOM))], ["a", "b"])["ranks"]
    assert rows[1]["demand_is_lower_bound"] and rows[1]["peak_allocated_bytes"] == build_report(load(OOM))["devices"][0]["demand_bytes"]
    from tracekit.render import reporter

    text = reporter("ranks", "text").render({**rank_table([summarize(load(OOM))], [str(OOM)]), "from_summaries": 0,
                                             "analysed": 1})
    assert "≥ 1.0 GiB" in text and "ran out of memory" in text


def test_legacy_observer_dump_says_what_it_cannot_tell():
    """torch 2.0's one-entry ring buffer kept only the dump's own `snapshot` entry: nothing says it was an OOM."""
    code, out, _ = cli("check", fixture("snapshot_legacy_torch20_oom_observer.pickle"))
    assert code == 0 and "out of memory: none recorded" in out
    assert "holds no allocator history" in out


def test_generation_truth_files_are_not_oom():
    for name in ("qwen2_amp_adamw_b4_s256.pickle.gz", "qwen2_generate_b2_p256_n128.pickle.gz"):
        d = build_report(load(CUDA / name))["devices"][0]
        assert not d["demand_is_lower_bound"] and d["demand_bytes"] == d["peak_allocated_bytes"]


def test_fixture_recording_is_gzip_of_a_recorder_file():
    with gzip.open(QWEN_CPU, "rb") as fh:
        head = fh.read(2)
    assert head[:1] == b"\x80"  # a pickle, as `tracekit record` writes it
    t = load(QWEN_CPU)
    assert t.recorder["model"]["class"].endswith("Qwen2ForCausalLM") and t.recorder["command"]


def test_to_trace_of_an_oom_snapshot_in_memory():
    snap = sim_oom()
    report = build_report(to_trace(snap, "x"))
    (f,) = [f for f in report["findings"] if f["kind"] == "oom"]
    assert f["needed_bytes"] == 8 * MiB + 32 * MiB and f["request_bytes"] == 32 * MiB and f["device_free_bytes"] == MiB
