"""Record the CUDA samples on a GPU and check them: numerics, the allocator's own peaks, the OOM post-mortem.

    python samples/make_cuda_samples.py OUT_DIR [NAME ...]

Each sample runs samples/cuda_train.py in fresh processes: twice plain and once recorded (by the
`tracekit record` CLI or by `tracekit.record` in code). The losses of the recorded run must equal the
plain run's bit for bit (the two plain runs show whether the GPU itself is deterministic). Writes
OUT_DIR/NAME.pickle for each sample and OUT_DIR/results.jsonl (a line per sample) with, per sample, the command, the
losses and the allocator's peaks printed by the script itself. Needs CUDA.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
TRAIN = os.path.join(HERE, "cuda_train.py")

# name: (how it is recorded, arguments of cuda_train.py)
SAMPLES = {
    "gpt_adamw_cuda": ("api", ["gpt"]),
    "gpt_adamw_bf16_cuda": ("cli", ["gpt", "--amp"]),
    "gpt_checkpoint_cuda": ("cli", ["gpt", "--checkpoint"]),
    "lora_cuda": ("api", ["lora"]),
    "leak_loop_cuda": ("api", ["leak", "--steps", "6"]),
    "logits_spike_cuda": ("cli", ["spike", "--steps", "2"]),
    "oom_cuda": ("cli", ["oom", "--steps", "1"]),
    "gpt_adamw_cpp_stacks_cuda": ("api", ["gpt", "--steps", "2", "--stacks", "all"]),
}


def run(cmd):
    t = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True)
    result = next((json.loads(line[7:]) for line in p.stdout.splitlines() if line.startswith("RESULT ")), None)
    return {"cmd": " ".join(cmd), "rc": p.returncode, "seconds": round(time.perf_counter() - t, 2),
            "result": result, "stderr_tail": p.stderr[-1500:]}


def make(name, out):
    how, args = SAMPLES[name]
    path = os.path.join(out, f"{name}.pickle")
    py = [sys.executable, TRAIN, *args]
    if how == "cli":
        stacks = [a for a in args if a == "all"]
        recorded = run([sys.executable, "-m", "tracekit.cli", "record", "-o", path,
                        *(["--stacks", "all"] if stacks else []), "--", *py])
    else:
        recorded = run(py + ["--record", path])
    plain = [run(py), run(py)]
    losses = lambda r: r["result"] and r["result"]["losses"]  # noqa: E731
    row = {"name": name, "how": how, "recorded": recorded, "plain": plain,
           "gpu_deterministic": losses(plain[0]) == losses(plain[1]),
           "bit_identical": losses(recorded) == losses(plain[0]),
           "written": os.path.exists(path), "bytes": os.path.getsize(path) if os.path.exists(path) else 0}
    print(f"{name:28s} rc {recorded['rc']} plain rc {plain[0]['rc']}  losses equal: {row['bit_identical']} "
          f"(plain vs plain {row['gpu_deterministic']})  file {row['bytes'] / 1e6:.2f} MB  "
          f"{recorded['seconds']:.1f} s", flush=True)
    if recorded["rc"] != 0:
        print("   " + recorded["stderr_tail"].strip().replace("\n", "\n   ")[-800:], flush=True)
    return row


def main(argv):
    out, names = argv[0], argv[1:] or list(SAMPLES)
    os.makedirs(out, exist_ok=True)
    rows = [make(name, out) for name in names]
    with open(os.path.join(out, "results.jsonl"), "w") as f:  # samples/cuda_results.jsonl
        f.writelines(json.dumps(row) + "\n" for row in rows)


if __name__ == "__main__":
    main(sys.argv[1:])
