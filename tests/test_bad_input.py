"""Every kind of bad input ends in one clear LoadError (CLI: one line, exit 2), never a traceback,
a hang, or code executed."""
import gzip
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
