"""FSDP2 (fully_shard) over torch.distributed: each rank holds 1/N of every parameter."""
import json
import torch, torch.distributed as dist
from torch.distributed.fsdp import fully_shard
dist.init_process_group("nccl")
rank, world = dist.get_rank(), dist.get_world_size()
torch.cuda.set_device(rank)
model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 512))
                              for _ in range(4)]).cuda()
full = sum(p.numel() * p.element_size() for p in model.parameters())
for m in model:
    fully_shard(m)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters())
for _ in range(2):
    loss = model(torch.randn(4, 256, 512, device="cuda")).square().mean()
    loss.backward(); opt.step(); opt.zero_grad()
local = sum(p.to_local().numel() * p.element_size() for p in model.parameters())
state = sum(v.to_local().numel() * v.element_size() for s in opt.state.values() for k, v in s.items() if k != "step")
print("RESULT " + json.dumps({"rank": rank, "world": world, "full_bytes": full, "local_bytes": local, "state_bytes": state,
                              "device": torch.cuda.current_device(), "max_allocated": torch.cuda.max_memory_allocated()}))
dist.destroy_process_group()
