"""`tracekit demo`: record a small model's training steps here and open the result."""
from __future__ import annotations

import importlib.util
import os

import click

from ..io.cache.folder import cache_dir
from .view import UserError, window_problem


def default_path() -> str:
    """demo.pickle in tracekit's cache folder ($TRACEKIT_CACHE_DIR, else the user cache folder)."""
    return os.path.join(cache_dir(), "demo.pickle")


def viewer_problem() -> str | None:
    """Why the viewer will not open here (no display, not installed, missing system libraries), or None."""
    if not (os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY")):
        return "no display"
    return window_problem()


@click.command("demo")
@click.option("-o", "--output", default=None,
              help="File to write (default: demo.pickle in the cache folder, see `tracekit cache`).")
@click.option("--steps", type=click.IntRange(min=1), default=3, show_default=True, help="Training steps recorded.")
@click.option("--backend", type=click.Choice(["auto", "cuda", "cpu"]), default="auto", show_default=True)
@click.option("--no-open", is_flag=True, help="Only record; do not open the viewer or print the report.")
def command(output, steps, backend, no_open):
    """Record a small GPT-like model's AdamW steps (CUDA if available, else CPU) and open the result.

    The viewer opens when there is a display and it is installed; otherwise
    the text report is printed.
    """
    if importlib.util.find_spec("torch") is None:
        raise UserError("the demo records a model and needs torch: pip install 'torch-tracekit[record]'")
    import torch

    from ..record import record_steps
    from ..record.toy import make_training

    device = "cuda" if backend != "cpu" and torch.cuda.is_available() else "cpu"
    path = os.path.abspath(output or default_path())
    click.echo(f"tracekit demo: recording {steps} training steps of a small GPT on {device}...", err=True)
    model, optimizer, step = make_training(seed=0, device=device)
    written = record_steps(step, steps=steps, warmup=1, path=path, model=model, optimizer=optimizer, backend=backend)
    if not written:
        raise click.ClickException("the recording could not be written (see the warnings above)")
    click.echo(f"tracekit demo: wrote {written}", err=True)
    if no_open:
        return
    why = viewer_problem()
    if why is not None and why != "no display":
        click.echo(f"tracekit demo: {why}; showing the text report instead", err=True)
    ctx = click.get_current_context()
    group = ctx.find_root().command  # the tracekit group: its commands come with the same error guard
    return ctx.invoke(group.get_command(ctx, "view" if why is None else "report"), files=(written,))
