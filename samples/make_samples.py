"""Make the sample recordings in this folder with tracekit's own recorder.

    .venv/bin/python samples/make_samples.py            # all samples, into samples/
    .venv/bin/python samples/make_samples.py gpt_adamw  # just one

Deterministic numerics (fixed seeds, single thread); addresses and times
naturally differ from run to run. Each sample prints its losses.
"""
from __future__ import annotations

import os
import sys

import torch

import tracekit.record as tk_record
from tracekit.record.toy import TinyGPT, lm_loss, make_training, random_batch

HERE = os.path.dirname(os.path.abspath(__file__))


def gpt_adamw(path):
    """Small GPT (2 layers, d_model 128, vocab 2048, seq 128, batch 8), AdamW, 3 recorded steps.

    Recording starts before the first step, so the optimizer state being
    created in step 0 is in the trace; parameters exist before it.
    """
    model, optimizer, step = make_training(seed=0)
    with tk_record.record(path, model=model, optimizer=optimizer, backend="cpu") as rec:
        for _ in range(3):
            print("  loss", float(step()))
            rec.step()


def leak_loop(path):
    """A loop that leaks: each step's logits (with their graph) are appended to a list, and
    `total_loss += loss` keeps a growing graph; 8 iterations, memory creeps up step after step."""
    torch.manual_seed(1)
    vocab, seq, batch = 2048, 64, 4
    model = TinyGPT(vocab=vocab, d_model=64, n_layers=2, n_heads=4, seq=seq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(2)
    outputs, total_loss = [], 0
    with tk_record.record(path, model=model, optimizer=optimizer, backend="cpu") as rec:
        for _ in range(8):
            inputs, targets = random_batch(vocab, batch, seq, generator=gen)
            logits = model(inputs)
            loss = lm_loss(logits, targets)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            outputs.append(logits)  # the leak: kept for "later analysis"
            total_loss += loss  # the classic one: should be loss.item()
            rec.step()
    print("  mean loss", total_loss.item() / 8, "kept outputs", len(outputs))


def logits_spike(path):
    """A step whose loss upcasts large bf16 logits to fp32 (vocab 8192, seq 128, batch 8):
    the fp32 copy and its log-softmax make a clear spike at the loss. Recorded with
    record_steps: 1 warm-up step, then 2 recorded steps."""
    torch.manual_seed(3)
    vocab, seq, batch = 8192, 128, 8
    model = TinyGPT(vocab=vocab, d_model=128, n_layers=2, n_heads=4, seq=seq)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(4)

    def step():
        inputs, targets = random_batch(vocab, batch, seq, generator=gen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(inputs)  # bf16
        loss = lm_loss(logits, targets, upcast=True)  # fp32 copy of the logits
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        print("  loss", float(loss))

    tk_record.record_steps(step, steps=2, warmup=1, path=path, model=model, optimizer=optimizer, backend="cpu")


SAMPLES = {"gpt_adamw": gpt_adamw, "leak_loop": leak_loop, "logits_spike": logits_spike}


def main(names):
    torch.set_num_threads(1)
    for name in names or SAMPLES:
        path = os.path.join(HERE, f"{name}.pickle")
        print(name)
        SAMPLES[name](path)
        print(f"  wrote {path} ({os.path.getsize(path) / 1e6:.2f} MB)")


if __name__ == "__main__":
    main(sys.argv[1:])
