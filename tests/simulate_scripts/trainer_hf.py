"""Hugging Face Trainer on a tiny Qwen2 (bf16 autocast through accelerate), two steps."""
import json
import torch, transformers
cfg = transformers.Qwen2Config(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256)
model = transformers.Qwen2ForCausalLM(cfg)


class DS(torch.utils.data.Dataset):
    def __len__(self):
        return 16

    def __getitem__(self, i):
        ids = torch.randint(0, 1000, (64,))
        return {"input_ids": ids, "labels": ids}


args = transformers.TrainingArguments(output_dir="/tmp/tracekit_sim_trainer", per_device_train_batch_size=4, max_steps=2,
                                      bf16=True, report_to=[], logging_steps=1, save_strategy="no",
                                      dataloader_num_workers=0)
tr = transformers.Trainer(model=model, args=args, train_dataset=DS())
tr.train()
print("RESULT " + json.dumps({"device": str(next(model.parameters()).device), "max_allocated": torch.cuda.max_memory_allocated(),
                              "steps": tr.state.global_step}))
