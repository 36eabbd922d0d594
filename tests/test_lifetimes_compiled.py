"""The one-pass pairing of allocs and frees (_replay.pair_lifetimes) against the sort by address it replaces
(replay._lifetimes_sorted): the same allocations, row for row, and the same last state per address."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tracekit.analysis import replay as R

if R._pair_compiled is None:  # pragma: no cover
    pytest.skip("the compiled replay is not built", allow_module_level=True)

ROOT = Path(__file__).parents[1]
FILES = sorted(p for p in (ROOT / "tests" / "fixtures" / "real").glob("snapshot*.pickle")) + \
    sorted(p for p in (ROOT / "samples").glob("*.pickle"))


def same(got, want):
    rows, *last = got
    rows0, *last0 = want
    for k in R.Allocations.__dataclass_fields__:
        a, b = getattr(rows, k), getattr(rows0, k)
        assert a.dtype == b.dtype and np.array_equal(a, b), k
    for a, b in zip(last, last0):
        assert a.dtype == b.dtype and np.array_equal(a, b)


def columns(rng, n, addresses):
    """n allocs and frees over a few addresses, in any order: pairs, allocs never freed, frees never allocated,
    an address allocated twice in a row and freed twice in a row."""
    addr = rng.choice(np.array(addresses, np.uint64), n)
    kind = rng.integers(0, 3, n)  # 0 alloc, 1 free, 2 something else
    return (addr, rng.integers(1, 1 << 40, n).astype(np.int64), rng.integers(-1, 50, n).astype(np.int32),
            kind == 0, kind == 1)


@pytest.mark.parametrize("seed", range(20))
def test_random_orders_pair_as_the_sort_does(seed):
    rng = np.random.default_rng(seed)
    addresses = rng.integers(0, 2**64 - 1, 1 + seed * 7, dtype=np.uint64).tolist() + [0]
    cols = columns(rng, 50 + 400 * seed, addresses)
    same(R._lifetimes(*cols), R._lifetimes_sorted(*cols))


def test_the_empty_key_address_goes_the_sorted_way():
    addr = np.array([2**64 - 1, 2**64 - 1, 5], np.uint64)
    cols = (addr, np.array([1, 1, 2], np.int64), np.zeros(3, np.int32), np.array([True, False, True]),
            np.array([False, True, False]))
    assert R._pair_compiled(*cols) is None
    same(R._lifetimes(*cols), R._lifetimes_sorted(*cols))


def test_constant_columns_pair_as_the_sort_does():
    from tracekit.model import constant_column

    rng = np.random.default_rng(7)
    addr, _, _, is_alloc, is_free = columns(rng, 3000, list(range(0, 40 * 512, 512)))
    cols = (addr, constant_column(4096, 3000, np.int64), constant_column(3, 3000, np.int32), is_alloc, is_free)
    same(R._lifetimes(*cols), R._lifetimes_sorted(*cols))
    empty = (addr[:0], cols[1][:0], cols[2][:0], is_alloc[:0], is_free[:0])
    same(R._lifetimes(*empty), R._lifetimes_sorted(*empty))


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_real_files_pair_as_the_sort_does(path):
    from tracekit.io import load
    from tracekit.model import ALLOC, FREE_COMPLETED

    trace = load(path, use_cache=False)
    ev = trace.events
    for d in trace.devices:
        sl = ev.device_slice(d)
        action = ev.action[sl]
        cols = (ev.addr[sl], ev.size[sl], ev.stack_id[sl], action == ALLOC, action == FREE_COMPLETED)
        same(R._lifetimes(*cols), R._lifetimes_sorted(*cols))
