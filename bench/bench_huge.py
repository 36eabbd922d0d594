#!/usr/bin/env python3
"""Windows of a file larger than memory: peak memory (max RSS) and wall time of each command, one fresh
process each (os.wait4), run in order.

Usage: python bench/bench_huge.py FILE [--iterations A..B] [--from N --to M] [--last 1s] [--view] [--survey]

FILE: e.g. one made by `bench/make_huge.py SOURCE OUT --entries 100000000 --marks`. Rows:
  report --json --no-cache --last SPAN           two passes (the last time, then the window's entries)
  report --json --no-cache --iterations A..B     two passes (the runs of user_metadata, then the window)
  report --json --no-cache --from N --to M       one pass
  --survey: the viewer's quick pass before its window picker (tracekit.analysis.survey.survey)
  --view: tracekit view --no-cache --iterations A..B --screenshot (offscreen), the viewer opening that window
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
BIN = os.path.join(os.path.dirname(sys.executable), "tracekit")


def run(argv, env=None):
    t = time.perf_counter()
    p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    _, status, usage = os.wait4(p.pid, 0)
    wall = time.perf_counter() - t
    err = p.stderr.read().decode(errors="replace").strip().splitlines() if p.stderr else []
    p.stderr and p.stderr.close()
    return wall, usage.ru_maxrss / 1024, os.waitstatus_to_exitcode(status), err[-1:] if err else []


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("file")
    ap.add_argument("--iterations", default=None)
    ap.add_argument("--from", dest="lo", type=int, default=None)
    ap.add_argument("--to", dest="hi", type=int, default=None)
    ap.add_argument("--last", default="1s")
    ap.add_argument("--view", action="store_true")
    ap.add_argument("--survey", action="store_true")
    args = ap.parse_args()
    rows = [["report", "--json", "--no-cache", "--last", args.last, args.file]]
    if args.iterations:
        rows.append(["report", "--json", "--no-cache", "--iterations", args.iterations, args.file])
    if args.lo is not None:
        rows.append(["report", "--json", "--no-cache", "--from", str(args.lo), "--to", str(args.hi), args.file])
    print(f"{args.file}: {os.path.getsize(args.file):,} bytes")
    for argv in rows:
        wall, rss, rc, err = run([BIN, *argv])
        print(f"  tracekit {' '.join(argv[:-1])}: {wall:.1f} s, peak {rss:,.0f} MiB, exit {rc} {err}", flush=True)
    if args.survey:
        code = ("import sys; from tracekit.analysis.survey import survey; s = survey(sys.argv[1]); "
                "print(s, file=sys.stderr)")
        wall, rss, rc, err = run([sys.executable, "-c", code, args.file])
        print(f"  survey (the window picker's first pass): {wall:.1f} s, peak {rss:,.0f} MiB, exit {rc}", flush=True)
    if args.view and args.iterations:
        with tempfile.TemporaryDirectory() as tmp:
            png = os.path.join(tmp, "view.png")
            env = {**os.environ, "QT_QPA_PLATFORM": "offscreen"}
            argv = ["view", "--no-cache", "--iterations", args.iterations, "--screenshot", png, args.file]
            wall, rss, rc, err = run([BIN, *argv], env=env)
            ok = os.path.exists(png) and os.path.getsize(png) > 0
            print(f"  tracekit {' '.join(argv[:-1])}: {wall:.1f} s, peak {rss:,.0f} MiB, exit {rc}, "
                  f"screenshot {'written' if ok else 'missing'} {err}", flush=True)


if __name__ == "__main__":
    main()
