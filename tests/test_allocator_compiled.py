"""The compiled replay (_replay.c) against the Python model: the same constants, the same reasons in the same
order, the same action codes, and the same state when stopped at an entry (`segments_at`)."""
import pytest

from tracekit import model
from tracekit.analysis.allocator import compiled, config, model_replay

_replay = pytest.importorskip("tracekit.analysis.allocator._replay",
                              reason="the compiled replay is not built (no C compiler)")


def test_the_constants_are_the_python_ones():
    for name in ("MIN_BLOCK", "SMALL_SIZE", "SMALL_BUFFER", "LARGE_BUFFER", "MIN_LARGE_ALLOC", "ROUND_LARGE",
                 "POWER2_START_LOG2", "INTERVALS"):
        assert getattr(_replay, name) == getattr(config, name), name
    assert config.SMALL_SIZE == 1 << config.POWER2_START_LOG2


def test_the_reasons_are_the_python_ones_in_order():
    assert _replay.REASONS == model_replay.REASONS[:len(_replay.REASONS)]
    # the Python loop's further reasons are those of expandable segments, which it alone replays
    assert all("segment_map" in r or "segment_unmap" in r for r in model_replay.REASONS[len(_replay.REASONS):])


def test_the_action_codes_are_the_model_ones():
    for name in ("ALLOC", "FREE_REQUESTED", "FREE_COMPLETED", "SEGMENT_ALLOC", "SEGMENT_FREE", "SEGMENT_MAP",
                 "SEGMENT_UNMAP", "OOM"):
        assert getattr(_replay, "A_" + name) == getattr(model, name), name


def _files():
    from .conftest import FIXTURES, ROOT, SAMPLES

    return (sorted((ROOT / "tests/fixtures/cuda").glob("*.gz"))[:2] + sorted(SAMPLES.glob("*_cuda.pickle"))[:4]
            + sorted(FIXTURES.glob("snapshot_cpp_frames_*.pickle"))[:2])


@pytest.mark.parametrize("path", _files(), ids=lambda p: p.name)
def test_segments_at_an_entry_is_pythons(path, monkeypatch):
    """Stopped after an entry (the start, a quarter, the allocated peak, the last), the compiled loop's blocks are
    the Python model's, segment by segment and block by block."""
    import tracekit

    trace = tracekit.load(path, use_cache=False)
    device = trace.devices[0]
    r = compiled.replay_device(trace, device)
    assert r.engine == "compiled"
    n = len(r.allocated)
    for i in sorted({-1, 0, n // 4, r.peak_index, n - 1}):
        c = compiled.segments_at(trace, device, i)
        monkeypatch.setenv("TRACEKIT_ALLOCATOR", "python")
        py = compiled.segments_at(trace, device, i)
        monkeypatch.delenv("TRACEKIT_ALLOCATOR")
        assert c == py, (path.name, i)
        assert sum(s["total_size"] for s in py) == r.reserved_at(i)
        assert sum(b["size"] for s in py for b in s["blocks"] if b["state"] == "active_allocated") \
            == r.allocated_at(i)
