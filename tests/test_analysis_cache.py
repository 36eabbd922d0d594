"""The analysis kept beside a cached trace (tracekit/io/cache/memo.py): restored, it gives exactly what
computing gives; it never outlives its trace, its window or its code; a damaged one is a miss."""
from __future__ import annotations

import json
import os
import shutil

import numpy as np
import pytest

import tracekit
from tracekit.io.cache import folder as cachefiles
from tracekit.io.cache import memo as analysis_cache
from tracekit.analysis.categories import categorize
from tracekit.analysis.phases import phases
from tracekit.analysis.replay import replay
from tracekit.analysis.report import build_report
from tracekit.analysis.sites import allocation_where
from tracekit.analysis.timeline import category_series
from tracekit.analysis.window import Window, select

from .conftest import SAMPLES, fixture


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACEKIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(cachefiles, "RACY_S", 0.0)  # files copied a moment ago may be fingerprinted
    return tmp_path / "cache"


def _analyse(trace):
    """What the viewer computes on open (gui/document.py), as comparable plain values."""
    out = {"report": json.dumps(build_report(trace), sort_keys=True)}
    for d, rep in replay(trace).items():
        out[f"replay {d}"] = [rep.n, rep.peak_allocated, rep.peak_index, rep.allocated.tolist(),
                              rep.allocations.size.tolist(), rep.allocations.free_index.tolist()]
        c = categorize(trace)[d]
        out[f"categories {d}"] = [c.labels.tolist(), list(c.names), c.reason.tolist()]
        p = phases(trace)[d]
        out[f"phases {d}"] = [p.source, p.phase.tolist(), p.iteration.tolist()]
        strings, ids = allocation_where(trace, rep)
        out[f"where {d}"] = [list(strings), ids.tolist()]
        s = category_series(trace, d, max_points=300)
        out[f"series {d}"] = {k: v.tolist() for k, v in s.by_category.items()}
    return out


@pytest.mark.parametrize("name, window", [
    (fixture("snapshot_cpp_frames_adamw_full_step.pickle"), None),
    (fixture("snapshot_newest_format_windows_paths.pickle"), Window(first=100, last=900)),
    (SAMPLES / "leak_loop.pickle", Window(iterations=(1, 2))),
])
def test_restored_analysis_is_the_computed_one(tmp_path, cache_dir, name, window):
    p = tmp_path / "f.pickle"
    shutil.copy(name, p)
    fresh = tracekit.load(p, use_cache=False)
    truth = _analyse(select(fresh, window) if window else fresh)
    first = tracekit.load(p)
    cut = select(first, window) if window else first
    _analyse(cut)
    assert analysis_cache.store(cut, p, window, extra={"report": build_report(cut)})
    again = tracekit.load(p)
    extra = analysis_cache.restore(again, p, window) if not window else None
    if window:
        analysis_cache.store(first, p)
        assert analysis_cache.restore(again, p) is not None
        again = select(again, window)
        extra = analysis_cache.restore(again, p, window)
    assert extra["report"] == build_report(cut)
    restored = set(again._memo)
    assert {k[1] for k in restored} >= {"replay", "_categorize", "phases", "_allocation_steps"}
    assert _analyse(again) == truth
    assert set(again._memo) == restored  # nothing had to be computed again


def test_it_goes_with_its_trace_code_and_window(tmp_path, cache_dir, monkeypatch):
    p = tmp_path / "f.pickle"
    shutil.copy(fixture("snapshot_cpp_frames_attention_fwd_bwd.pickle"), p)
    t = tracekit.load(p)
    build_report(t)
    assert analysis_cache.store(t, p)
    assert analysis_cache.restore(tracekit.load(p), p, Window(first=3)) is None  # another window
    monkeypatch.setattr(cachefiles, "_STAMP", "other code")
    assert analysis_cache.restore(tracekit.load(p), p) is None
    monkeypatch.undo()
    monkeypatch.setenv("TRACEKIT_CACHE_DIR", str(cache_dir))
    monkeypatch.setattr(cachefiles, "RACY_S", 0.0)
    assert analysis_cache.restore(tracekit.load(p), p) == {}
    os.unlink(cachefiles._file(cachefiles.known_key(p)))  # the trace's entry goes: so does its analysis
    from tracekit.io.cache import traces as cache

    cache.evict(cache.max_bytes())
    assert not list(cache_dir.glob("*.tkm"))


@pytest.mark.parametrize("damage", ["truncate", "flip"])
def test_a_damaged_analysis_is_a_miss(tmp_path, cache_dir, damage):
    p = tmp_path / "f.pickle"
    shutil.copy(fixture("snapshot_cpp_frames_attention_fwd_bwd.pickle"), p)
    t = tracekit.load(p)
    build_report(t)
    assert analysis_cache.store(t, p)
    (fn,) = cache_dir.glob("*.tkm")
    data = bytearray(fn.read_bytes())
    if damage == "truncate":
        data = data[: len(data) - 7]
    else:
        data[-3] ^= 0xFF  # inside the last column's sampled end
    fn.write_bytes(bytes(data))
    fresh = tracekit.load(p)
    assert analysis_cache.restore(fresh, p) is None and not fn.exists()
    assert not fresh.__dict__.get("_memo")


def test_unstorable_memo_entries_are_left_out(tmp_path, cache_dir):
    p = tmp_path / "f.pickle"
    shutil.copy(fixture("snapshot_cpp_frames_attention_fwd_bwd.pickle"), p)
    t = tracekit.load(p)
    t.__dict__.setdefault("_memo", {})[("tracekit.x", "f", ())] = object()
    t._memo[("tracekit.y", "g", ())] = np.arange(6).reshape(2, 3)
    assert analysis_cache.store(t, p)
    again = tracekit.load(p)
    analysis_cache.restore(again, p)
    assert ("tracekit.x", "f", ()) not in again._memo
    assert again._memo[("tracekit.y", "g", ())].tolist() == [[0, 1, 2], [3, 4, 5]]


def test_constant_arrays_are_stored_as_their_value(tmp_path, cache_dir):
    p = tmp_path / "f.pickle"
    shutil.copy(fixture("snapshot_cpp_frames_attention_fwd_bwd.pickle"), p)
    t = tracekit.load(p)
    n = analysis_cache.CONSTANT_MIN
    values = {"i8": np.full(n, -7, np.int64), "b": np.ones(n, bool), "2d": np.full((2, n), 3, np.int16),
              "f": np.zeros(n), "almost": np.r_[np.zeros(n - 1, np.int32), 1], "small": np.zeros(5, np.int8)}
    t.__dict__.setdefault("_memo", {})[("tracekit.x", "f", ())] = values
    assert analysis_cache.store(t, p)
    (fn,) = cache_dir.glob("*.tkm")
    assert fn.stat().st_size < n * (4 + 8 + 1)  # the ints and bools of one value take no column
    again = tracekit.load(p)
    analysis_cache.restore(again, p)
    got = again._memo[("tracekit.x", "f", ())]
    for k, v in values.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape and (got[k] == v).all(), k
        got[k][...] = 0  # writable, as a mapped column is


def test_analyses_of_older_code_are_dropped_when_a_new_one_is_stored(tmp_path, cache_dir, monkeypatch):
    p = tmp_path / "f.pickle"
    shutil.copy(fixture("snapshot_cpp_frames_attention_fwd_bwd.pickle"), p)
    t = tracekit.load(p)
    build_report(t)
    assert analysis_cache.store(t, p, code=" viewer=1")
    assert analysis_cache.store(t, p, Window(first=2), code=" viewer=1")
    assert len(list(cache_dir.glob("*.tkm"))) == 2  # two windows, both kept
    assert analysis_cache.store(t, p, code=" viewer=2")
    assert len(list(cache_dir.glob("*.tkm"))) == 1  # the viewer changed: its older entries cannot be read
    assert analysis_cache.restore(tracekit.load(p), p, code=" viewer=2") == {}
    assert analysis_cache.store(t, p)  # tracekit's own entry beside the viewer's (a big file's first open)
    assert len(list(cache_dir.glob("*.tkm"))) == 2
    monkeypatch.setattr(cachefiles, "_STAMP", "other tracekit")
    assert analysis_cache.store(t, p)
    assert len(list(cache_dir.glob("*.tkm"))) == 1


@pytest.mark.parametrize("behind", [False, True])
@pytest.mark.parametrize("window", [None, Window(iterations=(1, 2))])
def test_a_warm_viewer_document_is_the_cold_one(tmp_path, cache_dir, window, behind, monkeypatch):
    pytest.importorskip("PySide6")
    from tracekit_gui import document
    from tracekit_gui.document import Document

    if behind:  # a big file's way: the analysis kept on threads, in two entries (tracekit's, then the viewer's)
        monkeypatch.setattr(document, "KEEP_BEHIND_BYTES", 0)

    p = tmp_path / "f.pickle"
    shutil.copy(SAMPLES / "leak_loop.pickle", p)

    def seen(doc):
        d = doc.default_device()
        s = doc.series(d, max_points=3000)
        return [json.dumps(doc.report, sort_keys=True), doc.xs(d)[0].tolist(), doc.phase_spans(d),
                doc.iteration_starts(d), {k: v.tolist() for k, v in s.by_category.items()},
                doc.table_order(d, "size", doc.replays[d].allocations.size).tolist(), doc.where_table(d)[1].tolist(),
                doc.labels(d)[0].tolist()]

    truth = seen(Document.open(p, use_cache=False, window=window))
    cold = Document.open(p, window=window)
    assert seen(cold) == truth
    document.wait_kept()
    entries = list(cache_dir.glob("*.tkm"))
    assert len(entries) == (2 + (window is not None) if behind else 1 + (window is not None))
    warm = Document.open(p, window=window)
    d = warm.default_device()
    for what in (("series", 2048), "library", "modules", ("order", "size"), "has_timeline"):
        assert (what, d) in warm._kept  # restored (a warm open computes no series, no tables)
    assert {k[1] for k in warm.trace._memo} >= {"replay", "_categorize", "phases", "_allocation_libraries"}
    assert seen(warm) == truth
    assert warm.library_table(d)[1].tolist() == cold.library_table(d)[1].tolist()
    assert warm.module_table(d)[1].tolist() == cold.module_table(d)[1].tolist()
