#!/usr/bin/env python3
"""What the cache's safety costs: the whole-file key and the entry checks, against the floor.

On a tiled snapshot (../shared/bench/tile_snapshot.py, 1M entries, about 119 MiB; kept in
bench/out/ as bench_open.py keeps it), in one process, the median of --repeat runs of:

  floor         restricted unpickle of the file (nothing else)
  key           cache.key_for: SHA-256 of the whole file
  read          cache.read: load the entry, check its digest and structure
  load cached   tracekit.load from the cache (key + read + setup)

printed in seconds and as ratios to the floor.

Usage: python bench/bench_cache.py [--entries 1000000] [--repeat 5]
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE = ROOT / "tests/fixtures/real/snapshot_newest_format_windows_paths.pickle"
TILER = ROOT.parent / "shared/bench/tile_snapshot.py"


def median_time(fn, repeat):
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--entries", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    out = ROOT / "bench/out"
    out.mkdir(parents=True, exist_ok=True)
    big = out / f"tiled_{args.entries}.pickle"
    if not big.exists():
        subprocess.run([sys.executable, str(TILER), str(SOURCE), str(big), "--entries", str(args.entries)],
                       check=True)
    os.environ["TRACEKIT_CACHE_DIR"] = tempfile.mkdtemp(prefix="tracekit-bench-cache-")
    import tracekit
    from tracekit.io import cache
    from tracekit.io.unpickle import restricted_load

    path = str(big)
    st = os.stat(path)
    tracekit.load(path)  # fills the cache
    key = cache.key_for(path, st)

    def floor():
        with open(path, "rb") as f:
            restricted_load(f)

    rows = [("floor", median_time(floor, max(args.repeat // 2, 1))),
            ("key", median_time(lambda: cache.key_for(path, st), args.repeat)),
            ("read", median_time(lambda: cache.read(key, path), args.repeat)),
            ("load cached", median_time(lambda: tracekit.load(path), args.repeat))]
    f = rows[0][1]
    print(f"{big.name}: {st.st_size / 2**20:.0f} MiB")
    for name, t in rows:
        print(f"  {name:12s} {t:7.3f} s  {t / f:6.3f}x floor")


if __name__ == "__main__":
    main()
