"""What recording costs on the CPU, against the same work with no recording, measured in the same run.

    .venv/bin/python bench/bench_record.py [--rounds 5] [--steps 4] [--iterations 10000] [--threads N]
                                           [--only steps,script,long] [--gpt2]

Every figure is a ratio to the plain run measured alongside it, interleaved (plain, then each mode,
round after round), so that a busy machine slows both alike; medians are printed, and the CPU time of
the process beside the wall time (less sensitive to other processes on a shared machine).

1. steps: one training step, in this process: a tiny Hugging Face Qwen2 (2 layers, hidden 256,
   vocab 8000, batch 2 x 128, AdamW; many small modules and ops), the toy GPT, and with --gpt2
   GPT-2 124M from transformers' config (batch 1 x 128). Modes: `default` (`tracekit.record`),
   `no origins` (origins=False), `full detail` (stacks="all"), and `profiler source` (the CPU
   allocations from torch.profiler instead of the allocation hook: TRACEKIT_CPU_SOURCE=profiler).
   Each recorded block is a `with tracekit.record(...)` around `--steps` steps, and at least 5 s
   of them (the recorder drains and joins what it recorded every two seconds: the blocks pay for
   it in their steps); the time to write the file at the end is printed apart.
2. script: the same Qwen2 loop (3 steps) as a script, `python train.py` against
   `tracekit record -- python train.py` per mode: wall time, CPU time and peak RSS of the whole process
   (imports, model building, writing the file included).
3. long: a small MLP trained for --iterations iterations as a script, plain against
   `tracekit record` (default --max-entries) and `--max-entries 2000`: peak RSS over plain (MB), time.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

QWEN = dict(vocab_size=8000, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)

QWEN_SCRIPT = textwrap.dedent(f"""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**{QWEN!r}))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 8000, (2, 128))
    for step in range(3):
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        opt.step()
        opt.zero_grad()
        print("loss", out.loss.item().hex())
""")

LONG_SCRIPT = textwrap.dedent("""
    import sys, torch
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                                torch.nn.ReLU(), torch.nn.Linear(256, 10))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x, y = torch.randn(32, 64), torch.randint(0, 10, (32,))
    for _ in range(int(sys.argv[1])):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
    print("loss", loss.item().hex())
""")

STEP_MODES = {"default": ({}, {}), "no origins": ({"origins": False}, {}), "full detail": ({"stacks": "all"}, {}),
              "profiler source": ({}, {"TRACEKIT_CPU_SOURCE": "profiler"})}
SCRIPT_MODES = {"plain": None, "default": ([], {}), "no origins": ([], {"TRACEKIT_ORIGINS": "0"}),
                "full detail": (["--stacks", "all"], {})}


# -- 1. steps in this process ---------------------------------------------------------------------
def workloads(gpt2):
    import torch

    from tracekit.record.toy import make_training

    def hf(config_cls, model_cls, config, batch, seq, vocab):
        torch.manual_seed(0)
        model = model_cls(config_cls(**config))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        ids = torch.randint(0, vocab, (batch, seq))

        def step():
            out = model(input_ids=ids, labels=ids)
            out.loss.backward()
            opt.step()
            opt.zero_grad()
        return model, opt, step

    out = {}
    try:
        from transformers import GPT2Config, GPT2LMHeadModel, Qwen2Config, Qwen2ForCausalLM

        out["HF Qwen2 tiny (2 layers, hidden 256, vocab 8000, batch 2x128, AdamW)"] = \
            lambda: hf(Qwen2Config, Qwen2ForCausalLM, QWEN, 2, 128, 8000)
        if gpt2:
            out["GPT-2 124M from transformers' config (batch 1x128, AdamW)"] = \
                lambda: hf(GPT2Config, GPT2LMHeadModel, {}, 1, 128, 50257)
    except ImportError:
        print("(transformers is not installed: the Hugging Face workloads are skipped)")
    out["toy GPT (4 layers, d256, vocab 8k, batch 8x128, AdamW)"] = \
        lambda: make_training(seed=0, n_layers=4, d_model=256, vocab=8192)
    return out


def timed(step, n):
    wall, cpu = [], []
    for _ in range(n):
        w, c = time.perf_counter(), time.process_time()
        step()
        cpu.append(time.process_time() - c)
        wall.append(time.perf_counter() - w)
    return wall, cpu


def bench_steps(rounds, steps, gpt2, folder):
    import tracekit

    for name, make in workloads(gpt2).items():
        model, opt, step = make()
        timed(step, 2)  # warm-up: optimizer state, allocator, lazy imports
        one = statistics.median(timed(step, 2)[0])
        # blocks of at least 5 s: the recorder drains and joins what it recorded every two seconds,
        # so each recorded block pays its share of that work inside its steps (block means, not medians)
        n = max(steps, int(5.0 / max(one, 1e-3)) + 1)
        rows = {m: {"wall": [], "cpu": [], "write": []} for m in ["plain", *STEP_MODES]}
        for _ in range(rounds):
            w, c = timed(step, n)
            rows["plain"]["wall"].append(sum(w) / n)
            rows["plain"]["cpu"].append(sum(c) / n)
            for mode, (options, env) in STEP_MODES.items():
                saved = {k: os.environ.get(k) for k in env}
                os.environ.update(env)
                try:
                    path = os.path.join(folder, "steps.pickle")
                    rec = tracekit.record(path, model=model, optimizer=opt, backend="cpu", **options).start()
                    w, c = timed(step, n)
                    t = time.perf_counter()
                    rec.close()
                    rows[mode]["write"].append(time.perf_counter() - t)
                finally:
                    for k, v in saved.items():
                        if v is None:
                            os.environ.pop(k, None)
                        else:
                            os.environ[k] = v
                rows[mode]["wall"].append(sum(w) / n)
                rows[mode]["cpu"].append(sum(c) / n)
        plain = rows["plain"]
        print(f"{name}: {rounds} interleaved rounds of {n} steps per mode; per round the mean step, then the "
              f"median over rounds (ratios: per round, then the median)")
        print(f"  {'plain':16s} {statistics.median(plain['wall']) * 1e3:8.1f} ms/step wall   "
              f"{statistics.median(plain['cpu']) * 1e3:8.1f} ms/step CPU")
        for mode in STEP_MODES:
            r = rows[mode]
            rw = statistics.median(a / b for a, b in zip(r["wall"], plain["wall"]))
            rc = statistics.median(a / b for a, b in zip(r["cpu"], plain["cpu"]))
            print(f"  {mode:16s} {statistics.median(r['wall']) * 1e3:8.1f} ms/step wall ({rw:5.2f}x)   "
                  f"{statistics.median(r['cpu']) * 1e3:8.1f} ms/step CPU ({rc:5.2f}x)   "
                  f"writing the file {statistics.median(r['write']):5.2f} s")
        del model, opt, step


# -- 2. and 3.: whole scripts in fresh processes --------------------------------------------------
# Measured from a small launcher process: a child forked from this (big) process would count this
# process's memory in its peak RSS until it execs.
LAUNCHER = textwrap.dedent("""
    import json, os, subprocess, sys, time
    t = time.perf_counter()
    p = subprocess.Popen(sys.argv[2:], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, cwd=sys.argv[1])
    out = p.stdout.read()
    _, status, ru = os.wait4(p.pid, 0)
    sys.stdout.buffer.write(out)
    sys.stderr.write(json.dumps([time.perf_counter() - t, ru.ru_utime + ru.ru_stime, ru.ru_maxrss * 1024,
                                 os.waitstatus_to_exitcode(status)]))
""")


def run(cmd, env=None, cwd=None):
    """(wall s, CPU s, peak RSS bytes of the process and its children, stdout) of one command."""
    import json

    p = subprocess.run([sys.executable, "-c", LAUNCHER, cwd or os.getcwd(), *cmd], capture_output=True, env=env)
    wall, cpu, rss, code = json.loads(p.stderr.decode().strip().splitlines()[-1])
    if code != 0:
        raise SystemExit(f"bench_record: {' '.join(cmd)} failed")
    return wall, cpu, rss, p.stdout


def script_modes(script, args, modes, rounds, folder):
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRACEKIT_")}
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    results = {m: [] for m in modes}
    outputs = {}
    for _ in range(rounds):
        for mode, spec in modes.items():
            if spec is None:
                cmd, extra = [sys.executable, script, *args], {}
            else:
                options, extra = spec
                cmd = [sys.executable, "-m", "tracekit.cli", "record", "-o", os.path.join(folder, "s.pickle"),
                       *options, "--", sys.executable, script, *args]
            wall, cpu, rss, out = run(cmd, {**env, **extra}, folder)
            results[mode].append((wall, cpu, rss))
            outputs.setdefault(mode, out)
    same = len({o for o in outputs.values()}) == 1
    return results, same


def bench_script(rounds, folder):
    script = os.path.join(folder, "qwen_train.py")
    with open(script, "w") as f:
        f.write(QWEN_SCRIPT)
    results, same = script_modes(script, [], SCRIPT_MODES, rounds, folder)
    print(f"HF Qwen2 tiny, 3 steps as a script (`python train.py` vs `tracekit record -- python train.py`), "
          f"median of {rounds} interleaved runs each; outputs bit-identical: {same}")
    base = [statistics.median(x[i] for x in results["plain"]) for i in range(3)]
    for mode, rows in results.items():
        wall, cpu, rss = (statistics.median(x[i] for x in rows) for i in range(3))
        print(f"  {mode:12s} {wall:6.2f} s wall ({wall / base[0]:4.2f}x)  {cpu:6.2f} s CPU ({cpu / base[1]:4.2f}x)  "
              f"peak RSS {rss / 2**20:6.0f} MiB ({(rss - base[2]) / 2**20:+5.0f} MiB)")


def bench_long(iterations, rounds, folder):
    script = os.path.join(folder, "long_train.py")
    with open(script, "w") as f:
        f.write(LONG_SCRIPT)
    modes = {"plain": None, "recorded (default max entries)": ([], {}),
             "recorded, --max-entries 2000": (["--max-entries", "2000"], {})}
    results, same = script_modes(script, [str(iterations)], modes, rounds, folder)
    print(f"small MLP (64-256-256-10, batch 32, Adam), {iterations} iterations as a script, median of {rounds} "
          f"run(s); outputs bit-identical: {same}")
    base = [statistics.median(x[i] for x in results["plain"]) for i in range(3)]
    for mode, rows in results.items():
        wall, cpu, rss = (statistics.median(x[i] for x in rows) for i in range(3))
        print(f"  {mode:31s} {wall:6.1f} s ({wall / base[0]:4.2f}x)   peak RSS {rss / 2**20:6.0f} MiB "
              f"(over plain: {(rss - base[2]) / 2**20:+5.0f} MiB)")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=10_000)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--only", default="steps,script,long")
    parser.add_argument("--gpt2", action="store_true", help="also GPT-2 124M (seconds per step on a CPU)")
    args = parser.parse_args()
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs")
    only = set(args.only.split(","))
    with tempfile.TemporaryDirectory() as folder:
        if "steps" in only:
            bench_steps(args.rounds, args.steps, args.gpt2, folder)
        if "script" in only:
            bench_script(args.rounds, folder)
        if "long" in only:
            bench_long(args.iterations, max(1, args.rounds // 3), folder)


if __name__ == "__main__":
    main()
