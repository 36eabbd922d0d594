"""`tracekit record [-o FILE] [options] -- COMMAND [ARGS...]`: record an unmodified training script."""
from __future__ import annotations

import os
import subprocess
import sys

import click

from ..errors import TracekitError
from ..io.write import check_writable
from ..record.recorder import DEFAULT_MAX_ENTRIES, DEFAULT_PATH, expand_path
from ..record.script import NotPython, child_command, child_env
from ..record.signals import Forwarder


@click.command(
    "record",
    context_settings={"ignore_unknown_options": True, "allow_interspersed_args": False},
)
@click.option("-o", "--output", default=DEFAULT_PATH, show_default=True,
              help="File to write: .pickle, .pkl or .json, optionally + .gz; {rank} and {pid} are filled in. "
                   "Under torchrun each rank adds .rankN by default.")
@click.option("--max-entries", type=click.IntRange(min=1), default=DEFAULT_MAX_ENTRIES, show_default=True,
              help="Trace entries kept (the newest); the recorder's memory is bounded by it (about 0.9 KiB an "
                   "entry while the file is written).")
@click.option("--stacks", type=click.Choice(["python", "all"]), default="python", show_default=True,
              help="python: the executing Python lines (cheap). all: full detail, also C++ frames (CUDA: "
                   "torch's own stacks, costs what its history costs) / the torch call as a frame (CPU).")
@click.option("--warmup", type=click.IntRange(min=0), default=0, show_default=True,
              help="Iterations to run before recording starts.")
@click.option("--steps", type=click.IntRange(min=1), default=None,
              help="Iterations to record; then the file is written and the script goes on unrecorded. Default: all.")
@click.option("--backend", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True,
              help="auto: $TRACEKIT_BACKEND if set, else CUDA allocator history if CUDA is available, else the CPU profiler.")
@click.option("--no-activations", is_flag=True, help="Do not tag tensors saved for backward (no saved-tensor hooks).")
@click.option("--no-origins", is_flag=True,
              help="Record without forward origins of backward allocations and modules (as TRACEKIT_ORIGINS=0).")
@click.argument("command", nargs=-1, required=True, type=click.UNPROCESSED)
def command(output, max_entries, stacks, warmup, steps, backend, no_activations, no_origins, command):
    """Run COMMAND (python SCRIPT ..., python -m MODULE ..., python -c CODE ...) under the recorder.

    The script needs no changes: optimizer steps and the model's forward and
    backward mark iterations and phases. Its output and exit code are passed
    through; the file is written even when it fails.

    \b
    Example:
      tracekit record -o step.pickle --warmup 1 --steps 3 -- python train.py --lr 3e-4
    """
    argv = list(command)
    if argv and argv[0] == "--":
        argv = argv[1:]
    settings = {
        "output": os.path.abspath(output), "max_entries": max_entries, "stacks": stacks, "warmup": warmup,
        "steps": steps, "backend": backend, "activations": not no_activations, "origins": not no_origins,
        "command": argv,
    }
    try:  # refused now, not after the run, when the recording would be lost
        check_writable(expand_path(output))
    except ValueError as e:
        raise TracekitError(f"cannot write the recording to {output}: {e}") from None
    try:
        cmd = child_command(argv, settings)
    except NotPython as e:
        raise click.UsageError(f"{e}. Give a Python command, e.g. tracekit record -- python train.py") from None
    # SystemExit, not click's Exit: the script's exit code must reach the shell however tracekit was started.
    sys.exit(run_child(cmd, child_env()))


def run_child(cmd, env) -> int:
    """Run the child, passing Ctrl-C, SIGTERM and SIGHUP on to it as a terminal would; return its exit code."""
    with Forwarder() as forwarder:
        try:
            proc = subprocess.Popen(cmd, env=env)
        except FileNotFoundError:
            raise click.UsageError(f"cannot run {cmd[0]!r}: not found") from None
        forwarder.started(proc)
        code = proc.wait()
    if code < 0:  # killed by a signal: report it the way a shell does
        return 128 - code
    sys.stdout.flush()
    return code
