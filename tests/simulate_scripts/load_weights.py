"""Weights read from disk onto the card: from_pretrained from a local folder, torch.load and safetensors with a
device (argv: the folder holding `tiny/` and `sd.pt`)."""
import json, os, sys
import torch, transformers, safetensors.torch
root = sys.argv[1]
m = transformers.AutoModelForCausalLM.from_pretrained(os.path.join(root, "tiny"), dtype=torch.float32).cuda()
a = torch.cuda.memory_allocated()
sd = torch.load(os.path.join(root, "sd.pt"), map_location="cuda")
b = torch.cuda.memory_allocated()
st = safetensors.torch.load_file(os.path.join(root, "tiny", "model.safetensors"), device="cuda")
c = torch.cuda.memory_allocated()
print("RESULT " + json.dumps({"model": a, "torch_load": b - a, "safetensors": c - b, "dev": str(next(m.parameters()).device),
                              "sd_blocks": sum((t.numel() * t.element_size() + 511) // 512 * 512 for t in sd.values()),
                              "st_blocks": sum((t.numel() * t.element_size() + 511) // 512 * 512 for t in st.values()),
                              "sd_cuda": all(t.is_cuda for t in sd.values())}))
