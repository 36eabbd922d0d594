"""A recorder without a device: run a training step on fake tensors and write the CUDA request stream.

`simulate(Workload(...))` builds the Hugging Face model from its config on the meta device, turns
its parameters into fake CPU tensors (no memory), and runs warm-up + measured training steps
(forward under the workload's precision, loss, backward, optimizer step, zero_grad) under
`FakeTensorMode`. A `TorchDispatchMode` sees every aten op and every tensor storage it creates; a
weak reference on each storage says when it is released. Where the CUDA kernels allocate what CPU
kernels do not (or the other way round) the rules of record/cuda_kernels.py apply: CUDA autocast's
op lists and weight cache, the SDPA backend the GPU would pick and its outputs, the cuBLAS workspaces,
torch.optim's foreach path (CUDA's default). The result is a snapshot-format dict as our recorder
writes it (`device_traces` with alloc / free_requested / free_completed entries holding requested
sizes, addresses, stacks, `user_metadata` phases and a category; `tracekit` with phases, iterations
and tags), so every tracekit analysis (and the caching-allocator model) reads it like a recording.

Never on a fake `cuda` device: with the CPU build of torch that aborts the process at the first
autograd node (no CUDA device guard). Fake CPU tensors stand for device memory; the few tensors a
real run keeps on the host (the optimizer's step counters and what is computed from them only)
are taken out of the stream.
"""
from __future__ import annotations

import contextlib
import gc
import os
import sys
import time
import weakref
from dataclasses import dataclass

from ..errors import TracekitError

FORMAT = "tracekit-simulated-1"
PRECISIONS = ("fp32", "amp", "bf16", "fp16")
OPTIMIZERS = ("none", "sgd", "sgd-momentum", "adam", "adamw", "adafactor")
ADDRESS_BASE = 0x7F0000000000
ALIGN = 512
MAX_SHADOW = 1 << 20  # elements: small tensors also get real values (for data-dependent control flow)


class SimulationError(TracekitError):
    """The workload cannot be simulated (said in one line)."""


class WorkloadError(SimulationError):
    """The workload would fail on the GPU too (an index past a table...): no estimate stands in for it."""


@dataclass
class Workload:
    config: dict
    batch: int = 1
    seq: int = 512
    precision: str = "amp"
    optimizer: str = "adamw"
    checkpointing: str = "none"  # none | full (transformers' gradient_checkpointing_enable())
    sm: tuple = (9, 0)  # the GPU's compute capability (SDPA backend, cuBLAS workspace size)
    warmup: int = 1
    steps: int = 1
    lr: float = 1e-4
    seed: int = 0

    def check(self):
        if self.precision not in PRECISIONS:
            raise SimulationError(f"--simulate runs precision {', '.join(PRECISIONS)} (got {self.precision!r})")
        if self.optimizer not in OPTIMIZERS:
            raise SimulationError(f"--simulate runs optimizers {', '.join(OPTIMIZERS)} (got {self.optimizer!r})")
        if self.checkpointing not in ("none", "full"):
            raise SimulationError(f"--simulate runs checkpointing none or full (got {self.checkpointing!r})")
        if self.batch < 1 or self.seq < 1:
            raise SimulationError("--simulate needs --batch and --seq of at least 1")
        if self.steps < 1 or self.warmup < 0:
            raise SimulationError("--simulate needs at least one measured step")
        return self


# -- the event log --------------------------------------------------------------------------------------------

_SKIP_FILES = ("torch/utils/_python_dispatch.py", "torch/_subclasses/", "torch/_ops.py", "torch/utils/_stats.py",
               "torch/_compile.py", "torch/_dynamo/", "torch/overrides.py", "torch/utils/_pytree.py",
               "torch/_prims_common/", "torch/_decomp/", "torch/_refs/", "torch/_meta_registrations.py",
               "torch/fx/", "torch/_library/")
# frames of the simulator's own machinery are left out; the training step (fake_step.py) stays, as a user's
# training script would
_SKIP_NAMES = {__file__, __file__.replace("fake.py", "cuda_kernels.py"), __file__.replace("fake.py", "hf_model.py")}


def _skip(filename: str) -> bool:
    f = filename.replace("\\", "/")
    return filename in _SKIP_NAMES or any(s in f for s in _SKIP_FILES)


class Log:
    """The request stream being written: one alloc per storage, one free when it is released."""

    def __init__(self):
        self.entries = []
        self.next_addr = ADDRESS_BASE
        self.live = {}  # sid -> (addr, size, alloc entry)
        self.info = {}  # sid -> dict(size, op, node, phase, ...)
        self.metadata = ""
        self.t0 = int(time.time() * 1e6)
        self.clock = 0
        self.op_stack = []  # names of the ops being run (innermost last), for frames
        self.cast = 0  # > 0 while autocast casts
        self.weight_cast = 0  # > 0 while autocast makes its cached copy of a weight
        self._frames = {}  # (filename, line, name) -> frame dict (shared)
        self._py_cache = {}
        self.sid_seq = 0
        self.ops = []  # (op name, input sids, output sids) for host propagation
        self.pending_accumulation = None  # (old sid, new sid, entry index of new's alloc)
        self.accumulated = 0
        self.record_ops = True

    def now(self) -> int:
        self.clock += 1
        return self.t0 + self.clock

    def frame(self, filename, line, name):
        key = (filename, line, name)
        f = self._frames.get(key)
        if f is None:
            f = self._frames[key] = {"filename": filename, "line": line, "name": name}
        return f

    def python_frames(self) -> list:
        out = []
        f = sys._getframe(2)
        while f is not None:
            co = f.f_code
            if not _skip(co.co_filename):
                out.append(self.frame(co.co_filename, f.f_lineno, co.co_name))
            f = f.f_back
            if len(out) >= 64:
                break
        return out

    def cpp_frames(self, op: str | None) -> list:
        import torch
        out = []
        if self.cast:
            out.append(self.frame("autocast_mode.cpp", 0, "at::autocast::cached_cast(c10::ScalarType, at::Tensor const&, c10::DeviceType)"))
        names = list(self.op_stack)
        if op and (not names or names[-1] != op):
            names.append(op)
        for n in reversed(names):
            out.append(self.frame("", 0, f"at::_ops::{n}::call"))
        node = torch._C._current_autograd_node()
        if node is not None:
            name = node.name()
            if name.startswith("torch::autograd::"):
                name = name.rsplit("::", 1)[-1]
            out.append(self.frame("", 0, f"torch::autograd::generated::{name}::apply(std::vector<at::Tensor>&&)"))
            out.append(self.frame("engine.cpp", 0, "torch::autograd::Engine::evaluate_function"))
        return out

    def on_cast(self, active, weight):
        self.cast += 1 if active else -1
        self.weight_cast += 1 if (active and weight) else (-1 if weight else 0)

    def new_sid(self) -> int:
        self.sid_seq += 1
        return self.sid_seq

    def alloc(self, sid, size, op=None, frames=None, **info):
        addr = self.next_addr
        self.next_addr += max(ALIGN, (size + ALIGN - 1) // ALIGN * ALIGN)
        if frames is None:
            frames = self.cpp_frames(op) + self.python_frames()
        e = {"action": "alloc", "addr": addr, "size": int(size), "stream": 0, "time_us": self.now(),
             "frames": frames, "user_metadata": self.metadata}
        self.entries.append(e)
        self.live[sid] = (addr, int(size), e)
        import torch
        node = torch._C._current_autograd_node()
        self.info[sid] = dict(info, size=int(size), op=op, entry=len(self.entries) - 1, metadata=self.metadata,
                              backward=node is not None, node=id(node) if node is not None else None,
                              weight_cast=self.weight_cast > 0)
        return addr

    def free(self, sid):
        pending = self.pending_accumulation
        if pending is not None:
            self.pending_accumulation = None
            old, new, index = pending
            if sid == old and len(self.entries) == index + 1 and new in self.live:
                # InputBuffer::accumulate on CUDA: old_var.add_(var) in place (input_buffer.cpp
                # can_accumulate_inplace: the buffer holds the only reference); fake tensors are tensor
                # subclasses and take old_var + var. Undo the copy: the sum lives in old's block.
                self.entries.pop()
                self.live[new] = self.live.pop(old)
                info = self.info.pop(new)
                self.info[new] = dict(self.info[old], node=info.get("node"))
                self.info[old]["merged_into"] = new
                self.accumulated += 1
                return
        got = self.live.pop(sid, None)
        if got is None:
            return
        addr, size, _ = got
        frames = self.python_frames()
        t = self.now()
        for action in ("free_requested", "free_completed"):
            self.entries.append({"action": action, "addr": addr, "size": size, "stream": 0, "time_us": t,
                                 "frames": frames, "user_metadata": self.metadata})
        self.info[sid]["free_entry"] = len(self.entries) - 1

    @contextlib.contextmanager
    def op(self, name):
        self.op_stack.append(name)
        try:
            yield
        finally:
            self.op_stack.pop()


# -- the tracker: every storage's creation and release --------------------------------------------------------

def _tracker_class():
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
    from torch.utils._pytree import tree_flatten, tree_map
    from torch.utils.weak import WeakTensorKeyDictionary

    from . import cuda_kernels as ck

    aten = torch.ops.aten
    RANDOM = {aten.bernoulli.default, aten.bernoulli.p, aten.bernoulli_.float, aten.rand.default,
              aten.randn.default, aten.randint.low, aten.normal_.default, aten.uniform_.default,
              aten.native_dropout.default, aten.randperm.default, aten.exponential_.default}
    SCALAR = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default}
    ADD = aten.add.Tensor
    LOOKUPS_EMB = aten.embedding.default
    LOOKUPS = {aten.embedding.default, aten.index_select.default}
    from torch._prims_common import is_non_overlapping_and_dense_or_false as _dense

    class Tracker(TorchDispatchMode):
        def __init__(self, log: Log, sm):
            super().__init__()
            self.log = log
            self.sm = sm
            self.sids = {}  # id(storage) -> sid
            self.shadow = WeakTensorKeyDictionary()  # fake tensor -> real tensor (small ones only)
            self.workspaces = {}  # (kind, thread) -> sid
            self.prehook_node = None
            self.node_inputs = set()

        # storages --------------------------------------------------------------------
        def sid_of(self, t):
            try:
                st = t.untyped_storage()
            except Exception:
                return None
            return self.sids.get(id(st))

        def register(self, t, op):
            try:
                st = t.untyped_storage()
            except Exception:
                return None
            key = id(st)
            sid = self.sids.get(key)
            nbytes = st.nbytes()
            if sid is not None:
                info = self.log.info.get(sid)
                if info is not None and sid in self.log.live and info["size"] != nbytes:  # resized in place
                    self.log.free(sid)
                    sid = None
                else:
                    return sid
            sid = self.log.new_sid()
            self.sids[key] = sid
            self.log.alloc(sid, nbytes, op=op, dtype=str(t.dtype).replace("torch.", ""), shape=tuple(t.shape))
            weakref.finalize(st, self._released, key, sid)
            return sid

        def _released(self, key, sid):
            if self.sids.get(key) == sid:
                del self.sids[key]
            self.log.free(sid)

        # shadows: real values of small tensors, for data-dependent control flow -------
        def _real(self, a):
            if isinstance(a, torch.Tensor):
                from torch._subclasses.fake_tensor import FakeTensor
                if not isinstance(a, FakeTensor):
                    return a
                s = self.shadow.get(a)
                if s is None:
                    raise KeyError
                return s
            return a

        def _shadow_run(self, func, args, kwargs, out):
            if func in RANDOM:
                return
            flat_out = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            if any(t.numel() > MAX_SHADOW for t in flat_out):
                return
            try:
                rargs = tree_map(self._real, args)
                rkwargs = tree_map(self._real, kwargs)
            except KeyError:
                # a mutated tensor's shadow is no longer its value
                if func._schema.is_mutable:
                    for i, a in enumerate(func._schema.arguments):
                        if a.alias_info is not None and a.alias_info.is_write and i < len(args):
                            for t in tree_flatten(args[i])[0]:
                                if isinstance(t, torch.Tensor):
                                    self.shadow.pop(t, None)
                return
            if "device" in rkwargs:
                rkwargs = dict(rkwargs, device="cpu")
            try:
                with _disable_current_modes():
                    rout = func(*rargs, **rkwargs)
            except Exception:
                return
            for f, r in zip(tree_flatten(out)[0], tree_flatten(rout)[0]):
                if isinstance(f, torch.Tensor) and isinstance(r, torch.Tensor):
                    self.shadow[f] = r

        def set_shadow(self, fake, real):
            self.shadow[fake] = real

        # dispatch ----------------------------------------------------------------------
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func in SCALAR:
                try:
                    rargs = tree_map(self._real, args)
                except KeyError:
                    raise SimulationError(
                        f"the model's code needs the value of a tensor ({func.__name__} in "
                        f"{self._where()}), which fake tensors do not have") from None
                with _disable_current_modes():
                    return func(*rargs, **kwargs)
            if func in LOOKUPS:
                self._check_indices(func, args)
            out = func(*args, **kwargs)
            name = func.__name__
            if "." in name:
                base, ov = name.split(".", 1)
                name = base if ov == "default" else f"{base}_{ov}"
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor):
                    self.register(t, name)
            if func is ADD:
                self._maybe_accumulation(args, kwargs, out)
            if func in ck.GEMM_OPS:
                self._workspace("cublas")
            if ck.uses_cublaslt(func, args):
                self._workspace("cublaslt")
            self._shadow_run(func, args, kwargs, out)
            if self.log.record_ops:
                ins = [self.sid_of(t) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
                outs = [self.sid_of(t) for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
                self.log.ops.append((name, ins, outs))
            return out

        def _check_indices(self, func, args):
            """An index past the table is a device-side assert on CUDA (a sequence longer than the model's learned
            positions, a token id past the vocabulary); fake kernels do not look: check the real indices we have."""
            weight, indices = (args[0], args[1]) if func is LOOKUPS_EMB else (args[0], args[2])
            real = self.shadow.get(indices) if isinstance(indices, torch.Tensor) else None
            if real is None or real.numel() == 0:
                return
            rows = weight.size(0)
            with _disable_current_modes():
                top, low = int(real.max()), int(real.min())
            if top >= rows or low < -rows:
                raise WorkloadError(f"index {top} is out of range for a table of {rows} rows in "
                                      f"{self._where()} (a sequence longer than the model's positions, or a token "
                                      "id past its vocabulary): CUDA stops with a device-side assert there")

        def _maybe_accumulation(self, args, kwargs, out):
            """An `old + new` the autograd engine makes when a gradient slot receives a second gradient
            (InputBuffer::accumulate): old made by another node of this backward, not an input of the running
            node, new made by the running node, same shape, dense. If old is released right away (the buffer
            held its only reference), CUDA would have added in place; Log.free undoes the copy."""
            node = torch._C._current_autograd_node()
            if node is None or torch.is_grad_enabled() or kwargs.get("alpha", 1) != 1 or len(args) != 2:
                return
            old, new = args
            if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)):
                return
            if old.shape != new.shape or old.dtype != new.dtype or old.shape != out.shape \
                    or not _dense(old):
                return
            if self.prehook_node is not node:
                return  # a node whose inputs we do not know (a graph made during backward)
            st = old.untyped_storage()
            if torch._C._storage_Use_Count(st._cdata) != 2:  # old's TensorImpl and `st`: no view shares it
                return
            so, sn, sout = self.sid_of(old), self.sid_of(new), self.sid_of(out)
            if so is None or sn is None or sout is None or so in self.node_inputs:
                return
            io, inn = self.log.info.get(so), self.log.info.get(sn)
            if io is None or inn is None or not io.get("backward") or io.get("node") == id(node) \
                    or inn.get("node") != id(node):
                return
            self.log.pending_accumulation = (so, sout, self.log.info[sout]["entry"])

        def prehook(self, grad_outputs):
            """A node is about to run: what it receives (its inputs) are not engine accumulations."""
            self.prehook_node = torch._C._current_autograd_node()
            self.node_inputs = {self.sid_of(g) for g in grad_outputs if isinstance(g, torch.Tensor)}
            return None

        def watch_graph(self, root):
            """Pre-hooks on every node reachable from `root` (the loss's grad_fn)."""
            seen, todo = set(), [root]
            while todo:
                fn = todo.pop()
                if fn is None or id(fn) in seen:
                    continue
                seen.add(id(fn))
                try:
                    fn.register_prehook(self.prehook)
                except Exception:
                    pass
                todo.extend(f for f, _ in fn.next_functions)

        def _workspace(self, kind):
            """cuBLAS / cuBLASLt keep one workspace per (thread's handle, stream): the Python thread runs
            forward and the optimizer, the autograd engine's device thread runs backward."""
            thread = "backward" if torch._C._current_autograd_node() is not None else "forward"
            if (kind, thread) in self.workspaces:
                return
            sid = self.log.new_sid()
            self.workspaces[kind, thread] = sid
            if kind == "cublas":
                size = ck.cublas_workspace_bytes(self.sm)
                frames = [self.log.frame("CublasHandlePool.cpp", 0, "at::cuda::getNewWorkspace()"),
                          self.log.frame("CublasHandlePool.cpp", 0, "at::cuda::getCurrentCUDABlasHandle()")]
            else:
                size = ck.CUBLASLT_WORKSPACE_BYTES
                frames = [self.log.frame("CublasHandlePool.cpp", 0, "at::cuda::getCUDABlasLtWorkspace()")]
            frames += self.log.cpp_frames(None) + self.log.python_frames()
            self.log.alloc(sid, size, op=f"{kind}_workspace", frames=frames, workspace=thread)

        def _where(self) -> str:
            for f in self.log.python_frames():
                if "/torch/" not in f["filename"]:
                    return f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']}"
            return "?"

    return Tracker


# -- the workload ----------------------------------------------------------------------------------------------

class _Marks:
    """Phases and iterations, as our recorder writes them (user_metadata and the tracekit key)."""

    def __init__(self, log):
        self.log = log
        self.phases, self.iterations = [], []
        self.iteration = None
        self.phase = None
        self.t_phase = self.t_iter = None

    def start_iteration(self, i):
        self.iteration = i
        self.t_iter = self.log.now()
        self.log.metadata = f"tracekit:iter={i}"

    def start_phase(self, phase):
        self.end_phase()
        self.phase, self.t_phase = phase, self.log.now()
        self.log.metadata = f"tracekit:iter={self.iteration}:phase={phase}"

    def end_phase(self):
        if self.phase is not None:
            self.phases.append({"iteration": self.iteration, "phase": self.phase, "start_us": self.t_phase,
                                "end_us": self.log.now()})
            self.phase = None
            self.log.metadata = f"tracekit:iter={self.iteration}"

    def end_iteration(self):
        self.end_phase()
        self.iterations.append({"iteration": self.iteration, "start_us": self.t_iter, "end_us": self.log.now()})
        self.log.metadata = ""


@contextlib.contextmanager
def _eager_transformers():
    """transformers treats fake tensors as tracing (torch.compile) and then takes its compile-safe paths
    (always-built masks...). A GPU run is eager: say so, and answer its data-dependent checks from real
    values of the small tensors they read (the tracker's shadows)."""
    patched = []
    try:
        import transformers.utils.import_utils as iu
        for mod in list(sys.modules.values()):
            if getattr(mod, "__name__", "").startswith("transformers") and getattr(mod, "is_fake_tensor", None) is iu.is_fake_tensor:
                patched.append((mod, mod.is_fake_tensor))
                mod.is_fake_tensor = lambda *a, **k: False
        yield
    finally:
        for mod, fn in patched:
            mod.is_fake_tensor = fn


def simulate(w: Workload, progress=None) -> dict:
    """Run the workload on fake tensors and return the snapshot-format dict of its request stream."""
    w.check()
    from .hf_model import build_meta, import_transformers
    torch, transformers = import_transformers()
    from torch._subclasses.fake_tensor import FakeTensorMode, UnsupportedOperatorException

    from . import cuda_kernels as ck
    from . import fake_step

    if w.config.get("is_encoder_decoder"):
        raise SimulationError("--simulate trains decoder-only causal language models (this config is encoder-decoder)")
    model = build_meta(w.config)
    vocab = int(getattr(model.config, "vocab_size", 0) or 0)
    if not vocab:
        raise SimulationError("the config has no vocab_size: cannot make token ids for the batch")
    if not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
        raise SimulationError(f"{type(model).__name__} has no language-model head: --simulate trains causal LMs")
    log = Log()
    tracker = _tracker_class()(log, tuple(w.sm))
    autocast = ck.CudaAutocast(on_cast=log.on_cast)
    composites = ck.CudaComposites(tuple(w.sm), log.op)
    marks = _Marks(log)
    tags = []
    old_grad = torch.is_grad_enabled()
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_quiet_transformers())
            stack.enter_context(_eager_transformers())
            stack.enter_context(autocast.installed())
            stack.enter_context(composites.installed())
            stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            stack.enter_context(tracker)
            torch.set_grad_enabled(True)
            run = fake_step.Run(w, model, tracker=tracker, autocast=autocast, marks=marks, log=log, tags=tags)
            run.setup()
            total = w.warmup + w.steps
            for i in range(total):
                if progress:
                    progress(i / total, f"simulating step {i + 1} of {total}")
                run.step(i)
            gc.collect()
            host = _host_sids(run.optimizer, tracker, log, tags)
    except SimulationError:
        raise
    except UnsupportedOperatorException as e:
        raise SimulationError(f"an operator has no fake implementation ({e}): use the formulas (without "
                              "--simulate)") from None
    except MemoryError:
        raise SimulationError("the simulation ran out of host memory") from None
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        if os.environ.get("TRACEKIT_DEBUG"):
            raise
        raise SimulationError(f"the simulated step failed: {type(e).__name__}: {first}"[:400]) from None
    finally:
        torch.set_grad_enabled(old_grad)
    return _snapshot(log, marks, tags, host, w, model, composites.used, str(transformers.__version__),
                     str(torch.__version__))


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' advice and torch's fake-tensor error logs are not for the user: the one line we raise is."""
    import logging
    import warnings
    loggers = [logging.getLogger(n) for n in ("transformers", "torch._subclasses.fake_tensor", "torch._subclasses")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL if lg.name.startswith("torch") else logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


def _host_sids(opt, tracker, log, tags) -> set:
    """Storages a real run keeps in host memory: torch.optim's step counters (CPU tensors unless capturable or
    fused) and what only they feed (bias corrections...)."""
    import torch
    host = set()
    if opt is not None:
        for state in opt.state.values():
            t = state.get("step")
            if isinstance(t, torch.Tensor) and t.dim() == 0:
                sid = tracker.sid_of(t)
                if sid is not None:
                    host.add(sid)
    for kind, sid, _ in tags:  # earlier steps' counters too (a foreach step may replace them)
        if kind == "step" and sid is not None:
            host.add(sid)
    # a scalar made from a Python number (torch.tensor(1.0): a CPU tensor in a CUDA run) whose every use is
    # beside host tensors is one of them (adam.py: _foreach_add_(steps, torch.tensor(1.0, device="cpu")))
    uses = {}
    for k, (name, ins, outs) in enumerate(log.ops):
        for s in ins:
            if s is not None:
                uses.setdefault(s, []).append(k)
    scalars = [sid for sid, info in log.info.items() if info.get("op") in ("lift_fresh", "lift_fresh_copy")
               and info.get("shape") == ()]
    changed = True
    while changed:
        changed = False
        for name, ins, outs in log.ops:  # what only host tensors make is on the host
            real = [s for s in ins if s is not None]
            if real and all(s in host for s in real):
                new = {s for s in outs if s is not None} - host
                if new:
                    host |= new
                    changed = True
        for sid in scalars:
            if sid in host or sid not in uses:
                continue
            if all(any(s in host for s in log.ops[k][1] if s is not None and s != sid) for k in uses[sid]):
                host.add(sid)
                changed = True
    return host


def _snapshot(log, marks, tags, host, w, model, sdpa_used, hf_version, torch_version) -> dict:
    """The snapshot dict: device_traces without host storages, final segments, and the tracekit key."""
    from .hf_model import unique_parameters
    unique = unique_parameters(model)
    params = int(sum(p.numel() for p in unique))
    trainable = int(sum(p.numel() for p in unique if p.requires_grad))
    host_entries = set()
    for sid in host:
        info = log.info.get(sid)
        if info is None:
            continue
        host_entries.add(info["entry"])
        fe = info.get("free_entry")
        if fe is not None:
            host_entries.update((fe - 1, fe))
    # categories per allocation (exact: the simulator knows which tensor each storage is)
    cat = {}
    for kind, sid, name in tags:
        if sid is None or sid in host:
            continue
        c = {"buffer": "parameter", "step": None}.get(kind, kind)
        if c and sid not in cat:
            cat[sid] = c
    _label(log, cat, marks)
    by_entry = {}
    for sid, info in log.info.items():
        if "merged_into" in info:
            continue
        c = cat.get(sid, "temporary")
        by_entry[info["entry"]] = c
        fe = info.get("free_entry")
        if fe is not None:
            by_entry[fe - 1] = by_entry[fe] = c
    out_entries = []
    for k, e in enumerate(log.entries):
        if k in host_entries:
            continue
        e["category"] = by_entry.get(k, "other")
        out_entries.append(e)
    live = [(addr, size, e) for sid, (addr, size, e) in log.live.items() if sid not in host]
    segments = []
    for addr, size, e in sorted(live, key=lambda x: x[0]):
        # one segment per block live at the end (as the CPU backend writes them): the allocator's segments
        # are not simulated, so reserved equals allocated here; blocks are the request rounded up to 512 B
        block = max(ALIGN, (size + ALIGN - 1) // ALIGN * ALIGN)
        segments.append({
            "device": 0, "address": addr, "total_size": block, "allocated_size": block, "active_size": block,
            "requested_size": size, "stream": 0, "segment_type": "large" if size > (1 << 20) else "small",
            "segment_pool_id": (0, 0), "is_expandable": False, "frames": e["frames"],
            "blocks": [{"address": addr, "size": block, "requested_size": size, "state": "active_allocated",
                        "frames": e["frames"]}],
        })
    tag_items = []
    for kind, sid, name in tags:
        if sid is None or sid in host or kind == "step":
            continue
        info = log.info[sid]
        e = log.entries[info["entry"]]
        tag_items.append({"addr": e["addr"], "size": info["size"], "device": 0, "time_us": e["time_us"] + 0,
                          "kind": kind, "name": name})
    return {
        "segments": segments,
        "device_traces": [out_entries],
        "tracekit": {
            "version": 1,
            "backend": "simulated",
            "format": FORMAT,
            "torch_version": torch_version,
            "transformers_version": hf_version,
            "devices": [{"index": 0, "type": "cuda", "name": f"simulated sm{w.sm[0]}{w.sm[1]}"}],
            "phases": marks.phases,
            "iterations": marks.iterations,
            "tags": tag_items,
            "simulated": {
                "workload": {"batch": w.batch, "seq": w.seq, "precision": w.precision, "optimizer": w.optimizer,
                             "checkpointing": w.checkpointing, "sm": list(w.sm), "warmup": w.warmup,
                             "steps": w.steps},
                "model_class": type(model).__name__,
                "params": params,
                "trainable_params": trainable,
                # scaled_dot_product_attention calls per step, by the backend a CUDA run takes (checkpointing
                # calls it again in backward)
                "sdpa_backends": {k: v // max(1, w.warmup + w.steps) for k, v in sdpa_used.items()},
                "host_storages": len(host),
                "reserved": "not modelled (the caching allocator's segments are not simulated)",
            },
        },
    }


def _label(log, cat, marks):
    """Categories of the untagged allocations, as our recorder would tag them: made in forward and alive when
    backward begins = activation (what autograd saved, autocast's weight copies included), the cuBLAS workspaces
    = workspace, autocast's weight copies that die with the autocast region = parameter, the rest temporary."""
    starts = {}
    for p in marks.phases:
        if p["phase"] == "backward":
            starts[p["iteration"]] = p["start_us"]
    for sid, info in log.info.items():
        if sid in cat or "merged_into" in info:
            continue
        if info.get("workspace"):
            cat[sid] = "workspace"
            continue
        md = info.get("metadata", "")
        if md.endswith("phase=forward"):
            it = int(md.split("iter=")[1].split(":")[0])
            t0 = starts.get(it)
            fe = info.get("free_entry")
            freed_at = log.entries[fe]["time_us"] if fe is not None else None
            if t0 is not None and (freed_at is None or freed_at > t0):
                cat[sid] = "activation"
                continue
        if info.get("weight_cast"):  # autocast's copy of a weight freed when autocast exits (as tracekit names it)
            cat[sid] = "parameter"

