"""The hooks that tell the recorder where a training loop is.

- forward: a forward pre-hook on the model (or, with no model, global module
  hooks that find the outermost module call);
- backward: ``torch.autograd.backward`` and ``torch.autograd.grad`` wrapped
  (``Tensor.backward`` calls the former);
- optimizer: step pre/post hooks on the optimizer (or global ones);
- activations: ``saved_tensors_hooks`` whose pack hook sees every tensor saved
  for backward (see `pack`: autograd's in-place check is kept). Features that
  refuse saved-tensor hooks (torch.func grad/vjp/jacrev/hessian) enter
  ``torch.autograd.graph.disable_saved_tensors_hooks``; while they run, our
  hooks step off the stack (one warning), so they run as without us.

Every hook calls a `listener` method and nothing else, never raises into the
training code, and only listens on the thread that installed it.
"""
from __future__ import annotations

import contextlib
import functools
import re
import threading
import warnings


class Hooks:
    def __init__(self, listener, model=None, optimizer=None, activations=True):
        self.listener = listener
        self.has_model = model is not None
        self.has_optimizer = optimizer is not None
        self.activations = activations
        self.guard = None  # the op log (oplog.py): torch calls made by our listener are not the user's
        self.active = False
        self._handles = []
        self._patched = []  # (module, attribute, original, wrapper)
        self._saved_hooks = None
        self._disable_patch = None  # (torch.autograd.graph, original, wrapper)
        self._warned_disabled = False
        self._depth = 0  # outermost-module tracking for global hooks
        self._thread = None
        self._warned = False
        self._fsdp_patched = False
        self._ddp_patched = False

    def patch_fsdp(self):
        """Once FSDP2 is imported (the model is wrapped before its first forward): tell the listener each time a
        unit's parameters have been all-gathered (`FSDPParamGroup.wait_for_unshard` returned), so that it can tag
        them. The wrapper calls the original first and never changes what it returns."""
        if self._fsdp_patched or not self.active:
            return
        import sys

        self._patch_fsdp1(sys.modules.get("torch.distributed.fsdp._flat_param"))
        mod = sys.modules.get("torch.distributed.fsdp._fully_shard._fsdp_param_group")
        if mod is None:
            return
        self._fsdp_patched = True
        cls = getattr(mod, "FSDPParamGroup", None)
        original = getattr(cls, "wait_for_unshard", None)
        if original is None:
            return
        hooks = self

        @functools.wraps(original)
        def wait_for_unshard(group, *args, **kwargs):
            out = original(group, *args, **kwargs)
            # any thread: on CUDA, backward (and FSDP's unshard for it) runs on autograd's device thread
            if hooks.active and hooks.listener is not None and not _compiling():
                hooks._call("fsdp_unsharded", group)
            return out

        self._patch(cls, "wait_for_unshard", wait_for_unshard)
        original_pb = getattr(cls, "post_backward", None)
        if original_pb is not None:
            @functools.wraps(original_pb)
            def post_backward(group, *args, **kwargs):
                # before the original: the unit's full gradients, which it reduce-scatters and frees
                if hooks.active and hooks.listener is not None and not _compiling():
                    hooks._call("fsdp_post_backward", group)
                return original_pb(group, *args, **kwargs)

            self._patch(cls, "post_backward", post_backward)

    def _patch_fsdp1(self, mod):
        """FSDP1 (FullyShardedDataParallel): tell the listener after `FlatParamHandle.unshard` returned."""
        if getattr(self, "_fsdp1_patched", False) or mod is None:
            return
        cls = getattr(mod, "FlatParamHandle", None)
        original = getattr(cls, "unshard", None)
        if original is None:
            return
        self._fsdp1_patched = True
        hooks = self

        @functools.wraps(original)
        def unshard(handle, *args, **kwargs):
            out = original(handle, *args, **kwargs)
            if hooks.active and hooks.listener is not None and not _compiling():
                hooks._call("fsdp1_unsharded", handle)
            return out

        self._patch(cls, "unshard", unshard)

    def patch_ddp(self):
        """Once DDP is imported: tell the listener when `DistributedDataParallel._pre_forward` starts and ends (it
        rebuilds the gradient buckets there, in C++, where no Python stack names them)."""
        if self._ddp_patched or not self.active:
            return
        import sys

        mod = sys.modules.get("torch.nn.parallel.distributed")
        cls = getattr(mod, "DistributedDataParallel", None) if mod is not None else None
        original = getattr(cls, "_pre_forward", None)
        if original is None:
            return
        self._ddp_patched = True
        hooks = self

        @functools.wraps(original)
        def _pre_forward(ddp, *args, **kwargs):
            listening = hooks._listening()
            if listening:
                hooks._call("ddp_pre_forward", True)
            try:
                return original(ddp, *args, **kwargs)
            finally:
                if listening:
                    hooks._call("ddp_pre_forward", False)

        self._patch(cls, "_pre_forward", _pre_forward)

    # -- install / remove --------------------------------------------------
    def install(self, model=None, optimizer=None):
        """Install every hook; `model`, `optimizer`: the ones given to the recorder (not kept here)."""
        import torch
        import torch.autograd
        import torch.optim.optimizer as optim
        from torch.nn.modules import module as nn_module

        global _compiling
        _compiling = getattr(getattr(torch, "compiler", None), "is_compiling", _never)
        _node_names_keep_suffix()  # asked now, outside any backward
        self._thread = threading.get_ident()
        if model is not None:
            self._handles.append(model.register_forward_pre_hook(self._model_pre, with_kwargs=True))
        else:
            self._handles.append(nn_module.register_module_forward_pre_hook(self._global_pre))
            self._handles.append(
                nn_module.register_module_forward_hook(self._global_post, with_kwargs=True, always_call=True)
            )
        if optimizer is not None:
            self._handles.append(optimizer.register_step_pre_hook(self._optimizer_pre))
            self._handles.append(optimizer.register_step_post_hook(self._optimizer_post))
        else:
            self._handles.append(optim.register_optimizer_step_pre_hook(self._optimizer_pre))
            self._handles.append(optim.register_optimizer_step_post_hook(self._optimizer_post))
        for name in ("backward", "grad"):
            self._patch(torch.autograd, name, self._wrap_backward(getattr(torch.autograd, name)))
        if self.activations and torch._C._autograd._top_saved_tensors_default_hooks(True) is not None:
            # Pushing ours would hide the user's (save_on_cpu, their own offload...) until we pop.
            warnings.warn("tracekit: saved-tensor hooks of your own are active; tensors saved for backward "
                          "are not tagged as activations", RuntimeWarning, stacklevel=4)
        elif self.activations:
            self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
            self._saved_hooks.__enter__()
            graph = torch.autograd.graph
            original = graph.disable_saved_tensors_hooks
            self._disable_patch = (graph, original, self._wrap_disable(original))
            graph.disable_saved_tensors_hooks = self._disable_patch[2]
        self.active = True
        self.patch_fsdp()  # a model wrapped before recording starts: FSDP / DDP are imported already
        self.patch_ddp()

    def remove(self, pop_saved_hooks=True):
        """Detach every hook. The saved-tensor hooks are a per-thread stack that
        must be popped in order: with pop_saved_hooks=False they stay pushed but
        pass tensors through untouched until `pop_saved_hooks()` is called."""
        self.active = False
        for h in self._handles:
            h.remove()
        self._handles.clear()
        for module, attr, original, wrapper in self._patched:
            if getattr(module, attr, None) is wrapper:
                setattr(module, attr, original)
        self._patched.clear()
        if pop_saved_hooks:
            self.pop_saved_hooks()

    def pop_saved_hooks(self):
        if self._disable_patch is not None:
            (graph, original, wrapper), self._disable_patch = self._disable_patch, None
            if graph.disable_saved_tensors_hooks is wrapper:
                graph.disable_saved_tensors_hooks = original
        if self._saved_hooks is not None:
            hooks, self._saved_hooks = self._saved_hooks, None
            hooks.__exit__(None, None, None)

    def _wrap_disable(self, original):
        """`disable_saved_tensors_hooks` that first takes our hooks off the stack when they are on top."""
        hooks = self

        @contextlib.contextmanager
        def wrapper(error_message):
            import torch

            autograd = torch._C._autograd
            ours = hooks._saved_hooks
            top = autograd._top_saved_tensors_default_hooks(True)
            popped = ours is not None and top is not None and top[0] is ours.pack_hook
            if popped:
                if not hooks._warned_disabled:
                    hooks._warned_disabled = True
                    warnings.warn("tracekit: torch.func transforms do not support saved-tensor hooks; tensors "
                                  "they save for backward are not tagged as activations", RuntimeWarning,
                                  stacklevel=3)
                autograd._pop_saved_tensors_default_hooks()
            try:
                with original(error_message):
                    yield
            finally:
                if popped:
                    autograd._push_saved_tensors_default_hooks(ours.pack_hook, ours.unpack_hook)

        return wrapper

    # -- hooks -------------------------------------------------------------
    def _listening(self):
        # torch.compile traces module hooks into the graph: there, we are not (pruned, no graph break).
        return self.active and not _compiling() and threading.get_ident() == self._thread

    def _call(self, method, *args):
        listener, guard = self.listener, self.guard
        if listener is None:
            return
        if guard is not None:
            guard.busy += 1
        try:
            # the listener only reads tensors (addresses, sizes, names): no torch function dispatch for
            # those reads (the op log's mode would make each one a Python call)
            with _no_torch_function():
                getattr(listener, method)(*args)
        except Exception as e:  # the recorder never breaks training
            if not self._warned:
                self._warned = True
                warnings.warn(f"tracekit: a recorder hook failed ({e!r}); recording goes on", RuntimeWarning)
        finally:
            if guard is not None:
                guard.busy -= 1

    def _model_pre(self, module, args, kwargs):
        if self._listening():
            self.patch_fsdp()
            self.patch_ddp()
            self._call("forward_started", module, args, kwargs)

    def _global_pre(self, module, args):
        if not self._listening():
            return
        self._depth += 1
        if self._depth == 1:
            self.patch_fsdp()
            self.patch_ddp()
            self._call("forward_started", module, args, None)

    def _global_post(self, module, args, *rest):
        # (kwargs, output); torch passes (output) alone to an always-call hook when forward raised
        if not self._listening():
            return
        kwargs = rest[0] if len(rest) == 2 else None
        self._depth = max(0, self._depth - 1)
        if self._depth == 0 and kwargs:
            self._call("forward_kwargs", module, kwargs)

    def _optimizer_pre(self, optimizer, args, kwargs):
        if self._listening():
            self._call("optimizer_started", optimizer)

    def _optimizer_post(self, optimizer, args, kwargs):
        if self._listening():
            self._call("optimizer_ended", optimizer)

    def _pack(self, tensor):
        fn = tensor.grad_fn
        listener = self.listener
        if listener is not None and self._listening():
            try:  # the hot path of _call, for every saved tensor: no context manager, no lookup by name
                listener.saved_tensor(tensor, fn)
            except Exception as e:
                if not self._warned:
                    self._warned = True
                    warnings.warn(f"tracekit: a recorder hook failed ({e!r}); recording goes on", RuntimeWarning)
        return pack(tensor, fn)

    def _wrap_backward(self, original):
        hooks = self

        @functools.wraps(original)
        def wrapper(*args, **kwargs):
            if not hooks._listening():
                return original(*args, **kwargs)
            hooks._call("backward_started")
            try:
                return original(*args, **kwargs)
            finally:
                hooks._call("backward_ended")

        return wrapper

    def _patch(self, module, attr, wrapper):
        original = getattr(module, attr)
        setattr(module, attr, wrapper)
        self._patched.append((module, attr, original, wrapper))


def _never():
    return False


def _no_torch_function():
    import torch

    return torch._C.DisableTorchFunction()


_compiling = _never  # torch.compiler.is_compiling, once install() has found it


def pack(tensor, fn=False):
    """What our pack hook saves: the tensor detached, and its version now.

    Autograd checks a saved tensor's version counter at backward only when no
    saved-tensor hooks are set ("Only check version counter in the case
    without hooks", saved_variable.cpp). `detach()` shares the storage and the
    version counter (PyTorch asks for it: the saved tensor then holds no
    reference cycle), so `_unpack` can make the same check autograd would.
    """
    try:
        version = tensor._version
    except Exception:  # inference tensors have no version counter
        version = None
    if fn is False:
        fn = tensor.grad_fn
    return _Saved(tensor.detach(), version, fn, tensor.output_nr)


class _Saved:
    __slots__ = ("tensor", "version", "fn_type", "output_nr")

    def __init__(self, detached, version, fn, output_nr):
        self.tensor = detached
        self.version = version
        self.fn_type = type(fn) if fn is not None else None  # its class only: the node would make a cycle
        self.output_nr = output_nr

    @property
    def fn(self):
        return self.fn_type.__name__ if self.fn_type is not None else None


def _unpack(saved):
    tensor = saved.tensor
    if saved.version is None:
        return tensor
    with _no_torch_function():  # a plain read: not a call of the user's for the op log to see
        version = tensor._version
    if version != saved.version:
        raise RuntimeError(inplace_message(saved, tensor._version))
    return tensor


def inplace_message(saved, version):
    """Autograd's own words for a saved tensor modified in place (torch/csrc/autograd/saved_variable.cpp)."""
    t = saved.tensor
    what = f"[{t.type()} {list(t.shape)}]"
    if saved.fn is not None:
        fn = saved.fn if _node_names_keep_suffix() else re.sub(r"Backward[0-9]*$", "", saved.fn)
        what += f", which is output {saved.output_nr} of {fn},"
    return (
        "one of the variables needed for gradient computation has been modified by an inplace operation: "
        f"{what} is at version {version}; expected version {saved.version} instead. Hint: enable anomaly "
        "detection to find the operation that failed to compute its gradient, with "
        "torch.autograd.set_detect_anomaly(True, check_nan=False)."
    )


@functools.cache
def _node_names_keep_suffix() -> bool:
    """Whether this torch names the node "SigmoidBackward0" (2.11) or "Sigmoid" (2.13) in that message:
    asked of autograd itself, once, at install, with saved-tensor hooks off so that it makes its own check."""
    import torch

    try:
        with torch.autograd.graph.disable_saved_tensors_hooks("tracekit: probing autograd's message"):
            a = torch.ones(1, requires_grad=True)
            b = a.sigmoid()
            b.add_(1)
            b.sum().backward()
    except RuntimeError as e:
        return "SigmoidBackward" in str(e)
    except Exception:
        pass
    return False
