#!/usr/bin/env python3
"""What the cache's safety costs: the file's key and the entry checks, against the floor.

On a tiled snapshot (../shared/bench/tile_snapshot.py, 1M entries, about 119 MiB; kept in
bench/out/ as bench_open.py keeps it), in one process, the median of --repeat runs of:

  floor         restricted unpickle of the file (nothing else)
  key, cold     cache.key_for with no fingerprint remembered: SHA-256 of the whole file
  key, warm     cache.key_for by the remembered fingerprint (stat + both ends of the file)
  read          cache.read: map the entry, check its head, sampled CRCs and structure
  load cached   tracekit.load from the cache (key + read + setup)
  touch all     load cached, then sum every column (pages the whole entry in)

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
    import numpy as np

    import tracekit
    from tracekit.io.cache import folder as cachefiles
    from tracekit.io.cache import traces as cache
    from tracekit.io.unpickle import restricted_load

    path = str(big)
    st = os.stat(path)
    cachefiles.RACY_S = 0.0  # the tile may have been made a moment ago
    tracekit.load(path)  # fills the cache
    key = cache.key_for(path, st)

    def cold_key():
        for name in os.listdir(os.path.join(cache.cache_dir(), "fp")):
            os.unlink(os.path.join(cache.cache_dir(), "fp", name))
        cache.key_for(path, st)

    def touch_all():
        t = tracekit.load(path)
        for table in (t.events, t.frames, t.stacks, t.segments, t.blocks):
            for v in vars(table).values():
                if isinstance(v, np.ndarray):
                    v.sum()

    def floor():
        with open(path, "rb") as f:
            restricted_load(f)

    rows = [("floor", median_time(floor, max(args.repeat // 2, 1))),
            ("key, cold", median_time(cold_key, args.repeat)),
            ("key, warm", median_time(lambda: cache.key_for(path, st), args.repeat)),
            ("read", median_time(lambda: cache.read(key, path), args.repeat)),
            ("load cached", median_time(lambda: tracekit.load(path), args.repeat)),
            ("touch all", median_time(touch_all, args.repeat))]
    f = rows[0][1]
    print(f"{big.name}: {st.st_size / 2**20:.0f} MiB")
    for name, t in rows:
        print(f"  {name:12s} {t:8.4f} s  {t / f:7.4f}x floor")


if __name__ == "__main__":
    main()
