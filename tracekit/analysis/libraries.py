"""The library line that holds the memory: the innermost third-party frame of each allocation.

A Hugging Face model run from a user's script allocates everything from the
user's one line `model(**batch)`; the stack says more. Each allocation gets
three frames from its stack alone (analysis/frames.py): the user's line, the
innermost frame of a third-party package (`transformers/models/qwen2/modeling_qwen2.py:249
in forward`, the package named from its path) and PyTorch's op.

Allocations made by autograd's engine in the backward pass have no Python
frames (CUDA records none on the engine's thread). Their library line is the
forward op's, found through the autograd node their C++ frames name
(`NllLossBackward0` is the backward of `nll_loss`): among the allocations of
the forward pass before that backward pass whose stacks run that op, the
library line when there is only one, else the one matched by order (the
engine runs nodes in reverse order of creation, so the k-th last `mul` of the
forward is taken for the k-th `MulBackward0` of the backward, in proportion).
Our recorder's `forward_frames` give it exactly. Each allocation says which of
these found its line (`how`).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from ..model import Trace, compact_column, unique_rows
from .frames import package_of, stack_roles
from .memo import per_trace

HOW = ("", "its own stack", "the recorder's forward_frames",
       "the forward op of its autograd node (the only line that ran it)",
       "the forward op of its autograd node (matched by order)")
NONE, OWN, RECORDED, NODE_ONLY, NODE_ORDER = range(len(HOW))


@dataclass
class AllocationLibraries:
    """Per allocation of a device (rows of replay(trace)[device].allocations)."""

    frame: np.ndarray  # int32: library frame id (the line of the model's code), -1 where none
    inner: np.ndarray  # int32: innermost library frame (a helper it called; = frame when none)
    user: np.ndarray  # int32: user frame id, -1 where none
    how: np.ndarray  # int8: index into HOW
    backward: np.ndarray  # bool: the line is the forward op of a backward allocation
    source: np.ndarray  # int32 row (int64 from 2**31 rows): the forward allocation whose line it took, -1: its own


_CAMEL = re.compile(r"(?<=[a-z0-9])(?=[A-Z])|(?<=[A-Z])(?=[A-Z][a-z])")


def node_op(node: str) -> str:
    """The forward op an autograd node is the backward of: `NllLossBackward0` -> `nll_loss`."""
    base = re.sub(r"Backward\d*$", "", node)
    return _CAMEL.sub("_", base).lower()


def op_matches(op: str, forward: str) -> bool:
    """True when the aten op name (overload included, e.g. `mul_Tensor`, `_log_softmax`,
    `nll_loss_forward`) is the op `forward` (`mul`, `log_softmax`, `nll_loss`)."""
    name = op.lstrip("_")
    if name == forward:
        return True
    if not name.startswith(forward + "_"):
        return False
    rest = name[len(forward) + 1:]
    return rest == "forward" or rest[:1].isupper() or rest in ("nd", "int", "dim", "self", "out", "dtype",
                                                              "default", "functional")


def allocation_libraries(trace: Trace, device: int) -> AllocationLibraries:
    return _allocation_libraries(trace, device)


@per_trace
def _allocation_libraries(trace: Trace, device: int) -> AllocationLibraries:
    from .phases import BACKWARD, phases
    from .replay import replay
    from .sites import stack_sites

    rep = replay(trace)[device]
    al = rep.allocations
    m = len(al)
    roles = stack_roles(trace)
    ss = stack_sites(trace)
    # in numpy's index type once: indexing with int32 converts the index anew for each of the lookups below
    own = al.stack_id.astype(np.intp)
    own += 1
    frame = roles.library[own]  # fancy indexing copies: these are the result's own arrays
    inner = roles.inner[own]
    user = ss.user_frame[own]
    how = np.where(roles.library >= 0, OWN, NONE).astype(np.int8)[own]  # a table over stacks, spread
    backward = np.zeros(m, bool)
    source = np.full(m, -1, np.int32 if m < 2**31 else np.int64)  # rows
    traced = al.alloc_index >= 0
    if not m or not rep.n:
        return AllocationLibraries(frame, inner, user, how, backward, source)
    recorded = trace.events.forward_stack_id[rep.events]
    # the recorder's forward frames: none (a constant column of -1) in files it did not write
    rec = np.zeros(m, bool)
    if not (recorded.strides == (0,) and recorded[0] < 0):
        fwd = np.full(m, -1, trace.events.forward_stack_id.dtype)
        fwd[traced] = recorded[al.alloc_index[traced]]
        rec = (fwd >= 0) & (frame < 0)
    if rec.any():
        frame[rec] = roles.library[fwd[rec] + 1]
        inner[rec] = roles.inner[fwd[rec] + 1]
        user[rec] = np.where(user[rec] >= 0, user[rec], ss.user_frame[fwd[rec] + 1])
        got = rec & (frame >= 0)
        how[got], backward[got] = RECORDED, True
    node = roles.node[own]
    need = traced & (frame < 0) & (node > 0)
    if need.any():
        ph = phases(trace)[device]
        _by_node(trace, al, ph, need, node, roles, frame, inner, user, how, backward, source, BACKWARD)
    # no backward line found from a forward one: one value throughout, kept as constant columns
    return AllocationLibraries(frame, inner, user, how, compact_column(backward), compact_column(source))


def _by_node(trace, al, ph, need, node, roles, frame, inner, user, how, backward, source, BACKWARD):
    """Backward allocations take the library line of the forward op their autograd node belongs to."""
    a = al.alloc_index
    n = ph.n
    # windows: each backward run, with the forward allocations made since the previous backward run ended
    if ph.source == "none":
        bstarts, bends = np.array([0]), np.array([n - 1])
    else:
        is_b = ph.phase == BACKWARD
        change = ph.run_starts()
        b_runs = change[is_b[change]]
        if not len(b_runs):
            return
        bstarts = b_runs
        bends = np.append(change, n)[np.searchsorted(change, b_runs) + 1] - 1
    prev_end = np.concatenate([[-1], bends[:-1]])
    own = al.stack_id + 1  # no int64 copy
    candidates = np.flatnonzero((a >= 0) & (frame >= 0) & (roles.node[own] == 0) & (how == OWN))
    cand_a = a[candidates]
    order = np.argsort(cand_a, kind="stable")
    candidates, cand_a = candidates[order], cand_a[order]
    rows = np.flatnonzero(need)
    win = np.searchsorted(bstarts, a[rows], side="right") - 1
    ok = (win >= 0) & (a[rows] <= bends[np.maximum(win, 0)])
    rows, win = rows[ok], win[ok]
    strings = trace.strings
    match_memo = {}
    for w in np.unique(win).tolist():
        lo, hi = np.searchsorted(cand_a, [prev_end[w] + 1, bstarts[w]])
        fw = candidates[lo:hi]
        if not len(fw):
            continue
        fw_stacks = own[fw]
        uniq_stacks = np.unique(fw_stacks)
        in_w = rows[win == w]
        for nid in np.unique(node[in_w]).tolist():
            known = match_memo.get(nid)
            if known is None:  # per stack: -1 not looked at yet, 0 no, 1 it runs the node's forward op
                known = match_memo[nid] = np.full(len(roles.ops), -1, np.int8)
            todo = uniq_stacks[known[uniq_stacks] < 0]
            if len(todo):
                target = node_op(strings[nid])
                ops_memo = {}
                for s_ in todo.tolist():
                    ops = roles.ops[s_]
                    v = ops_memo.get(ops)
                    if v is None:
                        v = ops_memo[ops] = any(op_matches(o, target) for o in ops)
                    known[s_] = v
            good = known[uniq_stacks] == 1
            if not good.any():
                continue
            f_rows = fw[np.isin(fw_stacks, uniq_stacks[good])]
            b_rows = in_w[node[in_w] == nid]
            lines = frame[f_rows]
            if (lines == lines[0]).all() and (inner[f_rows] == inner[f_rows[0]]).all():
                pick, kind = np.zeros(len(b_rows), np.int64), NODE_ONLY
            else:
                # the j-th of B backward allocations <- the forward one at the same place counted from the end
                j = np.arange(len(b_rows))
                pick, kind = len(f_rows) - 1 - (j * len(f_rows)) // len(b_rows), NODE_ORDER
            frame[b_rows] = lines[pick]
            inner[b_rows] = inner[f_rows[pick]]
            user[b_rows] = np.where(user[b_rows] >= 0, user[b_rows], user[f_rows[pick]])
            how[b_rows], backward[b_rows] = kind, True
            source[b_rows] = f_rows[pick]


def library_frame(trace: Trace, frame_id: int) -> dict | None:
    """{filename, line, name, package, found_by} of a library frame id (None for -1)."""
    if frame_id < 0:
        return None
    f = trace.frame(frame_id)
    pkg, how = package_of(f["filename"])
    return {**f, "package": pkg, "found_by": how}


def library_sites(trace: Trace, device: int, mask: np.ndarray, rules=None, limit: int = 20) -> list[dict]:
    """Allocations of `mask` grouped by (library line, user line, category, pass), largest first (cuBLAS
    workspaces left out: they are the handle's).

    Each row: bytes, count, library_frame {filename, line, name, package, found_by}, user_frame
    (frame dict or None), category, pass ("forward" or "backward": a backward row is memory autograd
    made for that forward line), op (PyTorch's op of its largest allocation), how (how the line was found)."""
    from .categories import categorize
    from .replay import replay

    rep = replay(trace)[device]
    al = rep.allocations
    libs = allocation_libraries(trace, device)
    cats = categorize(trace, rules)[device]
    # a cuBLAS workspace belongs to its handle, not to the line whose matmul happened to come first
    workspace = cats.labels == cats.names.index("workspace") if "workspace" in cats.names else np.zeros(len(al), bool)
    rows = np.flatnonzero(mask & (libs.frame >= 0) & ~workspace)
    if not len(rows):
        return []
    key = np.stack([libs.frame[rows].astype(np.int64), libs.inner[rows].astype(np.int64),
                    libs.user[rows].astype(np.int64),
                    cats.labels[rows].astype(np.int64), libs.backward[rows].astype(np.int64)], axis=1)
    uniq, inv = unique_rows(key)
    nbytes = np.bincount(inv, weights=al.size[rows].astype(np.float64))
    count = np.bincount(inv)
    roles = stack_roles(trace)
    out = []
    for k in np.argsort(-nbytes, kind="stable")[:limit]:
        members = rows[inv == k]
        lead = members[np.argmax(al.size[members])]
        lib, inn, usr, cat, bwd = (int(v) for v in uniq[k])
        op = trace.strings[int(roles.op[int(al.stack_id[lead]) + 1])] if al.stack_id[lead] >= 0 else ""
        out.append({"bytes": int(nbytes[k]), "count": int(count[k]), "library_frame": library_frame(trace, lib),
                    "inner_frame": library_frame(trace, inn) if inn != lib else None,
                    "user_frame": trace.frame(usr) if usr >= 0 else None, "category": cats.names[cat],
                    "pass": "backward" if bwd else "forward", "op": op or None,
                    "how": HOW[int(libs.how[lead])]})
    return out


def library_where(row: dict) -> str:
    """`modeling_qwen2.py:249 in forward (transformers)` for a library_sites row."""
    f = row["library_frame"]
    from .frames import short_path

    text = f"{short_path(f['filename'])}:{f['line']} in {f['name']}"
    if f.get("package"):
        text += f" ({f['package']})"
    g = row.get("inner_frame")
    if g:
        text += f" via {short_path(g['filename'])}:{g['line']} in {g['name']}"
    return ("backward of " + text) if row.get("pass") == "backward" else text


def allocation_library_where(trace: Trace, device: int) -> tuple[np.ndarray, np.ndarray]:
    """(strings, ids): every allocation's library line as one line of text (`library_where`), "" where it has
    none, as an index into unique strings (tables, the viewer's "Library line" column)."""
    from .replay import replay

    al = replay(trace)[device].allocations
    libs = allocation_libraries(trace, device)
    key = np.stack([libs.frame.astype(np.int64), libs.inner.astype(np.int64), libs.backward.astype(np.int64)], axis=1)
    if not len(key):
        return np.array([""], dtype=object), np.zeros(len(al), np.int32)
    uniq, inv = unique_rows(key)
    strings = np.empty(len(uniq), dtype=object)
    for k, (lib, inn, bwd) in enumerate(uniq.tolist()):
        if lib < 0:
            strings[k] = ""
            continue
        row = {"library_frame": library_frame(trace, lib), "inner_frame": library_frame(trace, inn) if inn != lib else None,
               "pass": "backward" if bwd else "forward"}
        strings[k] = library_where(row)
    return strings, inv.reshape(-1).astype(np.int32)
