"""Windows of a trace (--from/--to, --last, --iterations): the window's numbers are the whole trace's."""
import dataclasses
import json

import numpy as np
import pytest
from click.testing import CliRunner

from tracekit.analysis.phases import phases
from tracekit.analysis.replay import replay
from tracekit.analysis.window import Window, parse_duration, parse_iterations, ranges, select
from tracekit.cli import cli
from tracekit.errors import TracekitError
from tracekit.io import load
from tracekit.model import NO_TIME

SAMPLE = "samples/gpt_adamw.pickle"  # our recorder: three iterations, times
REAL = "tests/fixtures/real/snapshot_cpp_frames_adamw_full_step.pickle"  # PyTorch's, with final segments
KINETO = "tests/fixtures/real/kineto_trace_memory_v100_rank1.json.gz"  # two devices, no segments


@pytest.fixture(scope="module")
def traces():
    return {p: load(p, use_cache=False) for p in (SAMPLE, REAL, KINETO)}


def test_parse():
    assert parse_duration("10s") == 10_000_000
    assert parse_duration("250ms") == 250_000
    assert parse_duration("2min") == 120_000_000
    assert parse_duration("1.5") == 1_500_000
    assert parse_duration("7us") == 7
    assert parse_iterations("3..5") == (3, 5)
    assert parse_iterations(" 4 ") == (4, 4)
    for bad in ("", "10x", "-1s", "0s", "s"):
        with pytest.raises(ValueError):
            parse_duration(bad)
    for bad in ("5..3", "a..b", "-1", "1..2..3"):
        with pytest.raises(ValueError):
            parse_iterations(bad)


@pytest.mark.parametrize("path", [SAMPLE, REAL, KINETO])
@pytest.mark.parametrize("part", [(1, 3), (1, 2), (0, 1), (3, 4)])  # in quarters: middle, to the end...
def test_entry_window_replays_like_the_whole(traces, path, part):
    t = traces[path]
    full = replay(t)
    n = {d: len(full[d].allocated) for d in t.devices}
    lo_q, hi_q = part
    spans = {d: (n[d] * lo_q // 4, n[d] * hi_q // 4 - 1) for d in t.devices}
    d0 = t.devices[0]
    w = select(t, Window(first=spans[d0][0], last=spans[d0][1]))
    got = replay(w)
    for d in w.devices:
        lo, hi = spans[d0][0], min(spans[d0][1], n[d] - 1)
        assert np.array_equal(got[d].allocated, full[d].allocated[lo:hi + 1])
        if full[d].reserved is not None:
            assert np.array_equal(got[d].reserved, full[d].reserved[lo:hi + 1])
        sl = w.events.device_slice(d)
        assert np.array_equal(w.events.index[sl], np.arange(hi - lo + 1))
        src = t.events.device_slice(d)
        assert np.array_equal(w.events.addr[sl], t.events.addr[src][lo:hi + 1])
    ends_early = any(spans[d0][1] < n[d] - 1 for d in t.devices)
    assert (len(w.segments) == 0) == (ends_early or len(t.segments) == 0)


def test_last_span_is_the_entries_at_or_after_the_cutoff(traces):
    t = traces[SAMPLE]
    times = t.events.time_us
    span = (int(times.max()) - int(times[times != NO_TIME].min())) // 3
    w = select(t, Window(last_us=span))
    cutoff = int(times.max()) - span
    expect = int(np.argmax(times >= cutoff))  # one device: the first entry at or after the cutoff
    assert len(w.events) == len(t.events) - expect
    assert np.array_equal(w.events.time_us, times[expect:])
    assert times[expect - 1] < cutoff


def test_iterations_window_holds_exactly_those_iterations(traces):
    t = traces[SAMPLE]
    it = phases(t)[0].iteration
    assert set(it.tolist()) >= {0, 1, 2}
    w = select(t, Window(iterations=(1, 2)))
    assert len(w.events) == int(np.isin(it, (1, 2)).sum())
    assert np.array_equal(phases(w)[0].iteration, it[np.isin(it, (1, 2))])
    assert w.meta["window"]["description"] == "iterations 1..2"


def test_combined_windows_intersect(traces):
    t = traces[SAMPLE]
    it_lo = ranges(t, Window(iterations=(1, 1)))[0]
    both = ranges(t, Window(iterations=(1, 1), first=it_lo[0] + 10, last=it_lo[1] - 11))[0]
    assert both == (it_lo[0] + 10, it_lo[1] - 10)


def test_whole_and_empty_windows(traces):
    t = traces[REAL]
    assert select(t, Window(first=0)) is t
    assert select(t, Window()) is t
    with pytest.raises(TracekitError, match="no entries are inside the window"):
        select(t, Window(first=10**9))
    with pytest.raises(TracekitError, match="no timestamps"):
        select(dataclasses.replace(traces[KINETO], events=_no_times(traces[KINETO])), Window(last_us=1))
    with pytest.raises(TracekitError, match="no iterations are known"):
        select(traces[KINETO], Window(iterations=(0, 1)))


def _no_times(t):
    return dataclasses.replace(t.events, time_us=np.full(len(t.events.time_us), NO_TIME, np.int64))


def test_cli_report_and_info_with_a_window(tmp_path, monkeypatch):
    monkeypatch.setenv("TRACEKIT_CACHE_DIR", str(tmp_path))
    r = CliRunner().invoke(cli, ["report", SAMPLE, "--json", "--iterations", "2"])
    assert r.exit_code == 0, r.output
    dev = json.loads(r.output)["devices"][0]
    t = load(SAMPLE, use_cache=False)
    full = replay(t)[0]
    it = phases(t)[0].iteration
    inside = np.flatnonzero(it == 2)
    assert dev["entries"] == len(inside)
    assert dev["peak_allocated_bytes"] == int(full.allocated[inside].max())
    assert dev["peak_event_index"] == int(np.argmax(full.allocated[inside]))  # renumbered from the window
    assert dev["peak_iteration"] == 2
    assert json.loads(r.output)["window"]["devices"]["0"] == [int(inside[0]), int(inside[-1]) + 1, len(it)]
    r = CliRunner().invoke(cli, ["report", SAMPLE, "--iterations", "2"])
    assert r.output.startswith(f"window: iteration 2; entries are renumbered from 0, entry 0 here is entry "
                               f"{int(inside[0])} of the file (cpu)\n")
    r = CliRunner().invoke(cli, ["info", SAMPLE, "--from", "100", "--to", "199"])
    assert r.exit_code == 0, r.output
    assert "window          entries 100..199" in r.output and "entries           100 " in r.output
    for bad in (["--last", "ten"], ["--iterations", "3..1"], ["--from", "5", "--to", "4"], ["--from", "-1"]):
        r = CliRunner().invoke(cli, ["info", SAMPLE, *bad])
        assert r.exit_code == 2 and isinstance(r.exception, SystemExit), (bad, r.output)


def test_viewer_document_opens_the_window(tmp_path, monkeypatch):
    document = pytest.importorskip("tracekit_gui.document")
    monkeypatch.setenv("TRACEKIT_CACHE_DIR", str(tmp_path))
    doc = document.Document.open(SAMPLE, window=Window(iterations=(2, 2)))
    it = phases(load(SAMPLE, use_cache=False))[0].iteration
    assert len(doc.trace.events) == int((it == 2).sum())
    assert doc.device_report(0)["peak_iteration"] == 2
