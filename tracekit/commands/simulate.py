"""`tracekit simulate [--gpu NAME] [--world-size N] [--rank R] [-o FILE] -- python SCRIPT ARGS`."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import click

from ..errors import TracekitError


@click.command("simulate", context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False})
@click.option("--gpu", default="H100", show_default=True,
              help="The card to simulate: H100, H200, A100-80GB, A100-40GB, L40S, L4, RTX4090, RTX3090, A10G, T4, V100.")
@click.option("-o", "--output", default=None,
              help="Also write the whole simulated run as `tracekit record` would (tags, phases, iterations); "
                   ".rankN is added under --world-size.")
@click.option("--world-size", type=click.IntRange(min=1, max=1 << 16), default=1, show_default=True,
              help="Run torch.distributed on a fake process group of this many ranks (one process).")
@click.option("--rank", type=click.IntRange(min=0), default=0, show_default=True, help="The rank simulated.")
@click.option("--routing", type=click.Choice(["even", "worst"]), default="even", show_default=True,
              help="MoE routing over values nobody knows: tokens spread evenly, or all to the first experts.")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def command(gpu, output, world_size, rank, routing, command):
    """Run COMMAND (python SCRIPT ..., python -m MODULE ..., python -c CODE ...) on this machine's CPU as if
    torch.cuda had the GPU: every tensor put on `cuda` is fake (no data, no memory), PyTorch's caching
    allocator is modelled, and the script's own torch.cuda.max_memory_allocated(), memory_summary() and
    _dump_snapshot() answer as on the card. Out of memory raises torch.cuda.OutOfMemoryError as there.

    \b
    Examples:
      tracekit simulate --gpu A100-40GB -- python train.py --batch 8
      tracekit simulate --gpu 4090 -o sim.pickle -- python finetune_lora.py
      tracekit simulate --world-size 8 -- python fsdp_train.py
    """
    from ..analysis.estimate.gpus import gpu as find_gpu
    from ..record.script import NotPython, child_env, parse_python_command
    argv = list(command)
    if argv and argv[0] == "--":
        argv = argv[1:]
    card = find_gpu(gpu)
    if rank >= world_size:
        raise TracekitError(f"--rank {rank} is not a rank of --world-size {world_size}")
    if output:
        from ..io.write import check_writable
        try:
            check_writable(os.path.abspath(output))
        except ValueError as e:
            raise TracekitError(f"-o: {e}") from None
    try:
        exe, opts, mode, target, args = parse_python_command(argv)
    except NotPython as e:
        raise TracekitError(f"tracekit simulate runs Python scripts: {e}") from None
    if mode == "path" and not os.path.exists(target):
        raise TracekitError(f"cannot open the script {target!r}: no such file")
    settings = {"gpu": card.name, "output": os.path.abspath(output) if output else None, "world_size": world_size,
                "rank": rank, "routing": routing, "command": argv}
    from ..simulate.runner import BOOTSTRAP
    # "python" names the interpreter kind; the script runs in this process's Python (the one with tracekit and torch)
    cmd = [sys.executable, *opts, "-c", BOOTSTRAP, json.dumps(settings), mode, target, *args]
    try:
        proc = subprocess.Popen(cmd, env=child_env())
    except OSError as e:
        raise TracekitError(f"cannot start {exe}: {e}") from None
    try:
        rc = proc.wait()
    except KeyboardInterrupt:
        try:
            rc = proc.wait(timeout=30)
        except Exception:
            proc.kill()
            rc = 130
    sys.exit(rc if rc >= 0 else 128 - rc)
