"""The recorder: a context manager that records one or more training steps to a file.

    with tracekit.record("step.pickle", model=model, optimizer=optimizer) as rec:
        for batch in loader:
            ...
            rec.step()  # optional iteration boundary

It picks a backend (CUDA allocator history, or the CPU profiler), installs the
hooks that mark iterations and phases and tag tensors, and at the end writes a
PyTorch-format snapshot with our data under the "tracekit" key. Anything that
goes wrong inside the recorder becomes a warning: training runs on untouched.
"""
from __future__ import annotations

import os
import signal
import sys
import warnings
import weakref

from . import summary
from .hooks import Hooks
from .marks import Marks, now_us
from .signals import TermHandler, deferred, exit_code, same_interrupt
from .tags import (
    BUFFER, GRADIENT, OPTIMIZER_STATE, PARAMETER, Tags, optimizer_params, param_names, storages,
)

FORMAT_VERSION = 1
# The newest trace entries kept (and written). Building and writing the file costs about 0.9 KiB of memory
# per entry at its peak, so this default keeps the recorder within ~160 MB of the plain run however long it
# runs (bench/bench_record.py, 10,000 iterations); --max-entries 2000: ~25 MB.
DEFAULT_MAX_ENTRIES = 150_000
DEFAULT_PATH = "memory.pickle"


class Recorder:
    """Records memory while active. Use `record(...)` to make one.

    `warmup` iterations are run with the hooks on but nothing recorded; after
    `steps` recorded iterations (None: no limit) the file is written and the
    hooks removed while the program goes on.
    """

    def __init__(self, path=DEFAULT_PATH, model=None, optimizer=None, *, backend="auto", stacks="python",
                 max_entries=DEFAULT_MAX_ENTRIES, activations=True, warmup=0, steps=None, command=None,
                 origins=True):
        if stacks not in ("python", "all"):
            raise ValueError(f"stacks must be 'python' or 'all', not {stacks!r}")
        if backend not in ("auto", "cuda", "cpu"):
            raise ValueError(f"backend must be 'auto', 'cuda' or 'cpu', not {backend!r}")
        self.path = expand_path(path)
        from ..io.write import output_format

        output_format(self.path)  # ValueError for a name whose format we cannot tell
        # Only weak references to the user's objects: a model or optimizer dropped while recording is freed.
        self._model_ref = weakref.ref(model) if model is not None else None
        self._optimizer_ref = weakref.ref(optimizer) if optimizer is not None else None
        self.backend_name = backend
        self.stacks = stacks
        self.max_entries = max_entries
        self.activations = activations
        self.warmup = warmup
        self.steps = steps
        self.command = list(command) if command is not None else list(sys.argv)
        self.exit_code = None
        self.error = None
        self.signal = None  # "SIGINT" / "SIGTERM" when one cut the recording short (the file is partial)
        self.written = None  # the path written, once it is
        self.enabled = False  # hooks are on (recording or waiting for warm-up to end)
        self.recording = False  # the backend is recording
        self._done = False
        self._backend = None
        self._hooks = None
        self._marks = None
        self._tags = None
        self._models = []  # (prefix, weakref to module, summary): the model, or outermost modules seen with parameters
        self._optimizers = []  # (weakref, summary)
        self._input_shape = None  # the first forward's batch shape, for `estimate`
        self._start_us = None
        self._preexisting = []
        self._watch = None
        self._term = None
        self.origins = origins  # forward origins of backward allocations, and modules (origins.py)
        self._checkpoint = None  # CUDA: torch.utils.checkpoint's early stop, switched off while recording
        self._param_names_memo = None
        self._named_memo = None
        self._fsdp_units = {}  # FSDP2 unit name -> bytes of its all-gathered parameters
        self._ddp_intervals = []  # [start_us, end_us] of DDP's pre-forward (bucket rebuilds)
        self._fsdp1_names = {}  # id(module) -> its name without FSDP1's wrappers
        self._distributed_info = None
        self._distributed_tries = 0

    @property
    def model(self):
        return self._model_ref() if self._model_ref is not None else None

    @property
    def optimizer(self):
        return self._optimizer_ref() if self._optimizer_ref is not None else None

    # -- context manager ---------------------------------------------------
    def __enter__(self):
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is not None and self.error is None:
            self.error = f"{exc_type.__name__}: {exc}"
        if exc_type is not None and issubclass(exc_type, KeyboardInterrupt):
            if self.signal is None:
                self.signal = "SIGINT"
            with same_interrupt():
                self.close()
            return False
        self.close()
        return False

    def start(self):
        """Install the hooks and start recording (or wait for the warm-up iterations)."""
        try:
            from ..io.write import check_writable

            check_writable(self.path)
        except ValueError as e:  # found now, not after the run: the recording would be lost
            self._disable(f"cannot write the recording to {self.path} ({e}); training runs without it")
            return self
        if _active and any(r.enabled and not r._done for r in list(_active)):
            self._disable("another tracekit recording is running in this process; this one records nothing "
                          "(the outer one goes on)")
            return self
        try:
            import torch  # noqa: F401

            from .origins import enabled as origins_enabled

            self.origins = bool(self.origins) and origins_enabled()
            self._backend = make_backend(resolve_backend(self.backend_name, self.model), self.stacks,
                                         self.max_entries, origins=self.origins, roots=self._roots)
            self._tags = Tags(self._backend.device_of)
            self._marks = Marks(on_change=self._metadata_changed)
            model, optimizer = self.model, self.optimizer
            if model is not None:
                self._add_model("", model)
            if optimizer is not None:
                self._add_optimizer(optimizer)
            self._hooks = Hooks(self, model=model, optimizer=optimizer, activations=self.activations)
            self._hooks.install(model, optimizer)
            del model, optimizer
            self._term = TermHandler(self._terminated)
            self._term.install()
            self.enabled = True
            _active.add(self)
            self._marks.start()
            if self.warmup <= 0:
                self._start_backend()
        except Exception as e:
            self._disable(f"recording could not start ({e!r}); training runs without it")
        return self

    def step(self):
        """Mark an iteration boundary (optional: optimizer steps mark them too)."""
        if not self.enabled:
            return
        try:
            self._marks.step()
            self._iteration_began()
        except Exception as e:
            self._disable(f"recording stopped ({e!r})", pop_saved_hooks=False)

    def close(self):
        """Stop recording, write the file (if anything was recorded) and remove the hooks."""
        try:
            self._finish()
        finally:
            if self._hooks is not None:
                self._hooks.remove()
            if self._term is not None:
                self._term.remove()
            if self._backend is not None:
                try:
                    self._backend.restore()
                except Exception:
                    pass
            self._release()

    def _release(self):
        """Nothing of the user's, and none of our tables, outlives the recording."""
        _active.discard(self)
        self._restore_checkpoint()
        if self._backend is not None and hasattr(self._backend, "release"):
            try:
                self._backend.release()
            except Exception:
                pass
        if self._hooks is not None:
            self._hooks.listener = None
        self._watch = None

    # -- the user's objects, held weakly -----------------------------------
    def _add_model(self, prefix, module):
        try:
            info = summary.model_summary(module)
        except Exception:
            info = None
        self._models.append((prefix, weakref.ref(module), info))

    def _add_optimizer(self, optimizer):
        try:
            info = summary.optimizer_summary(optimizer)
        except Exception:
            info = None
        self._optimizers.append((weakref.ref(optimizer), info))

    def _roots(self):
        """[(prefix, module)] of the known models still alive."""
        out = []
        for prefix, ref, _ in self._models:
            m = ref()
            if m is not None:
                out.append((prefix, m))
        return out

    def _live_optimizers(self):
        return [o for o in (ref() for ref, _ in self._optimizers) if o is not None]

    # -- listener methods (called by Hooks) --------------------------------
    def forward_started(self, module, args, kwargs):
        if (self._model_ref is None and _has_parameters(module)
                and all(ref() is not module for _, ref, _ in self._models)):
            self._add_model(f"{type(module).__name__}." if self._models else "", module)
        if self._input_shape is None and self._models and module is self._models[0][1]():
            self._input_shape = summary.input_shape(args, kwargs)
        self._resume_oplog()
        if self._marks.forward_started():
            self._iteration_began()
        elif self.recording:
            self._backend.tick()  # an inference loop has no phase changes: drain here
        if self.recording:
            prefix = self._prefix_of(module)
            if prefix == "" and module is (self._models[0][1]() if self._models else None):
                self._tags.add_named(self._named_parameters(), PARAMETER)  # the memoised list
                self._tags.add_named(module.named_buffers(), BUFFER)
            else:
                self._tags.add_model(module, prefix)
            self._tags.add_inputs(args, kwargs)

    def forward_kwargs(self, module, kwargs):
        if self.recording:
            self._tags.add_inputs((), kwargs)

    def backward_started(self):
        self._resume_oplog()
        self._marks.backward_started()

    def _resume_oplog(self):
        oplog = getattr(self._backend, "oplog", None) if self.recording else None
        if oplog is not None:
            oplog.resume()

    def backward_ended(self):
        self._marks.backward_ended()
        if self.recording:
            self._tags.add_gradients(self._named_parameters())
            if self._distributed_tries < 2 and not (self._distributed_info or {}).get("parameter_bytes"):
                self._distributed_tries += 1  # the first backward passes (FSDP is initialised by then), not every one
                self._take_distributed()

    def optimizer_started(self, optimizer):
        if all(ref() is not optimizer for ref, _ in self._optimizers):
            self._add_optimizer(optimizer)
        self._marks.optimizer_started()
        if self.recording:
            self._tags.add_gradients(optimizer_params(optimizer, self._param_names()))

    def optimizer_ended(self, optimizer):
        self._marks.optimizer_ended()
        if self.recording:
            self._tags.add_optimizer_state(optimizer, self._param_names())

    def fsdp_unsharded(self, group):
        """FSDP2 all-gathered a unit's parameters (hooks.patch_fsdp): tag them, and remember the unit's bytes."""
        if self.recording:
            name = getattr(group, "_module_fqn", None) or "(root)"
            held = []
            for fp in getattr(group, "fsdp_params", ()):
                held += list(getattr(fp, "all_gather_outputs", None) or ())
                held += list(getattr(fp, "_unsharded_inner_tensors", None) or ())
            self._tags.add_unsharded(held, f"{name} (unsharded)")
            try:
                self._fsdp_units[name] = sum(t.untyped_storage().nbytes() for t in held)
            except Exception:  # fake or meta tensors (a simulation): no bytes to count
                pass

    def fsdp1_unsharded(self, handle):
        """FSDP1 all-gathered a flat parameter (hooks._patch_fsdp1): tag its padded unsharded flat parameter."""
        if self.recording:
            flat = getattr(handle, "flat_param", None)
            if flat is None or not getattr(handle, "uses_sharded_strategy", True):
                return
            module = getattr(handle, "_fully_sharded_module", None)
            names = self._fsdp1_names
            if id(module) not in names:  # the wrapped module's name, FSDP's wrappers left out
                for prefix, root in self._roots():
                    for n, m in root.named_modules():
                        n = ".".join(x for x in (prefix.rstrip(".") + "." + n).split(".")
                                     if x and x != "_fsdp_wrapped_module")
                        names.setdefault(id(m), n)
            name = names.get(id(module)) or "(root)"
            held = [getattr(flat, a, None) for a in ("_full_param_padded", "_full_prec_full_param_padded")]
            self._tags.add_unsharded([t for t in held if t is not None], f"{name} (unsharded)")

    def fsdp_post_backward(self, group):
        """FSDP2 is about to reduce-scatter a unit's gradients: tag its full (unsharded) gradients as gradients."""
        if self.recording:
            from .distributed import fsdp2_unsharded_grads
            name = getattr(group, "_module_fqn", None) or "(root)"
            for param, g in fsdp2_unsharded_grads(group):
                self._tags.add(g, GRADIENT, f"{name}: {param}.grad (unsharded, before its reduce-scatter)")

    def ddp_pre_forward(self, started):
        """DDP's pre-forward began or ended (hooks.patch_ddp): its bucket rebuilds happen in between."""
        if self.recording:
            if started:
                self._ddp_intervals.append([now_us(), None])
            elif self._ddp_intervals and self._ddp_intervals[-1][1] is None:
                self._ddp_intervals[-1][1] = now_us()

    def _take_distributed(self):
        """What the job's wrappers say (record/distributed.py), taken while the model lives (a script's model is
        gone by the time its file is written)."""
        try:
            from .distributed import summary as distributed_summary

            got = distributed_summary(self._roots(), self._fsdp_units)
            if got is not None and (got.get("parameter_bytes") or self._distributed_info is None):
                self._distributed_info = got
        except Exception as e:
            if not getattr(self, "_warned_distributed", False):
                self._warned_distributed = True
                warnings.warn(f"tracekit: could not read the distributed setup ({e!r})", RuntimeWarning)

    def saved_tensor(self, tensor, fn=False):
        if self.recording:
            self._tags.add_activation(tensor, fn)

    # -- internals ---------------------------------------------------------
    def _terminated(self, signum):
        """SIGTERM (TermHandler): write what we have, marked partial; the process then dies of it."""
        self.signal = signal.Signals(signum).name
        self.exit_code = exit_code(signum)
        if self.error is None:
            self.error = f"terminated by {self.signal}"
        self.close()
        if self.written:
            print(f"tracekit: wrote {self.written} (partial: {self.signal})", file=sys.stderr, flush=True)

    def _iteration_began(self):
        self._tags.new_iteration()
        if self.recording:
            start = self._backend.window_start()  # bounded on long runs: what the kept trace no longer covers goes
            if start is not None:
                self._tags.forget_before(start)
                self._marks.forget_before(start)
        it = self._marks.iteration
        if not self.recording and not self._done and it >= self.warmup:
            try:
                self._start_backend()
            except Exception as e:
                self._disable(f"recording could not start ({e!r}); training runs without it", pop_saved_hooks=False)
        elif self.recording and self.steps is not None and it >= self.warmup + self.steps:
            self._finish(remove_hooks=True)

    def _start_backend(self):
        self._start_us = now_us()
        self._first_iteration = self._marks.iteration
        self._tag_existing(self._start_us)
        self._checkpoint_safe()
        self._backend.start(self._preexisting)
        self.recording = True
        if self._hooks is not None:
            self._hooks.guard = getattr(self._backend, "oplog", None)
        self._backend.set_metadata(now_us(), self._marks.metadata)

    def _checkpoint_safe(self):
        """CUDA: non-reentrant activation checkpointing with early stop crashes torch's own memory history
        (SystemError in run_backward, then a segfault); without early stop it records fine and computes
        the same gradients. So early stop is off while we record, and put back after."""
        if self._backend.name != "cuda":
            return
        try:
            from torch.utils import checkpoint

            cm = checkpoint.set_checkpoint_early_stop(False)
            cm.__enter__()
            self._checkpoint = cm
        except Exception:
            self._checkpoint = None

    def _restore_checkpoint(self):
        cm, self._checkpoint = self._checkpoint, None
        if cm is not None:
            try:
                cm.__exit__(None, None, None)
            except Exception:
                pass

    def _tag_existing(self, t):
        """Tag (and remember, for the CPU's final segments) what the model and optimizer hold now."""
        names = self._param_names()
        named = []
        for prefix, model in self._roots():
            named += [(prefix + n, p) for n, p in model.named_parameters()]
            named += [(prefix + n, b) for n, b in model.named_buffers()]
            for n, p in model.named_parameters():
                self._tags.add(p, PARAMETER, prefix + n, t)
            for n, b in model.named_buffers():
                self._tags.add(b, BUFFER, prefix + n, t)
        for optimizer in self._live_optimizers():
            for n, p in optimizer_params(optimizer, names):
                named.append((n, p))
                named.append((n + ".grad", p.grad))
                self._tags.add(p.grad, GRADIENT, n + ".grad", t)
                for key, value in optimizer.state.get(p, {}).items():
                    if hasattr(value, "untyped_storage"):
                        named.append((f"{n}.{key}", value))
                        self._tags.add(value, OPTIMIZER_STATE, f"{n}.{key}", t)
        for n, p in self._named_parameters():
            named.append((n + ".grad", p.grad))
            self._tags.add(p.grad, GRADIENT, n + ".grad", t)
        self._preexisting = storages(named, self._backend.device_of)
        self._watch = None
        if self._backend.name == "cpu":
            self._backend.choose_source()
        if self._backend.name == "cpu" and not self._backend.exact_frees:
            # the profiler drops their frees: watch them (see preexisting.py)
            try:
                from .preexisting import PreexistingWatch

                self._watch = PreexistingWatch([t for _, t in named], self._backend.device_of)
            except Exception as e:
                warnings.warn(f"tracekit: cannot watch the tensors that exist before recording ({e!r}); "
                              "those freed while recording will look live", RuntimeWarning)
        del named

    def _metadata_changed(self, metadata):
        if self.recording:
            t = now_us()
            self._backend.set_metadata(t, metadata)
            if self._watch is not None:
                try:
                    self._watch.poll(t)
                except Exception:
                    self._watch = None

    def _finish(self, remove_hooks=False):
        if self._done or not self.enabled:
            return
        self._done = True
        if remove_hooks and self._hooks is not None:
            # Called from inside a hook: leave the saved-tensor hooks pushed (inert) until close().
            self._hooks.remove(pop_saved_hooks=False)
        if not self.recording:
            return
        self.recording = False
        with deferred():  # Ctrl-C / SIGTERM now would lose the file: they wait until it is written
            self._write()
        from .rank_summary import write_beside

        write_beside(self)  # one rank of several: its summary beside the file (record/rank_summary.py)
        if remove_hooks and self._term is not None:
            self._term.remove()

    def _write(self):
        end_us = now_us()
        try:
            self._marks.finish(end_us)
            self._backend.stop()
            preexisting = [(a, s, []) for a, s in self._preexisting]
            if self._watch is not None:
                watch, self._watch = self._watch, None
                try:
                    freed = watch.stop(end_us)
                except Exception as e:
                    warnings.warn(f"tracekit: pre-existing tensors freed while recording may look live ({e!r})",
                                  RuntimeWarning)
                    freed = {}
                snapshot = self._backend.snapshot(preexisting, freed=freed)
            else:
                snapshot = self._backend.snapshot(preexisting)
            snapshot["tracekit"] = self._tracekit_key(end_us)
            if not any(snapshot.get("device_traces") or []):
                why = "; ".join(sorted({g["reason"] for g in snapshot["tracekit"]["gaps"]})) or "no allocations"
                if self._backend.name == "cuda" and why == "no allocations":
                    why = ("the CUDA allocator saw no allocations; if this trains on the CPU, record with "
                           "--backend cpu or TRACEKIT_BACKEND=cpu")
                warnings.warn(f"tracekit: the recording in {self.path} holds no trace entries ({why})",
                              RuntimeWarning)
            try:
                from ..analysis.categories import write_categories

                write_categories(snapshot)
            except Exception as e:
                warnings.warn(f"tracekit: could not write categories into {self.path} ({e!r})", RuntimeWarning)
                for entries in snapshot.get("device_traces", []):
                    for entry in entries:
                        entry.pop("category", None)
            from ..io.write import write_snapshot

            self.written = write_snapshot(self.path, snapshot)
        except Exception as e:
            warnings.warn(f"tracekit: could not write {self.path} ({e!r})", RuntimeWarning)
        finally:
            self._backend.restore()

    def _tracekit_key(self, end_us):
        first = self._first_iteration
        last = first + self.steps - 1 if self.steps is not None else None

        def kept(it):
            return it >= first and (last is None or it <= last)

        def clamp(d):
            d = dict(d)
            d["start_us"] = max(d["start_us"], self._start_us)
            d["end_us"] = min(d["end_us"], end_us)
            return d

        import torch

        model_info = self._main_model_summary()
        optimizer_info = self._optimizers[0][1] if self._optimizers else None
        return {
            "version": FORMAT_VERSION,
            "backend": self._backend.name,
            "torch_version": str(torch.__version__),
            "python_version": sys.version.split()[0],
            "devices": self._backend.devices(),
            "model": model_info,
            "optimizer": optimizer_info,
            "phases": [clamp(p) for p in self._marks.phases if kept(p["iteration"])],
            "iterations": [clamp(i) for i in self._marks.iterations if kept(i["iteration"])],
            "tags": self._tags.items,
            "distributed": self._distributed(),
            "command": self.command,
            "exit_code": self.exit_code,
            "error": self.error,
            "partial": self.signal is not None,
            "signal": self.signal,
            "gaps": list(getattr(self._backend, "gaps", [])),
            "settings": {
                "backend": self._backend.name if self._backend is not None else self.backend_name, "stacks": self.stacks, "max_entries": self.max_entries,
                "activations": self.activations, "warmup": self.warmup, "steps": self.steps,
                "path": self.path, "pid": os.getpid(), "rank": rank(), "world_size": world_size(),
                "start_us": self._start_us, "end_us": end_us, "origins": bool(self.origins),
                **self._backend_settings(),
            },
        }

    def _distributed(self):
        """What a sharded or data-parallel job's rank holds (record/distributed.py); None outside one."""
        self._take_distributed()
        info = self._distributed_info
        if info is not None:
            info = dict(info)
            if self._fsdp_units:
                info["unsharded_units"] = [{"name": k, "bytes": int(v)} for k, v in self._fsdp_units.items()]
            if self._ddp_intervals:
                info["ddp_pre_forward_us"] = [[a, b] for a, b in self._ddp_intervals if b is not None]
        return info

    def _main_model_summary(self):
        """The summary of the biggest known model (taken when it was first seen, refreshed if it still lives)."""
        best = None
        for prefix, ref, info in self._models:
            m = ref()
            if m is not None:
                try:
                    info = summary.model_summary(m)
                except Exception:
                    pass
            if info is not None and (best is None or info["parameters"] > best["parameters"]):
                best = info
        if best is not None:
            best = dict(best, input_shape=self._input_shape)
        return best

    def _backend_settings(self):
        """What the backend chose: where CPU allocations came from (the hook, or the profiler and why),
        what CUDA's history gathered with each entry (None: nothing, the op log names it)."""
        b = self._backend
        if b.name == "cpu":
            out = {"cpu_source": b.source}
            if b.source_note:
                out["cpu_source_note"] = b.source_note
            return out
        return {"cuda_context": getattr(b, "context", None),
                "checkpoint_early_stop": False if self._checkpoint is not None else None}

    def _prefix_of(self, module):
        return next((prefix for prefix, ref, _ in self._models if ref() is module), "")

    def _named_parameters(self):
        """(qualified name, parameter) of the known models (memoised per iteration: several hooks ask)."""
        key = self._marks.iteration if self._marks is not None else None
        memo = self._named_memo
        if memo is None or memo[0] != key:  # weakly: a parameter dropped meanwhile is freed
            named = [(prefix + n, weakref.ref(p)) for prefix, model in self._roots() for n, p in model.named_parameters()]
            memo = self._named_memo = (key, named)
        return [(n, p) for n, p in ((n, r()) for n, r in memo[1]) if p is not None]

    def _param_names(self):
        """id(parameter) -> qualified name (memoised per iteration: every optimizer hook asks)."""
        key = self._marks.iteration if self._marks is not None else None
        memo = self._param_names_memo
        if memo is None or memo[0] != key:
            memo = self._param_names_memo = (key, param_names(self._roots()))
        return memo[1]

    def _disable(self, message, pop_saved_hooks=True):
        """Warn once and let the program run on untouched (from a hook: leave the saved-tensor hooks to close())."""
        warnings.warn(f"tracekit: {message}", RuntimeWarning, stacklevel=3)
        self.enabled = False
        self.recording = False
        for cleanup in (
            lambda: self._hooks.remove(pop_saved_hooks) if self._hooks is not None else None,
            lambda: self._backend.restore() if self._backend is not None else None,
            lambda: self._term.remove() if self._term is not None else None,
            self._restore_checkpoint,
            lambda: _active.discard(self),
        ):
            try:
                cleanup()
            except Exception:
                pass


_active: weakref.WeakSet = weakref.WeakSet()  # recorders running in this process (a nested one records nothing)


def resolve_backend(name, model=None):
    """"auto" made concrete: $TRACEKIT_BACKEND if set; else where the model's parameters are (CPU
    training on a GPU machine records the CPU); else CUDA when it is available."""
    if name != "auto":
        return name
    env = os.environ.get("TRACEKIT_BACKEND", "").strip().lower()
    if env in ("cpu", "cuda"):
        return env
    try:
        first = next(iter(model.parameters()), None) if model is not None else None
    except Exception:
        first = None
    if first is not None:
        return "cuda" if first.device.type == "cuda" else "cpu"
    return "auto"


def make_backend(name, stacks, max_entries, origins=True, roots=lambda: ()):
    """The backend for `name` ("auto" picks CUDA when it is available)."""
    import torch

    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("backend 'cuda' asked for, but CUDA is not available")
        from .cuda import CudaBackend

        return CudaBackend(stacks=stacks, max_entries=max_entries, origins=origins, roots=roots)
    from .cpu import CpuBackend

    return CpuBackend(stacks=stacks, max_entries=max_entries, origins=origins, roots=roots)


def rank():
    """This process's distributed rank from the environment (torchrun), or None."""
    for var in ("RANK", "LOCAL_RANK"):
        value = os.environ.get(var)
        if value is not None and value.strip().lstrip("-").isdigit():
            return int(value)
    return None


def world_size():
    """The number of processes of a torchrun job (WORLD_SIZE), or None."""
    value = os.environ.get("WORLD_SIZE", "").strip()
    return int(value) if value.isdigit() else None


def expand_path(path) -> str:
    """Fill {rank} and {pid}; under a multi-process launch without {rank}, add .rankN before the suffix."""
    path = os.fspath(path)
    r = rank()
    world = os.environ.get("WORLD_SIZE", "")
    if r is not None and "{rank}" not in path and world.isdigit() and int(world) > 1:
        root, ext = _split_ext(path)
        path = f"{root}.rank{{rank}}{ext}"
    return path.replace("{rank}", str(r if r is not None else 0)).replace("{pid}", str(os.getpid()))


def _split_ext(path):
    for ext in (".pickle.gz", ".pkl.gz", ".json.gz"):
        if path.endswith(ext):
            return path[: -len(ext)], ext
    return os.path.splitext(path)


def _has_parameters(module):
    return next(iter(module.parameters()), None) is not None
