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
  --picker: the viewer's File > Open (offscreen, an empty cache): the first pass, the window picker answered
            with iterations A..B, the window opened and drawn
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
    ap.add_argument("--picker", action="store_true")
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
    if args.picker and args.iterations:
        picker(args)
    if args.view and args.iterations:
        with tempfile.TemporaryDirectory() as tmp:
            png = os.path.join(tmp, "view.png")
            env = {**os.environ, "QT_QPA_PLATFORM": "offscreen"}
            argv = ["view", "--no-cache", "--iterations", args.iterations, "--screenshot", png, args.file]
            wall, rss, rc, err = run([BIN, *argv], env=env)
            ok = os.path.exists(png) and os.path.getsize(png) > 0
            print(f"  tracekit {' '.join(argv[:-1])}: {wall:.1f} s, peak {rss:,.0f} MiB, exit {rc}, "
                  f"screenshot {'written' if ok else 'missing'} {err}", flush=True)


PICKER = """
import sys, time
from PySide6.QtCore import QTimer
from PySide6.QtWidgets import QApplication
from tracekit_gui.app import MainWindow, wait_loaded
app = QApplication([])
window = MainWindow(remember=False)
a, b = map(int, sys.argv[2].split(".."))
asked = []

def answer():
    d = QApplication.activeModalWidget()
    if d is None:
        return QTimer.singleShot(50, answer)
    asked.append(True)
    d.iters.setChecked(True)
    d.it_first.setValue(a)
    d.it_last.setValue(b)
    d.open_button.click()

QTimer.singleShot(0, answer)
assert window.open_picking_window(sys.argv[1]) is not None and asked, "the picker was not shown"
assert wait_loaded(window, 3000)
view = window.current_view()
print(view.summary.text(), file=sys.stderr)
"""


def picker(args):
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "QT_QPA_PLATFORM": "offscreen", "TRACEKIT_CACHE_DIR": tmp}
        wall, rss, rc, err = run([sys.executable, "-c", PICKER, args.file, args.iterations], env=env)
        print(f"  viewer File > Open, picker answered iterations {args.iterations}: {wall:.1f} s, peak {rss:,.0f} MiB, "
              f"exit {rc} {err}", flush=True)


if __name__ == "__main__":
    main()
