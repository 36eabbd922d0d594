"""A tiny Mixtral training step: MoE routing depends on values nobody knows in a simulation."""
import json
import torch, transformers
cfg = transformers.MixtralConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=1000,
                                 max_position_embeddings=256)
model = transformers.MixtralForCausalLM(cfg).cuda()
opt = torch.optim.AdamW(model.parameters())
ids = torch.randint(0, 1000, (4, 64), device="cuda")
with torch.autocast("cuda", dtype=torch.bfloat16):
    loss = model(input_ids=ids, labels=ids).loss
loss.backward(); opt.step(); opt.zero_grad()
print("RESULT " + json.dumps({"max_allocated": torch.cuda.max_memory_allocated()}))
