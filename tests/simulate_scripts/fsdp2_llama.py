"""FSDP2 over a Llama-style Hugging Face model built from a config file (argv: config.json batch seq): each decoder
layer a unit, then the root; AdamW, fp32; one warm-up step, then the peak of one step."""
import json, sys
import torch, torch.distributed as dist, transformers
from torch.distributed.fsdp import fully_shard
dist.init_process_group("nccl")
rank = dist.get_rank(); torch.cuda.set_device(rank)
cfg = transformers.AutoConfig.for_model(**json.load(open(sys.argv[1])))
batch, seq = int(sys.argv[2]), int(sys.argv[3])
with torch.device("cuda"):
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
for layer in model.model.layers:
    fully_shard(layer)
fully_shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
for step in range(2):
    if step == 1:
        torch.cuda.reset_peak_memory_stats()
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device="cuda")
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step(); opt.zero_grad()
print("RESULT " + json.dumps({"max_allocated": torch.cuda.max_memory_allocated(), "params": sum(p.numel() for p in model.parameters())}))
dist.destroy_process_group()
