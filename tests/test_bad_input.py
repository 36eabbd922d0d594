"""Every kind of bad input ends in one clear LoadError (CLI: one line, exit 2), never a traceback,
a hang, or code executed."""
import gzip
import json
import io
import os
import pickle
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import tracekit
from tracekit.analysis.replay import replay
from tracekit.errors import LoadError

from .conftest import fixture

NEWEST = "snapshot_newest_format_windows_paths.pickle"


class Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/tracekit_pwned",))


def write(tmp_path, name, data):
    p = tmp_path / name
    p.write_bytes(data)
    return p


def load_error(path):
    with pytest.raises(LoadError) as e:
        tracekit.load(path, use_cache=False)
    assert str(path) in str(e.value)
    return e.value.what


@pytest.mark.parametrize("protocol", [0, 2, 4, 5])
def test_malicious_pickle_executes_nothing(tmp_path, protocol):
    marker = "/tmp/tracekit_pwned"
    if os.path.exists(marker):
        os.unlink(marker)
    p = write(tmp_path, "evil.pickle", pickle.dumps({"segments": [], "x": Evil()}, protocol=protocol))
    what = load_error(p)
    assert "posix.system" in what or "os.system" in what
    assert "nothing was executed" in what
    assert not os.path.exists(marker)


def test_malicious_gzip_pickle(tmp_path):
    p = write(tmp_path, "evil.pickle.gz", gzip.compress(pickle.dumps([Evil()])))
    assert "refused" in load_error(p)


def test_empty_file(tmp_path):
    assert load_error(write(tmp_path, "empty.pickle", b"")) == "the file is empty (0 bytes)"


def test_missing_file_and_directory(tmp_path):
    assert load_error(tmp_path / "nope.pickle") == "no such file"
    assert "directory" in load_error(tmp_path)


def test_truncated_pickle(tmp_path):
    data = fixture(NEWEST).read_bytes()
    for cut in (3, len(data) // 2, len(data) - 1):
        assert "truncated" in load_error(write(tmp_path, f"cut{cut}.pickle", data[:cut]))


def test_truncated_gzip(tmp_path):
    data = gzip.compress(fixture(NEWEST).read_bytes())
    what = load_error(write(tmp_path, "cut.pickle.gz", data[: len(data) // 2]))
    assert "gzip" in what and ("truncated" in what or "corrupt" in what)


def test_random_bytes(tmp_path):
    what = load_error(write(tmp_path, "random.bin", bytes(range(7, 250)) * 10))
    assert "neither a pickle nor JSON" in what


def test_pickle_that_is_not_a_snapshot(tmp_path):
    assert "not a PyTorch memory snapshot" in load_error(write(tmp_path, "n.pickle", pickle.dumps(42)))
    what = load_error(write(tmp_path, "d.pickle", pickle.dumps({"model": "weights", "epoch": 3})))
    assert "'model'" in what and "neither a PyTorch memory snapshot" in what


def test_broken_json(tmp_path):
    assert "truncated JSON" in load_error(write(tmp_path, "b.json", b'{"segments": [{"device": 0, '))
    assert "not valid JSON" in load_error(write(tmp_path, "c.json", b'{"segments": [}'))


def test_structurally_wrong_snapshot(tmp_path):
    bad = {"segments": [{"device": 0, "address": "zero", "total_size": 1, "blocks": []}]}
    assert "address='zero'" in load_error(write(tmp_path, "w.pickle", pickle.dumps(bad)))
    bad = {"segments": [], "device_traces": [[{"action": "alloc", "addr": -5, "size": 1}]]}
    assert "device_traces[0][0]" in load_error(write(tmp_path, "v.pickle", pickle.dumps(bad)))


def test_cli_prints_one_line_and_exits_2(tmp_path):
    p = write(tmp_path, "evil.pickle", pickle.dumps(Evil()))
    for cmd in ("report", "info"):
        r = subprocess.run([sys.executable, "-m", "tracekit.cli", cmd, str(p)], capture_output=True, text=True,
                           timeout=60)
        assert r.returncode == 2
        assert r.stderr.startswith(f"tracekit: cannot open {p}: it is a pickle that asks to import")
        assert "Traceback" not in r.stderr and r.stderr.count("\n") == 1


# Mutation fuzzing: flip, cut and splice bytes of a real snapshot; every result is a Trace or a LoadError.
SEED = None


def _seed():
    global SEED
    if SEED is None:
        SEED = fixture(NEWEST).read_bytes()[:60000] + b"."  # a prefix keeps each example fast
    return SEED


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.integers(0, 59999), st.integers(0, 255)), min_size=1, max_size=8),
       st.integers(0, 60001), st.booleans())
def test_mutated_pickles_load_or_fail_cleanly(tmp_path, flips, cut, gz):
    data = bytearray(_seed())
    for pos, val in flips:
        data[pos] = val
    data = bytes(data[:cut])
    if gz:
        data = gzip.compress(data)
    p = tmp_path / "m.pickle"
    p.write_bytes(data)
    try:
        trace = tracekit.load(p, use_cache=False)
    except LoadError:
        return
    replay(trace)  # whatever loads must also replay without error


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.text(max_size=5),
                    lambda c: st.lists(c, max_size=4) | st.dictionaries(
                        st.sampled_from(["segments", "device_traces", "blocks", "action", "addr", "size", "frames",
                                         "address", "total_size", "state", "device", "time_us", "stream"]), c,
                        max_size=5), max_leaves=20))
def test_arbitrary_structures_load_or_fail_cleanly(tmp_path, obj):
    p = tmp_path / "s.pickle"
    p.write_bytes(pickle.dumps(obj, protocol=4))
    try:
        trace = tracekit.load(p, use_cache=False)
    except LoadError:
        return
    replay(trace)


# Issue 9, item 7: each wrong shape gets a message that says what is wrong (never a traceback).
def _snap(**extra):
    entries = [{"action": "alloc", "addr": 4096, "size": 512, "stream": 0, "time_us": 1_700_000_000_000_000},
               {"action": "free_completed", "addr": 4096, "size": 512, "stream": 0, "time_us": 1_700_000_000_000_001}]
    return {"segments": [], "device_traces": [entries], **extra}


def _entry(**fields):
    return _snap(device_traces=[[{"action": "alloc", "addr": 4096, "size": 512, "stream": 0, **fields}]])


def _seg(**fields):
    seg = {"device": 0, "address": 0, "total_size": 512, "stream": 0,
           "blocks": [{"address": 0, "size": 512, "state": "inactive"}]}
    return _snap(segments=[{**seg, **fields}])


def _kineto(**args):
    base = {"Addr": 1, "Bytes": 512, "Total Allocated": 512, "Total Reserved": 1024, "Device Type": 1, "Device Id": 0}
    ev = {"name": "[memory]", "ph": "i", "ts": 10.5, "args": {**base, **args}}
    return {"traceEvents": [ev, {**ev, "ts": ev.get("ts")}]}


WRONG_SHAPES = [
    ("size beyond int64", _entry(size=2**70), "size=1180591620717411303424, not an integer in range"),
    ("size beyond any device", _entry(size=2**55), "size=36028797018963968, not a size between 0 and 1 PiB"),
    ("sizes summing past int64", _snap(device_traces=[[{"action": "alloc", "addr": i, "size": 2**50} for i in range(5000)]]),
     "add up to more than 2**62 bytes"),
    ("device_free huge", _entry(action="oom", device_free=2**70), "device_free=1180591620717411303424, not a byte count"),
    ("device_free text", _entry(action="oom", device_free="lots"), "device_free='lots', not a byte count"),
    ("time_us at int64 max", _entry(time_us=2**63 - 1), "too far from any real time"),
    ("time_us inf", _entry(time_us=float("inf")), "time_us=inf, not an integer in range"),
    ("frames an int", _entry(frames=5), "'frames' of type int, not a list"),
    ("segment total_size huge", _seg(total_size=2**70), "total_size=1180591620717411303424, out of range"),
    ("block size past 1 PiB", _seg(blocks=[{"size": 2**51}]), "size=2251799813685248, larger than any device"),
    ("segment device huge", _seg(device=2**40), "device=1099511627776, beyond torch's device numbers (0-127)"),
    ("tracekit a string", _snap(tracekit="v1"), "'tracekit' is a str ('v1'), not a dict"),
    ("tracekit tag addr", _snap(tracekit={"tags": [{"addr": "0x10", "kind": "parameter"}]}),
     "'tracekit'.tags[0].addr is '0x10', not an integer"),
    ("tracekit phase time inf", _snap(tracekit={"phases": [{"phase": "forward", "start_us": float("inf")}]}),
     "'tracekit'.phases[0].start_us is inf, not a time in microseconds"),
    ("tracekit devices", _snap(tracekit={"devices": [5]}), "'tracekit'.devices[0] is a int (5), not a dict"),
    ("tracekit model", _snap(tracekit={"model": {"parameters": 2**70}}), "'tracekit'.model.parameters is"),
    ("tracekit iterations", _snap(tracekit={"iterations": {"0": 1}}), "'tracekit'.iterations is a dict, not a list"),
    ("allocator_settings a list", _snap(allocator_settings=[1]), "'allocator_settings' is a list, not a dict"),
    ("external_annotations an int", _snap(external_annotations=5), "'external_annotations' is a int (5), not a list"),
    ("external_annotations item", _snap(external_annotations=[5]), "'external_annotations'[0] is a int (5), not a dict"),
    ("external_annotations time", _snap(external_annotations=[{"name": "Optimizer.step", "stage": "START",
                                                               "time_us": float("nan")}]),
     "'external_annotations'[0].time_us is nan, not a time"),
    ("external_annotations name", _snap(external_annotations=[{"name": ["x"]}]),
     "'external_annotations'[0].name is ['x'], not a string"),
    ("kineto bytes huge", _kineto(Bytes=2**70), "'Bytes'=1180591620717411303424, out of range"),
    ("kineto bytes text", _kineto(Bytes="512"), "'Bytes'='512', not a number"),
    ("kineto device id", _kineto(**{"Device Id": [0]}), "'Device Id'=[0], not a number"),
    ("kineto total inf", _kineto(**{"Total Allocated": float("inf")}), "'Total Allocated'=inf, not a number"),
    ("memory timeline row", [[i * 1000, 0, 512, 0] for i in range(60)] + [[1, 2, 3]],
     "row 60 of the memory timeline is [1, 2, 3], not [time_ns, action, bytes, category]"),
]


@pytest.mark.parametrize("name,doc,message", WRONG_SHAPES, ids=[w[0] for w in WRONG_SHAPES])
def test_wrong_shapes_say_what_is_wrong(tmp_path, name, doc, message):
    p = write(tmp_path, "w.pickle", pickle.dumps(doc, protocol=4))
    assert message in load_error(p)


def test_kineto_ts_infinity_in_json(tmp_path):
    text = json.dumps(_kineto()).replace("10.5", "Infinity")
    assert "'ts'=inf, not a number" in load_error(write(tmp_path, "k.json", text.encode()))


@pytest.mark.parametrize("name,doc,message", WRONG_SHAPES[:6] + WRONG_SHAPES[11:14] + WRONG_SHAPES[22:24],
                         ids=[w[0] for w in WRONG_SHAPES[:6] + WRONG_SHAPES[11:14] + WRONG_SHAPES[22:24]])
def test_wrong_shapes_are_one_line_exit_2_in_every_command(tmp_path, name, doc, message):
    from .test_fuzz import run_cli

    p = write(tmp_path, "w.pickle", pickle.dumps(doc, protocol=4))
    for args in (["report", str(p)], ["info", str(p), "--json"], ["check", str(p), "--max-peak", "1GiB"]):
        code, out, err = run_cli(*args)
        assert code == 2 and err.startswith(f"tracekit: cannot open {p}: ") and err.count("\n") == 1, err
        assert message in err


def test_bom_json_opens(tmp_path):
    snap = _snap()
    p = write(tmp_path, "bom.json", b"\xef\xbb\xbf" + json.dumps(snap).encode())
    assert len(tracekit.load(p, use_cache=False).events) == 2
    gz = write(tmp_path, "bom.json.gz", gzip.compress(b"\xef\xbb\xbf" + json.dumps(snap).encode()))
    assert len(tracekit.load(gz, use_cache=False).events) == 2


# The one guard: whatever an analysis raises, the command says so in one line and exits 2.
@pytest.mark.parametrize("error,expected", [
    (ZeroDivisionError("division by zero"), "ZeroDivisionError: division by zero (this is a bug in tracekit"),
    (RecursionError("maximum recursion depth"), "it is nested too deeply"),
    (MemoryError(), "out of memory"),
    (OverflowError("int too large\nsecond line"), "OverflowError: int too large second line"),
])
def test_the_guard_turns_any_analysis_failure_into_one_line(monkeypatch, tmp_path, error, expected):
    from .test_fuzz import run_cli

    def boom(*a, **k):
        raise error

    monkeypatch.delenv("TRACEKIT_DEBUG", raising=False)
    monkeypatch.setenv("TRACEKIT_CACHE_DIR", str(tmp_path))  # no stored report: the analysis runs
    monkeypatch.setattr("tracekit.analysis.report.build_report", boom)
    path = str(fixture(NEWEST))
    for args in (["report", path], ["check", path, "--max-peak", "1GiB"]):
        code, out, err = run_cli(*args)
        assert code == 2, err
        assert err.startswith(f"tracekit: cannot analyse {path}: ") and err.count("\n") == 1, err
        assert expected in err
    if not isinstance(error, MemoryError):
        monkeypatch.setenv("TRACEKIT_DEBUG", "1")  # for a bug report: the real exception, with its traceback
        with pytest.raises(type(error)):
            run_cli("report", path)
