"""Reading and writing memory files, and the caches of what was read.

`load(path)` is the one entry point (reading.py: detect the format, read it safely, convert it to a
Trace). Every failure becomes a `LoadError` whose message names the file and what is wrong; nothing
in a file is ever executed, and reading is bounded in size, memory and nesting (limits.py).

The rooms: reading.py (formats, detection), snapshot.py / profiler.py / stream.py / _pkscan.c (the
readers), unpickle.py (the restricted unpickler), write.py and memory_viz.py (files we write),
rank_files.py (the files of a many-rank job), cache/ (the columnar copy of each
opened file, and the analysis results stored beside it).

The names below are imported on first use, so that code needing only a light part of io (the cache's
folder and keys, for a report served from the cache) does not pay for numpy and the readers.
"""
from __future__ import annotations

__all__ = ["load", "read_document", "to_trace", "first_pass", "LoadError"]

_FROM_READING = frozenset(__all__)


def __getattr__(name):
    if name in _FROM_READING:
        from . import reading

        return getattr(reading, name)
    raise AttributeError(f"module 'tracekit.io' has no attribute {name!r}")
