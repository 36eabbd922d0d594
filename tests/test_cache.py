"""The columnar cache never serves stale or wrong data, never blocks, never breaks an open (issue 9, item 9)."""
import hashlib
import io
import json
import os
import pickle
import re
import subprocess
import sys
import threading
import zlib

import numpy as np
import pytest

import tracekit
from tracekit.analysis.replay import replay
from tracekit.errors import TracekitError
from tracekit.io.cache import traces as cache

from .conftest import ROOT, SAMPLES, fixture
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
            for k in type(getattr(first, table)).__dataclass_fields__:  # the columns (not helpers attached to them)
                v, w = getattr(getattr(first, table), k), getattr(getattr(second, table), k)
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


def _tampered(entry):
    """Entries in the cache's own layout (or not) that are not what `write` makes, and worse. Written
    by cache.pack, so their CRCs pass (as a tamperer who read our code would write them): the
    structural checks must catch what the CRCs then cannot. Yields (name, arrays, head, sums),
    (name, raw bytes) or (name, "object" | "npz")."""
    head, good = cache.unpack(entry)
    good = {k: np.array(v) for k, v in good.items()}

    def with_(**changes):
        return {**good, **changes}, head, None

    def head_with(**changes):
        return good, {**head, **changes}, None

    n = len(good["ev_size"])
    yield "empty entry", {}, head, None
    yield "extra member", *with_(extra=np.zeros(3))
    yield "missing member", {k: v for k, v in good.items() if k != "ev_size"}, head, None
    yield "wrong dtype", *with_(ev_size=good["ev_size"].astype(np.float64))
    yield "2-d column", *with_(ev_size=np.stack([good["ev_size"]] * 2))
    yield "short column", *with_(ev_size=good["ev_size"][: n // 2])
    yield "stack id out of range", *with_(ev_stack_id=np.full(n, 10**6, np.int32))
    yield "string id out of range", *with_(fr_name=np.full(len(good["fr_name"]), 10**6, np.int32))
    yield "frame id out of range", *with_(st_frame_ids=np.full(len(good["st_frame_ids"]), -5, np.int32))
    yield "bad offsets", *with_(st_offsets=good["st_offsets"][::-1].copy())
    yield "action code out of range", *with_(ev_action=np.full(n, 99, np.int8))
    yield "negative sizes", *with_(ev_size=-good["ev_size"])
    yield "unsorted devices", *with_(ev_device=np.arange(n, 0, -1).astype(np.int32))
    yield "other key", *head_with(key="0" * 40)
    yield "head not JSON", cache.MAGIC + (2).to_bytes(8, "little") + zlib.crc32(b"\xff{").to_bytes(4, "little") + b"\xff{"
    yield "head a list", cache.MAGIC + (3).to_bytes(8, "little") + zlib.crc32(b"[1]").to_bytes(4, "little") + b"[1]"
    yield "strings not strings", *head_with(strings=["", 5])
    yield "devices disagree", *head_with(devices=[0, 7])
    yield "unknown meta tag", *head_with(meta={"~": "object", "v": 1})
    yield "meta not a dict", *head_with(meta=[1, 2])
    yield "object column", "object"
    yield "sizes changed, CRC not", {**good, "ev_size": good["ev_size"] // 2}, head, \
        {k: cache.column_sum(memoryview(np.ascontiguousarray(v)).cast("B")) for k, v in good.items()}
    yield "previous version's .npz", "npz"


def _write_tampered(target, case):
    if case[1] == "object":  # a head that names an object column: never unpickled, a miss
        cache.pack(target, {"ev_size": np.zeros(3, np.int64)}, {})
        data = bytearray(open(target, "rb").read())
        n = int.from_bytes(data[8:16], "little")
        body = bytes(data[20:20 + n]).replace(b'"<i8"', b'"|O8"')
        data[20:20 + n] = body
        data[16:20] = zlib.crc32(body).to_bytes(4, "little")
        target.write_bytes(bytes(data))
    elif case[1] == "npz":
        buf = io.BytesIO()
        np.savez(buf, head=np.array([{"a": 1}], dtype=object), allow_pickle=True)
        target.write_bytes(buf.getvalue())
    elif isinstance(case[1], bytes):
        target.write_bytes(case[1])
    else:
        _, arrays, head, sums = case
        cache.pack(target, arrays, {k: v for k, v in head.items() if k not in ("data",)}, sums=sums)


@pytest.mark.parametrize("case", range(23))
def test_odd_cache_entries_are_misses_and_deleted(tmp_path, cache_dir, case):
    path = fixture("snapshot_cpp_frames_attention_fwd_bwd.pickle")
    truth = tracekit.load(path, use_cache=False)
    tracekit.load(path)
    entry = _entry(path)
    tampered = list(_tampered(entry))[case]
    target = tmp_path / "t.tkc"
    _write_tampered(target, tampered)
    os.replace(target, entry)
    assert cache.read(cache.key_for(str(path), os.stat(path)), str(path)) is None, tampered[0]
    assert not os.path.exists(entry), tampered[0]  # deleted
    os.replace(_rewrite(tmp_path, tampered), entry)
    got = tracekit.load(path)  # a miss: read again from the file, and the entry rewritten
    assert _peak(got) == _peak(truth) and len(got.events) == len(truth.events), tampered[0]
    assert cache.read(cache.key_for(str(path), os.stat(path)), str(path)) is not None, tampered[0]


def _rewrite(tmp_path, case):
    target = tmp_path / "again.tkc"
    _write_tampered(target, case)
    return target


def test_the_untampered_round_trip_is_a_hit(tmp_path, cache_dir):
    """The helpers above change only what each case names: unchanged, the rewritten entry is read."""
    path = fixture("snapshot_cpp_frames_attention_fwd_bwd.pickle")
    tracekit.load(path)
    entry = _entry(path)
    head, good = cache.unpack(entry)
    target = tmp_path / "t.tkc"
    _write_tampered(target, ("same", {k: np.array(v) for k, v in good.items()}, head, None))
    os.replace(target, entry)
    assert cache.read(cache.key_for(str(path), os.stat(path)), str(path)) is not None


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
    assert not list(cache_dir.glob("*.tkc"))


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
        trace = tracekit.load(p)
        assert len(trace.events) and trace.path == as_str
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


# -- the fingerprint that spares a warm open from hashing the whole file --------------------------------

@pytest.fixture
def not_racy(monkeypatch):
    """Files written a moment ago may be fingerprinted (tests cannot wait for the clock)."""
    from tracekit.io.cache import folder as cachefiles

    monkeypatch.setattr(cachefiles, "RACY_S", 0.0)


def _hashed_bytes(monkeypatch):
    """A list that counts the bytes key_for hashes from here on."""
    from tracekit.io.cache import folder as cachefiles

    seen = []
    real = cachefiles.hashlib.sha256

    class Counting:
        def __init__(self, data=b""):
            self.h = real(data)

        def update(self, b):
            seen.append(len(b))
            self.h.update(b)

        def hexdigest(self):
            return self.h.hexdigest()

    monkeypatch.setattr(cachefiles.hashlib, "sha256", Counting)
    return seen


def test_a_warm_key_reads_only_the_ends_of_the_file(tmp_path, cache_dir, not_racy, monkeypatch):
    data = fixture("snapshot_newest_format_windows_paths.pickle").read_bytes()
    assert len(data) > 4 * cache.SAMPLE
    p = tmp_path / "big.pickle"
    p.write_bytes(data)
    key = cache.key_for(str(p))
    tracekit.load(p)
    seen = _hashed_bytes(monkeypatch)
    assert cache.key_for(str(p)) == key == hashlib.sha256(f"tracekit-cache {cache.VERSION} {len(data)}\n".encode()
                                                           + data).hexdigest()[:40]
    assert sum(seen) <= 2 * cache.SAMPLE  # the two ends, not the whole file
    os.unlink(_entry(p))  # a remembered key whose entry went is not trusted: the file is hashed again
    assert cache.key_for(str(p)) == key and sum(seen) > len(data)


def test_same_size_edit_with_mtime_restored_after_a_fingerprinted_open(tmp_path, cache_dir, not_racy):
    sim = Sim()
    for i in range(800):
        sim.free(sim.alloc(3 * MiB if i == 400 else MiB))
    data = pickle.dumps(sim.snapshot(), protocol=4)
    p = tmp_path / "s.pickle"
    p.write_bytes(data)
    assert _peak(tracekit.load(p)) == 3 * MiB
    assert _peak(tracekit.load(p)) == 3 * MiB  # from the cache, by the remembered key
    assert list((cache_dir / "fp").iterdir())
    st = os.stat(p)
    pos = [i for i in range(len(data)) if data.startswith(b"J" + (3 * MiB).to_bytes(4, "little"), i)][-3]
    assert cache.SAMPLE < pos < len(data) - cache.SAMPLE  # outside both sampled ends
    with open(p, "r+b") as f:
        f.seek(pos + 1)
        f.write((5 * MiB).to_bytes(4, "little"))
    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (os.stat(p).st_size, os.stat(p).st_mtime_ns, os.stat(p).st_ino) == (st.st_size, st.st_mtime_ns, st.st_ino)
    assert _peak(tracekit.load(p)) == 5 * MiB


def test_a_file_just_written_is_not_fingerprinted(tmp_path, cache_dir):
    p = tmp_path / "s.pickle"
    p.write_bytes(fixture("snapshot_cpp_frames_attention_fwd_bwd.pickle").read_bytes())
    tracekit.load(p)
    tracekit.load(p)
    assert not (cache_dir / "fp").exists() or not list((cache_dir / "fp").iterdir())


def test_a_damaged_fingerprint_file_is_ignored(tmp_path, cache_dir, not_racy):
    p = tmp_path / "s.pickle"
    p.write_bytes(fixture("snapshot_cpp_frames_attention_fwd_bwd.pickle").read_bytes())
    key = cache.key_for(str(p))
    tracekit.load(p)
    (fp,) = (cache_dir / "fp").iterdir()
    for junk in (b"", b"../../etc/passwd", b"z" * 40, os.urandom(64)):
        fp.write_bytes(junk)
        assert cache.key_for(str(p)) == key


# -- the report stored beside the trace ----------------------------------------------------------------

def _report(*args, cache_dir):
    from click.testing import CliRunner

    from tracekit.cli import cli

    r = CliRunner(env={"TRACEKIT_CACHE_DIR": str(cache_dir)}).invoke(cli, ["report", *map(str, args)])
    assert r.exit_code == 0, r.output
    return r.output


@pytest.mark.parametrize("name, options", [
    ("snapshot_cpp_frames_adamw_full_step.pickle", []),
    ("snapshot_cpp_frames_adamw_full_step.pickle", ["--last", "10ms"]),
    ("snapshot_newest_format_windows_paths.pickle", ["--from", "100", "--to", "900"]),
    ("snapshot_legacy_torch20_oom_observer.pickle", []),
    (str(SAMPLES / "leak_loop.pickle"), ["--iterations", "1..2"]),
])
def test_the_cached_report_is_the_computed_one(cache_dir, name, options):
    path = fixture(name) if "/" not in name else name
    fresh_json = _report("--json", "--no-cache", path, *options, cache_dir=cache_dir)
    fresh_text = _report("--no-cache", path, *options, cache_dir=cache_dir)
    assert not cache_dir.exists()
    assert _report("--json", path, *options, cache_dir=cache_dir) == fresh_json  # computed, then stored
    assert len(list(cache_dir.glob("*-*.json"))) == 1
    assert _report("--json", path, *options, cache_dir=cache_dir) == fresh_json  # from the store
    # the window line's note on how the file was read (only the window, streamed, with --no-cache) is all
    # that may differ
    unread = lambda text: re.sub(r"; only its .*$", "", text, flags=re.M)  # noqa: E731
    assert unread(_report(path, *options, cache_dir=cache_dir)) == unread(fresh_text)
    if options:
        assert '"window"' in fresh_json


def test_the_stored_report_is_what_is_served(tmp_path, cache_dir):
    """A stored report is used (its content is printed, with this file's name), and only under its name:
    other options, other code, or an edited file compute a new one."""
    from tracekit.io.cache import folder as cachefiles

    p = tmp_path / "a.pickle"
    p.write_bytes(fixture("snapshot_cpp_frames_attention_fwd_bwd.pickle").read_bytes())
    first = json.loads(_report("--json", p, cache_dir=cache_dir))
    (stored,) = cache_dir.glob("*-*.json")
    doc = json.loads(stored.read_text())
    doc["value"]["findings"] = ["marker"]
    doc["crc"] = cachefiles.value_crc(doc["value"])  # an edit with its CRC: served as stored
    stored.write_text(json.dumps(doc))
    q = tmp_path / "b.pickle"
    os.rename(p, q)
    served = json.loads(_report("--json", q, cache_dir=cache_dir))
    assert served["findings"] == ["marker"] and served["file"] == str(q)
    assert json.loads(_report("--json", q, "--from", "3", cache_dir=cache_dir))["findings"] != ["marker"]
    cachefiles._STAMP, stamp = "other code", cachefiles.code_stamp()
    try:
        assert json.loads(_report("--json", q, cache_dir=cache_dir))["findings"] == first["findings"]
    finally:
        cachefiles._STAMP = stamp
    with open(q, "ab") as f:
        f.write(b"\n")  # bytes after the pickle's STOP: the same trace, another file
    assert json.loads(_report("--json", q, cache_dir=cache_dir))["findings"] == first["findings"]
    assert cachefiles.result("0" * 40, "x") is None


def test_a_first_report_of_a_big_file_hashes_it_once(tmp_path, cache_dir, not_racy, monkeypatch):
    """Issue 35: `report --json` asks for the key before reading (a kept report?), in load (a cached trace?) and
    after (did the file change?); a file at least HASH_AHEAD_BYTES big is hashed once, on a thread while it is
    read, and its report and entry are the ones a plain open makes."""
    from tracekit.analysis.report import build_report
    from tracekit.commands._common import open_trace
    from tracekit.io.cache import folder as cachefiles
    from tracekit.io.cache.reports import file_report

    data = fixture("snapshot_newest_format_windows_paths.pickle").read_bytes()
    p = tmp_path / "big.pickle"
    p.write_bytes(data)
    monkeypatch.setattr(cachefiles, "HASH_AHEAD_BYTES", 1024)
    seen = _hashed_bytes(monkeypatch)

    def opened(path, no_cache, window):
        return open_trace(path, no_cache, window, write_behind=True)

    report, _ = file_report(str(p), opened, build_report)
    assert sum(n for n in seen if n > cache.SAMPLE) == len(data)  # once (not before and again in load), and
    # the fingerprints' ends, 64 KiB at a time
    assert not cachefiles.writing and os.path.isfile(_entry(p))  # the entry written behind is whole
    assert json.dumps(report) == json.dumps(build_report(tracekit.load(p, use_cache=False)))
    again, trace = file_report(str(p), opened, build_report)
    assert again == report and trace is None  # the kept report


def _head_of(entry):
    data = open(entry, "rb").read()
    n = int.from_bytes(data[8:16], "little")
    return json.loads(data[20:20 + n])


def test_one_valued_columns_are_stored_as_their_value(cache_dir):
    """A constant column (the scanner's zero-stride columns: stream, device, ...) is written as its value, with no
    bytes, and read back as a constant column equal to the original."""
    path = fixture("snapshot_cpp_frames_attention_fwd_bwd.pickle")
    first = tracekit.load(path, use_cache=False)
    tracekit.load(path)
    const = {f"ev_{k}" for k in type(first.events).__dataclass_fields__
             if getattr(first.events, k).strides == (0,) and len(first.events) > 1}
    assert const  # the fixture has some (a file of one stream, one device)
    head = _head_of(_entry(path))
    assert {k for k, spec in head["columns"].items() if len(spec) == 7} == const
    naive = 0  # the bytes the data would take had every column been written out
    for spec in head["columns"].values():
        naive += spec[1] * np.dtype(spec[0]).itemsize
    assert head["data"] < naive - sum(len(first.events) * getattr(first.events, k[3:]).itemsize for k in const) + 64 * 40
    second = tracekit.load(path)
    for k in const:
        a, b = getattr(first.events, k[3:]), getattr(second.events, k[3:])
        assert b.strides == (0,) and b.dtype == a.dtype and np.array_equal(a, b), k


@pytest.mark.parametrize("damage", ["out of range", "stats", "count", "float", "dtype"])
def test_a_damaged_constant_column_is_a_miss(tmp_path, cache_dir, damage):
    path = fixture("snapshot_cpp_frames_attention_fwd_bwd.pickle")
    tracekit.load(path)
    entry = _entry(path)
    data = bytearray(open(entry, "rb").read())
    n = int.from_bytes(data[8:16], "little")
    head = json.loads(data[20:20 + n])
    name = next(k for k, spec in head["columns"].items() if len(spec) == 7 and spec[0] == "<i4")
    spec = head["columns"][name]
    if damage == "out of range":
        spec[6] = spec[5][0] = spec[5][1] = 2**40
    elif damage == "stats":
        spec[5][1] = spec[6] + 1
    elif damage == "count":
        spec[1] = 1
    elif damage == "float":
        spec[6] = 0.5
    else:
        spec[0] = "<f8"
    body = json.dumps(head, separators=(",", ":")).encode()
    assert len(body) <= n  # padded to the same length, so the columns stay where they are
    body = body.ljust(n)
    data[20:20 + n] = body
    data[16:20] = zlib.crc32(body).to_bytes(4, "little")
    with open(entry, "wb") as f:
        f.write(bytes(data))
    assert cache.read(cache.key_for(str(path), os.stat(path)), str(path)) is None
    assert not os.path.exists(entry)
