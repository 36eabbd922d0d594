"""Planted: a large intermediate saved for backward (the backward spike comes from line 14)."""
import torch


class MLP(torch.nn.Module):
    def __init__(self, dim, hidden):
        super().__init__()
        self.up = torch.nn.Linear(dim, hidden)
        self.down = torch.nn.Linear(hidden, dim)

    def forward(self, x):
        h = self.up(x)
        # the wide intermediate is saved for backward; its gradient is as wide
        a = torch.nn.functional.gelu(h)
        return self.down(a)


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = MLP(64, 8192)

    def forward(self, x):
        return self.mlp(x)


torch.manual_seed(0)
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(512, 64)
for step in range(3):
    opt.zero_grad()
    loss = model(x).pow(2).mean()
    loss.backward()
    opt.step()
    print("loss", loss.item().hex(), [p.grad.double().sum().item().hex() for p in model.parameters()])
