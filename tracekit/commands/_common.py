"""Options and helpers shared by the commands that open files."""
from __future__ import annotations

import click

file_argument = click.argument("file", type=click.Path(dir_okay=True, path_type=str))
no_cache_option = click.option("--no-cache", is_flag=True, help="Do not read or write the columnar cache.")
rules_option = click.option("--rules", type=click.Path(exists=True, dir_okay=False),
                            help="User category rules (TOML), applied on top of tags and inference.")
json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON object instead of text.")


def size_value(param, value, positive: bool = True):
    """A byte option's value ("80GiB") as bytes: None stays None; a bare number, a bad size or (with
    `positive`) zero is one line naming the option and exit 2 (a TracekitError, not click's usage text)."""
    from ..errors import TracekitError
    from ..units import parse_bytes

    if value is None:
        return None
    name = param.opts[0] if param is not None and getattr(param, "opts", None) else "size"
    try:
        got = parse_bytes(value, unit_required=True)
    except ValueError as e:
        raise TracekitError(f"{name}: {e}") from None
    if positive and got <= 0:
        raise TracekitError(f"{name}: {value!r} is not a budget: give a size above zero")
    return got


def size_callback(ctx, param, value):
    """The click callback of every byte option (--budget, --max-peak, --memory-limit, ...)."""
    return size_value(param, value)


def _parsed(name):
    """A click callback that parses with tracekit.analysis.window's `name` (imported when used)."""
    def convert(ctx, param, value):
        from ..analysis import window

        try:
            return None if value is None else getattr(window, name)(value)
        except ValueError as e:
            raise click.BadParameter(str(e)) from None
    return convert


def window_options(f):
    """--from/--to/--last/--iterations: look at a window of the trace (tracekit.analysis.window)."""
    f = click.option("--iterations", "window_iterations", metavar="A..B", callback=_parsed("parse_iterations"),
                     help="Only iterations A to B (e.g. 3..5, or 4).")(f)
    f = click.option("--last", "window_last", metavar="SPAN", callback=_parsed("parse_duration"),
                     help="Only the last SPAN of the recording (e.g. 10s, 250ms, 2min).")(f)
    f = click.option("--to", "window_to", type=click.IntRange(min=0), metavar="N",
                     help="Only entries up to N (inclusive; numbered from 0 in each device's trace).")(f)
    return click.option("--from", "window_from", type=click.IntRange(min=0), metavar="N",
                        help="Only entries from N on (numbered from 0 in each device's trace).")(f)


def window_of(opts: dict):
    """The Window named by window_options' values (popped from `opts`)."""
    from ..analysis.window import Window

    w = Window(first=opts.pop("window_from", None), last=opts.pop("window_to", None),
               last_us=opts.pop("window_last", None), iterations=opts.pop("window_iterations", None))
    if w.first is not None and w.last is not None and w.last < w.first:
        raise click.BadParameter(f"--to {w.last} is before --from {w.first}")
    return w


def window_line(trace) -> str:
    """'window: iterations 1..2; entry 0 here is entry 2644 of the file (cpu)' for a cut trace."""
    from ..analysis.window import read_note

    cut = trace.meta["window"]
    starts = ", ".join(f"entry {lo} of the file ({trace.device_label(d)})" for d, (lo, _, _) in cut["devices"].items())
    note = read_note(cut)
    return (f"window: {cut['description']}; entries are renumbered from 0, entry 0 here is {starts}"
            + (f"; {note}" if note else ""))


def open_trace(path, no_cache=False, window=None, write_behind=False):
    """Load a file, drawing progress on stderr if it takes more than a second; cut to `window` if given.
    `write_behind`: see tracekit.io.load (the caller waits with cache.folder.wait_written())."""
    from ..io import load
    from ..io.progress import StderrProgress

    progress = StderrProgress(f"opening {path}")
    try:
        trace = load(path, progress=progress, use_cache=not no_cache, window=window, write_behind=write_behind)
    finally:
        progress.close()
    from ..io.limits import names_cut_line

    line = names_cut_line(trace)
    if line:
        click.echo(line, err=True)
    if window:
        from ..analysis.window import select

        trace = select(trace, window)
    return trace


def show(kind: str, result, as_json: bool = False, nl: bool = True, **context):
    """Print `result` (a `kind` result: report, info, diff, ranks, estimate, whatif, check) with its reporter
    from tracekit.render: one JSON object with --json, else text. `context` goes to the text reporter."""
    from ..render import reporter

    click.echo(reporter(kind, "json" if as_json else "text").render(result, **({} if as_json else context)), nl=nl)

