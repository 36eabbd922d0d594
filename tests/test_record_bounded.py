"""The CPU recorder converts as it goes: a ring buffer bounded by max_entries, and a user's own profiler."""
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import tracekit  # noqa: E402
from tracekit.analysis.replay import replay  # noqa: E402
from tracekit.record.cpu import CpuBackend  # noqa: E402
from tracekit.record.toy import make_training  # noqa: E402

SMALL = dict(n_layers=1, d_model=32, vocab=256, seq=16, batch=2)


@pytest.fixture(params=["hook", "profiler"])
def source(request, monkeypatch):
    """Where CPU allocations come from: the allocation hook (allochook.py), or torch.profiler's memory events."""
    if request.param == "hook":
        from tracekit.record.allochook import available

        ok, why = available()
        if not ok:
            pytest.skip(f"no allocation hook here: {why}")
        monkeypatch.delenv("TRACEKIT_CPU_SOURCE", raising=False)
    else:
        monkeypatch.setenv("TRACEKIT_CPU_SOURCE", "profiler")
    return request.param


def record(path, chunk_seconds, max_entries=None, steps=3, monkeypatch=None, inside=None):
    monkeypatch.setattr(CpuBackend, "chunk_seconds", chunk_seconds)
    model, opt, step = make_training(seed=0, **SMALL)
    options = {} if max_entries is None else {"max_entries": max_entries}
    with tracekit.record(path, model=model, optimizer=opt, backend="cpu", **options) as rec:
        for i in range(steps):
            if inside is not None and i == 1:
                with inside():
                    step()
            else:
                step()
            rec.step()
    trace = tracekit.load(path, use_cache=False)
    (rep,) = replay(trace).values()
    assert rep.invariant.ok, rep.invariant.problems
    return trace


def test_restarting_the_profiler_loses_nothing(tmp_path, monkeypatch, source):
    """One profiler session vs one per phase: the same allocations, in the same order, and the same end state."""
    whole = record(tmp_path / "a.pickle", None, monkeypatch=monkeypatch)
    chunked = record(tmp_path / "b.pickle", 0.0, monkeypatch=monkeypatch)
    assert len(whole.events) == len(chunked.events) > 100
    assert np.array_equal(whole.events.size, chunked.events.size)
    assert np.array_equal(whole.events.action, chunked.events.action)
    assert sorted(whole.blocks.size) == sorted(chunked.blocks.size)


@pytest.mark.parametrize("max_entries", [301, 1000])
def test_ring_keeps_the_newest_entries(tmp_path, monkeypatch, max_entries, source):
    whole = record(tmp_path / "a.pickle", None, monkeypatch=monkeypatch)
    ring = record(tmp_path / "r.pickle", 0.0, max_entries=max_entries, monkeypatch=monkeypatch)
    assert len(ring.events) == max_entries
    # the newest entries of the full recording, size for size
    assert np.array_equal(ring.events.size, whole.events.size[-max_entries:])
    assert sorted(ring.blocks.size) == sorted(whole.blocks.size)  # what is live at the end does not depend on it


def _their_profiler(memory):
    from torch.profiler import ProfilerActivity, profile

    made = []

    def factory():
        made.append(profile(activities=[ProfilerActivity.CPU], profile_memory=memory))
        return made[-1]

    return factory, made


@pytest.mark.parametrize("memory", [True, False])
def test_users_profiler_inside_ours(tmp_path, monkeypatch, memory, source):
    whole = record(tmp_path / "a.pickle", None, monkeypatch=monkeypatch)
    factory, made = _their_profiler(memory)
    with pytest.warns(RuntimeWarning, match="your torch.profiler started while tracekit was recording"):
        ours = record(tmp_path / "b.pickle", 0.0, monkeypatch=monkeypatch, inside=factory)
    theirs = made[0].events()
    assert len(theirs) > 50  # theirs has its events
    assert any(e.name == "[memory]" for e in theirs) is memory
    (gap,) = ours.recorder["gaps"]
    filled = memory or source == "hook"  # the hook records the CPU allocations whatever profiler runs
    assert gap["filled"] is filled and gap["start_us"] < gap["end_us"]
    if filled:  # nothing is missing
        assert np.array_equal(whole.events.size, ours.events.size)
    else:  # the steps before and after it are there
        assert 0 < len(ours.events) < len(whole.events)


def test_ours_inside_users_profiler_warns_and_leaves_theirs_whole(tmp_path, monkeypatch, source):
    from torch.profiler import ProfilerActivity, profile

    monkeypatch.setattr(CpuBackend, "chunk_seconds", 0.0)
    model, opt, step = make_training(seed=0, **SMALL)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as theirs:
        step()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with tracekit.record(tmp_path / "o.pickle", model=model, optimizer=opt, backend="cpu"):
                step()
        step()
    messages = [str(w.message) for w in caught]
    assert any("your torch.profiler was already running" in m for m in messages)
    if source == "profiler":
        assert any("holds no trace entries" in m for m in messages)  # never a silent empty file
    else:  # the hook records the step's allocations while their profiler runs
        assert not any("holds no trace entries" in m for m in messages)
        assert len(tracekit.load(tmp_path / "o.pickle", use_cache=False).events) > 100
    names = [e.name for e in theirs.events()]
    assert names.count("[memory]") > 20 and len(names) > 200
    k = tracekit.load(tmp_path / "o.pickle", use_cache=False).recorder
    assert k["gaps"] and k["gaps"][0]["reason"].startswith("your torch.profiler was already running")
    import torch.autograd.profiler as p

    assert p._enable_profiler.__module__ != __name__ and "coexist" not in p._enable_profiler.__qualname__


RANGES = """
import gc, sys, torch, tracekit
from torch.profiler import record_function
from tracekit.record.cpu import CpuBackend
from tracekit.record.toy import make_training
CpuBackend.chunk_seconds = 0.0  # restart at every phase boundary
for r in range(4):
    model, opt, step = make_training(seed=0, n_layers=1, d_model=32, vocab=256, seq=16, batch=2)
    with tracekit.record(sys.argv[1], model=model, optimizer=opt, backend="cpu", max_entries=301) as rec:
        for i in range(3):
            with record_function("user step"):  # restarting inside an open range corrupts torch's heap
                step()
            rec.step()
            gc.collect()
print("ok")
"""


def test_no_restart_inside_an_open_record_function(tmp_path):
    """Optimizer.step and the user's ranges stay open across our hooks: a restart there crashed (segfault)."""
    import subprocess
    import sys

    (tmp_path / "ranges.py").write_text(RANGES)
    r = subprocess.run([sys.executable, "ranges.py", "x.pickle"], cwd=tmp_path, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]
    trace = tracekit.load(tmp_path / "x.pickle", use_cache=False)
    assert len(trace.events) == 301
