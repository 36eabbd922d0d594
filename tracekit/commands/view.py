"""`tracekit view FILE ...`: open files in the desktop viewer (needs the `gui` extra)."""
from __future__ import annotations

import os
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
    try:
        import PySide6  # noqa: F401
        import pyqtgraph  # noqa: F401
    except ImportError as e:
        raise click.ClickException(
            f"the viewer needs PySide6 and pyqtgraph ({e.name or e} is missing): "
            "pip install 'tracekit[gui]'") from None
    if screenshot and not files:
        raise click.UsageError("--screenshot needs at least one FILE to open")
    no_screen = not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY") or os.environ.get("QT_QPA_PLATFORM"))
    if sys.platform.startswith("linux") and no_screen and not screenshot:  # a screenshot renders offscreen
        raise _UserError("there is no display to show a window on (DISPLAY and WAYLAND_DISPLAY are unset): "
                         "use `tracekit report FILE`, or `tracekit view FILE --screenshot OUT.png` to render "
                         "the window to a picture")
    from gui.app import main

    code = main(list(files), screenshot_path=screenshot)
    if code:
        raise SystemExit(code)
