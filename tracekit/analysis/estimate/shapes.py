"""A decoder-only language model's shape, read from a Hugging Face config.json, and its exact parameter count.

No transformers needed: each supported `model_type` is read the way its
transformers config class and modeling code read it (the class defaults
when a field is missing), and counted module by module, so the count is
exact rather than GPT-style napkin (12·L·h²). Covered: grouped and
multi-query attention (Falcon's `multi_query` / `new_decoder_architecture`,
GPT-BigCode), DeepSeek's multi-head latent attention, mixture-of-experts
layers (routed experts, router, shared experts and their gate; dense
layers where the config says so), parallel attention blocks (GPT-J, Falcon,
Phi, Cohere, GPT-NeoX), learned positions (GPT-2, GPT-Neo, OPT's offset of
2), biases as each family has them, extra norms (Gemma-2/3's four per
layer, OLMo-2's post-norms, q/k norms, BLOOM's embedding norm, Phi's final
LayerNorm), OPT's `word_embed_proj_dim` projections, and tied or untied
output layers (with their bias where the family has one). An unknown
`model_type` is counted with the generic (Llama-style) decoder formula, and
the shape says so (`counted_by`).
"""
from __future__ import annotations

import builtins
from typing import Any, overload

from dataclasses import asdict, dataclass, field, replace

from ...errors import TracekitError

GATED = {"swiglu", "geglu"}
# what an activation keeps for backward besides its output, in tensors as wide as the MLP (see activation_terms)
ACT_SAVED = {"silu": 1, "swish": 1, "gelu": 1, "gelu_pytorch_tanh": 1, "relu": 0, "relu2": 1, "gelu_new": 4,
             "gelu_fast": 6, "quick_gelu": 2, "bloom_gelu": 2}
NORMS = ("rmsnorm", "layernorm", "layernorm-nobias", "none")


@dataclass(frozen=True)
class ModelShape:
    hidden: int
    layers: int
    heads: int
    vocab: int
    ffn: int = 0  # 0: 4 × hidden
    kv_heads: int = 0  # 0: heads (no grouped-query attention)
    head_dim: int = 0  # 0: hidden // heads
    activation: str = "swiglu"  # swiglu | geglu (gated, three matrices) | gelu | relu | ... (plain, two)
    act_fn: str = ""  # the exact function (silu, gelu_new, ...); "" follows `activation`
    norm: str = "layernorm"  # rmsnorm (weight) | layernorm (weight, bias) | layernorm-nobias | none
    qkv_bias: bool = False
    out_bias: bool = False  # attention output projection
    mlp_bias: bool = False
    qk_norm: str = ""  # "" | head (one norm over head_dim) | per-head (heads × head_dim) | full (q and k widths)
    qk_norm_bias: bool = False
    tied: bool = False  # the output layer reuses the token embedding
    head_bias: bool = False  # the output layer has a bias (Phi, GPT-J, CodeGen)
    positions: int = 0  # learned position embeddings (rows, OPT's offset included); 0 for rotary/ALiBi
    rotary: float = 1.0  # fraction of head_dim rotated (partial rotary: GPT-NeoX, Phi, GPT-J); 0: none
    dropout: float = 0.0
    embed_dropout: float | None = None  # the embeddings' own dropout where the config names it apart (None: dropout)
    fused_qkv: bool = False  # one matrix for q, k, v: matters to Adafactor's state and to what attention keeps
    fused_gate_up: bool = False  # Phi-3
    parallel_residual: bool = False  # attention and MLP read the same normalized input(s)
    norms: int = 2  # hidden-wide norms per layer (1: parallel blocks with one; 4: Gemma-2/3, GLM-4)
    norm_layout: str = "pre"  # pre (before attention and MLP) | post (after them: OLMo-2) | sandwich (both)
    final_norm: bool = True
    embed_norm: bool = False  # BLOOM: a LayerNorm right after the token embedding
    embed_dim: int = 0  # OPT's word_embed_proj_dim (0: hidden); projections in and out when it differs
    norm_fp32: bool = False  # Gemma: the normalized value stays fp32 until after the weight
    experts: int = 0  # routed experts per MoE layer (0: dense)
    top_k: int = 0  # experts per token
    expert_ffn: int = 0  # each expert's intermediate size
    shared_ffn: int = 0  # shared expert(s) intermediate size in all (0: none)
    shared_gate: bool = False  # Qwen2-MoE: a sigmoid gate (hidden -> 1) on the shared expert
    expert_bias: bool = False  # gpt-oss: the experts' matrices have biases
    router_bias: bool = False  # gpt-oss
    attn_sinks: bool = False  # gpt-oss: one learned attention sink per head
    moe_start: int = 0  # layers before it are dense (DeepSeek's first_k_dense_replace)
    moe_step: int = 1  # every moe_step-th layer is MoE (Qwen's decoder_sparse_step)
    moe_skip: tuple = ()  # layers kept dense (Qwen's mlp_only_layers)
    q_lora_rank: int = 0  # multi-head latent attention (DeepSeek-V2/V3): 0 without
    kv_lora_rank: int = 0
    qk_nope_dim: int = 0
    qk_rope_dim: int = 0
    v_head_dim: int = 0
    model_type: str = ""
    counted_by: str = "shape flags"
    name: str = "custom"
    notes: tuple = field(default=(), compare=False)

    def __post_init__(self):
        positive = ("hidden", "layers", "heads", "vocab")
        for k in positive + ("ffn", "kv_heads", "head_dim", "positions", "embed_dim", "experts", "top_k",
                             "expert_ffn", "shared_ffn", "moe_start", "moe_step", "q_lora_rank", "kv_lora_rank",
                             "qk_nope_dim", "qk_rope_dim", "v_head_dim"):
            v = getattr(self, k)
            if not isinstance(v, int) or isinstance(v, bool) or v < (1 if k in positive + ("moe_step",) else 0):
                raise TracekitError(f"model shape needs a {'positive' if k in positive else 'non-negative'} "
                                    f"whole {k} (got {v!r})")
        if self.norm not in NORMS:
            raise TracekitError(f"norm must be one of {', '.join(NORMS)} (got {self.norm!r})")
        if not self.head_dim and not self.mla and self.hidden % self.heads:
            raise TracekitError(f"hidden {self.hidden} is not a multiple of heads {self.heads}; give --head-dim")
        if self.kv_heads and self.heads % self.kv_heads:
            raise TracekitError(f"heads {self.heads} is not a multiple of kv-heads {self.kv_heads}")
        if self.kv_heads > self.heads:
            raise TracekitError(f"kv-heads {self.kv_heads} is more than heads {self.heads}")
        if self.experts and not (0 < self.top_k <= self.experts):
            raise TracekitError(f"experts per token must be between 1 and the {self.experts} experts "
                                f"(got {self.top_k})")
        if self.mla and not (self.kv_lora_rank and self.v_head_dim and self.qk_nope_dim + self.qk_rope_dim):
            raise TracekitError("multi-head latent attention needs kv_lora_rank, qk_nope_head_dim + "
                                "qk_rope_head_dim and v_head_dim")
        if not 0 <= self.rotary <= 1:
            raise TracekitError(f"the rotary fraction must be within 0..1 (got {self.rotary})")

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

    @property
    def act(self) -> str:
        """The activation function itself (what it keeps for backward: ACT_SAVED)."""
        return self.act_fn or {"swiglu": "silu", "geglu": "gelu_pytorch_tanh"}.get(self.activation, self.activation)

    @property
    def mla(self) -> bool:
        return bool(self.kv_lora_rank)

    @property
    def q_width(self) -> int:
        """Query features per token (all heads)."""
        return self.heads * (self.qk_nope_dim + self.qk_rope_dim if self.mla else self.d_head)

    @property
    def kv_width(self) -> int:
        """Key (and value) features per token as attention reads them (MLA: per head, after kv_b_proj)."""
        return self.heads * (self.qk_nope_dim + self.qk_rope_dim) if self.mla else self.n_kv * self.d_head

    @property
    def v_width(self) -> int:
        return self.heads * self.v_head_dim if self.mla else self.n_kv * self.d_head

    @property
    def o_width(self) -> int:
        """The attention output projection's input width."""
        return self.heads * self.v_head_dim if self.mla else self.heads * self.d_head

    @property
    def emb(self) -> int:
        return self.embed_dim or self.hidden

    def is_moe(self, i: int) -> bool:
        return bool(self.experts) and i >= self.moe_start and (i + 1) % self.moe_step == 0 and i not in self.moe_skip

    @property
    def moe_layers(self) -> int:
        return sum(self.is_moe(i) for i in range(self.layers))

    @property
    def dense_layers(self) -> int:
        return self.layers - self.moe_layers

    def with_(self, **changes) -> "ModelShape":
        changes = {k: v for k, v in changes.items() if v is not None}
        if "activation" in changes:
            changes.setdefault("act_fn", "")  # the function follows the overriding activation
        if changes:
            changes.setdefault("counted_by", f"{self.counted_by}, with {', '.join(sorted(changes))} overridden")
        return replace(self, **changes)

    def to_dict(self) -> dict:
        d = asdict(self)
        d.pop("notes")
        d["moe_skip"] = list(self.moe_skip)
        d["params"] = self.params()
        return d

    # -- parameters ----------------------------------------------------------
    def attention_linears(self) -> list[tuple[str, int, int, bool]]:
        """(name, in_features, out_features, has_bias) of one layer's attention matrices (as separate q, k, v)."""
        h = self.hidden
        if self.mla:
            qk = self.qk_nope_dim + self.qk_rope_dim
            out = ([("q_a_proj", h, self.q_lora_rank, self.qkv_bias),
                    ("q_b_proj", self.q_lora_rank, self.heads * qk, False)] if self.q_lora_rank else
                   [("q_proj", h, self.heads * qk, False)])
            return out + [("kv_a_proj_with_mqa", h, self.kv_lora_rank + self.qk_rope_dim, self.qkv_bias),
                          ("kv_b_proj", self.kv_lora_rank, self.heads * (self.qk_nope_dim + self.v_head_dim), False),
                          ("o_proj", self.heads * self.v_head_dim, h, self.out_bias)]
        q, kv = self.heads * self.d_head, self.n_kv * self.d_head
        return [("q_proj", h, q, self.qkv_bias), ("k_proj", h, kv, self.qkv_bias),
                ("v_proj", h, kv, self.qkv_bias), ("o_proj", q, h, self.out_bias)]

    def mlp_linears(self, ffn=None, bias=None, prefix="") -> list[tuple[str, int, int, bool]]:
        h, f = self.hidden, ffn or self.d_ff
        b = self.mlp_bias if bias is None else bias
        up = [(prefix + "up_proj", h, f, b)]
        if self.gated:
            up.insert(0, (prefix + "gate_proj", h, f, b))
        return up + [(prefix + "down_proj", f, h, b)]

    def linears(self) -> list[tuple[str, int, int, bool]]:
        """(name, in, out, has_bias) of a dense layer's matrices (attention and MLP)."""
        return self.attention_linears() + self.mlp_linears()

    def matrices(self) -> list[tuple[str, int, int, bool, int]]:
        """(name, in, out, has_bias, how many in the model) of every layer matrix: attention in every layer, the
        dense MLP in dense layers; in MoE layers each routed expert's (gated, bias-free), the router, the shared
        expert and its gate. Embeddings and the output layer are not here."""
        L, moe = self.layers, self.moe_layers
        out = [(n, i, o, b, L) for n, i, o, b in self.attention_linears()]
        if L - moe:
            out += [(n, i, o, b, L - moe) for n, i, o, b in self.mlp_linears()]
        if moe:
            f, h = self.expert_ffn or self.d_ff, self.hidden
            out += [("experts." + n, i, o, self.expert_bias, moe * self.experts)
                    for n, i, o, _ in ModelShape.mlp_linears(replace(self, activation="swiglu"), f, False)]
            out.append(("router", h, self.experts, self.router_bias, moe))
            if self.shared_ffn:
                out += [("shared_expert." + n, i, o, b, moe)  # a dense MLP: DeepSeek-V2's takes mlp_bias
                        for n, i, o, b in ModelShape.mlp_linears(replace(self, activation="swiglu"),
                                                                 self.shared_ffn)]
                if self.shared_gate:
                    out.append(("shared_expert_gate", h, 1, False, moe))
        return out

    def norm_params(self, width=None) -> int:
        width = self.hidden if width is None else width
        return width * {"rmsnorm": 1, "layernorm": 2, "layernorm-nobias": 1, "none": 0}[self.norm]

    def qk_norm_params(self) -> int:
        """One layer's q and k norm parameters."""
        if not self.qk_norm:
            return 0
        per = 2 if self.qk_norm_bias else 1
        if self.qk_norm == "head":
            return 2 * self.d_head * per
        return (self.heads + self.n_kv) * self.d_head * per  # per-head or full: as wide as q and k

    def layer_norms_params(self) -> int:
        """One layer's norms: the hidden-wide ones, q/k norms and MLA's latent norms."""
        n = self.norms * self.norm_params() + self.qk_norm_params() + (self.heads if self.attn_sinks else 0)
        if self.mla:
            n += self.kv_lora_rank + self.q_lora_rank  # RMSNorms over the compressed kv and q
        return n


    def embedding_params(self) -> int:
        n = self.vocab * self.emb + self.positions * self.hidden
        if self.emb != self.hidden:
            n += 2 * self.emb * self.hidden  # OPT's project_in and project_out
        if self.embed_norm:
            n += self.norm_params()
        return n

    def head_params(self) -> int:
        return (0 if self.tied else self.vocab * self.emb) + (self.vocab if self.head_bias else 0)

    def params(self) -> int:
        """Exact parameter count (shared embeddings counted once, as model.parameters() does)."""
        mats = sum((i * o + (o if b else 0)) * n for _, i, o, b, n in self.matrices())
        return (self.embedding_params() + mats + self.layers * self.layer_norms_params()
                + (self.norm_params() if self.final_norm else 0) + self.head_params())

    def linear_params(self) -> int:
        """Parameters in the layers' matmul weights (what LoRA targets and bitsandbytes quantizes)."""
        return sum(i * o * n for _, i, o, _, n in self.matrices())

    def largest_layer_params(self) -> int:
        """The most parameters any one module holds directly (DeepSpeed's "largest layer")."""
        mats = [i * o + (o if b else 0) for name, i, o, b, _ in self.matrices() if not name.startswith("experts.")]
        if self.experts:
            f = self.expert_ffn or self.d_ff
            mats.append(self.experts * 2 * f * self.hidden)  # transformers 5 keeps the experts' gate_up fused
        return max(mats + [self.vocab * self.emb])

    def describe(self) -> str:
        """What the count covers, in a few words."""
        parts = []
        if self.mla:
            parts.append(f"multi-head latent attention (kv rank {self.kv_lora_rank})")
        elif self.n_kv == 1:
            parts.append("multi-query attention")
        elif self.n_kv < self.heads:
            parts.append(f"grouped-query attention ({self.n_kv} kv heads)")
        if self.experts:
            parts.append(f"{self.moe_layers} MoE layers × {self.experts} experts (top {self.top_k})"
                         + (" + shared expert" if self.shared_ffn else ""))
        if self.parallel_residual:
            parts.append("parallel attention and MLP")
        if self.positions:
            parts.append(f"{self.positions} learned positions")
        if self.emb != self.hidden:
            parts.append(f"embedding projections {self.emb} <-> {self.hidden}")
        parts.append("tied embeddings" if self.tied else "untied output layer")
        return ", ".join(parts)


# -- reading a config.json ---------------------------------------------------------------------------------------------
# tie_word_embeddings when config.json leaves it out: the config class's default (PretrainedConfig itself: True)
TIED_DEFAULT = {"llama": False, "mistral": False, "ministral": False, "mixtral": False, "qwen2": False,
                "qwen2_moe": False, "qwen3": False, "qwen3_moe": False, "phi": False, "phi3": False,
                "phimoe": False, "gpt_neox": False, "gptj": False, "codegen": False, "olmo": False, "olmo2": False,
                "olmoe": False, "stablelm": False, "persimmon": False, "deepseek_v2": False, "deepseek_v3": False,
                "granite": False, "helium": False, "smollm3": True, "glm": False, "glm4": False, "nemotron": False,
                "gpt_oss": False, "exaone4": False, "seed_oss": False, "olmo3": False, "hunyuan_v1_dense": False,
                "arcee": False, "gemma": True,
                "gemma2": True, "gemma3_text": True, "cohere": True, "starcoder2": True, "gpt2": True,
                "gpt_neo": True, "gpt_bigcode": True, "opt": True, "bloom": True, "falcon": True, "mpt": True}
LLAMA_LIKE = {"llama", "mistral", "ministral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "granite",
              "helium", "smollm3", "glm", "glm4", "nemotron", "gpt_oss", "exaone4", "seed_oss", "olmo3",
              "hunyuan_v1_dense", "arcee", "olmo", "olmo2", "olmoe", "gemma", "gemma2", "gemma3_text", "phi3",
              "phimoe", "cohere", "stablelm", "starcoder2", "deepseek_v2", "deepseek_v3"}
OTHER = {"gpt2", "gpt_neo", "gpt_bigcode", "gptj", "codegen", "gpt_neox", "opt", "bloom", "falcon", "mpt", "phi",
         "persimmon"}
KNOWN = LLAMA_LIKE | OTHER
# what transformers' config classes use when config.json leaves a size out (a constant, not derived from the heads)
KV_DEFAULT = {"gemma": 16, "helium": 20, "mistral": 8, "ministral": 8, "mixtral": 8, "phimoe": 8, "qwen2": 32,
              "qwen2_moe": 16, "qwen3": 32, "qwen3_moe": 4, "smollm3": 4, "stablelm": 32, "starcoder2": 2}
HEAD_DIM_DEFAULT = {"gemma": 256, "gemma2": 256, "gemma3_text": 256, "helium": 128, "qwen3": 128}
FFN_DEFAULT = {"cohere": 22528, "deepseek_v2": 11008, "deepseek_v3": 18432, "gemma": 24576, "gemma2": 9216,
               "gemma3_text": 9216, "gpt_neox": 24576, "granite": 11008, "helium": 7040, "llama": 11008,
               "ministral": 14336, "mistral": 14336, "mixtral": 14336, "olmo": 11008, "olmo2": 11008, "olmoe": 2048,
               "opt": 3072, "persimmon": 16384, "phi": 8192, "phi3": 8192, "phimoe": 6400, "qwen2": 22016,
               "qwen2_moe": 5632, "qwen3": 22016, "qwen3_moe": 6144, "smollm3": 11008, "stablelm": 6912,
               "starcoder2": 12288}
ACT_DEFAULT = {"gpt2": "gelu_new", "gpt_neo": "gelu_new", "gpt_bigcode": "gelu_pytorch_tanh", "gptj": "gelu_new",
               "codegen": "gelu_new", "gpt_neox": "gelu", "opt": "relu", "bloom": "bloom_gelu", "falcon": "gelu",
               "mpt": "gelu", "phi": "gelu_new", "persimmon": "relu2", "starcoder2": "gelu_pytorch_tanh",
               "gemma": "gelu_pytorch_tanh", "gemma2": "gelu_pytorch_tanh", "gemma3_text": "gelu_pytorch_tanh"}
# dropout probabilities the config classes default to (the others default to 0)
DROPOUT_DEFAULT = {"gpt2": {"resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1},
                   "gpt_bigcode": {"resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1},
                   "opt": {"dropout": 0.1}}
ATTENTION_BIAS = {"llama", "granite", "helium", "smollm3", "qwen3", "qwen3_moe", "olmo", "olmo2", "olmoe", "cohere",
                  "gemma", "gemma2", "gemma3_text", "phimoe", "deepseek_v2", "deepseek_v3", "glm", "glm4", "nemotron",
                  "gpt_oss", "seed_oss", "olmo3", "hunyuan_v1_dense", "arcee", ""}
MLP_BIAS = {"llama", "granite", "helium", "smollm3", "deepseek_v2", "nemotron", "seed_oss", "arcee", ""}
# model types that are not decoder-only language models: refused with a clear line rather than miscounted
NOT_DECODERS = {"t5", "mt5", "umt5", "bart", "mbart", "pegasus", "marian", "bert", "roberta", "deberta",
                "deberta-v2", "distilbert", "albert", "electra", "xlm-roberta", "whisper", "vit", "clip",
                "siglip", "wav2vec2", "encoder-decoder", "longt5", "led", "blenderbot", "m2m_100", "nllb_moe",
                "switch_transformers", "mamba", "mamba2", "rwkv", "falcon_mamba", "jamba", "zamba", "zamba2",
                "bamba", "nemotron_h", "xlstm"}


class _Cfg:
    """config.json values with the config class's defaults, as whole numbers or flags, failing in one line."""

    def __init__(self, cfg: dict, name: str):
        self.cfg, self.name = cfg, name

    def raw(self, *keys, default=None):
        for k in keys:
            if self.cfg.get(k) is not None:
                return self.cfg[k]
        return default

    @overload
    def int(self, *keys: str, default: builtins.int, required: bool = False) -> builtins.int: ...

    @overload
    def int(self, *keys: str, default: builtins.int | None = None, required: bool = False) -> builtins.int | None: ...

    def int(self, *keys, default=None, required=False) -> builtins.int | None:
        v = self.raw(*keys, default=default)
        if v is None:
            if required:
                raise TracekitError(f"{self.name}: the config has no {' / '.join(keys)}")
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or int(v) != v:
            raise TracekitError(f"{self.name}: {keys[0]} must be a whole number (got {v!r})")
        if v < 0:
            raise TracekitError(f"{self.name}: {keys[0]} cannot be negative (got {v})")
        return int(v)

    def flag(self, *keys, default=False) -> bool:
        v = self.raw(*keys, default=default)
        if not isinstance(v, (bool, int)):
            raise TracekitError(f"{self.name}: {keys[0]} must be true or false (got {v!r})")
        return bool(v)

    def num(self, *keys, default=0.0) -> float:
        v = self.raw(*keys, default=default)
        try:
            return float(v)
        except (TypeError, ValueError):
            raise TracekitError(f"{self.name}: {keys[0]} is not a number (got {v!r})") from None

    def rope(self, key, default):
        """A rotary setting, top-level (older configs) or in rope_parameters / rope_scaling (newer ones)."""
        for d in (self.cfg, self.cfg.get("rope_parameters") or {}):
            if isinstance(d, dict) and d.get(key) is not None:
                return d[key]
        return default


def _dropout(c: _Cfg, *keys) -> float:
    defaults = DROPOUT_DEFAULT.get(str(c.cfg.get("model_type") or "").lower(), {})
    return max([c.num(k, default=defaults.get(k, 0.0)) for k in keys] or [0.0])


def _llama_like(c: _Cfg, mt: str, s: dict):
    """Llama and the families written like it: RMSNorm, q/k/v/o, gated MLP, rotary; each family's quirks."""
    s.update(norm="rmsnorm", activation="swiglu",
             act_fn=str(c.raw("hidden_activation", "hidden_act", default=ACT_DEFAULT.get(mt, "silu"))).lower())
    bias = (c.flag("attention_bias", default=mt in ("glm", "glm4", "seed_oss", "gpt_oss"))  # their class defaults
            if mt in ATTENTION_BIAS else False)
    s.update(qkv_bias=bias, out_bias=bias, mlp_bias=c.flag("mlp_bias") if mt in MLP_BIAS else False)
    if mt in ("qwen2", "qwen2_moe"):
        s["qkv_bias"] = True  # Qwen2: q, k, v with bias, o without
    if mt in ("helium", "glm", "glm4"):
        s["out_bias"] = False  # q, k, v take attention_bias, o none
    if mt in ("glm", "glm4"):
        s.update(fused_gate_up=True, rotary=float(c.rope("partial_rotary_factor", 0.5)))
        if mt == "glm4":
            s.update(norms=4, norm_layout="sandwich")  # post_self_attn and post_mlp norms too
    if mt == "seed_oss":
        s["out_bias"] = c.flag("attention_out_bias")
    if mt in ("nemotron", "arcee"):
        s.update(activation=s["act_fn"])  # a plain MLP (up, down) with relu2
    if mt == "nemotron":
        s.update(norm="layernorm", rotary=float(c.rope("partial_rotary_factor", 0.5)))
    if mt == "gpt_oss":
        s.update(attn_sinks=True, expert_bias=True, router_bias=True)
    if mt in ("exaone4", "hunyuan_v1_dense"):
        s["qk_norm"] = "head"
    if mt in ("olmo2", "olmo3", "exaone4"):
        s.update(norm_layout="post")
    if mt in ("gemma2", "gemma3_text"):
        s["norm_layout"] = "sandwich"
    if mt == "stablelm":
        s.update(norm="layernorm", qkv_bias=c.flag("use_qkv_bias"), activation="swiglu")
        if c.flag("qk_layernorm"):
            s.update(qk_norm="per-head")
        if c.flag("use_parallel_residual"):
            s.update(parallel_residual=True, norms=1)
        s["rotary"] = float(c.rope("partial_rotary_factor", 0.25))
        s["dropout"] = _dropout(c, "hidden_dropout", "attention_dropout")
    if mt == "starcoder2":
        b = c.flag("use_bias", default=True)
        s.update(norm="layernorm", activation=s["act_fn"], qkv_bias=b, out_bias=b, mlp_bias=b)
        s["dropout"] = _dropout(c, "residual_dropout", "embedding_dropout", "attention_dropout")
    if mt == "cohere":
        s.update(norm="layernorm-nobias", parallel_residual=True, norms=1)
        if c.flag("use_qk_norm"):
            s["qk_norm"] = "per-head"
    if mt == "olmo":
        s["norm"] = "none"  # OLMo's LayerNorm has no parameters
    if mt in ("olmo2", "olmoe", "olmo3"):
        s["qk_norm"] = "full"  # post-norms (post_attention, post_feedforward): still two per layer
    if mt in ("qwen3", "qwen3_moe", "gemma3_text"):
        s["qk_norm"] = "head"
    if mt in ("gemma", "gemma2", "gemma3_text"):
        s.update(activation="geglu", norm_fp32=True)
        if mt != "gemma":
            s["norms"] = 4  # input, post-attention, pre- and post-feedforward
    if mt == "phi3":
        s.update(fused_qkv=True, fused_gate_up=True)
        s["rotary"] = float(c.rope("partial_rotary_factor", 1.0))
    if mt == "phimoe":
        s.update(norm="layernorm", head_bias=c.flag("lm_head_bias"))
    s["dropout"] = max(s.get("dropout", 0.0), _dropout(c, "attention_dropout"))
    if not mt:  # the generic formula: any dropout the config names
        s["dropout"] = max(s["dropout"], _dropout(c, "hidden_dropout", "attn_pdrop", "resid_pdrop", "embd_pdrop",
                                                  "dropout"))


def _moe(c: _Cfg, mt: str, s: dict):
    if mt in ("mixtral", "phimoe", "gpt_oss"):
        s.update(experts=c.int("num_local_experts", "num_experts", default={"mixtral": 8, "phimoe": 16}.get(mt, 128)),
                 top_k=c.int("num_experts_per_tok", "experts_per_token", default=4 if mt == "gpt_oss" else 2),
                 expert_ffn=s["ffn"])
    elif mt == "olmoe":
        s.update(experts=c.int("num_experts", "num_local_experts", default=64),
                 top_k=c.int("num_experts_per_tok", default=8), expert_ffn=s["ffn"])
    elif mt in ("qwen2_moe", "qwen3_moe"):
        s.update(experts=c.int("num_experts", "num_local_experts", default=60 if mt == "qwen2_moe" else 128),
                 top_k=c.int("num_experts_per_tok", default=4 if mt == "qwen2_moe" else 8),
                 expert_ffn=c.int("moe_intermediate_size", default=1408 if mt == "qwen2_moe" else 768),
                 moe_step=c.int("decoder_sparse_step", default=1) or 1)
        skip = c.raw("mlp_only_layers", default=[])
        if not isinstance(skip, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in skip):
            raise TracekitError(f"{c.name}: mlp_only_layers must be a list of layer numbers")
        s["moe_skip"] = tuple(skip)
        if mt == "qwen2_moe":
            s.update(shared_ffn=c.int("shared_expert_intermediate_size", default=5632), shared_gate=True)
    elif mt in ("deepseek_v2", "deepseek_v3"):
        v3 = mt == "deepseek_v3"
        f = c.int("moe_intermediate_size", default=2048 if v3 else 1407)
        s.update(experts=c.int("n_routed_experts", default=256 if v3 else 64),
                 top_k=c.int("num_experts_per_tok", default=8 if v3 else 6) or (8 if v3 else 6),
                 expert_ffn=f, shared_ffn=f * c.int("n_shared_experts", default=1 if v3 else 2),
                 moe_start=c.int("first_k_dense_replace", default=3 if v3 else 0))
        s.update(q_lora_rank=c.int("q_lora_rank", default=0) or 0, kv_lora_rank=c.int("kv_lora_rank", default=512),
                 qk_nope_dim=c.int("qk_nope_head_dim", default=128), qk_rope_dim=c.int("qk_rope_head_dim", default=64),
                 v_head_dim=c.int("v_head_dim", default=128), head_dim=0)
        s["out_bias"] = s["qkv_bias"]


def _other(c: _Cfg, mt: str, s: dict):
    """GPT-2 and the families that are not written like Llama."""
    h = s["hidden"]
    act = str(c.raw("activation_function", "hidden_act", "activation", default=ACT_DEFAULT.get(mt, "gelu"))).lower()
    s.update(norm="layernorm", activation=act, act_fn=act)
    if mt in ("gpt2", "gpt_neo", "gpt_bigcode"):
        s.update(qkv_bias=mt != "gpt_neo", out_bias=True, mlp_bias=True,
                 positions=c.int("n_positions", "max_position_embeddings", default=1024 if mt != "gpt_neo" else 2048),
                 rotary=0.0, fused_qkv=mt != "gpt_neo")
        if mt == "gpt_bigcode" and c.flag("multi_query", default=True):
            s["kv_heads"] = 1
        s["dropout"] = _dropout(c, "resid_pdrop", "embd_pdrop", "attn_pdrop", "resid_dropout", "embed_dropout",
                                "attention_dropout")
    elif mt in ("gptj", "codegen"):
        rd = c.int("rotary_dim", default=64) or 0
        s.update(parallel_residual=True, norms=1, mlp_bias=True, head_bias=True, fused_qkv=mt == "codegen",
                 rotary=min(1.0, rd / (h // s["heads"])) if rd else 1.0,
                 dropout=_dropout(c, "resid_pdrop", "embd_pdrop", "attn_pdrop"))
    elif mt == "gpt_neox":
        b = c.flag("attention_bias", default=True)
        s.update(qkv_bias=b, out_bias=b, mlp_bias=True, fused_qkv=True,
                 parallel_residual=c.flag("use_parallel_residual", default=True),
                 rotary=float(c.rope("partial_rotary_factor", c.raw("rotary_pct", default=0.25))),
                 dropout=_dropout(c, "hidden_dropout", "attention_dropout"))
    elif mt == "opt":
        b = c.flag("enable_bias", default=True)
        s.update(qkv_bias=b, out_bias=b, mlp_bias=b, rotary=0.0, act_fn=act, activation=act,
                 positions=c.int("max_position_embeddings", default=2048) + 2,  # OPTLearnedPositionalEmbedding
                 embed_dim=c.int("word_embed_proj_dim", default=s["hidden"]),
                 final_norm=c.flag("do_layer_norm_before", default=True)
                 and not c.flag("_remove_final_layer_norm", default=False),
                 dropout=_dropout(c, "dropout", "attention_dropout", "activation_dropout"))
        if not c.flag("layer_norm_elementwise_affine", default=True):
            s["norm"] = "none"
    elif mt == "bloom":
        s.update(qkv_bias=True, out_bias=True, mlp_bias=True, fused_qkv=True, embed_norm=True, rotary=0.0,
                 activation="bloom_gelu", act_fn="bloom_gelu", ffn=4 * h,
                 dropout=_dropout(c, "hidden_dropout", "attention_dropout"))
    elif mt == "falcon":
        new = c.flag("new_decoder_architecture")
        mq = c.flag("multi_query", default=True)
        parallel = c.flag("parallel_attn", default=True)
        b = c.flag("bias")
        s.update(qkv_bias=b, out_bias=b, mlp_bias=b, fused_qkv=True, activation="gelu", act_fn="gelu",
                 ffn=c.int("ffn_hidden_size", default=4 * h), rotary=0.0 if c.flag("alibi") else 1.0,
                 dropout=_dropout(c, "hidden_dropout", "attention_dropout"))
        if new or not mq:
            s["kv_heads"] = c.int("num_kv_heads", default=s["heads"]) or s["heads"]
        else:
            s["kv_heads"] = 1
        if not parallel:
            s["norms"] = 2
        else:
            n_ln = c.int("num_ln_in_parallel_attn", default=2 if new else 1) or (2 if new else 1)
            s.update(parallel_residual=True, norms=2 if n_ln == 2 else 1)
    elif mt == "mpt":
        # transformers' MPT: no biases and bias-free norms whatever no_bias says, an MLP of 4 × hidden whatever
        # expansion_ratio says (MptMLP, MptBlock "backward compatibility with weights on the Hub")
        s.update(norm="layernorm-nobias", fused_qkv=True, activation="gelu", act_fn="gelu", ffn=4 * h, rotary=0.0,
                 dropout=_dropout(c, "resid_pdrop", "emb_pdrop"))
    elif mt == "phi":
        s.update(qkv_bias=True, out_bias=True, mlp_bias=True, head_bias=True, parallel_residual=True, norms=1,
                 rotary=float(c.rope("partial_rotary_factor", 0.5)),
                 dropout=_dropout(c, "resid_pdrop", "embd_pdrop", "attention_dropout"),
                 embed_dropout=_dropout(c, "embd_pdrop"))  # Phi-2: embd_pdrop 0, resid_pdrop 0.1
        if c.flag("qk_layernorm"):
            s.update(qk_norm="head", qk_norm_bias=True)
    elif mt == "persimmon":
        s.update(qkv_bias=True, out_bias=True, mlp_bias=True, fused_qkv=True,
                 rotary=float(c.rope("partial_rotary_factor", 0.5)),
                 dropout=_dropout(c, "hidden_dropout", "attention_dropout"))
        if c.flag("qk_layernorm", default=True):
            s.update(qk_norm="head", qk_norm_bias=True)


def from_hf_config(cfg: dict, name="config") -> ModelShape:
    """ModelShape from a Hugging Face config.json dict; `counted_by` says which formula counted it."""
    if not isinstance(cfg, dict):
        raise TracekitError(f"{name}: a config must be a JSON object")
    mt = str(cfg.get("model_type") or "").lower().replace("-", "_")
    notes = []
    if isinstance(cfg.get("text_config"), dict) and not any(k in cfg for k in ("hidden_size", "n_embd", "d_model")):
        inner = dict(cfg["text_config"])
        inner.setdefault("model_type", {"gemma3": "gemma3_text"}.get(mt, inner.get("model_type", "")))
        shape = from_hf_config(inner, name)
        return replace(shape, notes=shape.notes + (f"model_type {mt!r}: its text model only (the vision or audio "
                                                   "tower is not counted)",))
    if mt.replace("_", "-") in NOT_DECODERS or mt in NOT_DECODERS:
        raise TracekitError(f"{name}: model_type {mt!r} is not a decoder-only transformer language model; "
                            "the estimator covers those (Llama, Mistral, Qwen, Gemma, Phi, Falcon, GPT-2, OPT, ...)")
    c = _Cfg(cfg, name)
    hidden: int | None
    layers: int | None
    heads: int | None
    if mt == "mpt":
        hidden, layers = c.int("d_model", default=2048), c.int("n_layers", default=24)
        heads = c.int("n_heads", default=16)
    else:
        hidden = c.int("hidden_size", "n_embd", "d_model", "n_embed")
        layers = c.int("num_hidden_layers", "n_layer", "num_layers", "n_layers")
        heads = c.int("num_attention_heads", "n_head", "n_heads", "num_heads")
    vocab = c.int("vocab_size", "padded_vocab_size", default=50368 if mt == "mpt" else None)
    missing = [k for k, v in (("hidden_size", hidden), ("num_hidden_layers", layers),
                              ("num_attention_heads", heads), ("vocab_size", vocab)) if v is None]
    if missing:
        what = f"model_type {mt!r}" if mt else "a config without model_type"
        raise TracekitError(f"{name}: not a transformer config this estimator can count ({what}; missing "
                            f"{', '.join(missing)})")
    for k, v in (("hidden_size", hidden), ("num_hidden_layers", layers), ("num_attention_heads", heads),
                 ("vocab_size", vocab)):
        if v is not None and v < 1:
            raise TracekitError(f"{name}: {k} must be at least 1 (got {v})")
    gpt_named = "n_embd" in cfg and mt not in KNOWN
    family = mt if mt in KNOWN else ("gpt2" if gpt_named else "")
    s: dict[str, Any] = {"hidden": hidden, "layers": layers, "heads": heads, "vocab": vocab,
         "ffn": c.int("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size", default=0) or 0,
         "kv_heads": c.int("num_key_value_heads", default=KV_DEFAULT.get(family, 0)) or 0,
         "head_dim": c.int("head_dim", default=HEAD_DIM_DEFAULT.get(family, 0)) or 0}
    for key, given, default in (("intermediate_size", s["ffn"], FFN_DEFAULT.get(family)),
                                ("num_key_value_heads", "num_key_value_heads" in cfg, KV_DEFAULT.get(family)),
                                ("head_dim", "head_dim" in cfg, HEAD_DIM_DEFAULT.get(family))):
        if not given and default:
            if key == "intermediate_size" and not any(k in cfg for k in ("ffn_dim", "n_inner", "ffn_hidden_size")):
                s["ffn"] = default
            notes.append(f"{key} not in the config: transformers' default for {family}, {default}")
    if family in LLAMA_LIKE or not family:
        _llama_like(c, family, s)
        if family in ("mixtral", "phimoe", "olmoe", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3", "gpt_oss"):
            _moe(c, family, s)
    else:
        s["head_dim"] = 0
        _other(c, family, s)
    if family in ("gemma", "gemma2", "gemma3_text") and s["act_fn"] == "gelu":
        s["act_fn"] = "gelu_pytorch_tanh"  # Gemma's config maps an exact "gelu" to the tanh approximation
    tied = cfg.get("tie_word_embeddings")
    if tied is None:
        tied = TIED_DEFAULT.get(family, True)
        if family not in TIED_DEFAULT:
            notes.append("tie_word_embeddings not given: transformers' default (tied)")
    if s.get("act_fn") and s["act_fn"] not in ACT_SAVED:
        notes.append(f"activation {s['act_fn']!r}: activations counted as for gelu")
    if mt and mt not in KNOWN:
        counted = (f"the generic decoder formula (model_type {mt!r} is not one it knows: "
                   + ("GPT-2-style names" if gpt_named else "counted as a Llama-style decoder") + ")")
        notes.append(f"model_type {mt!r} is not one the formulas know: counted with the generic "
                     f"{'GPT-2' if gpt_named else 'Llama'}-style decoder formula; check the count "
                     "(`tracekit estimate --simulate` builds the real model when transformers is installed)")
    elif not mt:
        counted = "the generic decoder formula (no model_type in the config)"
        notes.append("no model_type in the config: counted with the generic "
                     f"{'GPT-2' if gpt_named else 'Llama'}-style decoder formula")
    else:
        counted = f"the formula for model_type {mt!r}"
    quant = cfg.get("quantization_config")
    if isinstance(quant, dict) and quant.get("quant_method"):
        notes.append(f"the config's quantization_config ({quant.get('quant_method')}) is not applied: weights "
                     "priced at --precision (bitsandbytes: --quant)")
    if s.get("dropout") and s["dropout"] > 0:
        notes.append(f"dropout {s['dropout']} from the config (in training its masks count as activations)")
    try:
        return ModelShape(**s, tied=bool(tied), model_type=mt, counted_by=counted,
                          name=str(cfg.get("_name_or_path") or name), notes=tuple(notes))
    except TracekitError as e:
        raise TracekitError(f"{name}: {e}") from None


@dataclass(frozen=True)
class ParamCount:
    """A model known only by its parameter count (`--params N`): model states, no activations."""

    n: int
    largest: int = 0  # DeepSpeed's largest layer, when known
    name: str = "params"
    trainable: int | None = None  # None: all (a recording can say fewer, e.g. LoRA)
    factored: int | None = None  # Adafactor's state elements, when the trainable shapes are known
    notes: tuple = ()
    counted_by: str = "--params"

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
        return {"params": self.n, "largest_layer_params": self.largest, "name": self.name,
                "counted_by": self.counted_by}

    def with_(self, **changes):
        return self


def gpt_style_params(shape: ModelShape) -> int:
    """The GPT-style napkin count (12·L·h² + 13·L·h + (V + S)·h + 2h) some calculators use."""
    h = shape.hidden
    return 12 * shape.layers * h * h + 13 * shape.layers * h + (shape.vocab + shape.positions) * h + 2 * h
