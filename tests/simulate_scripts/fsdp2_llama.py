"""FSDP2 over a Llama-style Hugging Face model built from a config file, as FSDP2 training loops are written
(torchtitan, the FSDP2 tutorial): each decoder layer a unit, then the root; AdamW (torch's default foreach path),
the model's own loss, backward, step, zero_grad; one warm-up step, then the peak of one step.

argv: config.json batch seq [--mp bf16] [--no-reshard] [--keep-output]
  --mp bf16       MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) (torchtitan's default): fp32
                  shards, gradients and AdamW state; each unit all-gathered and computed in bf16, reduce-scattered in fp32
  --bf16          the model built in bf16, no policy: bf16 shards, gradients and AdamW state (pure bf16 training)
  --no-reshard    fully_shard(layer, reshard_after_forward=False): each layer stays unsharded from forward to backward
  --keep-output   `out = model(...); out.loss.backward()`: the model's output (its logits) held through the step,
                  instead of `model(...).loss.backward()` (only the loss kept)"""
import json, sys
import torch, torch.distributed as dist, transformers
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
argv = sys.argv[1:]
mp = "--mp" in argv and argv[argv.index("--mp") + 1] == "bf16"
if "--mp" in argv:
    del argv[argv.index("--mp"):argv.index("--mp") + 2]
flags = [a for a in argv if a.startswith("--")]
args = [a for a in argv if not a.startswith("--")]
dist.init_process_group("nccl")
rank = dist.get_rank(); torch.cuda.set_device(rank)
cfg = transformers.AutoConfig.for_model(**json.load(open(args[0])))
batch, seq = int(args[1]), int(args[2])
with torch.device("cuda"):
    dtype = torch.bfloat16 if "--bf16" in flags else torch.float32
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if mp else {}
for layer in model.model.layers:
    fully_shard(layer, reshard_after_forward="--no-reshard" not in flags, **kw)
fully_shard(model, **kw)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
for step in range(2):
    if step == 1:
        torch.cuda.reset_peak_memory_stats()
    ids = torch.randint(0, cfg.vocab_size, (batch, seq), device="cuda")
    if "--keep-output" in flags:
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
    else:
        model(input_ids=ids, labels=ids).loss.backward()
    opt.step(); opt.zero_grad()
print("RESULT " + json.dumps({"max_allocated": torch.cuda.max_memory_allocated(), "params": sum(p.numel() for p in model.parameters())}))
dist.destroy_process_group()
