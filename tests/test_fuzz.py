"""Seeded mutation fuzzing over the real fixtures and samples: byte-level and structural, pickle and JSON,
plain and gzip'd. Every case must end in exit 0 or 2 with one line on stderr — never a traceback, never the
guard's "this is a bug" fallback (each wrong shape has its own message) — within time and memory limits,
and a cached reopen must print exactly what the first open printed.

Runs in-process through the same entry the CLI uses (`tracekit.cli.main`), plus a subprocess sample for the
exit-code path. TRACEKIT_FUZZ_CASES and TRACEKIT_FUZZ_SEED choose how many cases and which.
"""
import contextlib
import copy
import gzip
import io
import json
import os
import pickle
import random
import reprlib
import resource
import subprocess
import sys
import time
from functools import lru_cache
from pathlib import Path

import pytest

from tracekit.cli import main
from tracekit.io.unpickle import restricted_load

from .conftest import FIXTURES, SAMPLES

CASES = int(os.environ.get("TRACEKIT_FUZZ_CASES", "300"))
SEED = int(os.environ.get("TRACEKIT_FUZZ_SEED", "20261123"))
CASE_SECONDS = 20  # no single case may take longer (the slowest honest one takes well under 1 s)


def _read(path):
    data = path.read_bytes()
    if data[:2] == b"\x1f\x8b":
        data = gzip.decompress(data)
    return json.loads(data) if data.lstrip()[:1] in b"{[" else restricted_load(io.BytesIO(data))


def _shrink(obj):
    """A smaller document of the same shape, so each case runs in milliseconds."""
    if isinstance(obj, dict) and "segments" in obj:
        out = dict(obj)
        out["segments"] = obj["segments"][:12]
        if isinstance(obj.get("device_traces"), list):
            out["device_traces"] = [t[-250:] for t in obj["device_traces"]]
        return out
    if isinstance(obj, dict) and "traceEvents" in obj:
        ev = obj["traceEvents"]
        mem = [e for e in ev if isinstance(e, dict) and e.get("name") == "[memory]"][:250]
        rest = [e for e in ev if not (isinstance(e, dict) and e.get("name") == "[memory]")][:50]
        return {k: v for k, v in obj.items() if k != "traceEvents"} | {"traceEvents": rest + mem}
    return obj[:250] if isinstance(obj, list) else obj


@lru_cache(maxsize=None)
def seeds():
    files = sorted(p for p in FIXTURES.iterdir() if p.suffix in (".pickle", ".gz")) + sorted(SAMPLES.glob("*.pickle"))
    return [(p.name, _shrink(_read(p))) for p in files]


def _deep(n):
    x = []
    for _ in range(n):
        x = [x]
    return x


WEIRD = [None, True, False, -1, 0, 1, 2**31, 2**62, 2**63 - 1, 2**63, 2**64, -2**63, 2**70, -2**70, 1.5, -0.0,
         float("inf"), float("-inf"), float("nan"), "", "x", "alloc", "oom", "free_completed", "START", [], {},
         [[]], [{}], {"a": 1}, [1, 2, 3], "9" * 50, {"filename": [], "line": "x", "name": None}]
PICKLE_ONLY = [(1, 2), b"bytes", frozenset({1}), {1, 2}, {(1, 2): 3}, 10**5000]
KEYS = ["segments", "device_traces", "blocks", "action", "addr", "size", "frames", "address", "total_size",
        "state", "device", "time_us", "stream", "device_free", "requested_size", "history", "tracekit",
        "allocator_settings", "external_annotations", "user_metadata", "traceEvents", "args", "Bytes", "ts",
        "Addr", "Total Allocated", "Total Reserved", "Device Type", "Device Id", "name", "stage", "phases",
        "iterations", "tags", "start_us", "end_us", "kind", "backend", "model", "devices", "segment_pool_id"]


def _containers(obj, rng, limit=6):
    """A random chain of (container, key) from the root down."""
    path, cur = [], obj
    for _ in range(rng.randint(1, limit)):
        if isinstance(cur, dict) and cur:
            k = rng.choice(list(cur))
        elif isinstance(cur, list) and cur:
            k = rng.randrange(len(cur))
        else:
            break
        path.append((cur, k))
        cur = cur[k]
    return path


def _short(v):
    try:
        return reprlib.repr(v)[:50]
    except ValueError:  # an int too long to print
        return "?"


def mutate_structure(obj, rng, as_pickle):
    obj = copy.deepcopy(obj)
    weird = WEIRD + (PICKLE_ONLY if as_pickle else [])
    for _ in range(rng.choice([1, 1, 1, 2, 3])):
        path = _containers(obj, rng)
        if not path:
            return rng.choice(weird)
        parent, key = path[-1]
        op = rng.random()
        if op < 0.45:
            parent[key] = copy.deepcopy(rng.choice(weird))
        elif op < 0.55 and isinstance(parent, dict):
            del parent[key]
        elif op < 0.65 and isinstance(parent, dict):
            parent[rng.choice(KEYS)] = copy.deepcopy(rng.choice(weird))
        elif op < 0.72:
            parent[key] = _deep(rng.choice([50, 3000]))
        elif op < 0.8 and isinstance(parent[key], list):
            parent[key] = parent[key] * rng.randint(2, 50)  # shared references, as a memo'd pickle has them
        elif op < 0.86:
            v = parent[key]
            parent[key] = tuple(v) if isinstance(v, list) else [v] if not isinstance(v, dict) else list(v.items())
        elif op < 0.93 and isinstance(parent, list):
            parent.insert(rng.randrange(len(parent) + 1), copy.deepcopy(rng.choice(weird)))
        else:
            parent[key] = copy.deepcopy(rng.choice(list(seeds()))[1]) if rng.random() < 0.1 else _short(parent[key])
    return obj


def mutate_bytes(data, rng):
    data = bytearray(data)
    for _ in range(rng.randint(1, 6)):
        if not data:
            break
        op, pos = rng.random(), rng.randrange(len(data))
        if op < 0.4:
            data[pos] = rng.randrange(256)
        elif op < 0.55:
            del data[pos:pos + rng.randint(1, 64)]
        elif op < 0.7:
            data[pos:pos] = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
        elif op < 0.8:
            chunk = data[pos:pos + rng.randint(1, 200)]
            data[pos:pos] = chunk * rng.randint(1, 5)
        else:
            del data[rng.randrange(len(data) + 1):]
    return bytes(data)


def _json_safe(o):
    """What JSON can hold: tuples become lists, non-string keys are dropped, sets and bytes go."""
    if isinstance(o, dict):
        return {k: _json_safe(v) for k, v in o.items() if isinstance(k, str)}
    if isinstance(o, (list, tuple)):
        return [_json_safe(v) for v in o]
    if isinstance(o, (set, frozenset, bytes)):
        return None
    if isinstance(o, int) and not isinstance(o, bool) and abs(o) > 10**300:
        return 0
    return o


def make_case(i):
    rng = random.Random(SEED * 100003 + i)
    name, seed_obj = rng.choice(seeds())
    as_pickle = rng.random() < 0.6
    structural = rng.random() < 0.7
    obj = mutate_structure(seed_obj, rng, as_pickle) if structural else seed_obj
    try:
        data = (pickle.dumps(obj, protocol=rng.choice([0, 2, 4, 5])) if as_pickle
                else json.dumps(_json_safe(obj)).encode())
    except (RecursionError, ValueError):
        data = pickle.dumps([], protocol=4)
    if not structural or rng.random() < 0.15:
        data = mutate_bytes(data, rng)
    if rng.random() < 0.25:
        data = gzip.compress(data, compresslevel=1)
        if rng.random() < 0.3:
            data = mutate_bytes(data, rng)
    kind = ("pickle" if as_pickle else "json") + ("-structural" if structural else "-bytes")
    return f"case{i}-{name}-{kind}", data, rng.choice(["report", "info", "check"])


def _final(err):
    """stderr without the progress bar a slow open draws (each redraw ends in \r)."""
    return err.rsplit("\r", 1)[-1]


def run_cli(*args):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as e:
            code = e.code
    return code or 0, out.getvalue(), err.getvalue()


def _command(cmd, path):
    if cmd == "check":
        return ["check", str(path), "--max-peak", "1GiB", "--json"]
    return [cmd, str(path), "--json"]


def test_fuzz_mutations(tmp_path, monkeypatch):
    monkeypatch.delenv("TRACEKIT_DEBUG", raising=False)
    outcomes = {0: 0, 1: 0, 2: 0}
    slowest = 0.0
    for i in range(CASES):
        label, data, cmd = make_case(i)
        path = tmp_path / f"{label}.bin"
        path.write_bytes(data)
        t0 = time.monotonic()
        code, out, err = run_cli(*_command(cmd, path))
        took = time.monotonic() - t0
        slowest = max(slowest, took)
        where = f"{label} ({cmd}, reproduce: TRACEKIT_FUZZ_SEED={SEED}, case {i})"
        assert took < CASE_SECONDS, f"{where} took {took:.1f} s"
        assert code in (0, 1, 2) and (code != 1 or cmd == "check"), f"{where}: exit {code}\n{err}"
        assert "Traceback" not in err, f"{where}: {err}"
        err = _final(err)
        if code == 2:
            assert err.startswith("tracekit: ") and err.count("\n") == 1, f"{where}: {err!r}"
            assert "this is a bug" not in err, f"{where}: a wrong shape without its own message: {err}"
        else:
            again = run_cli(*_command(cmd, path))  # the first open wrote the cache; this one reads it
            assert again[:2] == (code, out) and _final(again[2]) == _final(err), f"{where}: the cached reopen differs"
        outcomes[code] += 1
        path.unlink()
    usage = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"\n{CASES} mutations: exit 0: {outcomes[0]}, exit 1 (over budget): {outcomes[1]}, "
          f"exit 2: {outcomes[2]}, 0 tracebacks; slowest {slowest:.2f} s; max RSS {usage / 2**20:.0f} MiB")
    assert usage < 3 * 2**30
    assert outcomes[0] + outcomes[1] > CASES // 10, "too few mutations still open: the fuzz is not exploring"


def test_fuzz_exit_codes_in_a_subprocess(tmp_path):
    """A sample through the real executable, under an address-space limit: exit 0 or 2, one line, in time."""
    paths = []
    for i in range(0, CASES, max(CASES // 8, 1)):
        label, data, _ = make_case(i)
        p = tmp_path / f"{label}.bin"
        p.write_bytes(data)
        paths.append(p)

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (3 * 2**30, resource.RLIM_INFINITY))

    for p in paths:
        r = subprocess.run([sys.executable, "-m", "tracekit.cli", "info", str(p)], capture_output=True, text=True,
                           timeout=60, preexec_fn=limit, env={**os.environ, "TRACEKIT_DEBUG": ""})
        assert r.returncode in (0, 2), (p.name, r.returncode, r.stderr)
        assert "Traceback" not in r.stderr
        if r.returncode == 2:
            assert r.stderr.startswith("tracekit: ") and r.stderr.count("\n") == 1, r.stderr


@pytest.mark.parametrize("i", range(3))
def test_mutations_are_deterministic(i):
    assert make_case(i) == make_case(i)


# -- structure-aware: valid snapshots whose values are odd ---------------------------------------------
# Each case is a small, valid snapshot (tests/synth.py's Sim) with one to three values replaced where the
# format puts them: sizes, addresses, times, devices, line numbers, names, frames, whole lists. Every case
# must end in exit 0 or 2 (one line, never "this is a bug") in under ODD_SECONDS. A case that once failed is
# kept, small, under tests/fixtures/fuzz/ and replayed by test_kept_crashers.

ODD_CASES = int(os.environ.get("TRACEKIT_FUZZ_ODD_CASES", "60"))
ODD_SECONDS = 10
KEPT = Path(__file__).parent / "fixtures" / "fuzz"
ODD_VALUES = [2**64, 2**63, -(2**63) - 1, 10**30, -1, -(2**40), float("nan"), float("inf"), -0.0, 1e300, "12", "x" * 50_000,
              None, True, [], {}, [1, 2], {"a": 1}, b"\x00", 3.5, 0]


def _odd_base(rng):
    from .adversarial import frame, snapshot_with_stacks

    stacks = []
    for i in range(rng.randint(3, 12)):
        depth = rng.choice([1, 3, 8])
        stacks.append([frame(f"/home/u/m{i % 3}.py", 10 + k, "forward") for k in range(depth)]
                      + [frame("??", 0, "at::_ops::mm::call"), frame("/home/u/train.py", 5, "step")])
    return snapshot_with_stacks(stacks)


def _odd_places(snap):
    """(container, key) of every value a mutation may replace."""
    out = [(snap, "segments"), (snap, "device_traces")]
    for seg in snap["segments"]:
        out += [(seg, k) for k in seg]
        for b in seg["blocks"]:
            out += [(b, k) for k in b]
            for f in b["frames"]:
                out += [(f, k) for k in f]
    for trace in snap["device_traces"]:
        for e in trace:
            out += [(e, k) for k in e]
            for f in e.get("frames", []):
                out += [(f, k) for k in f]
            out.append((e.get("frames", []), None))
    return out


def make_odd_case(i):
    from .adversarial import deep_forwards, device_without_entries, frame

    rng = random.Random(SEED * 7919 + i)
    shape = rng.random()
    if shape < 0.08:
        snap = deep_forwards(depth=rng.choice([300, 1200, 3000]))
    else:
        snap = _odd_base(rng)
    if rng.random() < 0.15:
        snap = device_without_entries(snap)
    places = _odd_places(snap)
    for _ in range(rng.choice([1, 1, 2, 3])):
        parent, key = rng.choice(places)
        op = rng.random()
        if key is None:  # a frame list
            if op < 0.5:
                parent.extend([frame("/home/u/m.py", rng.choice([2**31, -7, 10**12]), "forward")] * rng.randint(1, 400))
            else:
                parent.insert(0, frame("x" * rng.choice([5000, 60_000]), 1, "y" * rng.choice([5000, 60_000])))
        elif op < 0.7:
            parent[key] = copy.deepcopy(rng.choice(ODD_VALUES))
        elif op < 0.8 and isinstance(parent, dict):
            del parent[key]
        elif op < 0.9:
            parent[key] = _deep(rng.choice([50, 400]))  # past TRACEKIT_MAX_DEPTH, within what pickle writes
        else:
            parent[key] = "Backward0::apply" * rng.choice([10, 5000]) if isinstance(parent.get(key), str) \
                else rng.choice([2**62, -(2**62)])
    return f"odd{i}", pickle.dumps(snap, protocol=4)


def _check_one(path, where):
    t0 = time.monotonic()
    code, out, err = run_cli("report", str(path), "--json", "--no-cache")
    took = time.monotonic() - t0
    assert took < ODD_SECONDS, f"{where} took {took:.1f} s"
    assert "Traceback" not in err, f"{where}: {err}"
    lines = [ln for ln in _final(err).splitlines() if not ln.startswith("tracekit: warning: ")]
    assert code in (0, 2), f"{where}: exit {code}\n{err}"
    if code == 2:
        assert len(lines) == 1 and lines[0].startswith("tracekit: "), f"{where}: {err!r}"
        assert "this is a bug" not in err, f"{where}: {err}"
    else:
        json.loads(out)
    return code


def test_fuzz_odd_values(tmp_path, monkeypatch):
    monkeypatch.delenv("TRACEKIT_DEBUG", raising=False)
    codes = {0: 0, 2: 0}
    for i in range(ODD_CASES):
        label, data = make_odd_case(i)
        p = tmp_path / f"{label}.pickle"
        p.write_bytes(data)
        codes[_check_one(p, f"{label} (reproduce: TRACEKIT_FUZZ_SEED={SEED}, odd case {i})")] += 1
        p.unlink()
    print(f"\n{ODD_CASES} odd-value snapshots: exit 0: {codes[0]}, exit 2: {codes[2]}")
    assert codes[0] > ODD_CASES // 4, "too few odd cases still open: the fuzz is not exploring"


@pytest.mark.parametrize("path", sorted(KEPT.glob("*.pickle*")), ids=lambda p: p.name)
def test_kept_crashers(path, monkeypatch):
    """Files that once ended in "this is a bug" (or took minutes): now exit 0 or 2, in time."""
    monkeypatch.delenv("TRACEKIT_DEBUG", raising=False)
    _check_one(path, path.name)


def test_odd_cases_are_deterministic():
    assert make_odd_case(5) == make_odd_case(5)
