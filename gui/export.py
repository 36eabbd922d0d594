"""Exports: the timeline as PNG, the allocations table as CSV, the whole window as PNG."""
from __future__ import annotations

import os

from tracekit.errors import TracekitError


def save_png(widget, path) -> str:
    """Render a widget (legend and plot included) to a PNG at its on-screen size."""
    path = os.fspath(path)
    if not widget.grab().save(path, "PNG"):
        raise TracekitError(f"cannot write {path}: the image could not be saved")
    return path


def save_csv(model, path) -> int:
    """Write the table's rows, as filtered and sorted on screen. Returns the number of rows."""
    path = os.fspath(path)
    frame = model.to_frame()
    try:
        frame.to_csv(path, index=False)
    except OSError as e:
        raise TracekitError(f"cannot write {path}: {e.strerror or e}") from None
    return len(frame)
