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

from typing import Any

from dataclasses import dataclass

import numpy as np

from ..model import NO_TIME, Trace, compact_column, isin_few
from . import distributed as _dist
from . import phases as ph
from .memo import per_trace
from .replay import DeviceReplay, block_size, replay

CATEGORIES = ("parameter", "gradient", "optimizer_state", "activation", "temporary", "input", "kv_cache", "workspace",
              "unsharded_parameter", "communication", "other")
(PARAMETER, GRADIENT, OPTIMIZER_STATE, ACTIVATION, TEMPORARY, INPUT, KV_CACHE, WORKSPACE, UNSHARDED_PARAMETER,
 COMMUNICATION, OTHER) = range(11)
METHODS = ("tag", "rule", "inferred")
TAG, RULE, INFERRED = range(3)

# Recorder tag kinds -> category; buffers (running stats, masks) count as model weights.
# Sharded training (record/tags.py): "parameter" is this rank's shard (a DTensor's local tensor),
# "unsharded_parameter" a unit's full parameters all-gathered for compute (FSDP2's unshard).
TAG_CATEGORY = {"parameter": PARAMETER, "buffer": PARAMETER, "gradient": GRADIENT,
                "optimizer_state": OPTIMIZER_STATE, "activation": ACTIVATION, "input": INPUT,
                "unsharded_parameter": UNSHARDED_PARAMETER}
# When several tags land on one allocation, the first kind here wins (an all-gathered weight that a matmul
# saves for backward, or that the model's own parameters() names while it is unsharded, is an unsharded parameter).
TAG_PRIORITY = (UNSHARDED_PARAMETER, PARAMETER, OPTIMIZER_STATE, GRADIENT, INPUT, ACTIVATION)

# memory_timeline files (torch.profiler) carry the profiler's category names.
PROFILER_NAMES = {"autograd_detail": "temporary", "unknown": "other", "": "other"}


@dataclass
class DeviceCategories:
    """One label per row of `replay(trace)[device].allocations`."""

    device: int
    labels: np.ndarray  # int16: index into names
    names: list[str]  # CATEGORIES, then user categories
    method: np.ndarray  # int8: index into METHODS
    tagged: np.ndarray  # int16: the tags' category, -1 where untagged (for checks and accuracy)
    reason: np.ndarray  # int16: index into reasons
    reasons: list[str]  # short phrases: what each allocation is and what says so

    def reason_names(self) -> np.ndarray:
        return np.array(self.reasons, dtype=object)[self.reason]

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
        labels, reason = infer(trace, reps[d], phs[d])
        reasons = list(REASONS)
        method = np.full(len(labels), INFERRED, np.int8)
        tagged = tag_labels(trace, reps[d])
        # a cuBLAS workspace is a workspace whatever the tags say (earlier recorders tagged them activation
        # or gradient): the frames name it, or, without C++ frames, its size and lifetime (issue 31)
        lazy = lazy_workspaces(trace, reps[d], phs[d], labels, tagged)
        labels[lazy], reason[lazy] = WORKSPACE, R[REASONS[LAZY_WORKSPACE]]
        if (trace.recorder or {}).get("tags"):  # else no allocation is tagged (tag_labels: -1 throughout)
            has_tag = (tagged >= 0) & ~((labels == WORKSPACE)
                                        & np.isin(reason, (R[REASONS[1]], R[REASONS[LAZY_WORKSPACE]])))
            labels[has_tag] = tagged[has_tag]
            method[has_tag] = TAG
            reason[has_tag] = len(reasons) + tagged[has_tag]
        reasons += [f"tagged by the recorder: {name}" for name in CATEGORIES]
        if rules:
            hit = rules.apply(trace, reps[d], names, labels)
            m = hit >= 0
            labels[m] = hit[m]
            method[m] = RULE
            reason[m] = len(reasons) + hit[m]
            reasons += [f"user rule: {name}" for name in names]
        # how and the tags' label are most often one value throughout (no tags, no rules): constant columns
        out[d] = DeviceCategories(device=d, labels=labels.astype(np.int16), names=names, method=compact_column(method),
                                  tagged=compact_column(tagged.astype(np.int16)), reason=reason.astype(np.int16),
                                  reasons=reasons)
    return out


# -- inference --------------------------------------------------------------------------------------

# What each inferred label rests on, as the report, the viewer and JSON show it.
REASONS: tuple[str, ...] = (
    "no evidence",
    "cuBLAS workspace",
    "cuBLAS workspace (by its size: live before the trace, no stack, torch's default workspace size)",
    "NCCL / c10d communication buffer",
    "Triton autotuning buffer",
    "KV cache (Hugging Face cache)",
    "autocast copy of a weight (freed when autocast exits)",
    "optimizer state created by the optimizer (_init_group)",
    "p.grad (AccumulateGrad)",
    "made in forward, alive when backward begins (saved for backward)",
    "made in forward, alive at an out-of-memory error",
    "made in forward under no_grad, alive at the end",
    "made in forward with no backward in the trace, alive at the end (output or saved for backward)",
    "made and freed in forward",
    "made in backward, alive at the optimizer step or the end (gradient)",
    "made and freed in backward",
    "made in the optimizer step, alive after it",
    "made and freed in the optimizer step",
    "made while building or loading the model",
    "made by the data loader",
    "made between steps, alive when the next step uses it (input batch)",
    "made and freed between steps",
    "made between steps, alive at the end",
    "made before the trace, state of a stateful optimizer (by sizes: k blocks per trainable parameter)",
    "made before the trace, p.grad kept across steps (by sizes: one block per trainable parameter)",
    "live before the trace and throughout it (model weights or buffers, by lifetime)",
    "live before the trace, no evidence of what it is",
    "made before the trace, freed by zero_grad (gradient)",
    "made before the trace, freed in backward (saved for backward)",
    "made before the trace, replaced in the optimizer step (previous optimizer state)",
    "made before the trace, freed between steps",
    "made before the trace, freed in forward",
    "made in forward, alive at the end (block stack of a dump)",
    "short-lived (no phase evidence)",
    "made in the trace, alive at an out-of-memory error",
    "autocast copy of a weight (alive at the end; half the size of a weight live throughout)",
    "cuBLAS workspace (live before the trace, no stack; the size of a workspace this trace allocates by handle)",
    "made before the trace, live throughout, no stack: more blocks of a trainable parameter's size than "
    "parameter + optimizer state (frozen weight or buffer)",
    "KV cache (grows by the same bytes every decoding step)",
    "made in a model call of the generation (prefill or decoding step) and freed in it",
    "made in a model call of the generation, used after it (model output: logits, hidden states)",
    "made by the generation loop between decoding steps and freed there",
    "made by the generation loop, kept across decoding steps (generated tokens, attention mask, positions)",
    "cuBLAS workspace (by its size and lifetime: made at a pass's first matrix multiply on its thread, "
    "never freed, more than the parameters of that size; the file has no C++ frames to name it)",
)
REASONS = REASONS + tuple(r for r in _dist.REASONS + _dist.EXTRA_REASONS if r not in REASONS)  # sharded training
R = {text: i for i, text in enumerate(REASONS)}
# cuBLAS keeps one workspace per handle and stream (a handle per thread: the user's and autograd's),
# of CUBLAS_WORKSPACE_CONFIG's default size (aten/src/ATen/cuda/CublasHandlePool.cpp): ":4096:2:16:8"
# (8 MiB + 128 KiB) before Hopper, 32 MiB on sm90 (":4096:8:16:8", 32 MiB + 128 KiB, in older torch);
# cuBLASLt its own of CUBLASLT_WORKSPACE_SIZE's default, 1 MiB.
CUBLAS_WORKSPACE_SIZES = (4096 * 1024 * 2 + 16 * 1024 * 8, 4096 * 1024 * 8, 4096 * 1024 * 8 + 16 * 1024 * 8, 1 << 20)
WORKSPACES_PER_STREAM = 2  # handles that run matmuls: the user's thread and autograd's thread
KV_SCALAR_BYTES = 16  # a KV-cache allocation this small holds a counter, not keys or values


def infer(trace: Trace, rep: DeviceReplay, phases: ph.DevicePhases) -> tuple[np.ndarray, np.ndarray]:
    """Inferred (category, reason) per allocation, from frames, phases and lifetimes."""
    from ..model import OOM

    al = rep.allocations
    m = len(al)
    n = rep.n
    labels = np.full(m, OTHER, np.int16)
    reason = np.zeros(m, np.int16)
    if m == 0:
        return labels, reason
    a, f = al.alloc_index, al.free_index
    traced, freed = a >= 0, f >= 0
    pos_t = np.int32 if n < 2**31 else np.int64  # entry positions (0..n) in int32 below 2**31 entries
    f_end = f.astype(pos_t)  # "freed after the last entry" for the live ones
    np.putmask(f_end, f_end < 0, n)
    after_a = a.astype(pos_t)  # the entry after each allocation's, at most n (0 for those made before): made once
    np.maximum(after_a, -1, out=after_a)
    after_a += 1
    np.minimum(after_a, n, out=after_a)
    phase = phases.phase
    if n:
        # one run lookup serves all: each allocation's run, where that run ends (the next one's start; past n for
        # the last), so that an allocation freed before then (after it was made) is freed in the same run, and
        # the entry after its own is in the next run when it is that start
        starts = phases.run_starts()
        run_after = phases.run_of(np.maximum(a, 0))
        run_end = np.append(starts[1:], n + 1)[run_after]
        pa = np.where(traced, phase[starts][run_after], -1)
        same_run = traced & freed & (f < run_end)
        run_after += after_a >= run_end  # in place: now the run of each after_a
        del run_end
    else:
        pa, same_run, run_after = np.full(m, -1), np.zeros(m, bool), None

    def freed_in():  # the phase each allocation was freed in, read where one made before the trace was (else -1)
        out = np.full(m, -1, np.int8)
        rows = np.flatnonzero(~traced & freed)
        out[rows] = phase[f[rows]]
        return out

    def alive_at_next(p):  # is the allocation still live when the next entry of phase p comes?
        nxt = phases.next_at(p, after_a, run_after)  # next_of(p)[...], without its per-entry column
        return nxt < f_end

    fl = ph.stack_flags(trace)
    seen = int(np.bitwise_or.reduce(fl)) if len(fl) else 0  # every bit some stack has: a rule on another takes none
    sflags = fl[al.stack_id + al.stack_id.dtype.type(1)]  # stack ids are below 2**31 - 1: no int64 copy
    has = lambda bits: (sflags & bits) != 0  # noqa: E731
    free_flags = lambda: fl[al.free_stack_id + al.free_stack_id.dtype.type(1)]  # noqa: E731  (few rules read them)
    when = lambda bits, rule: rule if seen & bits else None  # noqa: E731  (None: the rule takes nothing)
    no_stack = al.stack_id < 0
    before = ~traced
    ooms = np.flatnonzero(trace.events.action[rep.events] == OOM)
    at_oom = np.zeros(m, bool)
    for i in ooms.tolist():
        at_oom |= (a <= i) & (f_end > i)

    def cast_of_weight():  # an autocast copy alive at the end, half the size of a weight live throughout
        out = has(ph.F_AUTOCAST) & ~freed
        cast = np.flatnonzero(out)  # block sizes of these few only, not of every allocation
        out[cast] = np.isin(block_size(2 * al.size[cast]), np.unique(block_size(al.size[before & ~freed])))
        return out
    evidence = [  # what the frames say, whatever the phase
        (when(ph.F_WORKSPACE, lambda: has(ph.F_WORKSPACE)), WORKSPACE, "cuBLAS workspace"),
    ]
    # sharded and data-parallel training (FSDP, ZeRO, DDP) and any other collective buffer, by frames
    dist = _dist.evidence(trace, al, same_run, lambda: allocation_times(trace, rep))  # times: only if asked
    evidence += [(mask, CATEGORIES.index(cat), why) for mask, cat, why in dist]
    evidence += [
        (when(ph.F_AUTOTUNE, lambda: has(ph.F_AUTOTUNE) & freed), TEMPORARY, "Triton autotuning buffer"),
        # a cache's scalars (≤ 16 B: cumulative_length, seen-token counters) are its bookkeeping, not keys/values
        (when(ph.F_KV_CACHE, lambda: has(ph.F_KV_CACHE) & ~same_run & (al.size > KV_SCALAR_BYTES)), KV_CACHE,
         "KV cache (Hugging Face cache)"),
        (when(ph.F_AUTOCAST_CLEAR, lambda: ((free_flags() & ph.F_AUTOCAST_CLEAR) != 0) & (has(ph.F_AUTOCAST) | before)),
         PARAMETER, REASONS[6]),
        (when(ph.F_AUTOCAST, cast_of_weight), PARAMETER, REASONS[35]),
        (when(ph.F_INIT_STATE, lambda: has(ph.F_INIT_STATE) & ~same_run), OPTIMIZER_STATE, REASONS[7]),
        (when(ph.F_ACCUMULATE_GRAD, lambda: has(ph.F_ACCUMULATE_GRAD) & ~same_run), GRADIENT,
         "p.grad (AccumulateGrad)"),
    ]
    present = set(phase[phases.run_starts()].tolist()) if n else set()  # the phases of the runs: of every entry
    if phases.source == "none":
        rules = evidence + _lifetimes_only(al, n, at_oom)
    else:
        rules = evidence + _by_phase(phases, present, al, traced, freed, before, pa, freed_in, same_run,
                                     alive_at_next, has, when, free_flags, no_stack, at_oom)
    # The first rule whose mask holds wins: the rules are applied last first, each writing its number where its
    # mask holds (one pass a rule, no mask of the rows decided so far); a mask is made when its turn comes (a
    # callable), so few are held at once; a rule with no mask (None) takes nothing.
    rule_of = np.full(m, len(rules), np.int8 if len(rules) < 127 else np.int16)  # len(rules): none took it
    for k in range(len(rules) - 1, -1, -1):
        mask = rules[k][0]
        if mask is not None:
            np.copyto(rule_of, k, where=mask() if callable(mask) else mask)
    rule_of = rule_of.astype(np.intp)  # numpy's index type, once for both lookups
    labels = np.array([cat for _, cat, _ in rules] + [OTHER], np.int16)[rule_of]
    reason = np.array([R[why] for _, _, why in rules] + [0], np.int16)[rule_of]
    del mask, rule_of, rules, evidence, dist, alive_at_next, f_end, after_a, run_after, pa, same_run, at_oom
    del free_flags, no_stack, before, traced, freed  # not held under _before_trace's own
    workspace_frames = has(ph.F_WORKSPACE)
    del has, when, sflags
    _before_trace(trace, rep, labels, reason, phases, ph.OPTIMIZER in present, workspace_frames)
    return labels, reason


def _by_phase(phases, present, al, traced, freed, before, pa, freed_in, same_run, alive_at_next, has, when,
              free_flags, no_stack, at_oom) -> list:
    """(mask, category, reason) rules from the phase each allocation was made and freed in; each mask a callable
    that makes it (infer makes them one at a time), or None where it takes nothing: the rules of allocations made
    in a phase no entry is in (`present`: the phases of the entries), or before the trace when none was, and
    of a frame bit no stack has (`when`)."""
    any_optim = ph.OPTIMIZER in present
    any_pass = bool(present & {ph.FORWARD, ph.BACKWARD, ph.PREFILL, ph.DECODE})
    made: dict = {}  # each population (the allocations made in a phase), made when a rule first asks for it

    def made_in(p):
        if p not in made:
            made[p] = traced & (pa == p) if p != "step" else traced & isin_few(pa, (ph.PREFILL, ph.DECODE))
        return made[p]
    alive: dict = {}  # alive_at_next(p), made once, when a rule first asks for it

    def at(p):
        if p not in alive:
            alive[p] = alive_at_next(p)
        return alive[p]
    fwd, bwd, opt, none, step = (lambda p=p: made_in(p) for p in (ph.FORWARD, ph.BACKWARD, ph.OPTIMIZER, ph.NONE,
                                                                  "step"))
    in_generation = none  # a generation's loop between its model calls
    can = {"step": bool(present & {ph.PREFILL, ph.DECODE}), "fwd": ph.FORWARD in present,
           "bwd": ph.BACKWARD in present, "opt": any_optim, "none": ph.NONE in present, "before": not traced.all()}
    can["in_generation"] = can["none"] and phases.generation is not None
    of = lambda population, rule: rule if can[population] else None  # noqa: E731
    freed_by = lambda bits: (free_flags() & bits) != 0  # noqa: E731
    pf: dict = {}  # freed_in(), made when a rule first asks for it

    def freed_in_phase(p):
        if not pf:
            pf["pf"] = freed_in()
        return pf["pf"] == p
    return [
        # a generation (inference): nothing is kept for a backward pass
        (of("step", lambda: step() & same_run), TEMPORARY, REASONS[39]),
        (of("step", lambda: step()), TEMPORARY, REASONS[40]),
        (of("in_generation", lambda: in_generation() & same_run), TEMPORARY, REASONS[41]),
        (of("in_generation", lambda: in_generation()), INPUT, REASONS[42]),
        (of("fwd", lambda: fwd() & at(ph.BACKWARD)), ACTIVATION, REASONS[9]),
        (of("fwd", lambda: fwd() & at_oom), ACTIVATION, REASONS[10]),
        (of("fwd", when(ph.F_NO_GRAD, lambda: fwd() & ~freed & has(ph.F_NO_GRAD))), TEMPORARY, REASONS[11]),
        (of("fwd", lambda: fwd() & ~freed), ACTIVATION, REASONS[12]),
        (of("fwd", lambda: fwd()), TEMPORARY, REASONS[13]),
        (of("bwd", lambda: bwd() & (at(ph.OPTIMIZER) | ~freed)), GRADIENT, REASONS[14]),
        (of("bwd", lambda: bwd() & ~same_run & (not any_optim)), GRADIENT, REASONS[14]),
        (of("bwd", lambda: bwd()), TEMPORARY, REASONS[15]),
        (of("opt", lambda: opt() & ~same_run), OPTIMIZER_STATE, REASONS[16]),
        (of("opt", lambda: opt()), TEMPORARY, REASONS[17]),
        (of("none", when(ph.F_PARAM_INIT, lambda: none() & has(ph.F_PARAM_INIT) & ~same_run)), PARAMETER, REASONS[18]),
        (of("none", when(ph.F_DATA, lambda: none() & has(ph.F_DATA))), INPUT, REASONS[19]),
        (of("none", lambda: none() & (at(ph.FORWARD) | at(ph.BACKWARD)) & ~same_run), INPUT, REASONS[20]),
        (of("none", lambda: none() & at_oom), OTHER, REASONS[34]),
        (of("none", lambda: none() & same_run), TEMPORARY, REASONS[21]),
        (of("none", lambda: none() & ~freed), OTHER, REASONS[22]),
        # allocations made before the trace
        (of("before", when(ph.F_INIT_STATE | ph.F_OPTIM, lambda: before & ~freed & has(ph.F_INIT_STATE | ph.F_OPTIM))),
         OPTIMIZER_STATE, REASONS[7]),
        (of("before", when(ph.F_ACCUMULATE_GRAD | ph.F_BACKWARD,
                           lambda: before & ~freed & has(ph.F_ACCUMULATE_GRAD | ph.F_BACKWARD))),
         GRADIENT, REASONS[14]),
        (of("before", when(ph.F_PARAM_INIT, lambda: before & ~freed & has(ph.F_PARAM_INIT))), PARAMETER, REASONS[18]),
        (of("before", when(ph.F_MODULE, lambda: before & ~freed & has(ph.F_MODULE))), ACTIVATION, REASONS[32]),
        (of("before", lambda: before & ~freed & no_stack & any_pass), PARAMETER, REASONS[25]),
        (of("before", lambda: before & ~freed), OTHER, REASONS[26]),
        (of("before", when(ph.F_ZERO_GRAD, lambda: before & freed_by(ph.F_ZERO_GRAD))), GRADIENT, REASONS[27]),
        (of("before", lambda: before & freed_in_phase(ph.BACKWARD)), ACTIVATION, REASONS[28]),
        (of("before", lambda: before & freed_in_phase(ph.OPTIMIZER)), OPTIMIZER_STATE, REASONS[29]),
        (of("before", lambda: before & freed_in_phase(ph.FORWARD)), OTHER, REASONS[31]),
        (of("before", lambda: before), OTHER, REASONS[30]),
    ]


def requested_sizes(trace: Trace, rep: DeviceReplay) -> np.ndarray:
    """Bytes each allocation asked for: the trace's size for traced ones (newer torch records requests), the
    final block's `requested_size` for blocks live before the trace (their `size` is the block's)."""
    al = rep.allocations
    out = np.array(al.size, np.int64)  # one copy
    before = np.flatnonzero(al.alloc_index < 0)
    b = trace.blocks
    bm = np.flatnonzero(b.device == rep.device)
    if not len(before) or not len(bm):
        return out
    order = bm[np.argsort(b.addr[bm], kind="stable")]
    addrs = b.addr[order]
    pos = np.searchsorted(addrs, al.addr[before])
    ok = pos < len(addrs)
    ok[ok] = addrs[pos[ok]] == al.addr[before][ok]
    rows, blocks = before[ok], order[pos[ok]]
    req = b.requested_size[blocks]
    good = (req > 0) & (req <= b.size[blocks]) & (b.size[blocks] == al.size[rows])
    out[rows[good]] = req[good]
    return out


LAZY_WORKSPACE = len(REASONS) - 1  # the reason of `lazy_workspaces`
CUBLASLT_WORKSPACE = 1 << 20


def _has_cpp_frames(trace: Trace) -> bool:
    """Whether the file's stacks include C++ frames (torch's `_record_memory_history(stacks="all")`): then a
    workspace is named by its frames (getNewWorkspace, getCUDABlasLtWorkspace)."""
    strings, fr = trace.strings, trace.frames
    names: Any
    names = np.unique(fr.filename) if len(fr) else []
    return any(strings[int(i)].endswith((".cpp", ".h", ".cu", ".cuh")) for i in names)


def lazy_workspaces(trace: Trace, rep: DeviceReplay, phases: ph.DevicePhases, labels, tagged) -> np.ndarray:
    """Mask of the cuBLAS workspaces made during the trace, in a file whose stacks cannot name them (no C++
    frames: our recorder's files, torch's with Python stacks only).

    cuBLAS makes one workspace per handle (thread) and stream, lazily, at the first matrix multiply on it,
    of a fixed size (CUBLAS_WORKSPACE_SIZES), and never frees it; cuBLASLt makes its own of 1 MiB right
    after. So, per stream: the first allocation of a workspace size made in a forward pass (or a
    generation's model call) and never freed; the first one made in backward (the autograd thread) and
    never freed, when more such blocks outlive backward than there are parameters of that size (the rest
    are that size's gradients); and a never-freed 1 MiB block made within 3 entries after either, from
    the same stack. Parameters, optimizer state and KV cache are never taken."""
    al = rep.allocations
    out = np.zeros(len(al), bool)
    if not len(al) or phases.source == "none" or not rep.n:
        return out
    a = al.alloc_index
    kept = (a >= 0) & (al.free_index < 0)
    big = kept & isin_few(al.size, CUBLAS_WORKSPACE_SIZES[:3])
    rows = np.flatnonzero(big)  # the few of a workspace's size: the labels and tags of these only
    big[rows] = ~(isin_few(labels[rows], (PARAMETER, OPTIMIZER_STATE, KV_CACHE))
                  | isin_few(tagged[rows], (PARAMETER, OPTIMIZER_STATE)))
    if not big.any() or _has_cpp_frames(trace):
        return out
    blocked = isin_few(labels, (PARAMETER, OPTIMIZER_STATE, KV_CACHE)) | isin_few(tagged, (PARAMETER, OPTIMIZER_STATE))
    phase = np.where(a >= 0, phases.phase[np.maximum(a, 0)], -1)
    stream = trace.events.stream[rep.events][np.maximum(a, 0)]
    forward = np.isin(phase, (ph.FORWARD, ph.PREFILL, ph.DECODE))
    backward = phase == ph.BACKWARD
    is_param = (labels == PARAMETER) | (tagged == PARAMETER)
    picked = []
    for st in np.unique(stream[big]).tolist():
        on = big & (stream == st)
        rows = np.flatnonzero(on & forward)
        if len(rows):
            picked.append(int(rows[np.argmin(a[rows])]))
        rows = np.flatnonzero(on & backward)
        if len(rows):
            first = int(rows[np.argmin(a[rows])])
            s = al.size[first]
            if int((on & backward & (al.size == s)).sum()) > int((is_param & (al.size == s)).sum()):
                picked.append(first)
    if not picked:
        return out
    out[picked] = True
    lt = np.flatnonzero(kept & (al.size == CUBLASLT_WORKSPACE) & ~blocked)
    for r in picked:
        near = lt[(a[lt] > a[r]) & (a[lt] <= a[r] + 3) & (al.stack_id[lt] == al.stack_id[r])]
        if len(near):
            out[near[np.argmin(a[near])]] = True
    return out


def _before_trace(trace, rep, labels, reason, phases, any_optim, workspace_frames):
    """Blocks live before the trace and throughout it, without a stack: what their sizes say they are.

    They are parameters by lifetime (made before a trace whose passes they outlive). Sizes, compared as
    the bytes each block asked for (its `requested_size`: the allocator may hand a request a bigger
    cached block), tell more, as facts about PyTorch:

    - a stateful optimizer keeps k tensors of each trainable parameter's size (Adam: 2, SGD with momentum:
      1), so the optimizer state seen in the trace, or the gradients its backward made, name the trainable
      sizes t(s) and k; per size, k·t blocks are state when the trace shows none yet, and t more are
      gradients kept from before the trace when its backward made none of its own (accumulated in place);
    - cuBLAS and cuBLASLt keep one workspace per handle (thread) and stream, of a fixed size: torch's
      default size, or the size of a workspace the trace allocates by handle (`setWorkspaceForHandle`,
      `getNewWorkspace`). The blocks of such a size beyond the t(s) parameters (and their state) are
      workspaces, when they are no more than WORKSPACES_PER_STREAM per stream the trace uses; more than
      that are weights of the same size.

    This is right in aggregate; which of several equal-size blocks is which is not knowable from a memory
    trace (state takes the highest addresses, then gradients, then workspaces).
    """
    al = rep.allocations
    static = ((al.alloc_index < 0) & (al.free_index < 0) & (al.stack_id < 0)
              & np.isin(reason, (R[REASONS[25]], R[REASONS[26]])))
    if not static.any():
        return
    size = requested_sizes(trace, rep)
    t_of, k, grads_kept = _trainable_sizes(trace, al, labels, size, phases) if any_optim else ({}, 0, False)
    traced_ws = np.unique(size[workspace_frames & (al.alloc_index >= 0)]).tolist()
    ws_sizes = set(CUBLAS_WORKSPACE_SIZES) | set(traced_ws)
    ev = trace.events
    stream = ev.stream[rep.events]
    # one stream throughout (a constant column): 1 without copying the allocations' streams out
    streams = max(1, len(np.unique(stream[ev.action[rep.events] == 0]))) if rep.n and stream.strides != (0,) else 1
    max_ws = WORKSPACES_PER_STREAM * streams
    # the static blocks grouped by size, each group by address (then row): one sort of these few, not a pass
    # over every allocation per size
    srows = np.flatnonzero(static)
    ssize = size[srows]
    srows = srows[np.lexsort((al.addr[srows], ssize))]
    csize, ccount = np.unique(ssize, return_counts=True)
    del ssize
    for s, c, lo in zip(csize.tolist(), ccount.tolist(), (np.cumsum(ccount) - ccount).tolist()):
        t = t_of.get(s, 0)
        rows = srows[lo:lo + c]
        n_state = max(0, min(c - t, k * t)) if t else 0
        if not t:
            n_grad = 0
        elif grads_kept:
            n_grad = max(0, min(t, c - t - n_state))
        else:  # gradients kept across steps (zero_grad(set_to_none=False)) are one more block per parameter
            n_grad = t if c - t - n_state >= 2 * t else 0
        extra = c - n_state - n_grad - t
        n_ws = extra if s in ws_sizes and 0 < extra <= max_ws else 0
        end = len(rows)
        st, end = rows[end - n_state:end], end - n_state
        gr, end = rows[end - n_grad:end], end - n_grad
        ws = rows[end - n_ws:end]
        labels[st], reason[st] = OPTIMIZER_STATE, R[REASONS[23]]
        labels[gr], reason[gr] = GRADIENT, R[REASONS[24]]
        labels[ws] = WORKSPACE
        reason[ws] = R[REASONS[36]] if s in traced_ws else R[REASONS[2]]
        if t and extra > n_ws:  # more than parameter + state: frozen weights or buffers of that size
            rest = rows[:end - n_ws]
            frozen = rest[len(rest) - (extra - n_ws):]
            labels[frozen], reason[frozen] = PARAMETER, R[REASONS[37]]


def _trainable_sizes(trace, al, labels, size, phases):
    """({requested size: trainable parameters of it}, k state tensors per parameter, gradients kept from
    before the trace) from the gradients the trace's backward made, or else from its optimizer state."""
    traced_grads = (labels == GRADIENT) & (al.alloc_index >= 0)
    state = labels == OPTIMIZER_STATE
    iteration = phases.iteration
    by_run = iteration[phases.run_starts()]  # every entry's iteration is its run's: the runs' say which there are
    iters = max(1, len(np.unique(by_run[by_run >= 0]))) if len(iteration) else 1
    k_of_name = _optimizer_k(trace)
    if traced_grads.any():  # gradients made in backward name the trainable sizes
        gsize, gcount = np.unique(size[traced_grads], return_counts=True)
        iters_g = len(np.unique(iteration[al.alloc_index[traced_grads]])) or 1
        t_of = dict(zip(gsize.tolist(), np.maximum(1, gcount // iters_g).tolist()))
        grads_kept = False
    elif state.any():  # no gradients made: they exist already; the state names the sizes
        made = dict(zip(*(a.tolist() for a in np.unique(size[state & (al.alloc_index >= 0)], return_counts=True))))
        replaced = dict(zip(*(a.tolist() for a in np.unique(size[state & (al.alloc_index < 0)], return_counts=True))))
        counts = {s: max(made.get(s, 0) // iters, replaced.get(s, 0)) for s in np.unique(size[state]).tolist()}
        kk = k_of_name or 2
        t_of = {s: max(1, c // kk) for s, c in counts.items()}
        grads_kept = True
    else:
        return _all_trainable(al, labels, size, k_of_name)
    if state.any():
        return t_of, 0, grads_kept  # the state is in the trace already: nothing static is state
    static = (al.alloc_index < 0) & (al.free_index < 0) & (labels == PARAMETER) & (al.stack_id < 0)
    csize, ccount = np.unique(size[static], return_counts=True)
    ks = [(c - t_of[s]) // t_of[s] for s, c in zip(csize.tolist(), ccount.tolist()) if s in t_of and c > t_of[s]]
    k = k_of_name if k_of_name is not None else (min(2, int(np.median(ks))) if ks else 0)
    return t_of, k, grads_kept


_OPTIMIZER_K = (("adam", 2), ("lamb", 2), ("lion", 1), ("adagrad", 1), ("rmsprop", 1), ("adadelta", 2),
                ("sgd", None), ("adafactor", None))


def _all_trainable(al, labels, size, k):
    """No gradient or optimizer state made in the trace (gradients accumulated in place with
    `zero_grad(set_to_none=False)`, state updated in place): with a stateful optimizer of k tensors per
    parameter named in the file, each trainable parameter is k + 2 blocks of its size live throughout
    (weight, .grad, state). When the sizes holding nearly all the static bytes come in multiples of
    k + 2, the model is taken as fully trained: t(s) = count / (k + 2), gradients kept."""
    if not k:
        return {}, 0, False
    static = (al.alloc_index < 0) & (al.free_index < 0) & (labels == PARAMETER) & (al.stack_id < 0)
    csize, ccount = np.unique(size[static], return_counts=True)
    if not len(csize):
        return {}, 0, False
    fits = (ccount % (k + 2) == 0) & (ccount >= k + 2)
    workspace_like = np.isin(csize, CUBLAS_WORKSPACE_SIZES) & ~fits  # judged by _before_trace, not here
    total = float((csize * ccount)[~workspace_like].sum())
    if not total or float((csize[fits] * ccount[fits]).sum()) < FULLY_TRAINED_SHARE * total:
        return {}, 0, False
    return dict(zip(csize[fits].tolist(), (ccount[fits] // (k + 2)).tolist())), k, True


FULLY_TRAINED_SHARE = 0.9  # of the static bytes in sizes whose counts fit weight + grad + k states


def _optimizer_k(trace) -> int | None:
    """State tensors per parameter from the optimizer's name in the file's annotations (None: unknown)."""
    names = [str(a.get("name", "")) for a in trace.meta.get("external_annotations") or [] if isinstance(a, dict)]
    opt = (trace.recorder or {}).get("optimizer")
    if isinstance(opt, dict) and opt.get("class"):
        names.append(str(opt["class"]).rsplit(".", 1)[-1])
    for name in names:
        low = name.lower()
        if "optimizer.step" in low or low.isidentifier():
            for key, k in _OPTIMIZER_K:
                if key in low.split("#")[-1]:
                    return k
    return None


def _lifetimes_only(al, n, at_oom) -> list:
    """Rules without any phase evidence: short-lived allocations are temporaries; nothing else is known."""
    a, f = al.alloc_index, al.free_index
    short = (a >= 0) & (f >= 0) & (f - a <= max(16, n // 100)) & ~at_oom
    return [
        ((a >= 0) & at_oom, OTHER, REASONS[34]),
        (short, TEMPORARY, REASONS[33]),
        ((a < 0) & (f < 0), OTHER, REASONS[26]),
    ]


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
    best: dict = {}
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
    t = trace.events.time_us[rep.events]

    def at(index, missing):  # the entries' times as floats (NaN: no time), read only where they are asked for
        if not len(t):
            return np.where(index >= 0, 0.0, missing)
        raw = t[np.maximum(index, 0)]
        out = raw.astype(np.float64)
        out[raw == NO_TIME] = np.nan
        out[index < 0] = missing
        return out

    return at(al.alloc_index, -np.inf), at(al.free_index, np.inf)


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
    out: list[list]
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
