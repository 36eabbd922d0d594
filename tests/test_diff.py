"""`tracekit diff`: changes between two recordings, checked against independent replays of the raw files."""
import json
import pickle
import subprocess
import sys

import pytest
from click.testing import CliRunner

import tracekit
from tracekit.analysis.diff import diff, pair_devices, peak_sites
from tracekit.cli import cli
from tracekit.io.unpickle import restricted_load

from .conftest import SAMPLES
from .oracle import naive_replay

torch = pytest.importorskip("torch")


def record_mlp(path, batch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def step():
        x, y = torch.randn(batch, 128), torch.randint(0, 10, (batch,))
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    tracekit.record_steps(step, steps=2, warmup=0, path=str(path), model=model, optimizer=opt, backend="cpu")
    with open(path, "rb") as f:
        return restricted_load(f)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("diff")
    raw = {b: record_mlp(d / f"b{b}.pickle", b) for b in (16, 256)}
    return {b: (d / f"b{b}.pickle", raw[b]) for b in raw}


def test_peak_change_matches_independent_replays(runs):
    (pa, ra), (pb, rb) = runs[16], runs[256]
    (dev,) = diff(tracekit.load(pa), tracekit.load(pb))["devices"]
    peak_a, peak_b = naive_replay(ra)["peak"], naive_replay(rb)["peak"]
    assert dev["peak_allocated_bytes"] == {"a": peak_a, "b": peak_b, "change": peak_b - peak_a}
    # a 16x bigger batch: more activations at the peak, the same parameters
    cats = dev["categories_at_peak"]
    assert cats["activation"]["change"] > 0 and cats["parameter"]["change"] == 0
    assert sum(c["change"] for c in cats.values()) == peak_b - peak_a


def test_sites_at_the_peak_add_up_to_the_peak(runs):
    for path, raw in runs.values():
        assert sum(peak_sites(tracekit.load(path), 0).values()) == naive_replay(raw)["peak"]


def test_a_file_against_itself_changes_nothing():
    path = SAMPLES / "gpt_adamw.pickle"
    trace = tracekit.load(path)
    (dev,) = diff(trace, trace)["devices"]
    assert dev["peak_allocated_bytes"]["change"] == 0 and dev["sites_at_peak"] == []
    assert all(c["change"] == 0 for c in dev["categories_at_peak"].values())


def test_device_pairing():
    cpu, cuda0, cuda1 = ({"device": d} for d in (-1, 0, 1))
    assert pair_devices([cpu], [cuda0]) == [(cpu, cuda0)]
    assert pair_devices([cuda0, cuda1], [cuda1]) == [(cuda1, cuda1)]


def test_cli_text_and_json(runs):
    (pa, _), (pb, _) = runs[16], runs[256]
    r = CliRunner().invoke(cli, ["diff", str(pa), str(pb)])
    assert r.exit_code == 0 and "peak allocated" in r.output and "where the bytes at the peak moved" in r.output
    out = json.loads(CliRunner().invoke(cli, ["diff", "--json", str(pa), str(pb)]).output)
    assert out["devices"][0]["peak_allocated_bytes"]["change"] > 0


def test_cli_bad_file_is_a_clear_error(tmp_path):
    bad = tmp_path / "bad.pickle"
    bad.write_bytes(pickle.dumps({"not": "a snapshot"}))
    r = subprocess.run([sys.executable, "-m", "tracekit.cli", "diff", str(bad), str(SAMPLES / "gpt_adamw.pickle")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith(f"tracekit: cannot open {bad}:") and "Traceback" not in r.stderr
