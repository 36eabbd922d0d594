"""Allocation sites as a user reads them: their own line first, grouped by it.

A site is the user's frame that made an allocation. Allocations whose stack
holds no user frame at all (the autograd engine's thread in the backward
pass, recorded with C++ stacks) take the user's line that ran that pass (the
`loss.backward()` call seen on entries of the same phase run), and say which
autograd node made them. Sites group by (user frame, autograd node), so one
line never shows twice and the engine's work splits by node.

Our recorder writes, on each backward allocation, the stack of the forward op
whose backward made it (`forward_frames`, record/origins.py): that forward
line is the site ("backward of train.py:13 in loss_fn"), grouped apart from
the same line's forward allocations. Every allocation may also carry the
`nn.Module` that ran (`module`; for backward, the module of its forward op).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from ..model import Trace, compact_column
from .frames import USER, describe, frame_kinds, is_user, user_first, where
from .memo import per_trace
from .phases import phases
from .replay import DeviceReplay

_NODE = re.compile(r"((?<!\w)\w+Backward\d*)(::apply|_apply_functional)|(AccumulateGrad)")


@dataclass
class StackSites:
    """Per stack id + 1 (0: no stack): its first user frame and its autograd node."""

    user_frame: np.ndarray  # int32 frame id, -1 where the stack has no user frame
    node: np.ndarray  # int32 string id of the innermost autograd node name, 0 where none


@per_trace
def stack_sites(trace: Trace) -> StackSites:
    st = trace.stacks
    n = len(st)
    user = np.full(n + 1, -1, np.int32)
    node = np.zeros(n + 1, np.int32)
    if not n or not len(st.frame_ids):
        return StackSites(user, node)
    kinds = frame_kinds(trace)
    node_of_frame = np.zeros(len(trace.frames), np.int32)
    names = trace.frames.name
    seen: dict = {}
    for i, nid in enumerate(names.tolist()):
        v = seen.get(nid)
        if v is None:
            m = _NODE.search(trace.strings[nid])
            v = seen[nid] = trace.strings.intern(m.group(1) or m.group(3)) if m else 0
        node_of_frame[i] = v
    fids = st.frame_ids
    nonempty = np.diff(st.offsets) > 0
    starts = st.offsets[:-1][nonempty]
    big = np.iinfo(np.int64).max
    pos = np.arange(len(fids), dtype=np.int64)
    first_user = np.minimum.reduceat(np.where(kinds[fids] == USER, pos, big), starts)
    first_node = np.minimum.reduceat(np.where(node_of_frame[fids] > 0, pos, big), starts)
    rows = np.flatnonzero(nonempty) + 1
    ok = first_user < big
    user[rows[ok]] = fids[first_user[ok]]
    ok = first_node < big
    node[rows[ok]] = node_of_frame[fids[first_node[ok]]]
    return StackSites(user, node)


CHUNK = 1 << 18  # allocations whose site keys are made at a time


@dataclass
class AllocationSites:
    """Per allocation of a device: the stack that names its site, and its group key."""

    site_stack: np.ndarray  # int32: own stack, or the stack of the user's line that ran its pass
    key: np.ndarray  # int64: (user frame, node) packed; allocations with equal keys are one site
    borrowed: np.ndarray  # bool: the site comes from the pass, not the allocation's own stack
    forward: np.ndarray  # bool: the site is the forward op whose backward made the allocation
    module: np.ndarray  # int32 string id of the module that ran (0: not recorded)


def allocation_sites(trace: Trace, rep: DeviceReplay) -> AllocationSites:
    return _allocation_sites(trace, rep.device)


@per_trace
def _allocation_sites(trace: Trace, device: int) -> AllocationSites:
    from .categories import categorize
    from .replay import replay

    rep = replay(trace)[device]
    cats = categorize(trace)[device]  # first: its own temporaries come and go before this function's arrays
    al = rep.allocations
    ss = stack_sites(trace)
    own = al.stack_id
    m = len(own)
    site = own.astype(np.int32)  # a copy: stack ids (own, borrowed, forward) are int32
    fwd = np.full(m, -1, np.int32)
    module = np.zeros(m, np.int32)
    if rep.n:
        ev = trace.events
        stack = ev.stack_id[rep.events]
        # the recorder's forward frames and modules: constant columns (-1, 0) in files it did not write
        columns = [(out, col) for out, col, none in ((fwd, ev.forward_stack_id[rep.events], -1),
                                                     (module, ev.module[rep.events], 0))
                   if not (col.strides == (0,) and col[0] == none)]
        lone = []  # rows whose alloc entry's stack has no user frame: their site is borrowed
        for lo in range(0, m, CHUNK):  # a chunk of allocations at a time: no per-allocation int64 positions
            a = al.alloc_index[lo:lo + CHUNK]
            rows = np.flatnonzero(a >= 0)
            at = a[rows]
            st = stack[at]
            rows += lo
            site[rows] = st
            lone.append(rows[(ss.user_frame[st + st.dtype.type(1)] < 0) & (st >= 0)])  # stack ids < 2**31 - 1
            for out, col in columns:
                out[rows] = col[at]
        rows = np.concatenate(lone) if lone else np.zeros(0, np.int64)
        del lone
        if len(rows):
            site[rows] = _borrow(stack, ss.user_frame, al.alloc_index[rows], phases(trace)[device])
    forward = fwd >= 0
    site[forward] = fwd[forward]
    del fwd
    borrowed = (site != own) & ~forward
    # a line's backward allocations are a site apart from its forward ones
    backward_node = trace.strings.intern("backward") if forward.any() else None
    # a cuBLAS workspace is the handle's, not the line's that happened to run the first matmul: a site apart
    workspace = cats.labels == cats.names.index("workspace")
    workspace_node = trace.strings.intern("cuBLAS workspace") if workspace.any() else None
    width = len(trace.strings) + 1
    # the key of an allocation whose site is its own stack, with no node put in its place, is its stack's: a table
    # over stack ids; those with no stack take their reason's, the rest (borrowed, forward, workspace) their own
    s = np.arange(-1, len(ss.user_frame) - 1, dtype=np.int64)
    user = ss.user_frame.astype(np.int64)
    table = np.where(user >= 0, user * width + ss.node, (-2 - s) * width)
    key = table[own + own.dtype.type(1)]  # stack ids are below 2**31 - 1
    rows = np.flatnonzero(own < 0)
    key[rows] = (-(1 << 40) - cats.reason[rows].astype(np.int64)) * width
    special = site != own
    special |= forward
    if workspace_node is not None:
        special |= workspace
    rows = np.flatnonzero(special)
    del special
    for lo in range(0, len(rows), CHUNK):  # the key a chunk at a time: its int64 temporaries stay small
        r = rows[lo:lo + CHUNK]
        o = own[r].astype(np.int64)
        user = ss.user_frame[site[r] + 1].astype(np.int64)
        nodes = ss.node[o + 1].astype(np.int64)
        if backward_node is not None:
            nodes = np.where(forward[r] & (nodes == 0), backward_node, nodes)
        if workspace_node is not None:
            nodes = np.where(workspace[r], workspace_node, nodes)
        # no user frame: the stack itself is the site; no stack at all: what the categories say of it
        reason = cats.reason[r].astype(np.int64)
        first = np.where(user >= 0, user, np.where(o >= 0, -2 - o, -(1 << 40) - reason))
        key[r] = first * width + np.where(user >= 0, nodes, 0)
    # without the recorder's forward frames and modules these are one value throughout: constant columns
    return AllocationSites(site_stack=site, key=key, borrowed=compact_column(borrowed),
                           forward=compact_column(forward), module=compact_column(module))


def _borrowed_sites(stack, user_frame, at, phases, chunk: int = 1 << 20):
    """The site stack of the entries at positions `at`: their own stack, or, for a stack with no user frame,
    the one _borrow finds."""
    out = stack[at]
    lone = np.flatnonzero((user_frame[out + out.dtype.type(1)] < 0) & (out >= 0))  # stack ids < 2**31 - 1
    if len(lone):
        out[lone] = _borrow(stack, user_frame, at[lone], phases, chunk)
    return out


def _borrow(stack, user_frame, q, phases, chunk: int = 1 << 20):
    """The site of the entries at positions `q` (their stacks have no user frame): the stack of the nearest
    entry in the same run (phases.run_of) that has one (before it, else after it); else their own stack.
    Only these entries are looked up: the positions of the entries with a user frame are found a chunk of
    entries at a time, and searched."""
    out = stack[q]
    if not (user_frame >= 0).any():  # no stack to borrow from
        return out
    n = len(stack)
    pos_t = np.int32 if n < 2**31 else np.int64
    users = np.concatenate([np.flatnonzero(user_frame[stack[lo:lo + chunk] + stack.dtype.type(1)] >= 0).astype(pos_t)
                            + pos_t(lo) for lo in range(0, n, chunk)])
    if not len(users):
        return out
    k = np.searchsorted(users, q)  # users[k - 1] < q < users[k]: q itself has none
    run = phases.run_of(q)
    prev = users[np.maximum(k - 1, 0)]
    ok = (k > 0) & (phases.run_of(prev) == run)
    out[ok] = stack[prev[ok]]
    nxt = users[np.minimum(k, len(users) - 1)]
    later = ~ok & (k < len(users))
    later &= phases.run_of(nxt) == run
    out[later] = stack[nxt[later]]
    return out


def site_frames(trace: Trace, own_stack: int, site_stack: int) -> list[dict]:
    """The allocation's whole stack, user frames first; a borrowed site's user frames lead."""
    own = user_first(trace.stack(own_stack)) if own_stack >= 0 else []
    if site_stack == own_stack or site_stack < 0:
        return own
    return [f for f in trace.stack(site_stack) if is_user(f)] + own


def site_info(trace: Trace, own_stack: int, site_stack: int | None = None, forward: bool | None = None,
              module: int = 0) -> dict:
    """frames (user first), user_frame, what the internal frames reveal, and the one-line site.

    `forward`: the site is the forward op whose backward made the allocation
    (None: so when `site_stack` is another stack that some entry names as
    its forward_frames); `module`: the string id of its module.
    """
    site_stack = own_stack if site_stack is None else site_stack
    if forward is None:
        forward = site_stack != own_stack and site_stack >= 0 and site_stack in forward_stacks(trace)
    frames = site_frames(trace, own_stack, site_stack)
    what = describe(trace.stack(own_stack)) if own_stack >= 0 else ""
    user = frames[0] if frames and is_user(frames[0]) else None
    # a user line says where; what the internals reveal is added when it is not the line's own op
    shown = what if user is None or site_stack != own_stack or what in _WORTH_SAYING else ""
    if forward:
        shown = what if what and what not in ("autograd engine",) else ""
    line = where(frames, shown)
    name = trace.strings[module] if module > 0 else None
    if forward:
        line = f"backward of {line}" + (f" in module {name}" if name else "")
    return {"frames": frames, "user_frame": user, "what": what or None, "where": line,
            "forward_origin": bool(forward), "module": name}


@per_trace
def forward_stacks(trace: Trace) -> frozenset:
    """The stack ids some entry names as its forward_frames."""
    f = trace.events.forward_stack_id
    return frozenset(np.unique(f[f >= 0]).tolist())


# What internal frames reveal that the user's line alone does not.
_WORTH_SAYING = {"cuBLAS workspace", "p.grad (AccumulateGrad)", "autocast cast", "NCCL / c10d communication buffer",
                 "Triton autotuning buffer"}


def group_sites(trace: Trace, rep: DeviceReplay, mask: np.ndarray, limit: int = 10) -> list[dict]:
    """Sites of the masked allocations, largest first: bytes, count, first/last entry, and site_info."""
    al = rep.allocations
    rows = np.flatnonzero(mask)
    if not len(rows):
        return []
    sites = allocation_sites(trace, rep)
    uniq, inv = np.unique(sites.key[rows], return_inverse=True)
    nbytes = np.bincount(inv, weights=al.size[rows].astype(np.float64))
    count = np.bincount(inv)
    out = []
    for k in np.argsort(-nbytes, kind="stable")[:limit]:
        if nbytes[k] <= 0:
            break
        members = rows[inv == k]
        lead = members[np.argmax(al.size[members])]
        info = site_info(trace, int(al.stack_id[lead]), int(sites.site_stack[lead]), bool(sites.forward[lead]),
                         int(sites.module[lead]))
        if al.stack_id[lead] < 0 and not sites.forward[lead]:
            info["where"] = f"(no stack) {_reason(trace, rep, lead)}"
        out.append({"bytes": int(nbytes[k]), "count": int(count[k]), **info,
                    "stack_id": int(al.stack_id[lead]),
                    "start_index": int(al.alloc_index[members].min()), "end_index": int(al.free_index[members].max()),
                    "rows": members})
    return out


def allocation_where(trace: Trace, rep: DeviceReplay) -> tuple[np.ndarray, np.ndarray]:
    """(strings, ids): every allocation's one-line site, as an index into unique strings (tables, exports)."""
    al = rep.allocations
    sites = allocation_sites(trace, rep)
    uniq, first, inv = np.unique(sites.key, return_index=True, return_inverse=True)
    strings = np.empty(len(uniq), dtype=object)
    for k, row in enumerate(first.tolist()):
        if al.stack_id[row] < 0 and not sites.forward[row]:
            strings[k] = f"(no stack) {_reason(trace, rep, row)}"
        else:
            strings[k] = site_info(trace, int(al.stack_id[row]), int(sites.site_stack[row]),
                                   bool(sites.forward[row]), int(sites.module[row]))["where"]
    return strings, inv.astype(np.int32)


def _reason(trace, rep, row) -> str:
    from .categories import categorize

    c = categorize(trace)[rep.device]
    name, why = c.names[c.labels[row]], c.reasons[c.reason[row]]
    return why if why.endswith(name) else f"{name}: {why}"  # "tagged by the recorder: parameter" says it already


def public(group: dict) -> dict:
    """A site group as JSON-ready builtins (drops the row indices)."""
    return {k: v for k, v in group.items() if k not in ("rows", "stack_id")}
