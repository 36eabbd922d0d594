"""Training phases and iterations of every trace entry.

Each entry gets a phase (none / forward / backward / optimizer) and an
iteration number. The sources, best first:

1. our recorder's ``user_metadata`` on entries (``tracekit:iter=3:phase=forward``);
2. our recorder's phase and iteration intervals (``tracekit`` key, by time);
3. for snapshots recorded elsewhere: ``external_annotations``
   (``Optimizer.step#AdamW.step``, ``Optimizer.zero_grad``) and the stack
   frames of the entries — ``torch/optim/`` is the optimizer step,
   ``backward``/``_engine_run_backward`` the backward pass, a module call
   the forward pass, and a frameless allocation after the forward (CUDA
   records no Python stack on the autograd thread) the backward pass.
   Iterations then begin at each forward that follows an optimizer step (or
   a backward pass, in files without optimizer steps).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from ..model import ALLOC, FREE_COMPLETED, NO_TIME, Trace
from .memo import per_trace

PHASES = ("none", "forward", "backward", "optimizer")
NONE, FORWARD, BACKWARD, OPTIMIZER = range(4)

# Bits of frame evidence, per frame and (OR-ed) per stack.
F_OPTIM = 1  # torch/optim/ (the optimizer step)
F_ZERO_GRAD = 2  # zero_grad
F_BACKWARD = 4  # autograd backward entry points
F_MODULE = 8  # an nn.Module call (forward)
F_INIT_STATE = 16  # the optimizer creating its state (_init_group, _init_state...)
F_PARAM_INIT = 32  # building or moving a model: Module.to/_apply, load_state_dict, reset_parameters
F_CHECKPOINT = 64  # torch/utils/checkpoint.py (recompute in backward)
F_DATA = 128  # torch/utils/data (data loading)
F_USER = 256  # any frame of the user's own code
F_ACCUMULATE_GRAD = 512  # AccumulateGrad (C++ frames, stacks="all")

_SEP = r"[/\\]"
_RE_OPTIM = re.compile(rf"torch{_SEP}optim{_SEP}(?!lr_scheduler)")
_RE_AUTOGRAD = re.compile(rf"torch{_SEP}(autograd{_SEP}|_tensor\.py$)")
_BACKWARD_NAMES = {"backward", "_engine_run_backward", "grad", "_make_grads", "run_backward"}
_RE_MODULE = re.compile(rf"torch{_SEP}nn{_SEP}modules{_SEP}module\.py$")
_PARAM_INIT_NAMES = {"_apply", "load_state_dict", "_load_from_state_dict", "reset_parameters", "to_empty",
                     "cuda", "load", "from_pretrained", "_load_state_dict_into_model", "init_weights"}
_RE_CHECKPOINT = re.compile(rf"torch{_SEP}utils{_SEP}checkpoint\.py$")
_RE_DATA = re.compile(rf"torch{_SEP}utils{_SEP}data{_SEP}")
_RE_METADATA = re.compile(r"tracekit:iter=(-?\d+)(?::phase=(\w+))?")


def frame_flags(filename: str, name: str) -> int:
    """Evidence bits of one frame."""
    from .frames import is_internal

    bits = 0
    if name == "zero_grad":
        return F_ZERO_GRAD
    if _RE_OPTIM.search(filename):
        bits |= F_OPTIM
        if name.startswith("_init") or name in ("_lazy_init_state",):
            bits |= F_INIT_STATE
    if name in _BACKWARD_NAMES and _RE_AUTOGRAD.search(filename):
        bits |= F_BACKWARD
    if _RE_MODULE.search(filename) and name in ("_call_impl", "_wrapped_call_impl", "inner"):
        bits |= F_MODULE
    if name in _PARAM_INIT_NAMES:
        bits |= F_PARAM_INIT
    if _RE_CHECKPOINT.search(filename):
        bits |= F_CHECKPOINT
    if _RE_DATA.search(filename):
        bits |= F_DATA
    if "AccumulateGrad" in name:
        bits |= F_ACCUMULATE_GRAD
    if filename and not is_internal(filename) and not bits:
        bits |= F_USER
    return bits


@per_trace
def stack_flags(trace: Trace) -> np.ndarray:
    """Evidence bits per stack id (OR over its frames); index with stack_id + 1 (0 = no stack)."""
    fr, strings = trace.frames, trace.strings
    memo = {}
    per_frame = np.zeros(len(fr), np.int32)
    for i, (f, n) in enumerate(zip(fr.filename.tolist(), fr.name.tolist())):
        k = (f, n)
        bits = memo.get(k)
        if bits is None:
            bits = memo[k] = frame_flags(strings[f], strings[n])
        per_frame[i] = bits
    st = trace.stacks
    out = np.zeros(len(st) + 1, np.int32)
    if len(st) and len(st.frame_ids):
        lengths = np.diff(st.offsets)
        nonempty = lengths > 0
        vals = per_frame[st.frame_ids]
        starts = st.offsets[:-1][nonempty]
        out[1:][nonempty] = np.bitwise_or.reduceat(vals, starts)
    return out


@dataclass
class DevicePhases:
    """Phase and iteration of each of a device's trace entries."""

    phase: np.ndarray  # int8 per entry: index into PHASES
    iteration: np.ndarray  # int32 per entry (-1: before the first known iteration)
    source: str  # "metadata", "recorder", "inferred" or "none"

    @property
    def n(self):
        return len(self.phase)

    def runs(self) -> np.ndarray:
        """Run id per entry: it changes whenever the phase or the iteration changes."""
        change = np.ones(self.n, bool)
        change[1:] = (self.phase[1:] != self.phase[:-1]) | (self.iteration[1:] != self.iteration[:-1])
        return np.cumsum(change) - 1

    def next_of(self, phase: int) -> np.ndarray:
        """For each position i in 0..n, the first entry j >= i in `phase` (n if none); length n + 1."""
        n = self.n
        idx = np.where(self.phase == phase, np.arange(n), n)
        out = np.empty(n + 1, np.int64)
        out[n] = n
        out[:n] = np.minimum.accumulate(idx[::-1])[::-1] if n else idx
        return out

    def iterations(self) -> list[tuple[int, int, int]]:
        """[(iteration, first entry, last entry)] in order, for iterations >= 0."""
        it = self.iteration
        out = []
        if not len(it):
            return out
        change = np.flatnonzero(np.diff(it)) + 1
        starts = np.concatenate([[0], change])
        ends = np.concatenate([change - 1, [len(it) - 1]])
        for s, e in zip(starts.tolist(), ends.tolist()):
            if it[s] >= 0:
                out.append((int(it[s]), s, e))
        return out

    def intervals(self) -> list[tuple[int, int, int, int]]:
        """[(iteration, phase, first entry, last entry)] for each run of a phase other than none."""
        runs = self.runs()
        if not len(runs):
            return []
        starts = np.flatnonzero(np.diff(runs, prepend=-1))
        ends = np.concatenate([starts[1:] - 1, [self.n - 1]])
        return [(int(self.iteration[s]), int(self.phase[s]), int(s), int(e))
                for s, e in zip(starts.tolist(), ends.tolist()) if self.phase[s] != NONE]


@per_trace
def phases(trace: Trace) -> dict[int, DevicePhases]:
    """Phases of every device (computed once per trace object)."""
    return {d: device_phases(trace, d) for d in trace.devices}


def device_phases(trace: Trace, device: int) -> DevicePhases:
    sl = trace.events.device_slice(device)
    got = _from_metadata(trace, sl)
    if got is None:
        got = _from_recorder(trace, sl)
    if got is None:
        got = _inferred(trace, sl)
    return got


def _from_metadata(trace, sl):
    """Phases from our `tracekit:iter=N:phase=P` user_metadata strings."""
    um = trace.events.user_metadata[sl]
    if not len(um):
        return None
    ids = np.unique(um)
    phase_of = np.zeros(len(trace.strings), np.int8)
    iter_of = np.full(len(trace.strings), -1, np.int32)
    found = False
    for i in ids.tolist():
        m = _RE_METADATA.fullmatch(trace.strings[i])
        if m:
            found = True
            iter_of[i] = int(m.group(1))
            phase_of[i] = PHASES.index(m.group(2)) if m.group(2) in PHASES else NONE
    if not found:
        return None
    return DevicePhases(phase=phase_of[um], iteration=iter_of[um], source="metadata")


def _from_recorder(trace, sl):
    """Phases from the recorder's time intervals, for files whose entries lack our metadata."""
    rec = trace.recorder or {}
    ph, its = rec.get("phases") or [], rec.get("iterations") or []
    t = trace.events.time_us[sl]
    if not (ph or its) or not len(t) or (t == NO_TIME).all():
        return None
    phase = np.zeros(len(t), np.int8)
    iteration = np.full(len(t), -1, np.int32)
    for rows, target, value in ((its, iteration, None), (ph, phase, "phase")):
        for r in rows:
            try:
                lo, hi = int(r["start_us"]), int(r["end_us"])
            except (KeyError, TypeError, ValueError):
                continue
            m = (t >= lo) & (t < hi)
            if value is None:
                target[m] = int(r.get("iteration", -1))
            elif r.get("phase") in PHASES:
                target[m] = PHASES.index(r["phase"])
    return DevicePhases(phase=phase, iteration=iteration, source="recorder")


# Evidence codes per entry (0: none, inherit the phase before it).
_E_NONE, _E_FORWARD, _E_BACKWARD, _E_OPTIM, _E_ZERO, _E_USER, _E_FRAMELESS = range(7)


def _inferred(trace, sl) -> DevicePhases:
    """Phases from annotations and stack frames, for files recorded elsewhere."""
    ev = trace.events
    action, stack = ev.action[sl], ev.stack_id[sl]
    n = len(action)
    flags = stack_flags(trace)[stack.astype(np.int64) + 1]
    is_alloc = action == ALLOC
    is_free = action == FREE_COMPLETED
    code = np.zeros(n, np.int8)
    has_frames = stack >= 0
    code[has_frames & ((flags & F_USER) != 0)] = _E_USER
    code[has_frames & ((flags & F_MODULE) != 0)] = _E_FORWARD
    code[has_frames & ((flags & F_BACKWARD) != 0)] = _E_BACKWARD
    code[has_frames & ((flags & F_OPTIM) != 0)] = _E_OPTIM
    code[has_frames & ((flags & F_ZERO_GRAD) != 0)] = _E_ZERO
    code[~(is_alloc | is_free) & (code == _E_USER)] = _E_NONE  # segment events etc. say little
    if (is_alloc & has_frames).any():  # Python stacks were recorded: frameless allocations are autograd's
        code[is_alloc & ~has_frames] = _E_FRAMELESS
    _annotate(trace, sl, code)
    if not code.any():
        return DevicePhases(phase=np.zeros(n, np.int8), iteration=np.full(n, -1, np.int32), source="none")
    phase, iteration = _resolve(code)
    return DevicePhases(phase=phase, iteration=iteration, source="inferred")


def _annotate(trace, sl, code):
    """Optimizer.step / zero_grad ranges from external_annotations override frame evidence."""
    ann = trace.meta.get("external_annotations") or []
    t = trace.events.time_us[sl]
    if not ann or not len(t) or (t == NO_TIME).all():
        return
    open_at = {}
    for a in ann:
        if not isinstance(a, dict):
            continue
        name, stage, when = str(a.get("name", "")), a.get("stage"), a.get("time_us")
        kind = _E_OPTIM if name.startswith("Optimizer.step") else _E_ZERO if "zero_grad" in name else None
        if kind is None or when is None:
            continue
        if stage == "START":
            open_at[name] = int(when)
        elif stage == "END" and name in open_at:
            lo = open_at.pop(name)
            i, j = np.searchsorted(t, [lo, int(when)], side="left")
            code[i:j] = kind


def _resolve(code):
    """Walk the evidence runs once: a small state machine over runs, broadcast back to entries."""
    n = len(code)
    nz = np.flatnonzero(code)
    keep = np.ones(len(nz), bool)
    keep[1:] = code[nz[1:]] != code[nz[:-1]]
    starts = nz[keep]
    codes = code[starts].tolist()
    any_optim = _E_OPTIM in codes
    phase_at, iter_at = [], []
    phase, it, done = NONE, 0, False
    for c in codes:
        if c == _E_FORWARD:
            if phase != FORWARD and done:
                it += 1
                done = False
            phase = FORWARD
        elif c == _E_BACKWARD:
            phase = BACKWARD
        elif c == _E_OPTIM:
            phase = OPTIMIZER
        elif c == _E_ZERO:
            phase = NONE
        elif c == _E_FRAMELESS:
            if phase in (FORWARD, BACKWARD):
                phase = BACKWARD
        elif c == _E_USER:
            if phase in (BACKWARD, OPTIMIZER):
                phase = NONE
        if phase == OPTIMIZER or (phase == BACKWARD and not any_optim):
            done = True
        phase_at.append(phase)
        iter_at.append(it)
    phase = np.zeros(n, np.int8)
    iteration = np.zeros(n, np.int32)
    if len(starts):
        # each entry takes the state of the last run that began at or before it
        pos = np.searchsorted(starts, np.arange(n), side="right") - 1
        ok = pos >= 0
        phase[ok] = np.array(phase_at, np.int8)[pos[ok]]
        iteration[ok] = np.array(iter_at, np.int32)[pos[ok]]
    return phase, iteration
