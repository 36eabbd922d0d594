"""A compact columnar cache of opened files, so the second open is fast.

One uncompressed .npz per file under the user cache folder
($TRACEKIT_CACHE_DIR, else $XDG_CACHE_HOME/tracekit, ~/.cache/tracekit,
~/Library/Caches/tracekit or %LOCALAPPDATA%/tracekit/Cache). The key is the
file's identity: resolved path, size, mtime, inode and a hash of its first and
last 64 KiB, so a changed file never meets a stale cache. Read with
allow_pickle=False: a tampered cache can fail, never run code. Any problem
with the cache means "no cache", never an error. The least recently used
files go once the folder passes $TRACEKIT_CACHE_MAX_MB (default 1024).
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import tempfile
import zipfile

import numpy as np

from ..model import Blocks, Events, Frames, Segments, Stacks, Strings, Trace

VERSION = 3  # bump whenever Trace or meta layout changes (3: memory-timeline device label)
_TABLES = {"ev": Events, "fr": Frames, "st": Stacks, "sg": Segments, "bl": Blocks}


def cache_dir() -> str:
    if os.environ.get("TRACEKIT_CACHE_DIR"):
        return os.environ["TRACEKIT_CACHE_DIR"]
    if sys.platform == "darwin":
        return os.path.expanduser("~/Library/Caches/tracekit")
    if sys.platform == "win32":
        return os.path.join(os.environ.get("LOCALAPPDATA", os.path.expanduser("~")), "tracekit", "Cache")
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tracekit")


def key_for(path, stat) -> str | None:
    """Identity of the file's current content, or None if it cannot be read."""
    try:
        h = hashlib.sha256()
        h.update(f"{VERSION}|{os.path.realpath(path)}|{stat.st_size}|{stat.st_mtime_ns}|{stat.st_ino}".encode())
        with open(path, "rb") as f:
            h.update(f.read(65536))
            if stat.st_size > 65536:
                f.seek(max(stat.st_size - 65536, 65536))
                h.update(f.read(65536))
        return h.hexdigest()[:32]
    except OSError:
        return None


def _file(key) -> str:
    return os.path.join(cache_dir(), f"{key}.npz")


def write(key, trace: Trace) -> None:
    """Store a trace; failures are ignored (the cache is an optimisation)."""
    arrays = {}
    for prefix, table in _TABLES.items():
        obj = getattr(trace, {"ev": "events", "fr": "frames", "st": "stacks", "sg": "segments", "bl": "blocks"}[prefix])
        for name in table.__dataclass_fields__:
            arrays[f"{prefix}_{name}"] = getattr(obj, name)
    head = {"key": key, "path": trace.path, "format": trace.format, "devices": trace.devices,
            "strings": trace.strings.items, "meta": trace.meta}
    try:
        blob = json.dumps(head, default=_jsonable).encode()
        arrays["head"] = np.frombuffer(blob, dtype=np.uint8)
        os.makedirs(cache_dir(), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache_dir(), suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, _file(key))
        evict(max_bytes())
    except (OSError, TypeError, ValueError):
        try:
            os.unlink(tmp)
        except (OSError, UnboundLocalError):
            pass


def read(key, path) -> Trace | None:
    """The cached trace for `key`, or None (missing, stale, corrupt or another version)."""
    fn = _file(key)
    if not os.path.exists(fn):
        return None
    try:
        os.utime(fn)  # "recently used" for eviction, whatever the filesystem's atime policy
    except OSError:
        pass
    try:
        with np.load(fn, allow_pickle=False) as z:
            head = json.loads(bytes(z["head"]).decode())
            if head.get("key") != key:
                return None
            tables = {}
            for prefix, table in _TABLES.items():
                tables[prefix] = table(**{n: z[f"{prefix}_{n}"] for n in table.__dataclass_fields__})
        meta = _restore_int_keys(head["meta"])
        return Trace(path=str(path), format=head["format"], devices=head["devices"],
                     strings=Strings(head["strings"]), frames=tables["fr"], stacks=tables["st"],
                     events=tables["ev"], segments=tables["sg"], blocks=tables["bl"], meta=meta)
    except (OSError, ValueError, KeyError, TypeError, zipfile.BadZipFile, EOFError):
        try:
            os.unlink(fn)
        except OSError:
            pass
        return None


def max_bytes() -> int:
    """The cache's size limit: $TRACEKIT_CACHE_MAX_MB, default 1 GiB."""
    try:
        return int(float(os.environ.get("TRACEKIT_CACHE_MAX_MB", 1024)) * 2**20)
    except ValueError:
        return 2**30


def evict(limit: int) -> None:
    """Delete the least recently used cached files until the folder holds at most `limit` bytes."""
    d = cache_dir()
    files = []
    for name in os.listdir(d):
        if name.endswith(".npz"):
            st = os.stat(os.path.join(d, name))
            files.append((st.st_mtime, st.st_size, name))
    total = sum(size for _, size, _ in files)
    for _, size, name in sorted(files):
        if total <= limit:
            break
        os.unlink(os.path.join(d, name))
        total -= size


def clear() -> int:
    """Delete every cached file; returns how many were removed."""
    n = 0
    d = cache_dir()
    if os.path.isdir(d):
        for name in os.listdir(d):
            if name.endswith((".npz", ".tmp")):
                try:
                    os.unlink(os.path.join(d, name))
                    n += 1
                except OSError:
                    pass
    return n


def _jsonable(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    if isinstance(o, bytes):
        return o.decode("utf-8", "replace")
    return repr(o)


def _restore_int_keys(meta):
    """JSON turns int dict keys into strings; put back the ones we store per device."""
    for k in ("initial_allocated", "initial_reserved", "device_labels"):
        if isinstance(meta.get(k), dict):
            meta[k] = {int(d): v for d, v in meta[k].items()}
    return meta
