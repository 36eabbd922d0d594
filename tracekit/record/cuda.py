"""CUDA backend: the caching allocator's own memory history, with the executing line of every allocation.

`torch.cuda.memory._record_memory_history` records every alloc/free; `_snapshot()` gives segments,
blocks and the trace at the end (or at an out-of-memory error).

What it costs is chosen, not inherited from torch's defaults (which gather a Python stack, holding the
GIL, at every allocation *and* free):

- default: the history records no stacks (``context=None``). Where each allocation comes from is the
  op log's (oplog.py): every torch call made from Python is logged once with its stack (executing
  lines) and module, and its id rides on the allocator's per-thread metadata string
  (``tracekit:iter=3:phase=forward:op=1234``, `_set_memory_metadata`), so each history entry names its
  call exactly. Backward runs on autograd's device threads, whose entries carry no metadata: an entry
  inside a backward node's range (ranges.py, profiler restricted to backward nodes) takes the forward
  call that made the node (``forward_frames``, ``module``) and, as frames, the ``loss.backward()`` call.
- ``stacks="all"`` (full detail): torch's own stacks too (``context="all"``, Python and C++ frames);
  costs what torch's history costs, and more.

The metadata is put back to the phase string (``tracekit:iter=3:phase=forward``) in the file. The
recording state found at start is restored at stop: history off again if it was off, the previous
metadata string put back; a history someone else started is kept with its own settings.
"""
from __future__ import annotations

import inspect
import sys
import time
import warnings

import numpy as np

ROW_COLS = 12


class CudaBackend:
    name = "cuda"
    chunk_seconds = 1.0
    max_rows = 1 << 19  # op-log rows kept (the newest), as numpy; entries name calls by id

    def __init__(self, stacks="python", max_entries=1_000_000, origins=True, roots=lambda: ()):
        self.stacks = stacks
        self.max_entries = max_entries
        self.origins = origins
        self.roots = roots
        self.context = None  # what the allocator records with each entry (None: nothing; "all": stacks)
        self.oplog = None
        self.session = None
        self.metadata = None  # oplog.CallMetadata
        self.table = None
        self._calls = np.zeros((0, ROW_COLS), np.int64)
        self._ranges = np.zeros((0, 3), np.int64)
        self._snapshot = None
        self._started = False
        self._was_enabled = False
        self._old_metadata = ""
        self._metadata = None  # the phase string to stamp on new entries
        self._history_on = False  # started, and CUDA initialised: the allocator records
        self._last = 0.0

    @property
    def gaps(self):
        return []

    def window_start(self):
        return None  # the allocator's ring: what it kept is known at the end

    @staticmethod
    def _memory():
        import torch.cuda.memory

        return torch.cuda.memory

    def device_of(self, tensor):
        return tensor.device.index if tensor.device.type == "cuda" else None

    def start(self, preexisting=()):
        """Start the allocator's history (its segments already hold every live block: `preexisting` unused).

        Before CUDA is initialised (`tracekit record` starts ahead of the script) the allocator has no
        per-device state, and torch's history probe and metadata calls index it anyway (a segfault on a
        real GPU), so the history starts when CUDA is initialised (`torch.cuda._lazy_call`), before the
        first allocation. We never initialise CUDA ourselves: under torchrun the script picks its device."""
        import torch

        from .oplog import CallMetadata, OpLog
        from .origins import OriginTable
        from .ranges import ProfilerSession
        from .stacks import StackTable

        self._started = True
        mem = self._memory()
        setter = getattr(mem, "_set_memory_metadata", None)
        if mem is getattr(torch.cuda, "memory", None) and hasattr(torch._C, "_cuda_setMemoryMetadata"):
            setter = torch._C._cuda_setMemoryMetadata  # the same, without a Python frame per call
        self.metadata = CallMetadata(setter) if setter is not None else None
        self.table = OriginTable()
        self.oplog = OpLog(StackTable(), roots=self.roots, modules=self.origins, metadata=self.metadata)
        self.oplog.limit = 1 << 16
        self.oplog.on_full = self.tick
        if self.origins:
            self.session = ProfilerSession(memory=False, chunk_seconds=self.chunk_seconds)
        try:
            if cuda_initialized():
                self._begin()
            else:
                _on_cuda_init(self._begin_at_init)
            self.oplog.install(timed=True)
            if self.session is not None:
                self.session.start()
        except Exception:
            self.restore()
            raise
        self._last = time.monotonic()

    def _begin(self):
        mem = self._memory()
        self._was_enabled = history_enabled()
        self._old_metadata = _get_metadata(mem)
        if self._was_enabled:
            warnings.warn("tracekit: CUDA memory history was already on; tracekit records with its settings as "
                          "they are", RuntimeWarning)
            self.context = "theirs"
        else:
            full = self.stacks == "all"
            # without per-call metadata (an older torch), torch's own Python stacks on allocations
            self.context = "all" if full else ("alloc" if self.metadata is None else None)
            kwargs = {
                "context": self.context,
                "stacks": "all" if full else "python",
                "max_entries": self.max_entries if self.max_entries is not None else sys.maxsize,
                "clear_history": True,
            }
            kwargs = supported_kwargs(mem._record_memory_history, kwargs)
            try:
                mem._record_memory_history("all", **kwargs)
            except TypeError:  # a torch whose signature we could not read and that lacks clear_history
                kwargs.pop("clear_history", None)
                mem._record_memory_history("all", **kwargs)
        self._history_on = True
        if self.metadata is not None:
            self.metadata.active = True
            self.metadata.set_base(self._metadata or "")
        elif self._metadata is not None and hasattr(mem, "_set_memory_metadata"):
            mem._set_memory_metadata(self._metadata)

    def _begin_at_init(self):
        """Called by torch as CUDA initialises: an error here would fail the user's first CUDA call."""
        try:
            if self._started and not self._history_on:
                self._begin()
        except Exception as e:
            warnings.warn(f"tracekit: could not start CUDA's memory history ({e!r}); training runs without it",
                          RuntimeWarning)

    def set_metadata(self, time_us, metadata):
        self._metadata = metadata
        if self._history_on:
            if self.metadata is not None:
                self.metadata.set_base(metadata)
            else:
                mem = self._memory()
                if hasattr(mem, "_set_memory_metadata"):
                    mem._set_memory_metadata(metadata)
        self.tick()

    def tick(self):
        """Keep the op log and the backward ranges compact and bounded (at safe points)."""
        if self.oplog is None or self.oplog._container >= 0:
            return
        if time.monotonic() - self._last < self.chunk_seconds and self.oplog.pending_rows() < (1 << 16):
            return
        self._last = time.monotonic()
        self._collect(restart=True)

    def _collect(self, restart):
        from .origins import Calls, Ranges

        rows = self.oplog.take_rows()
        if len(rows):
            calls = Calls(rows, by_time=True)
            if self.origins:
                self.table.add(calls)
            a = calls.rows
            self._calls = np.concatenate([self._calls, a])[-self.max_rows:]
        if self.session is not None:
            if restart:
                self.session.restart(force=True)
            ranges, _ = self.session.take()
            if ranges:
                self._ranges = np.concatenate([self._ranges, Ranges(ranges).a])[-self.max_rows:]

    def stop(self):
        """Take the snapshot, then restore the previous recording state."""
        if not self._started:
            return
        try:
            if self.oplog is not None:
                self.oplog.remove()
            if self.session is not None:
                self.session.stop()
            self._collect(restart=False)
            if self._history_on:
                if self.metadata is not None:
                    self.metadata.active = False
                self._snapshot = self._memory()._snapshot()
                self._stats = allocator_stats()
            else:  # CUDA was never used while we recorded
                self._snapshot = {"segments": [], "device_traces": []}
        finally:
            self.restore()

    def restore(self):
        for step in (lambda: self.oplog.remove() if self.oplog is not None else None,
                     lambda: self.session.remove() if self.session is not None else None):
            try:
                step()
            except Exception:
                pass
        if self.metadata is not None:
            self.metadata.active = False
        if not self._started:
            return
        self._started = False
        if not self._history_on:
            return
        self._history_on = False
        mem = self._memory()
        try:
            if hasattr(mem, "_set_memory_metadata"):
                mem._set_memory_metadata(self._old_metadata)
        finally:
            if not self._was_enabled:
                mem._record_memory_history(None)

    def snapshot(self, preexisting=()):
        """The allocator's snapshot (its segments already hold every live block), each entry given its
        frames, forward origin and module from the op log."""
        snap = self._snapshot
        if isinstance(snap, list):  # very old torch: a bare list of segments
            snap = {"segments": snap, "device_traces": []}
        snap = dict(snap)
        if self.oplog is not None:
            try:
                annotate(snap, self._calls, self._ranges, self.table, self.oplog.stacks, self.oplog.path_names,
                         origins=self.origins)
            except Exception as e:
                warnings.warn(f"tracekit: allocations keep no Python lines in this recording ({e!r})",
                              RuntimeWarning)
        return snap

    def release(self):
        if self.oplog is not None:
            self.oplog.release()
        self._calls = np.zeros((0, ROW_COLS), np.int64)
        self._ranges = np.zeros((0, 3), np.int64)
        if self.table is not None:
            self.table.clear()
        self._snapshot = None

    def devices(self):
        import torch

        out = []
        if not cuda_initialized():  # the script never used CUDA: asking would initialise it now
            return out
        for i in range(torch.cuda.device_count()):
            props = torch.cuda.get_device_properties(i)
            limit = memory_limit(i, int(props.total_memory))
            out.append({"index": i, "type": "cuda", "name": props.name, "total_memory": int(props.total_memory),
                        **({"memory_limit_bytes": limit} if limit is not None else {}),
                        **({"allocator_stats": getattr(self, "_stats", {})[i]} if i in getattr(self, "_stats", {}) else {})})
        return out


def annotate(snap, calls, ranges, table, stacks, path_names, origins=True):
    """Give each history entry the Python frames of its call, and each allocation its module and (made in
    backward) the forward frames of the call that made its node. Entries name their call by the
    ``:op=ID`` suffix of their metadata, which is taken off again.

    calls: op-log rows (numpy, origins.K0...); ranges: (start_ns, end_ns, seq) of backward nodes.
    """
    from .origins import CID, CONTAINER, MODULE, STACK, T0, T1, Ranges

    cids = calls[:, CID] if len(calls) else np.zeros(0, np.int64)
    order = np.argsort(cids, kind="stable")
    cids_sorted = cids[order]
    outer = calls[calls[:, CONTAINER] != 0] if len(calls) else calls
    outer = outer[np.argsort(outer[:, T0], kind="stable")] if len(outer) else outer
    rng = Ranges([])
    rng.a = ranges[np.argsort(ranges[:, 0], kind="stable")] if len(ranges) else np.zeros((0, 3), np.int64)
    frames_cache = {}

    def frames_of(k):
        if k <= 0:
            return []
        f = frames_cache.get(k)
        if f is None:
            f = frames_cache[k] = stacks.frames(int(k))
        return f

    def row_of(cid):
        i = int(np.searchsorted(cids_sorted, cid))
        if i < len(cids_sorted) and cids_sorted[i] == cid:
            return calls[order[i]]
        return None

    last_frames = {}
    for device, entries in enumerate(snap.get("device_traces") or []):
        if not entries:
            continue
        # 1. the call named by each entry's metadata
        row_ids = np.full(len(entries), -1, np.int64)
        for i, e in enumerate(entries):
            md = e.get("user_metadata")
            if md and ":op=" in md:
                base, _, op = md.rpartition(":op=")
                e["user_metadata"] = base
                try:
                    row_ids[i] = int(op)
                except ValueError:
                    pass
        # 2. entries without a call (autograd's threads): backward node ranges and backward calls, by time
        times = np.array([e.get("time_us") if e.get("time_us") is not None else -1 for e in entries], np.int64)
        t_ns = times * 1000
        container_stack = np.zeros(len(entries), np.int64)
        in_backward = np.zeros(len(entries), bool)
        if len(outer):
            j = np.searchsorted(outer[:, T0], t_ns + 999, side="right") - 1
            ok = (j >= 0) & (row_ids < 0) & (times >= 0)
            ok[ok] = t_ns[ok] <= outer[j[ok], T1] + 999
            container_stack[ok] = outer[j[ok], STACK]
            in_backward = ok.copy()
            in_backward[ok] = outer[j[ok], CONTAINER] == 1  # a backward call, not an optimizer step
        if origins and len(rng):
            seq = rng.innermost(t_ns, slack_ns=999, between=in_backward)
            seq[row_ids >= 0] = -1  # made inside a logged call (a hook, recomputation): that call's
        else:
            seq = np.full(len(entries), -1, np.int64)
        fstack, fmodule = table.lookup(seq) if origins else (np.full(len(entries), -1), np.full(len(entries), -1))
        for i, e in enumerate(entries):
            action = e.get("action")
            if action not in ("alloc", "segment_alloc", "free_requested", "free_completed", "segment_free"):
                continue
            module = 0
            if row_ids[i] >= 0:
                r = row_of(row_ids[i])
                if r is not None:
                    if not e.get("frames"):
                        e["frames"] = frames_of(int(r[STACK]))
                    module = int(r[MODULE])
            elif container_stack[i] > 0 and not e.get("frames"):
                e["frames"] = frames_of(int(container_stack[i]))
            if action in ("alloc", "segment_alloc"):
                if seq[i] >= 0 and row_ids[i] < 0:  # made by a backward node: its forward call
                    if fstack[i] > 0:
                        ff = frames_of(int(fstack[i]))
                        if ff:
                            e["forward_frames"] = ff
                    if fmodule[i] > 0:
                        module = int(fmodule[i])
                if origins and 0 < module < len(path_names) and path_names[module]:
                    e["module"] = path_names[module]
                if action == "alloc" and e.get("frames"):
                    last_frames[(e.get("addr"), device)] = e["frames"]
    # 3. live blocks take the frames of their allocation
    for seg in snap.get("segments") or []:
        for block in seg.get("blocks") or []:
            if not block.get("frames") and block.get("state") == "active_allocated":
                f = last_frames.get((block.get("address"), seg.get("device")))
                if f:
                    block["frames"] = f


# memory_stats() keys kept in the file, so reports can be checked against the allocator's own figures
STAT_KEYS = ("allocated_bytes.all.current", "allocated_bytes.all.peak", "reserved_bytes.all.current",
             "reserved_bytes.all.peak", "active_bytes.all.peak", "requested_bytes.all.peak", "num_alloc_retries",
             "num_ooms", "num_device_alloc", "num_device_free")


def allocator_stats() -> dict:
    """{device: {max_memory_allocated, max_memory_reserved, memory_stats subset}} when recording stops.

    Peaks count since the process began or the user's last reset_peak_memory_stats
    (we never reset them: that would change what the user's own code reads)."""
    import torch

    out = {}
    try:
        for i in range(torch.cuda.device_count()):
            stats = torch.cuda.memory_stats(i)
            out[i] = {"max_memory_allocated": int(torch.cuda.max_memory_allocated(i)),
                      "max_memory_reserved": int(torch.cuda.max_memory_reserved(i)),
                      "memory_stats": {k: int(stats[k]) for k in STAT_KEYS if k in stats}}
    except Exception:  # noqa: BLE001 - figures for checking only; never fail a recording over them
        pass
    return out


def memory_limit(device, total):
    """Bytes the caching allocator may hold on `device` when a per-process memory fraction caps it."""
    import torch

    try:
        fraction = float(torch.cuda.get_per_process_memory_fraction(device))
    except Exception:  # a torch without the getter
        return None
    return int(fraction * total) if 0 < fraction < 1 else None


def cuda_initialized() -> bool:
    import torch

    try:
        return bool(torch.cuda.is_initialized())
    except Exception:
        return False


def _on_cuda_init(fn):
    """Run `fn` once CUDA is initialised (at once if it already is)."""
    import torch

    try:
        torch.cuda._lazy_call(fn)
    except Exception as e:  # a torch without the hook
        warnings.warn(f"tracekit: cannot wait for CUDA's initialisation ({e!r}); CUDA is not recorded",
                      RuntimeWarning)


def history_enabled() -> bool:
    import torch

    probe = getattr(torch._C, "_cuda_isHistoryEnabled", None)
    if not cuda_initialized():  # the probe indexes per-device state that does not exist yet (a segfault)
        return False
    try:
        return bool(probe()) if probe is not None else False
    except Exception:
        return False


def _get_metadata(mem) -> str:
    getter = getattr(mem, "_get_memory_metadata", None)
    try:
        return getter() if getter is not None else ""
    except Exception:
        return ""


def supported_kwargs(fn, kwargs):
    """The subset of `kwargs` that `fn` accepts (older torch lacks some options)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return kwargs
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
        return kwargs
    return {k: v for k, v in kwargs.items() if k in params}
