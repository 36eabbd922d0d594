"""A compact columnar cache of opened files, so the second open is fast.

One file per opened file under the user cache folder ($TRACEKIT_CACHE_DIR,
else $XDG_CACHE_HOME/tracekit, ~/.cache/tracekit, ~/Library/Caches/tracekit
or %LOCALAPPDATA%/tracekit/Cache): a small JSON head, then each column as raw
bytes at a 64-byte aligned offset, which a read maps into memory (copy on
write) instead of reading or decompressing it. Results computed from a trace
(the report) are stored beside it under the same key (`result`, `store_result`).

The key is a SHA-256 of the file's whole content, so no edit can meet a stale
entry and a copy or rename of a file still finds it. Hashing a large file on
every open would cost more than the rest of a warm open, so the key is
remembered under a fingerprint of the file: device, inode, size, mtime and
*ctime* (in ns) plus its first and last 64 KiB. Any write to a file, and any
utime() that puts its mtime back, moves its ctime to the present (no user can
set it), so a same-size edit with the mtime restored gets a new fingerprint,
hence a full hash. A fingerprint is not remembered while the file's times are
within 2 s of now (an edit inside one tick of a coarse clock would keep them),
nor on Windows, whose st_ctime is the creation time: there every open hashes.

Reading is defensive: the entry must be a regular file (a FIFO never blocks
us); its head must pass its CRC and name exactly the expected columns, dtypes
and lengths; the file must be exactly as long as the head says (truncated =
miss); each whole column must match the checksum written with it (`column_sum`:
the CRC-32 of its 4 KiB blocks' 64-bit sums, so that it runs at memory speed,
about 10 GB/s, where zlib's CRC-32 of every byte runs at 1.5-2; checked on every
read; the whole column's CRC-32 is also checked once, when written, before the
entry is renamed into place); every id must point inside its table.
Anything odd is a miss, and the entry is deleted: the file is read afresh and
its entry written again. No pickle is ever read. The least recently
used entries go once the folder passes $TRACEKIT_CACHE_MAX_MB (default 4096;
a non-negative number, else a one-line error).
"""
from __future__ import annotations

import base64
import json
import mmap
import os
import stat as _stat
import struct
import tempfile
import threading
import zlib
from typing import Any

import numpy as np

from .folder import (SAMPLE, SUFFIX, VERSION, Odd, _file, _remembered, _touch, _unlink, cache_dir,  # noqa: F401
                          key_for, open_regular, result, store_result, writing)
from ...model import (ACTIONS, BLOCK_STATES, Blocks, Events, Frames, Segments, Stacks, Strings, Trace,
                      constant_column, is_constant)
from ..limits import env_number

MAGIC = b"TKCACHE9"  # 9: a one-valued column stored as its value; 8: events.index in int32 (7: each column's checksum covers all of it; 6: its first and last 64 KiB)
_PRE = struct.Struct("<8sQI")  # magic, head length, head CRC-32
ALIGN = 64
_TABLES: dict[str, tuple[str, Any]] = {"ev": ("events", Events), "fr": ("frames", Frames), "st": ("stacks", Stacks),
           "sg": ("segments", Segments), "bl": ("blocks", Blocks)}
_I32, _I64, _U64, _I8 = np.dtype(np.int32), np.dtype(np.int64), np.dtype(np.uint64), np.dtype(np.int8)
DTYPES: dict[str, dict[str, np.dtype]] = {
    "ev": {"device": _I32, "index": _I32, "action": _I8, "addr": _U64, "size": _I64, "stream": _I64,
           "time_us": _I64, "stack_id": _I32, "user_metadata": _I32, "compile_context": _I32,
           "category": _I32, "device_free": _I64, "forward_stack_id": _I32, "module": _I32},
    "fr": {"filename": _I32, "line": _I32, "name": _I32},
    "st": {"offsets": _I64, "frame_ids": _I32},
    "sg": {"device": _I32, "address": _U64, "total_size": _I64, "stream": _I64, "segment_type": _I32,
           "pool_id": _I32, "is_expandable": np.dtype(bool), "stack_id": _I32},
    "bl": {"device": _I32, "segment": _I32, "addr": _U64, "size": _I64, "requested_size": _I64,
           "state": _I8, "stack_id": _I32},
}
_BESIDE = (".json", ".tkm")  # results stored beside a trace: reports.py, memo.py
COLUMNS = {f"{p}_{n}": dtype for p, fields in DTYPES.items() for n, dtype in fields.items()}


def max_bytes() -> int:
    """The cache's size limit: $TRACEKIT_CACHE_MAX_MB (a number >= 0), default 4 GiB (a 10M-entry file with its analysis
    takes about 1.5 GiB)."""
    return int(env_number("TRACEKIT_CACHE_MAX_MB", 4096.0, minimum=0.0) * 2**20)


# -- the entry's layout -------------------------------------------------------------------------------

BLOCK = 4096  # bytes per summed block of a column


def column_sum(buf) -> int:
    """A column's checksum: the CRC-32 of the 64-bit (wrapping) sums of its 4 KiB blocks, then of the bytes
    past the last whole block. Any damage inside one block changes that block's sum (a change of one 8-byte
    word always does), and the CRC of the sums sees which block changed: a damaged, zeroed, swapped or
    repeated page is seen; only words reordered inside one block, or changes that cancel in a block's sum,
    are not."""
    buf = memoryview(buf).cast("B")
    whole = len(buf) // BLOCK * BLOCK
    crc = 0
    if whole:
        words = np.frombuffer(buf, np.uint64, count=whole // 8)
        crc = zlib.crc32(words.reshape(-1, BLOCK // 8).sum(axis=1, dtype=np.uint64).tobytes())
    return zlib.crc32(buf[whole:], crc)


def pack(fn, arrays: dict, head: dict, sums: dict | None = None, verify: bool = True, consume: bool = False) -> None:
    """Write `arrays` (1-d numpy arrays) and `head` (JSON-ready) to `fn` in the entry layout, then (`verify`)
    read the written file back and check every column's CRC-32 (raises Odd if one differs); the head keeps
    each column's `column_sum`, which `unpack` checks. `sums` overrides the stored sums (to make a damaged
    entry). Without `verify` a bad write is found by `unpack` instead (for entries a miss only recomputes:
    the analysis memo, where reading back its ~1 GB at 10M entries would hold up the viewer's exit). `consume`:
    take each column out of `arrays` once written (a trace written beside its analysis: a column the analysis
    lets go of is freed then, not when the whole entry is written)."""
    table, parts, written, end = {}, [], [], 0
    for name, a in arrays.items():
        if is_constant(a) and a.dtype.kind in "biu":  # its value in the head, no bytes: most of a big trace's columns (device, stream, ...)
            v = int(a[0])
            table[name] = [a.dtype.str, int(a.shape[0]), 0, 0, 1, [v, v, True], v]
            continue
        col_sum, crc, length = _sums(a, with_crc=verify)
        offset = -(-end // ALIGN) * ALIGN
        table[name] = [a.dtype.str, int(a.shape[0]) if a.ndim else 1, offset,
                       (sums or {}).get(name, col_sum), a.ndim, _stats(a)]
        parts.append((offset, length, crc))
        written.append(name)
        end = offset + length
    body = json.dumps({**head, "columns": table, "data": end}).encode()
    start = _start(len(body))
    with open(fn, "wb") as f:
        f.write(_PRE.pack(MAGIC, len(body), zlib.crc32(body)) + body)
        for (offset, _, _), name in zip(parts, written):
            f.seek(start + offset)
            for raw in _pieces(arrays[name]):
                f.write(raw)
            if consume:
                del arrays[name]
        f.truncate(start + end)
    if not verify:
        if os.stat(fn).st_size != start + end:
            raise Odd("short write")
        return
    with open(fn, "rb", buffering=0) as f:
        if os.fstat(f.fileno()).st_size != start + end:
            raise Odd("short write")
        # read back a piece at a time into one buffer (a map of the file would count in the process's memory
        # while the analysis runs beside the writing: load(write_behind=True))
        buf = memoryview(bytearray(min(PIECE, max((length for _, length, _ in parts), default=0)) or 1))
        for offset, length, crc in parts:
            f.seek(start + offset)
            got, read_crc = 0, 0
            while got < length:
                n = f.readinto(buf[:min(len(buf), length - got)])
                if not n:
                    raise Odd("short read")
                read_crc = zlib.crc32(buf[:n], read_crc)
                got += n
            if read_crc != crc:
                raise Odd("a column differs once written")


PIECE = 1 << 24  # bytes of a column handled at a time when it is written (a multiple of BLOCK)


def _pieces(a):
    """A column's bytes, PIECE at a time: a constant column (a zero-stride view, model.constant_column) is
    made whole only a piece at a time."""
    if a.ndim != 1:
        a = np.ascontiguousarray(a)
        yield memoryview(a).cast("B") if a.size else memoryview(b"")
        return
    step = PIECE // a.itemsize
    for lo in range(0, len(a), step):
        yield memoryview(np.ascontiguousarray(a[lo:lo + step])).cast("B")


def _sums(a, with_crc=True) -> tuple[int, int, int]:
    """(column_sum, CRC-32, length) of a column's bytes, read PIECE at a time (the same figures as of the whole);
    the CRC-32 is 0 unless `with_crc`."""
    col_sum, crc, length = 0, 0, 0
    for raw in _pieces(a):
        whole = len(raw) // BLOCK * BLOCK  # only the last piece has a part block
        if whole:
            words = np.frombuffer(raw, np.uint64, count=whole // 8)
            col_sum = zlib.crc32(words.reshape(-1, BLOCK // 8).sum(axis=1, dtype=np.uint64).tobytes(), col_sum)
        col_sum = zlib.crc32(raw[whole:], col_sum)
        if with_crc:
            crc = zlib.crc32(raw, crc)
        length += len(raw)
    return col_sum, crc, length


def _stats(a):
    """[min, max, nondecreasing] of a 1-d integer column (None for others): taken when written, so that a
    read checks ids against table sizes without reading the columns."""
    if a.ndim != 1 or not len(a) or a.dtype.kind not in "iub":
        return None
    return [int(a.min()), int(a.max()), bool((a[1:] >= a[:-1]).all())]


def _start(head_len) -> int:
    """Where the columns begin: after the prefix and the head, aligned."""
    return -(-(_PRE.size + head_len) // ALIGN) * ALIGN


def unpack(fn) -> tuple[dict, dict]:
    """(head, columns) of the entry at `fn`: the columns are writable copy-on-write maps of the file.
    Raises Odd (or OSError) unless the file is exactly what `pack` wrote."""
    with open_regular(fn) as f:
        pre = f.read(_PRE.size)
        if len(pre) != _PRE.size:
            raise Odd("short")
        magic, n, crc = _PRE.unpack(pre)
        if magic != MAGIC or n > 2**31:
            raise Odd("not an entry of this version")
        body = f.read(n)
        if len(body) != n or zlib.crc32(body) != crc:
            raise Odd("head damaged")
        head = json.loads(body.decode())
        if not isinstance(head, dict) or not isinstance(head.get("columns"), dict):
            raise Odd("bad head")
        start, size = _start(n), os.fstat(f.fileno()).st_size
        if type(head.get("data")) is not int or start + head["data"] != size:
            raise Odd("truncated or grown")
        mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    columns, head["stats"] = {}, {}
    for name, spec in head.pop("columns").items():
        if not (isinstance(spec, list) and len(spec) in (6, 7) and isinstance(spec[0], str)
                and all(type(v) is int and v >= 0 for v in spec[1:5])):
            raise Odd(f"{name}: bad spec")
        if len(spec) == 7:  # a constant column: its value, no bytes
            columns[name] = _constant_of(name, spec)
            head["stats"][name] = spec[5]
            continue
        dstr, count, off, crc, ndim, stats = spec
        if stats is not None and not (isinstance(stats, list) and len(stats) == 3 and type(stats[0]) is int
                                      and type(stats[1]) is int and type(stats[2]) is bool):
            raise Odd(f"{name}: bad stats")
        head["stats"][name] = stats
        dtype = np.dtype(dstr)
        if dtype.hasobject or ndim != 1 or start + off + count * dtype.itemsize > size:
            raise Odd(f"{name}: {dstr} x {count} at {off}")
        a = np.frombuffer(mm, dtype=dtype, count=count, offset=start + off)
        if column_sum(a.data.cast("B") if count else b"") != crc:
            raise Odd(f"{name}: damaged")
        columns[name] = a
    return head, columns


def _constant_of(name, spec) -> np.ndarray:
    """The constant column a 7-item spec names ([dtype, count, 0, 0, 1, stats, value]), or Odd."""
    dstr, count, _, _, ndim, stats, value = spec
    try:
        dtype = np.dtype(dstr)
    except TypeError:
        raise Odd(f"{name}: bad dtype") from None
    if dtype.kind not in "biu" or ndim != 1 or count < 2 or type(value) is not int or stats != [value, value, True]:
        raise Odd(f"{name}: bad constant")
    lo, hi = (0, 1) if dtype.kind == "b" else (np.iinfo(dtype).min, np.iinfo(dtype).max)
    if not lo <= value <= hi:
        raise Odd(f"{name}: {value} out of {dstr}")
    return constant_column(value, count, dtype)


# -- traces -------------------------------------------------------------------------------------------

def write(key, trace: Trace) -> None:
    """Store a trace; failures are ignored (the cache is an optimisation)."""
    try:
        arrays, head = _entry_of(key, trace)
    except (OSError, TypeError, ValueError, RecursionError, MemoryError, Odd):
        return
    _store(key, arrays, head)


def write_soon(key, trace: Trace) -> None:
    """write() on a thread of its own, which the caller's analysis runs beside (writing and the checksums let
    go of the GIL): the strings and meta are taken now, the columns (never changed once read) as they are.
    The thread is not a daemon, so the entry is finished before the process exits; folder.wait_written() waits."""
    try:
        arrays, head = _entry_of(key, trace)
    except (OSError, TypeError, ValueError, RecursionError, MemoryError, Odd):
        return
    # daemon=False said outright: a thread inherits a daemon's (the viewer's loader is one) and would be cut at exit
    t = threading.Thread(target=_store, args=(key, arrays, head), name="tracekit-cache-write", daemon=False)
    writing.append(t)
    t.start()


def _entry_of(key, trace: Trace) -> tuple[dict, dict]:
    arrays = {}
    for prefix, (attr, table) in _TABLES.items():
        obj = getattr(trace, attr)
        for name in table.__dataclass_fields__:
            arrays[f"{prefix}_{name}"] = np.asarray(getattr(obj, name), dtype=DTYPES[prefix][name])
    head = {"key": key, "format": trace.format, "devices": [int(d) for d in trace.devices],
            "strings": list(trace.strings.items), "meta": encode(trace.meta)}
    return arrays, head


def _store(key, arrays: dict, head: dict) -> None:
    tmp = None
    try:
        os.makedirs(cache_dir(), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=cache_dir(), suffix=".tmp")
        os.close(fd)
        pack(tmp, arrays, head, consume=True)
        os.replace(tmp, _file(key))
        tmp = None
        evict(max_bytes())
    except (OSError, TypeError, ValueError, RecursionError, MemoryError, Odd):
        if tmp:
            _unlink(tmp)


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
        head, arrays = unpack(fn)
        if head.get("key") != key:
            raise Odd("another key")
        if set(arrays) != set(COLUMNS) or any(arrays[n].dtype != d for n, d in COLUMNS.items()):
            raise Odd("unexpected columns")
        tables = {p: table(**{n: arrays[f"{p}_{n}"] for n in table.__dataclass_fields__})
                  for p, (_, table) in _TABLES.items()}
        strings, devices, fmt = head.get("strings"), head.get("devices"), head.get("format")
        if not (isinstance(strings, list) and strings[:1] == [""] and all(type(s) is str for s in strings)
                and isinstance(devices, list) and all(type(d) is int for d in devices) and type(fmt) is str):
            raise Odd("bad head")
        trace = Trace(path=str(path), format=fmt, devices=devices, strings=Strings(strings),
                      frames=tables["fr"], stacks=tables["st"], events=tables["ev"], segments=tables["sg"],
                      blocks=tables["bl"], meta=decode(head.get("meta")))
        if not isinstance(trace.meta, dict):
            raise Odd("bad meta")
        check_consistent(trace, head["stats"])
    except Exception:  # whatever is wrong with it, it is a miss: delete it so the next open rewrites it
        _unlink(fn)
        return None
    _touch(fn)
    return trace


# -- checks and housekeeping --------------------------------------------------------------------------

def check_consistent(t: Trace, stats=None) -> None:
    """Raise Odd unless every table has consistent lengths and every id points inside its table.
    `stats` ({column name: [min, max, nondecreasing]}, from the entry's head) spares reading the columns."""
    stats = stats or {}
    columns = {f"{p}_{n}": getattr(getattr(t, attr), n) for p, (attr, table) in _TABLES.items()
               for n in table.__dataclass_fields__}

    def stat(name):
        s = stats.get(name)
        a = columns[name]
        if s is None and len(a):
            s = _stats(a)
        if len(a) and (s is None or s[0] > s[1]):
            raise Odd(f"{name}: no stats")
        return s

    def within(name, lo, hi, what):
        s = stat(name)
        if s and (s[0] < lo or s[1] >= hi):
            raise Odd(what)

    for obj, what in ((t.events, "events"), (t.frames, "frames"), (t.segments, "segments"), (t.blocks, "blocks")):
        if len({len(v) for v in vars(obj).values()}) > 1:
            raise Odd(f"{what} columns differ in length")
    ns, nf, nst = len(t.strings), len(t.frames), len(t.stacks)
    off = t.stacks.offsets
    if not len(off) or off[0] != 0 or off[-1] != len(t.stacks.frame_ids) or (np.diff(off) < 0).any():
        raise Odd("stack offsets")
    within("st_frame_ids", 0, nf, "frame ids")
    for name in ("fr_filename", "fr_name", "ev_user_metadata", "ev_compile_context", "ev_category", "ev_module",
                 "sg_segment_type", "sg_pool_id"):
        within(name, 0, ns, "string ids")
    for name in ("ev_stack_id", "ev_forward_stack_id", "sg_stack_id", "bl_stack_id"):
        within(name, -1, nst, "stack ids")
    within("ev_action", 0, len(ACTIONS), "actions")
    within("bl_state", 0, len(BLOCK_STATES), "block states")
    within("bl_segment", 0, len(t.segments), "block segments")
    for name in ("ev_size", "sg_total_size", "bl_size", "bl_requested_size"):
        within(name, 0, 2**50 + 1, "sizes")
    device = t.events.device
    if len(device) and not stat("ev_device")[2]:
        raise Odd("events not sorted by device")
    present = set(_distinct_sorted(device)) | set(np.unique(t.segments.device).tolist())
    if sorted(present) != t.devices:
        raise Odd("devices")


def _distinct_sorted(a) -> list:
    """The distinct values of a sorted array, reading one element per value (and a binary search)."""
    out, i = [], 0
    while i < len(a):
        out.append(int(a[i]))
        i = int(np.searchsorted(a, a[i], side="right"))
    return out


def entries() -> list:
    """(path, bytes) of every cached trace (what is stored beside it, `key-*`, counted with it)."""
    d = cache_dir()
    sizes: dict = {}
    for name in os.listdir(d) if os.path.isdir(d) else ():
        if name.endswith(SUFFIX) or (name[40:41] == "-" and name.endswith(_BESIDE)):
            try:
                sizes[name[:40]] = sizes.get(name[:40], 0) + os.lstat(os.path.join(d, name)).st_size
            except OSError:
                pass
    return [(_file(k), n) for k, n in sizes.items() if os.path.isfile(_file(k))]


def evict(limit: int) -> None:
    """Delete the least recently used cached traces (with their results) until the folder holds at most
    `limit` bytes; then results and fingerprints whose trace is gone."""
    d = cache_dir()
    files = []
    for fn, size in entries():
        try:
            files.append((os.lstat(fn).st_mtime, size, fn))
        except OSError:
            continue
    total = sum(size for _, size, _ in files)
    for _, size, fn in sorted(files):
        if total <= limit:
            break
        _unlink(fn)
        total -= size
    for name in os.listdir(d):
        stale_result = name.endswith(_BESIDE) and name[40:41] == "-" and not os.path.exists(_file(name[:40]))
        if stale_result or name.endswith(".npz"):  # .npz: entries of tracekit before VERSION 6
            _unlink(os.path.join(d, name))
    fps = os.path.join(d, "fp")
    for name in os.listdir(fps) if os.path.isdir(fps) else ():
        if not _remembered(name):
            _unlink(os.path.join(fps, name))


def clear() -> int:
    """Delete every cached trace, result and fingerprint; returns how many traces were removed."""
    n = 0
    d = cache_dir()
    if os.path.isdir(d):
        for name in os.listdir(d):
            if name.endswith((SUFFIX, ".npz", ".tmp") + _BESIDE) and _unlink(os.path.join(d, name)):
                n += name.endswith((SUFFIX, ".npz"))
        fps = os.path.join(d, "fp")
        for name in os.listdir(fps) if os.path.isdir(fps) else ():
            _unlink(os.path.join(fps, name))
    return n


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
