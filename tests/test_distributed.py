"""What a rank holds under FSDP2 and DDP: real 2-rank torchrun jobs over gloo on the CPU, recorded by
`tracekit record`, checked against the analytic bytes per rank (fp32, AdamW, N = 2 ranks, P parameters:
shards 4P/N, optimizer state 8P/N); FSDP1 / DeepSpeed / DDP frame rules on synthetic snapshots; the rank
table's wording; `estimate --fsdp N`."""
import json
import os
import shutil
import signal
import subprocess
import sys

import pytest

from tracekit.analysis.categories import categorize
from tracekit.analysis.distributed import frame_role, PARAM, UNSHARD, REDUCE, COMM, NONE, GRAD, STATE
from tracekit.analysis.ranks import imbalance
from tracekit.analysis.report import build_report
from tracekit.io.reading import load
from tracekit.io.snapshot import snapshot_to_trace
from tracekit.render.ranks import imbalance_lines

from .synth import Sim

HERE = os.path.dirname(os.path.abspath(__file__))
WORLD = 2


def _run_job(out, mode):
    """torchrun, 2 ranks, gloo: `python -m torch.distributed.run ... -m tracekit record -o OUT -- python fsdp_train.py`."""
    pytest.importorskip("torch.distributed")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(
        [os.path.dirname(HERE)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(WORLD),
           "-m", "tracekit", "record", "-o", os.path.join(out, f"{mode}.pickle"), "--",
           sys.executable, os.path.join(HERE, "fsdp_train.py"), mode]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, cwd=out,
                         start_new_session=True)
    try:
        text, _ = p.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        raise
    assert p.returncode == 0, text[-4000:]
    facts = [json.loads(line.split(" ", 1)[1]) for line in text.splitlines() if line.startswith("TRACEKIT_FACTS ")]
    assert len(facts) == 1, text[-4000:]
    assert all(os.path.exists(os.path.join(out, f"{mode}.rank{r}.pickle")) for r in range(WORLD)), text[-4000:]
    return facts[0], {r: os.path.join(out, f"{mode}.rank{r}.pickle") for r in range(WORLD)}


@pytest.fixture(scope="module")
def fsdp_job(tmp_path_factory):
    pytest.importorskip("torch.distributed.fsdp")
    return _run_job(str(tmp_path_factory.mktemp("fsdp")), "fsdp")


@pytest.fixture(scope="module")
def fsdp_bf16_job(tmp_path_factory):
    pytest.importorskip("torch.distributed.fsdp")
    return _run_job(str(tmp_path_factory.mktemp("fsdp_bf16")), "fsdp-bf16")


@pytest.fixture(scope="module")
def fsdp1_job(tmp_path_factory):
    pytest.importorskip("torch.distributed.fsdp")
    return _run_job(str(tmp_path_factory.mktemp("fsdp1")), "fsdp1")


@pytest.fixture(scope="module")
def ddp_job(tmp_path_factory):
    return _run_job(str(tmp_path_factory.mktemp("ddp")), "ddp")


def _device(path):
    report = build_report(load(path))
    (d,) = report["devices"]
    return d


def test_fsdp2_each_rank_holds_its_shards(fsdp_job):
    facts, files = fsdp_job
    P, N = facts["params"], facts["world_size"]
    unit = 4 * max(facts["units"])  # one block's full fp32 parameters
    for rank, path in files.items():
        d = _device(path)
        at = d["categories_at_peak"]
        peak = d["peak_allocated_bytes"]
        assert at.get("parameter", 0) == pytest.approx(4 * P / N, rel=0.05), (rank, at)
        assert at.get("optimizer_state", 0) == pytest.approx(8 * P / N, rel=0.05), (rank, at)
        assert unit <= at.get("unsharded_parameter", 0) <= 3 * unit, (rank, at)
        assert at.get("other", 0) <= 0.02 * peak, (rank, at)
        backward = [p for p in d["phases"] if p["phase"] == "backward"]
        assert backward and backward[0]["categories_at_peak"].get("gradient", 0) > 0, backward
        # the gradient shards the step ends with: 4P/N (the reduce-scatter outputs, kept to the optimizer step)
        optim = [p for p in d["phases"] if p["phase"] == "optimizer"][0]["categories_at_peak"]
        assert optim.get("gradient", 0) == pytest.approx(4 * P / N, rel=0.05), optim
        h = d["distributed"]
        assert h["strategy"] == "fsdp2" and h["world_size"] == N and h["share"] == "1/2"
        assert h["parameter_bytes"] == 4 * P and h["local_parameter_bytes"] == pytest.approx(4 * P / N, rel=0.01)
        assert 1 <= h["unsharded_units_at_peak"] <= 3
        assert h["summary"].startswith(f"rank {rank} holds 1/2 of the parameters (")


def test_fsdp2_by_frames_alone(fsdp_job):
    """The same file with the recorder's tags removed (a file recorded elsewhere): shards by FSDP2's frames,
    gradient shards by the reduce-scatter's frames and lifetime, state by phases."""
    facts, files = fsdp_job
    P, N = facts["params"], facts["world_size"]
    trace = load(files[0])
    trace.recorder["tags"] = []
    d = build_report(trace)["devices"][0]
    at = d["categories_at_peak"]
    assert at["parameter"] == pytest.approx(4 * P / N, rel=0.01)
    assert at["optimizer_state"] == pytest.approx(8 * P / N, rel=0.05)
    assert at.get("other", 0) <= 0.02 * d["peak_allocated_bytes"]
    optim = [p for p in d["phases"] if p["phase"] == "optimizer"][0]["categories_at_peak"]
    assert optim["gradient"] == pytest.approx(4 * P / N, rel=0.01)
    why = {r["reason"] for r in d["reasons_at_peak"]}
    assert "this rank's parameter shard (FSDP2 sharding, by frames)" in why


def test_fsdp2_levers_price_what_the_rank_holds(fsdp_job):
    from tracekit.analysis.levers import file_facts, levers

    facts, files = fsdp_job
    trace = load(files[0])
    d = _device(files[0])
    at = d["categories_at_peak"]
    got = {lv["technique"]: lv for lv in levers(file_facts(trace, 0, d), at, d["peak_allocated_bytes"])}
    assert got["FSDP CPU offload"]["saves_bytes"] == at["parameter"] + at.get("gradient", 0) + at["optimizer_state"]
    assert got["FSDP prefetch depth"]["saves_bytes"] == d["distributed"]["prefetched_bytes_at_peak"] > 0
    assert got["FSDP mixed-precision parameters"]["saves_bytes"] == (at["unsharded_parameter"]
                                                                      + at.get("communication", 0)) // 2
    assert "shard the optimizer state" not in got  # this rank's state is sharded already


def test_fsdp2_predicted_vs_measured_is_sharded(fsdp_job):
    facts, files = fsdp_job
    P, N = facts["params"], facts["world_size"]
    e = _device(files[0])["estimate"]
    assert e["setup"]["zero"] == 3 and e["setup"]["dp"] == N and e["setup"]["fsdp"]
    rows = {r["category"]: r for r in e["categories"]}
    assert rows["parameter"]["predicted"] == pytest.approx(4 * P / N, rel=0.01)
    assert rows["parameter"]["measured"] == pytest.approx(4 * P / N, rel=0.05)
    assert rows["optimizer_state"]["predicted"] == pytest.approx(8 * P / N, rel=0.01)
    assert rows["gradient"]["predicted"] == pytest.approx(4 * P / N, rel=0.01)


def test_fsdp2_rank_table_reads_right(fsdp_job):
    from click.testing import CliRunner

    from tracekit.cli import cli as main

    facts, files = fsdp_job
    out = CliRunner().invoke(main, ["report", os.path.dirname(files[0])])
    assert out.exit_code == 0, out.output
    text = out.output
    for rank in range(WORLD):
        assert f"rank {rank} holds 1/2 of the parameters" in text
    assert "unsharded_parameter" in text and "communication" in text  # columns of the table
    imb = [ln for ln in text.splitlines() if ln.startswith(("Imbalance", "Balanced"))]
    # equal ranks read "Balanced: both ranks peak at X (to the byte)."; unequal ones name two different ranks
    assert imb and all(ln.count("(rank 0)") < 2 and ln.count("(rank 1)") < 2 for ln in imb), imb
    assert imb[0].startswith("Balanced: both ranks peak at") or "(rank 0) to" in imb[0] or "(rank 1) to" in imb[0]


def test_fsdp2_bf16_units_kept_after_forward(fsdp_bf16_job):
    """MixedPrecisionPolicy(param_dtype=bfloat16), blocks not resharded after forward: shards stay fp32 (4P/N),
    units are all-gathered in bf16 (2 B per parameter), and the advice says to reshard after forward."""
    facts, files = fsdp_bf16_job
    P, N = facts["params"], facts["world_size"]
    trace = load(files[0])
    info = trace.recorder["distributed"]
    gathered = {u["name"]: u["bytes"] for u in info["unsharded_units"]}
    assert gathered["blocks.0"] == 2 * facts["units"][0] and gathered["(root)"] == 2 * facts["root"]
    assert [u["reshard_after_forward"] for u in info["units"] if u["name"].startswith("blocks.")] == [False] * 4
    d = _device(files[0])
    at = d["categories_at_peak"]
    assert at["parameter"] == pytest.approx(4 * P / N, rel=0.05)
    assert at["optimizer_state"] == pytest.approx(8 * P / N, rel=0.05)
    assert at.get("other", 0) <= 0.02 * d["peak_allocated_bytes"]
    assert d["distributed"]["unsharded_units_at_peak"] >= 2  # blocks kept from forward to backward
    advice = {f["technique"] for f in build_report(trace)["findings"] if f["kind"] == "advice"}
    assert "FSDP mixed-precision parameters" not in advice  # bf16 already


def test_fsdp1_flat_parameters(fsdp1_job):
    """FullyShardedDataParallel: the flat parameter's shard is `parameter` (4P/N), the padded unsharded flat
    parameters all-gathered for compute are `unsharded_parameter` (the recorder tags them after each unshard)."""
    facts, files = fsdp1_job
    P, N = facts["params"], facts["world_size"]
    unit = 4 * max(facts["units"])
    for rank, path in files.items():
        d = _device(path)
        at = d["categories_at_peak"]
        assert at["parameter"] == pytest.approx(4 * P / N, rel=0.05), at
        assert at["optimizer_state"] == pytest.approx(8 * P / N, rel=0.05), at
        assert unit <= at.get("unsharded_parameter", 0) <= 3 * unit, at
        assert at.get("other", 0) <= 0.02 * d["peak_allocated_bytes"], at
        assert d["distributed"]["strategy"] == "fsdp" and d["distributed"]["share"] == "1/2"


def test_ddp_each_rank_holds_everything_and_its_buckets(ddp_job):
    facts, files = ddp_job
    P = facts["params"]
    for rank, path in files.items():
        d = _device(path)
        at = d["categories_at_peak"]
        assert at.get("parameter", 0) == pytest.approx(4 * P, rel=0.05), at
        assert at.get("optimizer_state", 0) == pytest.approx(8 * P, rel=0.05), at
        # gradient_as_bucket_view=False: DDP's buckets are a second copy of the gradients (4P), made in its pre-forward
        assert at.get("communication", 0) == pytest.approx(4 * P, rel=0.05), at
        assert at.get("other", 0) <= 0.02 * d["peak_allocated_bytes"], at
        h = d["distributed"]
        assert h["strategy"] == "ddp" and h["share"] == "all"
        assert h["summary"].startswith(f"rank {rank} holds all of the parameters")
        levers = {f["technique"]: f for f in build_report(load(path))["findings"] if f["kind"] == "advice"}
        assert levers["DDP gradient_as_bucket_view"]["bytes"] == pytest.approx(4 * P, rel=0.05)
        assert "shard the optimizer state" in levers  # DDP keeps whole state: sharding is advice


# -- frame rules on snapshots recorded anywhere (FSDP1, DeepSpeed, DDP, c10d) -----------------------
def _f(filename, name, line=1):
    return {"filename": filename, "line": line, "name": name}


SITE = "/usr/lib/python3/site-packages/"
USER = _f("train.py", "main", 40)


def test_frame_roles():
    fs1 = SITE + "torch/distributed/fsdp/_flat_param.py"
    assert frame_role(fs1, "_alloc_padded_unsharded_flat_param")[0] == UNSHARD
    assert frame_role(fs1, "flatten_tensors_into_flat_param")[0] == PARAM
    assert frame_role(SITE + "torch/distributed/fsdp/_runtime_utils.py", "_reduce_grad")[0] == REDUCE
    ds = SITE + "deepspeed/runtime/zero/"
    assert frame_role(ds + "partition_parameters.py", "_partition_param")[0] == PARAM
    assert frame_role(ds + "partition_parameters.py", "_allgather_params")[0] == UNSHARD
    assert frame_role(ds + "stage_1_and_2.py", "copy_grads_in_partition")[0] == GRAD
    assert frame_role(ds + "stage3.py", "_create_fp32_partitions")[0] == STATE
    assert frame_role(ds + "stage3.py", "reduce_ipg_grads")[0] == COMM
    assert frame_role(SITE + "torch/nn/parallel/distributed.py", "_ddp_init_helper")[0] == COMM
    assert frame_role(SITE + "torch/nn/parallel/distributed.py", "_pre_forward")[0] == COMM  # bucket rebuild
    assert frame_role(SITE + "torch/nn/parallel/distributed.py", "forward")[0] != COMM  # runs the user's model
    assert frame_role(SITE + "torch/distributed/fsdp/_runtime_utils.py", "_pre_forward")[0] != COMM
    assert frame_role("train.py", "forward")[0] == NONE


def test_fsdp1_deepspeed_ddp_by_frames():
    """A snapshot with no tags: FSDP1 and ZeRO-3 allocations by their frames (innermost first, as torch writes
    them); the user's compute under FSDP1's forward wrapper is not a collective buffer."""
    fs1 = SITE + "torch/distributed/fsdp/"
    ds = SITE + "deepspeed/runtime/zero/"
    s = Sim()
    shard = s.alloc(4096, frames=[_f(fs1 + "_flat_param.py", "flatten_tensors_into_flat_param"),
                                  _f(fs1 + "_flat_param.py", "__init__"), USER])
    part = s.alloc(2048, frames=[_f(ds + "partition_parameters.py", "_partition_param"), USER])
    full = s.alloc(8192, frames=[_f(fs1 + "_flat_param.py", "_alloc_padded_unsharded_flat_param"),
                                 _f(fs1 + "_flat_param.py", "unshard"), _f(fs1 + "_runtime_utils.py", "_unshard"),
                                 USER])
    gathered = s.alloc(4096, frames=[_f(ds + "partition_parameters.py", "_allgather_params"), USER])
    act = s.alloc(1024, frames=[_f("model.py", "forward", 7), _f(fs1 + "fully_sharded_data_parallel.py", "forward"),
                                USER])
    staging = s.alloc(8192, frames=[_f(fs1 + "_runtime_utils.py", "_get_reduce_scatter_tensors"),
                                    _f(fs1 + "_runtime_utils.py", "_reduce_grad"), USER])
    bucket = s.alloc(16384, frames=[_f("c10d::Reducer::initialize_buckets", "c10d::Reducer::initialize_buckets", 0),
                                    _f(SITE + "torch/nn/parallel/distributed.py", "_ddp_init_helper"), USER])
    gshard = s.alloc(4096, frames=[_f(fs1 + "_runtime_utils.py", "_reduce_grad"), USER])
    s.free(staging)
    s.free(full)
    s.free(gathered)
    trace = snapshot_to_trace(s.snapshot(), "synthetic")
    cats = categorize(trace)[0]
    from tracekit.analysis.replay import replay

    al = replay(trace)[0].allocations
    got = {int(a): cats.names[c] for a, c in zip(al.addr.tolist(), cats.labels.tolist())}
    assert got[shard] == "parameter" and got[part] == "parameter"
    assert got[full] == "unsharded_parameter" and got[gathered] == "unsharded_parameter"
    assert got[staging] == "communication" and got[bucket] == "communication"
    assert got[gshard] == "gradient"  # the reduce-scatter's output, alive past the pass that made it
    assert got[act] != "communication"


# -- the rank table's wording ---------------------------------------------------------------------------
def _row(rank, peak, **cats):
    return {"rank": rank, "peak_allocated_bytes": peak, "categories_at_peak": cats}


def test_equal_ranks_read_balanced():
    peak = int(156.1 * 2**20)
    imb = imbalance([_row(0, peak, parameter=peak), _row(1, peak, parameter=peak)])
    assert imb["min_rank"] != imb["max_rank"] and imb["equal"]
    lines = imbalance_lines(imb)
    assert lines == ["Balanced: both ranks peak at 156.1 MiB (to the byte)."]
    imb = imbalance([_row(r, peak) for r in range(4)])
    assert imbalance_lines(imb) == ["Balanced: all 4 ranks peak at 156.1 MiB (to the byte)."]


def test_close_ranks_get_enough_digits():
    a = int(156.1 * 2**20)
    imb = imbalance([_row(0, a), _row(1, a + 12000)])
    line = imbalance_lines(imb)[0]
    assert line.startswith("Imbalance: peaks from 156.10 MiB (rank 0) to 156.11 MiB (rank 1)"), line
    assert "Balanced: no rank" in imbalance_lines(imb)[1]


# -- estimate --fsdp N ----------------------------------------------------------------------------------
def test_estimate_fsdp_per_gpu():
    from tracekit.analysis.estimate import Setup, estimate
    from tracekit.analysis.estimate.memory import fsdp_units
    from tracekit.analysis.estimate.shapes import ModelShape

    shape = ModelShape(hidden=1024, layers=8, heads=16, vocab=32000)
    P, N = shape.params(), 8
    est = estimate(shape, Setup(precision="fp32", optimizer="adamw", zero=3, dp=N, fsdp=True, seq=0))
    held = est.held("gpu")
    assert held["parameter"] == pytest.approx(4 * P / N, abs=2)
    shards = [ln for ln in est.lines if ln.key == "grad_shards"]
    assert sum(ln.bytes for ln in shards) == pytest.approx(4 * P / N, abs=2)
    # in backward the root unit holds the output layer's full gradient until it reduce-scatters, at the end
    head = [ln for ln in est.lines if ln.key == "fsdp_head_grad"]
    assert [ln.bytes for ln in head] == [4 * 32000 * 1024]
    assert held["optimizer_state"] == pytest.approx(8 * P / N, abs=2)
    layers, per_layer, root = fsdp_units(shape)
    assert layers == 8 and layers * per_layer + root == P
    at = {m["name"]: m["per_gpu"] for m in est.moments()}
    assert at["loss forward"]["unsharded_parameter"] == 4 * root  # the root only: each layer resharded
    assert at["loss forward"]["communication"] == 4 * per_layer  # the last all-gather's output, kept
    assert at["output layer backward"]["gradient"] == 4 * 32000 * 1024  # no layer's gradients yet
    # layer 6's backward: the root and layer 6 unsharded; layer 5 prefetched (its all-gather output) and layer 7's
    # reduce-scatter input; layer 7's gradient shards
    mid = at["layer 6 backward, MLP"]
    assert mid["unsharded_parameter"] == 4 * root + 4 * per_layer
    assert mid["communication"] == 4 * per_layer + 4 * per_layer
    assert at["layer 6 backward, end"]["gradient"] == pytest.approx(4 * 32000 * 1024 + 4 * per_layer
                                                                     + 4 * per_layer / N, abs=2)
    assert at["optimizer step"]["gradient"] == pytest.approx(4 * P / N, abs=2)
    assert est.peak_moment["name"] in at
    no_prefetch = {m["name"]: m["per_gpu"] for m in
                   estimate(shape, Setup(precision="fp32", zero=3, dp=N, fsdp=True, prefetch=0)).moments()}
    assert mid["communication"] - no_prefetch["layer 6 backward, MLP"]["communication"] == 4 * per_layer
    keep = {m["name"]: m["per_gpu"] for m in estimate(
        shape, Setup(precision="fp32", zero=3, dp=N, fsdp=True, reshard_after_forward=False)).moments()}
    assert keep["loss backward"]["unsharded_parameter"] == 4 * P  # every unit unsharded from forward to backward
    assert keep["layer 6 backward, MLP"]["unsharded_parameter"] == 4 * root + 7 * 4 * per_layer
    # MixedPrecisionPolicy(bf16, reduce fp32): fp32 shards, gradients and AdamW state; bf16 units
    mp = estimate(shape, Setup(precision="mixed", zero=3, dp=N, fsdp=True))
    assert mp.held("gpu")["parameter"] == pytest.approx(4 * P / N, abs=2)
    assert mp.held("gpu")["optimizer_state"] == pytest.approx(8 * P / N, abs=2)
    assert {m["name"]: m["per_gpu"] for m in mp.moments()}["layer 6 backward, MLP"]["unsharded_parameter"] == \
        2 * root + 2 * per_layer


def test_estimate_fsdp_cli():
    from click.testing import CliRunner

    from tracekit.cli import cli as main

    args = ["estimate", "--hidden", "1024", "--layers", "8", "--heads", "16", "--vocab", "32000", "--precision",
            "fp32", "--fsdp", "8", "--json"]
    out = CliRunner().invoke(main, args)
    assert out.exit_code == 0, out.output
    got = json.loads(out.output)
    assert got["setup"]["zero"] == 3 and got["setup"]["dp"] == 8 and got["setup"]["fsdp"]
    p = got["params"]
    assert got["held_gpu"]["parameter"] == pytest.approx(4 * p / 8, abs=2)
    assert got["held_gpu"]["optimizer_state"] == pytest.approx(8 * p / 8, abs=2)
    assert got["held_gpu"]["unsharded_parameter"] > 0
    text = CliRunner().invoke(main, args[:-1]).output
    assert "unsharded_parameter" in text and "/ dp 8 (FSDP)" in text
    bad = CliRunner().invoke(main, args[:-2] + ["1"])
    assert bad.exit_code == 2
