"""`python -m gui [--screenshot OUT.png] FILE ...`: the viewer's own entry point.

`tracekit view` starts the viewer this way, in a process of its own, so the
tracekit package never imports Qt (data flows one way: tracekit -> gui).
"""
import argparse
import sys

from .app import main

parser = argparse.ArgumentParser(prog="python -m gui", description="The tracekit desktop viewer.")
parser.add_argument("files", nargs="*")
parser.add_argument("--screenshot", default=None, help="render the window offscreen, write this PNG and exit")
args = parser.parse_args()
sys.exit(main(args.files, screenshot_path=args.screenshot))
