"""Where each allocation comes from: every torch call made from Python, logged as it runs.

`OpLog` is a ``TorchFunctionMode`` pushed on the recording thread: every call of a torch function or
tensor method from Python (``torch.ones(n)``, ``x.softmax(-1)``, ``q @ k``, ``F.linear``...) passes
through it once (the mode is off while the call runs, so the calls a torch function makes inside are
not logged again). For each call it keeps one row:

- the allocation source's event index before and after (`mark`), or the time: the allocations made
  in between are the call's, exactly (cpu.py, cuda.py);
- the Python stack at the call, with each frame's executing line (stacks.py);
- the module running (global forward hooks keep a stack of running modules and their names);
- the autograd sequence numbers before and after: the nodes the call made, so that an allocation made
  when backward runs one of them is named by this call's line and module (origins.py).

Cheap by construction: a stack is walked only up to the frame of the innermost running module's call
(`_call_impl`), whose own stack was interned when the module began (every frame above it is suspended
at the same instruction until the module returns); property reads and writes (``x.shape``, ``p.grad =
None``) are not logged. ``backward`` / ``autograd.grad`` calls are logged, and the mode stays on inside
them, so hooks and recomputation run by backward (activation checkpointing) are logged too.

Numerics: every call runs exactly as without the mode. Inside code that ``torch.compile`` traces the
handler only calls through (no graph break); on other threads, in a forked child, and while the
recorder's own hooks run it does nothing.
"""
from __future__ import annotations

import os
import sys
import threading
import time
import types
import weakref

import torch
from torch.overrides import TorchFunctionMode

from .stacks import StackTable

_MODULE_FILE = os.path.join("torch", "nn", "modules", "module.py")
_METHOD_WRAPPER = types.MethodWrapperType  # Tensor property __get__ / __set__: never allocate
_forked = [False]
_get_seq = torch._C._autograd._get_sequence_nr


def _after_fork():
    _forked[0] = True


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork)


def _never():
    return False


def compiling_probe():
    return getattr(getattr(torch, "compiler", None), "is_compiling", None) or _never


def _special_funcs():
    """{func: 1} for calls that neither allocate nor make autograd nodes (not logged), {func: 2} for the
    calls inside which the autograd engine runs Python (hooks, recomputation): logged, mode kept on."""
    T = torch.Tensor
    out = {}
    for name in ("item", "dim", "size", "numel", "is_contiguous", "data_ptr", "element_size", "stride",
                 "storage_offset", "is_complex", "is_floating_point", "tolist", "__len__", "__bool__",
                 "nelement", "ndimension", "get_device", "is_shared", "is_pinned", "__hash__", "__format__",
                 "__repr__", "__iter__", "is_set_to", "has_names", "_is_view"):
        f = getattr(T, name, None)
        if f is not None:
            out[f] = 1
    for f in (getattr(torch, "is_complex", None), getattr(torch, "is_floating_point", None),
              getattr(torch, "is_tensor", None), getattr(torch, "numel", None),
              getattr(torch._C, "_set_grad_enabled", None), getattr(torch, "is_grad_enabled", None)):
        if f is not None:
            out[f] = 1
    import inspect

    for f in (T.backward, torch.autograd.backward, torch.autograd.grad):
        out[f] = 2
        out[inspect.unwrap(f)] = 2  # torch.autograd.backward may be wrapped (hooks.py): its own name inside
    return out


def _core_state(name: str, doc: str) -> property:
    """A property of the log that lives on the compiled Core when there is one, else on the log itself."""
    private = "_" + {"on": "on", "busy": "busy", "calls": "calls", "container": "cont"}[name]

    def get(self):
        return getattr(self._core, name) if self._core is not None else getattr(self, private)

    def put(self, value):
        if self._core is not None:
            setattr(self._core, name, value)
        else:
            setattr(self, private, value)
    return property(get, put, doc=doc)


class OpLog(TorchFunctionMode):
    """Rows ``(k0, k1, t0, t1, stack, module, s0, s1, parent, op)`` of torch calls (see the module doc).

    mark(): the allocation source's event counter (0 when it has none: times are used instead).
    roots(): [(prefix, module)] of the models whose qualified names name the modules.
    metadata: a `CallMetadata` (CUDA): each call's id stamped on the allocator's entries.
    """

    def __init__(self, stacks: StackTable | None = None, mark=None, roots=lambda: (), modules=True,
                 op_names=False, metadata=None, coarse_optimizer=None):
        super().__init__()
        self.stacks = stacks or StackTable()
        self._ids = self.stacks._ids  # its intern table, read directly on the hot path
        self.mark = mark or (lambda: 0)
        self.roots = roots
        self.track_modules = modules
        self.op_names = op_names
        self.metadata = metadata
        self._core = None  # _cpuhook.Core: the hot path in C (else the Python one below)
        self.rows: list = []
        self.limit = 1 << 62  # rows that make it call on_full() (the backend drains at its next safe point)
        self.on_full = None
        self._on = False
        self._busy = 0  # > 0 while the recorder's own code runs: its calls are not the user's
        self.pushed = False
        self._calls = 0  # call ids (for rows' parent and the allocator's metadata)
        self._cont = -1  # id of the backward call running, if any
        self._thread = None
        self._compiling = _never
        self._special: dict = {}
        self.op_names_table: dict = {}  # op name -> id (op_names=True)
        # modules: the running ones, innermost last: (path id, anchor frame, id of the stack above it, id(module))
        self.paths = {"": 0}
        self.path_names = [""]
        self._mods = [(0, None, 0, 0)]
        self._names: dict = {}  # id(module) -> (weakref to it, qualified name); a dead module's id is never trusted
        # optimizer.step() logged as one span: the mode is off while it runs (its many small ops at full
        # speed), its allocations named by the step's call (`coarse_optimizer`; full detail logs each op)
        self.coarse_optimizer = (not op_names) if coarse_optimizer is None else coarse_optimizer
        self._span = None
        self._named: weakref.WeakSet = weakref.WeakSet()  # roots already named
        self._handles: list = []

    # -- state, in the core when there is one -------------------------------

    on = _core_state("on", "logging now")
    busy = _core_state("busy", "> 0 while the recorder's own code runs")
    calls = _core_state("calls", "call ids given so far")
    _container = _core_state("container", "id of the backward call running, or -1")

    @property
    def container(self):
        return self._container

    def pending_rows(self) -> int:
        return self._core.rows() + len(self.rows) if self._core is not None else len(self.rows)

    # -- install / remove --------------------------------------------------
    def install(self, timed=True, fast=True):
        """timed: stamp each call with its start and end time (when allocations are joined by time).
        fast: use the compiled hot path when it is built (_cpuhook.Core)."""
        self._thread = threading.get_ident()
        self._compiling = compiling_probe()
        self._special = _special_funcs()
        self._timed = timed
        if fast and not self.op_names_needs_python():
            self._core = _make_core(self, timed)
        if self.track_modules:
            from torch.nn.modules import module as nn_module

            self._handles = [nn_module.register_module_forward_pre_hook(self._pre),
                             nn_module.register_module_forward_hook(self._post, always_call=True)]
        if self.coarse_optimizer:
            import torch.optim.optimizer as optim

            self._handles += [optim.register_optimizer_step_pre_hook(self._opt_pre),
                              optim.register_optimizer_step_post_hook(self._opt_post)]
        self._patch_engine()
        self.__enter__()
        self.pushed = True
        self.on = True

    def _patch_engine(self):
        """While autograd's engine runs Python (hooks, checkpoint recomputation) inside a logged backward
        call, the mode is off (a mode is off inside its own handler): put it back on for the engine's run."""
        import torch.autograd as autograd

        original = getattr(autograd, "_engine_run_backward", None)
        if original is None or not callable(original):
            return
        log = self

        def run(*args, **kwargs):
            if log._on_stack():
                return original(*args, **kwargs)
            with log:
                return original(*args, **kwargs)

        def _engine_run_backward(*args, **kwargs):
            if not log.on or _forked[0] or threading.get_ident() != log._thread:
                return original(*args, **kwargs)
            if log._container < 0:  # not inside a logged backward call (an older torch): log one here
                return log._logged(run, args, kwargs, sys._getframe(1), container=True)
            return run(*args, **kwargs)

        self._engine = (autograd, original, _engine_run_backward)
        autograd._engine_run_backward = _engine_run_backward

    def _unpatch_engine(self):
        engine, self._engine = getattr(self, "_engine", None), None
        if engine is not None:
            module, original, wrapper = engine
            if getattr(module, "_engine_run_backward", None) is wrapper:
                module._engine_run_backward = original

    def _on_stack(self):
        from torch.overrides import _get_current_function_mode_stack

        return any(m is self for m in _get_current_function_mode_stack())

    def remove(self):
        """Stop logging and take the mode off the stack (only if it is on top: never someone else's)."""
        if self._span is not None:
            self._span[7] = False  # not pushed back: we are leaving
            self.end_span()
        self.on = False
        for h in self._handles:
            h.remove()
        self._handles = []
        self._unpatch_engine()
        self._mods[:] = [(0, None, 0, 0)]  # in place: the core holds this list
        if self.pushed and threading.get_ident() == self._thread:
            from torch.overrides import _get_current_function_mode_stack

            stack = _get_current_function_mode_stack()
            if stack and stack[-1] is self:
                self.__exit__(None, None, None)
                self.pushed = False
            # else: a mode of the user's was pushed above ours and is still on: ours stays below it, inert

    def take_rows(self):
        """The rows logged since the last take: a list of tuples, or (with the core) an int64 array n x 12."""
        rows, self.rows = self.rows, []
        if self._core is None:
            return rows
        import numpy as np

        a = np.frombuffer(self._core.take(), dtype=np.int64).reshape(-1, 12).copy()
        if rows:
            a = np.concatenate([a, np.array(rows, dtype=np.int64).reshape(-1, 12)])
        return a

    def release(self):
        """Drop every table (code objects included) once the recording is written."""
        self.rows = []
        core, self._core = self._core, None
        if core is not None:
            core.take()
            self._on, self._busy, self._calls, self._cont = 0, 0, core.calls, -1
        self.stacks.clear()
        self._names = {}
        self._special = {}

    def op_names_needs_python(self) -> bool:
        return False

    def op_name(self, op: int) -> str:
        """The name of the torch call `op` (stacks="all")."""
        if self._core is not None:
            funcs = self._core.op_funcs
            func = funcs[op] if 0 <= op < len(funcs) else None
            return _func_name(func) if func is not None else "?"
        names = {v: k for k, v in self.op_names_table.items()}
        return names.get(op, "?")

    # -- the mode ----------------------------------------------------------
    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        if type(func) is _METHOD_WRAPPER:  # a property read or write (x.shape, p.grad = None)
            return func(*args, **kwargs)
        # torch.compile traces this handler: is_compiling() is first, so that it traces nothing else (no graph break)
        if self._compiling():
            return func(*args, **kwargs)
        core = self._core
        if core is not None:
            return core.call(func, args, kwargs)
        kind = self._special.get(func, 0)
        if kind == 1 or not self.on or self.busy or _forked[0] or threading.get_ident() != self._thread:
            return func(*args, **kwargs)
        if kind == 2 or self.metadata is not None or self._timed or self.op_names:
            return self._logged(func, args, kwargs, sys._getframe(1), kind == 2)
        # the common path, inlined: no times, no metadata
        mark = self.mark
        cid = self.calls
        self.calls = cid + 1
        # the stack: frames up to the innermost running module's call (see _stack)
        f = sys._getframe(1)
        _, anchor, above, _ = self._mods[-1]
        parts = []
        app = parts.append
        while f is not None:
            app(f.f_code)
            app(f.f_lasti)
            if f is anchor:
                app(above)
                break
            f = f.f_back
        else:
            app(0)
        parts = tuple(parts)
        stack = self._ids.get(parts)
        if stack is None:
            stack = self.stacks.key(parts)
        module = self._mods[-1][0]
        s0 = _get_seq()
        k0 = mark()
        try:
            return func(*args, **kwargs)
        finally:
            rows = self.rows
            rows.append((k0, mark(), 0, 0, stack, module, s0, _get_seq(), self._container, cid, -1, False))
            if len(rows) >= self.limit:
                self._full()

    def _logged(self, func, args, kwargs, frame, container=False):
        """Run func(*args, **kwargs), logging one row for it (container: the engine runs inside it)."""
        mark = self.mark
        get_seq = _get_seq
        cid = self.calls
        self.calls = cid + 1
        stack = self._stack(frame)
        module = self._mods[-1][0]
        parent = self._container
        md = self.metadata
        if md is not None:
            md.enter(cid)
        s0 = get_seq()
        t0 = time.time_ns()
        k0 = mark()
        try:
            if container:
                self._container = cid  # the engine's Python (hooks, recomputation) is logged inside it
            return func(*args, **kwargs)
        finally:
            k1 = mark()
            t1 = time.time_ns()
            if container:
                self._container = parent
            if md is not None:
                md.exit(parent)
            op = self._op_id(func) if self.op_names else -1
            row = (k0, k1, t0, t1, stack, module, s0, get_seq(), parent, cid, op, int(container))
            if self._core is not None:
                self._core.append(row)
            else:
                self.rows.append(row)
            if self.pending_rows() >= self.limit:
                self._full()

    def _full(self):
        if self.on_full is not None:
            self.busy += 1
            try:
                self.on_full()
            except Exception:
                pass
            finally:
                self.busy -= 1

    def _stack(self, f):
        """The interned stack of frame `f` (innermost) outwards."""
        if self._core is not None and f is not None:
            return self._core.stack_of(f)
        _, anchor, above, _ = self._mods[-1]
        parts = []
        parent = 0
        while f is not None:
            parts.append(f.f_code)
            parts.append(f.f_lasti)
            if f is anchor:
                parent = above
                break
            f = f.f_back
        parts.append(parent)
        return self.stacks.key(tuple(parts))

    def _op_id(self, func):
        name = _func_name(func)
        k = self.op_names_table.get(name)
        if k is None:
            k = self.op_names_table[name] = len(self.op_names_table)
        return k

    # -- optimizer steps as one span -----------------------------------------
    def _opt_pre(self, optimizer, args, kwargs):
        if self._compiling() or not self.on or _forked[0] or threading.get_ident() != self._thread:
            return
        if self._span is not None or self.busy:
            return
        try:
            frame = sys._getframe(1)  # torch's step wrapper: it calls the step itself
            cid = self.calls
            self.calls = cid + 1
            stack = self._stack(frame)
            t0, k0, s0 = time.time_ns(), self.mark(), _get_seq()
            popped = self._top_is_self()
            if popped:
                self.__exit__(None, None, None)  # the step's own ops run without the mode
            self._span = [cid, k0, t0, s0, stack, self._mods[-1][0], self._container, popped]
            md = self.metadata
            if md is not None:
                md.enter(cid)
        except Exception:
            pass

    def _opt_post(self, optimizer, args, kwargs):
        if self._compiling() or _forked[0] or threading.get_ident() != self._thread:
            return
        self.end_span()

    def end_span(self):
        """Close the optimizer step's span (its post-hook; or at stop, when the step raised)."""
        span, self._span = self._span, None
        if span is None:
            return
        cid, k0, t0, s0, stack, module, parent, popped = span
        row = (k0, self.mark(), t0, time.time_ns(), stack, module, s0, _get_seq(), parent, cid, -1, 2)
        if self._core is not None:
            self._core.append(row)
        else:
            self.rows.append(row)
        if self.metadata is not None:
            self.metadata.exit(parent)
        if popped and self.on and not self._on_stack():
            self.__enter__()

    def resume(self):
        """A forward or backward inside optimizer.step (a closure: LBFGS, Lightning): log it again."""
        span = self._span
        if span is not None and span[7] and not self._on_stack():
            self.__enter__()
            span[7] = False

    def _top_is_self(self):
        from torch.overrides import _get_current_function_mode_stack

        stack = _get_current_function_mode_stack()
        return bool(stack) and stack[-1] is self

    # -- modules -----------------------------------------------------------
    def _pre(self, module, args):
        # is_compiling() first: torch.compile traces this hook, and must see nothing else (no graph break)
        if self._compiling() or not self.on or _forked[0] or threading.get_ident() != self._thread:
            return
        try:
            anchor = sys._getframe(1)  # the frame of Module._call_impl (or its `inner`): it calls forward
            code = anchor.f_code
            if code.co_name not in ("inner", "_call_impl") or not code.co_filename.endswith(_MODULE_FILE):
                anchor = None
            above = self._stack(anchor.f_back) if anchor is not None else 0
            self._mods.append((self._path_id(module), anchor, above, id(module)))
        except Exception:
            pass

    def _post(self, module, args, output):
        if self._compiling() or _forked[0] or threading.get_ident() != self._thread:
            return
        mods = self._mods
        if len(mods) > 1 and mods[-1][3] == id(module):
            mods.pop()
        else:  # hooks added or removed mid-forward: find it
            for i in range(len(mods) - 1, 0, -1):
                if mods[i][3] == id(module):
                    del mods[i:]
                    break

    def _name_of(self, module):
        v = self._names.get(id(module))
        return v[1] if v is not None and v[0]() is module else None

    def _path_id(self, module):
        name = self._name_of(module)
        if name is None:
            for prefix, root in self.roots():
                if root not in self._named:
                    self._named.add(root)
                    for n, m in root.named_modules():
                        if self._name_of(m) is None:
                            self._names[id(m)] = (weakref.ref(m), (prefix + n) if n else
                                                  (prefix.rstrip(".") or type(m).__name__))
            name = self._name_of(module)
        if name is None:
            top = self.path_names[self._mods[-1][0]]
            name = (top + "." if top else "") + type(module).__name__
        k = self.paths.get(name)
        if k is None:
            k = self.paths[name] = len(self.path_names)
            self.path_names.append(name)
        return k


def _func_name(func) -> str:
    return getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or repr(func)


def _make_core(log, timed):
    """The compiled hot path for `log`, or None (not built: the Python one runs)."""
    try:
        from ._cpuhook import Core
    except ImportError:
        return None
    from .allochook import LIBRARY  # noqa: F401  (the hook and the core live in one module)

    use_mark = getattr(log.mark, "__self__", None) is not None and getattr(log.mark, "__name__", "") == "mark"
    core = Core(log._special, log._mods, log.stacks._ids, log.stacks._parts, _get_seq, use_mark=use_mark,
                timed=bool(timed))
    core.limit = min(int(log.limit), (1 << 62))
    core.on_full = log._full
    core.op_names = int(bool(log.op_names))
    if log.metadata is not None:
        log.metadata.attach(core)
    return core


class CallMetadata:
    """CUDA: the allocator's per-thread metadata string carries the running call's id
    (``tracekit:iter=3:phase=forward:op=1234``), so each history entry names its call exactly."""

    def __init__(self, setter):
        self.setter = setter  # torch._C._cuda_setMemoryMetadata
        self.base = ""
        self._active = False
        self._core = None

    def attach(self, core):
        """The compiled hot path stamps the strings itself: keep it told."""
        self._core = core
        core.setter = self.setter
        core.md_base = self.base
        core.md_active = int(self._active)

    @property
    def active(self):
        return self._active

    @active.setter
    def active(self, value):
        self._active = bool(value)
        if self._core is not None:
            self._core.md_active = int(self._active)

    def set_base(self, base):
        self.base = base
        if self._core is not None:
            self._core.md_base = base
        if self._active:
            self.setter(base)

    def enter(self, cid):
        if self.active:
            self.setter(f"{self.base}:op={cid}")

    def exit(self, parent):
        if self.active:
            self.setter(f"{self.base}:op={parent}" if parent >= 0 else self.base)
