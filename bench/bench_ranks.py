#!/usr/bin/env python3
"""Many ranks: `tracekit report DIR` over --ranks rank files, against the floor, in one run.

Makes one rank file by tiling a real snapshot to --entries entries
(../shared/bench/tile_snapshot.py), copies it to run.rank0..N-1.pickle (in
bench/out/ranks_N_E/), and measures, each in a fresh process, the median of
--repeat runs of:

  floor          restricted unpickle of every file, one after another (reading them, nothing else)
  one process    report DIR --no-summaries --no-cache --jobs 1 (parse and analyse every file)
  pool           report DIR --no-summaries --no-cache (a process per core)
  summaries      report DIR, reading the summary beside each file (what the recorder writes)

and prints wall seconds, files per second, the largest process's max RSS,
and time as a ratio to the floor. The summaries are written first, as each
rank's recorder does (record/rank_summary.py): that cost is per rank, paid
on the rank at the end of its recording, and printed per file.

Usage: python bench/bench_ranks.py [--ranks 64] [--entries 20000] [--repeat 3]
"""
from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# ../shared beside the checkout (or beside the folder of worktrees holding it)
SHARED = next((p / "shared" for p in ROOT.parents if (p / "shared/bench/tile_snapshot.py").exists()),
              ROOT.parent / "shared")
SOURCE = ROOT / "tests/fixtures/real/snapshot_newest_format_windows_paths.pickle"
FLOOR = ("import sys; from tracekit.io.unpickle import restricted_load\n"
         "for p in sys.argv[1:]:\n    restricted_load(open(p, 'rb'))")
SUMMARIZE = ("import sys, time; from tracekit.io import load; from tracekit.analysis.ranks import summarize; "
             "from tracekit.io.rank_files import write_summary\n"
             "t = time.perf_counter()\n"
             "for p in sys.argv[1:]:\n    write_summary(p, summarize(load(p, use_cache=False)))\n"
             "print((time.perf_counter() - t) / len(sys.argv[1:]))")


def run(cmd, env=None):
    """Wall seconds and max RSS (MiB) of one child process (and the largest of its children)."""
    t = time.perf_counter()
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t
    out = p.stdout.read().decode()
    if status != 0:
        raise SystemExit(f"{' '.join(map(str, cmd[:6]))} ... failed: {p.stderr.read().decode()}")
    return wall, usage.ru_maxrss / 1024, out


def make_job(ranks, entries) -> Path:
    out = ROOT / "bench/out"
    one = out / f"tiled_{entries}.pickle"
    if not one.exists():
        out.mkdir(parents=True, exist_ok=True)
        subprocess.run([sys.executable, str(SHARED / "bench/tile_snapshot.py"), str(SOURCE), str(one),
                        "--entries", str(entries)], check=True)
    job = out / f"ranks_{ranks}_{entries}"
    if job.exists():
        shutil.rmtree(job)
    job.mkdir()
    for r in range(ranks):
        shutil.copyfile(one, job / f"run.rank{r}.pickle")
    return job


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, default=64)
    ap.add_argument("--entries", type=int, default=20_000)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    job = make_job(args.ranks, args.entries)
    files = sorted(str(p) for p in job.glob("run.rank*.pickle"))
    report = [sys.executable, "-m", "tracekit.cli", "report", "--json", str(job)]
    rows = {k: [] for k in ("floor", "one process", "pool", "summaries")}
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, TRACEKIT_CACHE_DIR=cache)
        per_rank = float(run([sys.executable, "-c", SUMMARIZE, *files], env)[2])
        for _ in range(args.repeat):
            rows["floor"].append(run([sys.executable, "-c", FLOOR, *files], env))
            rows["one process"].append(run(report + ["--no-summaries", "--no-cache", "--jobs", "1"], env))
            rows["pool"].append(run(report + ["--no-summaries", "--no-cache"], env))
            rows["summaries"].append(run(report, env))

    def med(name, i):
        return statistics.median(r[i] for r in rows[name])

    size = os.path.getsize(files[0])
    print(f"{args.ranks} rank files of {size / 2**20:.1f} MiB ({args.entries} entries) in {job}; "
          f"{os.cpu_count()} cores; median of {args.repeat}")
    print(f"summary per rank (what each rank's recorder spends at the end): {per_rank:.2f} s, "
          f"{os.path.getsize(files[0] + '.summary.json') / 1024:.0f} KiB")
    f_t = med("floor", 0)
    print(f"{'':13}{'seconds':>9}{'files/s':>9}{'x floor':>9}{'max RSS MiB':>13}")
    for name in rows:
        t, m = med(name, 0), med(name, 1)
        print(f"{name:13}{t:9.2f}{args.ranks / t:9.1f}{t / f_t:9.2f}{m:13.0f}")


if __name__ == "__main__":
    main()
