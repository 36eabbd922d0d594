"""What a rank of a sharded or data-parallel job holds, from the stacks (and the recorder's facts).

Sharded training (FSDP2's `fully_shard`, FSDP1's `FullyShardedDataParallel`, DeepSpeed ZeRO) and
DistributedDataParallel allocate from their own Python code, so the innermost frame of theirs in a stack
says what an allocation is:

- `parameter`: this rank's shard of the parameters (FSDP2 `_init_sharded_param`, FSDP1's flat parameter
  `shard`, ZeRO-3 `_partition_param`);
- `unsharded_parameter`: full parameters all-gathered for compute (FSDP2's all-gather output and copy-out,
  FSDP1's padded unsharded flat parameter, ZeRO-3's `_allgather_params`);
- `gradient`: this rank's gradient shard, the reduce-scatter's output when it outlives the backward pass
  that made it (FSDP2 `foreach_reduce`, FSDP1 `_reduce_grad`, ZeRO-2/3 partitioned gradients);
- `communication`: collective buffers that are neither (all-gather inputs, reduce-scatter inputs, DDP's
  gradient buckets, gloo/NCCL scratch, and any other c10d / NCCL / `torch/distributed` frame).

A wrapper that runs the user's module inside (FSDP1's and DDP's `forward`, a checkpoint wrapper, DTensor's op
dispatch) stops the search: what the model computes under it is decided by phases and lifetimes as usual.
Without any of those frames nothing here applies. Tags of our recorder (DTensor local shards, FSDP2's
unsharded parameters, gradient shards) win over all of this (categories.py).

What a rank holds, for the report and the rank table, is in `holds.py`.
"""
from __future__ import annotations

import re

import numpy as np

from ..model import Trace
from .memo import per_trace

NONE, STOP, PARAM, UNSHARD, REDUCE, GRAD, STATE, COMM, GATHER = range(9)
ROLE_NAMES = ("", "stop", "parameter", "unsharded_parameter", "reduce", "gradient", "optimizer_state",
              "communication", "all-gather output")

# FSDP2 all-gathers a unit into one flat buffer, then copies each parameter out of it into the unsharded
# parameters (which the unit computes with, and frees on reshard); the flat buffer lives from the all-gather (a
# prefetch: before the unit runs) to shortly after the copy-out, so for much of its life it duplicates the
# unsharded parameters: a collective buffer. A unit prefetched and not yet copied out is only there (holds.py
# counts those at the peak).
GATHER_WHY = ("all-gather output (FSDP2: a unit's full parameters before and just after their copy-out into the "
              "unsharded parameters; by frames)")
_S = r"[/\\]"
_FSDP2 = rf"torch{_S}distributed{_S}fsdp{_S}_fully_shard{_S}"
_FSDP1 = rf"torch{_S}distributed{_S}fsdp{_S}"
_DS = rf"deepspeed{_S}"
# (filename regex, function names (None: any), role, reason); the innermost frame that matches decides
RULES = [
    # FSDP2 (torch.distributed.fsdp.fully_shard)
    (rf"{_FSDP2}_fsdp_param\.py$", {"_init_sharded_param", "reset_sharded_param", "to_sharded",
                                     "_init_sharded_post_forward_param_metadata", "to_sharded_post_forward",
                                     "init_dtensor_from_local_tensor"}, PARAM,
     "this rank's parameter shard (FSDP2 sharding, by frames)"),
    (rf"{_FSDP2}_fsdp_param\.py$", {"init_all_gather_outputs", "alloc_all_gather_outputs", "init_unsharded_param",
                                     "to_unsharded", "alloc_storage"}, UNSHARD,
     "full parameters all-gathered for compute (FSDP2 unshard, by frames)"),
    (rf"{_FSDP2}_fsdp_collectives\.py$", {"_get_param_all_gather_inputs", "foreach_reduce_scatter_copy_in",
                                           "_div_if_needed", "foreach_all_reduce"}, COMM,
     "collective staging (FSDP2 all-gather input / reduce-scatter copy-in, by frames)"),
    (rf"{_FSDP2}_fsdp_collectives\.py$", {"foreach_all_gather"}, GATHER, GATHER_WHY),
    (rf"{_FSDP2}_fsdp_collectives\.py$", {"foreach_all_gather_copy_out"}, COMM,
     "collective staging (FSDP2 all-gather copy-out, by frames)"),
    (rf"{_FSDP2}_fsdp_collectives\.py$", {"foreach_reduce"}, REDUCE,
     "reduce-scatter (FSDP2 foreach_reduce, by frames)"),
    # FSDP1 (FullyShardedDataParallel)
    (rf"{_FSDP1}_flat_param\.py$", {"flatten_tensors_into_flat_param", "_init_flat_param_and_metadata", "shard",
                                     "_get_shard", "_init_shard_metadata", "_use_sharded_flat_param"}, PARAM,
     "this rank's parameter shard (FSDP flat parameter, by frames)"),
    (rf"{_FSDP1}_flat_param\.py$", {"_alloc_padded_unsharded_flat_param", "_get_padded_unsharded_flat_param",
                                     "_all_gather_flat_param", "unshard", "pre_unshard",
                                     "init_flat_param_attributes"}, UNSHARD,
     "full parameters all-gathered for compute (FSDP unshard, by frames)"),
    (rf"{_FSDP1}_runtime_utils\.py$", {"_reduce_grad", "_get_reduce_scatter_tensors", "_post_backward_hook"},
     REDUCE, "reduce-scatter (FSDP _reduce_grad, by frames)"),
    (rf"{_FSDP1}_runtime_utils\.py$", {"_reduce_grad_no_shard"}, GRAD,
     "gradient (FSDP NO_SHARD all-reduce, by frames)"),
    # DeepSpeed ZeRO
    (rf"{_DS}runtime{_S}zero{_S}partition_parameters\.py$", {"_partition_param", "_partition", "partition",
                                                              "_partition_param_sec"}, PARAM,
     "this rank's parameter partition (ZeRO-3, by frames)"),
    (rf"{_DS}runtime{_S}zero{_S}partition_parameters\.py$", {"_allgather_param", "_allgather_params",
                                                              "_allgather_params_coalesced", "all_gather_coalesced",
                                                              "_all_gather", "all_gather", "allgather_fn",
                                                              "_all_gather_dtype"}, UNSHARD,
     "full parameters all-gathered for compute (ZeRO-3 gather, by frames)"),
    (rf"{_DS}runtime{_S}zero{_S}stage3\.py$", {"partition_grads", "_DeepSpeedZeroOptimizer_Stage3__partition_grads",
                                               "__partition_grads"}, GRAD,
     "this rank's gradient partition (ZeRO-3, by frames)"),
    (rf"{_DS}runtime{_S}zero{_S}stage3\.py$", {"_create_fp32_partitions", "_setup_for_real_optimizer",
                                               "_create_fp16_partitions_with_defragmentation"}, STATE,
     "fp32 master partition (ZeRO-3 optimizer, by frames)"),
    (rf"{_DS}runtime{_S}zero{_S}stage_1_and_2\.py$", {"copy_grads_in_partition", "get_flat_partition",
                                                      "async_accumulate_grad_in_cpu_via_gpu"}, GRAD,
     "this rank's gradient partition (ZeRO-1/2, by frames)"),
    (rf"{_DS}runtime{_S}zero{_S}stage_1_and_2\.py$", {"__init__", "initialize_optimizer_states"}, STATE,
     "fp32 master partition (ZeRO-1/2 optimizer, by frames)"),
    (rf"{_DS}runtime{_S}zero{_S}(stage3|stage_1_and_2)\.py$", None, COMM,
     "collective buffer (ZeRO reduce bucket, by frames)"),
    (rf"{_DS}comm{_S}", None, COMM, "collective buffer (deepspeed.comm, by frames)"),
    # DDP: the reducer's gradient buckets are made when the module is wrapped
    (rf"torch{_S}nn{_S}parallel{_S}distributed\.py$", {"_ddp_init_helper", "__init__", "_sync_module_states",
                                                       "_sync_buffers", "_build_params_for_reducer",
                                                       "_check_sync_bufs_pre_fwd", "_sync_params_and_buffers"},
     COMM, "collective buffer (DDP gradient buckets / broadcast, by frames)"),
    # DDP rebuilds its buckets in its pre-forward (the reducer's C++, under this Python frame)
    (rf"torch{_S}nn{_S}parallel{_S}distributed\.py$", {"_pre_forward"}, COMM,
     "collective buffer (DDP gradient buckets rebuilt in its pre-forward, by frames)"),
    # wrappers that run the user's module or its ops: what is made under them is the model's own memory
    (rf"torch{_S}(distributed|nn{_S}parallel){_S}.*\.py$", {"forward", "_run_ddp_forward", "_pre_forward",
                                                            "_post_forward", "_root_pre_forward"}, STOP, ""),
    (rf"torch{_S}distributed{_S}(tensor|_tensor){_S}_dispatch\.py$", None, STOP, ""),
    (rf"torch{_S}distributed{_S}algorithms{_S}_checkpoint{_S}", None, STOP, ""),
    (rf"torch{_S}distributed{_S}distributed_c10d\.py$", None, COMM, "NCCL / c10d communication buffer"),
]
_COMPILED = [(re.compile(f), names, role, why) for f, names, role, why in RULES]
REASONS = tuple(dict.fromkeys(["NCCL / c10d communication buffer"] + [r[3] for r in RULES if r[3]]))
GENERIC_COMM = "NCCL / c10d communication buffer"


def frame_role(filename: str, name: str) -> tuple[int, str]:
    """(role, reason) of one frame by the rules (NONE, "" when none applies)."""
    for rx, names, role, why in _COMPILED:
        if (names is None or name in names or name.rsplit(".", 1)[-1] in names) and rx.search(filename):
            return role, why
    return NONE, ""


@per_trace
def stack_roles(trace: Trace) -> tuple[np.ndarray, np.ndarray]:
    """(role, reason index into REASONS) per stack id + 1 (0: no stack): the innermost frame a rule names
    decides; else any c10d / NCCL / torch.distributed frame (phases' F_COMM) makes a collective buffer."""
    from .phases import F_COMM, stack_flags

    fr, strings = trace.frames, trace.strings
    role = np.zeros(len(fr), np.int8)
    why = np.zeros(len(fr), np.int16)
    memo: dict = {}
    reasons = {r: i for i, r in enumerate(REASONS)}
    for i, (f, n) in enumerate(zip(fr.filename.tolist(), fr.name.tolist())):
        got = memo.get((f, n))
        if got is None:
            r, w = frame_role(strings[f], strings[n])
            got = memo[(f, n)] = (r, reasons.get(w, 0))
        role[i], why[i] = got
    st = trace.stacks
    out_role = np.zeros(len(st) + 1, np.int8)
    out_why = np.zeros(len(st) + 1, np.int16)
    if len(st) and len(st.frame_ids):
        lengths = np.diff(st.offsets)
        nonempty = np.flatnonzero(lengths > 0)
        starts = st.offsets[:-1][nonempty]
        r = role[st.frame_ids]
        big = np.iinfo(np.int64).max
        pos = np.where(r > 0, np.arange(len(r), dtype=np.int64), big)
        first = np.minimum.reduceat(pos, starts)  # innermost frame a rule names (frames are innermost first)
        ends = starts + lengths[nonempty]
        hit = first < ends
        out_role[1 + nonempty[hit]] = r[first[hit]]
        out_why[1 + nonempty[hit]] = why[st.frame_ids[first[hit]]]
    generic = ((stack_flags(trace) & F_COMM) != 0) & (out_role == NONE)
    out_role[generic] = COMM
    out_why[generic] = reasons[GENERIC_COMM]
    out_role[out_role == STOP] = NONE
    return out_role, out_why


DDP_BUCKETS = "DDP gradient buckets (made in DDP's pre-forward, alive past it; the recorder's marks)"


def _ddp_buckets(trace: Trace, times) -> np.ndarray | None:
    """Allocations made inside DDP's pre-forward (the recorder's marks: the reducer rebuilds its gradient buckets
    there, in C++, with no Python stack) and alive after it; `times`: (alloc, free) µs per allocation."""
    spans = ((trace.recorder or {}).get("distributed") or {}).get("ddp_pre_forward_us") or []
    if not spans or times is None:
        return None
    if callable(times):
        times = times()
    if not len(times[0]):
        return None
    ta, tf = times
    out = np.zeros(len(ta), bool)
    for a, b in spans:
        out |= (ta >= a) & (ta <= b) & (tf > b)
    return out


def evidence(trace: Trace, al, same_run: np.ndarray, times=None) -> list:
    """(mask, category name, reason) rules for categories.infer, in order; `times`: categories.allocation_times, or
    a function that makes them (called only when the recorder marked DDP's pre-forward)."""
    role, why = stack_roles(trace)
    # no stack has a role (most files): no rule by frames applies, and no allocation's role is looked up
    out = _by_roles(role, why, al, same_run) if role.any() else []
    buckets = _ddp_buckets(trace, times)
    if buckets is not None and buckets.any():
        out.append((buckets, "communication", DDP_BUCKETS))
    return out


def _by_roles(role, why, al, same_run) -> list:
    """evidence's rules by the role of each allocation's stack."""
    sid = al.stack_id + al.stack_id.dtype.type(1)  # stack ids are below 2**31 - 1: no overflow, no int64 copy
    r, w = role[sid], why[sid]
    out = []
    for code, cat, mask in ((PARAM, "parameter", None), (UNSHARD, "unsharded_parameter", None),
                            (GRAD, "gradient", ~same_run), (STATE, "optimizer_state", ~same_run)):
        m = r == code
        if mask is not None:
            m &= mask
        for k in np.unique(w[m]).tolist():
            out.append((m & (w == k), cat, REASONS[k]))
    reduce = r == REDUCE
    if reduce.any():
        out.append((reduce & ~same_run, "gradient", "this rank's gradient shard (reduce-scatter output, alive past "
                                                    "the backward pass that made it; by frames)"))
        out.append((reduce, "communication", "reduce-scatter staging (freed in the backward pass that made it; "
                                             "by frames)"))
    comm = (r == COMM) | (r == GATHER) | ((r == GRAD) | (r == STATE)) & same_run
    for k in np.unique(w[comm]).tolist():
        out.append((comm & (w == k), "communication", REASONS[k]))
    return out


EXTRA_REASONS = ("this rank's gradient shard (reduce-scatter output, alive past the backward pass that made it; "
                 "by frames)", "reduce-scatter staging (freed in the backward pass that made it; by frames)",
                 DDP_BUCKETS)
