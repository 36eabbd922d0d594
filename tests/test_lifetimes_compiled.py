"""The one-pass pairing of allocs and frees (_replay.pair_lifetimes) against the sort by address it replaces
(replay._lifetimes_sorted): the same allocations, row for row, and the same last state per address; the blocks
allocated before the trace it appends; the one-pass running sum (_replay.running_sum) against numpy's; the
vectorised invariant check and the reserved curve against the loops they replace."""
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
    # the last state per address comes in no particular order: compared by address
    by, by0 = np.argsort(last[0], kind="stable"), np.argsort(last0[0], kind="stable")
    for a, b in zip(last, last0):
        assert a.dtype == b.dtype and np.array_equal(a[by], b[by0])


def with_blocks(cols, blocks):
    """The compiled pairing given the final blocks, against the sort and the blocks appended after it."""
    rows, *last = R._lifetimes_sorted(*cols)
    same(R._lifetimes(*cols, blocks), (R._before_trace(rows, last[0], *blocks), *last))


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


@pytest.mark.parametrize("seed", range(10))
def test_blocks_never_touched_are_appended_as_the_sort_does(seed):
    rng = np.random.default_rng(100 + seed)
    addresses = list(range(0, 30 * 512, 512))
    cols = columns(rng, 20 + 300 * seed, addresses[::2])
    b_addr = rng.choice(np.array(addresses + [2**64 - 1], np.uint64), seed * 3)  # duplicates and the empty key too
    blocks = (b_addr, rng.integers(1, 1 << 30, len(b_addr)).astype(np.int64),
              rng.integers(-1, 9, len(b_addr)).astype(np.int32))
    with_blocks(cols, blocks)
    from tracekit.model import constant_column

    with_blocks(cols, blocks[:2] + (constant_column(5, len(b_addr), np.int32),))
    empty = tuple(c[:0] for c in cols)
    with_blocks(empty, blocks)


def naive_running_sum(size, up, down, initial):
    out = np.where(up, size, 0).astype(np.int64)
    np.subtract(out, size, out=out, where=down)
    return initial + np.cumsum(out)


@pytest.mark.parametrize("seed", range(10))
def test_running_sum_is_numpys(seed, monkeypatch):
    from tracekit.model import constant_column

    rng = np.random.default_rng(seed)
    n = 1 + 1000 * seed
    kind = rng.integers(0, 3, n)
    size = rng.integers(-(1 << 62), 1 << 62, n).astype(np.int64)  # wide: the sums wrap as numpy's do
    for s in (size, constant_column(int(size[0]), n, np.int64)):
        want = naive_running_sum(s, kind == 0, kind == 1, seed * 12345)
        got = R._running_sum(s, kind == 0, kind == 1, seed * 12345)
        assert got.dtype == np.int64 and np.array_equal(got, want)
        monkeypatch.setattr(R, "_running_sum_compiled", None)
        assert np.array_equal(R._running_sum(s, kind == 0, kind == 1, seed * 12345), want)
        monkeypatch.undo()
    assert len(R._running_sum(size[:0], kind[:0] == 0, kind[:0] == 1, 7)) == 0


def naive_check(last_addr, last_is_alloc, last_size, b_addr, b_size, b_requested):
    """The check as a loop over the addresses in order, with a dict of the final blocks (the last of a repeated
    address counts)."""
    final = dict(zip(b_addr.tolist(), zip(b_size.tolist(), b_requested.tolist())))
    problems = []
    order = np.argsort(last_addr, kind="stable")
    for addr, alive, size in zip(last_addr[order].tolist(), last_is_alloc[order].tolist(), last_size[order].tolist()):
        got = final.get(addr)
        if alive and got is None:
            problems.append((addr, size, "allocated in the trace and never freed, but not live in the final segments"))
        elif alive and got is not None and size not in got:
            problems.append((addr, size, f"live at the end with size {size}, but the final block has size {got[0]}"))
        elif not alive and got is not None:
            problems.append((addr, got[0], "freed in the trace and never reallocated, but live in the final segments"))
        if len(problems) >= 20:
            break
    return R.Invariant(checked=True, ok=not problems, problems=problems)


@pytest.mark.parametrize("seed", range(30))
def test_invariant_check_is_the_loops(seed):
    rng = np.random.default_rng(seed)
    u = int(rng.integers(0, min(60 * seed, 99) + 2))
    last_addr = rng.permutation(np.arange(0, 100 * 512, 512, dtype=np.uint64))[:u]
    alive = rng.random(u) < 0.5
    sizes = np.array([512, 1024, 4096], np.int64)
    last_size = rng.choice(sizes, u)
    nb = rng.integers(0, 40 * seed + 1)
    b_addr = rng.choice(np.arange(0, 120 * 512, 512, dtype=np.uint64), nb)  # repeats: the last one counts
    b_size, b_req = rng.choice(sizes, nb), rng.choice(sizes, nb)
    args = (last_addr, alive, last_size, b_addr, b_size, b_req)
    assert R._check(*args) == naive_check(*args)


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.name)
def test_real_files_check_and_reserved_as_the_loops_do(path):
    from tracekit.io import load
    from tracekit.model import SEGMENT_ALLOC, SEGMENT_FREE, SEGMENT_MAP, SEGMENT_UNMAP

    trace = load(path, use_cache=False)
    reps = R.replay(trace)
    ev = trace.events
    for d in trace.devices:
        rep = reps[d]
        sl = ev.device_slice(d)
        action, size = ev.action[sl], ev.size[sl]
        grow = np.isin(action, (SEGMENT_ALLOC, SEGMENT_MAP))
        shrink = np.isin(action, (SEGMENT_FREE, SEGMENT_UNMAP))
        if rep.reserved is not None:
            want = naive_running_sum(size, grow, shrink, rep.initial_reserved)
            assert np.array_equal(rep.reserved, want)
            assert (rep.reserved.strides == (0,)) == (len(want) > 1 and bool((want == want[0]).all()))
        rows, la, al, ls = R._lifetimes_sorted(ev.addr[sl], size, ev.stack_id[sl], action == R.ALLOC,
                                               action == R.FREE_COMPLETED)
        b = (trace.blocks.device == d) & np.isin(trace.blocks.state, R.LIVE_STATES)
        args = (la, al, ls, trace.blocks.addr[b], trace.blocks.size[b], trace.blocks.requested_size[b])
        if trace.meta.get("has_segments", True):
            assert R._check(*args) == naive_check(*args) == rep.invariant


@pytest.mark.parametrize("path", FILES[:4] + FILES[-2:], ids=lambda p: p.name)
def test_replay_without_the_extension_is_the_same(path, monkeypatch):
    """The numpy fallbacks (the sort by address, the blocks appended after it, numpy's running sum) replay a
    file as the compiled passes do."""
    from tracekit.io import load

    def replayed():
        return R.replay_device(load(path, use_cache=False), 0)

    got = replayed()
    monkeypatch.setattr(R, "_pair_compiled", None)
    monkeypatch.setattr(R, "_running_sum_compiled", None)
    want = replayed()
    for k in R.Allocations.__dataclass_fields__:
        a, b = getattr(got.allocations, k), getattr(want.allocations, k)
        assert a.dtype == b.dtype and np.array_equal(a, b), k
    assert np.array_equal(got.allocated, want.allocated) and got.allocated.dtype == want.allocated.dtype
    assert (got.reserved is None) == (want.reserved is None)
    if got.reserved is not None:
        assert np.array_equal(got.reserved, want.reserved)
    assert got.invariant == want.invariant
    assert (got.initial_allocated, got.initial_reserved, got.unattributed_bytes) == \
        (want.initial_allocated, want.initial_reserved, want.unattributed_bytes)
