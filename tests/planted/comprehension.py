"""Planted: attention heads computed in a list comprehension inside forward (the backward spike comes from line 15)."""
import torch


class Heads(torch.nn.Module):
    def __init__(self, dim, heads):
        super().__init__()
        self.heads = heads
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)

    def forward(self, x):
        q, k, v = (t.chunk(self.heads, dim=-1) for t in self.qkv(x).chunk(3, dim=-1))
        # one head per item: the (seq x seq) matrices and their gradients all come from the next line
        heads = [(a @ b.transpose(-2, -1)).softmax(-1) @ c for a, b, c in zip(q, k, v)]
        return self.out(torch.cat(heads, dim=-1))


torch.manual_seed(0)
model = torch.nn.Sequential(Heads(32, 2), Heads(32, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(2, 1024, 32)
for step in range(3):
    opt.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    print("loss", loss.item().hex(), [p.grad.double().sum().item().hex() for p in model.parameters()])
