"""DDP over torch.distributed: whole parameters and gradients on every rank, plus gradient buckets."""
import json, sys
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group("nccl")
rank = dist.get_rank(); torch.cuda.set_device(rank)
model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)).cuda()
ddp = DDP(model, device_ids=[rank], gradient_as_bucket_view="--view" in sys.argv)
opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
for _ in range(2):
    loss = ddp(torch.randn(8, 1024, device="cuda")).square().mean()
    loss.backward(); opt.step(); opt.zero_grad(set_to_none=False)
print("RESULT " + json.dumps({"param_bytes": sum(p.numel() * 4 for p in model.parameters()),
                              "allocated": torch.cuda.memory_allocated(), "max_allocated": torch.cuda.max_memory_allocated()}))
dist.destroy_process_group()
