"""The walk of the entries in order (_replay.change_steps, _replay.group_peaks) against the sorts it replaces
(timeline._sorted_steps, modules._sorted_group_peaks): the same step functions, dtypes included, and the same
peaks per group, on random allocations and on every real file; and the cases where it gives up."""
from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from tracekit.analysis import modules as M
from tracekit.analysis import timeline as T

if T._steps_compiled is None or M._peaks_compiled is None:  # pragma: no cover
    pytest.skip("the compiled replay is not built", allow_module_level=True)

ROOT = Path(__file__).parents[1]
FILES = sorted(p for p in (ROOT / "tests" / "fixtures" / "real").glob("snapshot*.pickle")) + \
    sorted(p for p in (ROOT / "samples").glob("*.pickle"))


def allocations(rng, m, n, before=0.1, never=0.2, idle=0.05):
    """m allocations over n entries as replay makes them: each entry at most one change, the rows in order of
    their first entry; some made before the trace, some never freed, some neither (no change: anywhere)."""
    entries = np.sort(rng.choice(n, 2 * m, replace=False)) if 2 * m <= n else np.arange(2 * m)
    first, second = entries[0::2].copy(), entries[1::2].copy()
    rng.shuffle(second)  # frees in any order after... or before (a free of another row)
    a = np.where(rng.random(m) < before, -1, np.minimum(first, second))
    f = np.where(rng.random(m) < never, -1, np.maximum(first, second))
    none = rng.random(m) < idle
    a[none], f[none] = -1, -1
    key = np.where(a >= 0, a, f)
    order = np.argsort(np.where(key >= 0, key, rng.integers(0, n, m)), kind="stable")  # idle rows anywhere
    return (a[order].astype(np.int64), f[order].astype(np.int64),
            rng.integers(0, 1 << 40, m).astype(np.int64))


def same_steps(got, want):
    assert len(got) == len(want)
    for (i0, p0, c0), (i1, p1, c1) in zip(got, want):
        assert type(i0) is type(i1) and i0 == i1
        assert p0.dtype == p1.dtype and np.array_equal(p0, p1)
        assert c0.dtype == c1.dtype and np.array_equal(c0, c1)


@pytest.mark.parametrize("seed", range(16))
def test_random_allocations_walk_as_the_sorts(seed):
    rng = np.random.default_rng(seed)
    m = int(rng.integers(0, 3000))
    # some spread over several windows of the walk (1 << 20 entries), long-lived ones waiting across them
    n = int(rng.choice([2 * m + 5, 4 * m + 1, 3 << 20, 9 << 20]))
    a, f, size = allocations(rng, m, n)
    count = int(rng.integers(1, 12))
    for dtype in (np.int8, np.int16, np.int32, np.int64):
        lab = rng.integers(-1, count + 2, m).astype(dtype)  # outside [0, count): in no category
        got = T._walked_steps(a, f, size, lab, count, n)
        assert got is not None
        same_steps(got, T._sorted_steps(a, f, size, lab, count, n))
        al = SimpleNamespace(alloc_index=a, free_index=f, size=size)
        group = rng.integers(-1, count, m).astype(dtype)
        assert M._peaks_compiled(a, f, size, group, count) is not None
        got = M.group_peaks(group, al, count)
        assert got.dtype == np.int64 and np.array_equal(got, M._sorted_group_peaks(group, al, count))


def test_many_waiting_across_windows():
    rng = np.random.default_rng(5)
    m = 20000  # made in the walk's first window, freed in its third, in any order; a few made there too
    a = np.r_[np.arange(m), rng.permutation(m) + m + (2 << 20)][: m + 100].astype(np.int64)
    f = np.r_[rng.permutation(m) + (2 << 20), np.full(100, -1)].astype(np.int64)
    size = rng.integers(1, 1 << 30, m + 100).astype(np.int64)
    lab = rng.integers(0, 3, m + 100).astype(np.int16)
    n = 3 << 20
    got = T._walked_steps(a, f, size, lab, 3, n)
    assert got is not None
    same_steps(got, T._sorted_steps(a, f, size, lab, 3, n))
    al = SimpleNamespace(alloc_index=a, free_index=f, size=size)
    assert M._peaks_compiled(a, f, size, lab, 3) is not None
    assert np.array_equal(M.group_peaks(lab, al, 3), M._sorted_group_peaks(lab, al, 3))


def test_empty():
    z = np.zeros(0, np.int64)
    same_steps(T._walked_steps(z, z, z, z.astype(np.int16), 3, 0), T._sorted_steps(z, z, z, z, 3, 0))
    al = SimpleNamespace(alloc_index=z, free_index=z, size=z)
    assert M._peaks_compiled(z, z, z, z.astype(np.int32), 4) == bytearray(32)
    assert M.group_peaks(z.astype(np.int32), al, 0).tolist() == []


@pytest.mark.parametrize("case", ["walked", "two changes at one entry", "alloc and free at one entry", "out of order",
                                  "before -1", "past int32"])
def test_the_walk_gives_up_where_the_sort_is_the_rule(case):
    a = np.array([0, -1, 2, 4], np.int64)  # in order of their first entry, one change per entry: walked
    f = np.array([3, 1, 5, -1], np.int64)
    if case == "two changes at one entry":
        f[2] = 4  # freed where another is made: a free goes first in group_peaks
    elif case == "alloc and free at one entry":
        f[0] = 0
    elif case == "out of order":
        a[2], f[2] = 3 << 20, -1  # a window of the walk past the next row's alloc
    elif case == "before -1":
        a[1] = -2
    elif case == "past int32":
        a[3] = 2**31 - 1
    size = np.array([5, 7, 11, 13], np.int64)
    group = np.zeros(4, np.int32)
    assert (T._steps_compiled(a, f, size, group.astype(np.int16), 1) is None) == (case != "walked")
    assert (M._peaks_compiled(a, f, size, group, 1) is None) == (case != "walked")
    al = SimpleNamespace(alloc_index=a, free_index=f, size=size)
    assert M.group_peaks(group, al, 1).tolist() == M._sorted_group_peaks(group, al, 1).tolist()


def test_a_free_and_an_alloc_at_one_entry_peak_after_the_entry():
    # impossible in a replay (one change per entry); the sort's rule holds there: the free first
    al = SimpleNamespace(alloc_index=np.array([0, 1], np.int64), free_index=np.array([1, -1], np.int64),
                         size=np.array([10, 10], np.int64))
    assert M.group_peaks(np.zeros(2, np.int32), al, 1).tolist() == [10]


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_real_files_walk_as_the_sorts(path):
    from tracekit.analysis.categories import categorize
    from tracekit.analysis.replay import replay
    from tracekit.io import load

    trace = load(path, use_cache=False)
    cats = categorize(trace)
    for d, rep in replay(trace).items():
        al = rep.allocations
        lab, count = cats[d].labels, len(cats[d].names)
        got = T._walked_steps(al.alloc_index, al.free_index, al.size, lab, count, rep.n)
        assert got is not None or not trace.meta.get("has_addresses", True)
        if got is not None:
            same_steps(got, T._sorted_steps(al.alloc_index, al.free_index, al.size, lab, count, rep.n))
        module, backward, *_ = M.allocation_module_ids(trace, rep)
        group = (module.astype(np.int64) * 2 + backward) % 7 - 1  # -1: in no group
        for g in (group.astype(np.int32), group):
            assert M._peaks_compiled(al.alloc_index, al.free_index, al.size, g, 6) is not None
            assert np.array_equal(M.group_peaks(g, al, 6), M._sorted_group_peaks(g, al, 6))


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_categories_summed_at_points_equal_the_step_functions(path):
    """A lean report's categories at its points (timeline._live_by_category: the allocations live there, summed)
    are the step functions' read at the same points, on every real file and sample, at random points, both ends,
    before the first entry and repeated points."""
    import tracekit
    from tracekit.analysis.replay import replay

    trace = tracekit.load(path, use_cache=False)
    rng = np.random.default_rng(7)
    for d in trace.devices:
        n = replay(trace)[d].n
        k = min(5, n - 1)
        pts = np.r_[-1, rng.integers(-1, n, 200), 0, n - 1, k, k] if n else np.r_[-1, -1]
        want = T.categories_at(trace, d, pts)
        got = T.categories_at(trace, d, pts, steps=False)
        assert list(got) == list(want)
        for name in want:
            assert got[name].dtype == np.int64 and np.array_equal(got[name], want[name]), (path.name, name)
