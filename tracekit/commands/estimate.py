"""`tracekit estimate`: predicted bytes per GPU by category, from a config, a preset, shapes or --params."""
from __future__ import annotations

import click

from ..errors import TracekitError
from ._common import json_option, show, size_callback
from ._estimate_options import model_options, setup_from, setup_options, shape_from


@click.command("estimate")
@model_options
@setup_options
@click.option("--deepspeed", "deepspeed_table", is_flag=True,
              help="Also print DeepSpeed's own estimate_zero2/3 table (model states; --dp GPUs over --nodes).")
@click.option("--nodes", type=int, default=1, show_default=True, help="With --deepspeed: nodes.")
@click.option("--list-presets", is_flag=True, help="List the bundled model presets and exit.")
@click.option("--simulate", is_flag=True,
              help="Run the training step on fake tensors (transformers, no GPU, no weights) and predict the GPU's "
                   "max_memory_allocated with categories and lines at the peak.")
@click.option("--compare", "compare_path", metavar="FILE", type=click.Path(dir_okay=False, path_type=str),
              help="With --simulate: put the simulation beside a recording of the same workload.")
@click.option("--gpu", "gpu_name", metavar="NAME",
              help="The GPU to fit on (H100, A100-40GB, L4, RTX 4090, T4, ...); with --simulate also the one "
                   "whose kernels are simulated (default H100).")
@click.option("--largest", type=click.Choice(["batch", "seq"]),
              help="With --simulate: the largest micro-batch (or sequence) that fits --budget or --gpu, by "
                   "bisection over simulated runs.")
@click.option("--budget", metavar="SIZE", callback=size_callback,
              help="Memory to fit in (80GiB, 24GB...): default the --gpu's memory.")
@click.option("--save-trace", metavar="PATH", help="With --simulate: write the simulated stream (.pickle/.json).")
@json_option
def command(as_json, deepspeed_table, nodes, list_presets, simulate, compare_path, gpu_name, largest, budget,
            save_trace, **kw):
    """Predict memory per GPU by category: parameters, gradients, optimizer state, activations.

    \b
    tracekit estimate --config llama-3-8b --precision mixed --optimizer adamw --batch 1 --seq 4096
    tracekit estimate --config path/to/config.json --lora-rank 16 --quant 4bit --precision bf16 --seq 2048
    tracekit estimate --params 7.5B --precision mixed --optimizer adam --zero 3 --dp 64
    tracekit estimate --config config.json --batch 4 --seq 256 --precision amp --simulate --gpu A100-40GB
    tracekit estimate --config config.json --seq 2048 --precision amp --simulate --largest batch --gpu L4
    """
    from ..analysis.estimate import estimate, preset_names
    from ..render.estimate import deepspeed_rows

    if list_presets:
        click.echo("\n".join(preset_names()))
        return
    if simulate or compare_path or largest or save_trace:
        from . import _simulate
        if not simulate:
            raise TracekitError("--compare, --largest and --save-trace go with --simulate")
        _simulate.emit(_simulate.run(kw, gpu_name, compare_path, largest, budget, save_trace, as_json), as_json)
        return
    shape = shape_from(kw)
    if shape is None:
        raise TracekitError("say which model: --config PATH|PRESET, --params N, or --hidden/--layers/--heads/--vocab")
    est = estimate(shape, setup_from(kw))
    ds = deepspeed_rows(est, nodes) if deepspeed_table else None
    from ._simulate import formula_extras
    extras = formula_extras(kw, est, gpu_name, budget)
    if as_json:
        out = est.to_dict()
        if ds is not None:
            out["deepspeed"] = ds
        out.update(extras)
        show("estimate", out, as_json=True)
    else:
        from ..render import reporter
        from ..render.simulate import formula_extras_text

        click.echo(reporter("estimate", "text").render(est, ds) + formula_extras_text(extras))


