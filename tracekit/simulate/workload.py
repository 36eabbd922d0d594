"""`tracekit estimate --simulate`: a Hugging Face config's training step, run on the simulated GPU.

The model is built from its config on the meta device (no weights, no download), then the built-in training
script (hf_step.py: model to the device, batch in, forward under the workload's precision, loss, backward,
optimizer step, zero_grad) runs inside `runner.simulation` exactly as a user's script would under
`tracekit simulate`. The result is the snapshot `-o` writes (output.py), which analysis/estimate/simulate.py
reads like any recording (the caching-allocator model's figures, categories and lines at the peak).
Also here: the answers built on simulated runs (`simulate_once`, the largest batch that fits).
"""
from __future__ import annotations

import contextlib
import gc
import os
from dataclasses import dataclass

from .engine import SimulationError, WorkloadError  # noqa: F401 - the errors estimate reports

PRECISIONS = ("fp32", "amp", "bf16", "fp16")
OPTIMIZERS = ("none", "sgd", "sgd-momentum", "adam", "adamw", "adafactor")
FORMAT = "tracekit-simulated-2"


@dataclass
class Workload:
    config: dict
    batch: int = 1
    seq: int = 512
    precision: str = "amp"
    optimizer: str = "adamw"
    checkpointing: str = "none"  # none | full (transformers' gradient_checkpointing_enable())
    sm: tuple = (9, 0)  # the GPU's compute capability (SDPA backend, cuBLAS workspace size)
    warmup: int = 1
    steps: int = 1
    lr: float = 1e-4
    seed: int = 0
    gpu: str | None = None  # the card's name (memory, context); None: the card of that compute capability

    def check(self):
        if self.precision not in PRECISIONS:
            raise SimulationError(f"--simulate runs precision {', '.join(PRECISIONS)} (got {self.precision!r})")
        if self.optimizer not in OPTIMIZERS:
            raise SimulationError(f"--simulate runs optimizers {', '.join(OPTIMIZERS)} (got {self.optimizer!r})")
        if self.checkpointing not in ("none", "full"):
            raise SimulationError(f"--simulate runs checkpointing none or full (got {self.checkpointing!r})")
        if self.batch < 1 or self.seq < 1:
            raise SimulationError("--simulate needs --batch and --seq of at least 1")
        if self.steps < 1 or self.warmup < 0:
            raise SimulationError("--simulate needs at least one measured step")
        return self


def card_for(w: Workload):
    """The card a workload runs on: by name, else the first of the table with its compute capability; its memory
    never limits a planning run (the fit is judged afterwards against --gpu / --budget)."""
    from dataclasses import replace

    from ..analysis.estimate.gpus import GPUS, gpu
    if w.gpu:
        g = gpu(w.gpu)
    else:
        g = next((x for x in GPUS if tuple(x.sm) == tuple(w.sm)), None) or replace(gpu(None), sm=tuple(w.sm))
    return replace(g, memory=1 << 50, context_bytes=0)


def simulate(w: Workload, progress=None) -> dict:
    """Run the workload on the simulated GPU and return the snapshot-format dict of its request stream."""
    w.check()
    from .hf_model import build_meta, import_transformers, unique_parameters
    torch, transformers = import_transformers()
    from torch._subclasses.fake_tensor import UnsupportedOperatorException

    from . import hf_step
    from .output import snapshot
    from .runner import SimulatedMarks, simulation

    if w.config.get("is_encoder_decoder"):
        raise SimulationError("--simulate trains decoder-only causal language models (this config is encoder-decoder)")
    model = build_meta(w.config)
    vocab = int(getattr(model.config, "vocab_size", 0) or 0)
    if not vocab:
        raise SimulationError("the config has no vocab_size: cannot make token ids for the batch")
    if not hasattr(model, "get_output_embeddings") or model.get_output_embeddings() is None:
        raise SimulationError(f"{type(model).__name__} has no language-model head: --simulate trains causal LMs")
    unique = unique_parameters(model)
    params = int(sum(p.numel() for p in unique))
    trainable = int(sum(p.numel() for p in unique if p.requires_grad))
    try:
        with contextlib.ExitStack() as stack:
            stack.enter_context(_quiet())
            session = stack.enter_context(simulation(card_for(w), marks=False))
            session.marks = SimulatedMarks(session)
            torch.set_grad_enabled(True)
            run = hf_step.TrainingStep(w, model, session)
            run.setup()
            total = w.warmup + w.steps
            for i in range(total):
                if progress:
                    progress(i / total, f"simulating step {i + 1} of {total}")
                run.step(i)
            del run
            gc.collect()
            sdpa = dict(session.composites.used)
            snap = snapshot(session, infer=True, extra={
                "workload": {"batch": w.batch, "seq": w.seq, "precision": w.precision, "optimizer": w.optimizer,
                             "checkpointing": w.checkpointing, "sm": list(w.sm), "warmup": w.warmup, "steps": w.steps},
                "model_class": type(model).__name__, "params": params, "trainable_params": trainable,
                # scaled_dot_product_attention calls per step, by the backend a CUDA run takes
                "sdpa_backends": {k: v // max(1, total) for k, v in sdpa.items()},
                "transformers_version": str(transformers.__version__)})
    except SimulationError:
        raise
    except UnsupportedOperatorException as e:
        raise SimulationError(f"an operator has no fake implementation ({e}): use the formulas (without "
                              "--simulate)") from None
    except MemoryError:
        raise SimulationError("the simulation ran out of host memory") from None
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        if os.environ.get("TRACEKIT_DEBUG"):
            raise
        raise SimulationError(f"the simulated step failed: {type(e).__name__}: {first}"[:400]) from None
    snap["tracekit"]["format"] = FORMAT
    return snap


@contextlib.contextmanager
def _quiet():
    """transformers' advice and torch's fake-tensor error logs are not for the user: the one line we raise is."""
    import logging
    import warnings
    loggers = [logging.getLogger(n) for n in ("transformers", "torch._subclasses.fake_tensor", "torch._subclasses")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.CRITICAL if lg.name.startswith("torch") else logging.ERROR)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


# -- runs for estimate ---------------------------------------------------------------------------------------

def workload_from(config: dict, kw, gpu, batch=None, seq=None) -> Workload:
    """The workload of `tracekit estimate --simulate`'s options."""
    return Workload(config=config, batch=batch or kw.get("batch") or 1, seq=seq or kw["seq"],
                    precision=kw.get("precision") or "fp32", optimizer=kw.get("optimizer") or "adamw",
                    checkpointing=kw.get("checkpointing") or "none", sm=gpu.sm, gpu=gpu.name)


def simulate_once(config: dict, kw, gpu, batch=None, seq=None, progress=None):
    """(snapshot dict, Trace) of one simulated run."""
    from ..io import to_trace
    snap = simulate(workload_from(config, kw, gpu, batch, seq), progress=progress)
    return snap, to_trace(snap, "<simulated>")


def largest_fitting(config, kw, gpu, what, capacity) -> dict:
    """Bisection over simulated runs: the largest batch (or seq) whose simulated reserved peak fits `capacity`."""
    from ..analysis.estimate import simulate as sim
    from ..io.progress import StderrProgress

    def evaluate(n):
        progress = StderrProgress(f"simulating {what} {n}")
        try:
            _, trace = simulate_once(config, kw, gpu, batch=n if what == "batch" else None,
                                     seq=n if what == "seq" else None, progress=progress)
        finally:
            progress.close()
        return sim.device_demand(trace)[0]  # what the run reserves (warm-up included) must fit

    if what == "seq":
        limit = max_positions(config) or (1 << 20)
        start = kw["seq"]
    else:
        limit, start = 1 << 16, kw.get("batch") or 1
    got = sim.largest_fitting(evaluate, capacity, start=start, limit=limit)
    got["what"] = what
    got["limit"] = limit
    got["fixed"] = {"seq": kw["seq"]} if what == "batch" else {"batch": kw.get("batch") or 1}
    return got


def max_positions(config) -> int | None:
    for k in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
        v = config.get(k)
        if isinstance(v, int) and v > 0:
            return v
    return None
