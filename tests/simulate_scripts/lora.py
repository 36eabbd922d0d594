"""peft LoRA on a tiny Llama: only the adapters train (QLoRA: qlora.py)."""
import json
import torch, transformers
from peft import LoraConfig, get_peft_model
cfg = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=4, vocab_size=1000, max_position_embeddings=256)
model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
model = model.cuda()
model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"], lora_alpha=16))
trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
ids = torch.randint(0, 1000, (2, 64), device="cuda")
loss = model(input_ids=ids, labels=ids).loss
loss.backward(); opt.step(); opt.zero_grad()
state = sum(t.numel() * t.element_size() for s in opt.state.values() for k, t in s.items() if k != "step")
print("RESULT " + json.dumps({"trainable": trainable, "state_bytes": state, "max_allocated": torch.cuda.max_memory_allocated()}))
