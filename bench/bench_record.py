"""Recording overhead on the CPU backend: training step time with and without the recorder.

    .venv/bin/python bench/bench_record.py [--steps 5] [--threads 2]

Runs the toy GPT at two sizes, each step timed plain, then recorded (the
`record` context manager with model and optimizer, all steps in the file),
and prints the median step times, their ratio and the file size. The time to
convert and write the file at the end is printed separately.

Modes: `default` (forward origins of backward allocations and module paths
on, record/origins.py) and `no origins` (`record(..., origins=False)`, or
TRACEKIT_ORIGINS=0 for `tracekit record`).
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
    "small (2 layers, d128, vocab 2k, seq 128, batch 8)": dict(),
    "medium (4 layers, d256, vocab 8k, seq 128, batch 8)": dict(n_layers=4, d_model=256, vocab=8192),
}


def timed_steps(step, n):
    times = []
    for _ in range(n):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return times


MODES = {"default": dict(), "no origins": dict(origins=False)}


def bench(config, steps, folder, options):
    _, _, step = make_training(seed=0, **config)
    timed_steps(step, 1)  # warm-up: optimizer state, allocator
    plain = statistics.median(timed_steps(step, steps))

    model, optimizer, step = make_training(seed=0, **config)
    timed_steps(step, 1)
    path = os.path.join(folder, "bench.pickle")
    rec = tk_record.record(path, model=model, optimizer=optimizer, backend="cpu", **options)
    rec.start()
    recorded = statistics.median(timed_steps(step, steps))
    t = time.perf_counter()
    rec.close()
    finish = time.perf_counter() - t
    return plain, recorded, finish, os.path.getsize(path)


def walk_cost(config, steps):
    """Seconds to convert one profiler session of `steps` steps: the allocation walk (cpu.py, the floor)
    and the origins walk (origins.py) over the same result."""
    from torch.profiler import ProfilerActivity, profile

    from tracekit.record.cpu import allocation_events
    from tracekit.record.modules import ModuleTracker
    from tracekit.record.origins import Origins

    model, _, step = make_training(seed=0, **config)
    step()
    tracker = ModuleTracker(lambda: [("", model)])
    tracker.install()
    try:
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True, with_stack=True) as prof:
            for _ in range(steps):
                step()
    finally:
        tracker.remove()
    results = prof.profiler.kineto_results
    t = time.perf_counter()
    allocation_events(results)
    floor = time.perf_counter() - t
    t = time.perf_counter()
    Origins(tracker).take(results)
    return floor, time.perf_counter() - t


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads, median of {args.steps} steps")
    with tempfile.TemporaryDirectory() as folder:
        for name, config in SIZES.items():
            print(f"{name}:")
            for mode, options in MODES.items():
                plain, recorded, finish, size = bench(config, args.steps, folder, options)
                print(f"  {mode:10s}  plain {plain * 1e3:8.1f} ms/step   recorded {recorded * 1e3:8.1f} ms/step   "
                      f"ratio {recorded / plain:5.2f}x   convert+write {finish:5.2f} s for {args.steps} steps "
                      f"({size / 1e6:.2f} MB)")
            floor, origins = walk_cost(config, 2)
            print(f"  converting 2 steps' profile: allocations {floor:5.2f} s, origins {origins:5.2f} s "
                  f"({origins / floor:4.2f}x the allocation walk)")


if __name__ == "__main__":
    main()
