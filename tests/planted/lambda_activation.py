"""Planted: a lambda inside a module's forward makes the spike (the backward spike comes from line 9)."""
import torch


class Mixer(torch.nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.proj = torch.nn.Linear(dim, dim)
        self.mix = lambda t: (t @ t.transpose(-2, -1)).softmax(-1) @ t

    def forward(self, x):
        return self.proj(self.mix(x))


torch.manual_seed(0)
model = torch.nn.Sequential(Mixer(32), Mixer(32))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(2, 1024, 32)
for step in range(3):
    opt.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    print("loss", loss.item().hex(), [p.grad.double().sum().item().hex() for p in model.parameters()])
