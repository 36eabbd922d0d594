"""A second FSDP2 training script, of another shape than tests/fsdp_train.py, for 2 ranks over gloo on the CPU:
run under `python -m torch.distributed.run ... -m tracekit record -o OUT -- python tests/fsdp_transformer.py [MODE]`
and under `tracekit simulate --gpu none --world-size 2 -- python tests/fsdp_transformer.py [MODE]`.

A pre-norm transformer written here (token and position embeddings, multi-head attention through
scaled_dot_product_attention, LayerNorm, a GELU MLP 3x wide, an untied output head), each block its own
`fully_shard` unit and the root last; the last block is kept unsharded after forward (as FSDP2's own examples do),
AdamW with weight decay, gradient clipping, two steps.

MODE: `fp32` (default), `bf16` (`MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`: units
all-gathered in bf16, gradients reduce-scattered in fp32) or `ckpt` (fp32, each block under non-reentrant activation
checkpointing). Rank 0 prints one `TRACEKIT_FACTS {...}` line.
"""
import json
import math
import sys

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

VOCAB, D_MODEL, HEADS, LAYERS, SEQ, BATCH, STEPS = 384, 96, 4, 3, 48, 3, 2


class Attention(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = Attention(d, heads)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(3 * d, d)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.proj(F.gelu(self.fc(self.ln2(x))))


class Model(nn.Module):
    def __init__(self, checkpointed=False):
        super().__init__()
        self.checkpointed = checkpointed
        self.tok = nn.Embedding(VOCAB, D_MODEL)
        self.pos = nn.Embedding(SEQ, D_MODEL)
        self.blocks = nn.ModuleList(Block(D_MODEL, HEADS) for _ in range(LAYERS))
        self.ln_f = nn.LayerNorm(D_MODEL)
        self.head = nn.Linear(D_MODEL, VOCAB, bias=False)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=1 / math.sqrt(D_MODEL))

    def forward(self, idx):
        x = self.tok(idx) + self.pos(torch.arange(idx.size(1)))
        for block in self.blocks:
            if self.checkpointed:
                from torch.utils.checkpoint import checkpoint

                x = checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
        return self.head(self.ln_f(x))


def main():
    mode = sys.argv[1] if len(sys.argv) > 1 else "fp32"
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = Model(checkpointed=mode == "ckpt")
    params = sum(p.numel() for p in model.parameters())
    units = [sum(p.numel() for p in b.parameters()) for b in model.blocks]
    mesh = init_device_mesh("cpu", (world,))
    extra = {}
    if mode == "bf16":
        extra["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for i, block in enumerate(model.blocks):
        fully_shard(block, mesh=mesh, reshard_after_forward=i < LAYERS - 1, **extra)
    fully_shard(model, mesh=mesh, **extra)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    gen = torch.Generator().manual_seed(rank + 1)
    for _ in range(STEPS):
        idx = torch.randint(0, VOCAB, (BATCH, SEQ + 1), generator=gen)
        logits = model(idx[:, :-1])
        loss = F.cross_entropy(logits.float().reshape(-1, VOCAB), idx[:, 1:].reshape(-1))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
    if rank == 0:
        print("TRACEKIT_FACTS " + json.dumps({"rank": rank, "world_size": world, "mode": mode, "params": params,
                                               "units": units, "root": params - sum(units)}), flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
