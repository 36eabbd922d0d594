"""A window picked while streaming (only its entries kept, the rest folded into per-device sums) gives
the same Trace, report and refusals as reading the whole file and cutting it afterwards."""
import glob
import json
import os
import pickle
import random

import numpy as np
import pytest

from tracekit.analysis.phases import phases
from tracekit.analysis.report import build_report
from tracekit.analysis.window import Window, select
from tracekit.errors import LoadError, TracekitError
from tracekit.io import load, stream
from tracekit.model import NO_TIME

from .test_stream import assert_same as assert_same_decoded

pytestmark = pytest.mark.skipif(not stream.enabled(), reason="the compiled scanner is not built here")

PICKLES = sorted(glob.glob("samples/*.pickle") + glob.glob("tests/fixtures/real/*.pickle"))


def fields(t):
    """Everything a Trace says, column by column (the window's Trace interns the stacks and strings of
    every entry, kept or not, so even their numbering is the whole read's)."""
    out = {"strings": list(t.strings.items), "devices": t.devices, "format": t.format, "path": t.path,
           "meta": t.meta}
    for part in ("events", "segments", "blocks", "frames", "stacks"):
        table = getattr(t, part)
        out.update({f"{part}.{k}": getattr(table, k) for k in table.__dataclass_fields__})
    return out


def assert_same(a, b):
    da, db = fields(a), fields(b)
    # how the file was read (the reader, and a window's "read": only its entries) is all that may differ
    da["meta"], db["meta"] = ({k: ({**v, "read": None} if k == "window" else v) for k, v in m.items() if k != "reader"}
                              for m in (da["meta"], db["meta"]))
    assert da.keys() == db.keys()
    for k in da:
        x, y = da[k], db[k]
        if isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y), k
        else:
            assert x == y, k


def windows(trace):
    """Windows over the trace: entry ranges, the last part of its time span, both at once."""
    n = max(len(trace.events.action[trace.events.device_slice(d)]) for d in trace.devices)
    out = [Window(first=n // 4, last=n // 2), Window(first=n // 3), Window(last=n // 5), Window(first=1, last=1)]
    t = trace.events.time_us[trace.events.time_us != NO_TIME]
    if len(t) and t.max() > t.min():
        span = int(t.max() - t.min())
        out += [Window(last_us=max(1, span // 3)), Window(first=n // 2, last_us=max(1, span // 2))]
    its = sorted({i for d in trace.devices for i, _, _ in phases(trace)[d].iterations()})
    if its:
        out += [Window(iterations=(its[len(its) // 2], its[-1])), Window(first=n // 3, iterations=(its[0], its[0]))]
    return out


def marked(trace):
    """Whether our recorder marked the iterations of every device with entries (else they are inferred)."""
    return all(phases(trace)[d].source in ("metadata", "recorder") for d in trace.devices
               if len(trace.events.action[trace.events.device_slice(d)]))


def cut_both_ways(path, window, streamed=True):
    """(whole file read then cut, streamed window then finished): a Trace or the error's line each.
    `streamed`: whether the window is to be picked while streaming (else the file is read whole)."""
    out = []
    for w in (None, window):
        try:
            trace = load(path, use_cache=False, window=w)
            if w is not None:
                assert ("streamed_window" in trace.meta) == streamed, window
            out.append(select(trace, window))
        except (LoadError, TracekitError) as e:
            out.append(str(e))
    return out


@pytest.mark.parametrize("path", PICKLES, ids=os.path.basename)
def test_a_streamed_window_is_the_window_cut_from_the_whole_trace(path):
    whole = load(path, use_cache=False)
    for window in windows(whole):
        cut, streamed = cut_both_ways(path, window, window.iterations is None or marked(whole))
        assert type(cut) is type(streamed), window
        if isinstance(cut, str):
            assert cut == streamed
            continue
        assert_same(cut, streamed)
        assert json.dumps(build_report(cut), sort_keys=True, default=str) == \
            json.dumps(build_report(streamed), sort_keys=True, default=str), window


@pytest.mark.parametrize("path", PICKLES[:4] + ["tests/fixtures/real/snapshot_cpp_frames_attention_fwd_bwd.pickle"],
                         ids=os.path.basename)
def test_a_streamed_window_of_a_json_snapshot_is_the_same(path, tmp_path):
    from tracekit.io.unpickle import restricted_load

    with open(path, "rb") as f:
        (tmp_path / "s.json").write_text(json.dumps(restricted_load(f)))
    p = str(tmp_path / "s.json")
    whole = load(p, use_cache=False)
    for window in windows(whole)[:3] + windows(whole)[-1:]:
        cut, streamed = cut_both_ways(p, window, window.iterations is None or marked(whole))
        assert_same(cut, streamed)


def entry(action, addr, size, t, **more):
    return {"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t,
            "frames": [{"filename": "train.py", "line": addr % 7, "name": "step"}], **more}


def block(addr, size, state="active_allocated"):
    return {"address": addr, "size": size, "requested_size": size, "state": state, "frames": []}


def snapshot():
    """Two devices, one of them starting late; memory allocated before the trace (freed in it, or live
    at the end and never touched); segment growth; an unknown action; an oom with device_free."""
    d0 = [entry("segment_alloc", 0, 1 << 20, 10),
          entry("free_completed", 900, 300, 11),  # allocated before the trace
          entry("alloc", 100, 50, 12), entry("alloc", 200, 70, 13), entry("free_requested", 100, 50, 14),
          entry("free_completed", 100, 50, 15), entry("future_action", 0, 0, 16),
          entry("oom", 0, 4096, 17, device_free=123), entry("alloc", 100, 40, 18),
          entry("free_completed", 950, 20, 19),  # allocated before the trace, freed late
          entry("alloc", 300, 10, 20), entry("free_completed", 200, 70, 21)]
    d1 = [entry("segment_alloc", 0, 2 << 20, 100 + i) if i == 0 else entry("alloc", 1000 + i, i, 100 + i)
          for i in range(6)]
    segs = [{"device": 0, "address": 0, "total_size": 2 << 20, "stream": 0, "segment_type": "large",
             "blocks": [block(100, 512), block(300, 512), block(5000, 1000), block(6000, 64, "inactive")]},
            {"device": 1, "address": 0, "total_size": 2 << 20, "stream": 0, "segment_type": "large",
             "blocks": [block(1000 + i, 512) for i in range(1, 6)]},
            {"device": 3, "address": 0, "total_size": 1 << 20, "stream": 0, "segment_type": "small",
             "blocks": [block(77, 512)]}]
    return {"segments": segs, "device_traces": [d0, d1]}


@pytest.mark.parametrize("window", [Window(first=3, last=7), Window(first=2), Window(last=4), Window(first=5),
                                    Window(last_us=4), Window(first=3, last_us=90), Window(first=9),
                                    Window(first=50), Window(last_us=1000)], ids=lambda w: w.describe())
def test_the_state_before_the_window_on_several_devices(window, tmp_path):
    p = tmp_path / "s.pickle"
    p.write_bytes(pickle.dumps(snapshot(), protocol=4))
    cut, streamed = cut_both_ways(str(p), window)
    if isinstance(cut, str):
        assert cut == streamed and "no entries are inside the window" in cut
        return
    assert_same(cut, streamed)


def test_the_live_bytes_before_the_window_by_hand(tmp_path):
    p = tmp_path / "s.pickle"
    p.write_bytes(pickle.dumps(snapshot(), protocol=4))
    w = Window(first=6, last=9)
    streamed = select(load(str(p), use_cache=False, window=w), w)
    # device 0 before entry 6: 1000 live at the end and never touched, 300 + 20 freed but never
    # allocated, then +50 +70 -300 -50 by entries 1..5
    assert streamed.meta["initial_allocated"] == {0: 1000 + 320 + 50 + 70 - 300 - 50, 1: 15, 3: 512}
    assert streamed.meta["initial_reserved"] == {0: 2 << 20, 1: 2 << 20, 3: 1 << 20}
    assert streamed.meta["window"]["devices"] == {0: [6, 10, 12], 1: [6, 6, 6], 3: [0, 0, 0]}
    assert streamed.meta["unknown_actions"] == ["future_action"]
    assert len(streamed.segments) == 0 and streamed.devices == [0]
    assert streamed.events.device_free.tolist() == [0, 123, 0, 0]


def test_bad_entries_outside_the_window_are_refused_as_when_reading_it_all(tmp_path):
    snap = snapshot()
    snap["device_traces"][0][1]["size"] = -5
    p = tmp_path / "s.pickle"
    p.write_bytes(pickle.dumps(snap, protocol=4))
    with pytest.raises(LoadError) as whole:
        load(str(p), use_cache=False)
    with pytest.raises(LoadError) as windowed:
        load(str(p), use_cache=False, window=Window(first=6))
    assert str(whole.value) == str(windowed.value)


def test_a_small_file_is_read_whole_and_cached_a_big_one_only_its_window(tmp_path, monkeypatch):
    import tracekit.io.reading

    monkeypatch.setenv("TRACEKIT_CACHE_DIR", str(tmp_path / "cache"))
    p = tmp_path / "s.pickle"
    p.write_bytes(pickle.dumps(snapshot(), protocol=4))
    w = Window(first=6, last=9)
    assert "streamed_window" not in load(str(p), window=w).meta  # small: read whole and cached
    assert "streamed_window" in load(str(p), window=w, use_cache=False).meta
    for f in (tmp_path / "cache").iterdir():
        f.unlink()
    monkeypatch.setattr(tracekit.io.reading, "WINDOW_READ_BYTES", p.stat().st_size)
    assert "streamed_window" in load(str(p), window=w).meta
    whole = load(str(p))
    assert "streamed_window" not in whole.meta and len(whole.events) == 18
    assert "streamed_window" not in load(str(p), window=w).meta  # from the cache: the whole trace


def test_the_survey_of_a_big_file_never_opened_comes_from_the_scanner(tmp_path, monkeypatch):
    """Entries, time span and iterations per device, checked against the pickle read in Python."""
    import re
    import shutil

    from tracekit.analysis import survey as survey_mod
    from tracekit.io.unpickle import restricted_load

    monkeypatch.setenv("TRACEKIT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(survey_mod, "SCAN_BYTES", 0)
    for src in ("samples/leak_loop.pickle", "tests/fixtures/real/snapshot_legacy_torch20_oom_observer.pickle"):
        p = tmp_path / os.path.basename(src)
        shutil.copy(src, p)
        with open(p, "rb") as f:
            snap = restricted_load(f)
        truth = []
        for entries in (snap.get("device_traces") if isinstance(snap, dict) else None) or []:
            times = [e["time_us"] for e in entries if "time_us" in e]
            its = {int(m.group(1)) for e in entries if (m := re.fullmatch(r"tracekit:iter=(\d+).*",
                                                                          e.get("user_metadata", "")))}
            if entries:
                truth.append((len(entries), min(times) if times else None, max(times) if times else None,
                              (min(its), max(its)) if its else None))
        got = survey_mod.survey(p)
        assert got.exact and got.scanned
        assert [(d.entries, d.first_us, d.last_us, d.iterations) for d in got.devices] == truth
        assert not list((tmp_path / "cache").glob("*"))  # a survey caches nothing


def both_ways(path, window, monkeypatch, reader="auto"):
    """(the whole read by `reader`, then cut; the streamed window, then finished): a Trace or the
    error's line each."""
    out = []
    for reader, w in ((reader, None), ("auto", window)):
        monkeypatch.setenv("TRACEKIT_READER", reader)
        try:
            out.append(select(load(path, use_cache=False, window=w), window))
        except (LoadError, TracekitError) as e:
            out.append(str(e))
    return out


def test_mutated_files_fail_or_read_the_same_through_a_window(tmp_path, monkeypatch):
    data = open("tests/fixtures/real/snapshot_cpp_frames_attention_fwd_bwd.pickle", "rb").read()
    rng = random.Random(16)
    p = tmp_path / "m.pickle"
    accepted = 0
    for i in range(150):
        b = bytearray(data)
        if i % 3 == 0:
            b = b[:rng.randrange(1, len(b))]
        else:
            for _ in range(rng.randrange(1, 4)):
                b[rng.randrange(len(b))] = rng.randrange(256)
        p.write_bytes(bytes(b))
        window = (Window(first=20, last=60), Window(last_us=200_000), Window(first=90))[i % 3]
        old, new = both_ways(p, window, monkeypatch, reader="python")
        if isinstance(old, str):
            assert new == old, i
        else:  # the two readers number strings differently (test_stream.py): compared by what they name
            accepted += 1
            assert_same_decoded(old, new)
    assert accepted > 10  # some mutations leave a readable file: those were compared field by field


def test_shared_frames_and_lists_across_the_window_edge_and_two_devices(tmp_path, monkeypatch):
    """Frame dicts and frames lists first met in dropped entries and used again in kept ones (the
    pickle refers back to them), shared with the blocks, on two devices of different lengths."""
    rng = random.Random(8)
    frames = [{"filename": f"f{i % 37}.py", "line": i, "name": f"fn{i % 11}"} for i in range(3000)]
    lists = [[frames[rng.randrange(3000)] for _ in range(rng.randrange(1, 9))] for _ in range(2500)]
    blocks = [{"address": 4096 * i, "size": 512, "requested_size": 512, "state": "active_allocated",
               "frames": lists[i]} for i in range(50)]
    seg = {"device": 0, "address": 0, "total_size": 4096 * 50, "stream": 0, "segment_type": "large",
           "blocks": blocks}
    actions = ("alloc", "free_completed", "segment_alloc", "free_requested")
    entries = [[{"action": actions[i % 4 if i % 7 else 0], "addr": 10**6 + (i // 2) * 64, "size": 8 + i % 5,
                 "frames": lists[rng.randrange(2500)] if i % 3 else [dict(f) for f in lists[i % 2500]],
                 "time_us": i, "user_metadata": f"tracekit:iter={i // 700}"}
                for i in range(d * 1000, 6000)] for d in range(2)]
    p = tmp_path / "many.pickle"
    p.write_bytes(pickle.dumps({"segments": [seg], "device_traces": entries}, protocol=4))
    for window in (Window(first=1500, last=3000), Window(last_us=2500), Window(first=4900), Window(last=10)):
        old, new = both_ways(p, window, monkeypatch)
        assert_same(old, new)


def test_entries_before_segments_through_a_window(tmp_path, monkeypatch):
    fr = [{"filename": "a.py", "line": 1, "name": "f"}]
    obj = {"device_traces": [[{"action": "alloc", "addr": 4096 * i, "size": 512, "frames": fr} for i in range(4)]],
           "segments": [{"device": 0, "address": 4096, "total_size": 512, "blocks": [
               {"address": 4096, "size": 512, "state": "active_allocated", "frames": fr}]}]}
    p = tmp_path / "order.pickle"
    p.write_bytes(pickle.dumps(obj, protocol=4))
    for window in (Window(first=2), Window(last=1), Window(first=1, last=2)):
        old, new = both_ways(p, window, monkeypatch)
        assert_same(old, new)


def test_iterations_from_the_recorders_table_and_unmarked_entries(tmp_path):
    """Iterations from user_metadata where entries carry it, from the recorder's time table where they
    do not (autograd's threads), as phases() finds them on the whole trace."""
    entries = []
    for i in range(60):
        e = entry("alloc" if i % 2 == 0 else "free_completed", 100 + (i // 2) * 8, 16, 1000 + i * 10)
        if i % 3:
            e["user_metadata"] = f"tracekit:iter={i // 20}:phase=forward"
        entries.append(e)
    table = {"iterations": [{"iteration": k, "start_us": 1000 + k * 200, "end_us": 1200 + k * 200}
                            for k in range(3)]}
    p = tmp_path / "s.pickle"
    for snap in ({"segments": [], "device_traces": [entries], "tracekit": table},
                 {"segments": [], "device_traces": [[{k: v for k, v in e.items() if k != "user_metadata"}
                                                     for e in entries]], "tracekit": table}):
        p.write_bytes(pickle.dumps(snap, protocol=4))
        for window in (Window(iterations=(1, 1)), Window(iterations=(1, 2)), Window(iterations=(0, 0), last=9)):
            cut, streamed = cut_both_ways(str(p), window)
            assert_same(cut, streamed)
            assert 0 < len(streamed.events) < 60
    p.write_bytes(pickle.dumps({"segments": [], "device_traces": [entries[:5]]}, protocol=4))
    assert "streamed_window" in load(str(p), use_cache=False, window=Window(iterations=(0, 0))).meta


def test_iterations_not_marked_by_our_recorder_read_the_file_whole(tmp_path):
    p = tmp_path / "s.pickle"
    p.write_bytes(pickle.dumps(snapshot(), protocol=4))
    cut, streamed = cut_both_ways(str(p), Window(iterations=(0, 1)), streamed=False)
    assert cut == streamed and "no iterations are known" in cut


def test_a_gzip_compressed_file_through_a_window(tmp_path):
    import gzip

    p = tmp_path / "s.pickle.gz"
    p.write_bytes(gzip.compress(pickle.dumps(snapshot(), protocol=4)))
    for window in (Window(first=3, last=7), Window(last_us=5)):
        cut, streamed = cut_both_ways(str(p), window)
        assert_same(cut, streamed)
        assert streamed.meta["reader"] == stream.COMPILED_WINDOW


@pytest.mark.parametrize("window", [Window(first=5, last=30), Window(first=45), Window(last=5), Window(first=598),
                                    Window(last_us=30), Window(first=1, last=1)], ids=lambda w: w.describe())
def test_columns_of_one_value_for_a_while_through_a_window(window, tmp_path, monkeypatch):
    """The kept rows of a column that holds one value for a while (stream, user_metadata set late), and
    action codes of more than 255 distinct actions, as the whole read's (see test_stream)."""
    from .test_stream import _columns_snapshot

    monkeypatch.setattr(stream, "_CHUNK", 4)
    p = tmp_path / "c.pickle"
    p.write_bytes(pickle.dumps(_columns_snapshot(), protocol=4))
    cut, streamed = cut_both_ways(str(p), window)
    assert type(cut) is type(streamed)
    if isinstance(cut, str):
        assert cut == streamed
        return
    assert_same(cut, streamed)
