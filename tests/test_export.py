"""`tracekit export`: snapshots pytorch.org/memory_viz renders, and the allocations table."""
import json
import pickle
import subprocess
import sys

import pytest

from tracekit.io.unpickle import restricted_load
from tracekit.io.write import snapshot_bytes, write_snapshot

from .conftest import FIXTURES, SAMPLES, fixture
from .memviz_rules import problems
from .synth import MiB, Sim

REAL = sorted(p for p in FIXTURES.glob("*") if p.suffix != ".md" and p.name != "truth.json")


def run(*args):
    return subprocess.run([sys.executable, "-m", "tracekit.cli", *map(str, args)], capture_output=True, text=True,
                          timeout=300)


def _report(path):
    r = run("report", "--json", path)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _categorised_sim():
    """A recording-like dict whose entries carry categories, none of them 'unknown' (what crashed the page)."""
    sim = Sim()
    a = sim.alloc(4 * MiB)
    b = sim.alloc(2 * MiB)
    sim.free(a)
    snap = sim.snapshot()
    for e in snap["device_traces"][0]:
        if e["action"] in ("alloc", "free_requested", "free_completed"):
            e["category"] = "activation" if e["addr"] == a else "parameter"
    return snap, b


def test_rules_catch_the_crash_and_the_writer_fixes_it(tmp_path):
    snap, _ = _categorised_sim()
    raw = pickle.dumps(snap, protocol=4)
    assert any("none is 'unknown'" in p for p in problems(raw))  # the page's TypeError, reproduced
    out = write_snapshot(tmp_path / "rec.pickle", snap)
    data = open(out, "rb").read()
    assert problems(data) == []
    written = pickle.loads(data)
    cats = {(e["action"], e.get("category")) for e in written["device_traces"][0]}
    # allocations keep their colours; only the segment entries say "unknown"
    assert ("alloc", "activation") in cats and ("alloc", "parameter") in cats
    assert {c for a, c in cats if a.startswith("segment")} == {"unknown"}


def test_writer_without_segment_entries_uses_a_free_request_or_drops_categories():
    snap, b = _categorised_sim()
    snap["device_traces"][0] = [e for e in snap["device_traces"][0] if not e["action"].startswith("segment")]
    from tracekit.io.memory_viz import renderable

    renderable(snap)
    marked = [e for e in snap["device_traces"][0] if e.get("category") == "unknown"]
    assert [e["action"] for e in marked] == ["free_requested"]  # the page never colours by it
    assert [e["category"] for e in snap["device_traces"][0] if e["action"] == "alloc"] == ["activation", "parameter"]
    assert problems(snapshot_bytes(snap)) == []
    only_allocs = {"segments": [], "device_traces": [[{"action": "alloc", "addr": 1, "size": 8, "category": "input"}]]}
    renderable(only_allocs)
    assert "category" not in only_allocs["device_traces"][0][0]


@pytest.mark.parametrize("name", ["gpt_adamw.pickle", "leak_loop.pickle", "logits_spike.pickle"])
def test_bundled_samples_render(name):
    path = SAMPLES / name
    if not path.exists():
        pytest.skip(f"{path} is missing")
    data = path.read_bytes()
    assert problems(data) == []
    snap = pickle.loads(data)
    assert {e.get("category") for t in snap["device_traces"] for e in t} >= {"unknown", "activation"}


@pytest.mark.parametrize("path", REAL, ids=lambda p: p.name)
def test_export_every_real_fixture_renders_and_keeps_the_figures(tmp_path, path):
    out = tmp_path / "viz.pickle"
    r = run("export", path, "--memory-viz", out)
    assert r.returncode == 0, r.stderr
    assert "memory_viz" in r.stdout
    data = out.read_bytes()
    assert problems(data) == []
    with open(out, "rb") as f:
        restricted_load(f)  # plain builtins only
    before, after = _report(path), _report(out)
    peaks = lambda rep: sorted(d["peak_allocated_bytes"] for d in rep["devices"])  # noqa: E731
    finals = lambda rep: sorted(d["final_allocated_bytes"] for d in rep["devices"])  # noqa: E731
    assert peaks(after) == peaks(before) and finals(after) == finals(before)
    snap = pickle.loads(data)
    cats = {e.get("category") for t in snap["device_traces"] for e in t if e["action"] == "alloc"}
    assert None not in cats  # every allocation is coloured by a category
    assert cats or path.name.startswith("snapshot_legacy")  # its trace is one 'snapshot' entry


def test_export_keeps_cuda_numbers_and_moves_the_cpu(tmp_path):
    out = tmp_path / "k.pickle"
    assert run("export", fixture("kineto_trace_memory_v100_rank1.json.gz"), "--memory-viz", out).returncode == 0
    snap = pickle.loads(out.read_bytes())
    labels = {d["index"]: d["label"] for d in snap["tracekit_export"]["devices"]}
    assert labels == {0: "cpu", 1: "cuda:1"}
    assert [d["label"] for d in _report(out)["devices"]] == ["cpu", "cuda:1"]  # reopened, still named so
    # profiler "Total Allocated" before the first event: one frameless block live throughout
    before = [s for s in snap["segments"] if s["device"] == 1 and not s["frames"]]
    assert len(before) == 1 and before[0]["total_size"] == _report(fixture("kineto_trace_memory_v100_rank1.json.gz"))[
        "devices"][1]["allocated_before_trace_bytes"]


def test_export_bare_segment_list(tmp_path):
    with open(fixture("snapshot_legacy_torch20_oom_observer.pickle"), "rb") as f:
        segments = restricted_load(f)["segments"]
    src = tmp_path / "bare.pickle"
    src.write_bytes(pickle.dumps(segments, protocol=4))
    out = tmp_path / "viz.pickle"
    assert run("export", src, "--memory-viz", out).returncode == 0
    snap = pickle.loads(out.read_bytes())
    assert problems(out.read_bytes()) == [] and len(snap["device_traces"]) == 1 + max(s["device"] for s in segments)


def test_export_bad_requests_exit_2(tmp_path):
    src = SAMPLES / "logits_spike.pickle"
    for args, says in [((src, "--memory-viz", tmp_path / "x.pickle.gz"), "plain pickles"),
                       ((src, "--memory-viz", src), "input file"),
                       ((src, "--allocations", tmp_path / "x.xlsx"), ".csv or .parquet"),
                       ((src,), "say what to write"),
                       ((tmp_path / "missing.pickle", "--memory-viz", tmp_path / "y.pickle"), "missing.pickle")]:
        r = run("export", *args)
        assert r.returncode == 2, (args, r.stderr)
        assert says in r.stderr and "Traceback" not in r.stderr


def test_export_multi_device_oom_pending_free_and_ring_buffer(tmp_path):
    sim = Sim(devices=2, streams=(0, 7))
    a = sim.alloc(4 * MiB, device=1)
    b = sim.alloc(2 * MiB, device=1, stream=7)
    sim.free(a, device=1)
    sim.free(b, device=1, complete=False)  # record_stream: still pending at the end
    sim.alloc(MiB, device=0)
    sim.oom(64 * MiB, device_free=MiB, device=1)
    sim.unknown(device=1)
    src = tmp_path / "multi.pickle"
    src.write_bytes(pickle.dumps(sim.snapshot(drop_first=1), protocol=4))
    out = tmp_path / "viz.pickle"
    r = run("export", src, "--memory-viz", out)
    assert r.returncode == 0, r.stderr
    assert problems(out.read_bytes()) == []
    snap = pickle.loads(out.read_bytes())
    assert [e["category"] for e in snap["device_traces"][1] if e["action"] == "oom"] == ["unknown"]
    assert _report(out)["devices"][1]["peak_allocated_bytes"] == _report(src)["devices"][1]["peak_allocated_bytes"]
