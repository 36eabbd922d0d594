"""Invariants of the allocator model under random request streams (hypothesis), and the compiled replay
against the Python one on the same files, including files that contradict themselves."""
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tracekit.analysis.allocator import compiled, model_replay
from tracekit.analysis.allocator.config import MB, SMALL_SIZE, parse_alloc_conf
from tracekit.analysis.allocator.core import Allocator, Device, OutOfMemory, check
from tracekit.analysis.allocator.settings_replay import replay_under_settings
from tracekit.io.snapshot import snapshot_to_trace

from .allocator_synth import Recorder, random_run

CONFIGS = ["", "max_split_size_mb:40", "roundup_power2_divisions:4", "expandable_segments:True",
           "garbage_collection_threshold:0.5", "expandable_segments:True,roundup_power2_divisions:[1:2,>:8]",
           "max_split_size_mb:64,max_non_split_rounding_mb:30"]

sizes = st.one_of(st.integers(1, 4096), st.integers(4096, 2 * MB), st.integers(2 * MB, 64 * MB),
                  st.sampled_from([512, MB, MB + 1, 10 * MB, 20 * MB, 100 * MB]))
ops = st.lists(st.tuples(st.sampled_from(["malloc", "malloc", "free", "free_later", "complete", "empty_cache"]),
                         sizes, st.sampled_from([0, 3]), st.integers(0, 10**6)), min_size=1, max_size=120)


def _split_ok(alloc: Allocator, b, cfg):
    """An allocated block is its rounded request, or more only where the allocator keeps a remainder."""
    want = cfg.round_size(b.requested)
    extra = b.size - want
    if extra == 0:
        return True
    if extra < 0 or b.pool.small or cfg.expandable_segments:
        return False
    if want >= cfg.max_split_size:  # oversize: a whole cached block within max_non_split_rounding
        return extra < cfg.max_non_split_rounding + 2 * MB
    return extra <= SMALL_SIZE


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(conf=st.sampled_from(CONFIGS), steps=ops, capacity=st.sampled_from([None, 300 * MB, 800 * MB]))
def test_invariants(conf, steps, capacity):
    cfg = parse_alloc_conf(conf)
    fraction = 400 * MB if "garbage" in conf else None
    alloc = Allocator(cfg, Device(capacity=capacity), fraction)
    live, waiting = [], []
    for op, size, stream, pick in steps:
        if op == "malloc":
            try:
                live.append(alloc.malloc(size, stream))
            except OutOfMemory:
                pass
        elif op in ("free", "free_later") and live:
            b = live.pop(pick % len(live))
            alloc.free(b, completed=op == "free")
            if op == "free_later":
                waiting.append(b)
        elif op == "complete" and waiting:
            alloc.complete_free(waiting.pop(pick % len(waiting)))
        elif op == "empty_cache":
            alloc.release_cached()
            waiting = [b for b in waiting if b.pending]
        assert check(alloc) == []
        assert alloc.reserved >= alloc.allocated
        assert capacity is None or alloc.reserved <= capacity
        assert fraction is None or alloc.reserved <= fraction
        assert all(_split_ok(alloc, b, cfg) for b in live)
    for b in live:
        alloc.free(b)
    for b in waiting:
        alloc.complete_free(b)
    assert check(alloc) == [] and alloc.allocated == 0
    # everything freed: each segment (each mapped range of a growing one) is one free block
    for seg in alloc.snapshot():
        assert [b["state"] for b in seg["blocks"]] == ["inactive"], seg
    alloc.release_cached()
    assert alloc.reserved == 0 and check(alloc) == []


@pytest.mark.parametrize("conf", CONFIGS)
def test_the_replay_finds_every_block_where_the_model_put_it(conf):
    """Files the model writes (random streams, two streams, frees completed later, empty_cache, running out
    of a device's memory): replayed, every alloc is placed, and the end state and peaks are the writer's;
    also when the file lost its first entries (a wrapped ring buffer)."""
    cfg = parse_alloc_conf(conf)
    for seed in range(8):
        cap = 600 * MB if seed % 3 == 0 else None
        frac = 500 * MB if "garbage" in conf else None
        rec = random_run(seed, cfg, streams=(0, 7), capacity=cap, memory_fraction_bytes=frac)
        for drop in (0, 37):
            trace = snapshot_to_trace(rec.snapshot(drop_first=drop), "synth")
            r = model_replay.replay_device_in_python(trace, 0)
            assert not r.unplaced and r.final_mismatch == 0 and not r.initial.problems, (seed, drop, r.unplaced)
            assert r.placed == sum(1 for e in rec.trace[drop:] if e["action"] == "alloc")
            if drop == 0:
                assert r.peak_allocated == rec.alloc.peak_allocated
                assert r.peak_reserved == rec.alloc.peak_reserved


@pytest.mark.parametrize("conf", CONFIGS)
def test_the_model_left_alone_repeats_itself(conf):
    """The what-if under the file's own settings makes the file's segment events again (sizes, order and,
    for cudaMalloc'ed segments, addresses) and the same peaks."""
    cfg = parse_alloc_conf(conf)
    for seed in range(6):
        cap = 600 * MB if seed % 3 == 0 else None
        frac = 500 * MB if "garbage" in conf else None
        limited = cap or frac
        rec = random_run(seed, cfg, streams=(0, 7), capacity=cap, memory_fraction_bytes=frac,
                         empty_cache=0 if limited else 0.01,
                         pending=0 if limited and ("garbage" in conf or "max_split" in conf) else 0.1)
        trace = snapshot_to_trace(rec.snapshot(), "synth")
        run = replay_under_settings(trace, 0, cfg, recorded=cfg, start="recorded", capacity=cap, memory_fraction_bytes=frac,
                       follow_addresses=True)
        keep = (lambda a, addr, z: (a, z)) if cfg.expandable_segments else (lambda a, addr, z: (a, addr, z))
        want = [keep(e["action"], e["addr"], e["size"]) for e in rec.trace if e["action"].startswith("segment_")]
        assert [keep(a, addr, z) for a, addr, z, _ in run.events] == want, seed
        assert (run.peak_reserved, run.peak_allocated) == (rec.alloc.peak_reserved, rec.alloc.peak_allocated)
        assert len(run.ooms) == sum(1 for e in rec.trace if e["action"] == "oom")


def _same(a, b):
    return (np.array_equal(a.allocated, b.allocated) and np.array_equal(a.reserved, b.reserved)
            and np.array_equal(a.block_size, b.block_size) and a.placed == b.placed and a.unplaced == b.unplaced
            and a.final_mismatch == b.final_mismatch and a.unplaced_slack == b.unplaced_slack
            and (a.initial_allocated, a.initial_reserved) == (b.initial_allocated, b.initial_reserved))


@pytest.mark.skipif(not compiled.compiled_available(), reason="the compiled replay is not built (no C compiler)")
@given(seed=st.integers(0, 10**6), conf=st.sampled_from([c for c in CONFIGS if "expandable" not in c]),
       damage=st.sampled_from(["none", "drop", "shuffle", "unknown_free", "foreign_alloc"]))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_compiled_replay_equals_python(seed, conf, damage):
    """Entry for entry the same figures and the same counts of what could not be followed, on good files and
    on damaged ones (lost entries, entries out of order, frees of unknown addresses, allocations outside)."""
    import random

    cfg = parse_alloc_conf(conf)
    rec = random_run(seed, cfg, steps=200, streams=(0, 5), capacity=500 * MB if seed % 2 else None,
                     memory_fraction_bytes=400 * MB if "garbage" in conf else None)
    snap = rec.snapshot()
    tr = snap["device_traces"][0]
    rng = random.Random(seed)
    if damage == "drop" and tr:
        del tr[rng.randrange(len(tr))::7]
    elif damage == "shuffle" and len(tr) > 10:
        k = rng.randrange(len(tr) - 5)
        tr[k:k + 5] = rng.sample(tr[k:k + 5], 5)
    elif damage == "unknown_free":
        tr.insert(rng.randrange(len(tr) + 1), {"action": "free_completed", "addr": 0xABC000, "size": 512, "stream": 0})
    elif damage == "foreign_alloc":
        tr.insert(rng.randrange(len(tr) + 1), {"action": "alloc", "addr": 0x1234000, "size": 3 * MB, "stream": 0})
    trace = snapshot_to_trace(snap, "synth")
    py = model_replay.replay_device_in_python(trace, 0)
    c = compiled.replay_device(trace, 0)
    assert c.engine == "compiled"
    assert _same(py, c), (py.unplaced, c.unplaced)


@pytest.mark.skipif(not compiled.compiled_available(), reason="the compiled replay is not built (no C compiler)")
def test_compiled_replay_equals_python_on_the_recordings(monkeypatch):
    from .conftest import FIXTURES, ROOT, SAMPLES
    import tracekit

    files = sorted((ROOT / "tests/fixtures/cuda").glob("*.gz")) + sorted(SAMPLES.glob("*_cuda.pickle")) \
        + sorted(FIXTURES.glob("snapshot_*.pickle"))
    for path in files:
        trace = tracekit.load(path, use_cache=False)
        c = compiled.replay_device(trace, 0)
        py = model_replay.replay_device_in_python(trace, 0)
        assert c.engine == "compiled" and _same(py, c), path.name
    monkeypatch.setenv("TRACEKIT_ALLOCATOR", "python")
    assert compiled.replay_device(trace, 0).engine == "python"


def test_first_touches_without_the_extension(monkeypatch):
    """The numpy path that finds where each address first appears gives what the compiled one gives."""
    import builtins

    from tracekit.analysis.allocator import state

    rec = random_run(11, steps=300)
    trace = snapshot_to_trace(rec.snapshot(drop_first=50), "synth")
    a = model_replay.replay_device_in_python(trace, 0)
    real_import = builtins.__import__

    def no_ext(name, *args, **kw):
        if name.endswith("_replay") or (args and args[2] and "first_touches" in (args[2] or ())):
            raise ImportError("pretend it was not built")
        return real_import(name, *args, **kw)

    monkeypatch.setattr(builtins, "__import__", no_ext)
    b = model_replay.replay_device_in_python(trace, 0)
    monkeypatch.setattr(builtins, "__import__", real_import)
    assert _same(a, b)
    u1 = state.first_touches(trace.events.action, trace.events.addr.astype(np.int64))
    assert len(u1[0]) > 10


def test_an_oversize_request_reuses_a_cached_block_only_close_to_its_size():
    cfg = parse_alloc_conf("max_split_size_mb:100")
    rec = Recorder(cfg)
    a = rec.malloc(200 * MB)
    rec.free(a)
    assert rec.malloc(190 * MB) == a  # within 20 MiB: the whole 200 MiB block
    b = rec.malloc(150 * MB)
    assert b != a  # 50 MiB bigger than asked: a new segment instead
    c = rec.malloc(50 * MB)  # below max_split_size: never an oversize block
    assert rec.alloc.blocks[c].size == 50 * MB
