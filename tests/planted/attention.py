"""Planted: eager attention, softmax(q @ k.T) over a long sequence (the backward spike comes from line 17)."""
import torch


class Attention(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
        # no fused kernel: the whole (seq x seq) matrix is saved, and its backward makes
        # another one at once
        # (the spike below)
        weights = scores.softmax(-1)
        return self.out(weights @ v)


class Block(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.attn = Attention(dim)

    def forward(self, x):
        return x + self.attn(x)


torch.manual_seed(0)
model = torch.nn.Sequential(Block(32), Block(32))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(2, 1024, 32)
for step in range(3):
    opt.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    print("loss", loss.item().hex(), [p.grad.double().sum().item().hex() for p in model.parameters()])
