"""Recording overhead on the CPU backend: step time, and memory on a long run, with and without the recorder.

    .venv/bin/python bench/bench_record.py [--steps 5] [--threads 2] [--iterations 2000] [--skip-gpt] [--skip-long]

1. The toy GPT at two sizes, each step timed plain, then recorded (the
   `record` context manager with model and optimizer, all steps in the file):
   median step times, their ratio and the file size, per mode: `default`
   (forward origins of backward allocations and module paths on,
   record/origins.py) and `no origins` (`record(..., origins=False)`, or
   TRACEKIT_ORIGINS=0 for `tracekit record`). The time to convert and write
   the file at the end is printed separately.
2. A long run: a small MLP trained for --iterations iterations, each in a
   fresh process: plain, recorded (default --max-entries), recorded with
   --max-entries 10000. Wall time and peak RSS of each, as ratios to plain.
"""
from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
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

    from tracekit.record.entries import allocation_events
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


def long_run(iterations, path=None, max_entries=None):
    """(seconds, peak RSS bytes) of training a small MLP in this process, recorded to `path` if given."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10))
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    t = time.perf_counter()
    rec = None
    if path is not None:
        options = {} if max_entries is None else {"max_entries": max_entries}
        rec = tk_record.record(path, model=model, optimizer=optimizer, backend="cpu", **options).start()
    for _ in range(iterations):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    if rec is not None:
        rec.close()
    seconds = time.perf_counter() - t
    return seconds, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def bench_long(iterations, threads, folder):
    rows = []
    for label, extra in (("plain", []), ("recorded", ["--record"]),
                         ("recorded, --max-entries 10000", ["--record", "--max-entries", "10000"])):
        path = os.path.join(folder, "long.pickle")
        out = subprocess.run([sys.executable, __file__, "--child", str(iterations), "--threads", str(threads),
                              "--path", path, *extra], capture_output=True, text=True, check=True).stdout
        seconds, rss = (float(v) for v in out.split()[-2:])
        size = os.path.getsize(path) if extra and os.path.exists(path) else 0
        rows.append((label, seconds, rss, size))
    _, plain_s, plain_rss, _ = rows[0]
    print(f"small MLP (64-256-256-10, batch 32, Adam), {iterations} iterations, each in a fresh process:")
    for label, seconds, rss, size in rows:
        print(f"  {label:31s} {seconds:7.1f} s ({seconds / plain_s:5.1f}x)   peak RSS {rss / 2**20:7.0f} MiB "
              f"({rss / plain_rss:4.1f}x)" + (f"   file {size / 1e6:.1f} MB" if size else ""))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--iterations", type=int, default=2000)
    parser.add_argument("--skip-gpt", action="store_true")
    parser.add_argument("--skip-long", action="store_true")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--path", help=argparse.SUPPRESS)
    parser.add_argument("--record", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--max-entries", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.child is not None:
        seconds, rss = long_run(args.child, args.path if args.record else None, args.max_entries)
        print(seconds, rss)
        return
    print(f"torch {torch.__version__}, {args.threads} threads, median of {args.steps} steps")
    with tempfile.TemporaryDirectory() as folder:
        if not args.skip_gpt:
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
        if not args.skip_long:
            bench_long(args.iterations, args.threads, folder)


if __name__ == "__main__":
    main()
