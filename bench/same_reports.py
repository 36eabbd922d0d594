#!/usr/bin/env python3
"""`tracekit report --json` of every file given (or: samples/, ../shared/fixtures/{real,cuda}/ and
bench/out/tiled_1000000.pickle) by two installs, each with an empty cache, compared byte for byte; this
install's second (warm) report too. Prints one line per file and exits 1 if any differs.

Usage: python bench/same_reports.py --base /path/to/other/.venv/bin/tracekit [FILE ...]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHARED = next((p / "shared" for p in ROOT.parents if (p / "shared/fixtures").is_dir()), ROOT.parent / "shared")


def report(exe, path, cache):
    env = dict(os.environ, TRACEKIT_CACHE_DIR=cache, PYTHONDONTWRITEBYTECODE="1")
    p = subprocess.run([exe, "report", "--json", str(path)], env=env, capture_output=True)
    return p.returncode, p.stdout, p.stderr


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True, help="the other install's tracekit executable")
    ap.add_argument("files", nargs="*")
    args = ap.parse_args()
    files = [Path(f) for f in args.files] or sorted(
        [p for d in (ROOT / "samples", SHARED / "fixtures/real", SHARED / "fixtures/cuda") for p in d.iterdir()
         if p.is_file() and not p.name.endswith((".md", ".py", ".jsonl", ".txt"))]
        + [p for p in [ROOT / "bench/out/tiled_1000000.pickle"] if p.exists()])
    mine = str(ROOT / ".venv/bin/tracekit")
    bad = 0
    for f in files:
        with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
            base = report(args.base, f, a)
            cold = report(mine, f, b)
            warm = report(mine, f, b)
        same = base[:2] == cold[:2] == warm[:2]
        bad += not same
        print(f"{'same' if same else 'DIFFERS'}  rc={base[0]}  {len(base[1]):>9,} bytes  {f}", flush=True)
    print(f"{len(files) - bad} of {len(files)} the same")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
