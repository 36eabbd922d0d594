#!/usr/bin/env python3
"""Viewer benchmark: time from `view` to a drawn window, and frame times while panning.

Usage: .venv/bin/python bench/bench_view.py [FILE] [--entries N] [--cache-dir DIR]

Without FILE it makes /tmp/tracekit-bench-1M.pickle (1M entries) by tiling
the real newest-format snapshot with ../shared/bench/tile_snapshot.py. Runs
offscreen. Prints figures; it is not a pass/fail test.

--cache-dir DIR keeps the cache there (default: a new temporary folder), so a 10M-entry file is read
whole once across runs; then "cold" is cold only on the first run.

- open (cold): a fresh process runs `tracekit view FILE --screenshot` with an
  empty cache: Python start, imports, unpickle, analysis, window, first paint.
- open (warm): the same with the columnar cache filled by the cold run.
- in-process: loading (cache) + analysis (restored from the cache: tracekit/io/cache/memo.py),
  building the tab, first paint; and their sum, from open_file to the painted window.
- pan: the view shifted by 2% of its width per frame; each frame re-queries
  the visible range (about one point per pixel) and repaints. Whole trace,
  then zoomed to 1% of it.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = ROOT / ".." / "shared"
SOURCE = SHARED / "fixtures" / "real" / "snapshot_newest_format_windows_paths.pickle"


def make_big(path: Path, entries: int):
    if not path.exists():
        print(f"making {path} ({entries:,} entries) ...", flush=True)
        subprocess.run([sys.executable, str(SHARED / "bench" / "tile_snapshot.py"), str(SOURCE), str(path),
                        "--entries", str(entries)], check=True)


def timed_cli(path, cache_dir, settings) -> float:
    env = dict(os.environ, QT_QPA_PLATFORM="offscreen", TRACEKIT_CACHE_DIR=cache_dir, TRACEKIT_SETTINGS=settings)
    out = os.path.join(cache_dir, "shot.png")
    t = time.perf_counter()
    subprocess.run([sys.executable, "-m", "tracekit.cli", "view", str(path), "--screenshot", out],
                   check=True, env=env, capture_output=True)
    return time.perf_counter() - t


def frames(app, view, mode, steps=60):
    """Pan right by 2% of the view per frame and paint it. Returns per-frame ms.

    mode "paint": only the paint (the drawn curves move);
    "viewer": what the viewer does, refresh() re-queries when the view leaves
    the fetched range (one view width either side) or zooms in;
    "query": a re-query of the visible range on every frame (worst case, as in a zoom)."""
    tl = view.timeline
    times = []
    for _ in range(steps):
        (x0, x1), _ = tl.vb.viewRange()
        shift = (x1 - x0) * 0.02
        t = time.perf_counter()
        tl.vb.setXRange(x0 + shift, x1 + shift, padding=0)
        if mode == "query":
            tl._fetched = None
        if mode != "paint":
            tl.refresh()
        tl._timer.stop()
        tl.graphics.viewport().repaint()
        times.append((time.perf_counter() - t) * 1000)
        app.processEvents()
        tl._timer.stop()
    return times


def summary(ms):
    ms = sorted(ms)
    return f"median {statistics.median(ms):6.1f} ms, p95 {ms[int(len(ms) * 0.95) - 1]:6.1f} ms, max {ms[-1]:6.1f} ms"


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("file", nargs="?")
    ap.add_argument("--entries", type=int, default=1_000_000)
    ap.add_argument("--cache-dir", default=None, help="keep the cache here (default: a new temporary folder)")
    args = ap.parse_args()
    path = Path(args.file) if args.file else Path(tempfile.gettempdir()) / "tracekit-bench-1M.pickle"
    if not args.file:
        make_big(path, args.entries)
    print(f"file: {path} ({path.stat().st_size / 2**20:.0f} MiB)")

    with (contextlib.nullcontext(args.cache_dir) if args.cache_dir else tempfile.TemporaryDirectory()) as tmp:
        settings = os.path.join(tmp, "settings.ini")
        cold = timed_cli(path, tmp, settings)
        warm = timed_cli(path, tmp, settings)
        print(f"tracekit view --screenshot, cold cache : {cold:6.2f} s")
        print(f"tracekit view --screenshot, warm cache : {warm:6.2f} s")

        os.environ.update(QT_QPA_PLATFORM="offscreen", TRACEKIT_CACHE_DIR=tmp, TRACEKIT_SETTINGS=settings)
        from PySide6.QtWidgets import QApplication

        from tracekit_gui.app import MainWindow, wait_loaded

        app = QApplication.instance() or QApplication([])
        window = MainWindow(remember=False)
        window.resize(1440, 900)
        window.show()
        app.processEvents()
        t = time.perf_counter()
        window.open_file(path)
        wait_loaded(window)
        t_loaded = time.perf_counter()
        view = window.current_view()
        window.repaint()
        app.processEvents()
        t_drawn = time.perf_counter()
        rep = view.doc.replays[view.device]
        print(f"in-process, warm cache: loaded + analysed + tab built {t_loaded - t:6.2f} s, "
              f"first paint {1000 * (t_drawn - t_loaded):6.1f} ms; open_file -> painted {t_drawn - t:6.2f} s")
        print(f"  {rep.n:,} entries, {len(rep.allocations):,} allocations, "
              f"{view.timeline.last_query[3]:,} points drawn for {view.timeline.last_query[2]} px")

        lo, hi = view.doc.x_range(view.device)
        for what, (a, b) in (("whole trace", (0.0, 1.0)), ("1% of trace", (0.3, 0.31))):
            for mode, label in (("paint", "paint only"), ("viewer", "as the viewer"), ("query", "re-query each")):
                view.timeline.vb.setXRange(lo + (hi - lo) * a, lo + (hi - lo) * b, padding=0)
                view.timeline.refresh()
                print(f"pan, {what:11s} in view, {label:13s}: {summary(frames(app, view, mode))}")
        t = time.perf_counter()
        view.model.sort(0, 0)
        print(f"sort {len(rep.allocations):,} allocations by size: {1000 * (time.perf_counter() - t):6.1f} ms")
        t = time.perf_counter()
        view.filter_edit.setText("log_softmax")
        view._apply_filter()
        print(f"filter by text ({view.model.rowCount():,} rows match): {1000 * (time.perf_counter() - t):6.1f} ms")
        t = time.perf_counter()
        view.pin_cursor(rep.peak_index)
        print(f"breakdown at the cursor: {1000 * (time.perf_counter() - t):6.1f} ms")
        window.close()


if __name__ == "__main__":
    main()
