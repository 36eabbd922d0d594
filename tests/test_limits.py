"""Resource bombs end fast and small with a message naming the limit and its override (issue 9, item 8).

The bombs run in a subprocess under an address-space limit, which prints its own peak RSS, so a
regression shows as a number over its bound rather than as a machine brought down."""
import gzip
import os
import pickle
import subprocess
import sys
import textwrap

import pytest

import tracekit
from tracekit.analysis.replay import replay
from tracekit.errors import LoadError, TracekitError
from tracekit.io import columns

from .conftest import ROOT, fixture

MiB = 2**20
DRIVER = textwrap.dedent("""
    import resource, sys, time
    resource.setrlimit(resource.RLIMIT_AS, (6 * 2**30, resource.RLIM_INFINITY))
    from tracekit.cli import main
    t0 = time.monotonic()
    try:
        code = main(sys.argv[1:])
    except SystemExit as e:
        code = e.code
    # VmHWM, not ru_maxrss: Linux keeps ru_maxrss across exec, so it would count the forking test process
    rss = next(int(x.split()[1]) * 1024 for x in open("/proc/self/status") if x.startswith("VmHWM"))
    print(f"RESULT {code or 0} {rss} {time.monotonic() - t0:.2f}", file=sys.stderr)
""")


def run_limited(*args, env=None):
    """(exit code, first stderr line, peak RSS bytes, seconds) of `tracekit ARGS` in a fresh process."""
    r = subprocess.run([sys.executable, "-c", DRIVER, *map(str, args)], capture_output=True, text=True, timeout=120,
                       cwd=ROOT, env={**os.environ, **(env or {})})
    lines = r.stderr.strip().splitlines()  # (a progress bar's \r count as line ends here)
    assert lines and lines[-1].startswith("RESULT"), r.stderr
    code, rss, took = lines[-1].split()[1:]
    assert "Traceback" not in r.stderr, r.stderr
    return int(code), next((x for x in lines if x.startswith("tracekit: ")), ""), int(rss), float(took)


def test_memo_bomb_fails_fast_and_small(tmp_path):
    # 9 bytes: PROTO 2, NONE, LONG_BINPUT 2**27, STOP. CPython sizes its memo list to twice the index
    # and zeroes it: 2 GiB touched before anything else happens, without a limit.
    p = tmp_path / "memo.pickle"
    p.write_bytes(b"\x80\x02N" + b"r" + (2**27).to_bytes(4, "little") + b".")
    assert p.stat().st_size == 9
    code, err, rss, took = run_limited("info", p, "--no-cache")
    assert code == 2
    assert "needs more than" in err and "TRACEKIT_MAX_MEMORY_MB" in err
    assert rss < 600 * MiB, f"peak RSS {rss / MiB:.0f} MiB"


def test_memory_limit_override():
    path = fixture("snapshot_cpp_frames_adamw_full_step.pickle")
    code, err, rss, took = run_limited("info", path, "--no-cache", env={"TRACEKIT_MAX_MEMORY_MB": "1"})
    assert code == 2 and "more than 1 MiB of memory (TRACEKIT_MAX_MEMORY_MB)" in err, err
    code, err, rss, took = run_limited("info", path, "--no-cache", env={"TRACEKIT_MAX_MEMORY_MB": "4096"})
    assert code == 0, err


@pytest.mark.parametrize("name,value", [("TRACEKIT_MAX_MEMORY_MB", "inf"), ("TRACEKIT_MAX_MEMORY_MB", "-5"),
                                        ("TRACEKIT_MAX_EXPANSION", "nan"), ("TRACEKIT_MAX_EXPANSION", "0.5"),
                                        ("TRACEKIT_MAX_DEPTH", "1.5"), ("TRACEKIT_CACHE_MAX_MB", "lots")])
def test_bad_settings_are_one_line(monkeypatch, name, value):
    monkeypatch.setenv(name, value)
    with pytest.raises(TracekitError, match=f"{name}={value!r} is not valid"):
        tracekit.load(fixture("snapshot_cpp_frames_attention_fwd_bwd.pickle"))


def _gzip_bomb(path, members, tail):
    """`members` gzip members of 16 MiB of spaces each (about 16 KiB apiece), then `tail`."""
    member = gzip.compress(b" " * (16 * MiB), compresslevel=9)
    with open(path, "wb") as f:
        f.write(gzip.compress(b"\x80\x04" if tail.startswith(b"\x80") else b""))
        for _ in range(members):
            f.write(member)
        f.write(gzip.compress(tail))


def test_gzip_json_bomb_stops_at_the_cap(tmp_path):
    p = tmp_path / "bomb.json.gz"
    _gzip_bomb(p, 64, b'{"segments": []}')  # 1 GiB of JSON whitespace from about 1 MiB
    assert p.stat().st_size < 2 * MiB
    code, err, rss, took = run_limited("report", p, "--no-cache")
    assert code == 2
    assert "expands past" in err and "TRACEKIT_MAX_EXPANSION" in err
    assert rss < 700 * MiB, f"peak RSS {rss / MiB:.0f} MiB"


def test_gzip_pickle_bomb_stops_at_the_cap(tmp_path):
    p = tmp_path / "bomb.pickle.gz"
    big = pickle.dumps({"segments": [], "pad": b"\0" * (300 * MiB)}, protocol=4)
    p.write_bytes(gzip.compress(big, compresslevel=1))
    with pytest.raises(LoadError, match="expands past .*TRACEKIT_MAX_EXPANSION"):
        tracekit.load(p, use_cache=False)


def test_expansion_override_opens_a_genuine_highly_compressed_file(tmp_path, monkeypatch):
    p = tmp_path / "airy.json.gz"
    _gzip_bomb(p, 6, b'{"segments": []}')  # 96 MiB of whitespace: past the 64 MiB floor of a small file
    with pytest.raises(LoadError, match="TRACEKIT_MAX_EXPANSION"):
        tracekit.load(p, use_cache=False)
    monkeypatch.setenv("TRACEKIT_MAX_EXPANSION", "100000")
    assert tracekit.load(p, use_cache=False).format == "snapshot"


def _shared_frames_snapshot(n_frames, n_entries):
    frames = [{"filename": f"/src/mod{i % 50}.py", "line": i, "name": f"f{i}"} for i in range(n_frames)]
    entries = []
    for i in range(n_entries):
        entries.append({"action": "alloc", "addr": 4096 * i, "size": 512, "stream": 0, "frames": frames})
        entries.append({"action": "free_completed", "addr": 4096 * i, "size": 512, "stream": 0, "frames": frames})
    return {"segments": [], "device_traces": [entries]}


def test_shared_frame_list_is_walked_once(monkeypatch):
    """A frame list shared by every entry (a pickle memo reference) costs its length once, not per entry."""
    calls = []
    real = columns._frame_key
    monkeypatch.setattr(columns, "_frame_key", lambda f: calls.append(1) or real(f))
    doc = _shared_frames_snapshot(1000, 500)
    trace = tracekit.io.to_trace(doc, "shared")
    assert len(calls) == 1000  # one walk of the list, not 1000 x 1000 entries
    assert len(trace.stacks) == 2 and len(trace.stack(int(trace.events.stack_id[0]))) == 1000
    assert (trace.events.stack_id == trace.events.stack_id[0]).all()


def test_shared_frame_bomb_is_linear(tmp_path):
    p = tmp_path / "shared.pickle.gz"
    p.write_bytes(gzip.compress(pickle.dumps(_shared_frames_snapshot(10000, 5000), protocol=4)))
    assert p.stat().st_size < 400_000
    code, err, rss, took = run_limited("report", p, "--no-cache")
    assert code == 0, err
    assert took < 30, f"{took:.1f} s (quadratic interning took minutes)"


def _deep_pickle(key, depth):
    """{'segments': [], key: [[[...]]]} nested `depth` deep, built opcode by opcode (pickle.dumps recurses)."""
    def s(text):
        b = text.encode()
        return b"X" + len(b).to_bytes(4, "little") + b
    deep = b"]" * depth + b"a" * (depth - 1)
    return b"\x80\x02}(" + s("segments") + b"]" + s(key) + deep + b"u."


@pytest.mark.parametrize("key", ["tracekit", "allocator_settings", "external_annotations"])
def test_deep_nesting_is_refused(tmp_path, key):
    p = tmp_path / "deep.pickle"
    p.write_bytes(_deep_pickle(key, 100_000))
    with pytest.raises(LoadError, match=f"'{key}' is nested more than 100 levels deep.*TRACEKIT_MAX_DEPTH"):
        tracekit.load(p, use_cache=False)


def test_deep_json_is_refused(tmp_path):
    p = tmp_path / "deep.json"
    p.write_text('{"segments": [], "tracekit": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(LoadError, match="nested too deeply"):
        tracekit.load(p, use_cache=False)


def test_depth_override(tmp_path, monkeypatch):
    p = tmp_path / "d.pickle"
    settings = {}
    cur = settings
    for _ in range(150):
        cur["x"] = {}
        cur = cur["x"]
    p.write_bytes(pickle.dumps({"segments": [], "allocator_settings": settings}))
    with pytest.raises(LoadError, match="TRACEKIT_MAX_DEPTH"):
        tracekit.load(p, use_cache=False)
    monkeypatch.setenv("TRACEKIT_MAX_DEPTH", "1000")
    assert tracekit.load(p, use_cache=False).meta["allocator_settings"] == settings


def test_self_containing_metadata_is_refused(tmp_path):
    loop = []
    loop.append(loop)
    p = tmp_path / "loop.pickle"
    p.write_bytes(pickle.dumps({"segments": [], "tracekit": {"settings": {"x": loop}}}))
    with pytest.raises(LoadError, match="'tracekit' contains itself"):
        tracekit.load(p, use_cache=False)


def test_shared_metadata_is_fine(tmp_path):
    shared = {"a": [1, 2]}
    p = tmp_path / "shared.pickle"
    p.write_bytes(pickle.dumps({"segments": [], "tracekit": {"settings": {"x": shared, "y": shared}}}))
    assert tracekit.load(p, use_cache=False).recorder["settings"]["y"] == shared


def test_deep_tuple_action_is_not_hashed(tmp_path):
    """Hashing a 1M-deep tuple overflows CPython's C stack; an action that is not a string never gets hashed."""
    deep = b"N" + b"\x85" * 1_000_000
    entry = b"}(" + b"X\x06\x00\x00\x00action" + deep + b"u"
    data = b"\x80\x02}(X\x08\x00\x00\x00segments]X\x0d\x00\x00\x00device_traces](" + b"](" + entry + b"ee" + b"u."
    p = tmp_path / "tuple.pickle"
    p.write_bytes(data)
    code, err, rss, took = run_limited("info", p, "--no-cache")
    assert code == 2 and "action=" in err and "not a string" in err


def test_real_files_open_within_the_default_limits():
    for name in ("snapshot_cpp_frames_adamw_full_step.pickle", "kineto_trace_memory_v100_rank1.json.gz"):
        assert replay(tracekit.load(fixture(name), use_cache=False))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the memory limit is an RLIMIT_AS, Linux only")
def test_the_limit_is_held_only_while_reading(tmp_path):
    import resource
    import threading

    before = resource.getrlimit(resource.RLIMIT_AS)
    bomb = tmp_path / "memo.pickle"
    bomb.write_bytes(b"\x80\x02N" + b"r" + (2**26).to_bytes(4, "little") + b".")  # asks for a 1 GiB memo
    with pytest.raises(LoadError, match="TRACEKIT_MAX_MEMORY_MB"):
        tracekit.load(bomb, use_cache=False)
    assert resource.getrlimit(resource.RLIMIT_AS) == before
    errors = []

    def open_one(name):
        try:
            tracekit.load(fixture(name), use_cache=False)
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=open_one, args=(n,)) for n in
               ("snapshot_cpp_frames_adamw_full_step.pickle", "kineto_trace_memory_torch19_resnet50.json.gz",
                "snapshot_newest_format_windows_paths.pickle")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and resource.getrlimit(resource.RLIMIT_AS) == before
