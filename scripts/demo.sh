#!/usr/bin/env bash
# Set everything up, then open the bundled sample: the viewer when a window can
# open here, else the text report (with one line saying what the viewer lacks).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
SAMPLE=${1:-samples/gpt_adamw.pickle}
if [ -n "${DISPLAY:-}${WAYLAND_DISPLAY:-}" ]; then
  # --check starts no Qt: it says which system packages the viewer's window needs, if any are missing.
  if why=$(.venv/bin/python -m tracekit_gui --check 2>&1); then
    exec .venv/bin/tracekit view "$SAMPLE"
  fi
  echo "$why" >&2
  echo "tracekit: showing the text report instead" >&2
fi
exec .venv/bin/tracekit report "$SAMPLE"
