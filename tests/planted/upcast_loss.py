"""Planted: logits upcast to fp32 in the loss (the backward spike comes from line 17)."""
import torch


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(64, 64)
        self.lm_head = torch.nn.Linear(64, 8192).to(torch.bfloat16)

    def forward(self, x):
        return self.lm_head(self.body(x).to(torch.bfloat16))


def loss_fn(logits, target):
    # upcast in the loss: 4 bytes per logit, and its backward makes as much again
    big = logits.float().softmax(-1)
    return -(big.gather(1, target[:, None]) + 1e-9).log().mean()


torch.manual_seed(0)
model = Net()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(512, 64)
target = torch.randint(0, 8192, (512,))
for step in range(3):
    opt.zero_grad()
    loss = loss_fn(model(x), target)
    loss.backward()
    opt.step()
    print("loss", loss.item().hex(), [p.grad.double().sum().item().hex() for p in model.parameters()])
