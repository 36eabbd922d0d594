"""The CUDA samples (samples/*_cuda.pickle), recorded by our recorder on an H100 (samples/README.md).

Checked on any machine, against figures the GPU gave independently: torch.cuda.max_memory_allocated()
and max_memory_reserved() stored by the recorder in the same run, the allocator's final segments
(replay invariant), and the recorder's tags (categories inferred with the tags stripped).
"""
import json

import numpy as np
import pytest

import tracekit
from tracekit.analysis.categories import categorize
from tracekit.analysis.replay import replay
from tracekit.analysis.report import build_report
from tracekit.io import read_document, to_trace

from .conftest import SAMPLES

CUDA = sorted(p.name for p in SAMPLES.glob("*_cuda.pickle"))


def test_the_cuda_samples_are_there():
    assert len(CUDA) == 8, CUDA


def _device(name):
    trace = tracekit.load(SAMPLES / name, use_cache=False)
    return trace, build_report(trace)


@pytest.mark.parametrize("name", CUDA)
def test_peaks_equal_the_allocators_own(name):
    trace, rep = _device(name)
    d = rep["devices"][0]
    stats = d["allocator_stats"]
    assert trace.recorder["backend"] == "cuda" and d["label"] == "cuda:0"
    assert d["replay_invariant"]["ok"], d["replay_invariant"]["problems"]
    assert d["peak_allocated_block_bytes"] == stats["max_memory_allocated"]
    assert d["peak_reserved_bytes"] == stats["max_memory_reserved"]


@pytest.mark.parametrize("name", [n for n in CUDA if n != "oom_cuda.pickle"])
def test_phases_and_iterations_cover_autograd_threads(name):
    """CUDA's metadata string is per thread: backward's allocations carry none, yet every entry of a
    recorded step has its phase and iteration (from the recorder's intervals)."""
    trace, rep = _device(name)
    d = rep["devices"][0]
    assert d["peak_phase"] in ("forward", "backward", "optimizer")
    its = [row["iteration"] for row in d["iterations"]]
    assert its == sorted(set(its)), its  # each iteration once, in order
    blank = [i for i, e in enumerate(read_document(SAMPLES / name)[0]["device_traces"][0])
             if e["action"] == "alloc" and not e.get("user_metadata")]
    assert blank  # the case exists in the file


@pytest.mark.parametrize("name", CUDA)
def test_categories_without_tags_agree_with_the_tags(name):
    """Bytes live at the peak whose category the tags give: inferred with the tags stripped, >= 95% agree."""
    full = tracekit.load(SAMPLES / name, use_cache=False)
    snap, _ = read_document(SAMPLES / name)
    snap["tracekit"]["tags"] = []
    stripped = to_trace(snap, str(SAMPLES / name))
    rep = replay(full)[0]
    live = rep.allocations.live_at(rep.peak_index)
    truth = categorize(full)[0].tagged.astype(np.int64)
    guess = categorize(stripped)[0].labels.astype(np.int64)
    w = rep.allocations.size * live * (truth >= 0)
    assert w.sum() > 0.15 * (rep.allocations.size * live).sum()  # tags cover 20-77% of these peaks
    assert float(w[guess == truth].sum()) / float(w.sum()) >= 0.95


@pytest.mark.parametrize("name", [n for n in CUDA if "cpp" not in n and "oom" not in n])
def test_backward_allocations_name_their_forward_line(name):
    """Backward allocations (made on autograd's thread, no Python frames) carry the forward op's stack."""
    snap, _ = read_document(SAMPLES / name)
    frameless = [e for e in snap["device_traces"][0] if e["action"] == "alloc" and not e.get("frames")]
    named = [e for e in frameless if e.get("forward_frames")]
    assert frameless and len(named) >= 0.75 * len(frameless)  # 80-100% on these samples


def test_oom_post_mortem_names_request_limit_and_live_lines():
    _, rep = _device("oom_cuda.pickle")
    (oom,) = [f for f in rep["findings"] if f["kind"] == "oom"]
    assert oom["bytes"] == 512 * 2**20 and oom["where"].startswith("samples/cuda_train.py:95")
    assert oom["limit_bytes"] == 2**30 and "may use only 1.00 GiB" in oom["summary"]  # with the need beside it: 1.04 GiB
    assert oom["device_free_bytes"] > 70 * 2**30
    assert oom["live_by_category"]["activation"] > oom["live_by_category"]["parameter"] > 0
    assert "record/toy.py:52 in forward" in oom["top_stacks"][0]["where"]  # the logits
    assert sum(s["bytes"] for s in oom["top_stacks"]) <= oom["allocated_bytes"]


def test_leak_and_spike_samples():
    _, leak = _device("leak_loop_cuda.pickle")
    (f,) = [f for f in leak["findings"] if f["kind"] == "leak"]
    # each step keeps its fp32 logits (batch 8 x seq 128 x vocab 8192 x 4 B) and a new 4-byte running loss
    assert f["bytes_per_iteration"] == [8 * 128 * 8192 * 4 + 4] * 4
    _, spike = _device("logits_spike_cuda.pickle")
    wheres = [f["where"] for f in spike["findings"] if f["kind"] in ("spike", "peak")]
    assert any("samples/cuda_train.py:96" in w for w in wheres), wheres
    for name in ("gpt_adamw_cuda.pickle", "lora_cuda.pickle"):  # a 4-byte loss kept per step is no leak
        assert not [f for f in _device(name)[1]["findings"] if f["kind"] == "leak"]


def test_losses_were_bit_identical_on_the_gpu():
    """What the GPU run printed (samples/cuda_results.jsonl): recorded losses equal unrecorded ones bit for bit."""
    rows = [json.loads(line) for line in (SAMPLES / "cuda_results.jsonl").read_text().splitlines()]
    assert {r["name"] + ".pickle" for r in rows} == set(CUDA)
    for r in rows:
        assert r["gpu_deterministic"] and r["bit_identical"], r["name"]
