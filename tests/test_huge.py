"""Files larger than memory (issue 35): bench/make_huge.py writes tile_snapshot.py's content as PyTorch
pickles it; a window of such a file, read in bounded memory (the scanner's compact memo, its address
table emptied of freed addresses, the iterations found from runs of user_metadata), is exactly the
whole file read and cut."""
import io
import os
import pickle
import random
import struct
import subprocess
import sys

import numpy as np
import pytest

from tracekit.analysis.phases import marked_iterations, marked_phases
from tracekit.analysis.window import Window
from tracekit.io import load, stream
from tracekit.io.unpickle import restricted_load
from tracekit.model import NO_TIME

from .test_stream_window import assert_same, cut_both_ways

pytestmark = pytest.mark.skipif(not stream.enabled(), reason="the compiled scanner is not built here")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = os.path.join(ROOT, "tests", "fixtures", "real", "snapshot_newest_format_windows_paths.pickle")
TILE = os.path.join(ROOT, "..", "..", "shared", "bench", "tile_snapshot.py")


def make_huge(tmp_path, name, entries, *extra):
    out = tmp_path / name
    subprocess.run([sys.executable, os.path.join(ROOT, "bench", "make_huge.py"), SOURCE, str(out),
                    "--entries", str(entries), *extra], check=True, capture_output=True)
    return str(out)


@pytest.fixture(scope="module")
def marked(tmp_path_factory):
    return make_huge(tmp_path_factory.mktemp("huge"), "marked.pickle", 12000, "--marks")


def test_make_huge_writes_tile_snapshots_content_memoized_as_torch_does(tmp_path):
    ours = make_huge(tmp_path, "huge.pickle", 12000)
    with open(ours, "rb") as f:
        got = restricted_load(f)
    tiled = str(tmp_path / "tiled.pickle")
    if os.path.exists(TILE):
        subprocess.run([sys.executable, TILE, SOURCE, tiled, "--entries", "12000"], check=True, capture_output=True)
        with open(tiled, "rb") as f:
            assert got == restricted_load(f)
    trace = got["device_traces"][0]
    assert len(trace) >= 12000
    # frame dicts are the file's (one per distinct frame), a frames list is shared by an allocation and
    # its frees as in the source, every entry dict is its own
    assert len({id(fr) for e in trace for fr in e.get("frames", [])}) < 200
    assert len({id(e["frames"]) for e in trace}) < 0.8 * len(trace)
    assert len({id(e) for e in trace}) == len(trace)


def test_make_huge_marks_iterations_as_our_recorder(marked):
    from tracekit.analysis.phases import phases

    trace = load(marked, use_cache=False)
    ph = phases(trace)[trace.devices[0]]
    assert ph.source == "metadata"
    its = [i for i, _, _ in ph.iterations()]
    assert its[0] == 0 and its[-1] >= 2 and sorted(set(its)) == list(range(its[-1] + 1))


@pytest.mark.parametrize("rows", [None, "3", "1000"])
def test_windows_of_a_made_file_are_the_whole_file_cut(marked, rows, monkeypatch):
    """With the scanner's address table compacted every few rows too ($TRACEKIT_SCAN_COMPACT_ROWS)."""
    if rows:
        monkeypatch.setenv("TRACEKIT_SCAN_COMPACT_ROWS", rows)
    n = len(load(marked, use_cache=False).events)
    for window in (Window(first=n // 3, last=n // 2), Window(last_us=200_000), Window(iterations=(1, 1)),
                   Window(iterations=(0, 1), first=100), Window(iterations=(2, 9))):
        cut, streamed = cut_both_ways(marked, window)
        assert_same(cut, streamed)
        assert streamed.meta["reader"] == stream.COMPILED_WINDOW


def test_a_made_file_reusing_addresses_replays_and_reads_through_a_window(tmp_path, monkeypatch):
    from tracekit.analysis.replay import replay

    path = make_huge(tmp_path, "reuse.pickle", 8000, "--marks", "--reuse-addresses", "2")
    whole = load(path, use_cache=False)
    assert replay(whole)[whole.devices[0]].invariant.ok
    monkeypatch.setenv("TRACEKIT_SCAN_COMPACT_ROWS", "5")
    for window in (Window(iterations=(1, 2)), Window(first=3000, last=6000)):
        cut, streamed = cut_both_ways(path, window)
        assert_same(cut, streamed)


def test_iterations_of_a_file_without_marks_are_inferred_from_it_whole(tmp_path):
    plain = make_huge(tmp_path, "plain.pickle", 6000)
    cut, streamed = cut_both_ways(plain, Window(iterations=(0, 0)), streamed=False)
    assert_same(cut, streamed)
    from tracekit.analysis.window import read_note

    assert "not marked by tracekit's recorder" in read_note(streamed.meta["window"])  # and it says so
    marked_file = make_huge(tmp_path, "marked.pickle", 6000, "--marks")
    cut, streamed = cut_both_ways(marked_file, Window(iterations=(0, 0)))
    assert "were kept" in read_note(streamed.meta["window"]) and read_note(cut.meta["window"]) == ""


def _u(s):
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def _put(i):
    return b"r" + struct.pack("<I", i)


def _get(i):
    return b"j" + struct.pack("<I", i)


def test_the_compact_memo_gives_back_every_slot_and_late_changes(tmp_path):
    """Protocol 2 (BINPUT with indices): 300 strings memoized, then referred back to in a scrambled
    order, one old index overwritten by a BINPUT (the memo's table of changes), read back after it."""
    names = [f"s{i}" for i in range(300)]
    body = b"(" + _u("segments") + _put(1) + b"]" + _put(2) + _u("device_traces") + _put(3) + b"]" + _put(4)
    body += _u("x") + _put(5) + b"]" + _put(6) + b"(" + b"".join(_u(s) + _put(7 + i) for i, s in enumerate(names))
    body += b"e"
    order = list(range(7, 307))
    random.Random(3).shuffle(order)
    body += _u("y") + _put(307) + b"]" + _put(308) + b"(" + b"".join(_get(i) for i in order) + b"e"
    body += _u("z") + _put(309) + b"]" + _put(310) + _u("changed") + _put(20) + b"a"  # BINPUT over an old index
    body += b"(" + b"".join(_get(i) for i in (20, 21, 19, 306, 7)) + b"e"
    data = b"\x80\x02}" + _put(0) + body + b"u."
    expected = restricted_load(io.BytesIO(data))
    assert expected["z"][:2] == ["changed", "changed"]
    tape = stream.Tape(data)
    root = {tape.key(tape._k[e], 0): tape.value(tape._kind[e], tape._v[e], 1) for e in tape.edges(tape.root)}
    expected.pop("device_traces")  # the scanner takes the device traces apart (into columns)
    root.pop("device_traces", None)
    assert root == expected


def test_an_entry_referred_back_to_is_read_by_the_python_reader(tmp_path):
    """A trace entry is never referred back to in a snapshot; the compact memo keeps no entry's row, so
    such a file is read (to the same Trace) by the restricted unpickler."""
    e = {"action": "alloc", "addr": 1, "size": 8, "stream": 0, "time_us": 1}
    p = tmp_path / "s.pickle"
    p.write_bytes(pickle.dumps({"segments": [], "device_traces": [[e, e]]}, protocol=4))
    t = load(str(p), use_cache=False)
    assert t.meta["reader"] == stream.PYTHON and len(t.events) == 2


def _per_entry(starts, codes, n):
    return np.repeat(codes, np.diff(np.r_[starts, n]))


@pytest.mark.parametrize("seed", range(40))
def test_marked_iterations_equal_the_phases_of_every_entry(seed):
    rng = random.Random(seed)
    texts = ["", "tracekit:iter=0:phase=forward", "tracekit:iter=0:phase=backward", "tracekit:iter=1",
             "tracekit:iter=2:phase=optimizer", "other", "tracekit:iter=-1:phase=forward"]
    if rng.random() < 0.2:
        texts.append("tracekit:iter=x")  # starts as ours, is not
    n = rng.randint(1, 300)
    per = [rng.randrange(len(texts)) if rng.random() < 0.3 else 0 for _ in range(n)]
    for i in range(1, n):
        if rng.random() < 0.8:
            per[i] = per[i - 1]
    um = np.array(per, np.int32)
    t = np.sort(np.array([rng.randint(0, 1000) for _ in range(n)], np.int64))
    if rng.random() < 0.2:
        t[:] = NO_TIME
    elif rng.random() < 0.3:
        t[rng.randrange(n)] = NO_TIME
    table = None
    if rng.random() < 0.6:
        table = {"iterations": [{"iteration": k, "start_us": k * 300 + rng.randint(-50, 50),
                                 "end_us": (k + 1) * 300 + rng.randint(-50, 50)} for k in range(4)]}
        if rng.random() < 0.3:
            table["phases"] = [{"phase": "forward", "start_us": 0, "end_us": 100}]
    ph = marked_phases(um, texts, t, table)
    starts = np.flatnonzero(np.r_[True, um[1:] != um[:-1]])
    codes = um[starts]
    unmarked = np.array([not texts[c].startswith("tracekit:iter=") for c in per], bool)
    got = marked_iterations(starts, codes, texts, n, t[unmarked], bool((t != NO_TIME).any()), table)
    if ph is None:
        assert got is None
    elif got is not None:
        assert got == ph.iterations()
    else:  # only where this pass lacks times it would need
        assert table and "tracekit:iter=x" in {texts[c] for c in per}
