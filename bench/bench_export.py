#!/usr/bin/env python3
"""Exports and tables against the floor (the restricted unpickle of the same file), in one run.

Makes (or reuses) the 1,000,000-entry tiled snapshot of bench_open.py, then
measures, each in a fresh process with an empty cache, the median of
--repeat runs of:

  floor          restricted unpickle of the file
  memory-viz     tracekit export FILE --memory-viz OUT.pickle
  allocations    tracekit export FILE --allocations OUT.csv
  query          tracekit query FILE "SELECT category, sum(size) FROM allocations GROUP BY 1"

and prints wall time and peak memory (max RSS) as ratios to the floor.

Usage: python bench/bench_export.py [--entries 1000000] [--repeat 3]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_open import FLOOR, ROOT, SHARED, SOURCE, run  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--entries", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    out = ROOT / "bench/out"
    out.mkdir(parents=True, exist_ok=True)
    big = out / f"tiled_{args.entries}.pickle"
    if not big.exists():
        subprocess.run([sys.executable, str(SHARED / "bench/tile_snapshot.py"), str(SOURCE), str(big),
                        "--entries", str(args.entries)], check=True)
    tk = [sys.executable, "-m", "tracekit.cli"]
    with tempfile.TemporaryDirectory() as tmp:
        cases = {
            "floor": [sys.executable, "-c", FLOOR, str(big)],
            "memory-viz": tk + ["export", str(big), "--no-cache", "--memory-viz", os.path.join(tmp, "viz.pickle")],
            "allocations": tk + ["export", str(big), "--no-cache", "--allocations", os.path.join(tmp, "a.csv")],
            "query": tk + ["query", str(big), "--no-cache", "SELECT category, sum(size) FROM allocations GROUP BY 1"],
        }
        got = {name: [] for name in cases}
        for _ in range(args.repeat):
            for name, cmd in cases.items():
                got[name].append(run(cmd, env=dict(os.environ, TRACEKIT_CACHE_DIR=os.path.join(tmp, "cache"))))
    floor_t = statistics.median(t for t, _ in got["floor"])
    floor_m = statistics.median(m for _, m in got["floor"])
    print(f"{big.name}: {args.entries:,} entries, median of {args.repeat}")
    for name, runs in got.items():
        t, m = statistics.median(x for x, _ in runs), statistics.median(x for _, x in runs)
        print(f"  {name:12} {t:7.2f} s ({t / floor_t:4.2f}x floor)  {m:7.0f} MiB ({m / floor_m:4.2f}x floor)")


if __name__ == "__main__":
    main()
