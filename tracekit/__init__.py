"""tracekit: record, classify and explain PyTorch memory use.

`tracekit.load(path)` opens any memory file as a `Recording` (the columnar
`Trace`, with DataFrames, the report and a notebook view: see api.py);
`tracekit.record(...)` (needs torch) records one. Importing tracekit imports
neither torch nor Qt.
"""
from __future__ import annotations

import os
from typing import TYPE_CHECKING, Callable

if TYPE_CHECKING:
    from .analysis.window import Window
    from .api import Recording

__version__ = "0.1.0"


def load(path: str | os.PathLike[str], progress: Callable[[float, str], None] | None = None, use_cache: bool = True,
         window: Window | None = None, write_behind: bool = False) -> Recording:
    """Open a snapshot or profiler trace as a `tracekit.api.Recording` (a `tracekit.model.Trace`).
    `write_behind`: a first open writes the cache's entry on a thread beside what the caller does next
    (tracekit.io.load)."""
    from .api import load as _load

    return _load(path, progress=progress, use_cache=use_cache, window=window, write_behind=write_behind)


def load_ipython_extension(ipython) -> None:
    """`%load_ext tracekit`: the `%%tracekit` cell magic (records the cell, shows the report)."""
    from .integrations.notebook import load_ipython_extension as _load_ext

    _load_ext(ipython)


def __getattr__(name):
    # The recorder needs torch: import it only when asked for.
    if name in ("record", "record_steps"):
        import importlib

        _record = importlib.import_module(".record", __name__)  # `from . import` would recurse here
        return getattr(_record, name)
    raise AttributeError(f"module 'tracekit' has no attribute {name!r}")
