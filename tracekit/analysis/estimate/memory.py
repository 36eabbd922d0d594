"""Napkin math, done carefully: bytes per GPU by category for a model shape and a training setup.

Model states follow the ZeRO paper (Rajbhandari et al. 2020): 16-bit weights
and gradients plus K bytes of optimizer state per parameter (K = 12 for
mixed-precision Adam: fp32 master weights, momentum, variance), sharded over
the data-parallel ranks by stage. Activations are what autograd saves for
backward, tensor by tensor as Hugging Face's decoder layers create them
(after Korthikanti et al. 2022, generalised to grouped-query attention,
gated MLPs, mixture-of-experts layers, any width and dtype), with what
autocast really keeps: an fp32 residual stream and fp32 norms, one 16-bit
copy of a linear's input per linear, 16-bit copies of the weights.

The peak is a moment, not a sum of maxima: each line says when it is live
(always, saved for backward, at the loss's backward, at the end of backward,
during the optimizer step), and the estimate is the largest of the step's
moments, with its composition. Every line carries its formula.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from ...errors import TracekitError
from ..categories import CATEGORIES
from .shapes import ACT_SAVED, ModelShape, ParamCount

PRECISIONS = ("fp32", "amp", "mixed", "bf16", "fp16")
OPTIMIZERS = ("none", "sgd", "sgd-momentum", "adam", "adamw", "adam8bit", "adafactor")
STATES = {"none": 0, "sgd": 0, "sgd-momentum": 1, "adam": 2, "adamw": 2, "adam8bit": 2, "adafactor": 0}
QUANT = ("none", "8bit", "4bit")
CHECKPOINTING = ("none", "selective", "full")
ATTENTION = ("eager", "sdpa", "flash")
# model types transformers runs with eager attention when no attn_implementation is given
EAGER_BY_DEFAULT = ("gemma2",)
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BNB_8BIT_BLOCK = 2048  # bitsandbytes 8-bit optimizers: one fp32 absmax per block of state
BNB_8BIT_MIN = 4096  # smaller tensors keep 32-bit state
NF4_BLOCK = 64  # bitsandbytes 4-bit: one absmax per 64 weights
MiB = 2**20
HOPPER_WORKSPACE = 32 * MiB  # torch's cuBLAS workspace per handle and stream on sm90 (CublasHandlePool.cpp)
OTHER_WORKSPACE = 4096 * 1024 * 2 + 16 * 1024 * 8  # ":4096:2:16:8", every other GPU

# when a line is live (see MOMENTS)
ALWAYS, SAVED, LOSS_FWD, LOSS_BWD, BWD_END, OPT_STEP, RECOMPUTE, GRADS, HELD = (
    "always", "saved", "loss forward", "loss backward", "end of backward", "optimizer step", "recompute",
    "gradients", "held")
# model types whose embeddings go through dropout (embd_pdrop, embedding_dropout)
EMBED_DROPOUT = {"gpt2", "gpt_neo", "gpt_bigcode", "gptj", "codegen", "phi", "starcoder2", ""}


@dataclass(frozen=True)
class Setup:
    """How the model is run. Sizes are per micro-batch; `seq` 0 leaves activations out."""

    mode: str = "train"  # train | inference
    precision: str = ""  # see PRECISIONS; "": fp32, or fp16 with --quant (transformers' bitsandbytes default)
    optimizer: str = "adamw"
    quant: str = "none"
    quant_double: bool = False  # 4-bit: double quantization of the absmax
    lora_rank: int = 0
    lora_targets: tuple = ("q_proj", "k_proj", "v_proj", "o_proj")
    batch: int = 1
    seq: int = 0
    grad_accum: int = 1
    checkpointing: str = "none"
    attention: str = ""  # "": transformers' default attn_implementation for the model (sdpa; eager for Gemma-2)
    dropout: float | None = None  # None: the model's
    zero: int = 0
    dp: int = 1
    fsdp: bool = False  # PyTorch FSDP (--fsdp N: zero 3 over dp N): units all-gathered for compute, counted
    prefetch: int = 1  # FSDP: units all-gathered ahead of the one computing (forward/backward prefetch)
    reshard_after_forward: bool = True  # FSDP: False keeps every unit unsharded from its forward to its backward
    tp: int = 1
    offload_param: bool = False
    offload_optimizer: bool = False
    generate: int = 0  # inference: new tokens held in the KV cache
    kv_block_size: int = 0  # PagedAttention-style fixed-size cache blocks
    fused_optimizer: bool = False  # torch.optim's fused=True (default: foreach on CUDA)
    loss_only: bool = False  # the loop keeps only the loss, not the model's output (Hugging Face's Trainer)
    cublas_workspace: int = HOPPER_WORKSPACE  # per cuBLAS handle; OTHER_WORKSPACE below Hopper
    precision_given: bool = field(default=True, compare=False)
    attention_given: bool = field(default=True, compare=False)

    def __post_init__(self):
        if not self.attention:
            object.__setattr__(self, "attention", "sdpa")
            object.__setattr__(self, "attention_given", False)
        if not self.precision:
            object.__setattr__(self, "precision", "fp16" if self.quant != "none" else "fp32")
            object.__setattr__(self, "precision_given", False)

    def check(self):
        for name, value, allowed in (("mode", self.mode, ("train", "inference")),
                                     ("precision", self.precision, PRECISIONS),
                                     ("optimizer", self.optimizer, OPTIMIZERS), ("quant", self.quant, QUANT),
                                     ("checkpointing", self.checkpointing, CHECKPOINTING),
                                     ("attention", self.attention, ATTENTION)):
            if value not in allowed:
                raise TracekitError(f"--{name} must be one of {', '.join(allowed)} (got {value!r})")
        if self.zero not in (0, 1, 2, 3):
            raise TracekitError(f"--zero must be 0, 1, 2 or 3 (got {self.zero})")
        for name in ("batch", "dp", "tp", "grad_accum"):
            if getattr(self, name) < 1:
                raise TracekitError(f"--{name.replace('_', '-')} must be at least 1")
        if self.seq < 0 or self.lora_rank < 0 or self.generate < 0 or self.kv_block_size < 0:
            raise TracekitError("--seq, --lora-rank, --generate and --kv-block-size cannot be negative")
        if self.cublas_workspace < 0:
            raise TracekitError("the cuBLAS workspace cannot be negative")
        if self.fsdp and (self.zero != 3 or self.dp < 2):
            raise TracekitError("--fsdp N shards over N ranks (ZeRO-3 semantics): N must be at least 2")
        if self.prefetch < 0:
            raise TracekitError("--prefetch cannot be negative")
        if self.offload_param and self.zero != 3:
            raise TracekitError("--offload-param cpu needs --zero 3 (only ZeRO-3 partitions parameters)")
        if self.mode == "train" and self.quant != "none" and not self.lora_rank:
            raise TracekitError("quantized weights cannot be trained directly: add --lora-rank (QLoRA)")
        return self


@dataclass
class Line:
    category: str
    bytes: int
    formula: str
    where: str = "gpu"  # gpu | cpu
    when: str = ALWAYS  # see MOMENTS
    key: str = ""  # what the line is, for FSDP's timeline ("layers", "tail", "log_softmax", "grad_shards", ...)
    share: dict | None = None  # FSDP's timeline: {moment: the fraction of the line live then}; None: by `when`


# the moments of a training step, and which lines are live at each (gradients also before backward when
# accumulating over micro-batches: see _moments)
MOMENTS: dict[str, Any] = {
    "train": [("loss forward", (ALWAYS, HELD, SAVED, LOSS_FWD)),
              ("loss backward", (ALWAYS, HELD, SAVED, LOSS_BWD)),
              ("end of backward", (ALWAYS, HELD, GRADS, BWD_END, RECOMPUTE)),
              ("optimizer step", (ALWAYS, HELD, GRADS, OPT_STEP))],
    "inference": [("forward", (ALWAYS, HELD, SAVED, LOSS_FWD, LOSS_BWD, BWD_END, OPT_STEP, RECOMPUTE, GRADS))],
}
MOMENT_TEXT = {
    "loss forward": "the forward pass's end, in the loss: everything saved for backward, and the logits' fp32 "
                    "copy while the log-softmax is made",
    "loss backward": "backward begins: the loss's gradients (vocabulary-wide, fp32) on top of the saved tensors",
    "end of backward": "backward has ended: every gradient is live, the saved tensors are freed",
    "optimizer step": "the optimizer step: gradients, states and the step's temporaries",
    "forward": "one forward pass",
}


@dataclass
class Estimate:
    shape: ModelShape
    setup: Setup
    params: int
    trainable_params: int
    lines: list = field(default_factory=list)
    assumptions: list = field(default_factory=list)
    # FSDP: the step's moments as [(name, what)], each line's `share` saying how much of it is live at each
    timeline: list | None = None

    def add(self, category, nbytes, formula, where="gpu", when=ALWAYS, key="", share=None):
        self.lines.append(Line(category, int(round(nbytes)), formula, where, when, key, share))

    def held(self, where="gpu") -> dict:
        """Each category's bytes when it is held (its lines summed), whatever the moment; "total" sums them."""
        out = {c: 0 for c in CATEGORIES}
        for ln in self.lines:
            if ln.where == where:
                out[ln.category] = out.get(ln.category, 0) + ln.bytes
        out["total"] = sum(out.values())
        return out

    def moments(self) -> list[dict]:
        """[{name, what, per_gpu: {category: bytes, total}}] for the step's moments, in order."""
        out = []
        if self.timeline is not None:
            for name, what in self.timeline:
                per = {c: 0 for c in CATEGORIES}
                for ln in self.lines:
                    if ln.where == "gpu" and ln.share and ln.share.get(name):
                        per[ln.category] = per.get(ln.category, 0) + int(round(ln.bytes * ln.share[name]))
                per["total"] = sum(per.values())
                out.append({"name": name, "what": what, "per_gpu": per})
            return out
        accumulating = self.setup.mode == "train" and self.setup.grad_accum > 1
        for name, live in MOMENTS[self.setup.mode]:
            if accumulating and name in ("loss forward", "loss backward"):
                live = live + (GRADS,)
            per = {c: 0 for c in CATEGORIES}
            for ln in self.lines:
                if ln.where == "gpu" and ln.when in live:
                    per[ln.category] = per.get(ln.category, 0) + ln.bytes
            per["total"] = sum(per.values())
            out.append({"name": name, "what": MOMENT_TEXT[name], "per_gpu": per})
        return out

    @property
    def peak_moment(self) -> dict:
        """The largest moment (the first of equals)."""
        ms = self.moments()
        return max(ms, key=lambda m: (m["per_gpu"]["total"], -ms.index(m)))

    def per(self, where="gpu") -> dict:
        """GPU: the composition at the peak moment (its total is the predicted peak); CPU: what is held there."""
        return dict(self.peak_moment["per_gpu"]) if where == "gpu" else self.held(where)

    @property
    def per_gpu(self) -> dict:
        return self.per("gpu")

    @property
    def per_cpu(self) -> dict:
        return self.per("cpu")

    def to_dict(self) -> dict:
        setup = asdict(self.setup)
        setup["lora_targets"] = list(self.setup.lora_targets)
        return {"model": self.shape.to_dict(), "setup": setup, "per_gpu": self.per_gpu,
                "per_cpu": self.per_cpu, "held_gpu": self.held("gpu"), "peak_moment": self.peak_moment["name"],
                "moments": self.moments(), "params": self.params, "trainable_params": self.trainable_params,
                "counted_by": getattr(self.shape, "counted_by", ""),
                "lines": [asdict(ln) for ln in self.lines], "assumptions": list(self.assumptions)}


def weight_bytes(precision: str) -> int:
    """Bytes of a weight (and of its gradient) as held by the model."""
    return 4 if precision in ("fp32", "amp") else 2


def compute_bytes(precision: str) -> int:
    """Bytes of an activation value a matmul makes."""
    return 4 if precision == "fp32" else 2


def stream_bytes(precision: str) -> int:
    """Bytes of the residual stream: fp32 under autocast (fp32 embeddings; adding a 16-bit output promotes)."""
    return 4 if precision in ("fp32", "amp") else 2


def estimate(shape: ModelShape, setup: Setup) -> Estimate:
    """Predicted bytes per GPU (and per CPU when offloading) by category and moment, with the formula of each line."""
    setup.check()
    if setup.tp > 1 and (shape.heads % setup.tp or shape.n_kv % setup.tp and shape.n_kv >= setup.tp):
        raise TracekitError(f"--tp {setup.tp} does not divide the {shape.heads} attention heads")
    if isinstance(shape, ParamCount):
        if setup.lora_rank or setup.optimizer == "adafactor" and shape.factored is None or setup.seq:
            raise TracekitError("--lora-rank, --optimizer adafactor and --seq need the model's shape "
                                "(--config or --hidden/--layers/...), not just --params")
    eager = (not setup.attention_given and setup.attention == "sdpa"
             and getattr(shape, "model_type", "") in EAGER_BY_DEFAULT)
    if eager:  # what transformers runs when the user sets no attn_implementation
        from dataclasses import replace

        setup = replace(setup, attention="eager", attention_given=False)
    trainable = _trainable(shape, setup)
    est = Estimate(shape, setup, shape.params(), trainable)
    est.assumptions += list(shape.notes)
    if eager:
        est.assumptions.append(f"eager attention: transformers runs {shape.model_type} with attn_implementation="
                               f"'eager' unless told otherwise (its attention logit soft-capping); --attention sdpa "
                               f"for the fused kernel")
    if not setup.precision_given and setup.quant != "none":
        est.assumptions.append(f"--quant {setup.quant} without --precision: the parts bitsandbytes leaves "
                               "unquantized in fp16, as transformers loads them (its torch_dtype default with "
                               "bitsandbytes)")
    _parameters(est)
    if setup.mode == "train":
        _gradients(est)
        _optimizer(est)
        if setup.seq:
            _activations(est)
    elif setup.seq:
        _inference_activations(est)
    if setup.seq:
        tokens = setup.batch * setup.seq
        est.add("input", tokens * 8, "batch × seq × 8 (int64 token ids; labels passed to the model add as much)")
        handles = 2 if setup.mode == "train" else 1
        if setup.cublas_workspace:
            est.add("other", handles * setup.cublas_workspace,
                    f"cuBLAS workspace: {handles} × {setup.cublas_workspace / MiB:g} MiB (torch allocates one per "
                    "cuBLAS handle and stream, handles are per thread: "
                    + ("the forward's and autograd's backward thread's" if handles == 2 else "the forward's")
                    + (", Hopper's default size)" if setup.cublas_workspace == HOPPER_WORKSPACE else ")"))
    if setup.fsdp and _fsdp_timeline_applies(shape, setup):
        _fsdp_timeline(est)
    m = est.peak_moment
    if setup.mode == "train":
        est.assumptions.append(f"the peak is the moment '{m['name']}' ({m['what']}); each step's moments: "
                               + ", ".join(f"{x['name']} {x['per_gpu']['total'] / 2**30:.3g} GiB"
                                           for x in est.moments()))
        est.assumptions.append("zero_grad(set_to_none=True) (torch's default) after each step: no gradients "
                               "live before backward" + (" except the ones accumulated over micro-batches"
                                                         if setup.grad_accum > 1 else ""))
    return est


# -- model states ----------------------------------------------------------------
def _lora_matrices(shape: ModelShape, setup: Setup) -> list[tuple[str, int, int, int]]:
    """(name, in, out, how many) of the matrices LoRA adapts: attention and dense MLPs (and shared experts);
    transformers 5 keeps routed experts as fused parameters, not nn.Linear, so PEFT does not adapt them."""
    targets = set(ALL_LINEAR if "all-linear" in setup.lora_targets else setup.lora_targets)
    mats = [(n.rsplit(".", 1)[-1], i, o, c) for n, i, o, _, c in shape.matrices()
            if n.rsplit(".", 1)[-1] in targets and not n.startswith(("experts.", "router"))]
    if not mats:
        raise TracekitError(f"--lora-targets {','.join(setup.lora_targets)} matches none of "
                            f"{', '.join(dict.fromkeys(n for n, *_ in shape.linears()))}")
    return mats


def _lora_params(shape: ModelShape, setup: Setup) -> int:
    return setup.lora_rank * sum((i + o) * c for _, i, o, c in _lora_matrices(shape, setup))


def _trainable(shape, setup) -> int:
    if setup.mode == "inference":
        return 0
    if isinstance(shape, ParamCount) and shape.trainable is not None:
        return shape.trainable
    return _lora_params(shape, setup) if setup.lora_rank else shape.params()


def _parameters(est: Estimate):
    shape, s = est.shape, est.setup
    w = weight_bytes(s.precision) if s.mode == "train" else compute_bytes(s.precision)
    if _fsdp_mixed(s):
        w = 4  # MixedPrecisionPolicy: the shards stay fp32 (they are the master weights)
    n = shape.params()
    tp = f" / tp {s.tp}" if s.tp > 1 else ""
    if s.quant == "none":
        nbytes, formula = n * w / s.tp, f"{n:,} params × {w} B{tp}"
    else:
        lin = shape.linear_params()
        rows = (sum(o * c for _, _, o, _, c in shape.matrices()) if isinstance(shape, ModelShape) else 0)
        qbytes: float
        if s.quant == "8bit":
            qbytes, qtext = lin + 4 * rows, f"{lin:,} linear weights × 1 B (int8) + {rows:,} rows × 4 B (fp32 scale)"
        else:
            per_block = (1 + 4 / 256) if s.quant_double else 4  # absmax bytes per block of 64
            qbytes = lin * 0.5 + lin / NF4_BLOCK * per_block
            qtext = (f"{lin:,} linear weights × 0.5 B (NF4) + absmax "
                     f"{'8-bit, double-quantized' if s.quant_double else 'fp32'} per {NF4_BLOCK}")
        rest = n - lin
        if isinstance(shape, ParamCount):
            est.assumptions.append("--params only: every parameter counted as a quantized linear weight")
        nbytes = (qbytes + rest * w) / s.tp
        formula = f"{qtext} + {rest:,} others (embeddings, output layer, norms, biases) × {w} B{tp}"
        est.assumptions.append("bitsandbytes keeps the embeddings, the output layer (lm_head), norms and "
                               f"biases in {w * 8}-bit; only the layers' matmul weights are quantized")
    if s.zero == 3 and s.dp > 1:
        nbytes, formula = nbytes / s.dp, f"({formula}) / dp {s.dp} ({'FSDP' if s.fsdp else 'ZeRO-3'})"
        if s.fsdp and _fsdp_timeline_applies(shape, s):
            formula += " (fp32 shards: MixedPrecisionPolicy computes in 16 bits)" if _fsdp_mixed(s) else ""
        elif s.fsdp:
            _unsharded(est, w)
        else:
            est.assumptions.append("ZeRO-3 also gathers each layer's full weights while it runs "
                                   "(about the largest layer; transient, not counted)")
    if s.lora_rank:
        lora = _lora_params(est.shape, s)
        est.add("parameter", lora * 4, f"LoRA adapters: {lora:,} params × 4 B (fp32) "
                                       f"(rank {s.lora_rank} on {', '.join(s.lora_targets)})")
    if s.offload_param:
        est.add("parameter", nbytes, formula + " (offloaded)", "cpu")
        largest = shape.largest_layer_params()
        est.add("parameter", largest * w, f"largest layer gathered: {largest:,} params × {w} B")
    else:
        est.add("parameter", nbytes, formula)


def fsdp_units(shape) -> tuple[int, int, int] | None:
    """(units, parameters of one layer unit, parameters of the root unit) when each layer is an FSDP unit and the
    root holds the rest (embeddings, final norm, output layer): how `fully_shard` is applied to a transformer."""
    layers = getattr(shape, "layers", 0)
    if isinstance(shape, ModelShape) and layers:
        per_layer = (shape.params() - shape.embedding_params() - shape.head_params()
                     - (shape.norm_params() if shape.final_norm else 0)) // layers
        return layers, per_layer, shape.params() - layers * per_layer
    if isinstance(shape, ParamCount) and shape.largest:
        return None
    return None


def _unsharded(est: Estimate, w: int):
    """FSDP: the full parameters of the units being computed, all-gathered (and freed on reshard)."""
    s, shape = est.setup, est.shape
    c = 2 if s.precision in ("mixed", "bf16", "fp16", "amp") and s.precision != "amp" else w
    got = fsdp_units(shape)
    if got is None:
        largest = shape.largest_layer_params()
        if largest:
            est.add("unsharded_parameter", largest * c, f"the computing unit all-gathered: largest layer "
                                                        f"{largest:,} params × {c} B", when=SAVED)
            if s.prefetch:
                est.add("communication", s.prefetch * largest * c,
                        f"all-gather output of {s.prefetch} prefetched unit(s): {s.prefetch} × {largest:,} params × "
                        f"{c} B", when=SAVED)
        est.assumptions.append("FSDP with --params only: a unit is taken as the largest layer (--largest-layer)")
        return
    layers, per_layer, root = got
    tp = f" / tp {s.tp}" if s.tp > 1 else ""
    est.add("unsharded_parameter", root * c / s.tp,
            f"root unit all-gathered (embeddings, final norm, output layer: {root:,} params × {c} B{tp}; the root "
            "is not resharded after forward)", when=SAVED)
    if s.reshard_after_forward:
        est.add("unsharded_parameter", per_layer * c / s.tp,
                f"the computing layer unit's full parameters (copied out of its all-gather): {per_layer:,} params × "
                f"{c} B{tp}", when=SAVED)
    else:
        est.add("unsharded_parameter", layers * per_layer * c / s.tp,
                f"every layer unit kept all-gathered from forward to backward (reshard_after_forward=False): "
                f"{layers} × {per_layer:,} params × {c} B{tp}", when=SAVED)
    if s.mode == "train" and not s.lora_rank:
        head = shape.head_params() or shape.vocab * shape.emb  # tied: the embedding is the output layer
        g = 4 if s.precision in ("fp32", "amp") else 2
        est.add("gradient", head * g / s.tp,
                f"the output layer's full gradient ({head:,} × {g} B{tp}): made first in backward, kept unsharded "
                "until the root unit reduce-scatters at the end of backward", when=LOSS_BWD)
    if s.prefetch:
        n = min(layers - 1, s.prefetch)
        est.add("communication", n * per_layer * c / s.tp,
                f"all-gather output of {n} unit{'s' if n > 1 else ''} prefetched (its full parameters before their "
                f"copy-out): {n} × {per_layer:,} params × {c} B{tp}", when=SAVED)
    g = 4 if s.precision in ("fp32", "amp") else 2
    est.add("communication", per_layer * g / s.tp,
            f"reduce-scatter input of the unit in backward: its full gradients, {per_layer:,} × {g} B{tp}",
            when=LOSS_BWD)
    est.assumptions.append(f"FSDP: each of the {layers} layers is a unit (fully_shard per layer, then the root), "
                           f"{s.prefetch} unit(s) prefetched (held in their all-gather outputs until their copy-out: "
                           "communication); units are all-gathered in "
                           f"{'16' if c == 2 else '32'}-bit; shards, gradients and optimizer state are 1/{s.dp} "
                           "per rank")


def _fsdp_mixed(s: Setup) -> bool:
    """--precision mixed under --fsdp: FSDP2's MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)."""
    return s.fsdp and s.precision == "mixed" and s.mode == "train"


def _fsdp_timeline_applies(shape, s: Setup) -> bool:
    """A training step of a transformer wrapped layer by layer: the moments of FSDP's timeline can be followed."""
    return (s.mode == "train" and fsdp_units(shape) is not None and not s.lora_rank and not s.offload_param
            and not s.offload_optimizer)


def _fsdp_timeline(est: Estimate):
    """FSDP2's step, moment by moment, on the rank: what `fully_shard` per decoder layer (then the root) holds at
    each moment where the peak can fall (torch/distributed/fsdp/_fully_shard, measured on the simulation):

    - forward: the root's full parameters (the root is not resharded after forward), each layer's all-gathered and
      freed after its forward (kept to backward with reshard_after_forward=False), the last all-gather's output kept
      until the next copy-out (implicit prefetching);
    - the loss's backward: the vocabulary-wide gradients; the root's pre-backward has prefetched the last layer;
    - the output layer's backward: the log-softmax is freed, the logits' gradient and the output layer's full
      gradient are live; that gradient stays unsharded (the root's) until the root reduce-scatters, last;
    - each layer's backward: its full parameters, the previous layer prefetched (its all-gather output), the
      layer after's reduce-scatter input (kept until this layer's reduce-scatter), the sharded gradients of the
      layers done, the activations of the layers still to go; inside the layer its MLP's gradients, at its end
      all its full gradients; then its reduce-scatter: input and output beside the full gradients;
    - the embedding's backward and the root's reduce-scatter; the end of backward; the optimizer step.
    """
    s, shape = est.setup, est.shape
    got = fsdp_units(shape)
    assert got is not None and isinstance(shape, ModelShape)
    L, PL, R = got
    tp = s.tp
    c = 4 if s.precision in ("fp32", "amp") else 2  # the unit's all-gathered parameters and full gradients
    rs = 2 if s.precision in ("bf16", "fp16") else 4  # reduce-scatter (MixedPrecisionPolicy's reduce_dtype fp32)
    cb, r = compute_bytes(s.precision), stream_bytes(s.precision)
    tokens = s.batch * s.seq
    V, emb, h = shape.vocab, shape.emb, shape.hidden
    head = shape.head_params() or V * emb
    P = shape.params()
    keep = not s.reshard_after_forward
    bits = f"{c * 8}-bit"
    ttp = f" / tp {tp}" if tp > 1 else ""

    layers = sorted({L - 1, L - 2, 1, 0} & set(range(L)), reverse=True)
    MLP, END, RS = "backward, MLP", "backward, end", "reduce-scatter"
    FWD = f"layer {L - 1} forward"
    text = {
        FWD: f"the last layer's forward begins: its all-gather output copied out into its full parameters while the "
             "previous layer's all-gather output is still held (freed when the copy-out returns)",
        "loss forward": "the forward pass's end, in the loss: everything saved for backward, the root's full "
                        "parameters, the last layer's all-gather output",
        "loss backward": "backward begins: the loss's gradients (vocabulary-wide, fp32) on top of the saved tensors",
        "output layer backward": "the output layer's backward: the logits' gradient and the layer's full weight "
                                 "gradient (kept unsharded until the root reduce-scatters), the log-softmax freed",
    }
    for i in layers:
        text[f"layer {i} {MLP}"] = (f"layer {i}'s backward, in its MLP: its full parameters, the gradients as wide as "
                                    "the MLP, activations of the layers still to go")
        text[f"layer {i} {END}"] = f"layer {i}'s backward ends: its full parameters and all its full gradients"
        text[f"layer {i} {RS}"] = (f"layer {i}'s reduce-scatter: its full gradients, the reduce-scatter's input and "
                                   "output")
    text["embedding backward"] = "the embedding's backward: its full gradient beside the output layer's"
    text["root reduce-scatter"] = "the root unit's reduce-scatter (embeddings, final norm, output layer)"
    text["end of backward"] = MOMENT_TEXT["end of backward"]
    text["optimizer step"] = MOMENT_TEXT["optimizer step"]
    names = list(text)
    est.timeline = [(n, text[n]) for n in names]
    front = ["loss forward", "loss backward", "output layer backward"]
    before = (L - 1) / L  # the layers before the last one, in forward
    backward = names[names.index("loss backward"):names.index("end of backward")]

    def every(f=1.0, among=None):
        return {n: f for n in (names if among is None else among)}

    def per_layer(fn):
        """{moment: fraction} from fn(i, kind) for each layer moment."""
        return {f"layer {i} {k}": fn(i, k) for i in layers for k in (MLP, END, RS)}

    emb_out = tokens * r * h if _stream_saved(shape, s) else 0
    for ln in est.lines:
        if ln.where != "gpu":
            continue
        if ln.when in (ALWAYS, HELD):
            ln.share = every()
        elif ln.key == "layers":  # layer i's saved tensors live until its backward
            ln.share = every(among=front) | per_layer(lambda i, k: (i + (k == MLP)) / L) | {FWD: before}
        elif ln.key == "tail":  # the final norm's and output layer's inputs go in its backward; the embedding's
            rest = min(1.0, emb_out / ln.bytes) if ln.bytes else 0.0   # output stays until layer 0's
            ln.share = every(among=front) | per_layer(lambda i, k: rest) | {FWD: rest}
        elif ln.key == "log_softmax":
            ln.share = every(among=front[:2])
        elif ln.when == SAVED:  # anything else saved for backward: as the layers', where per layer
            ln.share = every(among=front) | per_layer(lambda i, k: (i + (k == MLP)) / L) | {FWD: before}
        elif ln.when == RECOMPUTE:
            ln.share = per_layer(lambda i, k: float(k == MLP))
        elif ln.when == LOSS_FWD:
            ln.share = every(among=["loss forward"])
        elif ln.when == LOSS_BWD:
            ln.share = every(among=["loss backward"])
        elif ln.key == "grad_shards":  # the units reduce-scattered so far (a unit's output is made once its full
            # gradients are copied into the reduce-scatter input and freed), then every unit's
            ln.share = ({n: 1.0 for n in names} if s.grad_accum > 1 else
                        every(among=["end of backward", "optimizer step"])
                        | per_layer(lambda i, k: (L - 1 - i) * PL / P)
                        | {"embedding backward": L * PL / P, "root reduce-scatter": L * PL / P})
        elif ln.when == GRADS:
            ln.share = every(among=names[names.index("root reduce-scatter"):])
        elif ln.when == BWD_END:
            ln.share = every(among=["end of backward"])
        elif ln.when == OPT_STEP:
            ln.share = every(among=["optimizer step"])
        else:
            ln.share = every()

    # the root: all-gathered before the forward, not resharded after it, resharded after its backward
    est.add("unsharded_parameter", R * c / tp,
            f"root unit all-gathered (embeddings, final norm, output layer: {R:,} params × {c} B{ttp}): from the "
            "forward's start to its own backward's end (the root is not resharded after forward)",
            key="fsdp_root", share=every(among=names[:names.index("root reduce-scatter")]))
    if keep:
        est.add("unsharded_parameter", L * PL * c / tp,
                f"every layer unit unsharded from its forward to its backward (reshard_after_forward=False): "
                f"{L} × {PL:,} params × {c} B{ttp}", key="fsdp_layers",
                share=every(among=front + [FWD]) | per_layer(lambda i, k: (i + (k != RS)) / L))
    else:
        est.add("unsharded_parameter", PL * c / tp,
                f"the computing layer unit's full parameters (copied out of its all-gather): {PL:,} params × "
                f"{c} B{ttp}", key="fsdp_layer", share=per_layer(lambda i, k: float(k != RS)) | {FWD: 1.0})
    # all-gather outputs: the forward's last (kept until the next copy-out), the backward's prefetched
    n = max(1, min(L - 1, s.prefetch))
    ahead = {} if keep else ({"loss backward": min(s.prefetch, L) / n, "output layer backward": min(s.prefetch, L) / n}
                             | per_layer(lambda i, k: min(s.prefetch, i) / n))
    est.add("communication", n * PL * c / tp,
            f"all-gather output of {n} unit{'s' if n > 1 else ''} ({n} × {PL:,} params × {c} B{ttp}): the "
            "forward's last one, kept until the next copy-out; in backward the unit"
            f"{'s' if n > 1 else ''} prefetched ahead of the one computing"
            + (" (none: every unit is still unsharded)" if keep else ""),
            key="fsdp_all_gather", share={"loss forward": 1 / n, FWD: min(2, L) / n} | ahead)
    # gradients
    est.add("gradient", head * c / tp,
            f"the output layer's full gradient ({head:,} × {c} B{ttp}): made early in backward, kept unsharded until "
            "the root unit reduce-scatters at the end of backward",
            key="fsdp_head_grad", share=every(among=backward[1:]))
    tied = 2 if shape.tied else 1
    est.add("gradient", tied * V * emb * c / tp,
            f"the embedding's gradient ({V:,} × {emb} × {c} B{ttp}), made in its backward"
            + (", and its sum with the output layer's (tied: the autograd engine adds out of place, the output "
               "layer's gradient being a transposed view that keeps its base)" if shape.tied else ""),
            key="fsdp_embed_grad", share={"embedding backward": 1.0})
    if R > head:
        est.add("gradient", (R - head) * c / tp,
                f"the root's other full gradients ({R - head:,} × {c} B{ttp}: "
                + ("final norm" if shape.tied else "embedding, final norm") + ") at its reduce-scatter",
                key="fsdp_root_grads", share={"root reduce-scatter": 1.0})
    est.add("gradient", PL * c / tp,
            f"a layer unit's full gradients ({PL:,} × {c} B{ttp}): all made by its backward's end, freed after its "
            "reduce-scatter's copy-in", key="fsdp_layer_grads", share=per_layer(lambda i, k: float(k != MLP)))
    est.add("communication", PL * rs / tp,
            f"a layer unit's reduce-scatter input ({PL:,} × {rs} B{ttp}): kept until the next unit's "
            "reduce-scatter", key="fsdp_rs_input",
            share=per_layer(lambda i, k: float(k == RS or i < L - 1)) | {"embedding backward": 1.0})
    est.add("communication", R * rs / tp,
            f"the root unit's reduce-scatter input ({R:,} × {rs} B{ttp})", key="fsdp_root_rs",
            share={"root reduce-scatter": 1.0})
    # the working sets of backward
    if tokens:
        est.add("temporary", tokens * V * cb / tp,
                f"the logits' gradient in the output layer's backward ({cb * 8}-bit), batch × seq × vocab × {cb} B",
                key="fsdp_logits_grad", share={"output layer backward": 1.0})
        est.add("temporary", tokens * emb * cb / tp,
                f"the output layer's input gradient, batch × seq × {emb} × {cb} B",
                key="fsdp_head_dx", share={"output layer backward": 1.0})
        f = (shape.expert_ffn * shape.top_k if shape.experts and not shape.dense_layers else shape.d_ff) / tp
        wide = 2 if shape.gated else 1
        est.add("temporary", tokens * (wide * f * cb + r * h),
                f"in a layer's MLP backward: {wide + 1} gradients as wide as the MLP while down_proj's input is "
                f"freed (net {wide}) × {f:g} × {cb} B, and the residual stream's gradient {h} × {r} B, per token",
                key="fsdp_mlp_bwd", share=per_layer(lambda i, k: float(k == MLP)))
        est.add("gradient", h * f * c, f"down_proj's full weight gradient, made first in the layer's backward "
                f"({h} × {f:g} × {c} B)", key="fsdp_down_grad", share=per_layer(lambda i, k: float(k == MLP)))
        est.add("temporary", tokens * h * (r + 4 * 4),
                f"at a layer's backward end: the residual stream's gradient ({r} B) and the input norm's backward "
                f"(4 fp32 tensors as wide as the model), batch × seq × {h} × {r + 16} B",
                key="fsdp_end_bwd", share=per_layer(lambda i, k: float(k == END)))
        est.add("temporary", tokens * h * r, f"the residual stream's gradient, batch × seq × {h} × {r} B",
                key="fsdp_stream_grad", share=per_layer(lambda i, k: float(k == RS)))
    est.assumptions.append(
        f"FSDP2: each of the {L} layers is a unit (fully_shard per layer, then the root); "
        + (f"{s.prefetch} unit(s) prefetched in backward; " if not keep else "reshard_after_forward=False: every "
           "layer stays unsharded from its forward to its backward; ")
        + f"units all-gathered and their gradients made in {bits}"
        + (" (MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32): fp32 shards, reduce-scatter, "
           "gradients and AdamW state)" if _fsdp_mixed(s) else "")
        + f"; shards, gradients and optimizer state are 1/{s.dp} per rank; the peak is the largest of "
        f"{len(names)} moments of the step")


def _shard(stage_needed: int, s: Setup) -> tuple[int, str]:
    if s.zero >= stage_needed and s.dp > 1:
        return s.dp, f" / dp {s.dp} ({'FSDP' if s.fsdp else f'ZeRO-{s.zero}'})"
    return 1, ""


def _gradients(est: Estimate):
    s, n, shape = est.setup, est.trainable_params, est.shape
    g = 4 if s.lora_rank or _fsdp_mixed(s) else weight_bytes(s.precision)
    div, text = _shard(2, s)
    tp = s.tp if not s.lora_rank else 1
    formula = f"{n:,} trainable × {g} B{f' / tp {tp}' if tp > 1 else ''}{text}"
    est.add("gradient", n * g / div / tp, formula, when=GRADS, key="grad_shards")
    if s.grad_accum > 1:
        est.assumptions.append(f"gradient accumulation over {s.grad_accum} micro-batches keeps the gradients "
                               "between micro-batches; activations are per micro-batch")
    if isinstance(shape, ModelShape) and shape.tied and not s.lora_rank and div == 1:
        vh = shape.vocab * shape.emb
        est.add("temporary", vh * g / tp,
                f"tied embedding: the input embedding's gradient ({shape.vocab:,} × {shape.emb} × {g} B) made "
                "while the output layer's is held, then added to it (AccumulateGrad)", when=BWD_END)


def _optimizer(est: Estimate):
    s, shape, n = est.setup, est.shape, est.trainable_params
    if s.optimizer == "none" or n == 0:
        return
    # element size of the state: fp32, except pure 16-bit training where torch makes it like the weight
    e = 2 if s.precision in ("bf16", "fp16") and not s.lora_rank else 4
    nbytes: float
    parts, nbytes = [], 0
    if s.precision == "mixed" and not s.lora_rank and not s.fsdp:  # FSDP: the fp32 shards are the master
        nbytes += 4 * n
        parts.append("fp32 master weights 4 B")
    k = STATES[s.optimizer]
    if s.optimizer == "adam8bit":
        small = _small_tensor_params(shape) if isinstance(shape, ModelShape) and not s.lora_rank else 0
        big = n - small
        nbytes += big * 2 * (1 + 4 / BNB_8BIT_BLOCK) + small * 2 * 4
        parts.append(f"2 states × 1 B (+ fp32 absmax per {BNB_8BIT_BLOCK}); {small:,} params in tensors "
                     f"under {BNB_8BIT_MIN} elements keep 2 × 4 B")
    elif s.optimizer == "adafactor":
        factored = shape.factored if isinstance(shape, ParamCount) else _adafactor_elements(shape, s)
        assert factored is not None  # a ParamCount without trainable shapes gets no adafactor state (its setup says)
        nbytes += factored * e
        parts.append(f"factored second moment: {factored:,} values (rows + columns of each matrix) × {e} B")
    elif k:
        nbytes += k * e * n
        parts.append(f"{k} state{'s' if k > 1 else ''} × {e} B")
    div, text = _shard(1, s)
    tp = s.tp if not s.lora_rank else 1
    per = nbytes / n
    formula = (f"{n:,} trainable × {per:.4g} B ({' + '.join(parts)})"
               f"{f' / tp {tp}' if tp > 1 else ''}{text}")
    if s.offload_optimizer:
        est.add("optimizer_state", nbytes / div / tp, formula + " (offloaded)", "cpu")
        est.add("gradient", n * 4 / div / tp, f"fp32 gradient copy for the CPU optimizer: {n:,} × 4 B{text}", "cpu")
    else:
        est.add("optimizer_state", nbytes / div / tp, formula)
        # torch.optim's Adam/AdamW on CUDA default to foreach: _multi_tensor_adam takes the square root of every
        # exp_avg_sq at once (torch._foreach_sqrt), one state-sized list, before addcdiv
        if (s.optimizer in ("adam", "adamw") and not s.fused_optimizer and (s.precision != "mixed" or s.fsdp)
                and (s.zero == 0 or s.fsdp)):
            est.add("temporary", n * e / div / tp,
                    f"optimizer step: foreach Adam's sqrt(exp_avg_sq) for all {n:,} trainable at once × {e} B{text} "
                    "(torch.optim's default on CUDA; fused=True has none)", when=OPT_STEP)
    if s.optimizer in ("adam", "adamw", "adafactor"):
        est.assumptions.append("optimizer 'step' counters (one small tensor per parameter) are not counted")
    if (s.precision == "mixed" or s.zero) and not s.fsdp:
        est.assumptions.append("mixed precision / ZeRO: the optimizer is DeepSpeed's or Megatron's fused one "
                               "(no step temporaries counted)")


def _small_tensor_params(shape: ModelShape) -> int:
    """Parameters in tensors under bitsandbytes' 8-bit minimum: norms and biases."""
    small = 0
    for _, i, o, b, c in shape.matrices():
        if i * o < BNB_8BIT_MIN:
            small += i * o * c
        if b and o < BNB_8BIT_MIN:
            small += o * c
    norm = shape.hidden if shape.hidden < BNB_8BIT_MIN else 0
    norms = (shape.norms * shape.layers + 1) * norm * (2 if shape.norm == "layernorm" else 1)
    return small + norms


def _adafactor_elements(shape: ModelShape, s: Setup) -> int:
    """torch.optim.Adafactor: rows + columns for each matrix (as the model fuses them), the full size for vectors."""
    mats = {name: (i, o) for name, i, o, _ in shape.linears()}
    groups = [[n] for n in mats]
    if shape.fused_qkv and "q_proj" in mats:
        groups = [["q_proj", "k_proj", "v_proj"]] + [g for g in groups if g[0] not in ("q_proj", "k_proj", "v_proj")]
    if shape.fused_gate_up and shape.gated:
        groups = [["gate_proj", "up_proj"]] + [g for g in groups if g[0] not in ("gate_proj", "up_proj")]
    per_layer = sum(mats[g[0]][0] + sum(mats[n][1] for n in g) for g in groups)
    per_layer += sum(o for _, _, o, b in shape.linears() if b) + shape.layer_norms_params()
    n = shape.layers * per_layer + (shape.vocab + shape.emb) + (shape.norm_params() if shape.final_norm else 0)
    if shape.positions:
        n += shape.positions + shape.hidden
    if not shape.tied:
        n += shape.vocab + shape.emb
    return n


# -- activations -------------------------------------------------------------------
def _lora_set(s: Setup):
    return set(ALL_LINEAR if "all-linear" in s.lora_targets else s.lora_targets) if s.lora_rank else None


def _norm_terms(shape: ModelShape, s: Setup, width: int, where: str, frozen: bool) -> list[tuple[str, float]]:
    """What one norm saves besides its input (the residual stream, counted where it is made)."""
    p = s.precision
    if shape.norm in ("layernorm", "layernorm-nobias", "none"):
        return [(f"{where} LayerNorm: mean and rstd (fp32)", 8)]
    c = compute_bytes(p)
    if p in ("fp32", "amp"):  # the input is fp32: x.to(float32) is x itself, saved as the stream
        return [(f"{where} RMSNorm: rsqrt" + ("" if frozen else " and the normalized value in fp32"),
                 4 + (0 if frozen else 4 * width))]
    # 16-bit input: the fp32 copy (saved by pow and by x * rsqrt), the normalized value for the weight's gradient
    kept = 4 if shape.norm_fp32 else c  # Gemma keeps it fp32 until after the weight; Llama casts it back first
    return [(f"{where} RMSNorm: the fp32 copy of its input, rsqrt"
             + ("" if frozen else f", the normalized value ({kept * 8}-bit)"),
             4 * width + 4 + (0 if frozen else kept * width))]


def _stream_saved(shape: ModelShape, s: Setup) -> bool:
    """Does the norm reading the residual stream keep that tensor itself for backward?"""
    return shape.norm != "rmsnorm" or s.precision in ("fp32", "amp")


def _linear_inputs(shape: ModelShape, s: Setup, consumers: list[str], width: int, what: str,
                   lora) -> list[tuple[str, float]]:
    """The input a group of linears reading the same tensor keeps for their weights' gradients. Without autocast
    it is that tensor, kept once; under autocast each linear casts it to 16 bits itself and keeps its own copy
    (autocast caches casts of leaf tensors that require grad, i.e. the weights, not of activations)."""
    keeping = [n for n in consumers if lora is None or n in lora]
    if not keeping:
        return []
    if s.precision == "amp":
        return [(f"{what}: {len(keeping)} 16-bit cast{'s' if len(keeping) > 1 else ''} of the input "
                 f"({', '.join(keeping)}; autocast casts per linear)", 2 * width * len(keeping))]
    return [(f"{what}: the input (kept once for {', '.join(keeping)})", compute_bytes(s.precision) * width)]


def eager_attention(s: Setup) -> bool:
    return s.attention == "eager"


def _attention_terms(shape: ModelShape, s: Setup, lora) -> list[tuple[str, float]]:
    c, tp = compute_bytes(s.precision), s.tp
    q, kv, v, o = shape.q_width / tp, shape.kv_width / tp, shape.v_width / tp, shape.o_width / tp
    heads = shape.heads / tp
    terms: list[tuple[str, float]] = []
    if shape.mla:  # DeepSeek: the latent q and kv pass through RMSNorms; kv_b_proj's output stays (v is its view)
        lq, lkv, hh = shape.q_lora_rank, shape.kv_lora_rank, shape.heads / tp
        norm = 4 + (c if s.precision != "fp32" else 4)
        terms.append(("MLA: the latent q and kv norms (fp32 copy and normalized value)", norm * (lq + lkv)))
        terms.append(("MLA: kv_b_proj's output (k without rotary, and v)",
                      c * hh * (shape.qk_nope_dim + shape.v_head_dim)))
        terms.append(("MLA: q and k assembled (cat of the rotated and unrotated parts)", 2 * c * q))
        if eager_attention(s):
            terms.append(("attention scores: softmax in fp32" + (f" and its {c * 8}-bit copy" if c == 2 else ""),
                          ((4 + c) if c == 2 else 4) * heads * s.seq))
            terms.append(("attention output (o_proj's input)", c * o))
            return terms
        terms.append(("attention output" + (" and its contiguous copy" if c == 2 else ""),
                      (2 if c == 2 else 1) * c * o))
        terms.append(("attention log-sum-exp (fp32, per head)", 4 * heads))
        return terms
    if shape.qk_norm:
        per = 4 + (c if s.precision != "fp32" else 4)
        terms.append(("q and k norms: the fp32 copy and the normalized value", per * (q + kv)))
    if eager_attention(s):
        terms.append(("q, k, v" + (" (k and v repeated to every head: repeat_kv copies)" if kv < q else ""),
                      c * 3 * q))
        score = (4 + c) if c == 2 else 4
        if s.checkpointing != "selective":
            terms.append(("attention scores: softmax in fp32" + (f" and its {c * 8}-bit copy" if c == 2 else "")
                          + " (heads × seq)", score * heads * s.seq))
            drop = shape.dropout if s.dropout is None else s.dropout
            if drop and shape.model_type not in ("opt",):
                terms.append(("attention dropout: mask (1 B) and output", (1 + c) * heads * s.seq))
        if lora is None or "o_proj" in lora:  # kept by o_proj only (a frozen one keeps no input)
            terms.append(("attention output (the transpose's contiguous copy, o_proj's input)", c * o))
        return terms
    fused_view = shape.fused_qkv and not shape.mla
    if fused_view:
        roped = shape.rotary > 0
        terms.append(("fused q, k, v output (v" + (" and, unrotated, q, k" if not roped else "")
                      + " are views of it, so it stays)", c * (q + 2 * kv)))
        if roped:
            terms.append(("rotated q, k (new tensors)", c * (q + kv)))
    else:
        terms.append(("q, k, v as attention keeps them (k, v not repeated: SDPA's enable_gqa / flash)",
                      c * (q + kv + v)))
    terms.append((f"attention output ({'flash' if s.attention == 'flash' else 'SDPA'}: o_proj reads it)", c * o))
    # torch's flash kernel returns its output in the memory order of q: where q comes out of a concatenation
    # (partial rotary's cat, MLA's q assembly) that order is (batch, heads, seq), and the model's
    # transpose(1, 2).contiguous() copies it; the fp32 (memory-efficient) kernel writes (batch, seq, heads)
    if c == 2 and 0 < shape.rotary < 1:
        terms.append(("attention output's contiguous copy (q comes from a concatenation)", c * o))
    terms.append(("attention log-sum-exp (fp32, per head)", 4 * heads))
    return terms


def _mlp_terms(shape: ModelShape, s: Setup, lora, moe: bool) -> list[tuple[str, float]]:
    c, tp, h = compute_bytes(s.precision), s.tp, shape.hidden
    act = shape.act
    extra = ACT_SAVED.get(act, 1)
    down = lora is None or "down_proj" in lora
    if not moe:
        f = shape.d_ff / tp
        if shape.gated:
            return [(f"gated MLP: gate (kept by {act}), {act}(gate), up" + (", their product" if down else "")
                     + (f" (+{extra - 1} more kept by {act})" if extra > 1 else ""),
                     (extra + 2 + down) * c * f)]
        n = extra + (1 if down or act == "relu" else 0)
        return [(f"MLP: {act} keeps {extra} tensor{'s' if extra != 1 else ''} as wide as the MLP"
                 + (", its output feeds the down projection" if down else ""), n * c * f)]
    fe = (shape.expert_ffn or shape.d_ff) / tp
    k, E = shape.top_k, shape.experts
    terms: list[tuple[str, float]] = [(f"router: softmax of {E} expert scores (fp32)", 4 * E),
             (f"experts: per routed token-slot (top {k}): its input, gate_up, {act}(gate), the product, the output",
              k * c * (2 * h + 4 * fe + (extra - 1) * fe))]
    if s.precision == "amp":
        terms.append(("router: 16-bit cast of its input", 2 * h))
    if shape.shared_ffn:
        fs = shape.shared_ffn / tp
        terms.append(("shared expert: gate, act, up, product", (extra + 3) * c * fs))
        if s.precision == "amp":
            terms.append(("shared expert: 16-bit casts of its input (gate, up)", 2 * 2 * h))
        if shape.shared_gate:
            terms.append(("shared expert gate: sigmoid", c))
    return terms


def activation_terms(shape: ModelShape, s: Setup, moe: bool = False) -> list[tuple[str, float]]:
    """(what, bytes per token) saved for backward in one layer (an MoE one with moe=True), as Hugging Face's
    decoder layers make them, before checkpointing; divided by tensor parallelism where it shards."""
    h = shape.hidden
    r = stream_bytes(s.precision)
    lora = _lora_set(s)
    frozen = lora is not None  # LoRA: the norms' weights are frozen
    dropout = shape.dropout if s.dropout is None else s.dropout
    terms: list[tuple[str, float]] = []
    residuals = 1 if shape.parallel_residual else 2
    if _stream_saved(shape, s):
        terms.append((f"residual stream: {residuals} sum{'s' if residuals > 1 else ''} per layer in "
                       f"{'fp32' if r == 4 else '16-bit'}, kept by the next norm", residuals * r * h))
    pre = 1 if shape.parallel_residual and shape.norms == 1 else (0 if shape.norm_layout == "post" else 2)
    post = {"post": 2, "sandwich": 2}.get(shape.norm_layout, 0)
    for i in range(pre):
        terms += _norm_terms(shape, s, h, "pre-attention" if i == 0 else "pre-MLP", frozen)
    for i in range(post):  # Gemma-2/3, OLMo-2: norms on the attention and MLP outputs (16-bit in, fp32 copy kept)
        terms += [(f"post-{'attention' if i == 0 else 'MLP'} norm: the fp32 copy of its input, rsqrt, the "
                   "normalized value (fp32)", 4 * h + 4 + 4 * h)]
    attn_in = ["q_a_proj" if shape.q_lora_rank else "q_proj", "kv_a_proj_with_mqa"] if shape.mla else (
        ["qkv_proj"] if shape.fused_qkv else ["q_proj", "k_proj", "v_proj"])
    mlp_in = (["router", "gate_proj", "up_proj"] if shape.shared_ffn else ["router"]) if moe else (
        ["gate_up_proj"] if shape.fused_gate_up else (["gate_proj", "up_proj"] if shape.gated else ["up_proj"]))
    lora_names = None if lora is None else lora | ({"qkv_proj"} if lora & {"q_proj", "k_proj", "v_proj"} else set()) | (
        {"gate_up_proj"} if lora & {"gate_proj", "up_proj"} else set())
    if moe:
        mlp_in = []  # the experts' and router's inputs are counted with them
    if shape.parallel_residual and shape.norms == 1 and s.precision != "amp":
        terms += _linear_inputs(shape, s, attn_in + mlp_in, h, "attention and MLP", lora_names)
    else:
        terms += _linear_inputs(shape, s, attn_in, h, "attention", lora_names)
        if mlp_in:
            terms += _linear_inputs(shape, s, mlp_in, h, "MLP", lora_names)
    terms += _attention_terms(shape, s, lora)
    terms += _mlp_terms(shape, s, lora, moe)
    if lora:
        n_adapted = len([n for n, *_ in shape.linears() if n in lora])
        terms.append((f"LoRA: rank-{s.lora_rank} A outputs (fp32) of {n_adapted} adapted layers",
                       4 * s.lora_rank * n_adapted))
    if dropout:
        terms.append((f"{residuals} residual dropout mask{'s' if residuals > 1 else ''} (1 B)", residuals * h))
    return [(w, b) for w, b in terms if b]


def _activations(est: Estimate):
    shape, s = est.shape, est.setup
    c, r, h, V = compute_bytes(s.precision), stream_bytes(s.precision), shape.hidden, shape.vocab
    tokens = s.batch * s.seq
    dropout = shape.dropout if s.dropout is None else s.dropout
    kinds = [(False, shape.dense_layers), (True, shape.moe_layers)]
    for moe, count in kinds:
        if not count:
            continue
        terms = activation_terms(shape, s, moe)
        per_layer = sum(b for _, b in terms)
        detail = "; ".join(f"{w} {b:g}" for w, b in terms)
        label = "MoE layers" if moe else ("dense layers" if shape.experts else "layers")
        if s.checkpointing == "full":
            est.add("activation", tokens * r * h * count,
                    f"full checkpointing: each layer's input, batch {s.batch} × seq {s.seq} × {h} × {r} B × "
                    f"{count} {label}", when=SAVED, key="layers")
            if moe == (shape.moe_layers > 0):
                est.add("activation", tokens * per_layer,
                        f"one layer recomputed during backward: batch × seq × {per_layer:g} B/token ({detail})",
                        when=RECOMPUTE)
        else:
            what = "selective checkpointing (attention scores recomputed), " if s.checkpointing == "selective" else ""
            est.add("activation", tokens * per_layer * count,
                    f"{what}batch {s.batch} × seq {s.seq} × {count} {label} × {per_layer:g} B/token ({detail})",
                    when=SAVED, key="layers")
    # the embedding's output (layer 0's input), the final norm, the output layer's input
    frozen = bool(s.lora_rank)
    tail: list[tuple[str, float]] = [("the embedding's output (layer 0's input)" + (" + positions" if shape.positions else ""),
             r * h if _stream_saved(shape, s) else 0)]
    if shape.embed_norm:
        tail.append(("embedding LayerNorm: its output, mean and rstd", r * h + 8))
    if shape.final_norm:
        tail += _norm_terms(shape, s, h, "final", frozen)
    if not frozen:
        tail.append(("the output layer's input" + (" (its 16-bit cast)" if s.precision == "amp" else ""),
                     c * shape.emb))
    embed = dropout if s.dropout is not None or shape.embed_dropout is None else shape.embed_dropout
    if embed and shape.model_type in EMBED_DROPOUT:
        tail.append(("embedding dropout mask (1 B)", h))
    tail = [(w, b) for w, b in tail if b]
    est.add("activation", tokens * sum(b for _, b in tail),
            "batch × seq × (" + " + ".join(f"{w} {b:g}" for w, b in tail) + ") B", when=SAVED, key="tail")
    # the loss: Hugging Face's ForCausalLMLoss upcasts the logits (logits.float()), cross_entropy keeps its log-softmax
    est.add("activation", tokens * V * 4 / s.tp,
            f"loss: log-softmax of the fp32 logits (ForCausalLMLoss upcasts them), batch × seq × vocab {V:,} × 4 B"
            + (f" / tp {s.tp}" if s.tp > 1 else ""), when=SAVED, key="log_softmax")
    if s.loss_only:
        est.add("temporary", tokens * V * c / s.tp,
                f"the logits ({c * 8}-bit) until the loss is made (the loop keeps only the loss: they are freed "
                f"with the model's output), batch × seq × vocab × {c} B", when=LOSS_FWD)
    else:
        est.add("activation", tokens * V * c / s.tp,
                f"the logits ({c * 8}-bit), held by the model's output until the step ends (out = model(...); "
                f"out.loss.backward()), batch × seq × vocab × {c} B", when=HELD)
        est.assumptions.append(f"the loop keeps the model's output (its logits, {tokens * V * c / s.tp / 2**20:.1f} "
                               "MiB) through the step, as `out = model(**batch); out.loss.backward()` does; one that "
                               "keeps only the loss (Hugging Face's Trainer; --loss-only) peaks lower by that much")
    if shape.model_type == "gemma2":
        est.add("activation", tokens * V * c / s.tp,
                "Gemma-2's final logit soft-capping: tanh of the logits, kept for backward", when=SAVED)
    if c != 4:
        est.add("temporary", tokens * V * 4 / s.tp,
                "the loss's fp32 copy of the logits (logits.float()), freed once the log-softmax is made, "
                "batch × seq × vocab × 4 B", when=LOSS_FWD)
    est.add("temporary", 2 * tokens * V * 4 / s.tp,
            "the loss's backward: gradients of the log-softmax's output and input, 2 × batch × seq × vocab × 4 B",
            when=LOSS_BWD)
    if s.precision == "amp":
        mats = shape.linear_params() if s.checkpointing != "full" else 0
        n = mats + V * shape.emb
        est.add("activation", n * 2 / s.tp,
                f"autocast's 16-bit copies of the matmul weights, kept for backward: {n:,} "
                + ("(layers' linears and the output layer)" if mats else "(the output layer: checkpointed layers "
                   "recast theirs when they recompute)") + " × 2 B", when=SAVED)
    est.assumptions.append("activations: what autograd saves in Hugging Face's eager PyTorch code, tensor by "
                           f"tensor ({s.attention} attention), without the CUDA caching allocator's rounding")
    if s.lora_rank:
        est.assumptions.append("LoRA: frozen linears keep no input for backward; the first layer (whose input "
                               "needs no gradient) is counted like the others")
    if s.precision == "amp":
        est.assumptions.append("amp: autocast keeps the residual stream and norms in fp32, casts each linear's "
                               "input to 16 bits per linear, and caches one 16-bit copy of each weight")
    if shape.experts:
        est.assumptions.append("MoE: activations of transformers' expert loop, per routed token-slot (top-k); "
                               "a grouped-GEMM kernel keeps about as much")
    if s.attention != "eager":
        est.assumptions.append("SDPA/flash: no padding mask, so transformers passes enable_gqa and k, v are "
                               "not repeated to every head")


def _inference_activations(est: Estimate):
    shape, s = est.shape, est.setup
    B, h = compute_bytes(s.precision), shape.hidden
    tokens = s.batch * s.seq
    ffn = shape.expert_ffn * shape.top_k if shape.experts else shape.d_ff
    widest = max(shape.heads * s.seq if s.attention == "eager" else 0, (3 if shape.gated else 2) * ffn) * B / s.tp
    est.add("temporary", tokens * (2 * h * B + widest),
            f"one forward, no grad (nothing is saved, so intermediates are temporaries): residual stream and its "
            f"input (2 × {h} × {B} B) + the widest intermediate ({widest:g} B) per token, "
            f"batch {s.batch} × seq {s.seq}")
    if s.generate:  # generate() asks for the last position's logits only (logits_to_keep=1), copied to fp32
        est.add("temporary", s.batch * shape.vocab * (B + 4) / s.tp,
                f"logits of the last position only (generate's logits_to_keep=1) and their fp32 copy, "
                f"batch × vocab {shape.vocab:,} × ({B} + 4) B")
    else:
        est.add("temporary", tokens * shape.vocab * B / s.tp, f"logits, batch × seq × vocab {shape.vocab:,} × {B} B")
    if s.generate:
        length = s.seq + s.generate
        held = length
        if s.kv_block_size:
            held = -(-length // s.kv_block_size) * s.kv_block_size
        per_tok = (shape.kv_lora_rank + shape.qk_rope_dim) if shape.mla else 2 * shape.n_kv * shape.d_head
        kv = shape.layers * per_tok * B / s.tp
        what = ("compressed kv (kv_lora_rank + rope dims)" if shape.mla else
                f"2 × kv-heads {shape.n_kv} × head-dim {shape.d_head}")
        est.add("kv_cache", s.batch * length * kv,
                f"KV cache: layers × {what} × (seq + {s.generate}) × batch × {B} B")
        if held > length:
            est.add("other", s.batch * (held - length) * kv,
                    f"KV cache blocks of {s.kv_block_size} tokens: {held - length} unused slots per sequence")
