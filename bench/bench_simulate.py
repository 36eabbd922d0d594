#!/usr/bin/env python3
"""What a simulated training step costs against the floor: GPT-2 124M (batch 8 x 512) or Llama-2 7B (--model
llama-2-7b, batch 1 x 512), AdamW, through the simulator `tracekit simulate` and `estimate --simulate` share.

Each in a fresh process (so each has its own peak resident memory), for --precision amp (default) or fp32:

  floor      the same step with nothing of ours: the model built on the meta device, its parameters made fake
             tensors, warm-up step + one step (forward, loss, backward, AdamW foreach, zero_grad) under
             FakeTensorMode; no tracking, no CUDA rules (CPU autocast for amp)
  simulate   tracekit.simulate.workload.simulate (the same two steps with every storage tracked, CUDA's autocast
             policy, SDPA backends, workspaces) + the predicted peak (analysis.estimate.simulate)

prints wall seconds (median of --repeat runs; import time excluded, model build included), peak resident memory
(MiB) and the ratio to the floor. The targets: GPT-2 124M under 30 s; a 7B model under 3 minutes and 4 GiB.

Usage: python bench/bench_simulate.py [--model gpt2|llama-2-7b] [--precision amp|fp32] [--repeat 3]
"""
from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = {"gpt2": (ROOT / "tests/fixtures/configs/gpt2.json", 8, 512, 30, 2048),
          "llama-2-7b": (ROOT / "tracekit/data/presets/llama-2-7b.json", 1, 512, 180, 4096)}
CONFIG, BATCH, SEQ, TARGET_S, TARGET_MIB = MODELS["gpt2"]


def floor(precision):
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tracekit.simulate import hf_step as fake_step
    from tracekit.simulate.hf_model import build_meta

    t = time.perf_counter()
    model = build_meta(json.loads(CONFIG.read_text()))
    with FakeTensorMode(allow_non_fake_inputs=True):
        fake_step.to_device(model, device="cpu")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        for _ in range(2):
            ids = torch.empty((BATCH, SEQ), dtype=torch.int64)
            ctx = torch.autocast("cpu", dtype=torch.bfloat16) if precision == "amp" else _nothing()
            with ctx:
                out = model(input_ids=ids, labels=ids, use_cache=False)
            out.loss.backward()
            try:
                opt.step()
            except Exception:  # data-dependent .item() on the step counters: what the simulator answers
                pass
            opt.zero_grad(set_to_none=True)
            del out
    return time.perf_counter() - t, None


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *a):
        return False


def simulate(precision):
    from tracekit.analysis.estimate.simulate import simulated_peak
    from tracekit.io import to_trace
    from tracekit.simulate.workload import Workload
    from tracekit.simulate.workload import simulate as run

    t = time.perf_counter()
    snap = run(Workload(config=json.loads(CONFIG.read_text()), batch=BATCH, seq=SEQ, precision=precision,
                        optimizer="adamw"))
    peak = simulated_peak(to_trace(snap, "<simulated>")).peak_allocated_bytes
    return time.perf_counter() - t, peak


def child(what, precision):
    import torch  # noqa: F401  (imports are not what is measured)
    import transformers  # noqa: F401
    seconds, peak = {"floor": floor, "simulate": simulate}[what](precision)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"seconds": seconds, "rss_mib": rss, "peak": peak}))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--precision", choices=["amp", "fp32"], default="amp")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--child", choices=["floor", "simulate"])
    ap.add_argument("--model", choices=sorted(MODELS), default="gpt2")
    args = ap.parse_args()
    global CONFIG, BATCH, SEQ, TARGET_S, TARGET_MIB
    CONFIG, BATCH, SEQ, TARGET_S, TARGET_MIB = MODELS[args.model]
    if args.child:
        return child(args.child, args.precision)
    results = {}
    for what in ("floor", "simulate"):
        runs = []
        for _ in range(args.repeat):
            r = subprocess.run([sys.executable, __file__, "--child", what, "--precision", args.precision,
                                "--model", args.model],
                               capture_output=True, text=True, cwd=ROOT)
            if r.returncode:
                sys.exit(f"{what} failed:\n{r.stderr}")
            runs.append(json.loads(r.stdout.strip().splitlines()[-1]))
        results[what] = runs
    f = statistics.median(r["seconds"] for r in results["floor"])
    s = statistics.median(r["seconds"] for r in results["simulate"])
    print(f"{args.model}, batch {BATCH} x seq {SEQ}, AdamW, precision {args.precision}; median of {args.repeat} runs")
    print(f"  floor     {f:7.2f} s   {max(r['rss_mib'] for r in results['floor']):7.0f} MiB peak resident")
    print(f"  simulate  {s:7.2f} s   {max(r['rss_mib'] for r in results['simulate']):7.0f} MiB peak resident"
          f"   {s / f:.2f}x the floor")
    peak = results["simulate"][0]["peak"]
    print(f"  predicted max_memory_allocated: {peak / 2**30:.3f} GiB ({peak:,} bytes)")
    target = s < TARGET_S and max(r["rss_mib"] for r in results["simulate"]) < TARGET_MIB
    print(f"  target (< {TARGET_S} s, < {TARGET_MIB} MiB): {'met' if target else 'NOT met'}")


if __name__ == "__main__":
    main()
