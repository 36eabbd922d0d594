"""Two CUDA streams: the side stream's blocks come from pools of their own."""
import json
import torch
s = torch.cuda.Stream()
a = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")
del a  # a 20 MiB segment, cached on the default stream
with torch.cuda.stream(s):
    b = torch.empty(3 << 20, dtype=torch.uint8, device="cuda")  # cannot reuse the default stream's block
torch.cuda.current_stream().wait_stream(s)
b.record_stream(torch.cuda.current_stream())
print("RESULT " + json.dumps({"reserved": torch.cuda.memory_reserved(), "allocated": torch.cuda.memory_allocated()}))
