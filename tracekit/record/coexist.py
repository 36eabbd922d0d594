"""Coexisting with the user's own torch.profiler (CPU backend).

One process runs one profiler: starting a second silently takes the first's
events (the first then ends with none). So while recording on the CPU, we
listen for profilers that are not ours: ``torch.autograd.profiler``'s
``_prepare_profiler`` / ``_enable_profiler`` (every torch.profiler.profile
and autograd profiler starts through them) and ``_disable_profiler`` (which
returns the finished results). `OtherProfilers` calls `on_start()` before
one of theirs starts (we stop ours and keep what it had) and
`on_stop(results)` after it stops (we take its memory events, then start
ours again). Their profiler gets all its events; ours loses none that theirs
recorded.

`OpenRanges` counts the ``record_function`` ranges (the optimizer's
``Optimizer.step#...``, the user's own) opened while we record: our
profiler is only restarted where none is open, because a range opened under
one profiler session and closed under the next writes into the first one's
freed memory (a crash in torch 2.13).
"""
from __future__ import annotations

import contextlib

_NAMES = ("_prepare_profiler", "_enable_profiler", "_disable_profiler")


def profiler_running() -> bool:
    """Is a torch profiler (any kind) running in this process now?"""
    import torch

    probe = getattr(torch._C._autograd, "_profiler_enabled", None)
    try:
        return bool(probe()) if probe is not None else False
    except Exception:
        return False


class OtherProfilers:
    def __init__(self, on_start, on_stop):
        self.on_start = on_start
        self.on_stop = on_stop
        self._ours = 0  # > 0 while our own profiler starts or stops
        self._patched = []  # (name, original, wrapper)

    @contextlib.contextmanager
    def ours(self):
        self._ours += 1
        try:
            yield
        finally:
            self._ours -= 1

    def install(self):
        import torch.autograd.profiler as module

        self._module = module
        for name in _NAMES:
            original = getattr(module, name, None)
            if original is None:
                continue
            wrapper = self._wrap_stop(original) if name == "_disable_profiler" else self._wrap_start(original)
            setattr(module, name, wrapper)
            self._patched.append((name, original, wrapper))

    def remove(self):
        for name, original, wrapper in self._patched:
            if getattr(self._module, name, None) is wrapper:
                setattr(self._module, name, original)
        self._patched.clear()

    def _wrap_start(self, original):
        def start(*args, **kwargs):
            if not self._ours:
                self._safely(self.on_start)
            return original(*args, **kwargs)

        return start

    def _wrap_stop(self, original):
        def stop(*args, **kwargs):
            results = original(*args, **kwargs)
            if not self._ours:
                self._safely(self.on_stop, results)
            return results

        return stop

    @staticmethod
    def _safely(fn, *args):
        try:
            fn(*args)
        except Exception as e:  # never break the user's profiler
            import warnings

            warnings.warn(f"tracekit: could not step aside for your profiler ({e!r})", RuntimeWarning)


class OpenRanges:
    """How many `torch.autograd.profiler.record_function` ranges opened since `install` are still open."""

    def __init__(self):
        self._open = set()
        self._patched = None

    def __len__(self):
        return len(self._open)

    def install(self):
        import torch.autograd.profiler as module

        cls = module.record_function
        enter, exit_ = cls.__enter__, cls.__exit__
        opened = self._open

        def __enter__(rf):
            result = enter(rf)
            opened.add(id(rf))
            return result

        def __exit__(rf, *exc):
            opened.discard(id(rf))
            return exit_(rf, *exc)

        cls.__enter__, cls.__exit__ = __enter__, __exit__
        self._patched = (cls, enter, exit_, __enter__, __exit__)

    def remove(self):
        if self._patched is not None:
            cls, enter, exit_, ours_enter, ours_exit = self._patched
            self._patched = None
            if cls.__enter__ is ours_enter:
                cls.__enter__ = enter
            if cls.__exit__ is ours_exit:
                cls.__exit__ = exit_
        self._open.clear()
