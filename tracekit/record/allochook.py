"""The CPU allocation hook (_cpuhook.c): is it there, and a small wrapper around it.

`available()` says whether this process can record CPU allocations through the hook (Linux x86-64 or
aarch64, the compiled module built, libc10 loaded and calling posix_memalign/free through its jump
slots), or why not; the CPU backend then records allocations with torch.profiler instead (slower).
TRACEKIT_CPU_SOURCE=profiler forces the profiler.
"""
from __future__ import annotations

import os

LIBRARY = "/libc10.so"
EVENT = [("t", "<i8"), ("ptr", "<u8"), ("size", "<i8")]


def _module():
    from . import _cpuhook

    return _cpuhook


def available():
    """(True, "") or (False, why not)."""
    if os.environ.get("TRACEKIT_CPU_SOURCE", "").strip().lower() == "profiler":
        return False, "TRACEKIT_CPU_SOURCE=profiler"
    try:
        mod = _module()
    except ImportError:
        return False, "the compiled allocation hook (tracekit/record/_cpuhook.c) is not built"
    import torch  # noqa: F401  (loads libc10)

    why = mod.install(LIBRARY)
    if why is not None:
        return False, why
    return True, ""


class AllocHook:
    """One recording's use of the hook: start (a ring of `capacity` events), track, mark, drain, stop."""

    def __init__(self, capacity):
        self.mod = _module()
        self.capacity = max(int(capacity), 1 << 12)
        self.mark = self.mod.mark
        self.running = False
        self._drained_to = 0

    def start(self, preexisting=()):
        """Record from now on; `preexisting` [(addr, size)]: storages alive now whose frees to record."""
        import numpy as np

        self.mod.start(self.capacity)
        self.running = True
        if preexisting:
            pairs = np.array([(a, s) for a, s in preexisting], dtype=np.uint64)
            self.mod.track(pairs.tobytes())

    def drain(self):
        """(events, index of the first, dropped): the events since the last drain as a numpy array."""
        import numpy as np

        data, first, dropped = self.mod.drain()
        events = np.frombuffer(data, dtype=EVENT)
        self._drained_to = int(first) + len(events)
        return events, int(first), int(dropped)

    def pending(self) -> int:
        """Events recorded and not yet drained."""
        return self.mod.mark() - self._drained_to

    def stop(self):
        if self.running:
            self.running = False
            self.mod.stop()

    def release(self):
        """Free the buffers and put libc10's jump slots back: nothing of ours stays in the process."""
        self.mod.release()
        self.mod.uninstall()
