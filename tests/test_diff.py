"""`tracekit diff` on real pairs recorded here (checkpointing on/off, batch 8 vs 16, Adam vs SGD),
every figure checked against independent replays of the raw files (tests/oracle.py)."""
import json
import pickle
import re
import subprocess
import sys

import pytest
from click.testing import CliRunner

import tracekit
from tracekit.analysis.diff import diff, noise_bytes, pair_devices, peak_sites
from tracekit.cli import cli
from tracekit.render.diff import diff_text, relative

from .conftest import SAMPLES
from .oracle import naive_replay

torch = pytest.importorskip("torch")
_META = re.compile(r"tracekit:iter=(\d+)(?::phase=(\w+))?")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> (path, raw snapshot dict); 'base': batch 8, Adam, no checkpointing, one warm-up step."""
    from .pairs import record_run

    d = tmp_path_factory.mktemp("pairs")
    knobs = {"base": {}, "again": {}, "ckpt": {"checkpoint": True}, "b16": {"batch": 16, "warmup": 0},
             "sgd": {"optimizer": "sgd"}}
    return {name: (d / f"{name}.pickle", record_run(d / f"{name}.pickle", **kw)) for name, kw in knobs.items()}


def _diff(runs, a, b):
    result = diff(tracekit.load(runs[a][0]), tracekit.load(runs[b][0]))
    (dev,) = result["devices"]
    return result, dev


def naive_steps(raw):
    """Independently: per phase the highest allocated bytes, per iteration (in order) its peak and end bytes."""
    rep = naive_replay(raw)
    curve, entries = rep["curve"], raw["device_traces"][0]
    phase_peak, its = {}, {}
    for e, total in zip(entries, curve):
        m = _META.fullmatch(e.get("user_metadata") or "")
        if not m:
            continue
        phase = m.group(2) or "between"
        phase_peak[phase] = max(phase_peak.get(phase, 0), total)
        it = its.setdefault(int(m.group(1)), {"peak": 0})
        it["peak"], it["end"] = max(it["peak"], total), total
    return phase_peak, [its[k] for k in sorted(its)]


def test_checkpointing_drops_activations_and_says_where(runs):
    result, dev = _diff(runs, "base", "ckpt")
    pa, pb = naive_replay(runs["base"][1])["peak"], naive_replay(runs["ckpt"][1])["peak"]
    assert dev["peak_allocated_bytes"]["a"] == pa and dev["peak_allocated_bytes"]["b"] == pb
    assert dev["peak_allocated_bytes"]["change"] == pb - pa < 0
    act = dev["categories_at_peak"]["activation"]
    assert act["significant"] and act["relative"] < -0.8  # blocks recomputed in backward keep almost nothing
    assert sum(c["change"] for c in dev["categories_at_peak"].values()) == pb - pa
    # where: the model's own lines lose activations (the attention and MLP of each block)
    lost = [s for s in dev["sites_at_peak"] if s["change"] < 0 and s["category"] == "activation"]
    assert lost and any("record/toy.py" in s["site"] and "in forward" in s["site"] for s in lost)
    assert sum(s["change"] for s in lost) <= 0.5 * act["change"]
    text = diff_text(result)
    assert re.search(r"activation .* -\d+\.\d MiB \(-9\d%\)", text)


def test_batch_16_doubles_activations_aligned_by_iteration(runs):
    _, dev = _diff(runs, "base", "b16")  # b16 was recorded without a warm-up: iterations 0, 1 vs 1, 2
    act = dev["categories_at_peak"]["activation"]
    assert 1.9 <= act["b"] / act["a"] <= 2.1
    assert [(i["iteration_a"], i["iteration_b"]) for i in dev["iterations"]] == [(1, 0), (2, 1)]
    (_, its_a), (_, its_b) = naive_steps(runs["base"][1]), naive_steps(runs["b16"][1])
    for row, x, y in zip(dev["iterations"], its_a, its_b):
        assert (row["peak_bytes"]["a"], row["peak_bytes"]["b"]) == (x["peak"], y["peak"])
        assert (row["end_bytes"]["a"], row["end_bytes"]["b"]) == (x["end"], y["end"])


def test_phase_peaks_match_an_independent_replay(runs):
    for b in ("ckpt", "b16", "sgd"):
        _, dev = _diff(runs, "base", b)
        (pa, _), (pb, _) = naive_steps(runs["base"][1]), naive_steps(runs[b][1])
        for row in dev["phases"]:
            assert row["peak_bytes"]["a"] == pa.get(row["phase"]) and row["peak_bytes"]["b"] == pb.get(row["phase"])


def test_sgd_has_no_optimizer_state(runs):
    result, dev = _diff(runs, "base", "sgd")
    raw = runs["base"][1]
    last = max(i["iteration"] for i in raw["tracekit"]["iterations"])
    t0 = next(i["start_us"] for i in raw["tracekit"]["iterations"] if i["iteration"] == last)
    # Adam's state: the distinct storages the recorder tagged as optimizer state in the last iteration
    tags = [t for t in raw["tracekit"]["tags"] if t["kind"] == "optimizer_state" and t["time_us"] >= t0]
    state = {t["addr"]: t["size"] for t in tags}
    moments = sum(t["size"] for t in tags if t["name"].endswith(("exp_avg", "exp_avg_sq")))
    assert moments == 2 * raw["tracekit"]["model"]["parameter_bytes"]  # what Adam keeps, besides its step counts
    end = dev["categories_at_end"]["optimizer_state"]
    assert end == {"a": sum(state.values()), "b": 0, "change": -sum(state.values()), "relative": -1.0,
                   "significant": True}
    assert relative(end) == "gone"
    assert dev["modules_at_peak"] and all(m["category"] == "optimizer_state" and m["change"] < 0
                                          for m in dev["modules_at_peak"])
    text = diff_text(result)
    assert re.search(r"optimizer_state +1\.3 MiB +0 B +-1\.3 MiB \(gone\)", text)
    assert "(B allocates nothing in this phase)" in text  # plain SGD allocates nothing in its step


def test_two_runs_of_the_same_script_differ_only_by_noise(runs):
    result, dev = _diff(runs, "base", "again")
    assert not dev["peak_allocated_bytes"]["significant"] and dev["sites_at_peak"] == []
    assert not any(c["significant"] for c in dev["categories_at_peak"].values())
    assert result["findings"]["added"] == [] and result["findings"]["removed"] == []
    assert "nothing changed beyond noise" in diff_text(result)


def test_text_reads_at_a_glance(runs):
    for b in ("ckpt", "b16", "sgd", "again"):
        result, dev = _diff(runs, "base", b)
        text = diff_text(result)
        assert not re.search(r"\([+-]0%\)", text)  # no "-62.4 MiB (-0%)"
        assert not re.search(r"\b(\d+) -> \1\b", text)  # no "fragmentation: 1 -> 1"
        assert "under 1% of the larger peak" in text
        # every change the text prints is significant: at least the stated noise
        for m in re.finditer(r"([+-]\d+\.\d) (KiB|MiB) \(", text):
            n = float(m.group(1)) * {"KiB": 2**10, "MiB": 2**20}[m.group(2)]
            assert abs(n) >= dev["noise_bytes"] * 0.95


def test_relative_wording():
    assert relative({"a": 100, "b": 141, "change": 41}) == "+41%"
    assert relative({"a": 1000, "b": 996, "change": -4}) == "-0.4%"
    assert relative({"a": 100, "b": 250, "change": 150}) == "×2.5"
    assert relative({"a": 0, "b": 5, "change": 5}) == "new" and relative({"a": 5, "b": 0, "change": -5}) == "gone"
    assert noise_bytes(10 << 20, 20 << 20) == int(0.01 * (20 << 20)) and noise_bytes(100, 200) == 4096


def test_findings_added_and_removed(runs):
    result, _ = _diff(runs, "base", "ckpt")
    f = result["findings"]
    # the checkpointing advice disappears once the blocks are checkpointed
    assert any(r["kind"] == "advice" and r["summary"].startswith("activation checkpointing") for r in f["removed"])
    back, _ = _diff(runs, "ckpt", "base")
    assert sorted(r["summary"] for r in back["findings"]["added"]) == sorted(r["summary"] for r in f["removed"])


def test_sites_at_the_peak_add_up_to_the_peak(runs):
    for path, raw in runs.values():
        sites = peak_sites(tracekit.load(path), 0)
        assert sum(sum(c.values()) for c in sites.values()) == naive_replay(raw)["peak"]


def test_a_file_against_itself_changes_nothing():
    trace = tracekit.load(SAMPLES / "gpt_adamw.pickle")
    result = diff(trace, trace)
    (dev,) = result["devices"]
    assert dev["peak_allocated_bytes"]["change"] == 0 and dev["sites_at_peak"] == []
    assert all(c["change"] == 0 for c in dev["categories_at_peak"].values())
    assert result["findings"]["added"] == result["findings"]["removed"] == result["findings"]["changed"] == []


def test_device_pairing():
    cpu, cuda0, cuda1 = ({"device": d} for d in (-1, 0, 1))
    assert pair_devices([cpu], [cuda0]) == [(cpu, cuda0)]
    assert pair_devices([cuda0, cuda1], [cuda1]) == [(cuda1, cuda1)]


def test_cli_text_and_json(runs):
    pa, pb = runs["base"][0], runs["b16"][0]
    r = CliRunner().invoke(cli, ["diff", str(pa), str(pb)])
    assert r.exit_code == 0 and "peak allocated" in r.output and "at the peak, by site" in r.output
    out = json.loads(CliRunner().invoke(cli, ["diff", "--json", str(pa), str(pb)]).output)
    assert out["devices"][0]["peak_allocated_bytes"]["change"] > 0 and out["noise_share"] == 0.01


def test_cli_bad_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.pickle"
    bad.write_bytes(pickle.dumps({"not": "a snapshot"}))
    r = subprocess.run([sys.executable, "-m", "tracekit.cli", "diff", str(bad), str(SAMPLES / "gpt_adamw.pickle")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith(f"tracekit: cannot open {bad}:") and "Traceback" not in r.stderr


def test_the_shared_axis_puts_each_phase_in_its_slot(runs):
    from tracekit.analysis.align import SLOTS, aligned_series, aligned_x

    for name in ("base", "b16", "ckpt"):
        path, raw = runs[name]
        trace = tracekit.load(path)
        x = aligned_x(trace, 0)
        assert (x[1:] >= x[:-1]).all()  # the step's order is kept
        entries = raw["device_traces"][0]
        seen = []
        for i, e in enumerate(entries):  # the independent truth: our user_metadata strings
            m = _META.fullmatch(e.get("user_metadata") or "")
            it, phase = int(m.group(1)), m.group(2)
            if it not in seen:
                seen.append(it)
            slot = {"forward": 1, "backward": 2, "optimizer": 3}.get(phase)
            if slot is not None:
                assert SLOTS * seen.index(it) + slot <= x[i] < SLOTS * seen.index(it) + slot + 1
        s = aligned_series(trace, 0)
        k = int(s["total"].argmax())
        assert s["total"][k] == naive_replay(raw)["peak"] and 2 <= s["x"][k] % SLOTS < 3  # peaks in backward


def test_difference_over_the_aligned_step(runs):
    from tracekit.analysis.align import aligned_difference, aligned_series

    (pa, _), (pb, _) = runs["base"], runs["b16"]
    sa, sb = aligned_series(tracekit.load(pa), 0), aligned_series(tracekit.load(pb), 0)
    d = aligned_difference(sa, sb)
    assert (d["total"] == sum(d["by_category"].values())).all()  # the categories add up to the total
    _, dev = _diff(runs, "base", "b16")
    act = dev["categories_at_peak"]["activation"]
    # twice the batch: over the step, B holds up to about the extra activations at the peak more
    assert 0.8 * act["change"] <= d["by_category"]["activation"].max() <= 1.2 * act["change"]
    assert d["by_category"]["activation"].min() >= -0.05 * act["a"]  # and never noticeably fewer


def test_a_training_run_against_a_generation():
    """Phases of a generation (prefill, decode) beside a training step's: each side's phase peaks, the
    largest of them its peak, checked against a naive replay of the raw file (it raised on 'prefill')."""
    import gzip

    from .conftest import ROOT

    gen = ROOT / "tests" / "fixtures" / "cuda" / "qwen2_generate_b2_p256_n128.pickle.gz"
    raw = pickle.load(gzip.open(gen))
    result = diff(tracekit.load(SAMPLES / "gpt_adamw.pickle"), tracekit.load(gen))
    (dev,) = result["devices"]
    phases = {row["phase"]: row["peak_bytes"] for row in dev["phases"]}
    assert {"forward", "backward", "optimizer", "prefill", "decode"} <= set(phases)
    assert phases["prefill"]["a"] is None and phases["forward"]["b"] is None
    assert max(p["b"] or 0 for p in phases.values()) == naive_replay(raw)["peak"]
    r = CliRunner().invoke(cli, ["diff", str(SAMPLES / "gpt_adamw.pickle"), str(gen)])
    assert r.exit_code == 0 and "prefill" in r.output and "decode" in r.output
