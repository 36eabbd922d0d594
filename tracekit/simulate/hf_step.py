"""The training step `tracekit estimate --simulate` runs on the simulated GPU (runner.simulation): a built-in
training script, one user of the same machinery as `tracekit simulate -- python train.py`.

Written as a plain training script would be, so the simulated stream's frames read like a recording's:
the model moved to the device (its parameters and buffers, in `Module._apply`'s order), then per step
the batch moved in, forward (under CUDA autocast for `amp`), loss, backward, optimizer step,
`zero_grad(set_to_none=True)`. The model's outputs stay referenced until the step ends, as in a loop
written `out = model(...); out.loss.backward()`; no KV cache is kept (`use_cache=False`).
"""
from __future__ import annotations

import inspect

import torch
from torch.utils._python_dispatch import _disable_current_modes


class TrainingStep:
    def __init__(self, w, model, session):
        self.w, self.model, self.s = w, model, session
        self.marks = session.marks
        self.optimizer = None
        # the weights' dtype: fp32 for fp32 and amp (autocast runs on fp32 weights), else 16-bit; a config's own
        # torch_dtype (which transformers builds in) is what a checkpoint was saved in, not how it is trained
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(w.precision, torch.float32)
        self.vocab = int(model.config.vocab_size)
        self.generator = torch.Generator().manual_seed(w.seed)
        self.use_cache_kw = _accepts(model, "use_cache")

    def tag(self, kind, t, name):
        self.s.tags.append((kind, self.s.sids.get(id(t.untyped_storage())), name))

    def setup(self):
        self.s.metadata = "tracekit:setup"
        to_device(self.model, self.dtype)
        if self.w.checkpointing == "full":
            self.model.gradient_checkpointing_enable()
        self.model.train()
        for name, p in self.model.named_parameters():
            self.tag("parameter", p, name)
        for name, b in self.model.named_buffers():
            self.tag("buffer", b, name)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(self.w.optimizer, params, self.w.lr)
        self.s.metadata = ""

    def batch(self):
        with _disable_current_modes():  # the token ids themselves are real (data-dependent checks read them)
            real = torch.randint(0, self.vocab, (self.w.batch, self.w.seq), generator=self.generator)
        ids = real.to("cuda")  # batch.to(device): the copy keeps the real values beside the fake tensor
        self.tag("input", ids, "input_ids")
        return ids

    def step(self, i):
        marks, model, opt = self.marks, self.model, self.optimizer
        marks.start_iteration(i)
        ids = self.batch()
        kwargs = {"input_ids": ids, "labels": ids}
        if self.use_cache_kw:
            kwargs["use_cache"] = False  # a training step keeps no KV cache
        marks.start_phase("forward")
        if self.w.precision == "amp":
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = model(**kwargs)
        else:
            out = model(**kwargs)
        loss = out.loss
        marks.start_phase("backward")
        loss.backward()
        for name, p in model.named_parameters():
            if p.grad is not None:
                self.tag("gradient", p.grad, name + ".grad")
        if opt is not None:
            marks.start_phase("optimizer")
            opt.step()
            for state in opt.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        kind = "step" if key == "step" else "optimizer_state"
                        self.tag(kind, value, key)
            opt.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=True)
        marks.end_phase()
        del out, loss, ids, kwargs
        marks.end_iteration()


def to_device(model, dtype=None, device="cuda"):
    """`model.to(device[, dtype])` of a model built on the meta device: a tensor of the simulated GPU for every
    parameter and buffer, children first as
    Module._apply goes, shared (tied) tensors kept shared."""
    memo = {}

    def convert(t, is_param):
        got = memo.get(id(t))
        if got is not None:
            return got
        target = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
        new = torch.empty(t.shape, dtype=target, device=device)
        if is_param:
            new = torch.nn.Parameter(new, requires_grad=t.requires_grad)
        memo[id(t)] = new
        return new

    for module in _apply_order(model):
        for name, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[name] = convert(p, True)
        for name, b in list(module._buffers.items()):
            if b is not None:
                module._buffers[name] = convert(b, False)
    return model


def _apply_order(model):
    out = []

    def walk(m):
        for c in m.children():
            walk(c)
        out.append(m)
    walk(model)
    return out


def make_optimizer(name, params, lr):
    """torch.optim as a CUDA run makes it: foreach=True is what torch picks by default for CUDA tensors
    (optimizer.py _default_to_fused_or_foreach); on CPU tensors it would take the for-loop."""
    if name == "none":
        return None
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, foreach=True)
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, foreach=True)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, foreach=True)
    if name == "sgd-momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9, foreach=True)
    if name == "adafactor":
        return torch.optim.Adafactor(params, lr=lr, foreach=True)
    raise ValueError(f"optimizer {name!r} cannot be simulated")


def _accepts(model, name) -> bool:
    try:
        return name in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return False
