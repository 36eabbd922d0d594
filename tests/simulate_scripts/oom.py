"""Allocate until the simulated card is full; catch torch.cuda.OutOfMemoryError (or not, with --uncaught)."""
import json, sys
import torch
hits = []
seen = {}
torch.cuda.memory._attach_out_of_memory_observer(lambda device, alloc, dev_alloc, dev_free: seen.update(alloc=alloc))
chunks = []
try:
    while True:
        chunks.append(torch.empty(1 << 30, dtype=torch.uint8, device="cuda"))  # 1 GiB each
except torch.cuda.OutOfMemoryError as e:
    if "--uncaught" in sys.argv:
        raise
    print("RESULT " + json.dumps({"chunks": len(chunks), "message": str(e), "observer": seen,
                                  "reserved": torch.cuda.memory_reserved(), "free": torch.cuda.mem_get_info()[0],
                                  "total": torch.cuda.mem_get_info()[1]}))
