"""When do the storages that existed before recording die? (CPU backend.)

The profiler drops the free of a block it did not see allocated, so a
pre-existing storage (parameter, buffer, gradient, optimizer state known at
the start) freed during recording — e.g. a warm-up gradient freed by
``zero_grad(set_to_none=True)`` — would otherwise look live to the end.

Each pre-existing storage is watched with ``weakref.finalize`` on its
``UntypedStorage`` Python object: PyTorch keeps that object alive exactly as
long as the storage itself (PyObject preservation), so the finalizer runs
when the storage is freed, and stamps the time on the trace clock
(`marks.now_us`, Unix µs, as the entries). Where a torch lets the storage
object die early (no preservation), the tensor known to the model or
optimizer is watched instead. A storage weak reference
(``StorageWeakRef``) says whether the storage is gone; it is polled at each
phase / iteration boundary and at stop, so a storage that died without a
finalizer time gets the first boundary at which it was seen gone (the
earliest time it is known to be freed). `freed(end_us)` gives
{addr: time_us}; the CPU backend turns them into free entries (see
`entries.PreexistingFrees`). Nothing here touches a tensor's data, and any
failure leaves a storage unwatched (it then looks live, as before).
"""
from __future__ import annotations

import weakref

from .marks import now_us
from .tags import storage_span


class PreexistingWatch:
    def __init__(self, tensors, device_of):
        self.spans = {}  # addr -> size, every distinct pre-existing storage the trace sees
        self._died = {}  # addr -> time_us the finalizer ran
        self._seen_gone = {}  # addr -> time_us of the first poll that found the storage gone
        self._refs = {}  # addr -> StorageWeakRef
        self._finalizers = []
        self._active = True
        try:
            from torch.multiprocessing.reductions import StorageWeakRef
        except Exception:
            StorageWeakRef = None
        for t in tensors:
            if t is None or device_of(t) is None:
                continue
            span = storage_span(t)
            if span is None or span[0] in self.spans:
                continue
            addr, size = span
            self.spans[addr] = size
            try:
                self._watch(t, addr, StorageWeakRef)
            except Exception:
                pass

    def _watch(self, tensor, addr, StorageWeakRef):
        storage = tensor.untyped_storage()
        if StorageWeakRef is not None:
            self._refs[addr] = StorageWeakRef(storage)
        f = weakref.finalize(storage, self._on_death, addr)
        f.atexit = False
        del storage
        if not f.alive:  # the storage object died with our reference: watch the tensor instead
            self._died.pop(addr, None)
            f = weakref.finalize(tensor, self._on_death, addr)
            f.atexit = False
        self._finalizers.append(f)

    def _on_death(self, addr):
        if self._active:
            self._died.setdefault(addr, now_us())

    def _gone(self, addr):
        ref = self._refs.get(addr)
        try:
            return ref is not None and ref.expired()
        except Exception:
            return False

    def poll(self, t=None):
        """Note the storages found gone now (called at phase and iteration boundaries)."""
        if not self._active:
            return
        t = now_us() if t is None else t
        for addr in self._refs:
            if addr not in self._died and addr not in self._seen_gone and self._gone(addr):
                self._seen_gone[addr] = t

    def stop(self, end_us):
        """Stop watching; {addr: time_us} of the pre-existing storages freed while recording."""
        self.poll(end_us)
        self._active = False
        for f in self._finalizers:
            try:
                f.detach()
            except Exception:
                pass
        self._finalizers = []
        freed = {}
        for addr in self.spans:
            t = self._died.get(addr)
            if t is not None and addr in self._refs and not self._gone(addr):
                t = None  # the watched tensor died, its storage lives on (shared)
            if t is None:
                t = self._seen_gone.get(addr)
            if t is not None:
                freed[addr] = min(t, end_us)
        self._refs = {}
        return freed
