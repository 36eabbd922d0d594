"""A small training script, written as a user would, for the CUDA samples (samples/make_cuda_samples.py).

    python samples/cuda_train.py gpt [--amp] [--checkpoint] [--steps 3]      # plain
    tracekit record -o x.pickle -- python samples/cuda_train.py gpt --amp    # recorded by the CLI
    python samples/cuda_train.py gpt --record x.pickle                       # recorded in code

Workloads: gpt (TinyGPT + AdamW), lora (frozen TinyGPT, trainable low-rank adapters), leak (keeps every
step's logits and sums the loss tensor), spike (bf16 autocast, loss on an fp32 copy of large logits),
oom (the spike under a per-process memory fraction too small for it). The last line printed is
``RESULT {json}``: the losses (float.hex, to compare bit for bit) and the allocator's own peaks.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from tracekit.record.toy import TinyGPT, random_batch

SHAPES = {  # vocab, d_model, layers, heads, seq, batch
    "gpt": (8192, 256, 4, 4, 256, 8),
    "lora": (8192, 256, 4, 4, 256, 8),
    "leak": (8192, 128, 2, 4, 128, 8),
    "spike": (32768, 256, 2, 4, 256, 16),
    "oom": (32768, 256, 2, 4, 512, 8),
}


class CheckpointedGPT(TinyGPT):
    """TinyGPT whose blocks are recomputed in backward (activation checkpointing)."""

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = checkpoint(block, x, use_reentrant=False)
        return self.head(self.ln(x))


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable rank-r update."""

    def __init__(self, base: nn.Linear, r=8):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.a = nn.Parameter(torch.randn(r, base.in_features, device=base.weight.device) * 0.01)
        self.b = nn.Parameter(torch.zeros(base.out_features, r, device=base.weight.device))

    def forward(self, x):
        return self.base(x) + (x @ self.a.t()) @ self.b.t()


def build(args):
    vocab, d, layers, heads, seq, batch = SHAPES[args.workload]
    torch.manual_seed(0)
    cls = CheckpointedGPT if args.checkpoint else TinyGPT
    model = cls(vocab, d, layers, heads, seq).cuda()
    if args.workload == "lora":
        model.requires_grad_(False)
        for block in model.blocks:
            block.qkv = LoRALinear(block.qkv)
            block.fc = LoRALinear(block.fc)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=3e-4)
    return model, optimizer, vocab, seq, batch


def main(argv=None):
    parser = argparse.ArgumentParser()
    parser.add_argument("workload", choices=sorted(SHAPES))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--amp", action="store_true", help="bf16 autocast")
    parser.add_argument("--checkpoint", action="store_true", help="activation checkpointing")
    parser.add_argument("--record", help="record in code (tracekit.record) into this file")
    parser.add_argument("--stacks", default="python", choices=("python", "all"))
    args = parser.parse_args(argv)

    if args.workload == "oom":  # the allocator may use 1 GiB of this GPU: the fp32 logits do not fit
        torch.cuda.set_per_process_memory_fraction(2**30 / torch.cuda.get_device_properties(0).total_memory)
    model, optimizer, vocab, seq, batch = build(args)
    gen = torch.Generator(device="cuda").manual_seed(1)
    amp = args.amp or args.workload in ("spike", "oom")
    kept, total_loss, losses = [], 0, []

    def step():
        nonlocal total_loss
        inputs, targets = random_batch(vocab, batch, seq, "cuda", gen)
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            logits = model(inputs)
        if args.workload in ("spike", "oom"):
            logits = logits.float()  # the upcast: an fp32 copy of the bf16 logits
        loss = F.cross_entropy(logits.reshape(-1, vocab), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if args.workload == "leak":
            kept.append(logits)  # kept "for later", with its graph
            total_loss += loss  # should be loss.item()
        losses.append(loss.detach())

    torch.cuda.reset_peak_memory_stats()  # the allocator's peaks cover what is recorded, nothing before
    if args.record:
        import tracekit

        with tracekit.record(args.record, model=model, optimizer=optimizer, stacks=args.stacks) as rec:
            for _ in range(args.steps):
                step()
                rec.step()
    else:
        for _ in range(args.steps):
            step()
    torch.cuda.synchronize()
    print("RESULT " + json.dumps({"losses": [float(x).hex() for x in losses],
                                  "max_memory_allocated": torch.cuda.max_memory_allocated(),
                                  "max_memory_reserved": torch.cuda.max_memory_reserved()}))


if __name__ == "__main__":
    sys.exit(main())
