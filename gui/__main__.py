"""`python -m tracekit_gui [--check] [--screenshot OUT.png [--select KIND]] FILE ...`: the viewer's own entry point.

`tracekit view` starts the viewer this way, in a process of its own, so the
tracekit package never imports Qt (data flows one way: tracekit -> tracekit_gui).
`--check` only says whether a window can open here (exit 0), or why not and
what to install (one line, exit 2), without starting Qt.
"""
import argparse
import sys

from . import display

parser = argparse.ArgumentParser(prog="python -m tracekit_gui", description="The tracekit desktop viewer.")
parser.add_argument("files", nargs="*")
parser.add_argument("--screenshot", default=None, help="render the window, write this PNG and exit")
parser.add_argument("--select", default=None, metavar="KIND",
                    help="with --screenshot: select the first finding of this kind (leak, spike, peak, oom)")
parser.add_argument("--no-cache", action="store_true", help="do not read or write the columnar cache")
parser.add_argument("--compare", action="store_true", help="compare two files (A before, B after)")
parser.add_argument("--check", action="store_true", help="only check that a window can open here (exit 2 if not)")
args = parser.parse_args()
if args.check:
    why = display.missing_packages() or display.problem()
    if why:
        print(f"tracekit: {why}", file=sys.stderr)
    sys.exit(2 if why else 0)

from .app import main  # noqa: E402  (Qt is imported only past the check)

sys.exit(main(args.files, screenshot_path=args.screenshot, select=args.select, use_cache=not args.no_cache,
              compare=args.compare))
