"""The training step `tracekit estimate --simulate` runs on fake tensors (see fake.py).

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


class Run:
    def __init__(self, w, model, *, tracker, autocast, marks, log, tags):
        self.w, self.model = w, model
        self.tracker, self.autocast, self.marks, self.log, self.tags = tracker, autocast, marks, log, tags
        self.optimizer = None
        # the weights' dtype: fp32 for fp32 and amp (autocast runs on fp32 weights), else 16-bit; a config's own
        # torch_dtype (which transformers builds in) is what a checkpoint was saved in, not how it is trained
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(w.precision, torch.float32)
        self.vocab = int(model.config.vocab_size)
        self.generator = torch.Generator().manual_seed(w.seed)
        self.use_cache_kw = _accepts(model, "use_cache")

    def setup(self):
        self.log.metadata = "tracekit:setup"
        to_device(self.model, self.dtype)
        if self.w.checkpointing == "full":
            self.model.gradient_checkpointing_enable()
        self.model.train()
        for name, p in self.model.named_parameters():
            self.tags.append(("parameter", self.tracker.sid_of(p), name))
        for name, b in self.model.named_buffers():
            self.tags.append(("buffer", self.tracker.sid_of(b), name))
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = make_optimizer(self.w.optimizer, params, self.w.lr)
        self.log.metadata = ""

    def batch(self):
        with _disable_current_modes():  # the token ids themselves are real (data-dependent checks read them)
            real = torch.randint(0, self.vocab, (self.w.batch, self.w.seq), generator=self.generator)
        with self.log.op("_to_copy"):
            ids = torch.empty((self.w.batch, self.w.seq), dtype=torch.int64)  # batch.to(device)
        self.tracker.set_shadow(ids, real)
        self.tags.append(("input", self.tracker.sid_of(ids), "input_ids"))
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
            with self.autocast.region(torch.bfloat16):
                out = model(**kwargs)
        else:
            out = model(**kwargs)
        loss = out.loss
        marks.start_phase("backward")
        if loss.grad_fn is not None:
            self.tracker.watch_graph(loss.grad_fn)
        loss.backward()
        for name, p in model.named_parameters():
            if p.grad is not None:
                self.tags.append(("gradient", self.tracker.sid_of(p.grad), name + ".grad"))
        if opt is not None:
            marks.start_phase("optimizer")
            opt.step()
            for state in opt.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        kind = "step" if key == "step" else "optimizer_state"
                        self.tags.append((kind, self.tracker.sid_of(value), key))
            opt.zero_grad(set_to_none=True)
        else:
            model.zero_grad(set_to_none=True)
        marks.end_phase()
        del out, loss, ids, kwargs
        marks.end_iteration()


def to_device(model, dtype=None):
    """`model.to(device[, dtype])`: a fake tensor for every parameter and buffer, children first as
    Module._apply goes, shared (tied) tensors kept shared."""
    memo = {}

    def convert(t, is_param):
        got = memo.get(id(t))
        if got is not None:
            return got
        target = dtype if (dtype is not None and t.is_floating_point()) else t.dtype
        new = torch.empty(t.shape, dtype=target, device="cpu")
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
