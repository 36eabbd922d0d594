"""A plain PyTorch training loop (our own test script for `tracekit simulate`): an MLP, AdamW or SGD,
optional bf16 autocast, fp16 autocast with GradScaler, gradient checkpointing, accumulation; prints RESULT."""
import argparse, json
import torch
import torch.utils.checkpoint as ckpt

p = argparse.ArgumentParser()
p.add_argument("--opt", default="adamw"); p.add_argument("--amp", default="none")
p.add_argument("--ckpt", default="none"); p.add_argument("--steps", type=int, default=2)
p.add_argument("--accum", type=int, default=1); p.add_argument("--set-to-none", type=int, default=1)
p.add_argument("--dump", default=""); p.add_argument("--batch", type=int, default=64)
a = p.parse_args()
dev = "cuda" if torch.cuda.is_available() else "cpu"


class Block(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.up, self.down = torch.nn.Linear(d, 4 * d), torch.nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.down(torch.nn.functional.gelu(self.up(x)))


class Net(torch.nn.Module):
    def __init__(self, d=512, layers=4):
        super().__init__()
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(layers))
        self.head = torch.nn.Linear(d, 10)

    def forward(self, x):
        for b in self.blocks:
            if a.ckpt != "none":
                x = ckpt.checkpoint(b, x, use_reentrant=(a.ckpt == "reentrant"))
            else:
                x = b(x)
        return self.head(x)


model = Net().to(dev)
after_model = torch.cuda.memory_allocated()
param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
opt = torch.optim.AdamW(model.parameters(), lr=1e-3) if a.opt == "adamw" else torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.amp.GradScaler("cuda", enabled=(a.amp == "fp16"))
dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(a.amp)
if a.dump:
    torch.cuda.memory._record_memory_history(max_entries=100000)
losses = []
for step in range(a.steps):
    for micro in range(a.accum):
        x = torch.randn(a.batch, 128, 512).to(dev)
        y = torch.randint(0, 10, (a.batch, 128)).to(dev)
        with torch.autocast(dev, dtype=dtype or torch.float32, enabled=dtype is not None):
            out = model(x)
            loss = torch.nn.functional.cross_entropy(out.flatten(0, 1).float(), y.flatten())
        scaler.scale(loss / a.accum).backward()
    scaler.step(opt)
    scaler.update()
    opt.zero_grad(set_to_none=bool(a.set_to_none))
    losses.append(loss.item())
state_bytes = sum(t.numel() * t.element_size() for s in opt.state.values() for t in s.values()
                  if torch.is_tensor(t) and t.is_cuda)
if a.dump:
    torch.cuda.memory._dump_snapshot(a.dump)
    torch.cuda.memory._record_memory_history(enabled=None)
with torch.no_grad():
    before = torch.cuda.memory_allocated()
    probe = model(torch.randn(4, 128, 512, device=dev))
    no_grad_delta = torch.cuda.memory_allocated() - before
print("RESULT " + json.dumps({
    "param_bytes": param_bytes, "after_model": after_model, "state_bytes": state_bytes,
    "max_allocated": torch.cuda.max_memory_allocated(), "max_reserved": torch.cuda.max_memory_reserved(),
    "allocated": torch.cuda.memory_allocated(), "no_grad_delta": no_grad_delta, "probe_bytes": probe.numel() * 4,
    "losses": losses, "device": str(next(model.parameters()).device), "is_cuda": next(model.parameters()).is_cuda,
    "name": torch.cuda.get_device_name(0), "total": torch.cuda.get_device_properties(0).total_memory,
    "stats_peak": torch.cuda.memory_stats()["allocated_bytes.all.peak"]}))
