"""`tracekit estimate --simulate` (and --compare, --largest): the options, and the answer put together for the reporters.

The simulator (tracekit.simulate: torch and transformers) is imported only when asked for; the runs themselves and
the bisection over them are its (simulate/workload.py).
"""
from __future__ import annotations

from typing import Any

import click

from ..errors import TracekitError

# knobs the simulated step does not run: (option, value that is fine)
UNSUPPORTED = (("mode", "train", "--mode inference"), ("quant", "none", "--quant"), ("lora_rank", 0, "--lora-rank"),
               ("zero", 0, "--zero"), ("dp", 1, "--dp"), ("tp", 1, "--tp"), ("offload_param", "none", "--offload-param"),
               ("offload_optimizer", "none", "--offload-optimizer"), ("grad_accum", 1, "--grad-accum"),
               ("generate", 0, "--generate"), ("kv_block_size", 0, "--kv-block-size"))
SHAPE_FLAGS = ("hidden", "ffn", "layers", "heads", "kv_heads", "vocab", "head_dim", "activation_fn", "norm", "tied")


def check_options(kw) -> None:
    """Usage errors of --simulate, before anything is built."""
    if not kw.get("config"):
        raise TracekitError("--simulate builds the model from its config: give --config PATH|PRESET")
    if kw.get("params"):
        raise TracekitError("--simulate needs a model config, not --params")
    flags = [f"--{k.replace('_', '-')}" for k in SHAPE_FLAGS if kw.get(k) is not None]
    if flags:
        raise TracekitError(f"--simulate runs the config as it is; drop {', '.join(flags)} (or edit the config)")
    for key, fine, name in UNSUPPORTED:
        if kw.get(key) not in (None, fine):
            raise TracekitError(f"--simulate runs a plain training step; {name} is for the formulas (drop --simulate)")
    if kw.get("precision") == "mixed":
        raise TracekitError("--simulate runs --precision fp32, amp, bf16 or fp16 (mixed is DeepSpeed/Megatron's "
                            "16-bit weights with fp32 master copies: use the formulas)")
    if kw.get("optimizer") == "adam8bit":
        raise TracekitError("--simulate runs torch.optim optimizers; adam8bit (bitsandbytes) is for the formulas")
    if kw.get("checkpointing") == "selective":
        raise TracekitError("--simulate runs --checkpointing none or full (transformers' gradient_checkpointing_enable)")
    if not kw.get("seq"):
        raise TracekitError("--simulate needs --seq (tokens per sequence) and --batch")
    if kw.get("seq") < 0 or (kw.get("batch") is not None and kw.get("batch") < 1):
        raise TracekitError("--simulate needs --batch of at least 1 and a positive --seq")
    if kw.get("dropout") is not None:
        raise TracekitError("--simulate uses the config's dropout; drop --dropout (or edit the config)")


def run(kw, gpu_name, compare_path, largest, budget, save_trace, as_json):
    """The whole --simulate answer as a dict (rendered by render/simulate.py or printed as JSON)."""
    from ..analysis.estimate import simulate as sim
    from ..analysis.estimate.gpus import gpu as find_gpu
    from ..analysis.estimate.presets import read_config
    from ..io.progress import StderrProgress

    from ..simulate.workload import largest_fitting, simulate_once
    check_options(kw)
    gpu = find_gpu(gpu_name)
    if save_trace:
        from ..io.write import check_writable
        try:
            check_writable(save_trace)
        except ValueError as e:
            raise TracekitError(f"--save-trace: {e}") from None
    config = read_config(kw["config"])
    recorded = None
    if compare_path:  # read it first: a file that cannot be opened is said before a simulation runs
        from ..io import load
        recorded = load(compare_path)
    capacity = budget if budget is not None else gpu.memory
    out = {"gpu": {"name": gpu.name, "memory_bytes": gpu.memory, "compute_capability": list(gpu.sm)},
           "budget_bytes": budget}
    out["formula"] = _formula(kw)
    progress = StderrProgress("simulating")
    try:
        snap, trace = simulate_once(config, kw, gpu, progress=progress)
    except TracekitError as e:
        from ..simulate.workload import WorkloadError
        if isinstance(e, WorkloadError) or not (out["formula"] or {}).get("per_gpu"):
            raise  # the step would fail on the GPU too, or nothing to fall back on: the simulation's own line
        out.update(simulated=None, simulation_error=str(e), fallback="formula")
        return out
    finally:
        progress.close()
    peak = sim.simulated_peak(trace)
    tk = snap["tracekit"]["simulated"]
    simulated = peak.to_dict()
    simulated.update({"model_class": tk["model_class"], "sdpa_backends": tk["sdpa_backends"],
                      "torch": snap["tracekit"]["torch_version"], "transformers": tk["transformers_version"],
                      "workload": tk["workload"]})
    demand, by = sim.device_demand(trace)
    simulated["fits"] = sim.fits(demand, capacity, by)
    out["simulated"] = simulated
    out["param_count"] = {"params": tk["params"], "trainable_params": tk["trainable_params"],
                          "path": f"meta-device build (transformers {tk['transformers_version']})"}
    if save_trace:
        from ..io.write import write_snapshot
        out["saved_trace"] = write_snapshot(save_trace, snap)
    if recorded is not None:
        out["compare"] = sim.compare(trace, recorded)
        out["compare"]["file"] = compare_path
    if largest:
        out["largest"] = largest_fitting(config, kw, gpu, largest, capacity)
    return out


def _formula(kw):
    """The formula estimate's totals beside the simulation (None when the formulas do not know the model)."""
    from ._estimate_options import setup_from, shape_from
    from ..analysis.estimate import estimate
    try:
        est = estimate(shape_from(kw), setup_from(kw))
    except TracekitError as e:
        return {"error": str(e)}
    return {"per_gpu": est.per_gpu, "params": est.params, "estimate": est}


def emit(out, as_json):
    from ._common import show
    est = (out.get("formula") or {}).pop("estimate", None)
    if out.get("simulated") is None and "simulation_error" in out:
        click.echo(f"tracekit: --simulate: {out['simulation_error']}; the formula estimate follows", err=True)
        if as_json:
            show("estimate", dict(est.to_dict(), simulated=None, simulation_error=out["simulation_error"],
                                  fallback="formula", gpu=out["gpu"]), as_json=True)
        else:
            show("estimate", est)
        return
    show("simulate", out, as_json)


def formula_extras(kw, est, gpu_name, budget) -> dict:
    """For the formula path: which path counted the parameters (a meta-device build when transformers is
    installed and the config is used as it is, else the formulas), and whether the total fits --gpu/--budget."""
    from ..analysis.estimate import simulate as sim
    out: dict[str, Any] = {"param_count": param_count(kw, est)}
    if gpu_name or budget is not None:
        from ..analysis.estimate.gpus import gpu as find_gpu
        g = find_gpu(gpu_name) if gpu_name else None
        capacity = budget if budget is not None or g is None else g.memory
        out["gpu"] = {"name": g.name, "memory_bytes": g.memory, "compute_capability": list(g.sm)} if g else None
        out["fits"] = sim.fits(est.per_gpu["total"], capacity)
    return out


def param_count(kw, est) -> dict:
    formula = {"params": est.params, "trainable_params": est.trainable_params, "path": "formula"}
    if not kw.get("config"):
        return dict(formula, why="no config to build (shape flags or --params)")
    flags = [k for k in SHAPE_FLAGS if kw.get(k) is not None]
    if flags:
        return dict(formula, why="shape flags change the config, so the formula counts the changed shape")
    from ..analysis.estimate.presets import read_config
    from ..simulate.hf_model import exact_count, transformers_version
    if transformers_version() is None:
        return dict(formula, why="transformers is not installed (pip install 'torch-tracekit[hf]' counts exactly)")
    try:
        got = exact_count(read_config(kw["config"]))
    except TracekitError as e:
        return dict(formula, why=str(e))
    return {"params": got["params"], "trainable_params": got["trainable_params"], "path": got["path"],
            "model_class": got["model_class"], "tied": [list(t) for t in got["tied"]],
            "formula_params": est.params}
