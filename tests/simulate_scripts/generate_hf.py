"""Greedy generation with a tiny Qwen2 (dynamic or static cache): runs to max_new_tokens."""
import json, sys
import torch, transformers
cache = sys.argv[1] if len(sys.argv) > 1 else "dynamic"
cfg = transformers.Qwen2Config(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=1000, max_position_embeddings=512, eos_token_id=0)
model = transformers.Qwen2ForCausalLM(cfg).to(torch.bfloat16).cuda().eval()
ids = torch.randint(1, cfg.vocab_size, (2, 32), device="cuda")
kw = {"cache_implementation": "static"} if cache == "static" else {}
with torch.inference_mode():
    out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, do_sample=False, **kw)
print("RESULT " + json.dumps({"tokens": int(out.shape[1]), "max_allocated": torch.cuda.max_memory_allocated()}))
