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

from ..model import ALLOC, FREE_COMPLETED, NO_TIME, Trace, isin_few
from .memo import per_trace

PHASES = ("none", "forward", "backward", "optimizer", "prefill", "decode")
NONE, FORWARD, BACKWARD, OPTIMIZER, PREFILL, DECODE = range(6)

# Bits of frame evidence, per frame and (OR-ed) per stack.
F_OPTIM = 1  # torch/optim/, or an optimizer kernel (_foreach_*, fused Adam): the optimizer step
F_ZERO_GRAD = 2  # zero_grad
F_BACKWARD = 4  # autograd backward: Python entry points, the C++ engine, *Backward0 nodes
F_MODULE = 8  # an nn.Module call, or any frame of a `forward` method (forward)
F_INIT_STATE = 16  # the optimizer creating its state (_init_group, _init_state...)
F_PARAM_INIT = 32  # building or moving a model: Module.to/_apply, load_state_dict, reset_parameters
F_CHECKPOINT = 64  # torch/utils/checkpoint.py (recompute in backward)
F_DATA = 128  # torch/utils/data (data loading)
F_USER = 256  # any frame of the user's own code
F_ACCUMULATE_GRAD = 512  # AccumulateGrad (C++ frames, stacks="all")
F_AUTOCAST = 1024  # at::autocast::cached_cast (a cast made by autocast)
F_AUTOCAST_CLEAR = 2048  # autocast's cache being cleared (frees the cached weight copies)
F_WORKSPACE = 4096  # a cuBLAS / cuBLASLt workspace
F_COMM = 8192  # NCCL / c10d communication
F_AUTOTUNE = 16384  # Triton autotuning
F_FACTORY = 32768  # a tensor made from nothing or copied in: randn, zeros, tensor, to(device)...
F_KV_CACHE = 65536  # a Hugging Face KV cache (cache_utils.py)
F_NO_GRAD = 131072  # torch.no_grad / inference_mode decorators (grad_mode.py)
F_GENERATE = 262144  # a library's generation loop (transformers' generate / _sample / _beam_search ...)
F_PREFILL = 524288  # transformers' _prefill (the first model call of a generation)

_SEP = r"[/\\]"
_RE_OPTIM = re.compile(rf"torch{_SEP}optim{_SEP}(?!lr_scheduler)")
_RE_OPTIM_KERNEL = re.compile(r"_fused_adamw?_|_fused_sgd_|fused_adam|multi_tensor_apply|_foreach_(?!zero_)")
_RE_AUTOGRAD = re.compile(rf"torch{_SEP}(autograd{_SEP}|_tensor\.py$)")
_BACKWARD_NAMES = {"backward", "_engine_run_backward", "grad", "_make_grads", "run_backward"}
_RE_BACKWARD_CPP = re.compile(r"torch::autograd::(Engine|PythonEngine|python::PythonEngine)::|(?<!\w)\w+Backward\d*::apply"
                              r"|(?<!\w)\w+Backward\d*_apply_functional|validate_outputs|torch::autograd::PyNode::apply"
                              r"|torch::autograd::CppNode|SavedVariable::unpack|call_function\(")
_RE_AOT_BACKWARD = re.compile(rf"_aot_autograd{_SEP}|_functorch{_SEP}")
_RE_MODULE = re.compile(rf"torch{_SEP}nn{_SEP}modules{_SEP}module\.py$")
# torch.compile's generated code (the FX graph's `<eval_with_key>` / fx_generated_ file, inductor's kernels'
# `call`, dynamo's graph functions and graph-break resumes) runs the model's forward (issue 31); in a compiled
# backward or optimizer step their own evidence wins
_RE_COMPILED_FILE = re.compile(rf"<eval_with_key>|fx_generated_\w*\.py$|torchinductor_[^/\\]*{_SEP}")
_RE_COMPILED_NAME = re.compile(r"^(__compiled_fn|torch_dynamo_resume_in_|__resume_at_)")
_PARAM_INIT_NAMES = {"_apply", "load_state_dict", "_load_from_state_dict", "reset_parameters", "to_empty",
                     "cuda", "load", "from_pretrained", "_load_state_dict_into_model", "init_weights"}
_RE_CHECKPOINT = re.compile(rf"torch{_SEP}utils{_SEP}checkpoint\.py$")
_RE_DATA = re.compile(rf"torch{_SEP}utils{_SEP}data{_SEP}")
_RE_WORKSPACE = re.compile(r"getNewWorkspace|getNewCUDABlasLtWorkspace|getCUDABlasLtWorkspace|cublasLt?Workspace"
                           r"|setWorkspaceForHandle|getCurrentCUDABlasL?t?Handle")
_RE_COMM = re.compile(rf"c10d::|ProcessGroupNCCL|nccl|NCCL|torch{_SEP}distributed{_SEP}")
_RE_AUTOTUNE = re.compile(rf"triton{_SEP}runtime{_SEP}autotuner|autotune|benchmarker")
_RE_FACTORY = re.compile(
    r"at::_ops::(randn|rand|randint|randperm|normal|bernoulli|zeros|ones|full|tensor|arange|linspace|scalar_tensor|"
    r"_to_copy|lift_fresh_copy|from_file)(_like)?\w*::call|THPVariable_(randn|rand|randint|zeros|ones|full|tensor|"
    r"as_tensor|from_numpy|arange|to|cuda)\(|torch::utils::tensor_new|internal_new_from_data|THPVariable_to\b")
_RE_KV_CACHE = re.compile(rf"(transformers|vllm|peft){_SEP}.*cache(_utils)?\.py$")


def _kv_cache_file(filename: str) -> bool:
    """_RE_KV_CACHE.search(filename), in linear time: `.*` cannot pass a newline and `$` is the end, so only
    the last line can match, and there the first library folder settles it."""
    f = filename[:-1] if filename.endswith("\n") else filename
    if not f.endswith(("cache.py", "cache_utils.py")):
        return False
    return _RE_KV_CACHE.search(f, f.rfind("\n") + 1) is not None


_RE_GRAD_MODE = re.compile(rf"torch{_SEP}(autograd{_SEP}grad_mode|utils{_SEP}_contextlib)\.py$")
_RE_METADATA = re.compile(r"tracekit:iter=(-?\d+)(?::phase=(\w+))?")
_RE_GENERATION_FILE = re.compile(rf"{_SEP}generation{_SEP}[^/\\]*\.py$|{_SEP}(vllm|sglang){_SEP}")
_GENERATE_NAMES = {"generate", "_sample", "_greedy_search", "_beam_search", "_beam_sample", "_group_beam_search",
                   "_contrastive_search", "_assisted_decoding", "_dola_decoding", "_prefill", "sample", "greedy_search",
                   "beam_search"}


def frame_flags(filename: str, name: str, line: int | None = None) -> int:
    """Evidence bits of one frame (Python or C++)."""
    from .frames import USER, frame_kind

    bits = 0
    if name == "zero_grad":
        return F_ZERO_GRAD
    if _RE_OPTIM.search(filename) or _RE_OPTIM_KERNEL.search(name):
        bits |= F_OPTIM
        if _RE_OPTIM.search(filename) and (name.startswith("_init") or name in ("_lazy_init_state",)):
            bits |= F_INIT_STATE
    if (name in _BACKWARD_NAMES and _RE_AUTOGRAD.search(filename)) or _RE_BACKWARD_CPP.search(name) \
            or (name in ("backward", "_backward_impl") and _RE_AOT_BACKWARD.search(filename)):
        bits |= F_BACKWARD
    if (_RE_MODULE.search(filename) and name in ("_call_impl", "_wrapped_call_impl", "inner")) \
            or (name == "forward" and filename.endswith(".py")) \
            or _RE_COMPILED_FILE.search(filename) or _RE_COMPILED_NAME.search(name):
        bits |= F_MODULE
    if name in _PARAM_INIT_NAMES:
        bits |= F_PARAM_INIT
    if _RE_CHECKPOINT.search(filename):
        bits |= F_CHECKPOINT
    if _RE_DATA.search(filename):
        bits |= F_DATA
    if "AccumulateGrad" in name or filename.endswith("accumulate_grad.cpp"):
        bits |= F_ACCUMULATE_GRAD | F_BACKWARD
    if "at::autocast::cached_cast" in name:
        bits |= F_AUTOCAST
    if "clear_autocast_cache" in name or (name == "__exit__" and filename.endswith("autocast_mode.py")):
        bits |= F_AUTOCAST_CLEAR
    if _RE_WORKSPACE.search(name):
        bits |= F_WORKSPACE
    if _RE_COMM.search(name) or _RE_COMM.search(filename):
        bits |= F_COMM
    if _RE_AUTOTUNE.search(filename) or _RE_AUTOTUNE.search(name):
        bits |= F_AUTOTUNE
    if _kv_cache_file(filename):
        bits |= F_KV_CACHE
    if _RE_GRAD_MODE.search(filename):
        bits |= F_NO_GRAD
    if name in _GENERATE_NAMES and _RE_GENERATION_FILE.search(filename):
        bits |= F_GENERATE | (F_PREFILL if name == "_prefill" else 0)
    if not bits and filename and frame_kind(filename, name, line) == USER:
        bits |= F_USER
    return bits


_RE_OP = re.compile(r"at::_ops::\w+::call|THPVariable_\w{1,256}\(")


def _op_kind(name: str) -> int:
    """0: not an op frame; 1: an op; 2: an op that makes a tensor from nothing or copies one in."""
    if not _RE_OP.search(name):
        return 0
    return 2 if _RE_FACTORY.search(name) else 1


@per_trace
def stack_flags(trace: Trace) -> np.ndarray:
    """Evidence bits per stack id (OR over its frames); index with stack_id + 1 (0 = no stack).

    F_FACTORY is decided by the outermost op of the stack (the one the user's
    code called): `randn` is a factory, a `bmm` that allocates through `empty`
    is not.
    """
    fr, strings = trace.frames, trace.strings
    memo: dict = {}
    per_frame = np.zeros(len(fr), np.int32)
    op = np.zeros(len(fr), np.int8)
    for i, (f, n, ln) in enumerate(zip(fr.filename.tolist(), fr.name.tolist(), fr.line.tolist())):
        k = (f, n, ln == 0)
        got = memo.get(k)
        if got is None:
            got = memo[k] = (frame_flags(strings[f], strings[n], ln), _op_kind(strings[n]))
        per_frame[i], op[i] = got
    st = trace.stacks
    out = np.zeros(len(st) + 1, np.int32)
    if len(st) and len(st.frame_ids):
        lengths = np.diff(st.offsets)
        nonempty = lengths > 0
        vals = per_frame[st.frame_ids]
        starts = st.offsets[:-1][nonempty]
        out[1:][nonempty] = np.bitwise_or.reduceat(vals, starts)
        ops = op[st.frame_ids]
        pos = np.where(ops > 0, np.arange(len(ops)), -1)
        last = np.maximum.reduceat(pos, starts)  # outermost op frame of each stack (-1: none)
        factory = np.zeros(len(starts), bool)
        ok = last >= starts
        factory[ok] = ops[last[ok]] == 2
        out[1:][np.flatnonzero(nonempty)[factory]] |= F_FACTORY
    return out


_RUN_SHIFT = 6
RUN_BLOCK = 1 << _RUN_SHIFT  # entries per block of DevicePhases.run_of's table


@dataclass
class DevicePhases:
    """Phase and iteration of each of a device's trace entries."""

    phase: np.ndarray  # int8 per entry: index into PHASES
    iteration: np.ndarray  # int32 per entry (-1: before the first known iteration)
    source: str  # "metadata", "recorder", "inferred" or "none"
    stamped: np.ndarray | None = None  # metadata source: bool per entry, True where our string is on it
    generation: dict | None = None  # a generation (prefill + decoding steps): how it was recognised

    @property
    def n(self):
        return len(self.phase)

    def _changes(self) -> np.ndarray:
        """Per entry: True where a run begins (the first entry, and wherever the phase or the iteration changes)."""
        change = np.ones(self.n, bool)
        change[1:] = (self.phase[1:] != self.phase[:-1]) | (self.iteration[1:] != self.iteration[:-1])
        return change

    def run_starts(self, chunk: int = 1 << 20) -> np.ndarray:
        """The first entry of each run (int64, ascending, read-only): where runs() changes, without a run id per
        entry, found a chunk of entries at a time (no per-entry temporaries), once (kept on the object)."""
        got = self.__dict__.get("_run_starts")
        if got is not None:
            return got
        n = self.n
        parts = [np.zeros(min(n, 1), np.int64)]
        for lo in range(1, n, chunk):
            hi = min(n, lo + chunk)
            change = self.phase[lo:hi] != self.phase[lo - 1:hi - 1]
            change |= self.iteration[lo:hi] != self.iteration[lo - 1:hi - 1]
            parts.append(np.flatnonzero(change) + lo)
        got = self.__dict__["_run_starts"] = np.concatenate(parts)
        got.flags.writeable = False
        return got

    def run_of(self, at: np.ndarray) -> np.ndarray:
        """runs()[at] (`at`: entry positions, or n: the last run), from the runs' starts: no run id per entry.

        A binary search per position is slow on millions of positions out of order (each step a branch the
        CPU mispredicts), so the positions are first looked up in a table of the run at each block of
        RUN_BLOCK entries (made here, n / 8 bytes, not kept); only those in a block where a run starts after
        its first entry are searched. Same values as the search, in its dtype (intp)."""
        starts = self.run_starts()
        at = np.asarray(at)
        if len(at) < 4096 or len(starts) * RUN_BLOCK > self.n or int(at.min()) < 0:  # few, or runs too dense
            out = np.searchsorted(starts, at, side="right")
            out -= 1
            return out
        blocks = (self.n >> _RUN_SHIFT) + 1  # position n included
        first = np.searchsorted(starts, np.arange(blocks, dtype=np.int64) << _RUN_SHIFT, side="right") - 1
        split = np.zeros(blocks, bool)  # a run starts in the block after its first entry
        split[starts[(starts & (RUN_BLOCK - 1)) != 0] >> _RUN_SHIFT] = True
        out = np.empty(len(at), np.intp)
        for lo in range(0, len(at), 1 << 16):  # a slice of positions at a time: no temporaries of their size
            pos = at[lo:lo + (1 << 16)]
            block = pos >> _RUN_SHIFT
            got = out[lo:lo + (1 << 16)]
            np.take(first, block, out=got, mode="clip")  # (valid indices: "clip" only spares a buffer)
            fix = np.flatnonzero(split[block])
            if len(fix):
                got[fix] = np.searchsorted(starts, pos[fix], side="right") - 1
        return out

    def runs(self) -> np.ndarray:
        """Run id per entry: it changes whenever the phase or the iteration changes."""
        change = self._changes()
        out = np.cumsum(change, dtype=np.int64 if self.n >= 2**31 else np.int32)
        out -= 1  # in place: one per-entry array, not two
        return out

    def next_of(self, phase: int, chunk: int = 1 << 20) -> np.ndarray:
        """For each position i in 0..n, the first entry j >= i in `phase` (n if none); length n + 1
        (int32 below 2**31 entries, to keep large traces small). Made a chunk at a time from the end, so that
        a 10M-entry trace makes no per-entry temporaries."""
        n = self.n
        dtype = np.int64 if n >= 2**31 else np.int32
        out = np.empty(n + 1, dtype)
        out[n] = n
        nxt = dtype(n)  # the first entry in `phase` after the chunk
        for hi in range(n, 0, -chunk):
            lo = max(0, hi - chunk)
            idx = np.where(self.phase[lo:hi] == phase, np.arange(lo, hi, dtype=dtype), nxt)
            out[lo:hi] = np.minimum.accumulate(idx[::-1])[::-1]
            nxt = out[lo]
        return out

    def next_at(self, phase: int, at: np.ndarray, runs: np.ndarray | None = None) -> np.ndarray:
        """next_of(phase)[at] (`at`: positions in 0..n), from the runs (run_starts()) rather than the entries:
        a position in a run of `phase` is its own next entry, any other the start of the next such run.
        `runs`: run_of(at) where the caller has it (it serves every phase)."""
        n = self.n
        dtype = np.int64 if n >= 2**31 else np.int32
        at = np.asarray(at)
        if not n:
            return np.full(at.shape, n, dtype)
        nxt = self.next_run_start(phase)
        out = nxt[self.run_of(at) if runs is None else runs]  # run_of(n) is the last run: n or its own start
        np.maximum(out, at, out=out, casting="unsafe")  # positions are in 0..n: no loss in `dtype`
        return out

    def next_run_start(self, phase: int) -> np.ndarray:
        """Per run (run_starts()): its own start if it is a run of `phase`, else the start of the next run of
        `phase` (n if none), in next_of's dtype."""
        n = self.n
        starts = self.run_starts()
        dtype = np.int64 if n >= 2**31 else np.int32
        nxt = np.where(self.phase[starts] == phase, starts, n).astype(dtype)
        return np.minimum.accumulate(nxt[::-1])[::-1]

    def iterations(self) -> list[tuple[int, int, int]]:
        """[(iteration, first entry, last entry)] in order, for iterations >= 0."""
        it = self.iteration
        out: list = []
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
        if not self.n:
            return []
        starts = self.run_starts()
        ends = np.concatenate([starts[1:] - 1, [self.n - 1]])
        return [(int(self.iteration[s]), int(self.phase[s]), int(s), int(e))
                for s, e in zip(starts.tolist(), ends.tolist()) if self.phase[s] != NONE]


@per_trace
def phases(trace: Trace) -> dict[int, DevicePhases]:
    """Phases of every device (computed once per trace object)."""
    return {d: device_phases(trace, d) for d in trace.devices}


def device_phases(trace: Trace, device: int) -> DevicePhases:
    sl = trace.events.device_slice(device)
    ev = trace.events
    got = marked_phases(ev.user_metadata[sl], trace.strings, ev.time_us[sl], trace.recorder)
    return got if got is not None else _inferred(trace, sl)


def marked_phases(user_metadata, strings, time_us, recorder) -> DevicePhases | None:
    """The phases our recorder marked on a device's entries (their user_metadata ids into `strings`, and
    times against its table); None when it marked none (they are then inferred from the stacks)."""
    got = _from_metadata(user_metadata, strings)
    timed = _from_recorder(time_us, recorder)
    if got is not None and timed is not None:
        # The CUDA allocator keeps the metadata string per thread: what autograd's own threads allocate in
        # backward carries none, so those entries take the recorder's time intervals instead.
        blank = ~got.stamped
        got.phase[blank], got.iteration[blank] = timed.phase[blank], timed.iteration[blank]
    return timed if got is None else got


def when(trace: Trace, device: int, index: int) -> tuple[str | None, int | None, str]:
    """(phase, iteration, "in the backward pass of iteration 2") of a device's trace entry.

    The phase is "between" for entries outside forward, backward and the
    optimizer step; (None, None, "") when the trace has no phases."""
    ph = phases(trace)[device]
    if index < 0 or ph.source == "none" or index >= ph.n:
        return None, None, ""
    code, it = int(ph.phase[index]), int(ph.iteration[index])
    phase = PHASES[code] if code != NONE else "between"
    if ph.generation is not None:  # a generation: the prefill, decoding step k, the loop between them
        step = decode_step(ph, it)
        text = {PREFILL: "in the prefill", DECODE: f"in decoding step {step}"}.get(
            code, "before the prefill" if it < 0 else ("after the prefill" if step == 0
                                                        else f"after decoding step {step}"))
        return phase, (it if it >= 0 else None), text
    text = {NONE: "between steps", OPTIMIZER: "in the optimizer step"}.get(code, f"in the {phase} pass")
    if it >= 0:
        text += f" of iteration {it}"
    return phase, (it if it >= 0 else None), text


def decode_step(ph: DevicePhases, call: int) -> int:
    """A generation's model call `call` as its step: 0 for a prefill, k for the k-th decoding step after it."""
    prefills = [p for p in (ph.generation or {}).get("prefill_calls", []) if p <= call]
    return call - prefills[-1] if prefills else call + 1  # no prefill seen (a window): counted from its start


def metadata_iteration(text: str) -> int | None:
    """The iteration our recorder's user_metadata string names (None: not one of ours)."""
    m = _RE_METADATA.fullmatch(text)
    return int(m.group(1)) if m else None


def _distinct_ids(ids, bound: int, chunk: int = 1 << 20) -> np.ndarray:
    """The distinct values of a column of ids in 0..bound-1 (string ids), ascending: np.unique's, read a chunk
    at a time into a table of `bound` flags rather than sorted or hashed (a constant column: its one value)."""
    if ids.strides == (0,):
        return np.asarray(ids[:1]).copy()
    if int(ids.min()) < 0 or int(ids.max()) >= bound:
        return np.unique(ids)
    seen = np.zeros(bound, bool)
    for lo in range(0, len(ids), chunk):
        seen[ids[lo:lo + chunk]] = True
    return np.flatnonzero(seen).astype(ids.dtype)


def _from_metadata(um, strings):
    """Phases from our `tracekit:iter=N:phase=P` user_metadata strings."""
    if not len(um):
        return None
    ids = _distinct_ids(um, len(strings))
    phase_of = np.zeros(len(strings), np.int8)
    iter_of = np.full(len(strings), -1, np.int32)
    stamped = np.zeros(len(strings), bool)  # the string is ours
    found = False
    for i in ids.tolist():
        m = _RE_METADATA.fullmatch(strings[i])
        if m:
            found = stamped[i] = True
            iter_of[i] = int(m.group(1))
            phase_of[i] = PHASES.index(m.group(2)) if m.group(2) in PHASES else NONE
    if not found:
        return None
    return DevicePhases(phase=phase_of[um], iteration=iter_of[um], source="metadata", stamped=stamped[um])


def _from_recorder(t, recorder):
    """Phases from the recorder's time intervals, for files whose entries lack our metadata."""
    rec = recorder or {}
    ph, its = rec.get("phases") or [], rec.get("iterations") or []
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


def marked_iterations(starts, codes, texts, n, unmarked_times, timed, recorder) -> list | None:
    """`marked_phases(...).iterations()` of a device's `n` entries, from what the streaming reader's MARKS
    pass keeps (io/stream.py): the runs of one user_metadata (first positions `starts`, their texts
    `texts[codes]`) and the times of the entries whose text does not start with "tracekit:iter=", in
    order; `timed`: whether any entry has a time. Memory grows with the runs and those entries only.
    None where marked_phases is None (no marks: the iterations are inferred from the whole trace), or
    needs times this pass did not keep (a text starting so that is no mark, with the recorder's table)."""
    rec = recorder or {}
    table = bool((rec.get("phases") or rec.get("iterations")) and n and timed)
    iter_of = np.full(len(texts), -1, np.int32)
    stamped = np.zeros(len(texts), bool)
    for i, text in enumerate(texts):
        m = _RE_METADATA.fullmatch(text)
        if m:
            stamped[i] = True
            iter_of[i] = int(m.group(1))
    if not stamped.any() and not table:
        return None
    if table and any(not stamped[i] and texts[i].startswith("tracekit:iter=") for i in np.unique(codes).tolist()):
        return None
    starts = np.asarray(starts, np.int64)
    ends = np.r_[starts[1:], n].astype(np.int64)
    run_stamped = stamped[codes]
    seg_start, seg_iter = [starts[run_stamped]], [iter_of[codes][run_stamped]]
    blank = np.flatnonzero(~run_stamped)
    if len(blank):
        if not table:
            seg_start.append(starts[blank])
            seg_iter.append(np.full(len(blank), -1, np.int32))
        else:  # each unmarked entry's iteration from the recorder's table, as _from_recorder gives it
            t = np.asarray(unmarked_times, np.int64)
            it = _from_recorder(t, {"iterations": rec.get("iterations") or []}) if len(t) else None
            it_blank = it.iteration if it is not None else np.full(len(t), -1, np.int32)
            lengths = ends[blank] - starts[blank]
            if int(lengths.sum()) != len(t):
                return None
            b0 = np.r_[0, np.cumsum(lengths)[:-1]].astype(np.int64)  # each blank run's start among them
            cp = np.union1d(b0[lengths > 0], np.flatnonzero(np.diff(it_blank)) + 1)
            r = np.searchsorted(b0, cp, "right") - 1
            seg_start.append(starts[blank][r] + (cp - b0[r]))
            seg_iter.append(it_blank[cp])
    s_all = np.concatenate(seg_start)
    i_all = np.concatenate(seg_iter).astype(np.int64)
    order = np.argsort(s_all, kind="stable")
    s_all, i_all = s_all[order], i_all[order]
    keep = np.r_[True, i_all[1:] != i_all[:-1]] if len(i_all) else np.zeros(0, bool)
    s_all, i_all = s_all[keep], i_all[keep]
    e_all = np.r_[s_all[1:] - 1, n - 1]
    return [(int(i), int(a), int(b)) for i, a, b in zip(i_all.tolist(), s_all.tolist(), e_all.tolist()) if i >= 0]


# Evidence codes per entry (0: none, inherit the phase before it).
_E_NONE, _E_FORWARD, _E_BACKWARD, _E_OPTIM, _E_ZERO, _E_USER, _E_FRAMELESS, _E_FACTORY, _E_RECOMPUTE = range(9)


def _inferred(trace, sl) -> DevicePhases:
    """Phases from annotations and stack frames (Python and C++), for files recorded elsewhere."""
    ev = trace.events
    action, stack = ev.action[sl], ev.stack_id[sl]
    n = len(action)
    code, frameless, n_alloc, starts = _evidence_codes(stack_flags(trace), action, stack)
    if _annotate(trace, sl, code):  # annotations rewrote ranges of codes: count and cut them again
        frameless, starts = int(np.count_nonzero(code == _E_FRAMELESS)), _run_starts(code)
    present = set(code[starts].tolist())  # the codes there are (each non-zero code begins a run or continues one)
    if not present & {_E_BACKWARD, _E_OPTIM} and frameless <= MAX_FRAMELESS_SHARE * max(1, n_alloc):
        # maybe a generation (no backward, no optimizer step): its tests read each entry's flags
        flags = stack_flags(trace)[stack + stack.dtype.type(1)]  # stack ids are below 2**31 - 1: no overflow
        gen = _generation(code, flags, stack >= 0, action == ALLOC, action == FREE_COMPLETED)
        del flags
        if gen is not None:
            return gen
    if not present:
        return DevicePhases(phase=np.zeros(n, np.int8), iteration=np.full(n, -1, np.int32), source="none")
    phase, iteration, run_starts = _resolve(code, starts)
    out = DevicePhases(phase=phase, iteration=iteration, source="inferred")
    out.__dict__["_run_starts"] = run_starts  # known from the evidence runs: not found again by a pass over entries
    return out


def _code_table(flags: np.ndarray) -> np.ndarray:
    """The evidence code of an entry from its stack and its kind, as a table (stack id + 1, kind) -> code;
    kind 0: neither an alloc nor a free_completed, 1: an alloc, 2: a free_completed. A stack's evidence,
    strongest last: user code, a factory in user code, a module call, checkpoint recompute, backward,
    the optimizer step, zero_grad. Other entries (segment events...) say nothing by user code alone; an
    allocation with no stack is _E_FRAMELESS (undone by _evidence_codes when no allocation has one)."""
    has = lambda bits: (flags & bits) != 0  # noqa: E731
    base = np.zeros(len(flags), np.int8)
    base[has(F_USER)] = _E_USER
    base[has(F_USER) & has(F_FACTORY)] = _E_FACTORY
    base[has(F_MODULE)] = _E_FORWARD
    base[has(F_MODULE) & has(F_CHECKPOINT)] = _E_RECOMPUTE
    base[has(F_BACKWARD)] = _E_BACKWARD
    base[has(F_OPTIM)] = _E_OPTIM
    base[has(F_ZERO_GRAD)] = _E_ZERO
    base[:1] = _E_NONE  # row 0: no stack, no frame evidence
    table = np.empty((len(flags), 3), np.int8)
    table[:, 0] = np.where(isin_few(base, (_E_USER, _E_FACTORY)), _E_NONE, base)
    table[:, 1] = table[:, 2] = base
    table[:1, 1] = _E_FRAMELESS
    return table.reshape(-1)


def _evidence_codes(flags, action, stack, chunk: int = 1 << 20):
    """(evidence code per entry, the frameless allocations, the allocations, _run_starts of the codes) in one
    pass a chunk of entries at a time: each entry's code is its (stack, kind)'s in _code_table, so no per-entry
    flags or masks are made. Frameless allocations are autograd's only when some allocation has a stack
    (Python stacks were recorded)."""
    n = len(action)
    table = _code_table(flags)
    code = np.empty(n, np.int8)
    frameless = n_alloc = 0
    parts: list = []
    prev = 0  # the last non-zero code before the chunk
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        idx = stack[lo:hi].astype(np.intp)  # the entry's row of the table: (stack id + 1) * 3 + its kind
        idx += 1
        idx *= 3
        act = action[lo:hi]
        is_alloc = act == ALLOC
        n_alloc += int(np.count_nonzero(is_alloc))
        idx += is_alloc
        del is_alloc
        is_free = act == FREE_COMPLETED
        idx += is_free
        idx += is_free
        del is_free
        c = code[lo:hi]
        np.take(table, idx, out=c, mode="clip")  # (valid indices: "clip" only spares a buffer)
        del idx
        frameless += int(np.count_nonzero(c == _E_FRAMELESS))
        prev = _chunk_starts(c, lo, prev, parts)
    if frameless and frameless == n_alloc:  # no allocation has a stack: none is frameless
        for lo in range(0, n, chunk):
            c = code[lo:lo + chunk]
            c[c == _E_FRAMELESS] = _E_NONE
        return code, 0, n_alloc, _run_starts(code, chunk)
    return code, frameless, n_alloc, np.concatenate(parts) if parts else np.zeros(0, np.int64)


def _chunk_starts(c, lo, prev, parts) -> int:
    """Append to `parts` where a run of one non-zero code begins in chunk `c` (at entry `lo`), after the
    non-zero code `prev`; returns the chunk's last non-zero code (prev when it has none)."""
    nz = np.flatnonzero(c)
    if not len(nz):
        return prev
    cz = c[nz]
    keep = np.empty(len(nz), bool)
    keep[0] = cz[0] != prev
    keep[1:] = cz[1:] != cz[:-1]
    parts.append(nz[keep] + lo)
    return int(cz[-1])


MIN_MODEL_CALLS = 3  # a prefill and at least two decoding steps
MAX_FRAMELESS_SHARE = 0.02  # more allocations without a stack than this: backward under stacks="python"


def _generation(code, flags, has_frames, is_alloc, is_free) -> DevicePhases | None:
    """A generation: repeated model calls with no backward pass and no optimizer step, from a library's
    generation loop or growing a KV cache. Each call of the model is a step: the prefill (the first
    call, or transformers' `_prefill`), then decoding steps 1..N; the loop's own code between calls
    (sampling, appending the token) is phase none of the step before. Iteration = the call's number."""
    if isin_few(code, (_E_BACKWARD, _E_OPTIM)).any():
        return None
    frameless = int((code == _E_FRAMELESS).sum())
    if frameless > MAX_FRAMELESS_SHARE * max(1, int(is_alloc.sum())):
        return None
    seen = np.bitwise_or.reduce(flags[has_frames]) if has_frames.any() else 0
    if not seen & (F_GENERATE | F_KV_CACHE):
        return None
    touch = has_frames & (is_alloc | is_free)
    in_model = touch & ((flags & F_MODULE) != 0)
    outside = touch & ((flags & F_MODULE) == 0)
    state = np.where(in_model, 1, np.where(outside, 2, 0)).astype(np.int8)
    idx = np.arange(len(state))
    last = np.maximum.accumulate(np.where(state > 0, idx, -1))
    filled = np.where(last >= 0, state[np.maximum(last, 0)], 0)
    begins = (filled == 1) & np.r_[True, filled[:-1] != 1]
    calls = int(begins.sum())
    if calls < MIN_MODEL_CALLS:
        return None
    call = np.cumsum(begins) - 1  # -1 before the first call
    starts = np.flatnonzero(begins)
    prefill_flag = (flags & F_PREFILL) != 0
    if (prefill_flag & in_model).any():
        is_prefill = np.zeros(calls, bool)
        is_prefill[np.unique(call[prefill_flag & in_model & (call >= 0)])] = True
        how = "transformers' _prefill frames mark the prefill"
    else:
        # the first call is the prefill unless it frees keys/values of an earlier call (a decoding step
        # appends to the cache and frees the tensors it replaces: a window that opens mid-generation)
        is_prefill = np.zeros(calls, bool)
        first = slice(starts[0], starts[1] if calls > 1 else len(code))
        frees_kv = bool((is_free[first] & ((flags[first] & F_KV_CACHE) != 0)).any())
        is_prefill[0] = not frees_kv
        how = ("the first model call is the prefill" if not frees_kv
               else "no prefill: the first model call already replaces cached keys and values")
    phase = np.zeros(len(code), np.int8)
    inside = (filled == 1) & (call >= 0)
    phase[inside] = np.where(is_prefill[call[inside]], PREFILL, DECODE)
    iteration = call.astype(np.int32)
    info = {"model_calls": calls, "prefills": int(is_prefill.sum()), "decode_steps": int(calls - is_prefill.sum()),
            "call_starts": starts.tolist(), "prefill_calls": np.flatnonzero(is_prefill).tolist(),
            "evidence": ["no backward pass and no optimizer step in the trace",
                         f"{calls} calls of the model (module forward frames), separated by the loop's own code",
                         how]}
    if seen & F_GENERATE:
        info["evidence"].append("a library's generation loop in the stacks (e.g. transformers' generate / _sample)")
    if seen & F_KV_CACHE:
        info["evidence"].append("a KV cache in the stacks (Hugging Face cache_utils.py)")
    return DevicePhases(phase=phase, iteration=iteration, source="inferred", generation=info)


def _annotate(trace, sl, code) -> bool:
    """Optimizer.step / zero_grad ranges from external_annotations override frame evidence; True where
    some range was written."""
    ann = trace.meta.get("external_annotations") or []
    if not ann:
        return False
    t = trace.events.time_us[sl]
    if not len(t) or (t == NO_TIME).all():
        return False
    wrote = False
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
            wrote = wrote or j > i
    return wrote


def _resolve(code, starts=None):
    """Walk the evidence runs once: a small state machine over runs, broadcast back to entries.

    A backward pass with no forward evidence before it (a model called as
    `model.forward()` or plain functions, under C++ stacks) makes its own
    forward: the user's code since the previous step, from its first
    computation (tensors made from nothing or copied in before it are inputs).

    Returns (phase, iteration, the first entry of each run of one (phase, iteration): DevicePhases.run_starts()).
    `starts`: _run_starts(code) when known.
    """
    n = len(code)
    if starts is None:
        starts = _run_starts(code)
    codes = code[starts].tolist()
    any_optim = _E_OPTIM in codes
    phase_at, iter_at = [], []
    phase, it, done = NONE, 0, False
    user_since = None  # first run of user computation since the phase went back to none
    for k, c in enumerate(codes):
        if c == _E_FORWARD or (c == _E_RECOMPUTE and phase != BACKWARD):
            if phase != FORWARD and done:
                it += 1
                done = False
            phase = FORWARD
        elif c == _E_BACKWARD:
            if phase == NONE and user_since is not None:  # the forward that had no evidence of its own
                if done:
                    it += 1
                    done = False
                for j in range(user_since, k):
                    phase_at[j], iter_at[j] = FORWARD, it
            phase = BACKWARD
        elif c == _E_OPTIM:
            phase = OPTIMIZER
        elif c == _E_ZERO:
            phase = NONE
        elif c == _E_FRAMELESS:
            if phase in (FORWARD, BACKWARD):
                phase = BACKWARD
        elif c in (_E_USER, _E_FACTORY):
            if phase in (BACKWARD, OPTIMIZER):
                phase = NONE
        if phase != NONE:
            user_since = None
        elif c == _E_USER and user_since is None:
            user_since = k
        if phase == OPTIMIZER or (phase == BACKWARD and not any_optim):
            done = True
        phase_at.append(phase)
        iter_at.append(it)
    phase = np.zeros(n, np.int8)
    iteration = np.zeros(n, np.int32)
    run_starts = np.zeros(min(n, 1), np.int64)
    if len(starts):
        # each entry takes the state of the last run that began at or before it
        lengths = np.diff(starts, append=n)
        p_at, i_at = np.array(phase_at, np.int8), np.array(iter_at, np.int32)
        phase[starts[0]:] = np.repeat(p_at, lengths)
        iteration[starts[0]:] = np.repeat(i_at, lengths)
        # where (phase, iteration) changes: at a run whose state differs from the one before it (entries
        # before the first run are phase none of iteration 0)
        change = (p_at != np.r_[np.int8(NONE), p_at[:-1]]) | (i_at != np.r_[np.int32(0), i_at[:-1]])
        run_starts = np.union1d(run_starts, starts[change]).astype(np.int64)
    return phase, iteration, run_starts


def _run_starts(code, chunk: int = 1 << 20) -> np.ndarray:
    """The entries where a run of one non-zero evidence code begins (entries with code 0 belong to the run
    before them), read a chunk at a time: the positions of a 10M-entry trace's non-zero codes are not made."""
    parts: list = []
    prev = 0
    for lo in range(0, len(code), chunk):
        prev = _chunk_starts(code[lo:lo + chunk], lo, prev, parts)
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)
