"""The columnar cache never serves stale or wrong data, never blocks, never breaks an open (issue 9, item 9)."""
import io
import json
import os
import pickle
import subprocess
import sys
import threading

import numpy as np
import pytest

import tracekit
from tracekit.analysis.replay import replay
from tracekit.errors import TracekitError
from tracekit.io import cache

from .conftest import ROOT, fixture
from .synth import MiB, Sim


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    d = tmp_path / "cache"
    monkeypatch.setenv("TRACEKIT_CACHE_DIR", str(d))
    return d


def _entry(path):
    return cache._file(cache.key_for(os.fspath(path), os.stat(path)))


def _peak(trace):
    return replay(trace)[0].peak_allocated


def test_same_size_edit_past_the_head_with_mtime_restored_is_seen(tmp_path, cache_dir):
    sim = Sim()
    for i in range(800):  # enough entries that the edited bytes lie far from both ends' 64 KiB
        sim.free(sim.alloc(3 * MiB if i == 400 else MiB))
    data = pickle.dumps(sim.snapshot(), protocol=4)
    p = tmp_path / "s.pickle"
    p.write_bytes(data)
    first = _peak(tracekit.load(p))
    assert first == 3 * MiB
    assert os.path.exists(_entry(p))
    st = os.stat(p)
    # the 3 MiB alloc entry becomes 5 MiB in place: same length, mtime put back
    old, new = (3 * MiB).to_bytes(4, "little"), (5 * MiB).to_bytes(4, "little")
    hits = [i for i in range(len(data)) if data.startswith(b"J" + old, i)]
    pos = hits[-3]  # segment_alloc, alloc, free_requested, free_completed are the last four
    assert 65536 < pos < len(data) - 65536
    edited = data[:pos] + b"J" + new + data[pos + 5:]
    with open(p, "r+b") as f:
        f.write(edited)
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(p).st_size == st.st_size and os.stat(p).st_mtime_ns == st.st_mtime_ns
    assert tracekit.load(p).events.size.max() == 5 * MiB
    assert _peak(tracekit.load(p)) == 5 * MiB


def test_tuples_and_other_metadata_round_trip_exactly(tmp_path, cache_dir):
    meta = {"version": 1, "backend": "cpu", "command": ("python", "train.py"),
            "settings": {"shape": (8, 128), "ids": {1, 2}, "frozen": frozenset({"a"}), "raw": b"\xff\x00",
                         "ints": {3: "three", (1, 2): "pair"}, "~": "tilde", "nan": float("inf")}}
    snap = {"segments": [], "device_traces": [], "tracekit": meta}
    p = tmp_path / "t.pickle"
    p.write_bytes(pickle.dumps(snap, protocol=4))
    first = tracekit.load(p)
    assert os.path.exists(_entry(p))
    second = tracekit.load(p)
    assert second.recorder == first.recorder == meta
    assert type(second.recorder["command"]) is tuple and type(second.recorder["settings"]["ids"]) is set
    assert second.meta == first.meta


def test_cached_reopen_equals_the_first_open_on_every_fixture(cache_dir):
    from tracekit.analysis.report import build_report

    for name in ("snapshot_cpp_frames_attention_fwd_bwd.pickle", "snapshot_legacy_torch20_oom_observer.pickle",
                 "profiler_memory_timeline_raw.json.gz"):
        first = tracekit.load(fixture(name))
        second = tracekit.load(fixture(name))
        assert second.meta == first.meta and second.strings.items == first.strings.items
        for table in ("events", "frames", "stacks", "segments", "blocks"):
            for k, v in vars(getattr(first, table)).items():
                if k.startswith("_"):  # the Recording's back-reference, not a column
                    continue
                w = getattr(getattr(second, table), k)
                assert v.dtype == w.dtype and np.array_equal(v, w), (name, table, k)
        assert json.dumps(build_report(second)) == json.dumps(build_report(first))


def test_a_renamed_copy_shares_the_entry(tmp_path, cache_dir):
    a = tmp_path / "a.pickle"
    a.write_bytes(fixture("snapshot_cpp_frames_attention_fwd_bwd.pickle").read_bytes())
    tracekit.load(a)
    b = tmp_path / "b.pickle"
    os.rename(a, b)
    assert cache.read(cache.key_for(str(b), os.stat(b)), str(b)) is not None
    assert tracekit.load(b).path == str(b)


def _npz(path, **arrays):
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    path.write_bytes(buf.getvalue())


def _sealed(arrays):
    """`arrays` with the digest recomputed, as a tamperer who read our code would: the structural checks
    must catch what the digest then cannot."""
    if "head" not in arrays:
        return arrays
    try:
        head = json.loads(bytes(arrays["head"]).decode())
        head["digest"] = cache._digest({k: v for k, v in arrays.items() if k != "head"})
    except (ValueError, TypeError):
        return arrays
    return {**arrays, "head": np.frombuffer(json.dumps(head).encode(), np.uint8)}


def _tampered(entry):
    """Valid .npz files that are not what `write` makes, and worse."""
    with np.load(entry, allow_pickle=False) as z:
        good = {k: z[k] for k in z.files}
    head = json.loads(bytes(good["head"]).decode())

    def with_(**changes):
        return {**good, **changes}

    def head_with(**changes):
        return with_(head=np.frombuffer(json.dumps({**head, **changes}).encode(), np.uint8))

    n = len(good["ev_size"])
    yield "empty npz", {}
    yield "extra member", with_(extra=np.zeros(3))
    yield "missing member", {k: v for k, v in good.items() if k != "ev_size"}
    yield "wrong dtype", with_(ev_size=good["ev_size"].astype(np.float64))
    yield "2-d column", with_(ev_size=np.stack([good["ev_size"]] * 2))
    yield "short column", with_(ev_size=good["ev_size"][: n // 2])
    yield "stack id out of range", with_(ev_stack_id=np.full(n, 10**6, np.int32))
    yield "string id out of range", with_(fr_name=np.full(len(good["fr_name"]), 10**6, np.int32))
    yield "frame id out of range", with_(st_frame_ids=np.full(len(good["st_frame_ids"]), -5, np.int32))
    yield "bad offsets", with_(st_offsets=good["st_offsets"][::-1].copy())
    yield "action code out of range", with_(ev_action=np.full(n, 99, np.int8))
    yield "negative sizes", with_(ev_size=-good["ev_size"])
    yield "unsorted devices", with_(ev_device=np.arange(n, 0, -1).astype(np.int32))
    yield "other key", head_with(key="0" * 40)
    yield "head not JSON", with_(head=np.frombuffer(b"\xff{", np.uint8))
    yield "head a list", with_(head=np.frombuffer(b"[1]", np.uint8))
    yield "strings not strings", head_with(strings=["", 5])
    yield "devices disagree", head_with(devices=[0, 7])
    yield "unknown meta tag", head_with(meta={"~": "object", "v": 1})
    yield "meta not a dict", head_with(meta=[1, 2])
    yield "object array", "object"
    yield "sizes changed, digest not", {**good, "ev_size": good["ev_size"] // 2}


@pytest.mark.parametrize("case", range(22))
def test_odd_cache_entries_are_misses_and_deleted(tmp_path, cache_dir, case):
    path = fixture("snapshot_cpp_frames_attention_fwd_bwd.pickle")
    truth = tracekit.load(path, use_cache=False)
    tracekit.load(path)
    entry = _entry(path)
    name, arrays = list(_tampered(entry))[case]
    target = tmp_path / "t.npz"
    if arrays == "object":
        buf = io.BytesIO()
        np.savez(buf, head=np.array([{"a": 1}], dtype=object), allow_pickle=True)
        target.write_bytes(buf.getvalue())
    else:
        _npz(target, **(arrays if name.endswith("digest not") else _sealed(arrays)))
    os.replace(target, entry)
    got = tracekit.load(path)  # a miss: read again from the file, and the entry rewritten
    assert _peak(got) == _peak(truth) and len(got.events) == len(truth.events), name
    assert cache.read(cache.key_for(str(path), os.stat(path)), str(path)) is not None, name


@pytest.mark.parametrize("junk", [b"", b"PK\x03\x04 not really a zip", os.urandom(5000)])
def test_corrupt_cache_bytes_are_a_miss(cache_dir, junk):
    path = fixture("snapshot_cpp_frames_attention_fwd_bwd.pickle")
    tracekit.load(path)
    entry = _entry(path)
    with open(entry, "wb") as f:
        f.write(junk)
    assert len(tracekit.load(path).events) == len(tracekit.load(path, use_cache=False).events)


def test_truncated_cache_entry_is_a_miss(cache_dir):
    path = fixture("snapshot_cpp_frames_attention_fwd_bwd.pickle")
    tracekit.load(path)
    entry = _entry(path)
    data = open(entry, "rb").read()
    for cut in (len(data) // 3, len(data) - 10):
        with open(entry, "wb") as f:
            f.write(data[:cut])
        assert cache.read(cache.key_for(str(path), os.stat(path)), str(path)) is None
        assert not os.path.exists(entry)
        tracekit.load(path)


def _in_time(fn, seconds=20):
    result = []
    t = threading.Thread(target=lambda: result.append(fn()), daemon=True)
    t.start()
    t.join(seconds)
    assert result, f"still blocked after {seconds} s"
    return result[0]


def test_fifo_or_directory_in_the_cache_never_blocks(cache_dir):
    path = fixture("snapshot_cpp_frames_attention_fwd_bwd.pickle")
    tracekit.load(path)
    entry = _entry(path)
    os.unlink(entry)
    os.mkfifo(entry)
    trace = _in_time(lambda: tracekit.load(path))
    assert len(trace.events) and os.path.isfile(entry)  # the FIFO went, a real entry took its place
    os.unlink(entry)
    os.mkdir(entry)
    assert len(_in_time(lambda: tracekit.load(path)).events)


def test_fifo_as_input_is_refused_at_once(tmp_path):
    fifo = tmp_path / "pipe.pickle"
    os.mkfifo(fifo)
    for cmd in (["report", str(fifo)], ["check", str(fifo), "--max-peak", "1GiB"]):
        r = subprocess.run([sys.executable, "-m", "tracekit.cli", *cmd], capture_output=True, text=True, timeout=60)
        assert r.returncode == 2
        assert "named pipe (FIFO), not a regular file" in r.stderr and r.stderr.count("\n") == 1


@pytest.mark.parametrize("value", ["inf", "nan", "-1", "lots", "1e400"])
def test_bad_cache_size_setting_is_one_line(value):
    env = {**os.environ, "TRACEKIT_CACHE_MAX_MB": value}
    path = fixture("snapshot_cpp_frames_attention_fwd_bwd.pickle")
    r = subprocess.run([sys.executable, "-m", "tracekit.cli", "info", str(path)], capture_output=True, text=True,
                       timeout=60, env=env)
    assert r.returncode == 2, r.stderr
    assert r.stderr == f"tracekit: TRACEKIT_CACHE_MAX_MB={value!r} is not valid: expected a number >= 0\n"


def test_cache_size_zero_keeps_nothing(cache_dir, monkeypatch):
    monkeypatch.setenv("TRACEKIT_CACHE_MAX_MB", "0")
    tracekit.load(fixture("snapshot_cpp_frames_attention_fwd_bwd.pickle"))
    assert not list(cache_dir.glob("*.npz"))


def test_settings_are_checked_even_when_the_cache_is_skipped(monkeypatch):
    monkeypatch.setenv("TRACEKIT_MAX_EXPANSION", "inf")
    with pytest.raises(TracekitError, match="TRACEKIT_MAX_EXPANSION"):
        tracekit.load(fixture("snapshot_cpp_frames_attention_fwd_bwd.pickle"), use_cache=False)


def test_non_utf8_file_names(tmp_path, cache_dir):
    name = os.fsencode(str(tmp_path)) + b"/caf\xe9-\xff.pickle"
    with open(name, "wb") as f:
        f.write(fixture("snapshot_cpp_frames_attention_fwd_bwd.pickle").read_bytes())
    as_str = os.fsdecode(name)  # a str with surrogates, as click and sys.argv give it
    for p in (name, as_str, as_str):  # bytes, then str twice (the second open is from the cache)
        assert len(tracekit.load(p).events)
    for cmd in (["report"], ["info"], ["check", "--max-peak", "1TiB"], ["report", "--json"]):
        r = subprocess.run([sys.executable, "-m", "tracekit.cli", cmd[0], name, *cmd[1:]], capture_output=True,
                           timeout=60, cwd=ROOT, env={**os.environ, "TRACEKIT_CACHE_DIR": str(cache_dir)})
        assert r.returncode == 0, (cmd, r.stderr)
        assert b"Traceback" not in r.stderr
    assert name in r.stdout or b"\\udce9" in r.stdout  # report --json names the file (JSON escapes it)


def test_metadata_codec_is_exact():
    values = [None, True, 0, -2**80, 1.5, float("inf"), "", "~", [], {}, (), (1, (2, [3])), {1: 2, "a": (3,)},
              {"~": 1}, {"~": "dict", "v": []}, set(), frozenset({(1, 2)}), b"", bytearray(b"\x00\xff"),
              [{"x": {(): {b"k": 1}}}], np.int64(5)]
    for v in values:
        back = cache.decode(json.loads(json.dumps(cache.encode(v))))
        assert back == v and type(back) is (int if isinstance(v, np.integer) else type(v)), v
