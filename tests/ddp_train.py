"""A DistributedDataParallel training script for `torchrun` on the CPU (gloo), recorded by tracekit.

    torchrun --standalone --nproc-per-node 2 tests/ddp_train.py OUT_DIR [BIG_RANK]

Each rank trains a tiny GPT on its own random batches; rank BIG_RANK (if
given) uses twice the batch, the planted imbalance. Each rank runs one
unrecorded warm-up step and records two steps to OUT_DIR/ddp.pickle, which
the recorder names ddp.rankN.pickle (and writes its summary beside it).
"""
import os
import sys

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import tracekit
from tracekit.record.toy import TinyGPT, lm_loss, random_batch


def main():
    out, big = sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else -1
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = DistributedDataParallel(TinyGPT(vocab=512, d_model=64, n_layers=2, n_heads=4, seq=64))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(rank + 1)
    batch = 16 if rank == big else 8

    def step():
        inputs, targets = random_batch(512, batch, 64, generator=gen)
        lm_loss(model(inputs), targets).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    tracekit.record_steps(step, steps=2, warmup=1, path=os.path.join(out, "ddp.pickle"), model=model,
                          optimizer=opt, backend="cpu")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
