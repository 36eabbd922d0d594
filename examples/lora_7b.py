"""A LoRA fine-tune of a 7B Llama (random weights from its config: no download), as people write one.

    python examples/lora_7b.py --batch 8 --seq 512            # on a GPU
    tracekit simulate --gpu 4090 -- python examples/lora_7b.py --batch 8   # will it fit on a 24 GB card?
"""
import argparse

import torch
import transformers
from peft import LoraConfig, get_peft_model

p = argparse.ArgumentParser()
p.add_argument("--batch", type=int, default=8)
p.add_argument("--seq", type=int, default=512)
p.add_argument("--steps", type=int, default=2)
p.add_argument("--checkpointing", action="store_true")
a = p.parse_args()

cfg = transformers.LlamaConfig(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                               num_key_value_heads=32, vocab_size=32000, max_position_embeddings=4096)
model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16).cuda()
if a.checkpointing:
    model.gradient_checkpointing_enable()
    model.enable_input_require_grads()
model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
model.print_trainable_parameters()
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=2e-4)
for step in range(a.steps):
    ids = torch.randint(0, cfg.vocab_size, (a.batch, a.seq), device="cuda")
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    print(f"step {step}: loss {loss.item():.3f}")
print(f"peak allocated {torch.cuda.max_memory_allocated() / 2**30:.2f} GiB, "
      f"reserved {torch.cuda.max_memory_reserved() / 2**30:.2f} GiB")
