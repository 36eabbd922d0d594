"""`tracekit simulate --world-size N --rank R`: torch.distributed on a fake process group (one process).

`init_process_group` (any backend, env:// or a store) starts torch's fake process group
(torch.testing._internal.distributed.fake_pg) for rank R of N: collectives return tensors of the right
shapes without moving data, so FSDP2, FSDP1, DDP and ZeRO-style code run rank R's allocations as on the
GPU (all-gather outputs, reduce-scatter inputs, DDP's buckets). `torch.cuda.device_count()` is N (one
card per rank); the script's `set_device(local_rank)` picks rank R's card.

The backend the script asked for (`init_process_group("gloo")`, `"nccl"`, `"cpu:gloo,cuda:nccl"`, none: gloo
without a GPU, else gloo for host tensors and NCCL for device tensors) decides the collectives' own memory
(`gloo_staging`): NCCL works on the tensors it is given; gloo (torch/csrc/distributed/c10d/ProcessGroupGloo.cpp)
stages through buffers of its own, which the fake process group does not make.
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
        if backend is not None:
            backend = str(backend).lower()
        if backend not in (None, "fake") and backend not in ("nccl", "gloo", "cpu:gloo,cuda:nccl", "mpi", "ucc"):
            S.assume(f"the process group's backend {backend!r} runs as torch's fake process group")
        S.backends = backends_of(backend, gpu=not S.cpu_run)
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
    for name, method in gloo_staging(S, c10d.ProcessGroup).items():
        if isinstance(method, tuple):  # the fake work's wait: an asynchronous reduce-scatter's clones end there
            put(method[0], name, method[1])
        else:
            put(c10d.ProcessGroup, name, method)
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


def backends_of(backend, gpu) -> dict:
    """{device type: backend name} as init_process_group(backend) sets them up: one name serves both device types
    (gloo runs CUDA tensors through pinned host copies), `"cpu:gloo,cuda:nccl"` one per type, none: gloo for the host
    and NCCL for CUDA when there is a GPU (torch's default), else gloo."""
    if not backend:
        return {"cpu": "gloo", "cuda": "nccl" if gpu else "gloo"}
    if ":" in backend:
        out = {}
        for part in backend.split(","):
            dev, _, name = part.partition(":")
            out[dev.strip()] = name.strip()
        return out
    return {"cpu": backend, "cuda": backend}


def gloo_staging(session, pg_class) -> dict:
    """ProcessGroup methods that make, around the fake process group's collective, the buffers gloo makes of its own
    where the backend for the tensors' device is gloo (ProcessGroupGloo.cpp, torch 2.13; nothing under NCCL):

    - all-gather (`all_gather_single` / `_allgather_base`, which chunks the output and runs `allgather`; `allgather`):
      `AsyncAllgatherWork::allgather` gathers into one flat tensor of the whole output (`newLikeFlat`) and copies it
      out. Measured on CPU with tracekit's allocation hook alone (no recorder): each all-gather makes two buffers of
      the output's size one after the other, one on the calling thread and that one on gloo's worker thread; both are
      made and freed inside the call. With CUDA tensors gloo stages through pinned host memory (nothing on the card).
    - all-gather coalesced (`allgather_coalesced`, `allgather_into_tensor_coalesced`): the inputs concatenated (when
      more than one) and one flat output of every output, alive during the call.
    - reduce-scatter (`reduce_scatter_single` / `_reduce_scatter_base` / `reduce_scatter_tensor_coalesced`): a
      `clone()` of each input, all-reduced in place, then the caller's chunk copied out: the clone lives from the
      call to its wait (the call itself when synchronous; an asynchronous one: its `wait()` or the group's next
      collective, as gloo's worker runs them in order), on the input's device (CUDA too).
    - `allreduce_coalesced`: the tensors flattened into one (when more than one), alive during the call.
    - all-reduce of one tensor and broadcast work in place (measured: nothing made).
    """
    import torch

    S = session
    GLOO = "ProcessGroupGloo.cpp"
    pending: dict = {}  # id(work) -> (id(group), clones an asynchronous reduce-scatter keeps until its wait)
    depth = [0]

    def gloo_for(t) -> bool:
        """Is the backend for this tensor's device gloo?"""
        if not isinstance(t, torch.Tensor):
            return False
        where = "cpu" if S.cpu_run or S.where_of(t) is None else "cuda"
        return (getattr(S, "backends", None) or {}).get(where) == "gloo"

    def on_host(t) -> bool:
        return S.cpu_run or S.where_of(t) is None

    def flat_like(ts):
        n = sum(t.numel() for t in ts)
        return ts[0].new_empty((n,))

    def release_pending(group):
        for key in [k for k, (g, _) in pending.items() if g == group]:
            del pending[key]

    def wrap(name, plan):
        original = getattr(pg_class, name, None)
        if original is None:
            return None

        def method(self, *args, **kwargs):
            if depth[0]:
                return original(self, *args, **kwargs)
            depth[0] += 1
            try:
                release_pending(id(self))  # gloo's worker runs a group's collectives in order: earlier ones are done
                with torch.no_grad():
                    kept = plan(*args)
                if any(gloo_for(t) for t in _tensors(args)):
                    S.assume("gloo's collectives stage through buffers of their own (ProcessGroupGloo), released as "
                             "each collective returns (a worker thread the OS runs late releases them later)")
                work = original(self, *args, **kwargs)
                if kept:
                    opts = args[2] if len(args) > 2 else kwargs.get("opts")
                    if getattr(opts, "asyncOp", False) and work is not None:
                        pending[id(work)] = (id(self), kept)  # freed at its wait (or the group's next collective)
                    kept = None
                return work
            finally:
                depth[0] -= 1
        method.__name__ = name
        method.__qualname__ = f"{pg_class.__name__}.{name}"
        method.__doc__ = getattr(original, "__doc__", None)
        return method

    # each plan makes the transient buffers (made and freed inside) and returns those kept for the collective
    native = S.frames.native
    CALLER = "c10d::ProcessGroupGloo::allgather"
    WORKER = "c10d::(anonymous namespace)::AsyncAllgatherWork::allgather (newLikeFlat)"

    def all_gather(output, inp, *rest):
        if gloo_for(output) and on_host(output):
            for where in (CALLER, WORKER):  # the calling thread's, then the worker's flat output
                with native(GLOO, where):
                    tmp = output.new_empty(output.shape)
                del tmp
        return None

    def all_gather_list(outputs, inputs, *rest):
        outs = [o for group in outputs for o in group] if outputs and isinstance(outputs[0], (list, tuple)) else []
        if outs and gloo_for(outs[0]) and on_host(outs[0]):
            for where in (CALLER, WORKER):
                with native(GLOO, where):
                    tmp = flat_like(outs[:len(outputs[0])])
                del tmp
        return None

    def all_gather_coalesced(outputs, inputs, *rest):
        outs = [o for x in outputs for o in (x if isinstance(x, (list, tuple)) else [x])]
        ins = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
        if outs and gloo_for(outs[0]) and on_host(outs[0]):
            with native(GLOO, "c10d::(anonymous namespace)::AsyncAllgatherCoalescedWork::allgather_coalesced"):
                held = [flat_like(ins)] if len(ins) > 1 else []
                held.append(flat_like(outs))
            del held
        return None

    def reduce_scatter(output, inp, *rest):
        ins = list(inp) if isinstance(inp, (list, tuple)) else [inp]
        if ins and gloo_for(ins[0]):
            with native(GLOO, "c10d::ProcessGroupGloo::reduce_scatter_tensor_coalesced"):
                return [t.clone() for t in ins]
        return None

    def allreduce_coalesced(tensors, *rest):
        ts = list(tensors) if isinstance(tensors, (list, tuple)) else [tensors]
        if len(ts) > 1 and gloo_for(ts[0]) and on_host(ts[0]):
            with native(GLOO, "c10d::(anonymous namespace)::AsyncAllreduceCoalescedWork::allreduce_coalesced"):
                tmp = flat_like(ts)
            del tmp
        return None

    work_class = getattr(torch._C._distributed_c10d, "FakeWork", None)
    work_wait = getattr(work_class, "wait", None)

    def wait(self, *args, **kwargs):
        out = work_wait(self, *args, **kwargs)
        pending.pop(id(self), None)
        return out

    plans = {"all_gather_single": all_gather, "_allgather_base": all_gather, "allgather": all_gather_list,
             "allgather_coalesced": all_gather_coalesced, "allgather_into_tensor_coalesced": all_gather_coalesced,
             "all_gather_single_coalesced": all_gather_coalesced,
             "reduce_scatter_single": reduce_scatter, "_reduce_scatter_base": reduce_scatter,
             "reduce_scatter_tensor_coalesced": reduce_scatter, "reduce_scatter_single_coalesced": reduce_scatter,
             "allreduce_coalesced": allreduce_coalesced}
    out = {}
    for name, plan in plans.items():
        m = wrap(name, plan)
        if m is not None:
            out[name] = m
    if work_wait is not None:
        out["wait"] = (work_class, wait)
    return out


def _tensors(args) -> list:
    """The tensors of a collective's arguments (tensors, lists of them, lists of lists)."""
    import torch
    out: list = []
    for a in args:
        if isinstance(a, torch.Tensor):
            out.append(a)
        elif isinstance(a, (list, tuple)):
            out += _tensors(a)
    return out


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
            # made by the reducer's C++ (as in a GPU snapshot): a c10d frame says they are collective buffers
            with torch.no_grad(), session.frames.native(
                    "reducer.cpp", "c10d::Reducer::initialize_buckets(std::vector<std::vector<unsigned long>>)"):
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
