"""`tracekit view FILE ...`: open files in the desktop viewer (needs the `gui` extra).

The viewer is started as `python -m tracekit_gui` in a process of its own, so the
tracekit package never imports Qt or the viewer's package. Before Qt starts, the
viewer checks that a window can open here and otherwise says what to install."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import click

from ._common import no_cache_option, window_of, window_options


VIEWER = "tracekit_gui"  # the viewer's package (source folder gui/)


def window_problem() -> str | None:
    """Why the viewer cannot open a window here (one line: what to install), or None when it can."""
    if importlib.util.find_spec(VIEWER) is None:
        return "the viewer is not installed: pip install 'torch-tracekit[gui]'"
    done = subprocess.run([sys.executable, "-m", VIEWER, "--check"], capture_output=True, text=True)
    if done.returncode == 0:
        return None
    return done.stderr.strip().removeprefix("tracekit: ") or "the viewer cannot start"


class UserError(click.ClickException):
    """What the user must change (a missing package, no display): exit code 2."""

    exit_code = 2


@click.command(name="view")
@click.argument("files", nargs=-1, type=click.Path(dir_okay=True))
@click.option("--compare", is_flag=True, help="Compare two FILES (A before, B after) on one axis: what changed.")
@click.option("--screenshot", "screenshot", type=click.Path(dir_okay=False), default=None,
              help="Render the window after loading (offscreen without a display), write this PNG and exit.")
@no_cache_option
@window_options
def command(files, screenshot, compare, no_cache, **window_opts):
    """Open FILES (snapshots or profiler traces) in the desktop viewer; a folder of rank files opens as a
    rank dashboard; --compare with two files compares them."""
    if compare and len(files) != 2:
        raise click.UsageError("--compare needs exactly two FILES: A (before) and B (after)")
    missing = [m for m in ("PySide6", "pyqtgraph", VIEWER) if importlib.util.find_spec(m) is None]
    if missing:
        raise UserError(f"the viewer needs PySide6 and pyqtgraph ({', '.join(missing)} missing): "
                         "pip install 'torch-tracekit[gui]'")
    if screenshot and not files:
        raise click.UsageError("--screenshot needs at least one FILE to open")
    env = os.environ
    no_screen = not (env.get("DISPLAY") or env.get("WAYLAND_DISPLAY") or env.get("QT_QPA_PLATFORM"))
    if sys.platform.startswith("linux") and no_screen and not screenshot:  # a screenshot renders offscreen
        raise UserError("there is no display to show a window on (DISPLAY and WAYLAND_DISPLAY are unset): "
                         "use `tracekit report FILE`, or `tracekit view FILE --screenshot OUT.png` to render "
                         "the window to a picture")
    # The viewer runs as `python -m tracekit_gui`, a process of its own: tracekit never imports Qt.
    shot = ["--screenshot", screenshot] if screenshot else []
    cache = ["--no-cache"] if no_cache else []
    window = window_of(window_opts)
    if window and (compare or len(files) != 1 or os.path.isdir(files[0])):
        raise click.UsageError("--from/--to/--last/--iterations apply to one FILE")
    cache += [arg for flag, value in (("--from", window.first), ("--to", window.last),
                                      ("--last", None if window.last_us is None else f"{window.last_us}us"),
                                      ("--iterations", window.iterations and "{}..{}".format(*window.iterations)))
              if value is not None for arg in (flag, str(value))]
    code = subprocess.call([sys.executable, "-m", VIEWER, *shot, *cache, *(["--compare"] if compare else []),
                            "--", *files])
    if code:
        raise SystemExit(code)
