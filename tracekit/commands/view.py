"""`tracekit view FILE ...`: open files in the desktop viewer (needs the `gui` extra).

The viewer is started as `python -m gui` in a process of its own, so the
tracekit package never imports Qt or the gui package."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import click


class _UserError(click.ClickException):
    exit_code = 2


@click.command(name="view")
@click.argument("files", nargs=-1, type=click.Path(dir_okay=False))
@click.option("--screenshot", "screenshot", type=click.Path(dir_okay=False), default=None,
              help="Render the window offscreen after loading, write this PNG and exit.")
def command(files, screenshot):
    """Open FILES (snapshots or profiler traces) in the desktop viewer."""
    missing = [m for m in ("PySide6", "pyqtgraph", "gui") if importlib.util.find_spec(m) is None]
    if missing:
        raise click.ClickException(f"the viewer needs PySide6 and pyqtgraph ({', '.join(missing)} missing): "
                                   "pip install 'tracekit[gui]'")
    if screenshot and not files:
        raise click.UsageError("--screenshot needs at least one FILE to open")
    no_screen = not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY") or os.environ.get("QT_QPA_PLATFORM"))
    if sys.platform.startswith("linux") and no_screen and not screenshot:  # a screenshot renders offscreen
        raise _UserError("there is no display to show a window on (DISPLAY and WAYLAND_DISPLAY are unset): "
                         "use `tracekit report FILE`, or `tracekit view FILE --screenshot OUT.png` to render "
                         "the window to a picture")
    # The viewer runs as `python -m gui`, a process of its own: tracekit never imports Qt.
    shot = ["--screenshot", screenshot] if screenshot else []
    code = subprocess.call([sys.executable, "-m", "gui", *shot, "--", *files])
    if code:
        raise SystemExit(code)
