"""Findings on recordings with planted problems: leaks, spikes, and the clean loops that have neither.

Each workload is tiny and recorded with tracekit's CPU recorder; the lines the
findings must point at are found by their marker comments in this file.
"""
import inspect

import pytest

torch = pytest.importorskip("torch")
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from tests.conftest import SAMPLES  # noqa: E402
from tests.oracle import naive_replay  # noqa: E402
from tests.synth import MiB, Sim  # noqa: E402
from tracekit import load  # noqa: E402
from tracekit.analysis.report import build_report  # noqa: E402
from tracekit.io import read_document, to_trace  # noqa: E402
from tracekit.record import record  # noqa: E402

HERE = __file__


def line_of(marker):
    for i, text in enumerate(inspect.getsource(inspect.getmodule(line_of)).splitlines(), 1):
        if f"# {marker}" in text:
            return i
    raise AssertionError(marker)


def train(path, leak=False, steps=5, set_to_none=True):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 256), nn.ReLU(), nn.Linear(256, 64))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    kept = []
    with record(path, model=model, optimizer=opt, backend="cpu") as rec:
        for _ in range(steps):
            x = torch.randn(32, 64)
            out = model(x)
            loss = out.square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
            if leak:
                kept.append(out.detach().clone())  # LEAK (a method call: the CPU profiler knows its line)
            rec.step()
    return path


def upcast_loss(logits, targets):
    logits32 = logits.float()  # SPIKE
    return F.cross_entropy(logits32, targets)


def train_spiky(path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 8192)).to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with record(path, model=model, optimizer=opt, backend="cpu") as rec:
        for _ in range(3):
            x = torch.randn(64, 32, dtype=torch.bfloat16)
            y = torch.randint(0, 8192, (64,))
            loss = upcast_loss(model(x), y)
            loss.backward()
            opt.step()
            opt.zero_grad()
            rec.step()
    return path


def findings(path, kind):
    return [f for f in build_report(load(path))["findings"] if f["kind"] == kind]


@pytest.fixture(scope="module")
def recordings(tmp_path_factory):
    d = tmp_path_factory.mktemp("rec")
    return {"leaky": train(str(d / "leaky.pickle"), leak=True),
            "clean": train(str(d / "clean.pickle")),
            "clean_keep_grads": train(str(d / "clean2.pickle"), set_to_none=False),
            "spiky": train_spiky(str(d / "spiky.pickle"))}


def test_planted_leak_is_found_at_its_line(recordings):
    leaks = findings(recordings["leaky"], "leak")
    assert len(leaks) == 1
    f = leaks[0]
    assert f["frames"][0]["filename"].endswith("test_findings.py")
    assert f["frames"][0]["line"] == line_of("LEAK")
    # 32 x 64 fp32 kept per step, counted independently from the raw entries
    assert f["bytes_per_iteration"] == [32 * 64 * 4] * len(f["bytes_per_iteration"])
    assert len(f["bytes_per_iteration"]) == 3  # iterations 1..3 of 0..4 can be judged
    snap, _ = read_document(recordings["leaky"])
    kept = [e for e in snap["device_traces"][0] if e["action"] == "alloc"
            and e["frames"] and e["frames"][0]["line"] == line_of("LEAK")]
    assert len(kept) == 5 and all(e["size"] == 32 * 64 * 4 for e in kept)
    assert f["start_index"] <= f["index"] and f["index"] is not None


@pytest.mark.parametrize("name", ["clean", "clean_keep_grads", "spiky"])
def test_clean_loops_have_no_leak(recordings, name):
    assert findings(recordings[name], "leak") == []


def test_clean_samples_have_no_leak_and_leak_loop_has_one():
    for name, expected in (("gpt_adamw", 0), ("logits_spike", 0), ("leak_loop", 1)):
        path = SAMPLES / f"{name}.pickle"
        if not path.exists():
            pytest.skip(f"{path} is missing")
        assert len(findings(path, "leak")) == expected, name


def test_leak_loop_sample_points_at_the_model_call_it_keeps():
    path = SAMPLES / "leak_loop.pickle"
    if not path.exists():
        pytest.skip("samples/leak_loop.pickle is missing")
    (f,) = findings(path, "leak")
    src = (SAMPLES / "make_samples.py").read_text().splitlines()
    # first the toy model's output layer (the demo's model counts as user code), then the loop's call
    assert f["frames"][0]["filename"].endswith("toy.py") and f["frames"][0]["name"] == "forward"
    assert f["frames"][1]["filename"].endswith("make_samples.py")
    assert "logits = model(inputs)" in src[f["frames"][1]["line"] - 1]
    # the kept logits: batch 4 x seq 64 x vocab 2048 fp32 per iteration
    assert min(f["bytes_per_iteration"]) >= 4 * 64 * 2048 * 4


def test_upcast_spike_is_found_at_its_line(recordings):
    spikes = findings(recordings["spiky"], "spike")
    assert spikes
    lines = [(s["frames"][0]["filename"].rsplit("/", 1)[-1], s["frames"][0]["line"]) for s in spikes if s["frames"]]
    assert ("test_findings.py", line_of("SPIKE")) in lines
    s = next(s for s in spikes if s["frames"] and s["frames"][0]["line"] == line_of("SPIKE"))
    assert s["phase"] == "forward"
    assert s["bytes"] >= 64 * 8192 * 4  # at least the fp32 copy of the logits
    assert s["start_index"] <= s["index"] <= s["end_index"]
    # independently: allocated at the spike's entry, from the raw entries
    snap, _ = read_document(recordings["spiky"])
    assert s["allocated_bytes"] == naive_replay(snap)["curve"][s["index"]]
    advice = [f["technique"] for f in findings(recordings["spiky"], "advice")]
    assert "chunked loss" in advice


def test_peak_finding_by_category_sums_to_the_peak():
    path = SAMPLES / "gpt_adamw.pickle"
    if not path.exists():
        pytest.skip("samples/gpt_adamw.pickle is missing")
    snap, _ = read_document(str(path))
    oracle = naive_replay(snap)
    report = build_report(load(path))
    (peak,) = [f for f in report["findings"] if f["kind"] == "peak"]
    assert peak["bytes"] == oracle["peak"] and peak["index"] == oracle["peak_index"]
    assert sum(peak["by_category"].values()) == oracle["peak"]
    d = report["devices"][0]
    assert d["categories_at_peak"] == peak["by_category"]
    assert sum(d["categories_at_end"].values()) == oracle["final"]
    for it in d["iterations"]:
        assert sum(it["categories_at_peak"].values()) == it["peak_bytes"] == oracle["curve"][it["peak_index"]]
        assert sum(it["categories_at_end"].values()) == it["end_bytes"] == oracle["curve"][it["end_index"]]
    for ph in d["phases"]:
        assert sum(ph["categories_at_peak"].values()) == ph["peak_bytes"]
    assert {p["phase"] for p in d["phases"]} >= {"forward", "backward", "optimizer"}
    assert [it["iteration"] for it in d["iterations"]] == [0, 1, 2]


def test_advice_is_computed_from_the_measured_categories():
    path = SAMPLES / "gpt_adamw.pickle"
    if not path.exists():
        pytest.skip("samples/gpt_adamw.pickle is missing")
    report = build_report(load(path))
    at_peak = report["devices"][0]["categories_at_peak"]
    advice = {f["technique"]: f for f in report["findings"] if f["kind"] == "advice"}
    assert advice, "a step dominated by activations gets advice"
    for f in advice.values():
        assert 0 < f["bytes"] <= sum(at_peak.values()) and f["assumes"] and f["index"] is not None
    ck = advice["activation checkpointing"]
    assert load(path).recorder["model"]["repeated_blocks"] == 2  # TinyGPT's two blocks (a ModuleList), recorded
    assert "2 repeated blocks (the stacks" in ck["assumes"]  # counted from the stacks, not assumed
    # independently, from the file's own entries: the activations live at the peak that were made under the loop
    # over the blocks (toy.py:51, `x = block(x)`), less each block's input (batch 8 x seq 128 x d_model 128 x
    # 4 B, kept by checkpointing) and one block recomputed in backward
    snap, _ = read_document(str(path))
    live = _live_entries_at(snap, naive_replay(snap)["peak_index"])
    in_blocks = sum(e["size"] for e in live if e.get("category") == "activation"
                    and any(f["filename"].endswith("toy.py") and f["line"] == 51 for f in e.get("frames", [])))
    assert in_blocks > 0
    assert abs(ck["bytes"] - (in_blocks - 2 * 8 * 128 * 128 * 4 - in_blocks / 2)) <= 1


def _live_entries_at(snap, index):
    """The trace's alloc entries still live just after entry `index` (a plain replay of the raw entries)."""
    live = {}
    for e in snap["device_traces"][0][:index + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = e
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    return list(live.values())


def test_every_finding_has_the_viewer_fields():
    path = SAMPLES / "leak_loop.pickle"
    if not path.exists():
        pytest.skip("samples/leak_loop.pickle is missing")
    for f in build_report(load(path))["findings"]:
        assert f["kind"] in ("peak", "spike", "leak", "fragmentation", "oom", "advice")
        assert isinstance(f["bytes"], int) and isinstance(f["summary"], str) and f["summary"]
        assert f["index"] is None or isinstance(f["index"], int)
        assert all(set(fr) >= {"filename", "line", "name"} for fr in f["frames"])


def test_oom_finding_says_what_was_live_by_category():
    sim = Sim()
    a = sim.alloc(8 * MiB)
    sim.alloc(2 * MiB)
    sim.free(a)
    sim.oom(64 * MiB, device_free=MiB)
    snap = sim.snapshot()
    (f,) = [f for f in build_report(to_trace(snap, "x"))["findings"] if f["kind"] == "oom"]
    assert sum(f["live_by_category"].values()) == f["allocated_bytes"] == 2 * MiB
    assert "2.0 MiB allocated" in f["summary"]


def test_real_fixture_findings_run():
    from tests.conftest import fixture

    for name in ("snapshot_newest_format_windows_paths.pickle", "kineto_trace_memory_v100_rank1.json.gz",
                 "profiler_memory_timeline_raw.json.gz", "snapshot_legacy_torch20_oom_observer.pickle"):
        report = build_report(load(fixture(name)))
        kinds = [f["kind"] for f in report["findings"]]
        assert "peak" in kinds and "leak" not in kinds, name
        for d in report["devices"]:
            assert sum(d["categories_at_peak"].values()) == d["peak_allocated_bytes"]
        if name.startswith("snapshot_newest"):
            assert any(f["kind"] == "advice" and f["technique"] == "activation checkpointing"
                       for f in report["findings"])
