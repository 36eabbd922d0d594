#!/usr/bin/env bash
# Set everything up, then open the bundled sample: the viewer when there is a
# display, else the text report.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
SAMPLE=${1:-samples/gpt_adamw.pickle}
if [ -n "${DISPLAY:-}${WAYLAND_DISPLAY:-}" ] && .venv/bin/python -c "import PySide6, pyqtgraph" 2>/dev/null; then
  exec .venv/bin/tracekit view "$SAMPLE"
fi
exec .venv/bin/tracekit report "$SAMPLE"
