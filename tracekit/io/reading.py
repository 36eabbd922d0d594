"""Opening memory files: detect the format, read it safely, convert it to a Trace.

`load(path)` is the one entry point. Every failure becomes a `LoadError` whose
message names the file and what is wrong; nothing in a file is ever executed,
and reading is bounded in size, memory and nesting (see `limits`).
"""
from __future__ import annotations

import array
import gzip
import zlib
import json
import os
import pickle
import stat as _stat_mod

from ..errors import Cancelled, LoadError
from ..model import NO_TIME, Trace
from .cache import folder as _folder
from .cache import traces as _cache
from . import stream as _stream
from .columns import FX_FRAMES
from .limits import (CappedReader, LimitExceeded, check_settings, cut_long_names, decompressed_cap, max_expansion,
                     memory_budget, memory_limit, over_memory_message, text)
from .profiler import is_kineto, is_memory_timeline, kineto_to_trace, memory_timeline_to_trace
from .progress import ProgressReader
from .snapshot import SnapshotError, is_snapshot, snapshot_to_trace
from .unpickle import RefusedGlobal, restricted_load

__all__ = ["load", "read_document", "LoadError"]

GZIP_MAGIC = b"\x1f\x8b"
UTF8_BOM = b"\xef\xbb\xbf"


def load(path, progress=None, use_cache=True, window=None, write_behind=False) -> Trace:
    """Open a snapshot (pickle or JSON, optionally gzip'd) or a profiler trace.

    `progress(fraction, message)` is called while reading; it may raise
    `Cancelled`. A columnar cache makes the second open of a file fast.
    `window` (a tracekit.analysis.window.Window): when the file is not in the cache, is big (see
    WINDOW_READ_BYTES) or not to be cached, and the streaming reader takes it, only the window's
    entries are kept (see stream.py; the caller cuts with window.select, which finishes that cut);
    else the whole trace, cached as usual.
    `write_behind`: the cache's entry is written on a thread of its own (the caller's analysis runs beside it;
    cache.folder.wait_written() waits for it; it is finished before the process exits).
    """
    path = os.fsdecode(os.fspath(path))  # bytes names become str (undecodable bytes as surrogates)
    check_settings(use_cache)
    st = _stat(path)
    # the key: at once when the file was opened before, else hashed on the other core while it is read
    pending = _folder.key_soon(path) if use_cache else None
    done = pending is not None and pending.done()
    key = pending.result() if pending is not None and done else None
    if key:
        trace = _cache.read(key, path)
        if trace is not None:
            if progress:
                progress(1.0, "loaded from cache")
            return trace
    caching = bool(key) or (pending is not None and not done)
    zipped = _head(path, 2) == GZIP_MAGIC
    budget, why = memory_budget(st.st_size * (min(max_expansion(), 40) if zipped else 1))
    try:
        with memory_limit(budget):
            big = st.st_size * (10 if zipped else 1) >= WINDOW_READ_BYTES
            trace = _windowed(path, st, progress, window) if window and (big or not caching) else None
            if trace is not None:
                cut_long_names(trace)
                return trace  # a part of the file: not cached
            trace = _read_and_convert(path, st, progress)
            cut_long_names(trace)
    except MemoryError:
        raise LoadError(path, over_memory_message(budget, why)) from None
    if caching and not key and pending is not None:
        key = pending.result()
    if key:
        (_cache.write_soon if write_behind else _cache.write)(key, trace)
    return trace


def _read_and_convert(path, st, progress) -> Trace:
    # (glibc's own, growing threshold for giving freed blocks back, not stream.return_large_frees(): a
    # whole-file open faults every large temporary in afresh with it; on a 10M-entry report 2.5 s more
    # system time for 1.6% less peak memory; a window's read, where memory is the point, still sets it)
    fx = has_fx_frames(path, st.st_size)  # torch.compile's frames carry their graph's source: the Python path
    trace = None if fx else _streamed(path, st, progress)  # keeps them (columns.expand_fx_frames)
    if trace is not None:
        return trace
    obj, kind = read_document(path, progress, size=st.st_size)
    try:
        token = FX_FRAMES.set(fx)
        try:
            trace = to_trace(obj, path, progress)
        finally:
            FX_FRAMES.reset(token)
        trace.meta.update(container=kind, file_bytes=st.st_size, reader=_stream.PYTHON)
        return trace
    except (Cancelled, LoadError, MemoryError):
        raise
    except LimitExceeded as e:
        raise LoadError(path, str(e)) from None
    except RecursionError:
        raise LoadError(path, "it is nested too deeply to be a memory snapshot") from None
    except Exception as e:  # any other wrong shape: say what we can, never a traceback
        raise LoadError(path, _not_a_trace(obj, kind, e)) from None
    finally:
        del obj


FX_KEY = b"fx_original_trace"
FX_SCAN_MAX_BYTES = 1 << 30  # files larger than this are not searched for compiled frames
FX_SCAN_MAX_GZIP_BYTES = 64 << 20  # nor gzip'd files larger than this (decompressing twice costs)


def has_fx_frames(path, size) -> bool:
    """Whether the file's frames carry torch.compile's FX metadata (`fx_original_trace`: the source lines of
    the graph node a generated frame ran, added by `torch.cuda.memory._snapshot(augment_with_fx_traces=True)`).
    A byte search of the file (decompressed in pieces when gzip'd); False for files over FX_SCAN_MAX_BYTES."""
    if size > FX_SCAN_MAX_BYTES:
        return False
    try:
        with _open(path) as raw:
            zipped = raw.read(2) == GZIP_MAGIC
            if zipped and size > FX_SCAN_MAX_GZIP_BYTES:
                return False
            raw.seek(0)
            if not zipped and size:
                import mmap

                try:
                    with mmap.mmap(raw.fileno(), 0, access=mmap.ACCESS_READ) as m:
                        return m.find(FX_KEY) >= 0
                except (OSError, ValueError, AttributeError):  # not a regular file: read it in pieces below
                    raw.seek(0)
            stream = gzip.GzipFile(fileobj=raw, mode="rb") if zipped else raw
            tail = b""
            while True:
                piece = stream.read(16 << 20)
                if not piece:
                    return False
                if FX_KEY in tail + piece[:len(FX_KEY)] or FX_KEY in piece:
                    return True
                tail = piece[-len(FX_KEY):]
    except (OSError, EOFError, ValueError, gzip.BadGzipFile, zlib.error):
        return False  # a damaged file: the reader says what is wrong with it


# A window of a file this big (uncompressed, about 2M entries) is read alone when the file is not in the
# cache; a smaller one is read whole and cached, so that the next look at it (any window) is quick.
WINDOW_READ_BYTES = 256 << 20


def _windowed(path, st, progress, window):
    """The window's entries from the streaming reader (None: it cannot pick them, read it all).

    --from/--to are known before reading: one pass. --last needs the file's last time first: a pass
    that keeps nothing, then the one that keeps the window. --iterations: a pass that keeps the runs of
    one user_metadata and the unmarked entries' times only, from which `window.marked_ranges` finds each
    device's entries (None when our recorder did not mark the iterations: the file is read whole; the
    cut says so)."""
    if not _stream.enabled() or (window.iterations is not None and window.last_us is not None):
        return None
    _stream.return_large_frees()
    first = window.first or 0
    hi = 2**62 if window.last is None else window.last + 1
    threshold, span, ranges = None, (0.0, 0.95), b""
    if window.iterations is not None:
        marks = _streamed(path, st, progress, _stream.MARKS, (0.0, 0.45))
        found = window.marked_ranges(marks) if marks is not None else None
        if found is None:
            return None
        del marks
        top = max(found, default=-1)
        pairs = [found.get(dl, (2**62, 0)) for dl in range(top + 1)]  # lists without entries keep nothing
        ranges, span = array.array("q", [v for p in pairs for v in p]).tobytes(), (0.45, 0.95)
    elif window.last_us is not None:
        counted = _streamed(path, st, progress, _stream.NOTHING, (0.0, 0.45))
        folds = counted.meta["streamed_window"].values() if counted is not None else ()
        times = [f["tmax"] for f in folds if f["tmax"] != int(NO_TIME)]
        if not times:  # no times (the cut says so) or not streamable: the whole file
            return None
        threshold, span = max(times) - window.last_us, (0.45, 0.95)
    return _streamed(path, st, progress, (first, hi, threshold, ranges), span)


def first_pass(path) -> Trace | None:
    """The streaming reader's pass that keeps no entry: a Trace with the file's segments and, in
    meta["streamed_window"], per device its entries, first and last time and user_metadata strings;
    None when the compiled scanner is not built or leaves the file to the restricted unpickler."""
    path = os.fsdecode(os.fspath(path))
    st = os.stat(path)
    budget, _ = memory_budget(st.st_size * (min(max_expansion(), 40) if _head(path, 2) == GZIP_MAGIC else 1))
    try:
        with memory_limit(budget):
            return _streamed(path, st, None, _stream.NOTHING)
    except MemoryError:
        return None


def _streamed(path, st, progress, keep=None, span=(0.0, 0.95)):
    """The Trace from the streaming reader (stream.py), or None when it is not built, turned off, or
    leaves this file to the restricted unpickler (which then reads or refuses it as always)."""
    if not _stream.enabled():
        return None
    with _open(path) as raw:
        zipped = raw.read(2) == GZIP_MAGIC
        raw.seek(0)
        reader = ProgressReader(raw, st.st_size, progress, span=span, message="reading") if progress else raw
        try:
            trace, kind = _stream.read(path, reader, zipped, st.st_size, snapshot_to_trace, keep)
        except (Cancelled, MemoryError):
            raise
        except Exception:  # Unsupported, a corrupt gzip stream, a limit: the old path says what is wrong
            return None
    trace.meta.update(container=("gzip-compressed " if zipped else "") + kind, file_bytes=st.st_size,
                      reader=_stream.COMPILED if keep is None else _stream.COMPILED_WINDOW)
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
    msg = str(error)
    if msg and isinstance(error, ValueError):  # SnapshotError and the loaders' ValueErrors say what is wrong
        return f"it is not a valid memory snapshot: {_short(msg, 400)}"
    if msg:
        return f"it is not a valid memory file ({type(error).__name__}: {_short(msg)})"
    if isinstance(obj, dict):
        keys = ", ".join(repr(k[:40]) if isinstance(k, str) else text(k) for k in list(obj)[:6]) or "none"
        return (f"it is a {kind} dict without 'segments' or 'traceEvents' (keys: {keys}), "
                "so it is neither a PyTorch memory snapshot nor a profiler trace")
    return (f"it is a {kind} {type(obj).__name__}, not a PyTorch memory snapshot "
            "(expected a dict with 'segments', a profiler trace, or a memory timeline)")


def _stat(path):
    try:
        st = os.stat(path)
    except FileNotFoundError:
        raise LoadError(path, "no such file") from None
    except PermissionError:
        raise LoadError(path, "permission denied") from None
    except (OSError, ValueError) as e:
        raise LoadError(path, getattr(e, "strerror", None) or str(e)) from None
    if _stat_mod.S_ISDIR(st.st_mode):
        raise LoadError(path, "it is a directory, not a file")
    if not _stat_mod.S_ISREG(st.st_mode):
        mode = st.st_mode
        kind = ("a named pipe (FIFO)" if _stat_mod.S_ISFIFO(mode) else "a socket" if _stat_mod.S_ISSOCK(mode)
                else "a device" if _stat_mod.S_ISCHR(mode) or _stat_mod.S_ISBLK(mode) else "a special file")
        raise LoadError(path, f"it is {kind}, not a regular file (save the data to a file and open that)")
    if st.st_size == 0:
        raise LoadError(path, "the file is empty (0 bytes)")
    return st


def _open(path):
    try:
        return _folder.open_regular(path)
    except IsADirectoryError:
        raise LoadError(path, "it is not a regular file (save the data to a file and open that)") from None
    except OSError as e:
        raise LoadError(path, e.strerror or str(e)) from None


def _head(path, n) -> bytes:
    with _open(path) as f:
        return f.read(n)


def read_document(path, progress=None, size=None):
    """Decode a file to Python data. Returns (object, kind) with kind "pickle" or "JSON"."""
    size = size if size is not None else _stat(path).st_size
    with _open(path) as raw:
        head = raw.read(3)
        raw.seek(0)
        zipped = head[:2] == GZIP_MAGIC
        reader = ProgressReader(raw, size, progress, span=(0.0, 0.8)) if progress else raw
        stream = CappedReader(gzip.GzipFile(fileobj=reader, mode="rb"), *decompressed_cap(size)) if zipped else reader
        first = b""
        try:
            first = _first_bytes(stream)
            prefix = "gzip-compressed " if zipped else ""
            if first.startswith(UTF8_BOM) or first[:1] in b"{[ \t\r\n":
                return _read_json(stream, path), prefix + "JSON"
            if first[:1] in b"\x80(]}":
                return _read_pickle(stream, path, zipped), prefix + "pickle"
        except (LoadError, Cancelled, MemoryError):
            raise
        except LimitExceeded as e:
            raise LoadError(path, str(e)) from None
        except Exception as e:  # gzip.BadGzipFile, EOFError, zlib.error, OSError, ...
            if not zipped:
                raise LoadError(path, f"it could not be read ({e})") from None
            raise LoadError(path, f"it is a gzip file that is truncated or corrupt ({e})") from None
    shown = " ".join(f"{b:02x}" for b in (head[:2] + first[:1] if zipped else head[:3]))
    wrapped = "gzip-compressed data that is" if zipped else "a file that is"
    raise LoadError(path, f"{wrapped} neither a pickle nor JSON (it starts with bytes {shown}); "
                          "expected a PyTorch memory snapshot or profiler trace")


def _first_bytes(stream) -> bytes:
    if hasattr(stream, "peek"):
        b = stream.peek(3)[:3]
    else:
        b = stream.read(3)
        stream.seek(0)
    if not b:
        raise EOFError("no data after decompression")
    return b


def _read_pickle(stream, path, zipped):
    try:
        return restricted_load(stream)
    except (Cancelled, LimitExceeded, MemoryError):
        raise
    except RefusedGlobal as e:
        raise LoadError(path, f"it is a pickle that asks to import {_short(e.module)}.{_short(e.name)}; refused, "
                              "nothing was executed (memory snapshots hold only plain data, so this file is "
                              "not one)") from None
    except (EOFError, gzip.BadGzipFile, OSError) as e:
        if zipped and (str(e) or not isinstance(e, EOFError)):  # the compressed stream broke, not the pickle
            raise LoadError(path, f"it is a gzip file that is truncated or corrupt ({e})") from None
        raise LoadError(path, "it is truncated: the pickle data ends before its end marker") from None
    except pickle.UnpicklingError as e:
        msg = str(e)
        if "truncated" in msg:
            raise LoadError(path, "it is truncated: the pickle data ends before its end marker") from None
        raise LoadError(path, f"it is a corrupt pickle ({_short(msg)})") from None
    except RecursionError:
        raise LoadError(path, "it is a pickle nested too deeply to be a memory snapshot") from None
    except Exception as e:  # zlib.error, ValueError, struct.error, OverflowError, UnicodeDecodeError, ...
        if zipped and type(e).__name__ == "error" and "zlib" in type(e).__module__:
            raise LoadError(path, f"it is a gzip file that is truncated or corrupt ({e})") from None
        raise LoadError(path, f"it is a corrupt pickle ({type(e).__name__}: {_short(str(e))})") from None


def _read_json(stream, path):
    data = stream.read()
    try:
        text = data.decode("utf-8-sig")  # a leading byte-order mark is allowed
    except UnicodeDecodeError as e:
        raise LoadError(path, f"it looks like JSON but is not UTF-8 text (byte {e.start})") from None
    del data
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        where = "it is truncated JSON" if e.pos >= len(text.rstrip()) else "it is not valid JSON"
        raise LoadError(path, f"{where}: {e.msg} at line {e.lineno} column {e.colno}") from None
    except RecursionError:
        raise LoadError(path, "it is JSON nested too deeply to be a memory snapshot") from None
    except ValueError as e:  # e.g. an integer with more digits than Python converts
        raise LoadError(path, f"it is not valid JSON ({_short(str(e))})") from None


def _short(s, n=200) -> str:
    s = str(s).replace("\n", " ")
    return s if len(s) <= n else s[:n] + "..."


def _scaled(progress, lo, hi):
    if progress is None:
        return None
    return lambda f, msg: progress(lo + (hi - lo) * f, msg)
