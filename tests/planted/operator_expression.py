"""Planted: attention written as one operator expression in forward (the backward spike comes from line 16)."""
import torch


class Attention(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        d = q.shape[-1]
        # an operator expression: no method call of its own on this line before the softmax
        # (the whole (seq x seq) matrix is saved; its backward makes more at once)
        w = (q @ k.transpose(-2, -1) / d ** 0.5).softmax(-1)
        return self.out(w @ v)


torch.manual_seed(0)
model = torch.nn.Sequential(Attention(32), Attention(32))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(2, 1024, 32)
for step in range(3):
    opt.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    print("loss", loss.item().hex(), [p.grad.double().sum().item().hex() for p in model.parameters()])
