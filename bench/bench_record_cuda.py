"""What recording costs on a CUDA GPU, against the same step with no recording, measured in the same run.

    python bench/bench_record_cuda.py [--rounds 5] [--steps 8] [--models gpt2,llama] [--precisions amp,fp32]
                                      [--checkpointing] [--tiny] [--device cuda|cpu]

Per model and precision, one process: the training step (AdamW) is timed plain, then under each mode,
round after round (interleaved, so drift and a busy machine are charged to no mode), each step ended by
torch.cuda.synchronize(); per round the mean step of each block, then the median over rounds, and each
mode's ratio to the plain block of the same round (median over rounds). Models: GPT-2 124M from
transformers' GPT2Config() (batch 8 x 512), and a small Llama-style model (LlamaConfig, 8 layers,
hidden 512, batch 4 x 256); precisions: `amp` (torch.autocast bf16) and `fp32`.

Modes:
- `torch history`: torch.cuda.memory._record_memory_history() with torch's defaults, no tracekit (the
  reference: what PyTorch's own recording costs);
- `torch history, python stacks`: the same with stacks="python";
- `tracekit`: tracekit.record(...) default (no allocator stacks; the op log names each entry's call;
  forward origins and modules);
- `tracekit no origins`: origins=False;
- `tracekit full detail`: stacks="all" (torch's own Python and C++ stacks too).

--checkpointing: transformers' gradient_checkpointing_enable() (non-reentrant, the default) on GPT-2
124M, each in a fresh process: plain; torch's own history (known to crash: SystemError in run_backward,
then a segfault); torch's history with set_checkpoint_early_stop(False); tracekit default; tracekit full
detail. Prints each run's exit code and its step time against plain.

--tiny --device cpu runs the same code on tiny models on this machine's CPU (the torch-history modes
are skipped there): a check that the benchmark runs, not a figure.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import torch  # noqa: E402

import tracekit  # noqa: E402

MODELS = {
    "gpt2": dict(full=dict(), tiny=dict(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=128),
                 batch=(8, 512), tiny_batch=(2, 64)),
    "llama": dict(full=dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
                            num_key_value_heads=8, vocab_size=32000, max_position_embeddings=512),
                  tiny=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=2, vocab_size=1000, max_position_embeddings=128),
                  batch=(4, 256), tiny_batch=(2, 64)),
}


def build(name, tiny, device):
    from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

    spec = MODELS[name]
    cfg = spec["tiny" if tiny else "full"]
    torch.manual_seed(0)
    model = (GPT2LMHeadModel(GPT2Config(**cfg)) if name == "gpt2" else LlamaForCausalLM(LlamaConfig(**cfg))).to(device)
    model.train()
    batch, seq = spec["tiny_batch" if tiny else "batch"]
    vocab = model.config.vocab_size
    return model, batch, seq, vocab


def make_step(model, batch, seq, vocab, precision, device):
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator(device=device).manual_seed(1)
    ids = torch.randint(0, vocab, (batch, seq), device=device, generator=gen)
    autocast = (torch.autocast(device_type=device, dtype=torch.bfloat16) if precision == "amp"
                else contextlib.nullcontext())

    def step():
        with autocast:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return opt, step


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def block(step, n, device):
    sync(device)
    times = []
    for _ in range(n):
        t = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - t)
    return sum(times) / n


@contextlib.contextmanager
def torch_history(**kwargs):
    torch.cuda.memory._record_memory_history(**kwargs)
    try:
        yield
    finally:
        torch.cuda.memory._record_memory_history(None)


def modes(device, folder, model, opt):
    out = {}
    if device == "cuda":
        out["torch history"] = lambda: torch_history()
        out["torch history, python stacks"] = lambda: torch_history(stacks="python")

    @contextlib.contextmanager
    def ours(**options):
        rec = tracekit.record(os.path.join(folder, "b.pickle"), model=model, optimizer=opt, backend=device,
                              **options).start()
        try:
            yield
        finally:
            t = time.perf_counter()
            rec.close()
            ours.write.append(time.perf_counter() - t)
    ours.write = []
    out["tracekit"] = lambda: ours()
    out["tracekit no origins"] = lambda: ours(origins=False)
    out["tracekit full detail"] = lambda: ours(stacks="all")
    return out, ours.write


def bench(name, precision, args, folder):
    device = args.device
    model, batch, seq, vocab = build(name, args.tiny, device)
    opt, step = make_step(model, batch, seq, vocab, precision, device)
    for _ in range(3):
        step()
    all_modes, writes = modes(device, folder, model, opt)
    rows = {m: [] for m in ["plain", *all_modes]}
    for _ in range(args.rounds):
        rows["plain"].append(block(step, args.steps, device))
        for mode, cm in all_modes.items():
            with cm():
                step()  # the first step under a mode pays for its start (lazy state): not timed
                rows[mode].append(block(step, args.steps, device))
    n = sum(p.numel() for p in model.parameters())
    print(f"{name} ({n / 1e6:.1f} M parameters, batch {batch} x {seq}, {precision}, AdamW) on "
          f"{torch.cuda.get_device_name() if device == 'cuda' else 'CPU'}: {args.rounds} interleaved rounds of "
          f"{args.steps} steps")
    plain = rows["plain"]
    print(f"  {'plain':30s} {statistics.median(plain) * 1e3:8.2f} ms/step")
    for mode in all_modes:
        r = rows[mode]
        ratio = statistics.median(a / b for a, b in zip(r, plain))
        print(f"  {mode:30s} {statistics.median(r) * 1e3:8.2f} ms/step  {ratio:5.2f}x plain")
    if writes:
        print(f"  (tracekit: taking the snapshot and writing the file, median {statistics.median(writes):.2f} s)")
    del model, opt, step
    if device == "cuda":
        torch.cuda.empty_cache()


CHECKPOINTED = textwrap.dedent("""
    import contextlib, sys, time, torch
    from transformers import GPT2Config, GPT2LMHeadModel
    mode, device, tiny = sys.argv[1], sys.argv[2], sys.argv[3] == "1"
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=1000, n_positions=128) if tiny else GPT2Config()
    batch, seq = (2, 64) if tiny else (8, 512)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(cfg).to(device)
    model.gradient_checkpointing_enable()  # non-reentrant, transformers' default
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device=device)
    def step():
        with torch.autocast(device_type=device, dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)
    def sync():
        if device == "cuda": torch.cuda.synchronize()
    step(); sync()
    ctx = contextlib.nullcontext()
    if mode.startswith("torch"):
        torch.cuda.memory._record_memory_history()
        if mode == "torch-no-early-stop":
            from torch.utils.checkpoint import set_checkpoint_early_stop
            ctx = set_checkpoint_early_stop(False)
    elif mode.startswith("tracekit"):
        import tracekit
        ctx = tracekit.record("ckpt.pickle", model=model, optimizer=opt, backend=device,
                              stacks="all" if mode == "tracekit-full" else "python")
    with ctx:
        times = []
        for _ in range(5):
            sync(); t = time.perf_counter(); step(); sync(); times.append(time.perf_counter() - t)
    print("ms_per_step", sorted(times)[len(times) // 2] * 1e3)
""")


def bench_checkpointing(args, folder):
    script = os.path.join(folder, "ckpt.py")
    with open(script, "w") as f:
        f.write(CHECKPOINTED)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    runs = ["plain", "torch", "torch-no-early-stop", "tracekit", "tracekit-full"]
    if args.device != "cuda":
        runs = ["plain", "tracekit", "tracekit-full"]
    print(f"GPT-2 {'(tiny) ' if args.tiny else '124M '}with transformers' gradient_checkpointing_enable() "
          f"(non-reentrant), amp, each in a fresh process:")
    base = None
    for mode in runs:
        p = subprocess.run([sys.executable, script, mode, args.device, "1" if args.tiny else "0"], cwd=folder,
                           env=env, capture_output=True, text=True, timeout=900)
        ms = next((float(line.split()[1]) for line in p.stdout.splitlines() if line.startswith("ms_per_step")), None)
        if mode == "plain":
            base = ms
        how = {"plain": "no recording", "torch": "torch's own history (defaults)",
               "torch-no-early-stop": "torch's history, set_checkpoint_early_stop(False)",
               "tracekit": "tracekit default", "tracekit-full": "tracekit full detail"}[mode]
        fate = "ok" if p.returncode == 0 else f"exit {p.returncode}" + (
            " (segfault)" if p.returncode in (-11, 139) else "") + (" SystemError" if "SystemError" in p.stderr else "")
        figure = f"{ms:8.2f} ms/step" + (f"  {ms / base:5.2f}x plain" if base else "") if ms is not None else ""
        print(f"  {how:52s} {fate:24s} {figure}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--models", default="gpt2,llama")
    parser.add_argument("--precisions", default="amp,fp32")
    parser.add_argument("--checkpointing", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="tiny models (a check that it runs, not a figure)")
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("bench_record_cuda: needs a CUDA GPU (or --device cpu --tiny to check that it runs)")
    print(f"torch {torch.__version__}"
          + (f", {torch.cuda.get_device_name()}, CUDA {torch.version.cuda}" if args.device == "cuda" else ", CPU"))
    with tempfile.TemporaryDirectory() as folder:
        for name in args.models.split(","):
            for precision in args.precisions.split(","):
                bench(name, precision, args, folder)
        if args.checkpointing:
            bench_checkpointing(args, folder)


if __name__ == "__main__":
    main()
