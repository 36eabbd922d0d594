#!/usr/bin/env bash
# Before a device call with the `truth`/`alloc` steps (run here, from the repository root): ../shared does not travel
# to the device, so copy its fixture scripts into .gpu/scripts, and the pure-python packages they import that the
# device lacks (einops, einx, jaxtyping, wadler_lindig, frozendict) from .venv into .gpu/pylib. .gpu/ is ignored:
# pass carry=[".gpu"] to the device tool.
set -euo pipefail
cd "$(dirname "$0")/.."
SHARED=${SHARED:-../shared}
[ -d "$SHARED" ] || SHARED=$(cd "$(git rev-parse --git-common-dir)/../.." && pwd)/shared  # from a worktree
rm -rf .gpu && mkdir -p .gpu/pylib
cp -r "$SHARED/fixtures/scripts" .gpu/scripts
chmod -R u+w .gpu
for m in einops einx jaxtyping wadler_lindig frozendict; do
  d=$(.venv/bin/python -c "import $m, os; print(os.path.dirname($m.__file__))")
  cp -r "$d" .gpu/pylib/
  cp -r "$(dirname "$d")/${m}"-*.dist-info .gpu/pylib/ 2>/dev/null || true
done
find .gpu -name __pycache__ -prune -exec rm -rf {} +
du -sh .gpu
