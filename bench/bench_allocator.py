#!/usr/bin/env python3
"""What the caching-allocator replay (issue 24) costs when a file is opened, against the open itself.

Builds a 1,000,000-entry snapshot from a real one by repeating its trace (kept in bench/out/), then
measures in one run, each in a fresh process, the median of --repeat runs of:

  floor           restricted unpickle of the file (nothing else)
  report, off     tracekit report --json --no-cache with the model turned off (TRACEKIT_ALLOCATOR=off):
                  the open time before issue 24
  report          the same with the model (the compiled replay when built)
  report, py      the same with the model's Python loop (TRACEKIT_ALLOCATOR=python)

and, in one process, the replay alone (compiled.replay_device, then model_replay.replay_device_in_python) against
tracekit.load alone. Prints seconds and ratios; the target is "report" - "report, off" <= 0.3x "report, off".

The repetitions are the source's balanced trace at the SAME addresses (each repetition frees what it
allocates, so the allocator ends each one in the state it began with and the file stays consistent; the
replay places every block). ../shared/bench/tile_snapshot.py instead moves every repetition to fresh
addresses outside any segment, which the model can only count as not placed; --shifted measures that file
too (the model's slow path: every alloc resynchronised).

Usage: python bench/bench_allocator.py [--entries 1000000] [--repeat 3] [--shifted]
"""
from __future__ import annotations

import argparse
import os
import pickle
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = next((p / "shared" for p in ROOT.parents if (p / "shared/bench").is_dir()), ROOT.parent / "shared")
SOURCE = SHARED / "fixtures/real/snapshot_newest_format_windows_paths.pickle"
FLOOR = ("import sys; from tracekit.io.unpickle import restricted_load; "
         "f = open(sys.argv[1], 'rb'); restricted_load(f)")
INPROC = """
import sys, time
from tracekit.io import load
from tracekit.analysis.allocator import compiled, model_replay
t0 = time.perf_counter(); trace = load(sys.argv[1], use_cache=False); t1 = time.perf_counter()
r = compiled.replay_device(trace, trace.devices[0]); t2 = time.perf_counter()
p = model_replay.replay_device_in_python(trace, trace.devices[0]); t3 = time.perf_counter()
print(t1 - t0, t2 - t1, t3 - t2, r.engine, r.placed, r.unplaced_events, r.peak_allocated == p.peak_allocated)
"""


def run(cmd, env=None):
    t = time.perf_counter()
    p = subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    if p.returncode:
        raise SystemExit(f"{' '.join(map(str, cmd))} failed: {p.stderr.decode()[-500:]}")
    return time.perf_counter() - t


def same_address_tiling(source: Path, out: Path, entries: int):
    sys.path.insert(0, str(SHARED / "bench"))
    from tile_snapshot import _Restricted, balanced_prefix

    snap = _Restricted(open(source, "rb")).load()
    rep = balanced_prefix(snap["device_traces"][0])
    k = -(-entries // len(rep))
    snap["device_traces"][0] = [dict(e) for _ in range(k) for e in rep]
    with open(out, "wb") as f:
        pickle.dump(snap, f, protocol=4)


def measure(big: Path, repeat: int):
    report = [sys.executable, "-m", "tracekit.cli", "report", "--json", "--no-cache", str(big)]
    rows = {"floor": [], "report, off": [], "report": [], "report, py": []}
    inproc = []
    for _ in range(repeat):
        rows["floor"].append(run([sys.executable, "-c", FLOOR, str(big)]))
        rows["report, off"].append(run(report, dict(os.environ, TRACEKIT_ALLOCATOR="off")))
        rows["report"].append(run(report))
        rows["report, py"].append(run(report, dict(os.environ, TRACEKIT_ALLOCATOR="python")))
        out = subprocess.run([sys.executable, "-c", INPROC, str(big)], capture_output=True, text=True, check=True)
        inproc.append(out.stdout.split())
    med = {k: statistics.median(v) for k, v in rows.items()}
    off = med["report, off"]
    print(f"file: {big} ({big.stat().st_size / 2**20:.0f} MiB), median of {repeat}")
    print(f"{'':14}{'seconds':>9}{'x floor':>9}{'added x open':>14}")
    for name, t in med.items():
        added = "" if name in ("floor", "report, off") else f"{(t - off) / off:14.2f}"
        print(f"{name:14}{t:9.2f}{t / med['floor']:9.2f}{added}")
    load_t = statistics.median(float(r[0]) for r in inproc)
    fast_t = statistics.median(float(r[1]) for r in inproc)
    py_t = statistics.median(float(r[2]) for r in inproc)
    engine, placed, unplaced, agree = inproc[-1][3:]
    print(f"in one process: load {load_t:.2f} s; replay {fast_t:.2f} s ({engine}, {fast_t / load_t:.2f}x load), "
          f"Python replay {py_t:.2f} s ({py_t / load_t:.2f}x load); {placed} allocs placed, {unplaced} entries "
          f"not placed, compiled and Python peaks agree: {agree}")
    print(f"target (issue 24): the model adds <= 0.3x the open time: "
          f"{(med['report'] - off) / off:.2f}x with {engine}, {(med['report, py'] - off) / off:.2f}x in Python")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--entries", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--shifted", action="store_true", help="also the shared tiler's file (fresh addresses)")
    args = ap.parse_args()
    out = ROOT / "bench/out"
    out.mkdir(parents=True, exist_ok=True)
    big = out / f"same_address_{args.entries}.pickle"
    if not big.exists():
        same_address_tiling(SOURCE, big, args.entries)
    measure(big, args.repeat)
    if args.shifted:
        shifted = out / f"tiled_{args.entries}.pickle"
        if not shifted.exists():
            subprocess.run([sys.executable, str(SHARED / "bench/tile_snapshot.py"), str(SOURCE), str(shifted),
                            "--entries", str(args.entries)], check=True)
        print()
        measure(shifted, args.repeat)


if __name__ == "__main__":
    main()
