"""`python -m tracekit_gui [--check] [--screenshot OUT.png [--select KIND] [--group line|library|module]] FILE ...`: the viewer's own entry point.

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
parser.add_argument("--allocator", default=None, metavar="SETTINGS", nargs="?", const="",
                    help="with --screenshot: the allocator window instead, with a what-if on SETTINGS if given")
parser.add_argument("--group", default=None, choices=("line", "library", "module"),
                    help="with --screenshot: group the allocations table by your line, library line or module")
parser.add_argument("--no-cache", action="store_true", help="do not read or write the columnar cache")
parser.add_argument("--compare", action="store_true", help="compare two files (A before, B after)")
parser.add_argument("--check", action="store_true", help="only check that a window can open here (exit 2 if not)")
for flag, metavar, what in (("--from", "N", "only entries from N on"), ("--to", "N", "only entries up to N (inclusive)"),
                            ("--last", "SPAN", "only the last SPAN (10s, 250ms, 2min)"),
                            ("--iterations", "A..B", "only iterations A to B")):
    parser.add_argument(flag, dest="window_" + flag[2:], default=None, metavar=metavar, help=what)
args = parser.parse_args()
if args.check:
    why = display.missing_packages() or display.problem()
    if why:
        print(f"tracekit: {why}", file=sys.stderr)
    sys.exit(2 if why else 0)

from tracekit.analysis.window import Window, parse_duration, parse_iterations  # noqa: E402

try:
    trace_window = Window(
        first=None if args.window_from is None else int(args.window_from),
        last=None if args.window_to is None else int(args.window_to),
        last_us=None if args.window_last is None else parse_duration(args.window_last),
        iterations=None if args.window_iterations is None else parse_iterations(args.window_iterations))
except ValueError as e:
    print(f"tracekit: {e}", file=sys.stderr)
    sys.exit(2)

from .app import main  # noqa: E402  (Qt is imported only past the check)

sys.exit(main(args.files, screenshot_path=args.screenshot, select=args.select, use_cache=not args.no_cache,
              compare=args.compare, trace_window=trace_window or None, allocator=args.allocator, group=args.group))
