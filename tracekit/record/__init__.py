"""The recorder: `record(...)` (a context manager) and `record_steps(...)`.

`tracekit.record` is both this package and the function: the package is a
callable module, so `tracekit.record("step.pickle", model=m)` works however
it was reached. Importing this package does not import torch.
"""
from __future__ import annotations

import sys
import types
from typing import Any, Callable

from .recorder import DEFAULT_MAX_ENTRIES, DEFAULT_PATH, Recorder

__all__ = ["record", "record_steps", "Recorder"]


def record(path: str = DEFAULT_PATH, model: Any = None, optimizer: Any = None, *, backend: str = "auto",
           stacks: str = "python", max_entries: int = DEFAULT_MAX_ENTRIES, activations: bool = True,
           origins: bool = True) -> Recorder:
    """Record memory while the `with` block runs and write it to `path`.

    path: output file; "{rank}" and "{pid}" are filled in. model, optimizer:
    optional; when given, the file also tags their tensors (parameters,
    buffers, gradients, optimizer state) and holds the ones that existed
    before recording. backend: "auto" (CUDA if available, else CPU), "cuda"
    or "cpu". stacks: "python" or "all". max_entries: trace entries kept (the
    newest). activations: tag tensors saved for backward. origins: name each
    backward allocation by its forward line and every allocation by its module
    (False, or TRACEKIT_ORIGINS=0, turns it off).

        with tracekit.record("step.pickle", model=model, optimizer=opt) as rec:
            for batch in loader:
                ...
                rec.step()  # optional iteration boundary
    """
    return Recorder(path, model, optimizer, backend=backend, stacks=stacks,
                    max_entries=max_entries, activations=activations, origins=origins)


def record_steps(step_fn: Callable[[], Any], steps: int = 3, warmup: int = 1, path: str = DEFAULT_PATH,
                 model: Any = None, optimizer: Any = None, **options: Any) -> str | None:
    """Run `step_fn()` warmup + steps times, recording the last `steps` of them.

    Warm-up steps run first, unrecorded (lazy optimizer state and allocator
    caches settle); iterations in the file are numbered from `warmup`.
    Returns the path written (None if nothing could be written).
    """
    if steps < 1 or warmup < 0:
        raise ValueError("record_steps needs steps >= 1 and warmup >= 0")
    rec = Recorder(path, model, optimizer, warmup=warmup, steps=steps, **options)
    with rec:
        for _ in range(warmup + steps):
            step_fn()
            rec.step()
    return rec.written


class _CallableModule(types.ModuleType):
    def __call__(self, *args, **kwargs):
        return record(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
