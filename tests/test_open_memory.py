"""Opening a big file holds little (issue 35): columns of one value take no memory, the allocator state at
the peak reads only the entries up to it, membership tests on addresses are sorted, not hashed; every
figure stays what it was."""
import os

import numpy as np
import pytest

from tracekit.analysis.allocator import fast
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
    assert np.array_equal(isin_ints(small, big), np.isin(small, big))
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
