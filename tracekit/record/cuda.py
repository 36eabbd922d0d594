"""CUDA backend: the caching allocator's own memory history.

`torch.cuda.memory._record_memory_history` records every alloc/free with
Python stacks; `_set_memory_metadata` stamps each new entry with our
``tracekit:iter=N:phase=P`` string; `_snapshot()` gives segments, blocks and
the trace at the end (or at an out-of-memory error). The recording state
found at start is restored at stop: history off again if it was off, the
previous metadata string put back.
"""
from __future__ import annotations

import inspect
import sys


class CudaBackend:
    name = "cuda"

    def __init__(self, stacks="python", max_entries=1_000_000):
        self.stacks = stacks
        self.max_entries = max_entries
        self._snapshot = None
        self._started = False
        self._was_enabled = False
        self._old_metadata = ""
        self._metadata = None  # the string to stamp on new entries
        self._history_on = False  # started, and CUDA initialised: the allocator records

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
        self._started = True
        if cuda_initialized():
            self._begin()
        else:
            _on_cuda_init(self._begin_at_init)

    def _begin(self):
        mem = self._memory()
        self._was_enabled = history_enabled()
        self._old_metadata = _get_metadata(mem)
        kwargs = {
            "context": "all",
            "stacks": self.stacks,
            "max_entries": self.max_entries if self.max_entries is not None else sys.maxsize,
            # Keep a history someone else started; otherwise start from a clean one.
            "clear_history": not self._was_enabled,
        }
        kwargs = supported_kwargs(mem._record_memory_history, kwargs)
        try:
            mem._record_memory_history("all", **kwargs)
        except TypeError:  # a torch whose signature we could not read and that lacks clear_history
            kwargs.pop("clear_history", None)
            mem._record_memory_history("all", **kwargs)
        self._history_on = True
        if self._metadata is not None and hasattr(mem, "_set_memory_metadata"):
            mem._set_memory_metadata(self._metadata)

    def _begin_at_init(self):
        """Called by torch as CUDA initialises: an error here would fail the user's first CUDA call."""
        try:
            if self._started and not self._history_on:
                self._begin()
        except Exception as e:
            import warnings

            warnings.warn(f"tracekit: could not start CUDA's memory history ({e!r}); training runs without it",
                          RuntimeWarning)

    def set_metadata(self, time_us, metadata):
        self._metadata = metadata
        mem = self._memory()
        if self._history_on and hasattr(mem, "_set_memory_metadata"):
            mem._set_memory_metadata(metadata)

    def stop(self):
        """Take the snapshot, then restore the previous recording state."""
        if not self._started:
            return
        try:
            if self._history_on:
                self._snapshot = self._memory()._snapshot()
                self._stats = allocator_stats()
            else:  # CUDA was never used while we recorded
                self._snapshot = {"segments": [], "device_traces": []}
        finally:
            self.restore()

    def restore(self):
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
        """The allocator's snapshot; its segments already hold every live block."""
        snap = self._snapshot
        if isinstance(snap, list):  # very old torch: a bare list of segments
            snap = {"segments": snap, "device_traces": []}
        return dict(snap)

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
        import warnings

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
