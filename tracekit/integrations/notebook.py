"""`%load_ext tracekit`, then `%%tracekit [options]`: record a notebook cell and show its memory report inline.

    %%tracekit --device cpu -o step.pickle --model model --optimizer opt
    loss = model(batch).sum(); loss.backward(); opt.step(); opt.zero_grad()

The cell runs as usual (its output and errors show as always), recorded with
`tracekit.record` (CUDA when available, else the CPU backend); then the
report shows below it with a picture of memory over time stacked by category
(HTML with an inline PNG: JupyterLab, VS Code and classic notebooks, no
display server needed). A cell that ran out of memory is said first, in
one line per error, as `tracekit check` says it (the request, the free
memory then, the cap, what the run needed at least, the top holders). The
recording is kept in `_tracekit` (a `tracekit.Recording`: `.allocations()`,
`.query(...)` ...).
"""
from __future__ import annotations

import argparse
import os
import shlex
import tempfile

_counter = [0]


def _parser():
    p = argparse.ArgumentParser(prog="%%tracekit", add_help=False)
    p.add_argument("-o", "--output", default=None, help="file to write (default: a temporary file)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--model", default=None, help="name of the model variable (tags its tensors)")
    p.add_argument("--optimizer", default=None, help="name of the optimizer variable (tags its state)")
    p.add_argument("--stacks", choices=("python", "all"), default="python")
    p.add_argument("--rules", default=None, help="user category rules (TOML)")
    p.add_argument("--quiet", action="store_true", help="record and keep the file, show nothing")
    return p


def parse(line: str):
    """The magic's options; ValueError with the usage on a bad line."""
    p = _parser()
    try:
        return p.parse_args(shlex.split(line))
    except SystemExit:
        raise ValueError(f"usage: {p.format_usage().strip()}") from None


def run_cell(ipython, line: str, cell: str):
    """Record `cell` in `ipython`'s namespace; returns the Recording (None if nothing was recorded)."""
    from tracekit.api import load
    from tracekit.record import Recorder

    try:
        opts = parse(line)
    except ValueError as e:
        print(f"tracekit: {e}")
        return None
    ns = ipython.user_ns
    objs = {}
    for what in ("model", "optimizer"):
        name = getattr(opts, what)
        if name is not None:
            if name not in ns:
                print(f"tracekit: no variable named {name!r} for --{what}")
                return None
            objs[what] = ns[name]
    _counter[0] += 1
    default = os.path.join(tempfile.gettempdir(), "tracekit-notebook", f"cell-{os.getpid()}-{_counter[0]}.pickle")
    path = opts.output or default
    rec = Recorder(path, objs.get("model"), objs.get("optimizer"), backend=opts.device, stacks=opts.stacks,
                   command=["%%tracekit " + line])
    with rec:
        result = ipython.run_cell(cell)
    if not rec.written:
        print("tracekit: nothing was recorded (see the warnings above)")
        return None
    recording = load(rec.written, use_cache=False)
    ns["_tracekit"] = recording
    from tracekit.analysis.budget import oom_problems
    from tracekit.analysis.oom import parse_error

    problems = oom_problems(recording.report(opts.rules))
    for problem in problems:  # said first, as `tracekit check` says it
        print(f"tracekit: {problem['message']}")
    error = getattr(result, "error_in_exec", None)
    if not problems and error is not None and (type(error).__name__ == "OutOfMemoryError"
                                               or parse_error(str(error)) is not None):
        print(f"tracekit: out of memory: the cell raised {type(error).__name__}: {error}")
    if not opts.quiet:
        from IPython.display import HTML, display

        from .notebook_view import summary_html

        display(HTML(summary_html(recording, rules=opts.rules)))
        print(f"recorded to {rec.written}" + (" (the cell raised)" if not result.success else ""))
    return recording


def load_ipython_extension(ipython):
    def tracekit_magic(line, cell):
        run_cell(ipython, line, cell)

    tracekit_magic.__doc__ = __doc__
    ipython.register_magic_function(tracekit_magic, magic_kind="cell", magic_name="tracekit")
