"""The streaming reader: a pickled snapshot -> Trace without building its Python object tree.

The compiled scanner (_pkscan.c, built by setup.py when a C compiler is there)
reads the file (a pickle, or a memory_viz-style JSON snapshot) in chunks and writes the trace entries straight into per-entry
columns, their frames into an interned frame table and their frame lists into
an interned stack table; only the small rest of the file (segments, metadata)
becomes a tape (one node per container, one edge per item) that is made into
Python objects and goes through snapshot.py as before. It reads only the
opcodes pickle emits for plain data and refuses every other one (globals,
REDUCE, BUILD, persistent ids, bytes, protocol 0/1), so nothing can run.

Anything this path does not handle exactly as the restricted unpickler does
(an unsupported opcode, a value of an unusual type, a malformed entry) is
`Unsupported`, and the caller reads the file the old way, which refuses it or
reads it with its usual messages. So every file opens to the same Trace, or
fails with the same line, on either path. $TRACEKIT_READER=python forces the old
path.

With `keep=(first, hi, threshold)` the scanner keeps only each device's entries at positions
[first, hi) from its first entry timed at or after `threshold` (None: no such bound), and folds
every other entry into a few sums per device (allocated and reserved bytes before the window, bytes
freed but never allocated in the trace, the addresses it touches, its first and last times), so
memory grows with the window, not the file. The Trace then holds the window's entries (numbered
from 0) and the whole file's segments, with the folds in meta["streamed_window"];
tracekit.analysis.window.select finishes the cut exactly as it cuts a whole trace.
"""
from __future__ import annotations

import gzip
import io
import os
import re
import struct
from typing import Callable

import numpy as np

from ..errors import TracekitError
from ..model import ACTION, NO_TIME, OOM, OTHER, compact_column, constant_column, index_column, unique_ids
from .columns import MAX_SIZE, MAX_TIME, MAX_TOTAL, check_sizes
from .limits import CappedReader, decompressed_cap, max_depth

_scan: Callable[..., tuple] | None
_scan_json: Callable[..., tuple] | None
try:
    from ._pkscan import scan as _scan, scan_json as _scan_json
except ImportError:  # built without a C compiler: the restricted unpickler reads everything
    _scan = _scan_json = None

K_NONE, K_FALSE, K_TRUE, K_INT, K_FLOAT, K_STR, K_LIST, K_DICT, K_TUPLE = range(9)
COMPILED = "streaming (compiled scanner)"
PYTHON = "restricted unpickler (Python)"
COMPILED_WINDOW = "streaming (compiled scanner), keeping only the window's entries"
_ENTRY_COLUMNS = ("action", "addr", "size", "stream", "time_us", "frames", "forward_frames", "user_metadata",
                  "compile_context", "category", "module", "df_row", "df_kind", "df_val", "present")
_DTYPES = dict(zip(_ENTRY_COLUMNS, (np.uint8, np.int64, np.int64, np.int64, np.int64, np.int32, np.int32, np.int32,
                                    np.int32, np.int32, np.int32, np.int32, np.uint8, np.int64, np.uint8)))
_ROW_COLUMNS = _ENTRY_COLUMNS[:11]  # one row per kept entry (the rest: per device_free set, per string)
_CHUNK = 1 << 20  # rows mapped at a time: the temporaries of a mapping stay small


class Unsupported(Exception):
    """This file needs the restricted unpickler; the message says why (for tests and debugging)."""


def enabled() -> bool:
    """Whether the compiled path is built and not turned off ($TRACEKIT_READER=python)."""
    choice = os.environ.get("TRACEKIT_READER", "auto").strip().lower() or "auto"
    if choice not in ("auto", "python"):
        raise TracekitError(f"TRACEKIT_READER={choice!r} is not valid: expected auto or python")
    return _scan is not None and choice == "auto"


def return_large_frees():
    """Have glibc give large freed blocks (>= 1 MiB) back to the system at once, for the rest of this process.

    By default glibc raises that threshold as large blocks are freed, so the many large temporary
    arrays of loading and analysing a big trace stay in the heap and add up in the peak memory
    (about 5% on a 1M-entry report; about 0.3 s slower there). Skipped when $MALLOC_MMAP_THRESHOLD_
    is set, or off glibc."""
    global _tuned
    if _tuned or os.environ.get("MALLOC_MMAP_THRESHOLD_"):
        return
    _tuned = True
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 20)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):
        pass


_tuned = False


def read(path, raw, zipped, size, snapshot_to_trace, keep=None):
    """(Trace, "pickle" or "JSON") of a snapshot in the open file `raw`, or raise Unsupported.

    `keep`: a window's (first, hi, threshold[, ranges, record]) (see the module docstring and
    _pkscan.c's setup); None: every entry."""
    stream = CappedReader(gzip.GzipFile(fileobj=raw, mode="rb"), *decompressed_cap(size)) if zipped else raw
    head = stream.read(1)
    kind = "pickle"
    if head != b"\x80":
        head += stream.read(4095)
        if not _JSON_SNAPSHOT.match(head):  # profiler traces and the like: the Python path reads them
            raise Unsupported("neither a binary pickle nor a JSON snapshot")
        kind = "JSON"
    pending = [head]

    def chunk(n):  # the bytes already read, then the file in pieces
        return pending.pop() if pending else stream.read(n)

    return Tape(chunk, json=kind == "JSON", keep=keep).to_trace(path, snapshot_to_trace), kind


NOTHING = (2**62, 0, None)  # a window that keeps no entry: a pass that only counts and times them
MARKS = (2**62, 0, None, b"", True)  # the same, recording the runs of user_metadata (see _pkscan.c's w_record)


# a memory_viz-style JSON snapshot: an object whose first key is one of a snapshot's
_JSON_SNAPSHOT = re.compile(rb'(\xef\xbb\xbf)?[ \t\r\n]*\{[ \t\r\n]*"(segments|device_traces)"')


class Tape:
    """The scanner's output: the entries' columns, frames and stacks, and a tape of the rest
    (containers as nodes, items as edges: parent, key, value kind, value)."""

    def __init__(self, read, json=False, keep=None):
        """`read(n) -> bytes` gives the file in pieces (or the whole file as bytes); `json`: it is JSON;
        `keep`: a window's (first, hi, threshold)."""
        if isinstance(read, (bytes, bytearray)):
            read = io.BytesIO(read).read
        window = None if keep is None else (*keep[:3], MAX_SIZE, MAX_TIME, *keep[3:])
        try:
            out = (_scan_json if json else _scan)(read, int(NO_TIME), window)
        except ValueError as e:
            raise Unsupported(str(e)) from None
        self.root_kind, self.root, self.strings, self.keys, self.devices = out[:5]
        nkind, nfirst, nlast, ncount, ep, ek, ekind, ev = out[5:13]
        self.n_nodes = len(nkind)
        self.ep = np.frombuffer(ep, np.int32)
        # scalar access for the small part made into Python objects
        self._first, self._last, self._count = (memoryview(b).cast("i") for b in (nfirst, nlast, ncount))
        self._k, self._kind, self._v = memoryview(ek).cast("i"), memoryview(ekind), memoryview(ev).cast("q")
        # the entries' columns; a column of one value throughout comes as that value (see _pkscan.c's Col);
        # action: codes, 1 + its place in self._actions (the action string ids), one byte each below 256 codes
        rows, self._actions, width = out[42], np.frombuffer(out[43], np.int32), out[44]
        self.entries = {}
        for k, b in zip(_ENTRY_COLUMNS, out[13:28]):
            a = np.frombuffer(b, np.int32 if k == "action" and width == 4 else _DTYPES[k])
            self.entries[k] = constant_column(a[0], rows, a.dtype) if k in _ROW_COLUMNS and len(a) != rows else a
        f_file, f_line, f_name, s_off, s_fids = out[28:33]
        self.f_file, self.f_name = np.frombuffer(f_file, np.int32), np.frombuffer(f_name, np.int32)
        self.f_line = np.frombuffer(f_line, np.int64)
        self.s_off, self.s_fids = np.frombuffer(s_off, np.int64), np.frombuffer(s_fids, np.int32)
        self.folds = out[33]  # per device list: what the window's scan folded (None: no window)
        # out[34:36]: the scanner's address table (its folds say which addresses each device touched)
        # a window: per device list, the stacks and strings its entries use, in order of first use
        self._uses = (np.frombuffer(out[36], np.int32), np.frombuffer(out[37], np.uint8),
                      np.frombuffer(out[38], np.int32))
        # MARKS: runs of one user_metadata (string, first position) and the unmarked entries' times
        self._marks = (np.frombuffer(out[39], np.int32), np.frombuffer(out[40], np.int64),
                       np.frombuffer(out[41], np.int64))
        self._made = {}
        self._depth = max_depth()
        self._stack_of = {}  # scanner stack id -> the Interner's

    # -- Python objects, for everything but the trace entries --------------------------------------

    def edges(self, node):
        """The edges of a node, in order (contiguous unless items were added in several batches)."""
        first, last, count = self._first[node], self._last[node], self._count[node]
        if last - first + 1 == count:
            return range(first, last + 1) if count else range(0)
        return np.flatnonzero(self.ep == node).tolist()

    def value(self, kind, v, depth=0):
        if kind == K_STR:
            return self.strings[v]
        if kind == K_INT:
            return v
        if kind <= K_TRUE:
            return (None, False, True)[kind]
        if kind == K_FLOAT:
            return struct.unpack("<d", struct.pack("<q", v))[0]
        if v in self._made:
            return self._made[v]
        if depth >= self._depth:  # deeper than any snapshot, or a cycle: the old path says which
            raise Unsupported("nested too deeply")
        if kind == K_TUPLE:
            out = tuple(self.value(self._kind[e], self._v[e], depth + 1) for e in self.edges(v))
        elif kind == K_LIST:
            out = self._made[v] = []
            out.extend(self.value(self._kind[e], self._v[e], depth + 1) for e in self.edges(v))
        else:
            out = self._made[v] = {}
            for e in self.edges(v):
                out[self.key(self._k[e], depth)] = self.value(self._kind[e], self._v[e], depth + 1)
        self._made[v] = out
        return out

    def key(self, k, depth):
        if k >= 0:
            return self.strings[k]
        kind, v = self.keys[-2 - k]
        return self.value(kind, v, depth + 1)

    # -- the snapshot -----------------------------------------------------------------------------

    def to_trace(self, path, snapshot_to_trace):
        if self.root_kind != K_DICT:
            raise Unsupported("the top level is not a dict")
        obj = {}
        for e in self.edges(self.root):
            obj[self.key(self._k[e], 0)] = self.value(self._kind[e], self._v[e], 1)
        if "segments" not in obj:
            raise Unsupported("no 'segments'")
        devices = self.devices
        if devices is not None:
            obj["device_traces"] = [[] for _ in devices]
        elif obj.get("device_traces") and any(obj["device_traces"]):  # entries the scanner did not recognise
            raise Unsupported("'device_traces' of an unusual layout")

        def columns_of(device, it, present, unknown):
            if device == 0:  # the keys and actions of every entry, kept or not
                flags, strings = self.entries["present"], self.strings
                present.update(strings[i][:100] for i in np.flatnonzero(flags & 1).tolist())
                unknown.update(strings[i][:100] for i in np.flatnonzero(flags & 2).tolist()
                               if ACTION.get(strings[i], OTHER) == OTHER and strings[i] != "other")
            return self._events(device, devices[device], it)

        try:
            trace = snapshot_to_trace(obj, path, None, columns_of=columns_of)
        except Unsupported:
            raise
        except (ValueError, TypeError, KeyError, AttributeError, OverflowError, RecursionError) as e:
            raise Unsupported(f"conversion: {type(e).__name__}: {e}") from None
        if self.folds is not None:
            u_dl, u_col, u_id = self._uses
            trace.meta["streamed_window"] = {
                d: {**f, "touched": np.frombuffer(f["touched"], np.uint64),  # unsorted, repeats possible
                    "user_metadata": sorted(self.strings[i] for i in set(u_id[(u_dl == f["dl"]) & (u_col == 2)]
                                                                         .tolist()) if i >= 0)}
                for d, f in enumerate(self.folds)}
            um, t, pos = self._marks
            if len(pos):  # MARKS: per device, its runs of one user_metadata and the unmarked entries' times
                for f in trace.meta["streamed_window"].values():
                    runs = slice(f["rec_start"], f["rec_start"] + f["rec_runs"])
                    ids = um[runs]
                    texts = np.unique(ids)
                    f["marks"] = (pos[runs], np.searchsorted(texts, ids).astype(np.int32),
                                  [self.strings[i] if i >= 0 else "" for i in texts.tolist()],
                                  t[f["rec_tstart"]:f["rec_tstart"] + f["rec_tn"]])
                self._marks = None
        return trace

    def _events(self, device, rows, it):
        """The event columns of one device's entries (rows [first, first + count) of the scanner's).

        In a window, the stacks and strings of all the device's entries, kept or not, are interned
        as a read of the whole file interns them, so the numbering is the same. After the last device
        list, each scanner column is let go as soon as its event column is made (so that a big file's
        read holds little more than its trace)."""
        first, n = rows
        uses = [None] * 6
        if self.folds is not None:
            fold = self.folds[device]
            if not fold["n"]:
                return None
            dl, col, ids = self._uses
            mine = dl == fold["dl"]
            uses = [ids[mine & (col == i)] for i in range(6)]
            if not n:  # nothing kept: only what the whole file's read would intern
                empty = np.zeros(0, np.int32)
                for u in (0, 2, 3, 4, 1, 5):  # frames, user_metadata, compile_context, category, forward, module
                    (self._stacks if u < 2 else self._texts)(empty, it, uses[u])
                return None
        if not n:
            return None
        sl = slice(first, first + n)
        last = device == len(self.devices) - 1
        e, strings = self.entries, self.strings

        def take(name):  # this device's rows of a scanner column (let go after the last device's)
            return (e.pop(name) if last else e[name])[sl]

        # every kept entry has an action (the scanner refuses one without): its code, mapped
        lut = np.array([OTHER] + [ACTION.get(strings[s], OTHER) for s in self._actions.tolist()], np.int8)
        action = _mapped(lut, take("action"), np.int8, full=True)
        what = f"device {device} entry"
        # a column of one value throughout (device, most often stream, the texts, device_free) takes no memory
        col = {"device": constant_column(device, n, np.int32), "action": action,
               "addr": _full(take("addr")).view(np.uint64), "size": _full(take("size")),
               "stream": compact_column(take("stream")), "time_us": _full(take("time_us"))}
        check_sizes(col["size"], what)
        t = col["time_us"]
        for s in _chunks(n):
            x = t[s]
            if ((x != NO_TIME) & ((x >= MAX_TIME) | (x <= -MAX_TIME))).any():
                raise Unsupported("a time out of range")
        # in the order the Python path interns them (frames, texts, forward frames, module)
        col["stack_id"] = self._stacks(take("frames"), it, uses[0])
        for name, u in zip(("user_metadata", "compile_context", "category"), uses[2:5]):
            col[name] = self._texts(take(name), it, u)
        col["device_free"] = self._device_free(action, first, n)
        col["forward_stack_id"] = self._stacks(take("forward_frames"), it, uses[1])
        col["module"] = self._texts(take("module"), it, uses[5])
        col["index"] = index_column(n)  # last: the scanner's columns are gone by now
        return col

    def _texts(self, sids, it, used=None):
        """The Interner's ids of scanner string ids (-1: absent, read as ""); `used`: all the ids to intern."""
        distinct = _distinct(sids) if used is None else unique_ids(used)
        ids = np.array([it.strings.intern(self.strings[s] if s >= 0 else "") for s in distinct.tolist()], np.int32)
        if not len(sids):
            return ids[:0]
        if _constant(sids):
            return constant_column(ids[np.searchsorted(distinct, sids[0])], len(sids), np.int32)
        if used is None and len(distinct) == 1:
            return constant_column(ids[0], len(sids), np.int32)
        lo = int(distinct[0]) if len(distinct) else 0
        if len(distinct) and int(distinct[-1]) - lo <= 4 * len(sids) + 65536:  # a table over the range
            table = np.zeros(int(distinct[-1]) - lo + 1, np.int32)
            table[distinct.astype(np.int64) - lo] = ids
            return _mapped(table, sids, np.int32, lo=lo)
        out = np.empty(len(sids), np.int32)
        for s in _chunks(len(sids)):
            out[s] = ids[np.searchsorted(distinct, sids[s])]
        return out

    def _device_free(self, action, first, n):
        """device_free of the oom entries (the last value set wins), 0 elsewhere."""
        e = self.entries
        r = e["df_row"].astype(np.int64) - first
        keep = (r >= 0) & (r < n)
        if not keep.any():
            return constant_column(0, n, np.int64)
        free = np.zeros(n, np.int64)
        r, k, v = r[keep][::-1], e["df_kind"][keep][::-1], e["df_val"][keep][::-1]
        r, last = np.unique(r, return_index=True)  # reversed: the first of each row is the last one set
        k, v = k[last], v[last]
        oom = action[r] == OOM
        if (oom & ((k != K_INT) & (k != K_NONE) | (k == K_INT) & ((v < 0) | (v >= MAX_TOTAL)))).any():
            raise Unsupported("an oom entry's device_free is not a byte count")
        free[r[oom]] = np.where(k[oom] == K_INT, v[oom], 0)
        return free

    def _stacks(self, ids, it, used=None):
        """The Interner's stack ids of scanner stack ids + 1 (0: none), interned in order of first use
        (`used`: all the ids to intern, in that order)."""
        if used is None:
            used = _first_used(ids)
        top = max(int(ids.max()) if len(ids) else 0, int(used.max()) if len(used) else 0)
        lut = np.full(top + 1, -1, np.int32)
        strings, f_file, f_line, f_name = self.strings, self.f_file, self.f_line, self.f_name
        for i in used.tolist():
            if i == 0:
                continue
            sid = self._stack_of.get(i)
            if sid is None:
                fids = self.s_fids[self.s_off[i - 1]:self.s_off[i]]
                key = tuple(zip([strings[s] for s in f_file[fids].tolist()], f_line[fids].tolist(),
                                [strings[s] for s in f_name[fids].tolist()]))
                sid = it._stack_ids.get(key)
                sid = self._stack_of[i] = sid if sid is not None else it._new_stack(key)
            lut[i] = sid
        if len(ids) > 1 and (_constant(ids) or len(used) == 1 and (ids == used[0]).all()):  # e.g. no forward frames
            return constant_column(lut[ids[0]], len(ids), np.int32)
        return _mapped(lut, ids, np.int32)


def _chunks(n):
    """Slices of [0, n), _CHUNK rows each."""
    return (slice(i, min(i + _CHUNK, n)) for i in range(0, n, _CHUNK))


def _constant(a) -> bool:
    """Whether `a` is a column of one value (a constant_column, as the scanner gives such a column)."""
    return a.ndim == 1 and len(a) > 0 and a.strides == (0,)


def _full(a):
    """`a` as an array of its own (a constant column written out): the columns the Trace keeps as arrays."""
    return np.full(len(a), a[0], a.dtype) if _constant(a) and len(a) > 1 else a


def _mapped(table, ids, dtype, lo=0, full=False):
    """table[ids - lo], a chunk at a time (no index array as wide as the column); a constant column stays
    one (unless `full`)."""
    n = len(ids)
    if n > 1 and _constant(ids):
        v = table[int(ids[0]) - lo]
        return np.full(n, v, dtype) if full else constant_column(v, n, dtype)
    out = np.empty(n, dtype)
    for s in _chunks(n):
        x = ids[s]
        np.take(table, x - x.dtype.type(lo) if lo else x, out=out[s])
    return out


def _distinct(ids):
    """unique_ids(ids), a chunk at a time."""
    if _constant(ids):
        return ids[:1].copy()
    if len(ids) <= _CHUNK:
        return unique_ids(ids)
    return unique_ids(np.concatenate([unique_ids(ids[s]) for s in _chunks(len(ids))]))


def _first_used(ids):
    """The distinct ids in order of first use, a chunk at a time."""
    if _constant(ids):
        return ids[:1].copy()
    parts, seen = [], set()
    for s in _chunks(len(ids)):
        distinct, first = unique_ids(ids[s], return_index=True)
        order = distinct[np.argsort(first, kind="stable")]
        parts.append(order if not seen else np.array([i for i in order.tolist() if i not in seen], ids.dtype))
        seen.update(order.tolist())
    return np.concatenate(parts) if parts else ids[:0]
