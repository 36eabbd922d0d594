"""The streaming reader: a pickled snapshot -> Trace without building its Python object tree.

The compiled scanner (_pkscan.c, built by setup.py when a C compiler is there)
turns the pickle's opcodes into a flat tape: one node per container, one edge
per item. It reads only the opcodes pickle emits for plain data and refuses
every other one (globals, REDUCE, BUILD, persistent ids, bytes, protocol 0/1),
so nothing can run. The trace entries are then turned into columns with numpy,
straight from the tape; only the small rest of the file (segments, metadata) is
made into Python objects and goes through snapshot.py as before.

Anything this path does not handle exactly as the restricted unpickler does
(an unsupported opcode, a value of an unusual type, a malformed entry) is
`Unsupported`, and the caller reads the file the old way, which refuses it or
reads it with its usual messages. So every file opens to the same Trace, or
fails with the same line, on either path. $TRACEKIT_READER=python forces the old
path.
"""
from __future__ import annotations

import gzip
import mmap
import os
import struct

import numpy as np

from ..errors import TracekitError
from ..model import ACTION, NO_TIME, OOM, OTHER
from .columns import MAX_TIME, MAX_TOTAL, check_sizes
from .limits import CappedReader, decompressed_cap, max_depth

try:
    from ._pkscan import scan as _scan
except ImportError:  # built without a C compiler: the restricted unpickler reads everything
    _scan = None

K_NONE, K_FALSE, K_TRUE, K_INT, K_FLOAT, K_STR, K_LIST, K_DICT, K_TUPLE = range(9)
COMPILED = "streaming (compiled scanner)"
PYTHON = "restricted unpickler (Python)"


class Unsupported(Exception):
    """This file needs the restricted unpickler; the message says why (for tests and debugging)."""


def enabled() -> bool:
    """Whether the compiled path is built and not turned off ($TRACEKIT_READER=python)."""
    choice = os.environ.get("TRACEKIT_READER", "auto").strip().lower() or "auto"
    if choice not in ("auto", "python"):
        raise TracekitError(f"TRACEKIT_READER={choice!r} is not valid: expected auto or python")
    return _scan is not None and choice == "auto"


def read(path, raw, zipped, size, snapshot_to_trace):
    """The Trace of a pickled snapshot in the open file `raw`, or raise Unsupported."""
    if zipped:  # inflated in pieces, stopped at the same cap as the old path
        data = CappedReader(gzip.GzipFile(fileobj=raw, mode="rb"), *decompressed_cap(size)).read()
    else:
        data = mmap.mmap(raw.fileno(), 0, access=mmap.ACCESS_READ)
    try:
        if data[:1] != b"\x80":
            raise Unsupported("not a binary pickle")
        tape = Tape(data)
    finally:
        if isinstance(data, mmap.mmap):
            data.close()
        del data
    return tape.to_trace(path, snapshot_to_trace)


class Tape:
    """The scanner's output: containers as nodes, items as edges (parent, key, value kind, value)."""

    def __init__(self, data):
        try:
            (self.root_kind, self.root, nkind, nfirst, nlast, ncount, ep, ek, ekind, ev, self.strings,
             self.keys) = _scan(data)
        except ValueError as e:
            raise Unsupported(str(e)) from None
        self.n_nodes = len(nkind)
        self.nfirst, self.nlast = np.frombuffer(nfirst, np.int32), np.frombuffer(nlast, np.int32)
        self.ncount = np.frombuffer(ncount, np.int32)
        self.ep = np.frombuffer(ep, np.int32)
        self.ek = np.frombuffer(ek, np.int32)
        self.ekind = np.frombuffer(ekind, np.uint8)
        self.ev = np.frombuffer(ev, np.int64)
        # scalar access for the small part made into Python objects
        self._first, self._last, self._count = (memoryview(b).cast("i") for b in (nfirst, nlast, ncount))
        self._k, self._kind, self._v = memoryview(ek).cast("i"), memoryview(ekind), memoryview(ev).cast("q")
        self._made = {}
        self._depth = max_depth()
        self.sid = {s: i for i, s in enumerate(self.strings)}

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
        obj, traces = {}, None
        for e in self.edges(self.root):
            k = self.key(self._k[e], 0)
            if k == "device_traces":
                traces = (self._kind[e], self._v[e])
                obj[k] = None
            else:
                obj[k] = self.value(self._kind[e], self._v[e], 1)
        if "segments" not in obj:
            raise Unsupported("no 'segments'")
        devices = []
        if traces is not None and traces[0] != K_NONE:
            if traces[0] != K_LIST:
                raise Unsupported("'device_traces' is not a list")
            for e in self.edges(traces[1]):
                if self._kind[e] != K_LIST:
                    raise Unsupported("'device_traces' holds a non-list")
                devices.append(self._v[e])
        obj["device_traces"] = [[] for _ in devices]
        if traces is None:
            del obj["device_traces"]
        def columns_of(device, it, present, unknown):
            return self._events(device, devices[device], it, present, unknown)

        try:
            return snapshot_to_trace(obj, path, None, columns_of=columns_of)
        except Unsupported:
            raise
        except (ValueError, TypeError, KeyError, AttributeError, OverflowError, RecursionError) as e:
            raise Unsupported(f"conversion: {type(e).__name__}: {e}") from None

    def _children(self, parent_row, n, nodes):
        """Edges whose parent has a row (>= 0) in `parent_row` (indexed by node; `nodes` are those
        parents by row), grouped by row, in list order."""
        first, count = self.nfirst[nodes], self.ncount[nodes]
        if ((count == 0) | (self.nlast[nodes] - first + 1 == count)).all():  # each one's edges contiguous
            rows = np.repeat(np.arange(len(nodes), dtype=np.int32), count)
            starts = (np.cumsum(count, dtype=np.int64) - count).astype(np.int32)  # edges < 2**31
            idx = np.repeat(first - starts, count)
            idx += np.arange(len(idx), dtype=np.int32)
            return idx, rows
        pr = parent_row[self.ep]
        idx = np.flatnonzero(pr >= 0)
        rows = pr[idx]
        if len(rows) > 1 and (np.diff(rows) < 0).any():
            order = np.argsort(rows, kind="stable")
            idx, rows = idx[order], rows[order]
        return idx, rows

    def _rows(self, nodes):
        """(distinct nodes ascending, row of each of `nodes` among them, node -> row map), without sorting."""
        mark = np.zeros(self.n_nodes, bool)
        mark[nodes] = True
        distinct = np.flatnonzero(mark)
        row = np.full(self.n_nodes, -1, np.int32)
        row[distinct] = np.arange(len(distinct), dtype=np.int32)
        return distinct, row[nodes], row

    def _regular(self, nodes):
        """{key: edge of that key per node} when all `nodes` have the same string keys in the same order
        (the usual case: one writer makes every entry alike), else None."""
        count = self.ncount[nodes]
        if not len(nodes) or (count != count[0]).any() or count[0] == 0:
            return None
        first, c = self.nfirst[nodes], int(count[0])
        if (self.nlast[nodes] - first + 1 != c).any():
            return None
        idx = first[:, None] + np.arange(c, dtype=np.int32)
        keys = self.ek[idx]
        row0 = keys[0].tolist()
        if min(row0) < 0 or len(set(row0)) != c or (keys != keys[0]).any():
            return None
        return {k: idx[:, j] for j, k in enumerate(row0)}

    def _field(self, idx, keys, row, n, name, kinds, regular=None):
        """(rows, kinds, values) of the `name` items of the containers whose edges are `idx` with keys `keys`
        (`row`: node -> row; or `regular` from _regular); Unsupported on a duplicate or a kind not in `kinds`."""
        sid = self.sid.get(name)
        if sid is None or (regular is not None and sid not in regular):
            return np.zeros(0, np.int32), self.ekind[:0], self.ev[:0]
        if regular is not None:
            sel = regular[sid]
            k = self.ekind[sel]
            if not np.isin(k, kinds).all():
                raise Unsupported(f"an entry's '{name}' of an unusual type")
            return np.arange(n, dtype=np.int32), k, self.ev[sel]
        sel = idx[keys == sid]
        r = row[self.ep[sel]]
        if len(r) and np.bincount(r, minlength=n).max() > 1:
            raise Unsupported(f"an entry with two '{name}' items")
        k = self.ekind[sel]
        if not np.isin(k, kinds).all():
            raise Unsupported(f"an entry's '{name}' of an unusual type")
        return r, k, self.ev[sel]

    def _events(self, device, node, it, present, unknown):
        eidx = np.flatnonzero(self.ep == node)
        n = len(eidx)
        if not n:
            return None
        if (self.ekind[eidx] != K_DICT).any():
            raise Unsupported("an entry that is not a dict")
        distinct, _, row = self._rows(self.ev[eidx])
        if len(distinct) != n:
            raise Unsupported("one entry dict listed twice")
        row[distinct] = -1
        row[self.ev[eidx]] = np.arange(n, dtype=np.int32)  # rows in list order
        reg = self._regular(self.ev[eidx])
        if reg is not None:
            idx = keys = None
            present.update(self.strings[k][:100] for k in reg)
        else:
            idx, _ = self._children(row, n, self.ev[eidx])
            keys = self.ek[idx]
            if (keys < 0).any():
                raise Unsupported("an entry key that is not a string")
            present.update(self.strings[k][:100] for k in np.unique(keys).tolist())
        field = lambda *a: self._field(*a, regular=reg)  # noqa: E731

        r, _, v = field(idx, keys, row, n, "action", [K_STR])
        if len(r) != n:
            raise Unsupported("an entry without an action")
        names = np.unique(v)
        codes = np.array([ACTION.get(self.strings[s], OTHER) for s in names.tolist()], np.int8)
        unknown.update(self.strings[s][:100] for s, c in zip(names.tolist(), codes.tolist())
                       if c == OTHER and self.strings[s] != "other")
        action = np.empty(n, np.int8)
        action[r] = codes[np.searchsorted(names, v)]
        what = f"device {device} entry"
        col = {"device": np.full(n, device, dtype=np.int32), "index": np.arange(n, dtype=np.int64), "action": action}
        for name, dtype, default in (("addr", np.uint64, 0), ("size", np.int64, 0), ("stream", np.int64, 0),
                                     ("time_us", np.int64, NO_TIME)):
            r, _, v = field(idx, keys, row, n, name, [K_INT])
            if name == "addr" and (v < 0).any():
                raise Unsupported("a negative address")
            c = np.full(n, default, dtype=np.int64)
            c[r] = v
            col[name] = c.astype(dtype)
        check_sizes(col["size"], what)
        t = col["time_us"]
        if ((t != NO_TIME) & ((t >= MAX_TIME) | (t <= -MAX_TIME))).any():
            raise Unsupported("a time out of range")
        col["stack_id"] = self._stacks(field(idx, keys, row, n, "frames", [K_LIST, K_NONE]), n, it)
        def strings(name):
            r, _, v = field(idx, keys, row, n, name, [K_STR])
            c = np.zeros(n, np.int32)
            if len(r):
                distinct = np.unique(v)
                ids = np.array([it.strings.intern(self.strings[s]) for s in distinct.tolist()], np.int32)
                c[r] = ids[np.searchsorted(distinct, v)]
            return c

        for name in ("user_metadata", "compile_context", "category"):
            col[name] = strings(name)
        # our recorder's forward origin of backward allocations and the running module (snapshot.py's order)
        col["forward_stack_id"] = self._stacks(field(idx, keys, row, n, "forward_frames", [K_LIST, K_NONE]), n, it)
        col["module"] = strings("module")
        r, k, v = field(idx, keys, row, n, "device_free", [K_INT, K_NONE, K_FALSE, K_TRUE])
        free = np.zeros(n, np.int64)
        oom = action[r] == OOM
        if (oom & ((k != K_INT) & (k != K_NONE) | (k == K_INT) & ((v < 0) | (v >= MAX_TOTAL)))).any():
            raise Unsupported("an oom entry's device_free is not a byte count")
        free[r[oom]] = np.where(k[oom] == K_INT, v[oom], 0)
        col["device_free"] = free
        return col

    def _stacks(self, frames, n, it):
        """Stack ids of the entries' 'frames' lists, interned as columns.Interner does (first seen, first id)."""
        out = np.full(n, -1, np.int32)
        r, k, v = frames
        r, lists = r[k == K_LIST], v[k == K_LIST]
        if not len(r):
            return out
        ulist, inv, lrow = self._rows(lists)
        fidx, frows = self._children(lrow, len(ulist), ulist)
        if (self.ekind[fidx] != K_DICT).any():
            raise Unsupported("a frame that is not a dict")
        lengths = np.bincount(frows, minlength=len(ulist))
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]])
        fnodes = self.ev[fidx]
        ufr, finv, frow = self._rows(fnodes)
        reg = self._regular(ufr)
        gidx, gkeys = (None, None) if reg is not None else (self._children(frow, len(ufr), ufr)[0], None)
        gkeys = self.ek[gidx] if gidx is not None else None
        parts = {}
        for name, kind in (("filename", K_STR), ("line", K_INT), ("name", K_STR)):
            fr, _, fv = self._field(gidx, gkeys, frow, len(ufr), name, [kind], regular=reg)
            if len(fr) != len(ufr):
                raise Unsupported(f"a frame without '{name}'")
            parts[name] = np.empty(len(ufr), np.int64)
            parts[name][fr] = fv
        # one id per distinct (filename, line, name), then sequences of them per list, grouped by content
        occ = self._frame_keys(parts)[finv].astype(np.uint64) + np.uint64(1)
        pos = np.arange(len(occ)) - np.repeat(starts, lengths)
        group = self._group(occ, pos, starts, lengths)
        # stack ids, in the order entries first use them
        entry_group = group[inv]
        first = np.unique(entry_group, return_index=True)[1]
        sid_of = np.full(int(group.max()) + 1, -1, np.int32)
        rep = np.zeros(len(sid_of), np.int64)
        ug, ufirst = np.unique(group, return_index=True)
        rep[ug] = ufirst  # the first list of each group
        for g in entry_group[np.sort(first)].tolist():
            L = int(rep[g])
            if lengths[L] == 0:
                continue
            sl = slice(int(starts[L]), int(starts[L] + lengths[L]))
            rowsL = finv[sl]
            key = tuple((self.strings[f], ln, self.strings[nm]) for f, ln, nm in
                        zip(parts["filename"][rowsL].tolist(), parts["line"][rowsL].tolist(),
                            parts["name"][rowsL].tolist()))
            sid = it._stack_ids.get(key)
            sid_of[g] = sid if sid is not None else it._new_stack(key)
        out[r] = sid_of[entry_group]
        return out

    def _frame_keys(self, parts):
        """An int64 per frame, equal exactly when (filename, line, name) are equal."""
        ns, line = len(self.strings), parts["line"]
        lo, hi = (int(line.min()), int(line.max())) if len(line) else (0, 0)
        if ns * ns * (hi - lo + 1) >= 2**62:  # too wide to pack: number the distinct values instead
            a = np.unique(parts["filename"] * ns + parts["name"], return_inverse=True)[1].reshape(-1)
            line, lo, ns = np.unique(line, return_inverse=True)[1].reshape(-1), 0, len(line) + 1
            return a.astype(np.int64) * ns + line
        return (parts["filename"] * ns + parts["name"]) * (hi - lo + 1) + (line - lo)

    @staticmethod
    def _group(occ, pos, starts, lengths):
        """Group id per list: lists with equal sequences of frame ids share one (checked element by element)."""
        nl = len(lengths)
        maxlen = int(lengths.max()) if nl else 0
        with np.errstate(over="ignore"):
            p1 = np.concatenate([np.ones(1, np.uint64), np.cumprod(np.full(maxlen, 1_000_003, np.uint64))])
            p2 = np.concatenate([np.ones(1, np.uint64), np.cumprod(np.full(maxlen, 0x9E3779B97F4A7C15, np.uint64))])
            h1 = np.zeros(nl, np.uint64)
            h2 = np.zeros(nl, np.uint64)
            nz = lengths > 0
            if len(occ):
                m = _mix(occ)  # frame keys can share many low zero bits: spread them before multiplying
                h1[nz] = np.add.reduceat(m * p1[pos], starts[nz])
                h2[nz] = np.add.reduceat(_mix(m ^ np.uint64(0x5555)) * p2[pos], starts[nz])
            h = h1 ^ (h2 >> np.uint64(7)) ^ (lengths.astype(np.uint64) * np.uint64(0x100000001B3))
        _, first, group = np.unique(h, return_index=True, return_inverse=True)
        group = group.reshape(-1)
        # exactness: every list equals its group's first list, element by element; the lists of a group
        # where two differ (a hash collision) are regrouped exactly by their contents
        bad = lengths[first[group]] != lengths
        if len(occ):
            same = occ == occ[np.repeat(starts[first[group]], lengths) + pos]
            differs = np.zeros(nl, bool)
            differs[nz] = np.logical_and.reduceat(same, starts[nz]) == 0
            bad |= differs
        if bad.any():
            affected = np.flatnonzero(np.isin(group, np.unique(group[bad])))
            ids, nxt = {}, int(group.max()) + 1
            for i in affected.tolist():
                key = tuple(occ[starts[i]:starts[i] + lengths[i]].tolist())
                if key not in ids:
                    ids[key], nxt = nxt, nxt + 1
                group[i] = ids[key]
        return group


def _mix(x):
    """splitmix64's finaliser over a uint64 array (wrapping arithmetic)."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))
