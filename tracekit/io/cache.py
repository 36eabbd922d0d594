"""A compact columnar cache of opened files, so the second open is fast.

One uncompressed .npz per file under the user cache folder
($TRACEKIT_CACHE_DIR, else $XDG_CACHE_HOME/tracekit, ~/.cache/tracekit,
~/Library/Caches/tracekit or %LOCALAPPDATA%/tracekit/Cache). The key is a
SHA-256 of the file's whole content (about 0.1 s per 100 MiB), so no edit —
same size, restored mtime, anywhere in the file — can meet a stale entry, and
a copy or rename of a file still finds it. Metadata is stored in a tagged
JSON that keeps tuples, sets, bytes and non-string keys exactly.

Reading is defensive: the entry must be a regular file (a FIFO never blocks
us), it is opened with allow_pickle=False (a tampered cache cannot run code),
every array must have its expected name, dtype and shape and match the
SHA-256 written with it, and ids must point inside their tables. Anything odd is a miss, and the entry is deleted. The
least recently used files go once the folder passes $TRACEKIT_CACHE_MAX_MB
(default 1024; a non-negative number, else a one-line error).
"""
from __future__ import annotations

import base64
import hashlib
import json
import os
import stat as _stat
import sys
import tempfile

import numpy as np

from ..model import ACTIONS, BLOCK_STATES, Blocks, Events, Frames, Segments, Stacks, Strings, Trace
from .limits import env_number

VERSION = 5  # bump whenever Trace or meta layout changes (4: memory-timeline device label, 5: origins)
_TABLES = {"ev": ("events", Events), "fr": ("frames", Frames), "st": ("stacks", Stacks),
           "sg": ("segments", Segments), "bl": ("blocks", Blocks)}
_I32, _I64, _U64, _I8 = np.dtype(np.int32), np.dtype(np.int64), np.dtype(np.uint64), np.dtype(np.int8)
DTYPES = {
    "ev": {"device": _I32, "index": _I64, "action": _I8, "addr": _U64, "size": _I64, "stream": _I64,
           "time_us": _I64, "stack_id": _I32, "user_metadata": _I32, "compile_context": _I32,
           "category": _I32, "device_free": _I64, "forward_stack_id": _I32, "module": _I32},
    "fr": {"filename": _I32, "line": _I32, "name": _I32},
    "st": {"offsets": _I64, "frame_ids": _I32},
    "sg": {"device": _I32, "address": _U64, "total_size": _I64, "stream": _I64, "segment_type": _I32,
           "pool_id": _I32, "is_expandable": np.dtype(bool), "stack_id": _I32},
    "bl": {"device": _I32, "segment": _I32, "addr": _U64, "size": _I64, "requested_size": _I64,
           "state": _I8, "stack_id": _I32},
}


class Odd(Exception):
    """A cache entry that is not exactly what `write` makes."""


def cache_dir() -> str:
    if os.environ.get("TRACEKIT_CACHE_DIR"):
        return os.environ["TRACEKIT_CACHE_DIR"]
    if sys.platform == "darwin":
        return os.path.expanduser("~/Library/Caches/tracekit")
    if sys.platform == "win32":
        return os.path.join(os.environ.get("LOCALAPPDATA", os.path.expanduser("~")), "tracekit", "Cache")
    return os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "tracekit")


def max_bytes() -> int:
    """The cache's size limit: $TRACEKIT_CACHE_MAX_MB (a number >= 0), default 1 GiB."""
    return int(env_number("TRACEKIT_CACHE_MAX_MB", 1024.0, minimum=0.0) * 2**20)


def open_regular(path):
    """Open a file for reading without ever blocking: a FIFO, device or socket raises OSError."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0)
    fd = os.open(path, flags)
    try:
        if not _stat.S_ISREG(os.fstat(fd).st_mode):
            raise IsADirectoryError(f"{os.fsdecode(path)} is not a regular file")
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def key_for(path, stat) -> str | None:
    """Identity of the file's current content (a hash of all of it), or None if it cannot be read."""
    try:
        h = hashlib.sha256(f"tracekit-cache {VERSION} {stat.st_size}\n".encode())
        with open_regular(path) as f:
            while chunk := f.read(4 * 2**20):
                h.update(chunk)
        return h.hexdigest()[:40]
    except (OSError, ValueError):
        return None


def _file(key) -> str:
    return os.path.join(cache_dir(), f"{key}.npz")


def write(key, trace: Trace) -> None:
    """Store a trace; failures are ignored (the cache is an optimisation)."""
    tmp = None
    try:
        arrays = {}
        for prefix, (attr, table) in _TABLES.items():
            obj = getattr(trace, attr)
            for name in table.__dataclass_fields__:
                arrays[f"{prefix}_{name}"] = np.ascontiguousarray(getattr(obj, name), dtype=DTYPES[prefix][name])
        head = {"key": key, "format": trace.format, "devices": [int(d) for d in trace.devices],
                "strings": trace.strings.items, "meta": encode(trace.meta), "digest": _digest(arrays)}
        arrays["head"] = np.frombuffer(json.dumps(head).encode(), dtype=np.uint8)
        os.makedirs(cache_dir(), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache_dir(), suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
        os.replace(tmp, _file(key))
        tmp = None
        evict(max_bytes())
    except (OSError, TypeError, ValueError, RecursionError, MemoryError):
        if tmp:
            try:
                os.unlink(tmp)
            except OSError:
                pass


def read(key, path) -> Trace | None:
    """The cached trace for `key`, or None (missing, stale, corrupt, odd or another version: deleted)."""
    fn = _file(key)
    try:
        st = os.lstat(fn)
    except OSError:
        return None
    try:
        if not _stat.S_ISREG(st.st_mode):
            raise Odd("not a regular file")
        with open_regular(fn) as f, np.load(f, allow_pickle=False) as z:
            names = set(z.files)
            expected = {"head"} | {f"{p}_{n}" for p, fields in DTYPES.items() for n in fields}
            if names != expected:
                raise Odd("unexpected members")
            head = json.loads(bytes(_array(z, "head", np.dtype(np.uint8))).decode())
            if not isinstance(head, dict) or head.get("key") != key:
                raise Odd("another key")
            arrays = {f"{p}_{n}": _array(z, f"{p}_{n}", dtype) for p, fields in DTYPES.items()
                      for n, dtype in fields.items()}
        if head.get("digest") != _digest(arrays):
            raise Odd("the arrays are not the ones written")
        tables = {p: table(**{n: arrays[f"{p}_{n}"] for n in table.__dataclass_fields__})
                  for p, (_, table) in _TABLES.items()}
        strings, devices, fmt = head["strings"], head["devices"], head["format"]
        if not (isinstance(strings, list) and strings[:1] == [""] and all(type(s) is str for s in strings)
                and isinstance(devices, list) and all(type(d) is int for d in devices) and type(fmt) is str):
            raise Odd("bad head")
        trace = Trace(path=str(path), format=fmt, devices=devices, strings=Strings(strings),
                      frames=tables["fr"], stacks=tables["st"], events=tables["ev"], segments=tables["sg"],
                      blocks=tables["bl"], meta=decode(head["meta"]))
        if not isinstance(trace.meta, dict):
            raise Odd("bad meta")
        check_consistent(trace)
    except Exception:  # whatever is wrong with it, it is a miss: delete it so the next open rewrites it
        _unlink(fn)
        return None
    try:
        os.utime(fn)  # "recently used" for eviction, whatever the filesystem's atime policy
    except OSError:
        pass
    return trace


def _digest(arrays) -> str:
    """SHA-256 of the arrays' names, dtypes, shapes and bytes: a changed or damaged entry never passes."""
    h = hashlib.sha256()
    for name in sorted(arrays):
        a = np.ascontiguousarray(arrays[name])
        h.update(f"{name} {a.dtype.str} {a.shape}\n".encode())
        h.update(memoryview(a).cast("B"))
    return h.hexdigest()


def _array(z, name, dtype):
    a = z[name]
    if a.dtype != dtype or a.ndim != 1:
        raise Odd(f"{name} is {a.dtype}{a.shape}")
    return a


def check_consistent(t: Trace) -> None:
    """Raise Odd unless every table has consistent lengths and every id points inside its table."""
    def within(a, lo, hi, what):
        if len(a) and (int(a.min()) < lo or int(a.max()) >= hi):
            raise Odd(what)

    def same_length(obj, what):
        if len({len(v) for v in vars(obj).values()}) > 1:
            raise Odd(f"{what} columns differ in length")

    for obj, what in ((t.events, "events"), (t.frames, "frames"), (t.segments, "segments"), (t.blocks, "blocks")):
        same_length(obj, what)
    ns, nf, nst = len(t.strings), len(t.frames), len(t.stacks)
    off = t.stacks.offsets
    if not len(off) or off[0] != 0 or off[-1] != len(t.stacks.frame_ids) or (np.diff(off) < 0).any():
        raise Odd("stack offsets")
    within(t.stacks.frame_ids, 0, nf, "frame ids")
    for col in (t.frames.filename, t.frames.name, t.events.user_metadata, t.events.compile_context,
                t.events.category, t.events.module, t.segments.segment_type, t.segments.pool_id):
        within(col, 0, ns, "string ids")
    for col in (t.events.stack_id, t.events.forward_stack_id, t.segments.stack_id, t.blocks.stack_id):
        within(col, -1, nst, "stack ids")
    within(t.events.action, 0, len(ACTIONS), "actions")
    within(t.blocks.state, 0, len(BLOCK_STATES), "block states")
    within(t.blocks.segment, 0, len(t.segments), "block segments")
    for col in (t.events.size, t.segments.total_size, t.blocks.size, t.blocks.requested_size):
        within(col, 0, 2**50 + 1, "sizes")
    if len(t.events.device) and (np.diff(t.events.device) < 0).any():
        raise Odd("events not sorted by device")
    present = set(np.unique(t.events.device).tolist()) | set(np.unique(t.segments.device).tolist())
    if sorted(present) != t.devices:
        raise Odd("devices")


def evict(limit: int) -> None:
    """Delete the least recently used cached files until the folder holds at most `limit` bytes."""
    d = cache_dir()
    files = []
    for name in os.listdir(d):
        if name.endswith(".npz"):
            try:
                st = os.lstat(os.path.join(d, name))
            except OSError:
                continue
            files.append((st.st_mtime, st.st_size, name))
    total = sum(size for _, size, _ in files)
    for _, size, name in sorted(files):
        if total <= limit:
            break
        _unlink(os.path.join(d, name))
        total -= size


def clear() -> int:
    """Delete every cached file; returns how many were removed."""
    n = 0
    d = cache_dir()
    if os.path.isdir(d):
        for name in os.listdir(d):
            if name.endswith((".npz", ".tmp")) and _unlink(os.path.join(d, name)):
                n += 1
    return n


def _unlink(fn) -> bool:
    try:
        os.unlink(fn)
        return True
    except OSError:
        return False


# -- metadata, exactly -------------------------------------------------------------------------------
# Plain JSON for str, int, float, bool, None, lists and dicts with string keys; everything else that a
# restricted unpickler can make is tagged: {"~": kind, "v": value}. (A dict with a "~" key is tagged too.)

def encode(o):
    t = type(o)
    if o is None or t in (str, bool, int, float):
        return o
    if t is list:
        return [encode(v) for v in o]
    if t is dict:
        if all(type(k) is str for k in o) and "~" not in o:
            return {k: encode(v) for k, v in o.items()}
        return {"~": "dict", "v": [[encode(k), encode(v)] for k, v in o.items()]}
    if t is tuple:
        return {"~": "tuple", "v": [encode(v) for v in o]}
    if t in (set, frozenset):
        return {"~": t.__name__, "v": [encode(v) for v in o]}
    if t in (bytes, bytearray):
        return {"~": t.__name__, "v": base64.b64encode(o).decode()}
    if isinstance(o, np.generic):
        return encode(o.item())
    raise TypeError(f"cannot cache a {t.__name__}")


def decode(o):
    t = type(o)
    if t is list:
        return [decode(v) for v in o]
    if t is not dict:
        return o
    if "~" not in o:
        return {k: decode(v) for k, v in o.items()}
    kind, v = o["~"], o["v"]
    if kind == "dict":
        return {decode(k): decode(x) for k, x in v}
    if kind in ("tuple", "set", "frozenset"):
        return {"tuple": tuple, "set": set, "frozenset": frozenset}[kind](decode(x) for x in v)
    if kind in ("bytes", "bytearray"):
        return {"bytes": bytes, "bytearray": bytearray}[kind](base64.b64decode(v))
    raise Odd(f"unknown tag {kind!r}")
