"""The hooks that tell the recorder where a training loop is.

- forward: a forward pre-hook on the model (or, with no model, global module
  hooks that find the outermost module call);
- backward: ``torch.autograd.backward`` and ``torch.autograd.grad`` wrapped
  (``Tensor.backward`` calls the former);
- optimizer: step pre/post hooks on the optimizer (or global ones);
- activations: ``saved_tensors_hooks`` whose pack hook sees every tensor saved
  for backward and returns it detached (same storage, same values; PyTorch
  asks for ``detach()`` so that the saved tensor holds no reference cycle).

Every hook calls a `listener` method and nothing else, never raises into the
training code, and only listens on the thread that installed it.
"""
from __future__ import annotations

import functools
import threading
import warnings


class Hooks:
    def __init__(self, listener, model=None, optimizer=None, activations=True):
        self.listener = listener
        self.model = model
        self.optimizer = optimizer
        self.activations = activations
        self.active = False
        self._handles = []
        self._patched = []  # (module, attribute, original, wrapper)
        self._saved_hooks = None
        self._depth = 0  # outermost-module tracking for global hooks
        self._thread = None
        self._warned = False

    # -- install / remove --------------------------------------------------
    def install(self):
        import torch
        import torch.autograd
        import torch.optim.optimizer as optim
        from torch.nn.modules import module as nn_module

        self._thread = threading.get_ident()
        if self.model is not None:
            self._handles.append(self.model.register_forward_pre_hook(self._model_pre, with_kwargs=True))
        else:
            self._handles.append(nn_module.register_module_forward_pre_hook(self._global_pre))
            self._handles.append(
                nn_module.register_module_forward_hook(self._global_post, with_kwargs=True, always_call=True)
            )
        if self.optimizer is not None:
            self._handles.append(self.optimizer.register_step_pre_hook(self._optimizer_pre))
            self._handles.append(self.optimizer.register_step_post_hook(self._optimizer_post))
        else:
            self._handles.append(optim.register_optimizer_step_pre_hook(self._optimizer_pre))
            self._handles.append(optim.register_optimizer_step_post_hook(self._optimizer_post))
        for name in ("backward", "grad"):
            self._patch(torch.autograd, name, self._wrap_backward(getattr(torch.autograd, name)))
        if self.activations:
            self._saved_hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, _unpack)
            self._saved_hooks.__enter__()
        self.active = True

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
        if self._saved_hooks is not None:
            hooks, self._saved_hooks = self._saved_hooks, None
            hooks.__exit__(None, None, None)

    # -- hooks -------------------------------------------------------------
    def _listening(self):
        return self.active and threading.get_ident() == self._thread

    def _call(self, method, *args):
        try:
            getattr(self.listener, method)(*args)
        except Exception as e:  # the recorder never breaks training
            if not self._warned:
                self._warned = True
                warnings.warn(f"tracekit: a recorder hook failed ({e!r}); recording goes on", RuntimeWarning)

    def _model_pre(self, module, args, kwargs):
        if self._listening():
            self._call("forward_started", module, args, kwargs)

    def _global_pre(self, module, args):
        if not self._listening():
            return
        self._depth += 1
        if self._depth == 1:
            self._call("forward_started", module, args, None)

    def _global_post(self, module, args, kwargs, output):
        if not self._listening():
            return
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
        if self._listening():
            self._call("saved_tensor", tensor)
        return tensor.detach()

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


def _unpack(tensor):
    return tensor
