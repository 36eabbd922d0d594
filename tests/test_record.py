"""The recorder's Python API on the CPU backend: numerics, file format, replay, phases, tags, failures."""
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import tracekit  # noqa: E402
import tracekit.record as tk_record  # noqa: E402
from tracekit.analysis.replay import replay  # noqa: E402
from tracekit.io.unpickle import restricted_load  # noqa: E402
from tracekit.record.toy import make_training  # noqa: E402

SMALL = dict(vocab=256, d_model=32, n_layers=2, n_heads=2, seq=16, batch=4)


def train(steps, path=None, **record_options):
    """Losses and final parameters of `steps` toy GPT steps, recorded to `path` if given."""
    model, optimizer, step = make_training(seed=0, **SMALL)
    losses = []
    if path is None:
        for _ in range(steps):
            losses.append(step())
    else:
        with tk_record.record(path, model=model, optimizer=optimizer, backend="cpu", **record_options) as rec:
            for _ in range(steps):
                losses.append(step())
                rec.step()
        assert rec.written == str(path)
    return torch.stack(losses), [p.detach().clone() for p in model.parameters()]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    path = tmp_path_factory.mktemp("rec") / "step.pickle"
    losses, params = train(3, path)
    with open(path, "rb") as f:
        snapshot = restricted_load(f)
    return path, snapshot, losses, params


def test_recording_does_not_change_numerics(recorded):
    _, _, losses, params = recorded
    plain_losses, plain_params = train(3)
    assert torch.equal(losses, plain_losses)  # bitwise
    assert all(torch.equal(a, b) for a, b in zip(params, plain_params))


def test_file_is_a_pytorch_snapshot_of_plain_builtins(recorded):
    _, snap, _, _ = recorded
    assert set(snap) >= {"segments", "device_traces", "tracekit"}
    (trace,) = snap["device_traces"]
    assert {e["action"] for e in trace} >= {"alloc", "free_requested", "free_completed"}
    for e in trace[:50]:
        assert set(e) >= {"action", "addr", "size", "stream", "time_us", "frames", "user_metadata"}
    allocs = [e for e in trace if e["action"] == "alloc"]
    framed = [e for e in allocs if e["frames"]]
    assert len(framed) > 0.95 * len(allocs)  # (a free made by Python dropping a reference has no frames)
    assert all(set(f) == {"filename", "line", "name"} for f in framed[0]["frames"])
    seg = snap["segments"][0]
    assert set(seg) >= {"device", "address", "total_size", "allocated_size", "active_size", "requested_size",
                        "stream", "segment_type", "segment_pool_id", "is_expandable", "frames", "blocks"}
    assert seg["segment_type"] == "cpu"
    assert set(seg["blocks"][0]) >= {"address", "size", "requested_size", "state", "frames"}


def test_tracekit_key(recorded):
    _, snap, _, _ = recorded
    k = snap["tracekit"]
    assert k["version"] == 1 and k["backend"] == "cpu"
    assert k["torch_version"] == torch.__version__
    assert k["devices"] == [{"index": 0, "type": "cpu", "name": k["devices"][0]["name"],
                             "total_memory": k["devices"][0]["total_memory"]}]
    model = k["model"]
    assert model["class"].endswith("TinyGPT") and model["parameters"] > 0
    assert model["parameter_bytes"] == 4 * model["parameters"] == 4 * model["trainable_parameters"]
    opt = k["optimizer"]
    assert (opt["class"], opt["param_groups"], opt["defaults"]["betas"]) == ("torch.optim.adamw.AdamW", 1, [0.9, 0.999])
    assert k["exit_code"] is None and k["error"] is None
    assert k["settings"]["backend"] == "cpu"


def test_replays_exactly(recorded):
    path, _, _, _ = recorded
    trace = tracekit.load(path, use_cache=False)
    (rep,) = replay(trace).values()
    assert rep.invariant.checked and rep.invariant.ok, rep.invariant.problems
    # The model's parameters existed before recording: allocations from before the trace.
    assert rep.initial_allocated >= trace.recorder["model"]["parameter_bytes"]


def test_iterations_and_phases(recorded):
    _, snap, _, _ = recorded
    k = snap["tracekit"]
    times = [e["time_us"] for e in snap["device_traces"][0]]
    start, end = k["settings"]["start_us"], k["settings"]["end_us"]
    assert start <= min(times) and max(times) <= end
    assert [i["iteration"] for i in k["iterations"]] == [0, 1, 2]
    phases = k["phases"]
    assert [(p["iteration"], p["phase"]) for p in phases] == [
        (i, p) for i in range(3) for p in ("forward", "backward", "optimizer")
    ]
    for a, b in zip(phases, phases[1:]):
        assert a["start_us"] <= a["end_us"] <= b["start_us"]
    for p in phases:
        it = k["iterations"][p["iteration"]]
        assert start <= it["start_us"] <= p["start_us"] and p["end_us"] <= it["end_us"] <= end
    # Entries carry the phase they were made in.
    metas = {e["user_metadata"] for e in snap["device_traces"][0]}
    assert {f"tracekit:iter={i}:phase={p}" for i in range(3) for p in ("forward", "backward", "optimizer")} <= metas


def _allocation_at(trace, rep, addr, time_us):
    """The allocation holding `addr` at `time_us`, as (addr, size), or None."""
    a = rep.allocations
    t = trace.events.time_us[rep.events]
    born = np.where(a.alloc_index < 0, np.iinfo(np.int64).min, t[np.maximum(a.alloc_index, 0)])
    dies = np.where(a.free_index < 0, np.iinfo(np.int64).max, t[np.maximum(a.free_index, 0)])
    hit = (a.addr <= addr) & (addr < a.addr + a.size.astype(np.uint64)) & (born <= time_us) & (time_us < dies)
    rows = np.flatnonzero(hit)
    return (int(a.addr[rows[0]]), int(a.size[rows[0]])) if len(rows) else None


def test_tags_point_into_allocations(recorded):
    path, snap, _, _ = recorded
    tags = snap["tracekit"]["tags"]
    kinds = {t["kind"] for t in tags}
    assert kinds >= {"parameter", "gradient", "optimizer_state", "activation", "input"}
    trace = tracekit.load(path, use_cache=False)
    (rep,) = replay(trace).values()
    for tag in tags:
        assert set(tag) == {"addr", "size", "device", "time_us", "kind", "name"}
        hit = _allocation_at(trace, rep, tag["addr"], tag["time_us"])
        assert hit == (tag["addr"], tag["size"]), tag
    names = {t["name"] for t in tags if t["kind"] == "parameter"}
    assert "tok.weight" in names and "blocks.0.qkv.weight" in names
    assert any(t["name"] == "tok.weight.exp_avg" for t in tags if t["kind"] == "optimizer_state")
    assert any(t["name"] == "tok.weight.grad" for t in tags if t["kind"] == "gradient")


def test_record_steps_skips_warmup(tmp_path):
    model, optimizer, step = make_training(seed=0, **SMALL)
    path = tk_record.record_steps(step, steps=2, warmup=1, path=tmp_path / "s.pickle",
                                  model=model, optimizer=optimizer, backend="cpu")
    with open(path, "rb") as f:
        k = restricted_load(f)["tracekit"]
    assert [i["iteration"] for i in k["iterations"]] == [1, 2]
    assert {p["iteration"] for p in k["phases"]} == {1, 2}
    # Optimizer state was made in the warm-up step: it is live before the trace.
    trace = tracekit.load(path, use_cache=False)
    (rep,) = replay(trace).values()
    assert rep.invariant.ok
    state = [t for t in k["tags"] if t["kind"] == "optimizer_state" and t["time_us"] == k["settings"]["start_us"]]
    assert state


def test_without_model_global_hooks_find_phases(tmp_path):
    model, optimizer, step = make_training(seed=0, **SMALL)
    with tk_record.record(tmp_path / "g.pickle", backend="cpu") as rec:
        for _ in range(2):
            step()
    with open(rec.written, "rb") as f:
        k = restricted_load(f)["tracekit"]
    assert [(p["iteration"], p["phase"]) for p in k["phases"]] == [
        (i, p) for i in range(2) for p in ("forward", "backward", "optimizer")
    ]
    assert k["model"]["class"].endswith("TinyGPT")
    assert k["optimizer"]["class"].endswith("AdamW")
    assert {"parameter", "gradient", "optimizer_state", "activation", "input"} <= {t["kind"] for t in k["tags"]}


def test_tracekit_record_is_the_function(tmp_path):
    assert callable(tracekit.record)
    assert tracekit.record_steps is tk_record.record_steps
    with tracekit.record(tmp_path / "x.pickle", backend="cpu") as rec:
        torch.ones(1000).sum()
    assert rec.written


def test_recording_that_cannot_start_warns_and_training_runs(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # backend "cuda" cannot start
    model, optimizer, step = make_training(seed=0, **SMALL)
    with pytest.warns(RuntimeWarning, match="recording could not start"):
        with tk_record.record(tmp_path / "no.pickle", model=model, optimizer=optimizer, backend="cuda") as rec:
            losses = torch.stack([step() for _ in range(2)])
    assert rec.written is None and not (tmp_path / "no.pickle").exists()
    assert torch.equal(losses, train(2)[0])


def test_failing_hook_warns_once_and_recording_goes_on(tmp_path, monkeypatch):
    from tracekit.record.tags import Tags

    def broken(self, tensor, *rest):
        raise RuntimeError("broken tagger")

    monkeypatch.setattr(Tags, "add_activation", broken)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        losses, _ = train(2, tmp_path / "h.pickle")
    assert sum("broken tagger" in str(w.message) for w in caught) == 1
    assert torch.equal(losses, train(2)[0])
    assert (tmp_path / "h.pickle").exists()


def test_exception_in_block_still_writes_and_reraises(tmp_path):
    model, optimizer, step = make_training(seed=0, **SMALL)
    with pytest.raises(ValueError, match="mid-step"):
        with tk_record.record(tmp_path / "e.pickle", model=model, optimizer=optimizer, backend="cpu"):
            step()
            raise ValueError("mid-step")
    with open(tmp_path / "e.pickle", "rb") as f:
        k = restricted_load(f)["tracekit"]
    assert k["error"] == "ValueError: mid-step"


def test_hooks_are_removed_after_recording(tmp_path):
    from torch.nn.modules import module as nn_module

    before = (len(nn_module._global_forward_pre_hooks), torch.autograd.backward)
    with tk_record.record(tmp_path / "r.pickle", backend="cpu"):
        pass
    assert (len(nn_module._global_forward_pre_hooks), torch.autograd.backward) == before
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None


def test_max_entries_keeps_the_newest_and_still_replays(tmp_path):
    train(2, tmp_path / "m.pickle", max_entries=300)
    with open(tmp_path / "m.pickle", "rb") as f:
        snap = restricted_load(f)
    assert len(snap["device_traces"][0]) == 300
    (rep,) = replay(tracekit.load(tmp_path / "m.pickle", use_cache=False)).values()
    assert rep.invariant.ok, rep.invariant.problems


def test_backend_failing_after_warmup_warns_and_training_runs(tmp_path, monkeypatch):
    from tracekit.record.cpu import CpuBackend

    def refuse(self, *args):
        raise RuntimeError("profiler busy")

    monkeypatch.setattr(CpuBackend, "start", refuse)
    model, optimizer, step = make_training(seed=0, **SMALL)
    losses = []
    with pytest.warns(RuntimeWarning, match="profiler busy"):
        written = tk_record.record_steps(lambda: losses.append(step()), steps=2, warmup=1,
                                         path=tmp_path / "w.pickle", model=model, optimizer=optimizer, backend="cpu")
    assert written is None and not (tmp_path / "w.pickle").exists()
    assert torch.equal(torch.stack(losses), train(3)[0])
    assert torch._C._autograd._top_saved_tensors_default_hooks(True) is None
