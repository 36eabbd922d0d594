"""CPU backend: every CPU allocation and free, with the executing line that made it, as a PyTorch snapshot.

Three cheap sources, joined in numpy once per chunk (about a second), never per allocation while the
step runs:

1. Allocations and frees: the allocation hook (allochook.py: libc10's own posix_memalign and free,
   each event a running index, time, address and size). Where the hook cannot be installed (not
   Linux, no compiler when tracekit was installed) torch.profiler's memory events instead (ranges.py,
   slower: its events cost microseconds each to read back).
2. Where: the op log (oplog.py): every torch call from Python with its stack (executing lines), its
   module and the autograd nodes it made. An allocation belongs to the innermost call it happened in.
3. Backward: the profiler, restricted to the ranges of backward nodes (ranges.py): an allocation made
   in one belongs to the forward call that made the node (origins.py).

There is no caching allocator on the CPU: each allocation is its own segment, so, in the order the CUDA
allocator would write them, a ``segment_alloc`` precedes each ``alloc`` and a ``segment_free`` follows
each ``free_completed`` (at the same time_us: reserved == allocated at every time), and the final
``segments`` are synthesized the same way: one segment (``segment_type: "cpu"``) per block live at the
end, including the storages that existed before recording (known from the model and the optimizer) and
were not freed during it. The hook records the frees of those storages too (they are registered with
it); with the profiler source the recorder watches them (preexisting.py). Device 0 is the CPU.
"""
from __future__ import annotations

import os
import platform
import time
import warnings

import numpy as np

from .entries import CPU_DEVICE
from .ring import ROW, Ring

HOOK_CAPACITY = 1 << 20  # events between two drains at most (24 MiB); more, and the oldest undrained are dropped
MAX_ROWS = 1 << 18  # op-log rows that make the recorder drain at its next safe point


class CpuBackend:
    """Records CPU memory; `max_entries` bounds what is kept (ring.py), `origins` adds forward origins
    and modules, `stacks="all"` adds the torch call (forward) or backward node that allocated as a frame."""

    name = "cpu"
    chunk_seconds = 2.0  # drain, join and restart the profiler this often (at safe points)

    def __init__(self, stacks="python", max_entries=None, origins=True, roots=lambda: ()):
        self.stacks = stacks
        self.max_entries = max_entries
        self.origins = origins
        self.roots = roots
        self.source = None  # "hook" or "profiler"
        self.source_note = ""  # why not the hook
        self.oplog = None
        self.session = None  # ranges.ProfilerSession
        self.hook = None
        self.table = None  # origins.OriginTable
        self._ring = None
        self._metadata = []  # [(time_us, metadata string)] in time order, pruned to the ring's window
        self._last = 0.0
        self._pending = None  # profiler-source allocations of an unsafe drain (cannot happen: see drain)

    @property
    def gaps(self):
        return list(self.session.gaps) if self.session is not None else []

    def window_start(self):
        """The time (µs) of the oldest entry kept, once the ring has dropped some (else None)."""
        if self._ring is None or not self._ring.dropped:
            return None
        return self._ring.first_time()

    @property
    def exact_frees(self):
        """Frees of the storages that existed before recording are seen (the hook): no watch needed."""
        return self.source == "hook"

    # -- recording ---------------------------------------------------------
    def device_of(self, tensor):
        """The trace device a tensor's storage lives on, or None if this backend does not see it."""
        return CPU_DEVICE if tensor.is_cpu else None

    def choose_source(self):
        from .allochook import available

        ok, why = available()
        self.source = "hook" if ok else "profiler"
        self.source_note = why
        return self.source

    def start(self, preexisting=()):
        """Start recording; `preexisting` [(addr, size)]: storages live now (their frees are recorded later)."""
        from .oplog import OpLog
        from .origins import OriginTable
        from .ranges import ProfilerSession
        from .stacks import StackTable

        if self.source is None:
            self.choose_source()
        self._ring = Ring(self.max_entries, [(a, s, []) for a, s in preexisting], exact_frees=self.source == "hook")
        self.table = OriginTable()
        if self.source == "hook":
            from .allochook import AllocHook

            # a drain comes when half of it is used: a small `max_entries` needs no big buffer either
            self.hook = AllocHook(min(HOOK_CAPACITY, max(1 << 16, 2 * (self.max_entries or HOOK_CAPACITY))))
        self.oplog = OpLog(StackTable(), mark=self.hook.mark if self.hook else None, roots=self.roots,
                           modules=self.origins, op_names=self.stacks == "all")
        self.oplog.limit = MAX_ROWS
        self.oplog.on_full = self.tick
        if self.origins or self.hook is None:
            self.session = ProfilerSession(memory=self.hook is None, chunk_seconds=self.chunk_seconds,
                                           hook_allocations=self.hook is not None)
        try:
            if self.hook is not None:
                self.hook.start(preexisting)
            self.oplog.install(timed=self.hook is None)
            if self.session is not None:
                self.session.start()
        except Exception:
            self.restore()
            raise
        self._last = time.monotonic()

    def set_metadata(self, time_us, metadata):
        self._metadata.append((time_us, metadata))
        self.tick()

    def tick(self):
        """Drain and join what came since the last time, if it is time and safe (phase boundaries,
        forward starts, a full op log)."""
        if self.oplog is None or self.oplog._container >= 0:  # a backward call is open: its row is to come
            return
        due = self.chunk_seconds is not None and time.monotonic() - self._last >= self.chunk_seconds
        if not due and self.oplog.pending_rows() < MAX_ROWS and (self.hook is None
                                                              or self.hook.pending() < self.hook.capacity // 2):
            return
        self._drain()

    def _drain(self, final=False):
        if self.session is not None:
            if final:
                self.session.stop()
            elif not self.session.restart(force=True):
                return  # inside a record_function range: the next safe point
        self._last = time.monotonic()
        self._join()

    def stop(self):
        try:
            if self.oplog is not None:
                self.oplog.remove()
            if self.hook is not None:
                self.hook.stop()
            self._drain(final=True)
        finally:
            self.restore()

    def restore(self):
        """Take every hook off (idempotent; an error path ends here too)."""
        for step in (lambda: self.oplog.remove() if self.oplog is not None else None,
                     lambda: self.hook.stop() if self.hook is not None else None,
                     lambda: self.session.remove() if self.session is not None else None):
            try:
                step()
            except Exception:
                pass

    # -- joining -----------------------------------------------------------
    def _join(self):
        from .origins import CONTAINER, MODULE, OP, STACK, Calls, Ranges

        rows = self.oplog.take_rows()
        ranges, prof_allocs = self.session.take() if self.session is not None else ([], [])
        if self.hook is not None:
            events, first, dropped = self.hook.drain()
            if dropped:
                self._ring.forget_older()
                warnings.warn(f"tracekit: {dropped} CPU allocation events came faster than they were read and "
                              "were dropped; the recording keeps the newest", RuntimeWarning)
            t_ns = events["t"].astype(np.int64)
            addr = events["ptr"]
            size = events["size"]
            keys = np.arange(first, first + len(events), dtype=np.int64)
            seq = None
        else:
            a = np.array(prof_allocs, dtype=np.int64).reshape(-1, 4) if prof_allocs else np.zeros((0, 4), np.int64)
            a = a[np.argsort(a[:, 0], kind="stable")]
            t_ns, addr, size, seq = a[:, 0], a[:, 1].astype(np.uint64), a[:, 2], a[:, 3]
            keys = t_ns
        calls = Calls(rows, by_time=self.hook is None)
        which, row = calls.innermost(keys)
        stack = calls.column(which, row, STACK, 0)
        module = calls.column(which, row, MODULE, 0)
        if self.origins:
            # made by a backward node: inside a backward call (not a hook or recomputation logged inside it)
            in_backward = (which == 2) & (calls.column(which, row, CONTAINER, 0) == 1)
            seq = Ranges(ranges).innermost(t_ns, between=in_backward)
            seq[~in_backward] = -1
            self.table.add(calls)
            fstack, fmodule = self.table.lookup(seq)
            backward = seq >= 0
            module = np.where(backward, np.maximum(fmodule, 0), module)
        else:
            fstack = np.full(len(t_ns), -1, np.int64)
            module = np.zeros(len(t_ns), np.int64)
        if self.stacks == "all":
            stack = self._with_ops(stack, calls.column(which, row, OP, -1), seq)
        out = np.zeros(len(t_ns), ROW)
        out["t"] = t_ns // 1000
        out["addr"] = addr
        out["size"] = size
        out["stack"] = stack
        out["fstack"] = fstack
        out["module"] = module
        self._ring.compact_metas()
        out["meta"] = self._metas(out["t"])
        self._ring.add(out)
        first = self._ring.first_time()
        if first is not None:  # metadata older than the ring's window is no longer needed
            times = [t for t, _ in self._metadata]
            i = int(np.searchsorted(times, first, side="right")) - 1
            if i > 0:
                del self._metadata[:i]

    def _metas(self, t_us):
        if not self._metadata or not len(t_us):
            return np.full(len(t_us), -1, np.int32)
        times = np.array([t for t, _ in self._metadata], dtype=np.int64)
        ids = np.array([self._ring.meta_id(m) for _, m in self._metadata], dtype=np.int32)
        j = np.searchsorted(times, t_us, side="right") - 1
        return np.where(j >= 0, ids[np.maximum(j, 0)], -1).astype(np.int32)

    def _with_ops(self, stack, op, seq):
        """stacks="all": the torch call that allocated (``TensorBase.softmax``, ``linear``) as a first frame."""
        table = self.oplog.stacks
        out = stack.copy()
        cache = {}
        for i in np.flatnonzero(op >= 0):
            key = (int(stack[i]), int(op[i]))
            k = cache.get(key)
            if k is None:
                k = cache[key] = table.key_op(self.oplog.op_name(key[1]), key[0])
            out[i] = k
        return out

    # -- the snapshot ------------------------------------------------------
    def snapshot(self, preexisting=(), freed=None):
        """The snapshot dict. `freed` {addr: time_us}: pre-existing storages seen to die (profiler source)."""
        table = self.oplog.stacks if self.oplog is not None else None
        names = self.oplog.path_names if self.oplog is not None else [""]

        def frames_of(k):
            return table.frames(k) if table is not None and k > 0 else []

        def module_name(k):
            return names[k] if 0 <= k < len(names) else ""

        snap = self._ring.snapshot(frames_of, module_name, freed or {}, self._metadata)
        return snap

    def release(self):
        """Drop the tables once the file is written (code objects, rows): nothing outlives the recording."""
        if self.oplog is not None:
            self.oplog.release()
        if self.table is not None:
            self.table.clear()
        self._ring = None
        if self.hook is not None:
            try:
                self.hook.release()
            except Exception:
                pass

    def devices(self):
        return [{"index": CPU_DEVICE, "type": "cpu", "name": cpu_name(), "total_memory": total_ram()}]


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "cpu"


def total_ram():
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None
