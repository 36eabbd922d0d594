"""A decoder-only transformer's shape, read from a Hugging Face config.json, and its exact parameter count.

Covers the Llama family (Llama, Mistral, Qwen2/3, Phi-3: RMSNorm, gated MLP,
grouped-query attention) and the GPT family (GPT-2, GPT-NeoX: LayerNorm with
bias, plain MLP). Counts follow the modules those architectures build, so a
count is exact, not GPT-style napkin (12·L·h²).
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace

from ...errors import TracekitError

GATED = {"swiglu", "geglu"}
# tie_word_embeddings defaults of config classes (PretrainedConfig itself: True)
TIED_DEFAULT = {"llama": False, "mistral": False, "mixtral": False, "qwen2": False, "qwen3": False,
                     "phi3": False, "gpt_neox": False, "gpt2": True}


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    vocab: int
    ffn: int = 0  # 0: 4 × hidden
    kv_heads: int = 0  # 0: heads (no grouped-query attention)
    head_dim: int = 0  # 0: hidden // heads
    activation: str = "swiglu"  # swiglu (gated, three matrices) | gelu | relu
    norm: str = "layernorm"  # layernorm (weight and bias) | rmsnorm (weight only)
    qkv_bias: bool = False
    out_bias: bool = False  # attention output projection
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3: an RMSNorm over head_dim on queries and keys
    tied: bool = False  # the output layer reuses the token embedding
    positions: int = 0  # learned position embeddings (GPT-2); 0 for rotary
    dropout: float = 0.0
    fused_qkv: bool = False  # one matrix for q, k, v (GPT-2, GPT-NeoX, Phi-3): matters to Adafactor's state
    fused_gate_up: bool = False  # Phi-3
    parallel_residual: bool = False  # GPT-NeoX: attention and MLP norms read the same input
    name: str = "custom"
    notes: tuple = field(default=(), compare=False)

    def __post_init__(self):
        for k in ("hidden", "layers", "heads", "vocab", "ffn", "kv_heads", "head_dim", "positions"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < (1 if k in ("hidden", "layers", "heads",
                                                                                    "vocab") else 0):
                raise TracekitError(f"model shape needs a {'positive' if k in ('hidden', 'layers', 'heads', 'vocab') else 'non-negative'} "
                                    f"whole {k} (got {v!r})")
        if not self.head_dim and self.hidden % self.heads:
            raise TracekitError(f"hidden {self.hidden} is not a multiple of heads {self.heads}; give --head-dim")
        if self.kv_heads and self.heads % self.kv_heads:
            raise TracekitError(f"heads {self.heads} is not a multiple of kv-heads {self.kv_heads}")

    # -- derived sizes -------------------------------------------------------
    @property
    def d_ff(self) -> int:
        return self.ffn or 4 * self.hidden

    @property
    def n_kv(self) -> int:
        return self.kv_heads or self.heads

    @property
    def d_head(self) -> int:
        return self.head_dim or self.hidden // self.heads

    @property
    def gated(self) -> bool:
        return self.activation in GATED

    def with_(self, **changes) -> "ModelShape":
        return replace(self, **{k: v for k, v in changes.items() if v is not None})

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("notes")
        return d

    # -- parameters ----------------------------------------------------------
    def linears(self) -> list[tuple[str, int, int, bool]]:
        """(name, in_features, out_features, has_bias) of one layer's matrices."""
        h, q, kv = self.hidden, self.heads * self.d_head, self.n_kv * self.d_head
        out = [("q_proj", h, q, self.qkv_bias), ("k_proj", h, kv, self.qkv_bias),
               ("v_proj", h, kv, self.qkv_bias), ("o_proj", q, h, self.out_bias)]
        if self.gated:
            out += [("gate_proj", h, self.d_ff, self.mlp_bias), ("up_proj", h, self.d_ff, self.mlp_bias)]
        else:
            out += [("up_proj", h, self.d_ff, self.mlp_bias)]
        return out + [("down_proj", self.d_ff, h, self.mlp_bias)]

    def norm_params(self, width=None) -> int:
        width = width or self.hidden
        return width * (2 if self.norm == "layernorm" else 1)

    def layer_params(self) -> int:
        n = sum(i * o + (o if b else 0) for _, i, o, b in self.linears())
        n += 2 * self.norm_params()
        if self.qk_norm:
            n += 2 * self.norm_params(self.d_head)
        return n

    def embedding_params(self) -> int:
        return self.vocab * self.hidden + self.positions * self.hidden

    def head_params(self) -> int:
        return 0 if self.tied else self.vocab * self.hidden

    def params(self) -> int:
        """Exact parameter count (shared embeddings counted once, as model.parameters() does)."""
        return (self.embedding_params() + self.layers * self.layer_params() + self.norm_params()
                + self.head_params())

    def linear_params(self) -> int:
        """Parameters in the layers' nn.Linear weights (what LoRA targets and bitsandbytes quantizes)."""
        return self.layers * sum(i * o for _, i, o, _ in self.linears())

    def largest_layer_params(self) -> int:
        """The most parameters any one module holds directly (DeepSpeed's "largest layer")."""
        mats = [i * o + (o if b else 0) for _, i, o, b in self.linears()]
        return max(mats + [self.vocab * self.hidden])


def _get(cfg, *keys, default=None):
    for k in keys:
        if cfg.get(k) is not None:
            return cfg[k]
    return default


def from_hf_config(cfg: dict, name="config") -> ModelShape:
    """ModelShape from a Hugging Face config.json dict (Llama, Mistral, Qwen2/3, Phi-3, GPT-2, GPT-NeoX...)."""
    if not isinstance(cfg, dict):
        raise TracekitError(f"{name}: a config must be a JSON object")
    mt = str(cfg.get("model_type", "")).lower()
    if "text_config" in cfg and "hidden_size" not in cfg:
        return from_hf_config(cfg["text_config"], name)
    hidden = _get(cfg, "hidden_size", "n_embd", "d_model")
    layers = _get(cfg, "num_hidden_layers", "n_layer", "num_layers")
    heads = _get(cfg, "num_attention_heads", "n_head")
    vocab = _get(cfg, "vocab_size")
    if None in (hidden, layers, heads, vocab):
        missing = [k for k, v in (("hidden_size", hidden), ("num_hidden_layers", layers),
                                  ("num_attention_heads", heads), ("vocab_size", vocab)) if v is None]
        raise TracekitError(f"{name}: not a transformer config this estimator knows (missing {', '.join(missing)})")
    notes = []
    gpt_style = mt in ("gpt2", "gpt_neox", "gpt_neo", "gptj", "opt", "gpt_bigcode") or "n_embd" in cfg
    act = str(_get(cfg, "hidden_act", "hidden_activation", "activation_function",
                   default="gelu" if gpt_style else "silu")).lower()
    if gpt_style:
        activation = "relu" if act == "relu" else "gelu"
        norm, qkv_bias, out_bias, mlp_bias = "layernorm", True, True, True
    else:
        activation = "swiglu" if act in ("silu", "swish", "swiglu") else ("relu" if act == "relu" else "gelu")
        if mt.startswith("gemma"):
            activation = "swiglu"  # GeGLU: gated, three matrices like SwiGLU
        norm = "rmsnorm"
        attn_bias = bool(cfg.get("attention_bias", False))
        qkv_bias = attn_bias or mt in ("qwen2", "qwen2_moe", "qwen2_vl")
        out_bias = attn_bias
        mlp_bias = bool(cfg.get("mlp_bias", False))
    learned = mt == "gpt2" or (not mt and "n_positions" in cfg)
    tied = cfg.get("tie_word_embeddings")
    if tied is None:
        tied = TIED_DEFAULT.get(mt, True)
        if mt not in TIED_DEFAULT:
            notes.append("tie_word_embeddings not given: transformers' default (tied)")
    try:
        dropout = max(float(_get(cfg, k, default=0.0) or 0.0) for k in
                      ("attention_dropout", "attn_pdrop", "resid_pdrop", "hidden_dropout", "embd_pdrop"))
    except (TypeError, ValueError):
        raise TracekitError(f"{name}: a dropout in the config is not a number") from None
    if mt in ("gpt2",) and dropout:
        notes.append(f"dropout {dropout} from the config (saved masks count as activations)")
    try:
        sizes = {"hidden": int(hidden), "layers": int(layers), "heads": int(heads), "vocab": int(vocab),
                 "ffn": int(_get(cfg, "intermediate_size", "n_inner", "ffn_dim", default=0) or 0),
                 "kv_heads": int(_get(cfg, "num_key_value_heads", default=0) or 0),
                 "head_dim": int(cfg.get("head_dim") or 0) if not gpt_style else 0,
                 "positions": int(_get(cfg, "n_positions", "max_position_embeddings", default=0)) if learned else 0}
    except (TypeError, ValueError) as e:
        raise TracekitError(f"{name}: a size in the config is not a number ({e})") from None
    return ModelShape(
        **sizes,
        activation=activation, norm=norm, qkv_bias=qkv_bias, out_bias=out_bias, mlp_bias=mlp_bias,
        qk_norm=mt.startswith("qwen3"), tied=bool(tied), dropout=dropout,
        fused_qkv=mt in ("gpt2", "gpt_neox", "phi3") or (not mt and "n_embd" in cfg), fused_gate_up=mt == "phi3",
        parallel_residual=mt == "gpt_neox" and bool(cfg.get("use_parallel_residual", True)),
        name=str(cfg.get("_name_or_path") or name), notes=tuple(notes))


@dataclass(frozen=True)
class ParamCount:
    """A model known only by its parameter count (`--params N`): model states, no activations."""

    n: int
    largest: int = 0  # DeepSpeed's largest layer, when known
    name: str = "params"
    trainable: int | None = None  # None: all (a recording can say fewer, e.g. LoRA)
    factored: int | None = None  # Adafactor's state elements, when the trainable shapes are known
    notes: tuple = ()

    def __post_init__(self):
        if self.n <= 0:
            raise TracekitError(f"--params must be positive (got {self.n})")

    def params(self) -> int:
        return self.n

    def linear_params(self) -> int:
        return self.n

    def largest_layer_params(self) -> int:
        return self.largest

    def to_dict(self) -> dict:
        return {"params": self.n, "largest_layer_params": self.largest, "name": self.name}

    def with_(self, **changes):
        return self


def gpt_style_params(shape: ModelShape) -> int:
    """The GPT-style napkin count (12·L·h² + 13·L·h + (V + S)·h + 2h) some calculators use."""
    h = shape.hidden
    return 12 * shape.layers * h * h + 13 * shape.layers * h + (shape.vocab + shape.positions) * h + 2 * h
