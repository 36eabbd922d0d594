"""Which `nn.Module` is running: global forward hooks keep the current module path over time.

Like PyTorch's MemTracker, global forward pre- and post-hooks push and pop
the running module. Each change is stamped on the trace clock (Unix ns, as
the profiler's events), so any allocation's time says which module's forward
ran then (`path_at`). Backward needs no hook: an allocation made by a
backward node belongs to the module whose forward made that node (origins.py
looks the forward op's time up here).

Names are the qualified names of the recorded model(s)
(``layers.3.mlp.down_proj``); a module outside them is named by its class
under the running one.
"""
from __future__ import annotations

import bisect
import threading
import time


class ModuleTracker:
    """The running module path over time: `times` (ns, ascending) and `paths` (the path from then on)."""

    def __init__(self, roots=lambda: ()):
        self.roots = roots  # () -> [(prefix, module)]: the models whose names are known
        self.times = []
        self.paths = []
        self._stack = []
        self._names = {}  # id(module) -> qualified name
        self._named = set()  # id of the roots already named
        self._handles = []
        self._thread = None

    def install(self):
        import torch
        from torch.nn.modules import module as nn_module

        self._compiling = getattr(getattr(torch, "compiler", None), "is_compiling", None) or (lambda: False)
        self._thread = threading.get_ident()
        self._handles = [nn_module.register_module_forward_pre_hook(self._pre),
                         nn_module.register_module_forward_hook(self._post, always_call=True)]

    def remove(self):
        for h in self._handles:
            h.remove()
        self._handles = []

    def _name(self, module):
        name = self._names.get(id(module))
        if name is None:
            for prefix, root in self.roots():
                if id(root) not in self._named:
                    self._named.add(id(root))
                    for n, m in root.named_modules():
                        self._names.setdefault(id(m), (prefix + n) if n else (prefix.rstrip(".") or type(m).__name__))
            name = self._names.get(id(module))
        if name is None:
            name = (self._stack[-1] + "." if self._stack else "") + type(module).__name__
        return name

    def _pre(self, module, args):
        # torch.compile traces module hooks into its graph: there we are not (pruned, no graph break)
        if self._compiling() or threading.get_ident() != self._thread:
            return
        try:
            self._stack.append(self._name(module))
            self._mark(self._stack[-1])
        except Exception:
            pass

    def _post(self, module, args, output):
        if self._compiling() or threading.get_ident() != self._thread or not self._stack:
            return
        try:
            self._stack.pop()
            self._mark(self._stack[-1] if self._stack else "")
        except Exception:
            pass

    def _mark(self, path):
        t = time.time_ns()
        if self.times and self.times[-1] >= t:
            t = self.times[-1]
        self.times.append(t)
        self.paths.append(path)

    def path_at(self, time_ns) -> str:
        """The module running at `time_ns` ("" outside any module)."""
        i = bisect.bisect_right(self.times, time_ns) - 1
        return self.paths[i] if i >= 0 else ""

    def forget_before(self, time_ns):
        """Drop the changes older than the one in force at `time_ns` (bounded memory)."""
        i = bisect.bisect_right(self.times, time_ns) - 1
        if i > 0:
            del self.times[:i]
            del self.paths[:i]
