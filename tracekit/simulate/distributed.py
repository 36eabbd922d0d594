"""`tracekit simulate --world-size N --rank R`: torch.distributed on a fake process group (one process).

`init_process_group` (any backend, env:// or a store) starts torch's fake process group
(torch.testing._internal.distributed.fake_pg) for rank R of N: collectives return tensors of the right
shapes without moving data, so FSDP2, FSDP1, DDP and ZeRO-style code run rank R's allocations as on the
GPU (all-gather outputs, reduce-scatter inputs, DDP's buckets). `torch.cuda.device_count()` is N (one
card per rank); the script's `set_device(local_rank)` picks rank R's card.
"""
from __future__ import annotations

import contextlib


@contextlib.contextmanager
def fake_process_group(session):
    import torch
    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    S = session
    saved = []

    def put(obj, name, value):
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    orig_init = c10d.init_process_group

    def init_process_group(backend=None, init_method=None, timeout=None, world_size=-1, rank=-1, store=None,
                           group_name="", pg_options=None, device_id=None, **kw):
        if backend not in (None, "fake") and backend not in ("nccl", "gloo", "cpu:gloo,cuda:nccl", "mpi", "ucc"):
            S.assume(f"the process group's backend {backend!r} runs as torch's fake process group")
        kwargs = {"backend": "fake", "store": FakeStore(), "rank": S.rank, "world_size": S.world_size}
        if timeout is not None:
            kwargs["timeout"] = timeout
        S.assume(f"torch.distributed runs on a fake process group: rank {S.rank} of {S.world_size}, collectives move "
                 "no data")
        return orig_init(**kwargs)

    def is_nccl_available():
        return True

    put(c10d, "init_process_group", init_process_group)
    put(dist, "init_process_group", init_process_group)
    put(c10d, "is_nccl_available", is_nccl_available)
    put(dist, "is_nccl_available", is_nccl_available)

    # DDP's reducer is C++ that reads tensor data: it runs as our model of it (buckets, bucket views)
    import torch.nn.parallel as par
    import torch.nn.parallel.distributed as pdist
    model = ddp_class(S)
    put(par, "DistributedDataParallel", model)
    put(pdist, "DistributedDataParallel", model)
    put(torch.nn.parallel, "DistributedDataParallel", model)
    try:
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)
        try:
            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:
            pass


def ddp_class(session):
    """DistributedDataParallel as its reducer holds memory: gradient buckets made when it is built (the parameters
    in reverse order, a first bucket of 1 MiB, then `bucket_cap_mb`, one flat tensor per bucket beside the
    parameters), each gradient copied into its bucket when it is ready (or, with gradient_as_bucket_view=True, the
    gradient becomes a view of its bucket and its own tensor is freed), the all-reduce in place."""
    import torch

    class DistributedDataParallel(torch.nn.Module):
        def __init__(self, module, device_ids=None, output_device=None, dim=0, broadcast_buffers=True,
                     process_group=None, bucket_cap_mb=None, find_unused_parameters=False, check_reduction=False,
                     gradient_as_bucket_view=False, static_graph=False, **kw):
            super().__init__()
            self.module = module
            self.device_ids = device_ids
            self.gradient_as_bucket_view = gradient_as_bucket_view
            self.require_backward_grad_sync = True
            session.assume("DDP's reducer runs as tracekit's model of it (gradient buckets, bucket views)")
            params = [p for p in module.parameters() if p.requires_grad]
            cap = int((bucket_cap_mb if bucket_cap_mb is not None else 25) * (1 << 20))
            limits = [1 << 20, cap]
            buckets, cur, size = [], [], 0
            for p in reversed(params):
                nbytes = p.numel() * p.element_size()
                limit = limits[min(len(buckets), 1)]
                if cur and (size + nbytes > limit or p.dtype != cur[0].dtype):
                    buckets.append(cur)
                    cur, size = [], 0
                cur.append(p)
                size += nbytes
            if cur:
                buckets.append(cur)
            self._views = {}
            self._buckets = []
            with torch.no_grad():
                for group in buckets:
                    flat = torch.zeros(sum(p.numel() for p in group), dtype=group[0].dtype, device=group[0].device)
                    self._buckets.append(flat)
                    offset = 0
                    for p in group:
                        self._views[p] = flat[offset:offset + p.numel()].view_as(p)
                        offset += p.numel()
            for p in params:
                p.register_post_accumulate_grad_hook(self._ready)

        def _ready(self, p):
            if not self.require_backward_grad_sync:
                return
            view = self._views.get(p)
            if view is None or p.grad is None:
                return
            with torch.no_grad():
                if self.gradient_as_bucket_view:
                    if p.grad.data_ptr() != view.data_ptr():
                        view.copy_(p.grad)
                        p.grad = view
                else:
                    view.copy_(p.grad)
                    p.grad.copy_(view)

        def forward(self, *args, **kwargs):
            return self.module(*args, **kwargs)

        import contextlib as _cl

        @_cl.contextmanager
        def no_sync(self):
            old = self.require_backward_grad_sync
            self.require_backward_grad_sync = False
            try:
                yield
            finally:
                self.require_backward_grad_sync = old

        def join(self, *a, **k):
            import contextlib
            return contextlib.nullcontext()

        def register_comm_hook(self, state, hook):
            session.assume("DDP communication hooks are not run")

        def _set_static_graph(self):
            pass

    return DistributedDataParallel
