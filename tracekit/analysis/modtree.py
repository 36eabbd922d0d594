"""The nn.Module that made each allocation, from its stack, for files without module tags.

Our recorder writes the module on every allocation. A snapshot made with
torch's own API has none, but its Python frames hold the chain of `forward`
calls: `modeling_qwen2.py:452 in forward` (the model's), `:388 in forward`
(its decoder, calling a layer), `:282 in forward` (the layer, calling its
attention), `torch/nn/modules/linear.py in forward` (a Linear). The chains of
all stacks make a tree: a module is its caller module plus the line that
called it. Each module is named, top down:

- **by source**: the library's file is read with `ast`, never imported or
  run (io/sources.py), where the frame says it is or in this machine's
  installed copy of the package. The root is the class whose `forward` holds
  the root's lines; a child is the attribute its caller's line calls
  (`self.self_attn(...)` -> `self_attn`; `for layer in self.layers: layer(...)`
  -> `layers`, numbered), of the class that attribute is built from in the
  caller's `__init__`. When the installed copy is another version (its lines
  moved), each module's recorded lines are aligned to its `forward` in the
  installed source by one shift per module, the one that puts most of the
  lines that call a module on lines that call one ("by source, lines shifted");
- **by file and function** otherwise: `forward@modeling_qwen2.py:452`, the
  module called from that line.

Repeated layers: the i-th run of a numbered module's `forward` within one run
of its caller is instance i (a run starts when the module's own line goes
back, or when other code ran in between), so allocations get
`model.layers.2.self_attn` and the module table folds them back
(`model.layers.*.self_attn`, Qwen2DecoderLayer ×4). Backward allocations (no
Python frames) take the module of the forward allocation their autograd
node is matched to (analysis/libraries.py).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..io.sources import budget as sources_budget
from ..io.sources import locate, outline
from ..model import Trace, unique_ids
from .frames import LIB, OP, USER, frame_kinds, package_of
from .memo import per_trace

MAX_SHIFT = 120  # lines a module's forward may have moved between the recorded and the installed version
_TORCH_MODULE = re.compile(r"torch[/\\]nn[/\\]modules[/\\]\w+\.py$")
_SEP = re.compile(r"[/\\]")
HOWS = ("", "by source", "by source, lines shifted (another version installed)", "by file and function")
BY_SOURCE, SHIFTED, BY_FILE = 1, 2, 3


@dataclass
class Node:
    """A module in the tree of forward calls: its caller and the caller's line that called it."""

    parent: int  # node id, -1 for a root
    caller_line: int  # the line in the parent's forward that called it
    file: str  # the file of its own forward
    lines: set = field(default_factory=set)  # lines of its own forward seen in frames
    children: dict = field(default_factory=dict)  # (caller line, child's file) -> child node id
    name: str = ""  # attribute ("self_attn") or class for a root
    cls: str = ""
    looped: bool = False  # called in a loop over a ModuleList: its instances are numbered
    how: int = 0


@dataclass
class StackModules:
    """Per stack id + 1: the chain of (node id, line of that node's forward) root first; the nodes."""

    chains: list  # [tuple[(node, line), ...]]; () where the stack runs no forward
    nodes: list


def _relative(filename: str, package: str | None) -> str | None:
    """The path of a file inside its package ('models/qwen2/modeling_qwen2.py')."""
    if not package:
        return None
    parts = _SEP.split(filename)
    for i in range(len(parts) - 1, -1, -1):
        if parts[i] == package:
            return "/".join(parts[i + 1:])
    return None


def _source(filename: str):
    if not filename.endswith(".py"):  # only Python source is read (a frame may name any file)
        return None
    pkg, _ = package_of(filename)
    if pkg is None and _TORCH_MODULE.search(filename):
        pkg = "torch"
    path, _ = locate(filename, pkg, _relative(filename, pkg))
    return outline(path) if path else None


@per_trace
def stack_modules(trace: Trace) -> StackModules:
    st, fr, strings = trace.stacks, trace.frames, trace.strings
    n = len(st)
    chains: list[tuple] = [()] * (n + 1)
    fwd_id = strings.index.get("forward")
    if not n or not len(st.frame_ids) or fwd_id is None:
        return StackModules(chains, [])
    kinds = frame_kinds(trace)
    fname = {i: strings[i] for i in np.unique(fr.filename).tolist()}
    is_fwd = fr.name == fwd_id
    cand = np.flatnonzero(is_fwd)
    ok = np.zeros(len(fr), bool)
    for i in cand.tolist():
        f = fname[int(fr.filename[i])]
        ok[i] = kinds[i] in (LIB, USER) or (kinds[i] == OP and bool(_TORCH_MODULE.search(f)))
    nodes: list[Node] = []
    roots: dict = {}
    fids = st.frame_ids
    for s in range(n):
        ids = fids[st.offsets[s]:st.offsets[s + 1]]
        sel = ids[ok[ids]][::-1]  # outermost first
        if not len(sel):
            continue
        chain = []
        node: int = -1
        caller_line = -1  # the line that called the current node (-1: a root)
        for i in sel.tolist():
            f, line = fname[int(fr.filename[i])], int(fr.line[i])
            if node < 0:
                root = roots.get(f)
                if root is None:
                    root = roots[f] = len(nodes)
                    nodes.append(Node(parent=-1, caller_line=-1, file=f))
                node = root
            else:
                parent = nodes[node]
                child = parent.children.get((caller_line, f))
                if child is None:
                    child = parent.children[(caller_line, f)] = len(nodes)
                    nodes.append(Node(parent=node, caller_line=caller_line, file=f))
                node = child
            nodes[node].lines.add(line)
            chain.append((node, line))
            caller_line = line
        chains[s + 1] = tuple(chain)
    with sources_budget():  # the library sources one trace's module tree may read
        for r in roots.values():
            _resolve(nodes, r)
    return StackModules(chains, nodes)


# the shifts _align tries, nearest first (0, -1, 1, -2, 2, ...): the first least cost in this order wins
_SHIFTS = np.array([0] + [s for d in range(1, MAX_SHIFT + 1) for s in (-d, d)], np.int64)
_ROWS = 2048  # caller lines per block of the (lines x shifts) table


def _sorted_lines(node: Node):
    """The node's lines and caller lines as sorted int64 arrays (kept on the node: its lines are final)."""
    got = node.__dict__.get("_sorted")
    if got is None:
        got = node.__dict__["_sorted"] = (np.array(sorted(node.lines), np.int64),
                                          np.array(sorted({line for line, _ in node.children}), np.int64))
    return got


def _align(node: Node, o, lo: int, hi: int):
    """(shift, cost) that best places the node's recorded lines on its forward [lo, hi] in the source.

    The cost of a shift: how far the recorded lines land from where they should (a caller line from the
    nearest line that calls a module, any line from [lo, hi]; tests/test_bounded_cost.py holds the definition
    line by line), for every shift in [-MAX_SHIFT, MAX_SHIFT], in time linear in the node's lines: the lines that
    land outside [lo, hi] cost through prefix sums over the sorted lines; only the caller lines that can land
    inside are looked at one by one, against the sorted calls."""
    lines, callers = _sorted_lines(node)
    calls = np.array(sorted(ln for ln in o.calls if lo <= ln <= hi), np.int64)
    s = _SHIFTS
    n = len(lines)
    prefix = np.concatenate(([0], np.cumsum(lines)))
    k = np.searchsorted(lines, lo - s, "left")  # lines with ln + s < lo
    cost = k * (10 + lo - s) - prefix[k]
    j = np.searchsorted(lines, hi - s, "right")  # lines with ln + s > hi
    cost += (n - j) * (10 - hi + s) + (prefix[n] - prefix[j])
    near = callers[(callers >= lo - MAX_SHIFT) & (callers <= hi + MAX_SHIFT)]
    for r in range(0, len(near), _ROWS):
        x = near[r:r + _ROWS, None] + s[None, :]
        inside = (x >= lo) & (x <= hi)
        if len(calls):
            pos = np.searchsorted(calls, x)
            left = np.abs(x - calls[np.maximum(pos - 1, 0)])
            right = np.abs(calls[np.minimum(pos, len(calls) - 1)] - x)
            dist = np.minimum(left, right)
            cost += np.where(inside & (dist > 0), 1 + dist, 0).sum(axis=0)
        else:
            cost += 11 * inside.sum(axis=0)
    i = int(np.argmin(cost))
    return int(s[i]), int(cost[i])


def _resolve(nodes: list, root: int):
    """Name the root from the source (the forward its lines fit best), then its children top down."""
    node = nodes[root]
    o = _source(node.file)
    placed = None
    if o is not None:
        for lo, hi, cls in o.forwards():
            shift, cost = _align(node, o, lo, hi)
            if placed is None or (cost, abs(shift)) < (placed[2], abs(placed[1])):
                placed = (cls, shift, cost, lo, hi)
    if placed and placed[2] <= len(node.lines):  # most of its lines fit
        node.name = node.cls = placed[0]
        node.how = BY_SOURCE if placed[1] == 0 and placed[2] == 0 else SHIFTED
        _children(nodes, root, o, placed[0], placed[1])
    else:
        node.name, node.how = f"forward@{_short(node.file)}", BY_FILE
        _children(nodes, root, None, "", 0)


def _children(nodes, parent_id, o, parent_cls, shift):
    """Name the children of a named node, and theirs, top down (a loop, not recursion: a stack may nest
    forwards deeper than Python's recursion limit)."""
    work = [(parent_id, o, parent_cls, shift)]
    while work:
        later = []
        _children_of(nodes, *work.pop(), later)
        work.extend(reversed(later))  # depth first, in line order, as the recursion went


def _children_of(nodes, parent_id, o, parent_cls, shift, later):
    parent = nodes[parent_id]
    attrs = o.attributes.get(parent_cls, {}) if o is not None else {}
    edges = sorted(parent.children.items())  # ((caller line, child's file), child id), in line order
    sources = {f: _source(f) for (_, f), _ in edges}
    matched = _match(o, parent_cls, shift, edges, attrs, sources, parent.file) if o is not None else {}
    for (line, child_file), child_id in edges:
        child = nodes[child_id]
        got = matched.get(child_id)
        if got and got[0] == "<super>":  # the module's base class running for it: not a module of its own
            child.name, child.looped, child.cls, child.how = "", False, parent.cls, parent.how
            later.append((child_id, None, "", 0))
            continue
        if got:
            child.name, child.looped, child.cls = got
        else:
            child.name = f"forward@{_short(parent.file)}:{line}"
        co = sources[child_file] if child.cls else None
        span = co.forward_of(child.cls) if co is not None else None
        if span:
            s2, cost = _align(child, co, *span)
            inside = sum(1 for ln in child.lines if span[0] <= ln + s2 <= span[1])
            if inside * 2 >= len(child.lines):
                child.how = BY_SOURCE if s2 == 0 and cost == 0 and parent.how == BY_SOURCE else SHIFTED
                later.append((child_id, co, child.cls, s2))
                continue
        child.how = parent.how if got else BY_FILE  # named by its caller's source, class or not
        later.append((child_id, None, "", 0))


MAX_REACH = 12  # lines a caller's line may land from the call it made, after the function's shift
UNKNOWN_CLASS = 3  # extra cost of a call whose module class the caller's __init__ does not say


def _attr_class(o, cls, chain) -> str:
    """The class `self.<chain>` is built from, walking attributes (`model.decoder` -> OPTModel -> OPTDecoder)."""
    for part in chain.split("."):
        cls = o.attributes.get(cls, {}).get(part, "")
        if not cls:
            return ""
    return cls


def _match(o, parent_cls, shift, edges, attrs, sources, parent_file=None) -> dict:
    """{child id: (attribute, looped, class)}: the recorded caller lines (in order) matched to the lines of the
    caller's forward that call modules (in order), so that order is kept, a call's class has its forward in
    the callee's file, and the lines move least from where the function's shift puts them."""
    span = o.forward_of(parent_cls) if parent_cls else None
    lo, hi = span if span else (min(o.calls, default=0), max(o.calls, default=0))
    cands = []  # (line, attribute, looped, class); a call spread over lines is listed at each of them
    for ln in sorted(x for x in o.calls if lo <= x <= hi):
        for chain, looped in o.calls[ln]:
            if chain == "<super>":
                cands.append((ln, chain, False, ""))
                continue
            head = chain.split(".")[0]
            if attrs and head not in attrs:
                continue  # not a module the caller's __init__ builds (a method, a function attribute)
            cands.append((ln, chain, looped, _attr_class(o, parent_cls, chain)))
    if not cands or not edges:
        return {}
    defined = {f: ({c for _, _, c in src.forwards()} if src is not None else set()) for f, src in sources.items()}
    inf = float("inf")
    r, c = len(edges), len(cands)
    chain_of = lambda j: cands[j][1]  # noqa: E731

    def cost(i, j):
        (line, f), _ = edges[i]
        ln, _, _, cls = cands[j]
        d = abs(ln - (line + shift))
        if d > MAX_REACH:
            return inf
        if chain_of(j) == "<super>":  # the base class's forward, wherever it lives
            return d
        if cls and defined[f]:
            return d if cls in defined[f] else inf
        return d + UNKNOWN_CLASS
    # dp[i][j]: least cost with edges[:i] placed on cands[:j] (edges may stay unplaced, at a cost)
    skip = MAX_REACH + UNKNOWN_CLASS + 1
    dp = [[inf] * (c + 1) for _ in range(r + 1)]
    back: list[list[Any]] = [[None] * (c + 1) for _ in range(r + 1)]
    for j in range(c + 1):
        dp[0][j] = 0
    for i in range(1, r + 1):
        dp[i][0] = dp[i - 1][0] + skip
        back[i][0] = ("skip", 0)
        for j in range(1, c + 1):
            best, how = dp[i][j - 1], ("next", j - 1)
            if dp[i - 1][j] + skip < best:  # edge i-1 unplaced
                best, how = dp[i - 1][j] + skip, ("skip", j)
            k = cost(i - 1, j - 1)
            if k < inf and dp[i - 1][j - 1] + k < best:
                best, how = dp[i - 1][j - 1] + k, ("take", j - 1)
            # several recorded lines may be one call written over lines: stay on the same call
            if k < inf and i >= 2 and back[i - 1][j] and back[i - 1][j][0] == "take" and dp[i - 1][j] + k < best:
                best, how = dp[i - 1][j] + k, ("same", j)
            dp[i][j], back[i][j] = best, how
    out = {}
    i, j = r, c
    while i > 0:
        kind, pj = back[i][j]
        if kind == "next":
            j = pj
            continue
        if kind in ("take", "same"):
            ln, chain, looped, cls = cands[pj if kind == "take" else j - 1]
            if not cls:  # a module the caller's __init__ does not name a class for (ACT2FN[...]): the callee's
                src = sources[edges[i - 1][0][1]]
                fw = src.forwards() if src is not None else []
                cls = fw[0][2] if len(fw) == 1 else ""
            same = sorted({x[1] for x in cands if x[0] == ln and x[3] == cls and x[1] != "<super>"})
            if cls and len(same) > 1:  # several modules of one class called on one line: not told apart
                chain = "|".join(same)
            out[edges[i - 1][1]] = (chain, looped, cls)
            if kind == "take":
                j = pj
        i -= 1
    return out


def _short(filename: str) -> str:
    return _SEP.split(filename)[-1]


# -- per allocation: module paths with numbered layers ----------------------------------------------

@dataclass
class AllocationModules:
    """Per allocation of a device: its module path and class chain, as indices into `names` (0: "", none).

    (Indices into a table of their own, not the trace's interned strings: this result is kept in the cache
    with the analysis, and strings interned while analysing are not.)"""

    module: np.ndarray  # int32 index into names: "model.layers.2.self_attn" (root: its class name)
    classes: np.ndarray  # int32 index into names: "Qwen2ForCausalLM > Qwen2Model > Qwen2DecoderLayer[2] > ..."
    how: np.ndarray  # int8 index into HOWS (the least sure of its chain)
    names: np.ndarray  # object array of str; names[0] == ""


def allocation_modules(trace: Trace, device: int) -> AllocationModules:
    return _allocation_modules(trace, device)


@per_trace
def _allocation_modules(trace: Trace, device: int) -> AllocationModules:
    from .libraries import allocation_libraries
    from .replay import replay

    rep = replay(trace)[device]
    al = rep.allocations
    m = len(al)
    sm = stack_modules(trace)
    module = np.zeros(m, np.int32)
    classes = np.zeros(m, np.int32)
    how = np.zeros(m, np.int8)
    table = {"": 0}
    intern = lambda text: table.setdefault(text, len(table))  # noqa: E731

    def done():
        names = np.empty(len(table), dtype=object)
        names[:] = list(table)
        return AllocationModules(module, classes, how, names)
    if not m or not sm.nodes:
        return done()
    # the stack that names each allocation's module: its own, or its forward op's for backward allocations
    libs = allocation_libraries(trace, device)
    stack = al.stack_id
    src = libs.source
    if not (src.strides == (0,) and src[0] < 0):  # (a constant column of -1: every allocation's own stack)
        take = src >= 0
        if take.any():
            stack = stack.astype(np.int64)  # a copy
            stack[take] = al.stack_id[src[take]]
        del take
    with_chain = np.array([bool(c) for c in sm.chains], bool)
    if not _loop_depth(sm):  # no numbered module: the key is the stack alone, its module a table over stack ids
        return _by_stack(sm, stack, with_chain, intern, done)
    index_of = _instances(trace, rep, sm, stack)
    rows = np.flatnonzero(with_chain[stack + 1])
    if not len(rows):
        return done()
    depth = index_of.shape[1]
    cols = [stack[rows]] + [index_of[rows, c] for c in range(depth)]  # the key's columns, without the rows
    del stack, index_of
    uniq, inv = _unique_rows(cols)
    paths, cls_ids, worsts = (np.zeros(len(uniq), t) for t in (np.int32, np.int32, np.int8))
    for k, row in enumerate(uniq.tolist()):
        path, cls, worst = _path(sm.nodes, sm.chains[row[0] + 1], row[1:])
        paths[k], cls_ids[k], worsts[k] = intern(path), intern(cls), worst
    module[rows], classes[rows], how[rows] = paths[inv], cls_ids[inv], worsts[inv]
    return done()


def _by_stack(sm, stack, with_chain, intern, done) -> AllocationModules:
    """_allocation_modules where no chain has a numbered module: each stack's path, class chain and how looked
    up once (in ascending stack order, as the rows' unique keys are named) and spread to the allocations by
    their stack, without the rows that have a chain or their unique keys."""
    s1 = stack.astype(np.intp)  # in numpy's index type once, for the four lookups below
    s1 += 1
    present = np.zeros(len(with_chain), bool)
    present[s1] = True
    paths, cls_ids = np.zeros(len(with_chain), np.int32), np.zeros(len(with_chain), np.int32)
    worsts = np.zeros(len(with_chain), np.int8)
    for s in np.flatnonzero(present & with_chain).tolist():
        path, cls, worst = _path(sm.nodes, sm.chains[s], ())
        paths[s], cls_ids[s], worsts[s] = intern(path), intern(cls), worst
    out = done()
    out.module, out.classes, out.how = paths[s1], cls_ids[s1], worsts[s1]
    return out


def _loop_depth(sm) -> int:
    """The most numbered (looped) modules in one chain, up to MAX_LOOP_DEPTH: the instance columns of the key."""
    nodes = sm.nodes
    depth = 0
    for chain in sm.chains:
        depth = max(depth, sum(1 for nid, _ in chain if nodes[nid].looped))
    return min(MAX_LOOP_DEPTH, depth)


def _unique_rows(cols: list | np.ndarray):
    """np.unique(key, axis=0, return_inverse=True) for rows of small integers >= -1, the key given as its
    columns (`cols`, emptied as they are read; or a 2-d array): the rows packed into one int64 each
    (lexicographic order kept) when they fit, which is much faster than sorting rows, and made in place, a
    column at a time."""
    if isinstance(cols, np.ndarray):
        cols = [cols[:, c] for c in range(cols.shape[1])]
    if len(cols[0]):
        span = [int(c.max()) + 2 for c in cols]  # values -1 .. max, shifted to 0 .. max + 1
        if min(int(c.min()) for c in cols) >= -1 and float(np.prod(np.array(span, np.float64))) < 2.0**62:
            packed = np.zeros(len(cols[0]), np.int64)
            for c in range(len(cols)):
                packed *= span[c]
                packed += cols[c].astype(np.int64, copy=False)
                packed += 1
                cols[c] = None  # read: let go
            # keys not much wider than the rows (stacks x instances, most often) are tabled, not sorted
            u, inv = unique_ids(packed, return_inverse=True)
            del packed
            rows = np.zeros((len(u), len(span)), np.int64)
            for c in range(len(span) - 1, -1, -1):
                rows[:, c] = u % span[c] - 1
                u = u // span[c]
            return rows, inv.reshape(-1)
    key = np.stack([np.asarray(c, np.int64) for c in cols], axis=1)
    cols.clear()
    uniq, inv = np.unique(key, axis=0, return_inverse=True)
    return uniq, inv.reshape(-1)


def _path(nodes, chain, idx):
    parts, classes, worst = [], [], 0
    looped_seen = 0
    for pos, (nid, _) in enumerate(chain):
        nd = nodes[nid]
        worst = max(worst, nd.how)
        label = nd.cls or nd.name
        if nd.looped:
            i = idx[looped_seen] if looped_seen < len(idx) else -1
            label += f"[{i}]" if i >= 0 else "[*]"
        if pos == 0:
            parts.append(nd.name)
        elif not nd.name:  # super().forward: the same module
            continue
        else:
            name = nd.name
            if nd.looped:
                i = idx[looped_seen] if looped_seen < len(idx) else -1
                name = f"{name}.{i}" if i >= 0 else f"{name}.*"
                looped_seen += 1
            parts.append(name)
        classes.append(label)
    path = parts[0] if len(parts) == 1 else ".".join(parts[1:])
    return path, " > ".join(classes), worst


MAX_LOOP_DEPTH = 3


def _instances(trace, rep, sm, stack) -> np.ndarray:
    """Instance number of the looped modules of each allocation's chain (-1: unknown), outermost first, up to
    MAX_LOOP_DEPTH.

    Over the allocations made in the trace with a stack, in order: a looped module's run starts when the
    allocation before did not run it, or ran it at a later line of its forward (the line went back: the
    next layer began), or belonged to another phase run; the instance is the number of its runs since its
    caller's run began (a new phase run; for a loop inside a loop, a new instance of the outer one).
    Allocations whose module comes from another stack (`stack`: their forward op's, for backward memory)
    take that allocation's instances."""
    from .phases import phases

    al = rep.allocations
    m = len(al)
    nodes = sm.nodes
    depth = _loop_depth(sm)
    out = np.full((m, depth), -1, np.int64)
    if not depth:
        return out
    a = al.alloc_index
    own = np.flatnonzero((a >= 0) & (al.stack_id >= 0))
    order = own[np.argsort(a[own], kind="stable")]
    if not len(order):
        return out
    run_of = phases(trace)[rep.device].run_of(a[order]).astype(np.int64, copy=False) if rep.n \
        else np.zeros(0, np.int64)  # a run id per allocation, none per entry
    uniq_st, st_inv = unique_ids(al.stack_id[order].astype(np.int64), return_inverse=True)
    for level in range(depth):
        node_of = np.full(len(uniq_st), -1, np.int64)
        line_of = np.zeros(len(uniq_st), np.int64)
        for j, s in enumerate(uniq_st.tolist()):
            seen = 0
            for nid, line in sm.chains[s + 1]:
                if nodes[nid].looped:
                    if seen == level:
                        node_of[j], line_of[j] = nid, line
                        break
                    seen += 1
        nd = node_of[st_inv]
        pos = np.flatnonzero(nd >= 0)
        if not len(pos):
            continue
        g = np.lexsort((pos, nd[pos]))  # by node, then order
        p, node, line, run = pos[g], nd[pos][g], line_of[st_inv][pos][g], run_of[pos][g]
        outer = out[order[p], level - 1] if level else np.zeros(len(p), np.int64)
        first = np.r_[True, node[1:] != node[:-1]]
        new_run = first | np.r_[True, (run[1:] != run[:-1]) | (outer[1:] != outer[:-1])]
        # each instance starts at the line its first instance in this run started at (its first allocating line)
        idx = np.arange(len(p))
        run_start = np.maximum.accumulate(np.where(new_run, idx, 0))
        entry = line[run_start]
        back_to_entry = (line == entry) & np.r_[True, (line[1:] != line[:-1]) | (p[1:] != p[:-1] + 1)]
        start = new_run | back_to_entry | np.r_[True, p[1:] != p[:-1] + 1]
        count = np.cumsum(start)
        last_reset = run_start
        before = np.where(last_reset > 0, count[np.maximum(last_reset - 1, 0)], 0)
        out[order[p], level] = count - before - 1
    # allocations whose module is another allocation's (backward memory: its forward op's) take its numbers
    borrowed = np.flatnonzero(stack != al.stack_id)  # compared as int64, without an int64 copy
    if len(borrowed):
        from .libraries import allocation_libraries

        src = allocation_libraries(trace, rep.device).source
        ok = borrowed[src[borrowed] >= 0]
        out[ok] = out[src[ok]]
    return out
