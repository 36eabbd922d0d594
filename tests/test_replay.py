"""Replay against the real fixtures (figures from SOURCES.md and an independent naive replay)
and against synthetic snapshots of the shapes the fixtures lack."""
import gzip
import json

import numpy as np
import pytest

import tracekit
from tracekit.analysis.replay import replay
from tracekit.io.unpickle import restricted_load

from .conftest import fixture
from .oracle import naive_replay
from .synth import MiB, Sim

NEWEST = "snapshot_newest_format_windows_paths.pickle"
LEGACY = "snapshot_legacy_torch20_oom_observer.pickle"


def raw(name):
    with open(fixture(name), "rb") as f:
        return restricted_load(f)


def mib(n):
    return round(n / MiB, 1)


def test_newest_fixture_matches_sources_md_and_naive_replay():
    snap = raw(NEWEST)
    rep = replay(tracekit.load(fixture(NEWEST)))[0]
    naive = naive_replay(snap)
    # SOURCES.md: starts at 1313.9 MiB, peaks at 13282.6 MiB at entry 1402, ends at 1313.9, reserved 13524 MiB
    assert (mib(rep.initial_allocated), mib(rep.peak_allocated), rep.peak_index) == (1313.9, 13282.6, 1402)
    assert mib(rep.final_allocated) == 1313.9 and mib(rep.final_reserved) == 13524.0
    assert rep.initial_allocated == naive["start"]
    assert rep.peak_allocated == naive["peak"] and rep.peak_index == naive["peak_index"]
    assert rep.allocated.tolist() == naive["curve"]
    assert rep.final_reserved == naive["reserved_end"]
    assert rep.invariant.checked and rep.invariant.ok


def test_newest_fixture_before_trace_frees():
    # SOURCES.md: 312.5 MiB of frees whose allocations happened before recording
    rep = replay(tracekit.load(fixture(NEWEST)))[0]
    al = rep.allocations
    pre = (al.alloc_index == -1) & (al.free_index >= 0)
    assert mib(al.size[pre].sum()) == 312.5


def test_legacy_fixture_history_blocks():
    snap = raw(LEGACY)
    trace = tracekit.load(fixture(LEGACY))
    rep = replay(trace)[0]
    # SOURCES.md: 11291.7 MiB allocated, 11296 MiB reserved, no trace (one snapshot entry)
    assert mib(rep.peak_allocated) == 11291.7 and mib(rep.final_reserved) == 11296.0
    assert rep.peak_allocated == naive_replay(snap)["start"]
    assert len(trace.segments) == 176 and rep.invariant.ok
    # addresses of legacy blocks are laid out from the segment start
    seg0 = snap["segments"][0]
    assert int(trace.blocks.addr[0]) == seg0["address"] == seg0["blocks"][0]["history"][0]["addr"]
    # frames come from the block history
    assert trace.stack(int(trace.blocks.stack_id[0]))[0]["name"] == "allocate"


def test_kineto_replay_matches_total_allocated_field():
    """The profiler writes the running total on every event: our replay must reproduce it."""
    path = fixture("kineto_trace_memory_v100_rank1.json.gz")
    doc = json.load(gzip.open(path))
    mem = sorted((e for e in doc["traceEvents"] if e.get("name") == "[memory]"), key=lambda e: e["ts"])
    expected = [e["args"]["Total Allocated"] for e in mem if e["args"]["Device Type"] == 1]
    reserved = [e["args"]["Total Reserved"] for e in mem if e["args"]["Device Type"] == 1]
    trace = tracekit.load(path)
    rep = replay(trace)[1]
    alloc_or_free = np.isin(trace.events.action[rep.events], (0, 2))
    assert rep.allocated[alloc_or_free].tolist() == expected
    assert rep.peak_allocated == max(expected)
    assert rep.reserved[alloc_or_free].tolist() == reserved


def test_old_kineto_without_addresses_gives_totals():
    path = fixture("kineto_trace_memory_torch19_resnet50.json.gz")
    doc = json.load(gzip.open(path))
    cuda = [e["args"]["Bytes"] for e in sorted(doc["traceEvents"], key=lambda e: e.get("ts", 0))
            if e.get("name") == "[memory]" and e["args"].get("Device Type") == 1]
    rep = replay(tracekit.load(path))[0]
    assert rep.peak_allocated == max(np.cumsum(cuda))
    assert len(rep.allocations) == 0  # no addresses: no lifetimes, and we do not invent them


def test_memory_timeline_raw():
    path = fixture("profiler_memory_timeline_raw.json.gz")
    rows = json.load(gzip.open(path))
    trace = tracekit.load(path)
    rep = replay(trace)[0]
    assert len(trace.events) == len(rows) == 16845
    assert rep.peak_allocated == max(np.cumsum([r[2] for r in rows]))


def _check_against_naive(snap, device=0):
    from tracekit.io import to_trace

    trace = to_trace(snap, "<synthetic>")
    rep = replay(trace)[device]
    naive = naive_replay(snap, device)
    assert rep.invariant.ok, rep.invariant.problems
    assert rep.allocated.tolist() == naive["curve"]
    assert rep.initial_allocated == naive["start"]
    assert rep.final_reserved == naive["reserved_end"]
    return trace, rep


def test_synthetic_several_devices_and_streams():
    sim = Sim(devices=2, streams=(0, 7))
    a = sim.alloc(4 * MiB, device=0)
    b = sim.alloc(8 * MiB, device=1, stream=7)
    sim.alloc(2 * MiB, device=1)
    sim.free(a, device=0)
    sim.free(b, device=1)
    snap = sim.snapshot()
    trace, rep0 = _check_against_naive(snap, 0)
    _, rep1 = _check_against_naive(snap, 1)
    assert trace.devices == [0, 1]
    assert rep0.peak_allocated == 4 * MiB and rep1.peak_allocated == 10 * MiB
    assert sorted(set(trace.events.stream.tolist())) == [0, 7]


def test_synthetic_expandable_segments():
    sim = Sim(expandable=True)
    a = sim.alloc(20 * MiB)
    sim.alloc(2 * MiB)
    sim.free(a)
    trace, rep = _check_against_naive(sim.snapshot())
    assert rep.peak_reserved == 22 * MiB and rep.initial_reserved == 0
    assert trace.segments.is_expandable.all()


def test_synthetic_pending_free_is_still_allocated():
    sim = Sim()
    a = sim.alloc(3 * MiB)
    sim.free(a, complete=False)  # free_requested only: the block is active_pending_free
    trace, rep = _check_against_naive(sim.snapshot())
    assert rep.final_allocated == 3 * MiB


def test_synthetic_oom_no_time_and_unknown_actions():
    sim = Sim(times=False)
    sim.alloc(5 * MiB)
    sim.unknown()
    sim.oom(64 * MiB, device_free=1 * MiB)
    trace, rep = _check_against_naive(sim.snapshot())
    assert not trace.has_time
    assert trace.meta["unknown_actions"] == ["future_action_from_torch_3"]
    oom = np.flatnonzero(trace.events.action == 8)
    assert trace.events.device_free[oom].tolist() == [1 * MiB]


def test_synthetic_ring_buffer_truncation():
    sim = Sim()
    early = [sim.alloc(MiB * (i + 1)) for i in range(3)]
    sim.alloc(10 * MiB)
    for a in early:
        sim.free(a)
    full = sim.snapshot()
    n_dropped = 8  # the first 3 allocs and their segment_allocs and part of the 4th are lost
    trace, rep = _check_against_naive(sim.snapshot(drop_first=n_dropped))
    # what the trace lost is now "before the trace": 1+2+3 MiB freed in it, 10 MiB alloc lost too
    assert rep.initial_allocated == naive_replay(full)["curve"][n_dropped - 1]
    assert rep.final_allocated == 10 * MiB


def test_bare_list_torch20():
    sim = Sim()
    sim.alloc(MiB)
    segments = sim.snapshot()["segments"]
    for s in segments:  # torch 2.0: no block addresses, a history list instead
        for b in s["blocks"]:
            b["history"] = [{"addr": b.pop("address"), "real_size": b["size"], "frames": b.pop("frames")}]
    trace = tracekit.io.to_trace(segments, "<bare>")
    rep = replay(trace)[0]
    assert rep.peak_allocated == MiB and trace.meta["bare_list"]


@pytest.mark.parametrize("name", [NEWEST, LEGACY])
def test_json_and_gzip_give_the_same_trace(tmp_path, name):
    snap = raw(name)
    as_json = tmp_path / "s.json"
    as_json.write_text(json.dumps(snap))
    as_gz = tmp_path / "s.pickle.gz"
    as_gz.write_bytes(gzip.compress(fixture(name).read_bytes()))
    reps = [replay(tracekit.load(p))[0] for p in (fixture(name), as_json, as_gz)]
    assert len({(r.peak_allocated, r.peak_index, r.final_reserved) for r in reps}) == 1


def test_cache_second_open_is_identical(tmp_path):
    first = tracekit.load(fixture(NEWEST))
    second = tracekit.load(fixture(NEWEST))  # from the cache now
    assert second.meta.get("container") == "pickle"
    for name in ("action", "addr", "size", "time_us", "stack_id"):
        assert np.array_equal(getattr(first.events, name), getattr(second.events, name))
    assert first.stack(int(first.events.stack_id[0])) == second.stack(int(second.events.stack_id[0]))
    assert replay(second)[0].peak_allocated == replay(first)[0].peak_allocated


def test_stale_cache_is_not_used(tmp_path):
    path = tmp_path / "s.pickle"
    sim = Sim()
    sim.alloc(MiB)
    import pickle

    path.write_bytes(pickle.dumps(sim.snapshot(), protocol=4))
    assert replay(tracekit.load(path))[0].peak_allocated == MiB
    sim.alloc(2 * MiB)
    path.write_bytes(pickle.dumps(sim.snapshot(), protocol=4))
    assert replay(tracekit.load(path))[0].peak_allocated == 3 * MiB


def test_cache_keeps_to_its_size_limit(tmp_path, monkeypatch):
    import os
    import pickle
    import time

    cache_dir = tmp_path / "c"
    monkeypatch.setenv("TRACEKIT_CACHE_DIR", str(cache_dir))
    paths = []
    for i in range(3):
        sim = Sim()
        sim.alloc((i + 1) * MiB)
        p = tmp_path / f"s{i}.pickle"
        p.write_bytes(pickle.dumps(sim.snapshot(), protocol=4))
        paths.append(p)
    tracekit.load(paths[0])
    one = sum(f.stat().st_size for f in cache_dir.glob("*.tkc"))
    monkeypatch.setenv("TRACEKIT_CACHE_MAX_MB", str(2.5 * one / 2**20))  # room for two files
    for p in paths[1:]:
        time.sleep(0.01)
        tracekit.load(p)
    from tracekit.io.cache import folder as cache

    kept = {f.stem for f in cache_dir.glob("*.tkc")}
    keys = [cache.key_for(str(p), os.stat(p)) for p in paths]
    assert kept == set(keys[1:])  # the least recently used one went
