#!/usr/bin/env bash
# Create .venv at the repository root (if missing) and install tracekit with
# everything it needs: torch 2.13.0 (CPU build), PySide6, pyqtgraph, pandas,
# click and the test tools. Safe to run again: it reinstalls only when
# pyproject.toml or setup.py changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv" >&2
  "$PY" -m venv .venv
fi
stamp=.venv/.tracekit-installed
# the compiled extensions are rebuilt when their C sources change too
want=$(cat pyproject.toml setup.py tracekit/io/_pkscan.c tracekit/analysis/allocator/_replay.c tracekit/record/_cpuhook.c | sha256sum | cut -c1-16)
if [ "$(cat "$stamp" 2>/dev/null)" != "$want" ]; then
  echo "setup: installing tracekit and its dependencies into .venv (a few minutes the first time)" >&2
  .venv/bin/python -m pip install -q --upgrade pip >&2
  # torch==2.13.0 is pinned: the CPU build lies on this machine's disk, a looser pin pulls a CUDA build.
  .venv/bin/python -m pip install -q "torch==2.13.0" >&2
  # Earlier checkouts installed this project under the distribution name `tracekit` (now torch-tracekit).
  if .venv/bin/python -m pip show -q tracekit >/dev/null 2>&1; then .venv/bin/python -m pip uninstall -q -y tracekit >&2; fi
  .venv/bin/python -m pip install -q -e ".[all]" >&2
  echo "$want" > "$stamp"
fi
