"""CPU backend: storages that exist before recording and die during it get their frees in the trace.

The profiler drops the free of a block it did not see allocated; the recorder
watches pre-existing storages (parameters, gradients, optimizer state) and
writes their frees itself. Here the warm-up step's gradients are freed by the
first recorded `zero_grad(set_to_none=True)`.
"""
import pickle

import pytest

torch = pytest.importorskip("torch")

import tracekit  # noqa: E402
from tracekit.analysis.replay import replay  # noqa: E402


def setup():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)

    def step():
        x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
        optimizer.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    return model, optimizer, step


def record(path, warmup):
    model, optimizer, step = setup()
    written = tracekit.record_steps(step, steps=2, warmup=warmup, path=str(path), model=model,
                                    optimizer=optimizer, backend="cpu")
    assert written == str(path)
    with open(path, "rb") as f:
        snapshot = pickle.load(f)
    rep = replay(tracekit.load(str(path)))[0]
    assert rep.invariant.checked and rep.invariant.ok, rep.invariant.problems
    return snapshot, rep, model


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    d = tmp_path_factory.mktemp("pre")
    return record(d / "warm.pickle", warmup=1), record(d / "cold.pickle", warmup=0)


def test_peak_after_warmup_equals_cold_start(runs):
    (_, warm, model), (_, cold, _) = runs
    # Iteration 2 of a cold start (first step already made grads and Adam state) is the warm run's
    # iteration 2; with the warm-up gradients counted twice the warm peak would be one gradient set higher.
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    assert warm.peak_allocated == cold.peak_allocated
    # The end state: parameters + gradients + two Adam moments (+ step counters), nothing stale.
    assert warm.final_allocated == cold.final_allocated
    assert warm.final_allocated < 4 * grad_bytes + 4096


def test_warmup_gradients_are_freed_in_trace(runs):
    (snapshot, rep, _), _ = runs
    start = snapshot["tracekit"]["settings"]["start_us"]
    grads = {(t["addr"], t["size"]) for t in snapshot["tracekit"]["tags"]
             if t["kind"] == "gradient" and t["time_us"] == start}
    assert len(grads) == 6  # 3 weights + 3 biases, from the warm-up step
    entries = snapshot["device_traces"][0]
    first_iter = snapshot["tracekit"]["iterations"][0]
    for addr, size in grads:
        frees = [i for i, e in enumerate(entries) if e["action"] == "free_completed" and e["addr"] == addr]
        assert frees, f"warm-up gradient at {addr:#x} never freed"
        i = frees[0]
        assert entries[i]["size"] == size
        assert [entries[i - 1]["action"], entries[i + 1]["action"]] == ["free_requested", "segment_free"]
        assert first_iter["start_us"] <= entries[i]["time_us"] <= first_iter["end_us"]
        # freed before any later allocation reuses its address
        later = [j for j, e in enumerate(entries) if e["action"] == "alloc" and e["addr"] == addr]
        assert all(j > i for j in later)
        # entries stay in time order
    times = [e["time_us"] for e in entries]
    assert times == sorted(times)
    # none of them is still live at the end
    live = {(b["address"], b["size"]) for s in snapshot["segments"] for b in s["blocks"]}
    assert not grads & live or all(
        any(e["action"] == "alloc" and e["addr"] == a for e in entries) for a, _ in grads & live)


