"""Events.index, each entry's position in its device's trace: int32 from every reader and from the cache,
and 0..n-1 per device (a window renumbers from its first entry)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tracekit.io import load
from tracekit.model import MAX_DEVICE_ENTRIES, index_column

REAL = Path(__file__).parent / "fixtures" / "real"
FILES = ["snapshot_newest_format_windows_paths.pickle", "snapshot_legacy_torch20_oom_observer.pickle",
         "kineto_trace_memory_v100_rank1.json.gz", "profiler_memory_timeline_raw.json.gz"]


def positions_ok(trace):
    ev = trace.events
    assert ev.index.dtype == np.int32
    for d in trace.devices:
        sl = ev.device_slice(d)
        assert np.array_equal(ev.index[sl], np.arange(sl.stop - sl.start))


@pytest.mark.parametrize("name", FILES)
@pytest.mark.parametrize("reader", ["auto", "python"])
def test_positions_are_int32_from_each_reader_and_the_cache(name, reader, tmp_path, monkeypatch):
    monkeypatch.setenv("TRACEKIT_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("TRACEKIT_READER", reader)
    cold = load(REAL / name)
    positions_ok(cold)
    from tracekit.io.cache.folder import wait_written

    wait_written()
    warm = load(REAL / name)  # from the cache
    positions_ok(warm)
    assert np.array_equal(warm.events.index, cold.events.index)


def test_a_device_past_int32_positions_is_refused():
    with pytest.raises(Exception, match="more than tracekit reads"):
        index_column(MAX_DEVICE_ENTRIES + 1)
    assert index_column(3).tolist() == [0, 1, 2]
