#!/usr/bin/env python3
"""Opening speed: `tracekit report --json` against the floor (DESIGN.md §9).

Makes a 1,000,000-entry snapshot from a real fixture with
../shared/bench/tile_snapshot.py (kept in bench/out/), then measures in one run,
each in a fresh process, the median of --repeat runs of:

  floor        restricted unpickle of the file (nothing else)
  first open   tracekit report --json with an empty cache (parses, writes the cache)
  first, py    the same with TRACEKIT_READER=python (the restricted unpickler, not the streaming reader)
  second open  tracekit report --json again (reads the columnar cache)
  window       tracekit report --json --last 1s from the cache (issue 15's window selection)
  window, cold the same with no cache (two passes of the scanner: the last time, then only the
               window's entries are kept, the rest folded into per-device sums)
  range, cold  tracekit report --json --from N/2 --to N/2+N/10 with no cache (one pass, keeping a
               tenth of the entries)

With --json, the same rows for a JSON copy of the file (memory_viz's format; made once, beside it),
against the floor of json.loads of that copy.

and prints wall time and peak memory (max RSS) as ratios to the floor.
Targets (issue 15): first ≤ 0.5× time and ≤ 0.3× memory; second ≤ 0.05× time.

With --profile, instead: one first open (`report --json --no-cache`'s work) stage by stage in a fresh
process (bench/profile_open.py): wall time, the peak memory during each stage and what is held after
it, beside the floor's.

Usage: python bench/bench_open.py [--entries 1000000] [--repeat 3] [--json] [--profile]
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
SHARED = next((p / "shared" for p in ROOT.parents if (p / "shared/bench").is_dir()), ROOT.parent / "shared")
SOURCE = SHARED / "fixtures/real/snapshot_newest_format_windows_paths.pickle"
FLOOR = ("import sys; from tracekit.io.unpickle import restricted_load; "
         "f = open(sys.argv[1], 'rb'); restricted_load(f)")
JSON_FLOOR = "import sys, json; json.loads(open(sys.argv[1], 'rb').read().decode())"
TO_JSON = ("import sys, json; from tracekit.io.unpickle import restricted_load; "
           "open(sys.argv[2], 'w').write(json.dumps(restricted_load(open(sys.argv[1], 'rb'))))")


def run(cmd, env=None):
    """Wall seconds and max RSS (MiB) of one child process; fails loudly if it fails."""
    t = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t
    if status != 0:
        raise SystemExit(f"{' '.join(map(str, cmd))} failed: {p.stderr.read().decode()}")
    return wall, usage.ru_maxrss / 1024


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--entries", type=int, default=1_000_000)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", action="store_true", help="measure a JSON copy of the file instead")
    ap.add_argument("--profile", action="store_true",
                    help="time and peak memory of each stage of one first open (bench/profile_open.py)")
    args = ap.parse_args()
    out = ROOT / "bench/out"
    out.mkdir(parents=True, exist_ok=True)
    big = out / f"tiled_{args.entries}.pickle"
    if not big.exists():
        subprocess.run([sys.executable, str(SHARED / "bench/tile_snapshot.py"), str(SOURCE), str(big),
                        "--entries", str(args.entries)], check=True)
    floor_code = FLOOR
    if args.json:
        pickled, big, floor_code = big, big.with_suffix(".json"), JSON_FLOOR
        if not big.exists():
            subprocess.run([sys.executable, "-c", TO_JSON, str(pickled), str(big)], check=True, cwd=ROOT)
    if args.profile:
        return profile(big, floor_code, args.entries)
    report = [sys.executable, "-m", "tracekit.cli", "report", "--json", str(big)]
    floor, first, first_py, second, window, cold, cold_range = [], [], [], [], [], [], []
    middle = ["--from", str(args.entries // 2), "--to", str(args.entries // 2 + args.entries // 10)]
    for _ in range(args.repeat):
        floor.append(run([sys.executable, "-c", floor_code, str(big)]))
        with tempfile.TemporaryDirectory() as cache:
            env = dict(os.environ, TRACEKIT_CACHE_DIR=cache)
            first_py.append(run(report + ["--no-cache"], dict(env, TRACEKIT_READER="python")))
            first.append(run(report, env))
            second.append(run(report, env))
            window.append(run(report + ["--last", "1s"], env))
            cold.append(run(report + ["--last", "1s", "--no-cache"], env))
            cold_range.append(run(report + middle + ["--no-cache"], env))

    def med(rows, i):
        return statistics.median(r[i] for r in rows)

    f_t, f_m = med(floor, 0), med(floor, 1)
    print(f"file: {big} ({big.stat().st_size / 2**20:.0f} MiB, {args.entries} entries), median of {args.repeat}")
    print(f"{'':14}{'seconds':>9}{'x floor':>9}{'max RSS MiB':>13}{'x floor':>9}  target")
    print(f"{'floor':14}{f_t:9.2f}{1:9.2f}{f_m:13.0f}{1:9.2f}")
    for name, rows, target in (("first open", first, "issue 15: <= 0.5x time, <= 0.3x memory"),
                               ("first, py", first_py, "the restricted unpickler's path"),
                               ("second open", second, "issue 15: <= 0.05x time"),
                               ("window --last", window, "cached; the analysis covers only the window"),
                               ("window, cold", cold, "only the window kept while reading"),
                               ("range, cold", cold_range, "a tenth of the entries kept while reading")):
        t, m = med(rows, 0), med(rows, 1)
        print(f"{name:14.14}{t:9.2f}{t / f_t:9.2f}{m:13.0f}{m / f_m:9.2f}  {target}")


FLOOR_MAX_ENTRIES = 2_000_000  # above this the floor's unpickle (about 0.9 GB per 1M entries) is scaled, not run


def profile(big, floor_code, entries):
    """One first open stage by stage (bench/profile_open.py), beside one run of the floor. Above
    FLOOR_MAX_ENTRIES the floor is measured on a 1M-entry file and scaled by the entries (the unpickle of
    10M entries would take 8.6 GB; its memory grows in proportion, its time about so), and says so."""
    import json

    scale, floor_file = 1.0, big
    if entries > FLOOR_MAX_ENTRIES and floor_code == FLOOR:
        floor_file = big.parent / "tiled_1000000.pickle"
        if not floor_file.exists():
            subprocess.run([sys.executable, str(SHARED / "bench/tile_snapshot.py"), str(SOURCE), str(floor_file),
                            "--entries", "1000000"], check=True)
        scale = entries / 1_000_000
    f_t, f_m = run([sys.executable, "-c", floor_code, str(floor_file)])
    f_t, f_m = f_t * scale, f_m * scale
    if scale != 1.0:
        print(f"floor: measured on {floor_file.name}, scaled x{scale:g} (not run on {entries} entries)")
    p = subprocess.run([sys.executable, str(ROOT / "bench/profile_open.py"), str(big)], capture_output=True,
                       text=True, cwd=ROOT)
    if p.returncode:
        raise SystemExit(f"profile_open.py failed: {p.stderr}")
    rows = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    print(f"file: {big} ({big.stat().st_size / 2**20:.0f} MiB, {entries} entries); floor {f_t:.2f} s, {f_m:.0f} MiB")
    print(f"{'stage':18}{'seconds':>9}{'x floor':>9}{'peak MiB':>10}{'x floor':>9}{'held MiB':>10}")
    for r in rows:
        peak = "" if r["peak_mib"] is None else f"{r['peak_mib']:10.0f}{r['peak_mib'] / f_m:9.2f}"
        print(f"{r['stage']:18}{r['seconds']:9.2f}{r['seconds'] / f_t:9.2f}{peak:>19}{r['held_mib']:10.0f}")


if __name__ == "__main__":
    main()
