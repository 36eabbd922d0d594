"""Opening memory files: detect the format, read it safely, convert it to a Trace.

`load(path)` is the one entry point. Every failure becomes a `LoadError` whose
message names the file and what is wrong; nothing in a file is ever executed.
"""
from __future__ import annotations

import gzip

import json
import os
import pickle
import struct
import zlib

from ..errors import Cancelled, LoadError
from ..model import Trace
from . import cache as _cache
from .profiler import is_kineto, is_memory_timeline, kineto_to_trace, memory_timeline_to_trace
from .progress import ProgressReader
from .snapshot import SnapshotError, is_snapshot, snapshot_to_trace
from .unpickle import RefusedGlobal, RestrictedUnpickler

__all__ = ["load", "read_document", "LoadError"]

GZIP_MAGIC = b"\x1f\x8b"


def load(path, progress=None, use_cache=True) -> Trace:
    """Open a snapshot (pickle or JSON, optionally gzip'd) or a profiler trace.

    `progress(fraction, message)` is called while reading; it may raise
    `Cancelled`. A columnar cache makes the second open of a file fast.
    """
    path = os.fspath(path)
    stat = _stat(path)
    key = _cache.key_for(path, stat) if use_cache else None
    if key:
        trace = _cache.read(key, path)
        if trace is not None:
            if progress:
                progress(1.0, "loaded from cache")
            return trace
    obj, kind = read_document(path, progress, size=stat.st_size)
    try:
        trace = to_trace(obj, path, progress)
        trace.meta.update(container=kind, file_bytes=stat.st_size)
    except (SnapshotError, ValueError, KeyError, TypeError, AttributeError, IndexError) as e:
        raise LoadError(path, _not_a_trace(obj, kind, e)) from None
    finally:
        del obj
    if key:
        _cache.write(key, trace)
    return trace


def to_trace(obj, path, progress=None) -> Trace:
    """Convert a decoded document (dict or list) to a Trace, whatever its kind."""
    if is_snapshot(obj):
        return snapshot_to_trace(obj, path, _scaled(progress, 0.8, 0.98))
    if is_kineto(obj):
        return kineto_to_trace(obj, path)
    if is_memory_timeline(obj):
        return memory_timeline_to_trace(obj, path)
    raise SnapshotError("")


def _not_a_trace(obj, kind, error) -> str:
    if str(error):
        return f"it is not a valid memory snapshot: {error}"
    if isinstance(obj, dict):
        keys = ", ".join(repr(k) for k in list(obj)[:6]) or "none"
        return (f"it is a {kind} dict without 'segments' or 'traceEvents' (keys: {keys}), "
                "so it is neither a PyTorch memory snapshot nor a profiler trace")
    what = type(obj).__name__
    return (f"it is a {kind} {what}, not a PyTorch memory snapshot "
            "(expected a dict with 'segments', a profiler trace, or a memory timeline)")


def _stat(path):
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise LoadError(path, "no such file") from None
    except PermissionError:
        raise LoadError(path, "permission denied") from None
    except OSError as e:
        raise LoadError(path, e.strerror or str(e)) from None
    if os.path.isdir(path):
        raise LoadError(path, "it is a directory, not a file")
    if st.st_size == 0:
        raise LoadError(path, "the file is empty (0 bytes)")
    return st


def read_document(path, progress=None, size=None):
    """Decode a file to Python data. Returns (object, kind) with kind "pickle" or "JSON"."""
    size = size if size is not None else _stat(path).st_size
    try:
        raw = open(path, "rb")
    except OSError as e:
        raise LoadError(path, e.strerror or str(e)) from None
    with raw:
        head = raw.read(2)
        raw.seek(0)
        zipped = head == GZIP_MAGIC
        reader = ProgressReader(raw, size, progress, span=(0.0, 0.8)) if progress else raw
        stream = gzip.GzipFile(fileobj=reader, mode="rb") if zipped else reader
        try:
            first = _first_byte(stream)
            prefix = "gzip-compressed " if zipped else ""
            if first in b"{[ \t\r\n":
                return _read_json(stream, path, zipped), prefix + "JSON"
            if first in b"\x80(]}":
                return _read_pickle(stream, path, zipped), prefix + "pickle"
        except (gzip.BadGzipFile, EOFError, zlib.error, OSError) as e:
            if not zipped:
                raise LoadError(path, f"it could not be read ({e})") from None
            raise LoadError(path, f"it is a gzip file that is truncated or corrupt ({e})") from None
    shown = " ".join(f"{b:02x}" for b in head + first)
    wrapped = "gzip-compressed data that is" if zipped else "a file that is"
    raise LoadError(path, f"{wrapped} neither a pickle nor JSON (it starts with bytes {shown}); "
                          "expected a PyTorch memory snapshot or profiler trace")


def _first_byte(stream) -> bytes:
    if hasattr(stream, "peek"):
        b = stream.peek(1)[:1]
    else:
        b = stream.read(1)
        stream.seek(0)
    if not b:
        raise EOFError("no data after decompression")
    return b


def _read_pickle(stream, path, zipped):
    try:
        return RestrictedUnpickler(stream).load()
    except Cancelled:
        raise
    except RefusedGlobal as e:
        raise LoadError(path, f"it is a pickle that asks to import {e.module}.{e.name}; refused, nothing was "
                              "executed (memory snapshots hold only plain data, so this file is not one)") from None
    except (EOFError, gzip.BadGzipFile, zlib.error) as e:
        if zipped and (str(e) or not isinstance(e, EOFError)):  # the compressed stream broke, not the pickle
            raise LoadError(path, f"it is a gzip file that is truncated or corrupt ({e})") from None
        raise LoadError(path, "it is truncated: the pickle data ends before its end marker") from None
    except pickle.UnpicklingError as e:
        msg = str(e)
        if "truncated" in msg:
            raise LoadError(path, "it is truncated: the pickle data ends before its end marker") from None
        raise LoadError(path, f"it is a corrupt pickle ({msg})") from None
    except MemoryError:
        raise LoadError(path, "it is a corrupt pickle (it asks for more memory than this machine has)") from None
    except (ValueError, KeyError, IndexError, TypeError, AttributeError, struct.error, OverflowError,
            UnicodeDecodeError, RecursionError, OSError) as e:
        raise LoadError(path, f"it is a corrupt pickle ({type(e).__name__}: {e})") from None


def _read_json(stream, path, zipped):
    try:
        data = stream.read()
    except (EOFError, OSError, zlib.error) as e:
        raise LoadError(path, f"it is a gzip file that is truncated or corrupt ({e})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise LoadError(path, f"it looks like JSON but is not UTF-8 text (byte {e.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        where = "it is truncated JSON" if e.pos >= len(text.rstrip()) else "it is not valid JSON"
        raise LoadError(path, f"{where}: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise LoadError(path, "it is JSON nested too deeply to be a memory snapshot") from None


def _scaled(progress, lo, hi):
    if progress is None:
        return None
    return lambda f, msg: progress(lo + (hi - lo) * f, msg)


