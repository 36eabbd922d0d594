"""Plain-torch decoder models written the way Hugging Face writes them (eager), for checking `estimate`.

Written independently of tracekit.analysis.estimate: their parameter counts
(built on the meta device, so 70B costs nothing) check the estimator's exact
counts, and small real ones are recorded on the CPU to check its bytes.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    """LlamaRMSNorm: computed in fp32, weight applied in the input dtype."""

    def __init__(self, d, eps=1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        dtype = x.dtype
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rotate_half(x):
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        h, self.heads, self.kv = c["hidden_size"], c["num_attention_heads"], c.get("num_key_value_heads") or c[
            "num_attention_heads"]
        self.d = c.get("head_dim") or h // self.heads
        bias = c.get("qkv_bias", False)
        self.fused = c.get("fused", False)
        if self.fused:  # Phi-3: one qkv matrix
            self.qkv_proj = nn.Linear(h, (self.heads + 2 * self.kv) * self.d, bias=False)
        else:
            self.q_proj = nn.Linear(h, self.heads * self.d, bias=bias)
            self.k_proj = nn.Linear(h, self.kv * self.d, bias=bias)
            self.v_proj = nn.Linear(h, self.kv * self.d, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.d, h, bias=False)
        if c.get("qk_norm"):
            self.q_norm, self.k_norm = RMSNorm(self.d), RMSNorm(self.d)

    def forward(self, x, cos, sin):
        b, s, _ = x.shape
        if self.fused:
            q, k, v = self.qkv_proj(x).split([self.heads * self.d, self.kv * self.d, self.kv * self.d], dim=-1)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        q = q.view(b, s, self.heads, self.d).transpose(1, 2)
        k = k.view(b, s, self.kv, self.d).transpose(1, 2)
        v = v.view(b, s, self.kv, self.d).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        rep = self.heads // self.kv
        if rep > 1:  # repeat_kv
            k = k[:, :, None].expand(b, self.kv, rep, s, self.d).reshape(b, self.heads, s, self.d)
            v = v[:, :, None].expand(b, self.kv, rep, s, self.d).reshape(b, self.heads, s, self.d)
        att = torch.matmul(q, k.transpose(2, 3)) * self.d ** -0.5
        mask = torch.full((s, s), float("-inf"), device=x.device, dtype=att.dtype).triu(1)
        att = F.softmax(att + mask, dim=-1, dtype=torch.float32).to(q.dtype)
        y = torch.matmul(att, v).transpose(1, 2).reshape(b, s, -1)
        return self.o_proj(y)


class LlamaMLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        h, f = c["hidden_size"], c["intermediate_size"]
        self.fused = c.get("fused", False)
        if self.fused:  # Phi-3: one gate_up matrix
            self.gate_up_proj = nn.Linear(h, 2 * f, bias=False)
        else:
            self.gate_proj = nn.Linear(h, f, bias=False)
            self.up_proj = nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)

    def forward(self, x):
        if self.fused:
            gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        else:
            gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(F.silu(gate) * up)


class LlamaLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm = RMSNorm(c["hidden_size"])
        self.self_attn = LlamaAttention(c)
        self.post_attention_layernorm = RMSNorm(c["hidden_size"])
        self.mlp = LlamaMLP(c)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Config:
    """Like transformers' PretrainedConfig as far as the recorder looks: `to_dict()`."""

    def __init__(self, values):
        self.values = dict(values)

    def to_dict(self):
        return dict(self.values)


class Llama(nn.Module):
    """Llama / Mistral / Qwen2 (qkv_bias) / Qwen3 (qk_norm) / Phi-3 (fused) decoder for causal LM."""

    def __init__(self, c):
        super().__init__()
        self.config = Config(c)
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(LlamaLayer(c) for _ in range(c["num_hidden_layers"]))
        self.norm = RMSNorm(c["hidden_size"])
        self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)
        if c.get("tie_word_embeddings"):
            self.lm_head.weight = self.embed_tokens.weight
        self.head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]

    def forward(self, idx):
        s = idx.shape[1]
        inv = 1.0 / (10000 ** (torch.arange(0, self.head_dim, 2, dtype=torch.float32) / self.head_dim))
        freqs = torch.outer(torch.arange(s, dtype=torch.float32), inv)
        emb = torch.cat((freqs, freqs), dim=-1)
        x = self.embed_tokens(idx)
        cos, sin = emb.cos().to(x.dtype), emb.sin().to(x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))


class GPT2Block(nn.Module):
    def __init__(self, h, heads):
        super().__init__()
        self.heads = heads
        self.ln_1 = nn.LayerNorm(h)
        self.c_attn = nn.Linear(h, 3 * h)
        self.c_proj = nn.Linear(h, h)
        self.ln_2 = nn.LayerNorm(h)
        self.c_fc = nn.Linear(h, 4 * h)
        self.mlp_proj = nn.Linear(4 * h, h)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(h, dim=2)
        q, k, v = (t.view(b, s, self.heads, h // self.heads).transpose(1, 2) for t in (q, k, v))
        att = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(h // self.heads)
        keep = torch.ones(s, s, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~keep, float("-inf")).softmax(dim=-1)
        x = x + self.c_proj(torch.matmul(att, v).transpose(1, 2).reshape(b, s, h))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT2(nn.Module):
    """GPT-2 (tied output layer, learned positions); dropout off."""

    def __init__(self, vocab=50257, h=768, layers=12, heads=12, positions=1024):
        super().__init__()
        self.wte = nn.Embedding(vocab, h)
        self.wpe = nn.Embedding(positions, h)
        self.h = nn.ModuleList(GPT2Block(h, heads) for _ in range(layers))
        self.ln_f = nn.LayerNorm(h)
        self.lm_head = nn.Linear(h, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, idx):
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class NeoXLayer(nn.Module):
    def __init__(self, h, f):
        super().__init__()
        self.input_layernorm = nn.LayerNorm(h)
        self.post_attention_layernorm = nn.LayerNorm(h)
        self.query_key_value = nn.Linear(h, 3 * h)
        self.dense = nn.Linear(h, h)
        self.dense_h_to_4h = nn.Linear(h, f)
        self.dense_4h_to_h = nn.Linear(f, h)


class NeoX(nn.Module):
    """GPT-NeoX / Pythia parameters (untied embed_out, biases everywhere, rotary: no position weights)."""

    def __init__(self, c):
        super().__init__()
        h = c["hidden_size"]
        self.embed_in = nn.Embedding(c["vocab_size"], h)
        self.layers = nn.ModuleList(NeoXLayer(h, c["intermediate_size"]) for _ in range(c["num_hidden_layers"]))
        self.final_layer_norm = nn.LayerNorm(h)
        self.embed_out = nn.Linear(h, c["vocab_size"], bias=False)


def count(model) -> int:
    return sum(p.numel() for p in model.parameters())


class LoRALinear(nn.Module):
    """PEFT-style LoRA around a frozen nn.Linear: base(x) + B(A(x)) × scale."""

    def __init__(self, base, rank, scale=2.0):
        super().__init__()
        self.base, self.scale = base, scale
        self.lora_A = nn.Linear(base.in_features, rank, bias=False)
        self.lora_B = nn.Linear(rank, base.out_features, bias=False)
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(x)) * self.scale


def with_lora(model: Llama, rank, targets=("q_proj", "v_proj")) -> Llama:
    """Freeze `model` and adapt `targets` in every layer's attention."""
    model.requires_grad_(False)
    for layer in model.layers:
        for name in targets:
            setattr(layer.self_attn, name, LoRALinear(getattr(layer.self_attn, name), rank))
    return model
