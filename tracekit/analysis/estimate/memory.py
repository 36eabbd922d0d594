"""Napkin math, done carefully: bytes per GPU by category for a model shape and a training setup.

Model states follow the ZeRO paper (Rajbhandari et al. 2020): 16-bit weights
and gradients plus K bytes of optimizer state per parameter (K = 12 for
mixed-precision Adam: fp32 master weights, momentum, variance), sharded over
the data-parallel ranks by stage. Activations follow Korthikanti et al. 2022
("Reducing Activation Recomputation in Large Transformer Models"), term by
term, generalised to grouped-query attention, gated MLPs, any FFN width and
dtype: what autograd saves for backward in each layer. Every line carries the
formula it used, so a user can check it by hand.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

from ...errors import TracekitError
from ..categories import CATEGORIES
from .shapes import ModelShape, ParamCount

PRECISIONS = ("fp32", "amp", "mixed", "bf16", "fp16")
OPTIMIZERS = ("none", "sgd", "sgd-momentum", "adam", "adamw", "adam8bit", "adafactor")
STATES = {"none": 0, "sgd": 0, "sgd-momentum": 1, "adam": 2, "adamw": 2, "adam8bit": 2, "adafactor": 0}
QUANT = ("none", "8bit", "4bit")
CHECKPOINTING = ("none", "selective", "full")
ATTENTION = ("eager", "flash")
ALL_LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BNB_8BIT_BLOCK = 2048  # bitsandbytes 8-bit optimizers: one fp32 absmax per block of state
BNB_8BIT_MIN = 4096  # smaller tensors keep 32-bit state
NF4_BLOCK = 64  # bitsandbytes 4-bit: one absmax per 64 weights


@dataclass(frozen=True)
class Setup:
    """How the model is run. Sizes are per micro-batch; `seq` 0 leaves activations out."""

    mode: str = "train"  # train | inference
    precision: str = "fp32"  # see PRECISIONS
    optimizer: str = "adamw"
    quant: str = "none"
    quant_double: bool = False  # 4-bit: double quantization of the absmax
    lora_rank: int = 0
    lora_targets: tuple = ("q_proj", "k_proj", "v_proj", "o_proj")
    batch: int = 1
    seq: int = 0
    grad_accum: int = 1
    checkpointing: str = "none"
    attention: str = "eager"
    dropout: float | None = None  # None: the model's
    zero: int = 0
    dp: int = 1
    tp: int = 1
    offload_param: bool = False
    offload_optimizer: bool = False
    generate: int = 0  # inference: new tokens held in the KV cache
    kv_block_size: int = 0  # PagedAttention-style fixed-size cache blocks

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


@dataclass
class Estimate:
    shape: ModelShape
    setup: Setup
    params: int
    trainable_params: int
    lines: list = field(default_factory=list)
    assumptions: list = field(default_factory=list)

    def add(self, category, nbytes, formula, where="gpu"):
        self.lines.append(Line(category, int(round(nbytes)), formula, where))

    def per(self, where="gpu") -> dict:
        out = {c: 0 for c in CATEGORIES}
        for ln in self.lines:
            if ln.where == where:
                out[ln.category] = out.get(ln.category, 0) + ln.bytes
        out["total"] = sum(out.values())
        return out

    @property
    def per_gpu(self) -> dict:
        return self.per("gpu")

    @property
    def per_cpu(self) -> dict:
        return self.per("cpu")

    def to_dict(self) -> dict:
        return {"model": self.shape.to_dict(), "setup": asdict(self.setup), "per_gpu": self.per_gpu,
                "per_cpu": self.per_cpu, "params": self.params, "trainable_params": self.trainable_params,
                "lines": [asdict(ln) for ln in self.lines], "assumptions": list(self.assumptions)}


def weight_bytes(precision: str) -> int:
    """Bytes of a weight (and of its gradient) as held by the model."""
    return 4 if precision in ("fp32", "amp") else 2


def compute_bytes(precision: str) -> int:
    """Bytes of an activation value."""
    return 4 if precision == "fp32" else 2


def estimate(shape: ModelShape, setup: Setup) -> Estimate:
    """Predicted bytes per GPU (and per CPU when offloading) by category, with the formula of each line."""
    setup.check()
    if setup.tp > 1 and (shape.heads % setup.tp or shape.n_kv % setup.tp and shape.n_kv >= setup.tp):
        raise TracekitError(f"--tp {setup.tp} does not divide the {shape.heads} attention heads")
    if isinstance(shape, ParamCount):
        if setup.lora_rank or setup.optimizer == "adafactor" and shape.factored is None or setup.seq:
            raise TracekitError("--lora-rank, --optimizer adafactor and --seq need the model's shape "
                                "(--config or --hidden/--layers/...), not just --params")
    trainable = _trainable(shape, setup)
    est = Estimate(shape, setup, shape.params(), trainable)
    est.assumptions += list(shape.notes)
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
    return est


# -- model states ----------------------------------------------------------------
def _lora_params(shape: ModelShape, setup: Setup) -> int:
    targets = ALL_LINEAR if "all-linear" in setup.lora_targets else setup.lora_targets
    mats = [(i, o) for name, i, o, _ in shape.linears() if name in targets]
    if not mats:
        raise TracekitError(f"--lora-targets {','.join(setup.lora_targets)} matches none of "
                            f"{', '.join(n for n, *_ in shape.linears())}")
    return shape.layers * setup.lora_rank * sum(i + o for i, o in mats)


def _trainable(shape, setup) -> int:
    if setup.mode == "inference":
        return 0
    if isinstance(shape, ParamCount) and shape.trainable is not None:
        return shape.trainable
    return _lora_params(shape, setup) if setup.lora_rank else shape.params()


def _parameters(est: Estimate):
    shape, s = est.shape, est.setup
    w = weight_bytes(s.precision) if s.mode == "train" else compute_bytes(s.precision)
    n = shape.params()
    tp = f" / tp {s.tp}" if s.tp > 1 else ""
    if s.quant == "none":
        nbytes, formula = n * w / s.tp, f"{n:,} params × {w} B{tp}"
    else:
        lin = shape.linear_params()
        rows = shape.layers * sum(o for _, _, o, _ in shape.linears()) if isinstance(shape, ModelShape) else 0
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
                               f"biases in {w * 8}-bit; only the layers' nn.Linear weights are quantized")
    if s.zero == 3 and s.dp > 1:
        nbytes, formula = nbytes / s.dp, f"({formula}) / dp {s.dp} (ZeRO-3)"
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


def _shard(stage_needed: int, s: Setup) -> tuple[int, str]:
    if s.zero >= stage_needed and s.dp > 1:
        return s.dp, f" / dp {s.dp} (ZeRO-{s.zero})"
    return 1, ""


def _gradients(est: Estimate):
    s, n = est.setup, est.trainable_params
    g = 4 if s.lora_rank else weight_bytes(s.precision)
    div, text = _shard(2, s)
    tp = s.tp if not s.lora_rank else 1
    formula = f"{n:,} trainable × {g} B{f' / tp {tp}' if tp > 1 else ''}{text}"
    est.add("gradient", n * g / div / tp, formula)
    if s.grad_accum > 1:
        est.assumptions.append(f"gradient accumulation over {s.grad_accum} micro-batches keeps the gradients "
                               "between micro-batches; activations are per micro-batch")


def _optimizer(est: Estimate):
    s, shape, n = est.setup, est.shape, est.trainable_params
    if s.optimizer == "none" or n == 0:
        return
    # element size of the state: fp32, except pure 16-bit training where torch makes it like the weight
    e = 2 if s.precision in ("bf16", "fp16") and not s.lora_rank else 4
    parts, nbytes = [], 0
    if s.precision == "mixed" and not s.lora_rank:
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
    if s.optimizer in ("adam", "adamw", "adafactor"):
        est.assumptions.append("optimizer 'step' counters (one small tensor per parameter) are not counted")


def _small_tensor_params(shape: ModelShape) -> int:
    """Parameters in tensors under bitsandbytes' 8-bit minimum: norms and biases."""
    small = 0
    for _, i, o, b in shape.linears():
        if i * o < BNB_8BIT_MIN:
            small += i * o
        if b and o < BNB_8BIT_MIN:
            small += o
    small *= shape.layers
    norm = shape.hidden if shape.hidden < BNB_8BIT_MIN else 0
    norms = (2 * shape.layers + 1) * norm * (2 if shape.norm == "layernorm" else 1)
    return small + norms


def _adafactor_elements(shape: ModelShape, s: Setup) -> int:
    """torch.optim.Adafactor: rows + columns for each matrix (as the model fuses them), the full size for vectors."""
    mats = {name: (i, o) for name, i, o, _ in shape.linears()}
    groups = [[n] for n in mats]
    if shape.fused_qkv:
        groups = [["q_proj", "k_proj", "v_proj"]] + [g for g in groups if g[0] not in ("q_proj", "k_proj", "v_proj")]
    if shape.fused_gate_up and shape.gated:
        groups = [["gate_proj", "up_proj"]] + [g for g in groups if g[0] not in ("gate_proj", "up_proj")]
    per_layer = sum(mats[g[0]][0] + sum(mats[n][1] for n in g) for g in groups)
    per_layer += sum(o for _, _, o, b in shape.linears() if b) + 2 * shape.norm_params()
    if shape.qk_norm:
        per_layer += 2 * shape.norm_params(shape.d_head)
    n = shape.layers * per_layer + (shape.vocab + shape.hidden) + shape.norm_params()
    if shape.positions:
        n += shape.positions + shape.hidden
    if not shape.tied:
        n += shape.vocab + shape.hidden
    return n


# -- activations -------------------------------------------------------------------
def activation_terms(shape: ModelShape, s: Setup) -> list[tuple[str, float]]:
    """(what, bytes per token) saved for backward in one layer, after checkpointing and tensor parallelism."""
    B, h, tp = compute_bytes(s.precision), shape.hidden, s.tp
    hq, kv = shape.heads * shape.d_head, shape.n_kv * shape.d_head
    dropout = shape.dropout if s.dropout is None else s.dropout
    lora = set(ALL_LINEAR if "all-linear" in s.lora_targets else s.lora_targets) if s.lora_rank else None

    def saves_input(*names):  # a frozen linear does not keep its input for backward; a trained one does
        return lora is None or bool(lora & set(names))

    if shape.norm == "rmsnorm":
        norm = (4 * h + (B * h if lora is None else 0),
                "input in fp32" + (" + normalized (eager RMSNorm)" if lora is None else " (frozen weight)"))
    else:
        norm = (B * h, "input")
    kv_saved = hq if s.attention == "eager" else kv  # eager GQA repeats k and v to every head
    n_norms = 1 if shape.parallel_residual and shape.norm == "layernorm" else 2
    terms = [(f"{n_norms} norm{'s' if n_norms > 1 else ''}: {norm[1]}", n_norms * norm[0])]
    if saves_input("q_proj", "k_proj", "v_proj"):
        terms.append(("q, k, v projections' input", B * h))
    terms.append(("q, k, v" + (" (k, v repeated to every head)" if s.attention == "eager" and kv < hq else ""),
                  B * (hq + 2 * kv_saved) / tp))
    if saves_input("o_proj"):
        terms.append(("attention output (o_proj input)", B * hq / tp))
    if saves_input("gate_proj", "up_proj"):
        terms.append(("MLP input", B * h))
    ff = shape.d_ff / tp
    down = 1 if saves_input("down_proj") else 0
    if shape.gated:
        terms.append(("gated MLP: gate, act(gate), up" + (", product" if down else ""), (3 + down) * B * ff))
    elif shape.activation == "relu":
        terms.append(("MLP: relu output", B * ff))
    else:
        terms.append(("MLP: activation input" + (" and output" if down else ""), (1 + down) * B * ff))
    if lora:
        n_adapted = len([n for n, *_ in shape.linears() if n in lora])
        terms.append((f"LoRA: rank-{s.lora_rank} A outputs (fp32) of {n_adapted} adapted layers",
                       4 * s.lora_rank * n_adapted))
    if dropout:
        terms.append(("2 residual dropout masks (1 B)", 2 * h))
    if s.attention == "eager" and s.checkpointing == "none":
        if B == 4:
            terms.append(("attention scores: softmax (heads × seq)", B * shape.heads * s.seq / tp))
        else:
            terms.append((f"attention scores: softmax in fp32 and its {B * 8}-bit copy (heads × seq)",
                           (4 + B) * shape.heads * s.seq / tp))
        if dropout:
            terms.append(("attention dropout: mask (1 B) and output", (1 + B) * shape.heads * s.seq / tp))
    elif s.attention == "flash":
        terms.append(("flash attention log-sum-exp (fp32)", 4 * shape.heads / tp))
    return terms


def _activations(est: Estimate):
    shape, s = est.shape, est.setup
    B, h, L = compute_bytes(s.precision), shape.hidden, shape.layers
    tokens = s.batch * s.seq
    dropout = shape.dropout if s.dropout is None else s.dropout
    terms = activation_terms(shape, s)
    per_layer = sum(b for _, b in terms)
    detail = "; ".join(f"{w} {b:g}" for w, b in terms)
    if s.checkpointing == "full":
        est.add("activation", tokens * B * h * L,
                f"full checkpointing: each layer's input, batch {s.batch} × seq {s.seq} × {h} × {B} B × {L} layers")
        full = activation_terms(shape, Setup(**{**asdict(s), "checkpointing": "none"}))
        one = sum(b for _, b in full)
        est.add("activation", tokens * one,
                f"one layer recomputed during backward: batch × seq × {one:g} B/token")
    else:
        what = "selective checkpointing (attention scores recomputed), " if s.checkpointing == "selective" else ""
        est.add("activation", tokens * per_layer * L,
                f"{what}batch {s.batch} × seq {s.seq} × {L} layers × {per_layer:g} B/token ({detail})")
    frozen = bool(s.lora_rank)  # LoRA: the norms' weights and the output layer are frozen
    norm = (4 * h + (0 if frozen else B * h)) if shape.norm == "rmsnorm" else B * h
    tail = norm + (0 if frozen else B * h) + (h if dropout else 0)
    est.add("activation", tokens * tail, f"final norm and output layer input, batch × seq × {tail:g} B"
            + (" (+ embedding dropout mask)" if dropout else ""))
    est.add("activation", tokens * shape.vocab * 4 / s.tp,
            f"loss: log-softmax of the logits in fp32, batch × seq × vocab {shape.vocab:,} × 4 B"
            + (f" / tp {s.tp}" if s.tp > 1 else ""))
    est.add("temporary", 2 * tokens * shape.vocab * 4 / s.tp,
            "the loss's backward: gradients of the log-softmax and of the logits, 2 × batch × seq × vocab × 4 B")
    if B != 4:
        est.add("temporary", tokens * shape.vocab * B / s.tp,
                f"the {B * 8}-bit logits before the fp32 upcast, batch × seq × vocab × {B} B")
    est.assumptions.append("activations: what autograd saves in eager PyTorch per Korthikanti et al. 2022, "
                           "without the CUDA caching allocator's rounding")
    if s.lora_rank:
        est.assumptions.append("LoRA: frozen linears keep no input for backward; the first layer (whose input "
                               "needs no gradient) is counted like the others")
    if s.precision == "amp":
        n = shape.linear_params() + shape.vocab * shape.hidden
        est.add("activation", n * 2 / s.tp, f"autocast's 16-bit copies of the matmul weights, kept for backward: "
                                            f"{n:,} (layers' linears and the output layer) × 2 B")
        est.assumptions.append("amp: activations counted at 2 B, though autocast leaves norms and the residual "
                               "stream in fp32")


def _inference_activations(est: Estimate):
    shape, s = est.shape, est.setup
    B, h = compute_bytes(s.precision), shape.hidden
    tokens = s.batch * s.seq
    widest = max(shape.heads * s.seq if s.attention == "eager" else 0,
                 (3 if shape.gated else 2) * shape.d_ff) * B / s.tp
    est.add("temporary", tokens * (2 * h * B + widest),
            f"one forward, no grad (nothing is saved, so intermediates are temporaries): residual stream and its "
            f"input (2 × {h} × {B} B) + the widest intermediate ({widest:g} B) per token, "
            f"batch {s.batch} × seq {s.seq}")
    est.add("temporary", tokens * shape.vocab * B / s.tp, f"logits, batch × seq × vocab {shape.vocab:,} × {B} B")
    if s.generate:
        length = s.seq + s.generate
        held = length
        if s.kv_block_size:
            held = -(-length // s.kv_block_size) * s.kv_block_size
        kv = 2 * shape.layers * shape.n_kv * shape.d_head * B / s.tp
        est.add("activation", s.batch * length * kv,
                f"KV cache: layers × 2 × kv-heads {shape.n_kv} × head-dim {shape.d_head} × (seq + {s.generate}) "
                f"× batch × {B} B")
        if held > length:
            est.add("other", s.batch * (held - length) * kv,
                    f"KV cache blocks of {s.kv_block_size} tokens: {held - length} unused slots per sequence")
