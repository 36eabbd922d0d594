"""What each allocation is: parameter, gradient, optimizer state, activation, temporary, input or other.

`categorize(trace)` labels every row of `replay(trace)[device].allocations`
and says how it was decided (METHODS):

- "tag": the recorder tagged the tensor (parameter, buffer, gradient,
  optimizer state, tensor saved for backward, model input). A tag (addr,
  time) labels the allocation that holds that address at that time.
- "rule": a user rule (see `rules.py`) matched; rules override everything.
- "inferred": from the phase the allocation was made in and the phases it
  lives through, and its stack frames (see docs/categories.md):

  ======================  =====================================================
  made in ...             and ...                                  is ...
  ======================  =====================================================
  any phase               freed in the same phase of the same iteration  temporary
  forward                 alive when a backward pass begins         activation
  backward                alive at the next optimizer step (or at the end,
                          or past its backward without an optimizer) gradient
  optimizer step          alive after the step                      optimizer_state
  none (between steps)    alive when the next forward begins        input
  before the trace        never freed                               parameter
  before the trace        freed in backward / zero_grad             activation / gradient
  ======================  =====================================================

  Frames refine this: `_init_group` is optimizer state, Module.to/_apply,
  load_state_dict and reset_parameters make parameters, torch.utils.data
  makes inputs. (Forward code re-run by checkpointing inside backward makes
  temporaries: they die in the backward pass that made them.)
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..model import NO_TIME, Trace
from . import phases as ph
from .memo import per_trace
from .replay import DeviceReplay, replay

CATEGORIES = ("parameter", "gradient", "optimizer_state", "activation", "temporary", "input", "other")
PARAMETER, GRADIENT, OPTIMIZER_STATE, ACTIVATION, TEMPORARY, INPUT, OTHER = range(7)
METHODS = ("tag", "rule", "inferred")
TAG, RULE, INFERRED = range(3)

# Recorder tag kinds -> category; buffers (running stats, masks) count as model weights.
TAG_CATEGORY = {"parameter": PARAMETER, "buffer": PARAMETER, "gradient": GRADIENT,
                "optimizer_state": OPTIMIZER_STATE, "activation": ACTIVATION, "input": INPUT}
# When several tags land on one allocation, the first kind here wins.
TAG_PRIORITY = (PARAMETER, OPTIMIZER_STATE, GRADIENT, INPUT, ACTIVATION)

# memory_timeline files (torch.profiler) carry the profiler's category names.
PROFILER_NAMES = {"autograd_detail": "temporary", "unknown": "other", "": "other"}


@dataclass
class DeviceCategories:
    """One label per row of `replay(trace)[device].allocations`."""

    device: int
    labels: np.ndarray  # int16: index into names
    names: list  # CATEGORIES, then user categories
    method: np.ndarray  # int8: index into METHODS
    tagged: np.ndarray  # int16: the tags' category, -1 where untagged (for checks and accuracy)

    def label_names(self) -> np.ndarray:
        return np.array(self.names, dtype=object)[self.labels]

    def bytes_by_category(self, sizes, mask=None) -> dict:
        """{name: bytes} of `sizes` (one per allocation), over `mask`, in `names` order."""
        lab = self.labels if mask is None else self.labels[mask]
        s = sizes if mask is None else sizes[mask]
        got = np.bincount(lab.astype(np.int64), weights=s.astype(np.float64), minlength=len(self.names))
        return {name: int(round(b)) for name, b in zip(self.names, got)}


def categorize(trace: Trace, rules=None) -> dict[int, DeviceCategories]:
    """Label every allocation of every device (memoised per trace and rules)."""
    from .rules import Rules

    if rules is not None and not isinstance(rules, Rules):
        rules = Rules.load(rules)
    return _categorize(trace, rules)


@per_trace
def _categorize(trace: Trace, rules) -> dict[int, DeviceCategories]:
    reps = replay(trace)
    phs = ph.phases(trace)
    names = list(CATEGORIES) + ([c for c in rules.categories if c not in CATEGORIES] if rules else [])
    out = {}
    for d in trace.devices:
        labels = infer(trace, reps[d], phs[d])
        method = np.full(len(labels), INFERRED, np.int8)
        tagged = tag_labels(trace, reps[d])
        has_tag = tagged >= 0
        labels[has_tag] = tagged[has_tag]
        method[has_tag] = TAG
        if rules:
            hit = rules.apply(trace, reps[d], names, labels)
            m = hit >= 0
            labels[m] = hit[m]
            method[m] = RULE
        out[d] = DeviceCategories(device=d, labels=labels.astype(np.int16), names=names, method=method,
                                  tagged=tagged.astype(np.int16))
    return out


# -- inference --------------------------------------------------------------------------------------

def infer(trace: Trace, rep: DeviceReplay, phases: ph.DevicePhases) -> np.ndarray:
    """Inferred category per allocation (int16), from lifetimes, phases and frames."""
    al = rep.allocations
    m = len(al)
    n = rep.n
    labels = np.full(m, OTHER, np.int16)
    if m == 0:
        return labels
    a, f = al.alloc_index, al.free_index
    traced, freed = a >= 0, f >= 0
    f_end = np.where(freed, f, n)  # "freed after the last entry" for the live ones
    a0 = np.where(traced, a, 0)
    f0 = np.where(freed, f, 0)
    phase, runs = phases.phase, phases.runs()
    pa = np.where(traced, phase[a0], -1) if n else np.full(m, -1)
    pf = np.where(freed, phase[f0], -1) if n else np.full(m, -1)
    same_run = traced & freed & (runs[a0] == runs[f0]) if n else np.zeros(m, bool)
    after_a = np.where(traced, a + 1, 0)

    def alive_at_next(p):  # is the allocation still live when the next entry of phase p comes?
        nxt = phases.next_of(p)[np.minimum(after_a, n)]
        return nxt < f_end

    if phases.source == "none":
        return _lifetimes_only(al, n)
    fl = ph.stack_flags(trace)
    sflags = fl[al.stack_id.astype(np.int64) + 1]
    free_flags = fl[al.free_stack_id.astype(np.int64) + 1]
    has = lambda bits: (sflags & bits) != 0  # noqa: E731
    any_optim = bool((phase == ph.OPTIMIZER).any())

    # Traced allocations, by the phase they were made in.
    fwd, bwd, opt, none = (traced & (pa == p) for p in (ph.FORWARD, ph.BACKWARD, ph.OPTIMIZER, ph.NONE))
    at_backward, at_forward = alive_at_next(ph.BACKWARD), alive_at_next(ph.FORWARD)
    at_optim = alive_at_next(ph.OPTIMIZER)
    rules = [
        (fwd & at_backward, ACTIVATION),
        (fwd & ~at_backward & ~freed, OTHER),
        (fwd, TEMPORARY),
        (bwd & (at_optim | ~freed), GRADIENT),
        (bwd & ~same_run & (not any_optim), GRADIENT),
        (bwd, TEMPORARY),
        (opt & ~same_run, OPTIMIZER_STATE),
        (opt, TEMPORARY),
        (none & has(ph.F_PARAM_INIT) & ~same_run, PARAMETER),
        (none & has(ph.F_DATA), INPUT),
        (none & at_forward & ~same_run, INPUT),
        (none & same_run, TEMPORARY),
    ]
    # Allocations made before the trace.
    before = ~traced
    rules += [
        (before & ~freed & has(ph.F_INIT_STATE | ph.F_OPTIM), OPTIMIZER_STATE),
        (before & ~freed & has(ph.F_ACCUMULATE_GRAD | ph.F_BACKWARD), GRADIENT),
        (before & ~freed, PARAMETER),
        (before & ((free_flags & ph.F_ZERO_GRAD) != 0), GRADIENT),
        (before & (pf == ph.BACKWARD), ACTIVATION),
    ]
    # Frames say more than lifetimes for a few well-known places.
    rules = [
        (traced & has(ph.F_INIT_STATE) & ~same_run, OPTIMIZER_STATE),
        (traced & has(ph.F_ACCUMULATE_GRAD) & ~same_run, GRADIENT),
    ] + rules
    done = np.zeros(m, bool)
    for mask, cat in rules:
        take = mask & ~done
        labels[take] = cat
        done |= take
    if any_optim:
        _split_static(al, labels, phases.iteration)
    return labels


def _split_static(al, labels, iteration):
    """Optimizer state made before the trace looks like parameters: live throughout, no frames.

    Sizes tell them apart in aggregate: every trainable parameter has a
    gradient of its size, and stateful optimizers keep k tensors of that size
    per parameter (Adam: 2, SGD with momentum: 1). Per size s with g(s)
    gradients per iteration and c(s) such blocks, k·g are state (k: the median
    over sizes of (c - g) // g, capped at 2), g more are gradients kept from
    before the trace when at least 2g remain, the rest parameters. Which
    blocks of a size are which is not knowable from the trace: state takes the
    highest addresses, then gradients.
    """
    static = (al.alloc_index < 0) & (al.free_index < 0) & (labels == PARAMETER)
    if not static.any() or (labels == OPTIMIZER_STATE).any():
        return
    grads = labels == GRADIENT
    gsize, gcount = np.unique(al.size[grads & (al.alloc_index >= 0)], return_counts=True)
    if not len(gsize):
        gsize, gcount = np.unique(al.size[grads], return_counts=True)
    if not len(gsize):
        return
    # gradients per iteration: the traced ones repeat each iteration, so count one iteration's worth
    traced = grads & (al.alloc_index >= 0)
    iters = len(np.unique(iteration[al.alloc_index[traced]])) if traced.any() else 1
    g_of = dict(zip(gsize.tolist(), np.maximum(1, gcount // iters).tolist()))
    ssize, scount = np.unique(al.size[static], return_counts=True)
    ks = [(c - g_of[s]) // g_of[s] for s, c in zip(ssize.tolist(), scount.tolist()) if s in g_of and c > g_of[s]]
    k = min(2, int(np.median(ks))) if ks else 0
    if k <= 0:
        return
    for s, c in zip(ssize.tolist(), scount.tolist()):
        g = g_of.get(s, 0)
        n_state = min(c - g, k * g) if g else 0
        if n_state <= 0:
            continue
        # gradients kept across steps (zero_grad(set_to_none=False)) are one more block per parameter
        n_grad = g if c - g - n_state >= 2 * g else 0
        rows = np.flatnonzero(static & (al.size == s))
        rows = rows[np.argsort(al.addr[rows], kind="stable")]
        labels[rows[len(rows) - n_state:]] = OPTIMIZER_STATE
        labels[rows[len(rows) - n_state - n_grad:len(rows) - n_state]] = GRADIENT


def _lifetimes_only(al, n) -> np.ndarray:
    """Without any phase evidence: short-lived allocations are temporaries, the rest
    is "other", and what was live for the whole trace is taken for parameters."""
    a, f = al.alloc_index, al.free_index
    labels = np.full(len(al), OTHER, np.int16)
    short = (a >= 0) & (f >= 0) & (f - a <= max(16, n // 100))
    labels[short] = TEMPORARY
    labels[(a < 0) & (f < 0)] = PARAMETER
    return labels


# -- tags -------------------------------------------------------------------------------------------

def tag_labels(trace: Trace, rep: DeviceReplay) -> np.ndarray:
    """The tags' category per allocation (-1 where no tag applies)."""
    al = rep.allocations
    out = np.full(len(al), -1, np.int16)
    tags = [t for t in (trace.recorder or {}).get("tags") or []
            if isinstance(t, dict) and t.get("device", 0) == rep.device and t.get("kind") in TAG_CATEGORY]
    if not tags or not len(al):
        return out
    rows = match_tags(trace, rep, tags)
    rank = {c: i for i, c in enumerate(TAG_PRIORITY)}
    best = {}
    for row, t in zip(rows, tags):
        if row < 0:
            continue
        c = TAG_CATEGORY[t["kind"]]
        if row not in best or rank[c] < rank[best[row]]:
            best[row] = c
    if best:
        out[np.fromiter(best, np.int64)] = np.fromiter(best.values(), np.int16)
    return out


def allocation_times(trace: Trace, rep: DeviceReplay):
    """(alloc_time, free_time) per allocation in µs; -inf before the trace, +inf live at the end."""
    al = rep.allocations
    t = trace.events.time_us[rep.events].astype(np.float64)
    t[trace.events.time_us[rep.events] == NO_TIME] = np.nan
    ta = np.where(al.alloc_index >= 0, t[np.maximum(al.alloc_index, 0)] if len(t) else 0, -np.inf)
    tf = np.where(al.free_index >= 0, t[np.maximum(al.free_index, 0)] if len(t) else 0, np.inf)
    return ta, tf


def match_tags(trace: Trace, rep: DeviceReplay, tags: list) -> np.ndarray:
    """Allocation row holding each tag's address at its time (-1 if none).

    Exact base addresses are matched in one vectorised pass: among the
    allocations at that address, the last one made at or before the tag's
    time, if it is still live then. The rest (pointers inside a block) are
    searched by containment.
    """
    al = rep.allocations
    ta, tf = allocation_times(trace, rep)
    addr = np.array([int(t["addr"]) for t in tags], np.uint64)
    when = np.array([float(t.get("time_us", np.inf)) for t in tags], np.float64)
    # Sort allocations by (address, alloc time): a tag's candidates are one contiguous run.
    order = np.lexsort((ta, al.addr))
    sa, sta, stf = al.addr[order], ta[order], tf[order]
    lo = np.searchsorted(sa, addr, side="left")
    hi = np.searchsorted(sa, addr, side="right")
    rows = np.full(len(tags), -1, np.int64)
    for i in np.flatnonzero(hi > lo):
        seg_t = sta[lo[i]:hi[i]]
        k = int(np.searchsorted(seg_t, when[i], side="right")) - 1
        if k < 0:
            continue
        j = lo[i] + k
        if stf[j] >= when[i]:
            rows[i] = order[j]
    missing = np.flatnonzero(rows < 0)
    if len(missing):
        end = al.addr + al.size.astype(np.uint64)
        for i in missing:
            c = np.flatnonzero((al.addr <= addr[i]) & (addr[i] < end) & (ta <= when[i]) & (tf >= when[i]))
            if len(c):
                rows[i] = c[np.argmax(ta[c])]
    return rows


# -- writing categories onto entries ---------------------------------------------------------------

def entry_labels(trace: Trace, device: int, rules=None) -> np.ndarray:
    """Category index (into names) of each trace entry of a device: alloc and free_completed /
    free_requested entries take their allocation's category; other entries -1."""
    from ..model import ALLOC, FREE_REQUESTED

    rep = replay(trace)[device]
    cats = categorize(trace, rules)[device]
    al = rep.allocations
    out = np.full(rep.n, -1, np.int16)
    a, f = al.alloc_index, al.free_index
    out[a[a >= 0]] = cats.labels[a >= 0]
    out[f[f >= 0]] = cats.labels[f >= 0]
    # free_requested entries: the allocation at the same address made before the request
    ev = trace.events
    act = ev.action[rep.events]
    req = np.flatnonzero(act == FREE_REQUESTED)
    if len(req) and len(al):
        uniq, rank = np.unique(al.addr, return_inverse=True)
        span = np.int64(rep.n + 2)
        key = rank.astype(np.int64) * span + (al.alloc_index + 1)
        order = np.argsort(key, kind="stable")
        req_addr = ev.addr[rep.events][req]
        r_rank = np.searchsorted(uniq, req_addr)
        known = (r_rank < len(uniq)) & (uniq[np.minimum(r_rank, len(uniq) - 1)] == req_addr)
        pos = np.searchsorted(key[order], r_rank.astype(np.int64) * span + (req + 1), side="left") - 1
        row = order[np.maximum(pos, 0)]
        ok = known & (pos >= 0) & (rank[row] == r_rank)
        ok &= (al.free_index[row] < 0) | (al.free_index[row] >= req)
        out[req[ok]] = cats.labels[row[ok]]
    out[act == ALLOC] = np.where(out[act == ALLOC] < 0, OTHER, out[act == ALLOC])
    return out


def label_entries(trace: Trace, rules=None) -> list:
    """Category names per trace entry, as a list per device (position = device number).

    `label_entries(trace)[d][i]` is the category of entry i of the file's
    `device_traces[d]` ("" for entries that are not allocations or frees),
    ready to be written as each entry's "category" key (memory_viz colours by it).
    """
    if not trace.devices:
        return []
    out = [[] for _ in range(max(0, max(trace.devices)) + 1)]
    for d in trace.devices:
        if d < 0:
            continue
        names = np.array(list(categorize(trace, rules)[d].names) + [""], dtype=object)
        out[d] = names[entry_labels(trace, d, rules)].tolist()  # -1 picks the trailing ""
    return out


def write_categories(snapshot: dict, rules=None) -> dict:
    """Add a "category" to every alloc/free entry of a snapshot dict, in place; returns it."""
    from ..io.snapshot import snapshot_to_trace

    trace = snapshot_to_trace(snapshot, "<snapshot>")
    for d, labels in enumerate(label_entries(trace, rules)):
        entries = snapshot.get("device_traces", [])[d] if d < len(snapshot.get("device_traces", [])) else []
        for e, c in zip(entries, labels):
            if c:
                e["category"] = c
    return snapshot
