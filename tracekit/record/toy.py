"""A small GPT-like language model and its training step, for `tracekit demo`, the samples and tests.

Real PyTorch training, just small: token + position embeddings, pre-norm
transformer blocks (causal self-attention, GELU MLP), a language-model head
and cross-entropy loss on random tokens.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class TransformerBlock(nn.Module):
    def __init__(self, d_model, n_heads):
        super().__init__()
        self.n_heads = n_heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_heads, d // self.n_heads).transpose(1, 2) for z in (q, k, v))
        # Written out (no fused kernel) so the attention matrix shows in the trace.
        att = (q @ k.transpose(-2, -1)) * (d // self.n_heads) ** -0.5
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(b, t, d)
        x = x + self.proj(y)
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class TinyGPT(nn.Module):
    def __init__(self, vocab=2048, d_model=128, n_layers=2, n_heads=4, seq=128):
        super().__init__()
        self.tok = nn.Embedding(vocab, d_model)
        self.pos = nn.Embedding(seq, d_model)
        self.blocks = nn.ModuleList(TransformerBlock(d_model, n_heads) for _ in range(n_layers))
        self.ln = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab, bias=False)

    def forward(self, idx):
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def lm_loss(logits, targets, upcast=False):
    """Next-token cross-entropy; upcast=True computes it on an fp32 copy of the logits."""
    if upcast:
        logits = logits.float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def random_batch(vocab, batch, seq, device="cpu", generator=None):
    """(inputs, targets): random token ids and the same sequence shifted by one."""
    tokens = torch.randint(vocab, (batch, seq + 1), device=device, generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def make_training(seed=0, device="cpu", vocab=2048, d_model=128, n_layers=2, n_heads=4, seq=128, batch=8, lr=3e-4):
    """(model, optimizer, step): step() runs one AdamW training step on a fresh random batch, returns the loss."""
    torch.manual_seed(seed)
    model = TinyGPT(vocab, d_model, n_layers, n_heads, seq).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    gen = torch.Generator(device=device).manual_seed(seed + 1)

    def step():
        inputs, targets = random_batch(vocab, batch, seq, device, gen)
        loss = lm_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.detach()

    return model, optimizer, step
