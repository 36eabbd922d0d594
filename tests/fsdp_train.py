"""A training script of FSDP2 (`fully_shard`) or DDP for 2 ranks over gloo on the CPU, run under
`python -m torch.distributed.run ... -m tracekit record -o OUT -- python tests/fsdp_train.py MODE`.

MODE is `fsdp` (each block a unit, then the root: embeddings, final norm and head), `fsdp-bf16` (the same
with `MixedPrecisionPolicy(param_dtype=bfloat16)` and the blocks kept unsharded after forward), `fsdp1`
(FullyShardedDataParallel, each block a unit) or `ddp` (DistributedDataParallel). The model is a small GPT (tracekit.record.toy.TinyGPT) trained with AdamW
on random tokens for three steps. Rank 0 prints one JSON line (`TRACEKIT_FACTS {...}`) with what
the analytic bytes rest on: the parameter count, each unit's parameter count and the world size.
"""
import json
import os
import sys

import torch
import torch.distributed as dist

from tracekit.record.toy import TinyGPT, lm_loss, random_batch

VOCAB, D_MODEL, LAYERS, HEADS, SEQ, BATCH, STEPS = 512, 128, 4, 4, 32, 4, 3


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "fsdp"
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = TinyGPT(vocab=VOCAB, d_model=D_MODEL, n_layers=LAYERS, n_heads=HEADS, seq=SEQ)
    params = sum(p.numel() for p in model.parameters())
    units = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    root = params - sum(units)
    if mode in ("fsdp", "fsdp-bf16"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cpu", (world,))
        extra = {}
        if mode == "fsdp-bf16":
            extra = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16), "reshard_after_forward": False}
        for block in model.blocks:
            fully_shard(block, mesh=mesh, **extra)
        fully_shard(model, mesh=mesh, **{k: v for k, v in extra.items() if k == "mp_policy"})
    elif mode == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        from tracekit.record.toy import TransformerBlock

        model = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}),
                                         device_id=torch.device("cpu"))
    else:
        from torch.nn.parallel import DistributedDataParallel

        model = DistributedDataParallel(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank + 1)
    for _ in range(STEPS):
        inputs, targets = random_batch(VOCAB, BATCH, SEQ, generator=gen)
        lm_loss(model(inputs), targets).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    if rank == 0:  # one line (two ranks printing at once may interleave)
        print("TRACEKIT_FACTS " + json.dumps({"rank": rank, "world_size": world, "mode": mode, "params": params,
                                               "units": units, "root": root}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
