"""Opening a big file holds little (issue 35): columns of one value take no memory, the allocator state at
the peak reads only the entries up to it, membership tests on addresses are sorted, not hashed; every
figure stays what it was."""
import os

import numpy as np
import pytest

from tracekit.analysis.allocator import compiled as fast
from tracekit.analysis.report import build_report
from tracekit.io import load
from tracekit.io.cache import traces
from tracekit.model import Events, compact_column, constant_column, isin_ints

from .conftest import SAMPLES

CUDA_SAMPLE = SAMPLES / "gpt_adamw_cuda.pickle"


def _columns(trace):
    return {k: np.asarray(v) for k, v in vars(trace.events).items() if isinstance(v, np.ndarray)}


def test_constant_columns_take_no_memory_and_read_the_same(monkeypatch):
    streamed = load(CUDA_SAMPLE, use_cache=False)
    monkeypatch.setenv("TRACEKIT_READER", "python")
    python = load(CUDA_SAMPLE, use_cache=False)
    for name, col in _columns(streamed).items():
        other = _columns(python)[name]
        assert col.dtype == other.dtype, name
        if name in ("user_metadata", "compile_context", "category", "module"):  # ids of strings: the texts
            col, other = ([t.strings[i] for i in c.tolist()] for t, c in ((streamed, col), (python, other)))
        elif name in ("stack_id", "forward_stack_id"):
            col, other = ([t.stack(i) if i >= 0 else None for i in c.tolist()] for t, c in ((streamed, col), (python, other)))
        assert np.array_equal(col, other) if isinstance(col, np.ndarray) else col == other, name
    ev = streamed.events
    assert ev.device.strides == (0,) and ev.device_free.strides == (0,)  # one value: a view of it
    assert not ev.device.flags.writeable  # nothing writes into a trace's columns
    assert ev.addr.strides != (0,)


def test_constant_columns_survive_the_cache():
    trace = load(CUDA_SAMPLE, use_cache=False)
    traces.write("k35", trace)
    back = traces.read("k35", str(CUDA_SAMPLE))
    assert back is not None
    for name, col in _columns(trace).items():
        assert np.array_equal(col, _columns(back)[name]), name
    assert build_report(back) == build_report(trace)


def test_compact_and_constant_column():
    a = np.array([7, 7, 7], np.int64)
    c = compact_column(a)
    assert c.strides == (0,) and c.dtype == np.int64 and c.tolist() == [7, 7, 7]
    b = np.array([7, 8], np.int64)
    assert compact_column(b) is b
    assert constant_column(-1, 0, np.int32).shape == (0,)
    ev = Events(*(np.zeros(4, t) for t in (np.int32, np.int64, np.int8, np.uint64, np.int64, np.int64, np.int64,
                                           np.int32, np.int32, np.int32, np.int32, np.int64)))
    assert ev.forward_stack_id.tolist() == [-1] * 4 and ev.module.tolist() == [0] * 4


@pytest.mark.parametrize("dtype", [np.uint64, np.int64, np.int32])
def test_isin_ints_is_isin(dtype):
    rng = np.random.default_rng(35)
    big = (rng.integers(0, 50, 5000) << 40).astype(dtype) if dtype != np.int32 else rng.integers(0, 99, 5000, dtype)
    small = np.concatenate([big[:20], rng.integers(0, 2**30, 30).astype(dtype)])
    assert np.array_equal(isin_ints(small, big), np.isin(small, big))  # a few asked of many (repeats among them)
    assert np.array_equal(isin_ints(big, small), np.isin(big, small))  # many asked of a few
    assert isin_ints(small, big[:0]).tolist() == [False] * len(small)
    assert np.array_equal(isin_ints(small, big.astype(np.float64)), np.isin(small, big.astype(np.float64)))


def test_state_at_an_entry_reads_only_up_to_it(monkeypatch):
    trace = load(CUDA_SAMPLE, use_cache=False)
    n = len(trace.events.action)
    for i in (0, n // 3, n - 2, n - 1):
        compiled = fast.segments_at(trace, 0, i)
        monkeypatch.setenv("TRACEKIT_ALLOCATOR", "python")
        assert fast.segments_at(trace, 0, i) == compiled, i
        monkeypatch.delenv("TRACEKIT_ALLOCATOR")


def _group_peaks_before(group, al, n_groups):  # the implementation before issue 35, for reference
    rows = np.flatnonzero(group >= 0)
    out = np.zeros(n_groups, np.int64)
    if not len(rows):
        return out
    born = al.alloc_index[rows].astype(np.int64) + 1
    freed = al.free_index[rows].astype(np.int64) + 1
    end = int(max(born.max(), freed.max())) + 1
    freed = np.where(freed > 0, freed, end)
    span = 2 * (end + 1)
    g = group[rows].astype(np.int64) * span
    key = np.concatenate([g + born * 2 + 1, g + freed * 2])
    order = np.argsort(key, kind="stable")
    grp = key[order] // span
    size = al.size[rows].astype(np.int64)
    live = np.cumsum(np.concatenate([size, -size])[order])
    starts = np.flatnonzero(np.r_[True, grp[1:] != grp[:-1]])
    base = np.r_[0, live[starts[1:] - 1]]
    live = live - np.repeat(base, np.diff(np.r_[starts, len(grp)]))
    out[grp[starts]] = np.maximum.reduceat(live, starts)
    return out


@pytest.mark.parametrize("chunk,group_rows", [(3, 1 << 19), (1 << 20, 1 << 19), (3, 7), (1 << 20, 1)])
def test_group_peaks_read_back_in_chunks(monkeypatch, chunk, group_rows):
    from types import SimpleNamespace

    from tracekit.analysis import modules

    monkeypatch.setattr(modules, "CHUNK", chunk)
    monkeypatch.setattr(modules, "GROUP_ROWS", group_rows)  # a few groups at a time, or one
    monkeypatch.setattr(modules, "_peaks_compiled", None)  # the sort (tests/test_walk_compiled.py: the walk)
    rng = np.random.default_rng(35)
    for m in (1, 2, 50, 400):
        entries = rng.permutation(3 * m)
        alloc = np.where(rng.random(m) < 0.2, -1, entries[:m])
        free = np.where(rng.random(m) < 0.3, -1, entries[m:2 * m])
        al = SimpleNamespace(alloc_index=alloc.astype(np.int64), free_index=free.astype(np.int64),
                             size=rng.integers(1, 1 << 30, m).astype(np.int64))
        group = rng.integers(-1, 5, m).astype(np.int32)
        assert np.array_equal(modules.group_peaks(group, al, 5), _group_peaks_before(group, al, 5))


def test_remembered_peaks_are_kept_by_curve_name_not_id():
    from tracekit.analysis.replay import replay

    trace = load(CUDA_SAMPLE, use_cache=False)
    rep = replay(trace)[0]
    big = rep.__class__(**{**{k: getattr(rep, k) for k in rep.__dataclass_fields__},
                           "allocated": np.tile(rep.allocated, 100), "reserved": np.tile(rep.reserved, 100)})
    assert (big.peak_allocated, big.peak_index) == (rep.peak_allocated, rep.peak_index)
    assert set(big.__dict__["_peaks"]) == {("allocated", rep.initial_allocated)}
    assert big.peak_reserved == rep.peak_reserved
