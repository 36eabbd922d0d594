"""The streaming reader (compiled scanner + numpy columns) opens every file to the same Trace as the
restricted unpickler, and refuses exactly what it refuses, with the same one line."""
import glob
import json
import gzip
import os
import pickle
import random

import numpy as np
import pytest

from tracekit.errors import LoadError
from tracekit.io import load, stream

pytestmark = pytest.mark.skipif(not stream.enabled(), reason="the compiled scanner is not built here")

PICKLES = sorted(glob.glob("samples/*.pickle") + glob.glob("tests/fixtures/real/*.pickle"))
SMALL = "tests/fixtures/real/snapshot_cpp_frames_attention_fwd_bwd.pickle"


def decoded(t):
    """Everything a Trace says, with string ids replaced by their strings (their numbering may differ)."""
    s = t.strings.items
    out = {f"events.{k}": getattr(t.events, k) for k in t.events.__dataclass_fields__}
    for k in ("user_metadata", "compile_context", "category", "module"):
        out[f"events.{k}"] = [s[i] for i in out[f"events.{k}"].tolist()]
    out["frames"] = [(s[a], b, s[c]) for a, b, c in zip(t.frames.filename.tolist(), t.frames.line.tolist(),
                                                           t.frames.name.tolist())]
    out["stacks"] = (t.stacks.offsets, t.stacks.frame_ids)
    for k in t.segments.__dataclass_fields__:
        v = getattr(t.segments, k)
        out[f"segments.{k}"] = [s[i] for i in v.tolist()] if k in ("segment_type", "pool_id") else v
    out.update({f"blocks.{k}": getattr(t.blocks, k) for k in t.blocks.__dataclass_fields__})
    out["meta"] = {k: ({**v, "read": None} if k == "window" else v) for k, v in t.meta.items() if k != "reader"}
    out["devices"], out["format"] = t.devices, t.format
    return out


def assert_same(a, b):
    da, db = decoded(a), decoded(b)
    assert da.keys() == db.keys()
    for k in da:
        x, y = da[k], db[k]
        if isinstance(x, tuple):
            assert all(np.array_equal(p, q) and p.dtype == q.dtype for p, q in zip(x, y)), k
        elif isinstance(x, np.ndarray):
            assert x.dtype == y.dtype and np.array_equal(x, y), k
        else:
            assert x == y, k


def both(path, monkeypatch):
    """(old path's result, streaming result): a Trace or the LoadError's message."""
    out = []
    for reader in ("python", "auto"):
        monkeypatch.setenv("TRACEKIT_READER", reader)
        try:
            out.append(load(path, use_cache=False))
        except LoadError as e:
            out.append(str(e))
    return out


@pytest.mark.parametrize("path", PICKLES, ids=os.path.basename)
def test_every_fixture_and_sample_reads_the_same(path, monkeypatch):
    old, new = both(path, monkeypatch)
    assert old.meta["reader"] == stream.PYTHON and new.meta["reader"] == stream.COMPILED
    assert_same(old, new)


def test_forward_origins_and_modules_read_the_same(tmp_path, monkeypatch):
    """Our recorder's per-entry forward_frames and module (issue 11) come through the streaming reader too."""
    fwd = [{"filename": "train.py", "line": 13, "name": "loss_fn"}]
    entries = [{"action": "alloc", "addr": 4096, "size": 512, "frames": [FRAME], "module": "model.lm_head"},
               {"action": "alloc", "addr": 8192, "size": 1024, "frames": [], "forward_frames": fwd,
                "module": "model.lm_head"},
               {"action": "free_completed", "addr": 8192, "size": 1024, "forward_frames": fwd}]
    path = tmp_path / "o.pickle"
    path.write_bytes(pickle.dumps(_snapshot(entries), protocol=4))
    old, new = both(path, monkeypatch)
    assert new.meta["reader"] == stream.COMPILED
    assert_same(old, new)
    assert new.stack(int(new.events.forward_stack_id[1])) == fwd
    assert new.strings[int(new.events.module[1])] == "model.lm_head"


def test_gzip_compressed(tmp_path, monkeypatch):
    p = tmp_path / "s.pickle.gz"
    p.write_bytes(gzip.compress(open(PICKLES[0], "rb").read()))
    old, new = both(p, monkeypatch)
    assert new.meta["reader"] == stream.COMPILED and new.meta["container"] == "gzip-compressed pickle"
    assert_same(old, new)


def _snapshot(entries, **top):
    return {"segments": [], "device_traces": [entries], **top}


FRAME = {"filename": "a.py", "line": 3, "name": "f"}
ODD = {
    "bool addr": [{"action": "alloc", "addr": True, "size": 4}],
    "addr past 2**63": [{"action": "alloc", "addr": 2**63 + 512, "size": 4}],
    "negative addr": [{"action": "alloc", "addr": -5, "size": 4}],
    "float size": [{"action": "alloc", "addr": 1, "size": 4.0}],
    "huge size": [{"action": "alloc", "addr": 1, "size": 2**60}],
    "no action": [{"addr": 1, "size": 4}],
    "int action": [{"action": 3, "addr": 1, "size": 4}],
    "unknown action": [{"action": "teleport", "addr": 1, "size": 4}],
    "tuple frames": [{"action": "alloc", "addr": 1, "size": 4, "frames": (FRAME,)}],
    "frame without line": [{"action": "alloc", "addr": 1, "size": 4, "frames": [{"filename": "a", "name": "f"}]}],
    "frame line as str": [{"action": "alloc", "addr": 1, "size": 4, "frames": [{**FRAME, "line": "7"}]}],
    "frame line 2**40": [{"action": "alloc", "addr": 1, "size": 4, "frames": [{**FRAME, "line": 2**40}]},
                         {"action": "alloc", "addr": 2, "size": 4, "frames": [{**FRAME, "line": 2**40 + 1}]}],
    "empty frames": [{"action": "alloc", "addr": 1, "size": 4, "frames": []}],
    "frames None": [{"action": "alloc", "addr": 1, "size": 4, "frames": None}],
    "oom device_free": [{"action": "oom", "addr": 0, "size": 4, "device_free": 77}],
    "oom bad device_free": [{"action": "oom", "addr": 0, "size": 4, "device_free": -1}],
    "time out of range": [{"action": "alloc", "addr": 1, "size": 4, "time_us": 2**62 + 1}],
    "user_metadata int": [{"action": "alloc", "addr": 1, "size": 4, "user_metadata": 5}],
    "int key": [{"action": "alloc", "addr": 1, "size": 4, 7: "x"}],
    "entry not a dict": [{"action": "alloc", "addr": 1, "size": 4}, ["alloc"]],
    "entries with different keys": [{"action": "alloc", "addr": 1, "size": 4},
                                    {"size": 4, "action": "free_completed", "addr": 1, "frames": [FRAME]},
                                    {"action": "alloc", "addr": 2, "size": 8, "frames": [FRAME, FRAME]}],
    "a key twice": [{"action": "alloc", "addr": 1, "size": 4}],  # made below: SETITEMS sets 'addr' again
}


@pytest.mark.parametrize("name", sorted(ODD))
def test_unusual_entries_read_or_fail_the_same(name, tmp_path, monkeypatch):
    p = tmp_path / "odd.pickle"
    data = pickle.dumps(_snapshot(ODD[name]), protocol=4)
    if name == "a key twice":  # the entry's SETITEMS gets a second 'addr' (same memoised key string) = 9
        i = data.index(b"\x8c\x04addr")
        k = data.index(b"u", i)
        data = data[:k] + b"h\x09K\x09" + data[k:]
        assert pickle.loads(data)["device_traces"][0][0]["addr"] == 9
    p.write_bytes(data)
    old, new = both(p, monkeypatch)
    if isinstance(old, str):
        assert new == old
    else:
        assert_same(old, new)


def test_shared_objects_and_cycles(tmp_path, monkeypatch):
    frames = [FRAME, {"filename": "b.py", "line": 9, "name": "g"}]
    entry = {"action": "alloc", "addr": 1, "size": 4, "frames": frames}
    meta = {"k": [1, 2]}
    meta["self"] = meta  # a cycle in metadata
    cases = {"shared": _snapshot([entry, {**entry, "addr": 2}, {"action": "free_completed", "addr": 1, "size": 4,
                                                                 "frames": frames}]),
             "same dict twice": _snapshot([entry, entry]),
             "entry also in the metadata": _snapshot([entry], allocator_settings={"e": entry}),
             "frame also in the metadata": _snapshot([{**entry, "frames": [dict(FRAME)]}]),
             "device trace also in the metadata": {"segments": [], "device_traces": [[entry]]},
             "frames list as entry and forward frames": _snapshot([{**entry, "forward_frames": frames}]),
             "cycle": _snapshot([entry], allocator_settings=meta)}
    cases["frame also in the metadata"]["x"] = cases["frame also in the metadata"]["device_traces"][0][0]["frames"][0]
    cases["device trace also in the metadata"]["x"] = cases["device trace also in the metadata"]["device_traces"][0]
    for name, obj in cases.items():
        p = tmp_path / f"{name}.pickle"
        p.write_bytes(pickle.dumps(obj, protocol=4))
        old, new = both(p, monkeypatch)
        if isinstance(old, str):
            assert new == old, name
        else:
            assert_same(old, new)


class Evil:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


@pytest.mark.parametrize("protocol", [0, 2, 4, 5])
def test_globals_are_refused_with_the_same_line(protocol, tmp_path, monkeypatch):
    p = tmp_path / "evil.pickle"
    p.write_bytes(pickle.dumps(_snapshot([{"action": "alloc", "addr": 1, "size": 4, "x": Evil()}]), protocol=protocol))
    old, new = both(p, monkeypatch)
    assert isinstance(old, str) and "refused, nothing was executed" in old
    assert new == old
    with pytest.raises(stream.Unsupported):
        stream.Tape(p.read_bytes())


def test_mutated_files_fail_or_read_the_same(tmp_path, monkeypatch):
    data = open(SMALL, "rb").read()
    rng = random.Random(15)
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
        old, new = both(p, monkeypatch)
        if isinstance(old, str):
            assert new == old, i
        else:
            accepted += 1
            assert_same(old, new)
    assert accepted > 10  # some mutations leave a readable file: those were compared field by field


def test_without_the_compiled_scanner_the_old_path_reads(monkeypatch):
    monkeypatch.setattr(stream, "_scan", None)
    assert load(SMALL, use_cache=False).meta["reader"] == stream.PYTHON


@pytest.mark.parametrize("delta", [-1, 1, -100, 100, 10**6, 2**40])
def test_a_wrong_frame_length_fails_or_reads_the_same(delta, tmp_path, monkeypatch):
    data = open("samples/gpt_adamw.pickle", "rb").read()
    assert data[2] == 0x95  # PROTO 4, then the first FRAME and its 8-byte length
    n = int.from_bytes(data[3:11], "little")
    p = tmp_path / "f.pickle"
    p.write_bytes(data[:3] + max(0, n + delta).to_bytes(8, "little") + data[11:])
    old, new = both(p, monkeypatch)
    if isinstance(old, str):
        assert new == old
    else:
        assert_same(old, new)


def test_many_frames_and_stacks_and_shared_ones_read_the_same(tmp_path, monkeypatch):
    """Thousands of distinct frames and stacks (the scanner's hash tables grow several times), frame dicts
    and frame lists shared with the segments' blocks and between entries, and a second device."""
    rng = random.Random(7)
    frames = [{"filename": f"f{i % 37}.py", "line": i, "name": f"fn{i % 11}"} for i in range(3000)]
    lists = [[frames[rng.randrange(3000)] for _ in range(rng.randrange(1, 9))] for _ in range(2500)]
    blocks = [{"address": 4096 * i, "size": 512, "requested_size": 512, "state": "active_allocated",
               "frames": lists[i]} for i in range(50)]
    seg = {"device": 0, "address": 0, "total_size": 4096 * 50, "stream": 0, "segment_type": "large",
           "blocks": blocks}
    entries = [[{"action": "alloc", "addr": 10**6 + i, "size": 8, "frames": lists[rng.randrange(2500)] if i % 3
                 else [dict(f) for f in lists[i % 2500]], "time_us": i} for i in range(d * 100, 6000)]
               for d in range(2)]
    p = tmp_path / "many.pickle"
    p.write_bytes(pickle.dumps({"segments": [seg], "device_traces": entries}, protocol=4))
    old, new = both(p, monkeypatch)
    assert new.meta["reader"] == stream.COMPILED
    assert_same(old, new)
    assert len(new.stacks.offsets) > 2000 and len(new.frames.line) > 2000


def test_entries_before_segments_read_the_same(tmp_path, monkeypatch):
    """A file whose device traces come first (frames first met in an entry, then in a block): either path
    reads it, to the same Trace."""
    fr = [FRAME]
    obj = {"device_traces": [[{"action": "alloc", "addr": 4096, "size": 512, "frames": fr}]],
           "segments": [{"device": 0, "address": 4096, "total_size": 512, "blocks": [
               {"address": 4096, "size": 512, "state": "active_allocated", "frames": fr}]}]}
    p = tmp_path / "order.pickle"
    p.write_bytes(pickle.dumps(obj, protocol=4))
    old, new = both(p, monkeypatch)
    assert_same(old, new)


def test_reading_in_tiny_pieces_gives_the_same_columns():
    """The scanner refills its buffer wherever the data breaks (inside an opcode, a string, a frame header)."""
    data = open("samples/gpt_adamw.pickle", "rb").read()
    whole = stream.Tape(data)
    rng = random.Random(3)
    f = __import__("io").BytesIO(data)
    pieces = stream.Tape(lambda n: f.read(min(n, rng.randrange(1, 12))))
    assert whole.strings == pieces.strings and whole.devices == pieces.devices
    for k, v in whole.entries.items():
        assert np.array_equal(v, pieces.entries[k]), k
    for k in ("f_file", "f_line", "f_name", "s_off", "s_fids"):
        assert np.array_equal(getattr(whole, k), getattr(pieces, k)), k
    from tracekit.io.unpickle import restricted_load

    with open("samples/gpt_adamw.pickle", "rb") as fh:  # every entry of the file, not merely many
        assert len(whole.entries["action"]) == sum(len(t) for t in restricted_load(fh)["device_traces"])


def test_several_devices_one_empty_read_the_same(tmp_path, monkeypatch):
    e = [{"action": "alloc", "addr": 4096 * (i + 1), "size": 512, "frames": [FRAME]} for i in range(3)]
    p = tmp_path / "dev.pickle"
    p.write_bytes(pickle.dumps({"segments": [], "device_traces": [e[:2], [], e[2:]]}, protocol=4))
    old, new = both(p, monkeypatch)
    assert new.meta["reader"] == stream.COMPILED
    assert_same(old, new)
    assert new.devices == [0, 2]


# -- JSON snapshots (memory_viz's format): the same scanner, driven by JSON's tokens --------------------

def _json_of(path):
    from tracekit.io.unpickle import restricted_load

    with open(path, "rb") as f:
        return json.dumps(restricted_load(f))


@pytest.mark.parametrize("path", PICKLES, ids=os.path.basename)
def test_every_fixture_and_sample_as_json_reads_the_same(path, tmp_path, monkeypatch):
    p = tmp_path / "s.json"
    p.write_text(_json_of(path))
    old, new = both(p, monkeypatch)
    assert old.meta["reader"] == stream.PYTHON and new.meta["reader"] == stream.COMPILED
    assert new.meta["container"] == "JSON"
    assert_same(old, new)


JSON_ODD = {
    "escapes and unicode": '{"segments": [], "device_traces": [[{"action": "alloc", "addr": 1, "size": 4, '
                           '"frames": [{"filename": "C:\\\\dir\\\\a.py", "line": 3, "name": "f\\u00e9\\ud83d\\ude00"}, '
                           '{"filename": "C:\\\\dir\\\\a.py", "line": 3, "name": "\\ud800 lone"}], '
                           '"user_metadata": "caf\u00e9 \\"q\\""}]]}',
    "byte-order mark": '\ufeff{"segments": [], "device_traces": [[{"action": "alloc", "addr": 1, "size": 4}]]}',
    "a key twice": '{"segments": [], "device_traces": [[{"action": "alloc", "addr": 1, "size": 4, "addr": 9}]]}',
    "floats and literals": '{"segments": [], "device_traces": [[{"action": "alloc", "addr": 1, "size": 4, '
                           '"x": [1.5, -2e-3, 1E400, true, false, null, -0]}]], "allocator_settings": {"a": 0.25}}',
    "float size": '{"segments": [], "device_traces": [[{"action": "alloc", "addr": 1, "size": 4.0}]]}',
    "NaN": '{"segments": [], "device_traces": [[{"action": "alloc", "addr": 1, "size": 4, "x": NaN}]]}',
    "integer past 2**64": '{"segments": [], "device_traces": [[{"action": "alloc", "addr": 1, "size": 4, '
                          '"x": 123456789012345678901234567890}]]}',
    "leading zero": '{"segments": [], "device_traces": [[{"action": "alloc", "addr": 01, "size": 4}]]}',
    "trailing comma": '{"segments": [], "device_traces": [[{"action": "alloc", "addr": 1, "size": 4,}]]}',
    "extra data": '{"segments": [], "device_traces": []} {}',
    "truncated": '{"segments": [], "device_traces": [[{"action": "alloc", "addr": 1, "si',
    "control character": '{"segments": [], "device_traces": [[{"action": "al\tloc", "addr": 1, "size": 4}]]}',
    "deep": '{"segments": [], "device_traces": [], "x": ' + "[" * 20000 + "]" * 20000 + "}",
    "many entries": json.dumps({"segments": [], "device_traces": [[
        {"action": "alloc", "addr": i, "size": 8, "frames": [FRAME] * (i % 4), "time_us": i} for i in range(5000)]]}),
}


@pytest.mark.parametrize("name", sorted(JSON_ODD))
def test_unusual_json_reads_or_fails_the_same(name, tmp_path, monkeypatch):
    p = tmp_path / "odd.json"
    p.write_bytes(JSON_ODD[name].encode("utf-8", "surrogatepass"))
    old, new = both(p, monkeypatch)
    if isinstance(old, str):
        assert new == old
    else:
        assert_same(old, new)
        if name in ("escapes and unicode", "many entries", "byte-order mark"):
            assert new.meta["reader"] == stream.COMPILED


def test_invalid_utf8_in_json_fails_the_same(tmp_path, monkeypatch):
    p = tmp_path / "bad.json"
    p.write_bytes(b'{"segments": [], "device_traces": [[{"action": "al\xffloc", "addr": 1, "size": 4}]]}')
    old, new = both(p, monkeypatch)
    assert isinstance(old, str) and new == old


def test_mutated_json_fails_or_reads_the_same(tmp_path, monkeypatch):
    data = _json_of(SMALL).encode()
    rng = random.Random(16)
    p = tmp_path / "m.json"
    accepted = 0
    for i in range(120):
        b = bytearray(data)
        if i % 3 == 0:
            b = b[:rng.randrange(1, len(b))]
        else:
            for _ in range(rng.randrange(1, 4)):
                b[rng.randrange(len(b))] = rng.choice(b'{}[]:,"0123456789.e-tfn \\x')
        p.write_bytes(bytes(b))
        old, new = both(p, monkeypatch)
        if isinstance(old, str):
            assert new == old, i
        else:
            accepted += 1
            assert_same(old, new)
    assert accepted > 10


def test_gzip_json_and_profiler_json_are_left_to_the_python_path_when_not_snapshots(tmp_path, monkeypatch):
    p = tmp_path / "s.json.gz"
    p.write_bytes(gzip.compress(_json_of(SMALL).encode()))
    old, new = both(p, monkeypatch)
    assert new.meta["reader"] == stream.COMPILED and new.meta["container"] == "gzip-compressed JSON"
    assert_same(old, new)
    kineto = "tests/fixtures/real/kineto_trace_memory_v100_rank1.json.gz"
    monkeypatch.setenv("TRACEKIT_READER", "auto")
    assert load(kineto, use_cache=False).meta["reader"] == stream.PYTHON


def _columns_snapshot():
    """Columns that hold one value for a while and then another (stream, user_metadata set late, module
    on one device only), over three devices; more than 255 distinct actions (the scanner's action codes
    widen from one byte to four)."""
    fr = [[{"filename": "m.py", "line": i, "name": f"f{i}"}] for i in range(5)]
    d0 = [{"action": "alloc", "addr": 4096 * (i + 1), "size": 512, "stream": 0, "time_us": 10 + i,
           "frames": fr[i % 3]} for i in range(40)]
    d0 += [{"action": "free_completed", "addr": 4096 * (i + 1), "size": 512, "stream": 7, "time_us": 60 + i,
            "frames": fr[(i * 7) % 5], "user_metadata": "late"} for i in range(20)]
    d1 = [{"action": f"future_{i % 300}", "addr": 8, "size": 0, "stream": 3, "time_us": 100 + i,
           "module": "model.layer", "forward_frames": fr[4]} for i in range(600)]
    d1[599]["action"] = "alloc"
    d2 = [{"action": "oom", "addr": 0, "size": 4, "device_free": 5 + i, "frames": fr[1]} for i in range(3)]
    return {"segments": [], "device_traces": [d0, d1, d2]}


@pytest.mark.parametrize("chunk", [1 << 20, 1, 7], ids=lambda c: f"chunk{c}")
def test_columns_of_one_value_for_a_while_read_the_same(chunk, tmp_path, monkeypatch):
    """The scanner keeps a column of one value as that value until another comes (and its action codes
    in a byte below 256 distinct actions); the columns are mapped a chunk of rows at a time."""
    monkeypatch.setattr(stream, "_CHUNK", chunk)
    p = tmp_path / "c.pickle"
    p.write_bytes(pickle.dumps(_columns_snapshot(), protocol=4))
    old, new = both(p, monkeypatch)
    assert new.meta["reader"] == stream.COMPILED
    assert_same(old, new)
    tape = stream.Tape(p.read_bytes())
    assert tape.entries["stream"].strides != (0,) and tape.entries["category"].strides == (0,)
    assert tape.entries["action"].dtype == np.int32 and len(tape._actions) == 303
    one = stream.Tape(pickle.dumps(_snapshot(_columns_snapshot()["device_traces"][0]), protocol=4))
    assert one.entries["action"].dtype == np.uint8 and one.entries["forward_frames"].strides == (0,)
    p.write_text(json.dumps(_columns_snapshot()))
    old, new = both(p, monkeypatch)
    assert_same(old, new)
