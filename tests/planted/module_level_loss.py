"""Planted: the loss computed at module level, no function (the backward spike comes from line 23; a
forward spike at module level from line 26)."""
import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(64, 64)
        self.lm_head = torch.nn.Linear(64, 8192)

    def forward(self, x):
        return self.lm_head(torch.relu(self.body(x)))


torch.manual_seed(0)
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(512, 64)
target = torch.randint(0, 8192, (512,))
for step in range(3):
    opt.zero_grad()
    big = model(x).double().softmax(-1)  # the upcast: 8 bytes a logit, and its backward makes as much
    loss = -(big.gather(1, target[:, None]) + 1e-9).log().mean()
    with torch.no_grad():
        spread = (big * big.log1p()).sum().item()  # a module-level forward spike: two temporaries as big
    loss.backward()
    opt.step()
    print("loss", loss.item().hex(), spread.hex(), [p.grad.double().sum().item().hex() for p in model.parameters()])
