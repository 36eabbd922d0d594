"""`tracekit estimate`: predicted bytes per GPU by category, from a config, a preset, shapes or --params."""
from __future__ import annotations

import functools

import click

from ..errors import TracekitError
from ._common import echo_json, json_option

class Count(click.ParamType):
    """A parameter count: 8030261248, 8.03e9, 8.03B, 350M, 65k."""

    name = "N"
    SCALE = {"": 1, "k": 1e3, "m": 1e6, "b": 1e9, "g": 1e9, "t": 1e12}

    def convert(self, value, param, ctx):
        if isinstance(value, int):
            return value
        text = str(value).strip().lower().replace(",", "").replace("_", "")
        unit = text[-1:] if text[-1:] in self.SCALE and text[-1:] else ""
        try:
            return int(round(float(text[:len(text) - len(unit)]) * self.SCALE[unit]))
        except ValueError:
            self.fail(f"{value!r} is not a count (try 7.5e9, 7.5B or 350M)", param, ctx)


COUNT = Count()
SHAPE_FLAGS = ("hidden", "ffn", "layers", "heads", "kv_heads", "vocab", "head_dim")


def model_options(f):
    """--config/--params and the shape flags (they override a config)."""
    opts = [
        click.option("--config", "config", metavar="PATH|PRESET",
                     help="A Hugging Face config.json (or its folder), or a preset: tracekit estimate --list-presets."),
        click.option("--params", type=COUNT, help="Only a parameter count: 7.5e9, 7.5B, 350M (model states only)."),
        click.option("--largest-layer", type=COUNT, help="With --params: the largest layer's parameters (DeepSpeed)."),
        click.option("--hidden", type=int), click.option("--ffn", type=int),
        click.option("--layers", type=int), click.option("--heads", type=int),
        click.option("--kv-heads", type=int), click.option("--vocab", type=int),
        click.option("--head-dim", type=int),
        click.option("--activation-fn", type=click.Choice(["relu", "gelu", "swiglu"])),
        click.option("--norm", type=click.Choice(["layernorm", "rmsnorm"]),
                     help="Normalization (shape flags alone: layernorm)."),
        click.option("--tied/--untied", default=None, help="Output layer shares the token embedding."),
    ]
    return functools.reduce(lambda g, o: o(g), reversed(opts), f)


def setup_options(f):
    """The training/inference knobs shared by estimate, whatif and report --estimate-config."""
    opts = [
        click.option("--mode", type=click.Choice(["train", "inference"]), default="train", show_default=True),
        click.option("--precision", type=click.Choice(["fp32", "amp", "mixed", "bf16", "fp16"]), default="fp32",
                     show_default=True, help="amp: autocast, fp32 weights; mixed: 16-bit weights + fp32 master "
                                             "(DeepSpeed/Megatron); bf16/fp16: pure 16-bit."),
        click.option("--optimizer", type=click.Choice(["none", "sgd", "sgd-momentum", "adam", "adamw", "adam8bit",
                                                       "adafactor"]), default="adamw", show_default=True),
        click.option("--quant", type=click.Choice(["none", "8bit", "4bit"]), default="none", show_default=True),
        click.option("--double-quant", is_flag=True, help="4-bit: double quantization of the scales."),
        click.option("--lora-rank", type=int, default=0),
        click.option("--lora-targets", default="q_proj,k_proj,v_proj,o_proj", show_default=True,
                     help="Comma-separated module names, or all-linear."),
        click.option("--batch", type=int, default=1, show_default=True, help="Micro-batch size."),
        click.option("--seq", type=int, default=0, help="Sequence length (0: no activations)."),
        click.option("--grad-accum", type=int, default=1, show_default=True),
        click.option("--checkpointing", type=click.Choice(["none", "selective", "full"]), default="none",
                     show_default=True),
        click.option("--attention", type=click.Choice(["eager", "flash"]), default="eager", show_default=True,
                     help="eager materializes the score matrix; flash (fused/SDPA) does not."),
        click.option("--dropout", type=float, help="Dropout probability (default: the config's, else 0)."),
        click.option("--zero", type=click.IntRange(0, 3), default=0, show_default=True),
        click.option("--dp", type=int, default=1, show_default=True, help="Data-parallel size."),
        click.option("--tp", type=int, default=1, show_default=True, help="Tensor-parallel size."),
        click.option("--offload-param", type=click.Choice(["none", "cpu"]), default="none", show_default=True),
        click.option("--offload-optimizer", type=click.Choice(["none", "cpu"]), default="none", show_default=True),
        click.option("--generate", type=int, default=0, help="Inference: KV cache for N new tokens."),
        click.option("--kv-block-size", type=int, default=0, help="KV cache in fixed-size blocks (PagedAttention)."),
    ]
    return functools.reduce(lambda g, o: o(g), reversed(opts), f)


def shape_from(kw):
    """ModelShape (or ParamCount) from the model options; None when none was given."""
    from ..analysis.estimate.presets import load_shape
    from ..analysis.estimate.shapes import ModelShape, ParamCount

    flags = {k: kw.get(k) for k in SHAPE_FLAGS}
    extra = {"activation": kw.get("activation_fn"), "norm": kw.get("norm"), "tied": kw.get("tied")}
    if kw.get("config"):
        if kw.get("params"):
            raise TracekitError("give --config or --params, not both")
        return load_shape(kw["config"]).with_(**flags, **extra)
    if kw.get("params"):
        return ParamCount(kw["params"], kw.get("largest_layer") or 0)
    if any(v is not None for v in flags.values()):
        missing = [f"--{k}" for k in ("hidden", "layers", "heads", "vocab") if not flags.get(k)]
        if missing:
            raise TracekitError(f"shape flags need {', '.join(missing)} too (or use --config / --params)")
        return ModelShape(**{k: v for k, v in flags.items() if v is not None},
                          **{k: v for k, v in extra.items() if v is not None})
    return None


def setup_from(kw):
    from ..analysis.estimate import Setup

    return Setup(mode=kw["mode"], precision=kw["precision"], optimizer=kw["optimizer"], quant=kw["quant"],
                 quant_double=kw["double_quant"], lora_rank=kw["lora_rank"],
                 lora_targets=tuple(t.strip() for t in kw["lora_targets"].split(",") if t.strip()),
                 batch=kw["batch"], seq=kw["seq"], grad_accum=kw["grad_accum"], checkpointing=kw["checkpointing"],
                 attention=kw["attention"], dropout=kw["dropout"], zero=kw["zero"], dp=kw["dp"], tp=kw["tp"],
                 offload_param=kw["offload_param"] == "cpu", offload_optimizer=kw["offload_optimizer"] == "cpu",
                 generate=kw["generate"], kv_block_size=kw["kv_block_size"]).check()


@click.command("estimate")
@model_options
@setup_options
@click.option("--deepspeed", "deepspeed_table", is_flag=True,
              help="Also print DeepSpeed's own estimate_zero2/3 table (model states; --dp GPUs over --nodes).")
@click.option("--nodes", type=int, default=1, show_default=True, help="With --deepspeed: nodes.")
@click.option("--list-presets", is_flag=True, help="List the bundled model presets and exit.")
@json_option
def command(as_json, deepspeed_table, nodes, list_presets, **kw):
    """Predict memory per GPU by category: parameters, gradients, optimizer state, activations.

    \b
    tracekit estimate --config llama-3-8b --precision mixed --optimizer adamw --batch 1 --seq 4096
    tracekit estimate --config path/to/config.json --lora-rank 16 --quant 4bit --precision bf16 --seq 2048
    tracekit estimate --params 7.5B --precision mixed --optimizer adam --zero 3 --dp 64
    """
    from ..analysis.estimate import estimate, preset_names
    from ..render_estimate import deepspeed_rows, estimate_text

    if list_presets:
        click.echo("\n".join(preset_names()))
        return
    shape = shape_from(kw)
    if shape is None:
        raise TracekitError("say which model: --config PATH|PRESET, --params N, or --hidden/--layers/--heads/--vocab")
    est = estimate(shape, setup_from(kw))
    ds = deepspeed_rows(est, nodes) if deepspeed_table else None
    if as_json:
        out = est.to_dict()
        if ds is not None:
            out["deepspeed"] = ds
        echo_json(out)
    else:
        click.echo(estimate_text(est, ds))
