"""model.unique_ids gives np.unique's results (values, first indices, inverse) on ids of every shape."""
import numpy as np
import pytest

from tracekit.model import unique_ids


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64, np.uint32, np.uint64])
@pytest.mark.parametrize("spread", [1, 7, 1000, 10**9])
def test_same_as_numpy(dtype, spread):
    rng = np.random.default_rng(spread)
    lo = -5 if np.dtype(dtype).kind == "i" else 0
    hi = min(spread, np.iinfo(dtype).max)
    v = rng.integers(lo, hi, 5000).astype(dtype)
    for ri in (False, True):
        for rv in (False, True):
            want = np.unique(v, return_index=ri, return_inverse=rv)
            got = unique_ids(v, return_index=ri, return_inverse=rv)
            want, got = (want,) if not isinstance(want, tuple) else want, (got,) if not isinstance(got, tuple) else got
            for w, g in zip(want, got):
                assert np.array_equal(w.reshape(-1), g.reshape(-1))
            assert got[0].dtype == v.dtype


def test_empty_and_floats():
    assert len(unique_ids(np.zeros(0, np.int64))) == 0
    u, i = unique_ids(np.array([2.5, 1.0, 2.5]), return_inverse=True)
    assert u.tolist() == [1.0, 2.5] and i.tolist() == [1, 0, 1]


def test_high_unsigned_addresses():
    v = (np.uint64(2**63 + 12345) + np.array([5, 0, 5, 9, 0], np.uint64))
    u, i, inv = unique_ids(v, return_index=True, return_inverse=True)
    w, wi, winv = np.unique(v, return_index=True, return_inverse=True)
    assert np.array_equal(u, w) and np.array_equal(i, wi) and np.array_equal(inv, winv)


def test_module_rows_packed_as_numpy_sorts_rows():
    """modtree's packed row unique (stack, layer instances) equals np.unique(axis=0)."""
    from tracekit.analysis.modtree import _unique_rows

    rng = np.random.default_rng(1)
    for _ in range(200):
        key = rng.integers(-1, rng.integers(1, 50), (rng.integers(1, 400), rng.integers(1, 5)))
        u, inv = _unique_rows(key)
        want, want_inv = np.unique(key, axis=0, return_inverse=True)
        assert np.array_equal(u, want) and np.array_equal(inv, want_inv.reshape(-1))
    wide = np.array([[2**40, 1], [3, 2**30], [3, 2**30]])  # too wide to pack: numpy's row sort
    u, inv = _unique_rows(wide)
    assert u.tolist() == [[3, 2**30], [2**40, 1]] and inv.tolist() == [1, 0, 0]


@pytest.mark.parametrize("dtype", [np.int8, np.int32, np.int64, np.uint32, np.uint64])
@pytest.mark.parametrize("shape", [(0, 3), (1, 1), (4000, 1), (4000, 3), (4000, 5)])
@pytest.mark.parametrize("spread", [2, 1000, 2**40])
def test_unique_rows_is_numpys_unique_of_rows(dtype, shape, spread):
    """model.unique_rows (the library lines' groups, issue 35): np.unique(axis=0, return_inverse=True)'s rows,
    in their dtype and order, and its inverse, flat."""
    from tracekit.model import unique_rows

    rng = np.random.default_rng(spread + shape[0])
    lo = -3 if np.dtype(dtype).kind == "i" else 0
    hi = min(spread, np.iinfo(dtype).max)
    key = rng.integers(lo, hi, shape).astype(dtype)
    want_rows, want_inv = np.unique(key, axis=0, return_inverse=True)
    rows, inv = unique_rows(key)
    assert rows.dtype == want_rows.dtype and np.array_equal(rows, want_rows)
    assert np.array_equal(inv, want_inv.reshape(-1))
