"""Tensor tags: (address, size, device, time, kind, name) of tensors whose role we know.

A tag labels the allocation that holds that address at that time: the
storage of a parameter, a gradient, an optimizer state tensor, a tensor saved
for backward (activation) or a model input. Tags use the storage's base
address and size, so they match the allocation exactly.
"""
from __future__ import annotations

from .marks import now_us

PARAMETER, BUFFER, GRADIENT = "parameter", "buffer", "gradient"
OPTIMIZER_STATE, ACTIVATION, INPUT = "optimizer_state", "activation", "input"
UNSHARDED_PARAMETER = "unsharded_parameter"  # a unit's full parameters all-gathered for compute (FSDP2 unshard)
KINDS = (PARAMETER, BUFFER, GRADIENT, OPTIMIZER_STATE, ACTIVATION, INPUT, UNSHARDED_PARAMETER)
MAX_TAGS = 50_000  # the newest kept (CUDA: the kept window is known at the end only); all are re-tagged every iteration


def storage_span(tensor):
    """(base address, size in bytes) of a tensor's storage, or None (no storage, meta, sparse...).

    A DTensor (FSDP2's sharded parameters, their gradients and optimizer state; tensor parallelism) has no
    storage of its own: its local tensor's is what this rank holds."""
    try:
        local = getattr(tensor, "_local_tensor", None)
        if local is not None:
            tensor = local
        storage = tensor.untyped_storage()
        addr, size = storage.data_ptr(), storage.nbytes()
    except Exception:
        return None
    return (addr, size) if addr and size else None


class Tags:
    """Collects tags; `device_of(tensor)` (from the backend) says which tensors the trace sees.

    Within one iteration each (address, kind, name) is tagged once, and an
    address already tagged as a parameter, buffer or input is not tagged
    again as an activation.
    """

    def __init__(self, device_of, clock=now_us):
        self.device_of = device_of
        self.clock = clock
        self._items = []
        self._seen = set()
        self._owned = set()  # addresses of parameters, buffers and inputs this iteration
        self._activation_at = {}  # address -> index in _items of this iteration's activation tag

    @property
    def items(self):
        """The tags as dicts (an activation's name is made here, once: "GeluBackward0 [8, 128, 512]")."""
        out = []
        for t in self._items:
            if t is None:
                continue
            addr, size, device, time_us, kind, name = t
            if type(name) is tuple:
                fn, shape = name
                name = f"{fn.__name__ if fn is not None else 'saved tensor'} {list(shape)}"
            out.append({"addr": addr, "size": size, "device": device, "time_us": time_us, "kind": kind,
                        "name": name})
        return out

    def forget_before(self, time_us):
        """Drop the tags older than `time_us` (the oldest entry the trace still keeps): every iteration tags
        parameters, gradients and state again, so what the kept window needs stays."""
        items = self._items
        i = 0
        while i < len(items) and (items[i] is None or items[i][3] < time_us):
            i += 1
        if i:
            del items[:i]
            self._activation_at = {a: k - i for a, k in self._activation_at.items() if k >= i}

    def new_iteration(self):
        if len(self._items) > MAX_TAGS:  # bounded on long runs: the oldest go (the trace keeps the newest too)
            del self._items[:len(self._items) - MAX_TAGS // 2]
        self._seen.clear()
        self._owned.clear()
        self._activation_at.clear()

    def add(self, tensor, kind, name, time_us=None):
        if tensor is None:
            return
        device = self.device_of(tensor)
        if device is None:
            return
        span = storage_span(tensor)
        if span is None:
            return
        addr, size = span
        if kind == ACTIVATION and addr in self._owned:
            return
        key = (addr, kind, name)
        if key in self._seen:
            return
        self._seen.add(key)
        if kind in (PARAMETER, BUFFER, INPUT):
            self._owned.add(addr)
            # e.g. an input seen as a saved tensor before the forward hook that names it
            drop = self._activation_at.pop(addr, None)
            if drop is not None:
                self._items[drop] = None
        elif kind == ACTIVATION:
            self._activation_at[addr] = len(self._items)
        self._items.append((addr, size, device, self.clock() if time_us is None else time_us, kind, name))

    def add_unsharded(self, tensors, name):
        """Tag full parameters just all-gathered (FSDP2's unshard): every time, since a unit is unsharded in
        forward and again in backward, often at the same address."""
        for t in tensors:
            if t is None or self.device_of(t) is None:
                continue
            span = storage_span(t)
            if span is not None:
                self._items.append((span[0], span[1], self.device_of(t), self.clock(), UNSHARDED_PARAMETER, name))

    # -- what a model and an optimizer hold -------------------------------
    def add_named(self, named, kind, prefix=""):
        add = self.add
        for name, t in named:
            add(t, kind, prefix + name)

    def add_model(self, model, prefix=""):
        for name, p in model.named_parameters():
            self.add(p, PARAMETER, prefix + name)
        for name, b in model.named_buffers():
            self.add(b, BUFFER, prefix + name)

    def add_gradients(self, named_params):
        for name, p in named_params:
            self.add(p.grad, GRADIENT, name + ".grad")

    def add_optimizer_state(self, optimizer, names):
        for name, p in optimizer_params(optimizer, names):
            for key, value in optimizer.state.get(p, {}).items():
                if is_tensor(value):
                    self.add(value, OPTIMIZER_STATE, f"{name}.{key}")

    def add_inputs(self, args, kwargs=None):
        for name, t in iter_tensors(args, "input"):
            if is_input(t):
                self.add(t, INPUT, name)
        for name, t in iter_tensors(kwargs or {}, "input"):
            if is_input(t):
                self.add(t, INPUT, name)

    def add_activation(self, tensor, fn=False):
        if fn is False:
            fn = tensor.grad_fn
        if fn is None and tensor.requires_grad:
            return  # a parameter (or another leaf that wants a gradient), not an activation
        # named lazily ("GeluBackward0 [8, 128, 512]" is made when the file is written): the node's class
        # and the shape, never the node itself (that would keep the graph alive)
        self.add(tensor, ACTIVATION, (type(fn) if fn is not None else None, tuple(tensor.shape)))


def is_tensor(x) -> bool:
    import torch

    return isinstance(x, torch.Tensor)


def is_input(t) -> bool:
    """A model input: a leaf the autograd graph did not make (not a parameter, not an activation)."""
    import torch

    return t.grad_fn is None and not isinstance(t, torch.nn.Parameter) and not t.requires_grad


def iter_tensors(obj, name, depth=0):
    """(name, tensor) for tensors in nested tuples, lists and dicts (batches, kwargs)."""
    if depth > 4:
        return
    if is_tensor(obj):
        yield name, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from iter_tensors(v, f"{name}[{k!r}]" if depth else str(k), depth + 1)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from iter_tensors(v, f"{name}[{i}]", depth + 1)
    elif hasattr(obj, "items") and hasattr(obj, "keys"):  # BatchEncoding and other mappings
        try:
            items = list(obj.items())
        except Exception:
            return
        for k, v in items:
            yield from iter_tensors(v, str(k), depth + 1)


def param_names(models) -> dict:
    """id(parameter) -> qualified name, over the known models."""
    names: dict = {}
    for prefix, model in models:
        for name, p in model.named_parameters():
            names.setdefault(id(p), prefix + name)
    return names


def optimizer_params(optimizer, names):
    """(name, parameter) for every parameter of an optimizer; unnamed ones get group/index names."""
    for g, group in enumerate(optimizer.param_groups):
        for i, p in enumerate(group["params"]):
            yield names.get(id(p), f"param_groups[{g}][{i}]"), p


def storages(named_tensors, device_of):
    """[(addr, size)] of distinct storages among (name, tensor) pairs that the trace sees."""
    out = {}
    for _, t in named_tensors:
        if t is None or device_of(t) is None:
            continue
        span = storage_span(t)
        if span is not None:
            out.setdefault(span[0], span[1])
    return sorted(out.items())
