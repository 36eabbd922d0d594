"""Recording overhead on a CUDA GPU: step time plain and recorded, per recorder mode.

    python bench/bench_record_cuda.py [--steps 10] [--sizes small,gpt2]

For each model size, in one process: the training step (TinyGPT + AdamW, fp32) timed plain
(median of --steps steps, each ended by torch.cuda.synchronize(), after 2 warm-up steps),
then recorded by `tracekit.record` in each mode, then plain again (the floor is the lower of
the two plain medians, so drift is not charged to the recorder). `torch only` is
torch.cuda.memory._record_memory_history(stacks="python") alone, no tracekit. Modes: `default`
(stacks="python", forward origins and module paths on), `no origins` (origins=False), and
`C++ stacks` (stacks="all"). Prints ms/step, the ratio to the floor, and the time to take
the snapshot and write the file. Target (issue 16): default <= 1.2x.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time

import torch

import tracekit.record as tk_record
from tracekit.record.toy import make_training

SIZES = {
    "small": dict(vocab=8192, d_model=256, n_layers=4, n_heads=4, seq=256, batch=8),
    "gpt2": dict(vocab=32768, d_model=768, n_layers=12, n_heads=12, seq=512, batch=8),
}
MODES = {"default": dict(), "no origins": dict(origins=False), "C++ stacks": dict(stacks="all")}


def timed(step, n):
    times = []
    for _ in range(n):
        torch.cuda.synchronize()
        t = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--sizes", default="small,gpt2")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_record_cuda: needs a CUDA GPU")
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, median of {args.steps} steps")
    with tempfile.TemporaryDirectory() as folder:
        for size in args.sizes.split(","):
            config = SIZES[size]
            model, optimizer, step = make_training(seed=0, device="cuda", **config)
            timed(step, 2)
            plain = [timed(step, args.steps)]
            rows = []
            torch.cuda.memory._record_memory_history("all", context="all", stacks="python")  # torch's own cost
            timed(step, 1)
            rows.append(("torch only", timed(step, args.steps), 0.0, 0))
            torch.cuda.memory._record_memory_history(None)
            for mode, options in MODES.items():
                path = os.path.join(folder, f"{size}.pickle")
                rec = tk_record.record(path, model=model, optimizer=optimizer, backend="cuda", **options).start()
                timed(step, 1)
                recorded = timed(step, args.steps)
                t = time.perf_counter()
                rec.close()
                rows.append((mode, recorded, time.perf_counter() - t, os.path.getsize(path)))
            plain.append(timed(step, args.steps))
            floor = min(plain)
            n_params = sum(p.numel() for p in model.parameters())
            print(f"{size} ({n_params / 1e6:.1f} M parameters, {config}): plain {plain[0] * 1e3:.2f} / "
                  f"{plain[1] * 1e3:.2f} ms/step (floor {floor * 1e3:.2f})")
            for mode, recorded, finish, nbytes in rows:
                print(f"  {mode:11s} {recorded * 1e3:8.2f} ms/step  {recorded / floor:5.2f}x   "
                      + (f"snapshot+write {finish:5.2f} s for {args.steps + 1} steps ({nbytes / 1e6:.1f} MB)"
                         if nbytes else "(torch's allocator history with Python stacks alone, no tracekit)"))
            del model, optimizer, step
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
