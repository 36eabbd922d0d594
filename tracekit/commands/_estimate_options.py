"""The model and training-setup options shared by `estimate`, `whatif`, `report --estimate-config` and
`estimate --simulate`, and how their values become a ModelShape and a Setup (tracekit.analysis.estimate)."""
from __future__ import annotations

import functools

import click

from ..errors import TracekitError

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


def _knob(*decls, **attrs):
    return decls, attrs


KNOBS = [
    _knob("--mode", type=click.Choice(["train", "inference"]), default="train", show_default=True),
    _knob("--precision", type=click.Choice(["fp32", "amp", "mixed", "bf16", "fp16"]),
          help="amp: autocast, fp32 weights; mixed: 16-bit weights + fp32 master (DeepSpeed/Megatron; with --fsdp "
          "FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32): fp32 shards); "
          "bf16/fp16: pure 16-bit. Default fp32, or fp16 with --quant (as transformers loads bitsandbytes models)."),
    _knob("--optimizer", type=click.Choice(["none", "sgd", "sgd-momentum", "adam", "adamw", "adam8bit",
          "adafactor"]), default="adamw", show_default=True),
    _knob("--quant", type=click.Choice(["none", "8bit", "4bit"]), default="none", show_default=True),
    _knob("--double-quant", is_flag=True, help="4-bit: double quantization of the scales."),
    _knob("--lora-rank", type=int, default=0),
    _knob("--lora-targets", default="q_proj,k_proj,v_proj,o_proj", show_default=True,
          help="Comma-separated module names, or all-linear."),
    _knob("--batch", type=int, default=1, show_default=True, help="Micro-batch size."),
    _knob("--seq", type=int, default=0, help="Sequence length (0: no activations)."),
    _knob("--grad-accum", type=int, default=1, show_default=True),
    _knob("--checkpointing", type=click.Choice(["none", "selective", "full"]), default="none",
          show_default=True),
    _knob("--attention", type=click.Choice(["eager", "sdpa", "flash"]),
          help="transformers' attn_implementation: eager materializes the score matrix; sdpa and flash "
          "(flash_attention_2) do not (default: transformers' for the model: sdpa, eager for Gemma-2)."),
    _knob("--dropout", type=float, help="Dropout probability (default: the config's, else 0)."),
    _knob("--loss-only", is_flag=True, help="The training loop keeps only the loss, not the model's output "
          "(Hugging Face's Trainer): its logits are freed before backward."),
    _knob("--fused-optimizer", is_flag=True, help="torch.optim's fused=True (default foreach: one state-sized "
          "temporary during Adam's step)."),
    _knob("--zero", type=click.IntRange(0, 3), default=0, show_default=True),
    _knob("--fsdp", type=click.IntRange(min=2), help="PyTorch FSDP over N ranks (fully_shard per layer): "
          "parameters, gradients and optimizer state 1/N per rank, plus what FSDP2's step holds moment by moment "
          "(the root's and the computing layer's full parameters, --prefetch layers prefetched, full gradients, "
          "reduce-scatter buffers). Sets --zero 3 --dp N."),
    _knob("--prefetch", type=click.IntRange(min=0), default=1, show_default=True,
          help="With --fsdp: units all-gathered ahead of the one computing."),
    _knob("--reshard-after-forward/--no-reshard-after-forward", "reshard_after_forward", default=True,
          show_default=True, help="With --fsdp: free each unit's full parameters after its forward."),
    _knob("--dp", type=int, default=1, show_default=True, help="Data-parallel size."),
    _knob("--tp", type=int, default=1, show_default=True, help="Tensor-parallel size."),
    _knob("--offload-param", type=click.Choice(["none", "cpu"]), default="none", show_default=True),
    _knob("--offload-optimizer", type=click.Choice(["none", "cpu"]), default="none", show_default=True),
    _knob("--generate", type=int, default=0, help="Inference: KV cache for N new tokens."),
    _knob("--kv-block-size", type=int, default=0, help="KV cache in fixed-size blocks (PagedAttention)."),
]


def setup_options(f, defaults=True):
    """The training/inference knobs shared by estimate, whatif and report --estimate-config.

    defaults=False: every knob defaults to None (the recording says, unless given)."""
    for decls, attrs in reversed(KNOBS):
        attrs = dict(attrs)
        if not defaults and not attrs.get("is_flag"):
            attrs.update(default=None, show_default=False)
        f = click.option(*decls, **attrs)(f)
    return f


def shape_from(kw):
    """ModelShape (or ParamCount) from the model options; None when none was given."""
    from ..analysis.estimate.presets import load_shape
    from ..analysis.estimate.shapes import ModelShape, ParamCount

    flags = {k: kw.get(k) for k in SHAPE_FLAGS}
    extra = {"activation": kw.get("activation_fn"), "norm": kw.get("norm"), "tied": kw.get("tied")}
    _check_flags(flags)
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


_FLAG_KEYS = {"hidden": "hidden_size", "ffn": "intermediate_size", "layers": "num_hidden_layers",
              "heads": "num_attention_heads", "kv_heads": "num_key_value_heads", "vocab": "vocab_size",
              "head_dim": "head_dim"}


def _check_flags(flags):
    """The shape flags within the bounds a config's sizes have (presets.check_config), said as flags."""
    from ..analysis.estimate.presets import check_config

    given = {_FLAG_KEYS[k]: v for k, v in flags.items() if v is not None}
    check_config(given, "estimate", {key: "--" + k.replace("_", "-") for k, key in _FLAG_KEYS.items()})


FIELDS = {"double_quant": "quant_double"}  # knob -> Setup field, where they differ


def overrides_from(kw) -> dict:
    """Setup fields from the knobs that were given (None: not given)."""
    out, fsdp = {}, None
    for decls, _ in KNOBS:
        knob = decls[1] if len(decls) > 1 and decls[1].isidentifier() else decls[0].lstrip("-").replace("-", "_")
        value = kw.get(knob)
        if value is None or (knob in ("double_quant", "fused_optimizer", "loss_only") and not value):
            continue
        if knob == "fsdp":
            fsdp = value
            continue
        if knob == "lora_targets":
            value = tuple(t.strip() for t in value.split(",") if t.strip())
        elif knob in ("offload_param", "offload_optimizer"):
            value = value == "cpu"
        out[FIELDS.get(knob, knob)] = value
    if fsdp:  # --fsdp N is ZeRO-3 over N ranks, with FSDP's units counted (it wins over --zero / --dp)
        out.update(zero=3, dp=fsdp, fsdp=True)
    return out


def setup_from(kw):
    from ..analysis.estimate import Setup

    return Setup(**overrides_from(kw)).check()


def report_options(f):
    """`report --estimate-config PATH|PRESET [knobs]`: predicted vs measured for files recorded anywhere."""
    f = setup_options(f, defaults=False)
    return click.option("--estimate-config", metavar="PATH|PRESET",
                        help="Model config (or preset) to put predicted beside measured; the knobs "
                             "(--precision, --optimizer, --batch, --seq...) override what the recording says.")(f)


def report_spec(kw) -> dict:
    """What analysis.report.build_report(estimate=...) takes, from report's options."""
    config = kw.pop("estimate_config", None)
    overrides = overrides_from(kw)
    if not config:
        return {"shape": None, "overrides": overrides}
    from ..analysis.estimate.presets import load_shape

    return {"shape": load_shape(config), "overrides": overrides}
