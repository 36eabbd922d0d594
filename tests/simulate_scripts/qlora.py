"""QLoRA as people write it: a 4-bit (or --8bit) model read from a local folder with from_pretrained and a
device_map (--device-map auto | 0 | cuda), peft's k-bit preparation with gradient checkpointing, LoRA on the
attention projections, two AdamW steps."""
import json, sys
import torch, transformers
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
bits = 8 if "--8bit" in sys.argv else 4
where = sys.argv[sys.argv.index("--device-map") + 1] if "--device-map" in sys.argv else "0"
device_map = {"": 0} if where == "0" else where
quant = (transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_type="nf4",
                                         bnb_4bit_use_double_quant=True) if bits == 4
         else transformers.BitsAndBytesConfig(load_in_8bit=True))
model = transformers.AutoModelForCausalLM.from_pretrained(sys.argv[1], quantization_config=quant, device_map=device_map,
                                                          dtype=torch.bfloat16)
after_load = torch.cuda.memory_allocated()
model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=True)
model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], lora_alpha=16,
                                         task_type="CAUSAL_LM"))
trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
ids = torch.randint(0, 1000, (2, 64), device="cuda")
for _ in range(2):
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward(); opt.step(); opt.zero_grad()
state = sum(t.numel() * t.element_size() for s in opt.state.values() for k, t in s.items() if k != "step")
w = model.base_model.model.model.layers[0].self_attn.q_proj.base_layer.weight
print("RESULT " + json.dumps({"bits": bits, "after_load": after_load, "trainable": trainable, "state_bytes": state,
                              "weight": [type(w).__name__, str(w.dtype), list(w.shape), str(w.device)],
                              "max_allocated": torch.cuda.max_memory_allocated()}))
