"""Joins: which logged call made each allocation, and which forward call caused each backward one.

Every torch call made from Python is a row of the op log (oplog.py): the allocation source's event
indices (or times) before and after it, its stack, its module, and the autograd sequence numbers of the
nodes it made. The profiler gives the ranges in which the engine ran each backward node, with that
node's sequence number (ranges.py). So:

- an allocation's frames are those of the innermost call it happened in (`innermost`): the line that
  runs, exactly; allocations made by the engine during ``loss.backward()`` are in that call;
- an allocation made inside a backward node's range (`innermost_range`) was caused by the forward call
  that made the node (`OriginTable`): its stack becomes the entry's ``forward_frames`` and its module
  the entry's ``module``; a forward allocation's ``module`` is its call's module.

Everything here works on numpy arrays, once per chunk of events: nothing is done per allocation in
Python while the step runs. TRACEKIT_ORIGINS=0 (or ``record(..., origins=False)``) records without the
profiler and the module hooks: no ``forward_frames`` and no ``module``.
"""
from __future__ import annotations

import os

import numpy as np

BACKWARD_RANGE = "autograd::engine::evaluate_function: "
MAX_CALLS = 1 << 17  # node-making calls remembered, the newest (their backward may come some iterations later)

# columns of an op-log row (oplog.OpLog.rows)
K0, K1, T0, T1, STACK, MODULE, S0, S1, PARENT, CID, OP, CONTAINER = range(12)


def enabled(default=True) -> bool:
    v = os.environ.get("TRACEKIT_ORIGINS")
    return default if v is None else v.strip().lower() not in ("0", "false", "no", "off", "")


class Calls:
    """One chunk's op-log rows as arrays, for joining events to the call they happened in."""

    def __init__(self, rows, by_time=False):
        a = np.asarray(rows, dtype=np.int64).reshape(-1, 12) if len(rows) else np.zeros((0, 12), np.int64)
        lo, hi = (T0, T1) if by_time else (K0, K1)
        self.rows = a
        inner = a[a[:, CONTAINER] == 0]
        outer = a[a[:, CONTAINER] != 0]
        self.inner = inner[np.argsort(inner[:, lo], kind="stable")]
        self.outer = outer[np.argsort(outer[:, lo], kind="stable")]
        self.lo, self.hi = lo, hi
        self._outer_by_cid = {int(c): i for i, c in enumerate(self.outer[:, CID])}

    def innermost(self, keys):
        """Row (into `self.inner` or `self.outer`, see `which`) of the innermost call holding each key
        (event index or time): (which, row) arrays, which = 0 none, 1 inner, 2 outer."""
        n = len(keys)
        which = np.zeros(n, np.int8)
        row = np.full(n, -1, np.int64)
        if not n:
            return which, row
        lo, hi = self.lo, self.hi
        if len(self.inner):
            j = np.searchsorted(self.inner[:, lo], keys, side="right") - 1
            ok = j >= 0
            ok[ok] = keys[ok] < self.inner[j[ok], hi]
            which[ok] = 1
            row[ok] = j[ok]
        rest = which == 0
        if len(self.outer) and rest.any():
            keys_r = keys[rest]
            j = np.searchsorted(self.outer[:, lo], keys_r, side="right") - 1
            res = np.full(len(keys_r), -1, np.int64)
            for _ in range(8):  # containers nest (a backward inside a backward): walk out to the one holding it
                ok = j >= 0
                if not ok.any():
                    break
                hold = np.zeros(len(j), bool)
                hold[ok] = keys_r[ok] < self.outer[j[ok], hi]
                found = hold & (res < 0)
                res[found] = j[found]
                nxt = np.full(len(j), -1, np.int64)
                todo = ok & ~hold & (res < 0)
                for i in np.flatnonzero(todo):
                    nxt[i] = self._outer_by_cid.get(int(self.outer[j[i], PARENT]), -1)
                j = nxt
            found = res >= 0
            idx = np.flatnonzero(rest)
            which[idx[found]] = 2
            row[idx[found]] = res[found]
        return which, row

    def column(self, which, row, col, default=-1):
        out = np.full(len(which), default, np.int64)
        m = which == 1
        out[m] = self.inner[row[m], col]
        m = which == 2
        out[m] = self.outer[row[m], col]
        return out


class Ranges:
    """Backward node ranges (start_ns, end_ns, seq): the innermost holding a time."""

    def __init__(self, ranges):
        a = np.array(ranges, dtype=np.int64).reshape(-1, 3) if ranges else np.zeros((0, 3), np.int64)
        self.a = a[np.argsort(a[:, 0], kind="stable")]

    def __len__(self):
        return len(self.a)

    def innermost(self, times_ns, slack_ns=0, between=None):
        """The sequence number of the innermost range holding each time (-1: none, or a node without one,
        AccumulateGrad). Ranges nest (a node running a nested backward): the latest-starting range that
        still holds the time is innermost.

        between: a mask of the times known to be inside a backward pass; those that no range holds take
        the node that ran last. The engine adds a node's gradients into the buffers of the next nodes
        after the node's own range has closed (a tensor used twice in forward gets its gradients summed
        there): that memory is the last node's."""
        n = len(times_ns)
        out = np.full(n, -1, np.int64)
        if not n or not len(self.a):
            return out
        if between is not None and n > 64 and between.sum() < n // 2:  # only the times inside a backward pass
            sub = np.flatnonzero(between)
            out[sub] = self.innermost(times_ns[sub], slack_ns, np.ones(len(sub), bool))
            return out
        starts, ends, seqs = self.a[:, 0], self.a[:, 1] + slack_ns, self.a[:, 2]
        j = np.searchsorted(starts, times_ns, side="right") - 1
        last = j.copy()
        todo = j >= 0
        for _ in range(16):
            if not todo.any():
                break
            idx = np.flatnonzero(todo)
            hold = times_ns[idx] <= ends[j[idx]]
            out[idx[hold]] = seqs[j[idx[hold]]]
            todo[idx[hold]] = False
            j[idx[~hold]] -= 1
            todo[idx[~hold]] &= j[idx[~hold]] >= 0
        if between is not None:
            held = np.zeros(n, bool)
            held[out >= 0] = True
            # times held by a range without a number (AccumulateGrad) stay -1
            miss = between & ~held & (last >= 0)
            if miss.any():
                idx = np.flatnonzero(miss)
                inside = np.zeros(len(idx), bool)
                jj = last[idx]
                for _ in range(16):  # is it inside any range at all (then it is that range's, maybe -1)?
                    ok = jj >= 0
                    if not ok.any():
                        break
                    h = ok.copy()
                    h[ok] = times_ns[idx[ok]] <= ends[jj[ok]]
                    inside |= h
                    jj = np.where(ok & ~h, jj - 1, -1)
                free = idx[~inside]
                # the node that finished last before the time (an outer node ends after the nested ones)
                by_end = np.argsort(ends, kind="stable")
                k = np.searchsorted(ends[by_end], times_ns[free], side="right") - 1
                ok = k >= 0
                out[free[ok]] = seqs[by_end[k[ok]]]
        return out


class OriginTable:
    """The forward calls that made autograd nodes: sequence numbers [s0, s1) -> (stack, module).
    Bounded (`MAX_CALLS`, the newest kept): sequence numbers only grow, so the table stays sorted."""

    def __init__(self, cap=MAX_CALLS):
        self.cap = cap
        self.s0 = np.zeros(0, np.int64)
        self.s1 = np.zeros(0, np.int64)
        self.stack = np.zeros(0, np.int64)
        self.module = np.zeros(0, np.int64)

    def add(self, calls: Calls):
        rows = calls.rows
        made = rows[(rows[:, S1] > rows[:, S0]) & (rows[:, CONTAINER] == 0)]
        if not len(made):
            return
        made = made[np.argsort(made[:, S0], kind="stable")]
        self.s0 = np.concatenate([self.s0, made[:, S0]])[-self.cap:]
        self.s1 = np.concatenate([self.s1, made[:, S1]])[-self.cap:]
        self.stack = np.concatenate([self.stack, made[:, STACK]])[-self.cap:]
        self.module = np.concatenate([self.module, made[:, MODULE]])[-self.cap:]
        if len(self.s0) > 1 and (np.diff(self.s0) < 0).any():  # a new thread's counter, a reset: keep sorted
            order = np.argsort(self.s0, kind="stable")
            self.s0, self.s1, self.stack, self.module = (x[order] for x in (self.s0, self.s1, self.stack,
                                                                              self.module))

    def lookup(self, seqs):
        """(stack, module) per sequence number (-1, -1 where no logged call made that node)."""
        n = len(seqs)
        stack = np.full(n, -1, np.int64)
        module = np.full(n, -1, np.int64)
        if not n or not len(self.s0):
            return stack, module
        j = np.searchsorted(self.s0, seqs, side="right") - 1
        ok = (seqs >= 0) & (j >= 0)
        ok[ok] = seqs[ok] < self.s1[j[ok]]
        stack[ok] = self.stack[j[ok]]
        module[ok] = self.module[j[ok]]
        return stack, module

    def clear(self):
        self.__init__(self.cap)
