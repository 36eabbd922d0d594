"""Where a torch call's tensors go: the function-level rules of the simulated device (a TorchFunctionMode).

A call that names a CUDA device (`device="cuda"`, `.cuda()`, `.to("cuda:1")`, a tensor of the simulated
device as `.to()`'s argument) makes device storage; `.cpu()` / `.to("cpu")` of a device tensor makes a host
copy; a call on device tensors lets the factories inside it (a composite's temporaries) make device storage.
The fake tensors themselves stay on `cpu` (see engine.py); this mode only says where their storages count.
Also here: what a real CUDA tensor answers that a fake one cannot (`tolist`, `numpy`, `record_stream`,
`pin_memory`), backward's start (the graph watched for in-place accumulation), and torch.save / torch.load.
"""
from __future__ import annotations

from .engine import HOST, MAX_SHADOW


def device_mode_class():
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import _disable_current_modes

    T = torch.Tensor
    PARSE_TO = torch._C._nn._parse_to

    class DeviceMode(TorchFunctionMode):
        def __init__(self, session, tracker, marks=None):
            super().__init__()
            self.s = session
            self.tracker = tracker
            self.marks = marks
            self.special = {
                T.cuda: self._cuda, T.cpu: self._cpu, T.to: self._to, T.tolist: self._tolist, T.numpy: self._numpy,
                T.record_stream: self._record_stream, T.pin_memory: self._pin_memory, T.is_pinned: self._is_pinned,
                T.backward: self._backward, torch.autograd.backward: self._backward_fn,
                torch.autograd.grad: self._backward_fn, T.__array__: self._array,
            }

        # ------------------------------------------------------------------------------------------
        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            h = self.special.get(func)
            if h is not None and not (self.s.cpu_run and func in (T.cuda, T.cpu, T.to)):
                return h(func, args, kwargs)
            if func is PARSE_TO:  # parses `.to()`'s arguments (a subclass's own `to`): the device as named
                return func(*args, **kwargs)
            s = self.s
            target = None
            d = kwargs.get("device")
            if d is not None:
                idx = s.cuda_index(d)
                if idx is not None:
                    kwargs = dict(kwargs, device="cpu")
                    target = idx
            ambient = self._ambient(args)
            with s.call(target, ambient):
                return func(*args, **kwargs)

        def _ambient(self, args):
            s = self.s
            for a in args:
                if isinstance(a, torch.Tensor):
                    d = s.where_of(a)
                    if d is not None:
                        return d
                elif isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor):
                    for t in a:
                        if isinstance(t, torch.Tensor):
                            d = s.where_of(t)
                            if d is not None:
                                return d
            return None

        # moving tensors -----------------------------------------------------------------------------------
        def _copy_to(self, t, where, dtype=None, memory_format=None):
            kw = {"copy": True}
            if dtype is not None:
                kw["dtype"] = dtype
            if memory_format is not None:
                kw["memory_format"] = memory_format
            with self.s.call(where, None):
                out = T.to(t, "cpu", **kw)
            sh = self.tracker.shadow.get(t) if isinstance(t, torch._subclasses.fake_tensor.FakeTensor) else None
            if sh is None and not isinstance(t, torch._subclasses.fake_tensor.FakeTensor) and t.numel() <= MAX_SHADOW:
                sh = t  # a real tensor (from numpy, torch.load...) keeps its values
            if sh is not None:
                with _disable_current_modes():
                    self.tracker.shadow[out] = sh.to(dtype) if dtype is not None else sh.clone()
            return out

        def _cuda(self, func, args, kwargs):
            t = args[0]
            dev = args[1] if len(args) > 1 else kwargs.get("device")
            idx = self.s.current_device if dev is None else self.s.cuda_index(dev if not isinstance(dev, int) else dev)
            if idx is None:
                idx = self.s.current_device
            if self.s.where_of(t) == idx:
                return t
            return self._copy_to(t, idx, memory_format=kwargs.get("memory_format"))

        def _cpu(self, func, args, kwargs):
            t = args[0]
            if self.s.where_of(t) is None:
                return t
            return self._copy_to(t, HOST, memory_format=kwargs.get("memory_format"))

        def _to(self, func, args, kwargs):
            t = args[0]
            rest, kw = args[1:], dict(kwargs)
            copy = kw.pop("copy", False)
            if rest and isinstance(rest[0], torch.Tensor):  # .to(other): other's device and dtype
                other = rest[0]
                d = self.s.where_of(other)
                device = torch.device("cuda", d) if d is not None else torch.device("cpu")
                dtype, non_blocking = other.dtype, (rest[1] if len(rest) > 1 else kw.get("non_blocking", False))
                memory_format = None
                if len(rest) > 2:
                    copy = rest[2]
            else:
                for i, a in enumerate(rest):
                    if isinstance(a, bool) and i >= 1:
                        pass
                if rest and isinstance(rest[0], int) and not isinstance(rest[0], bool) and not self.s.cpu_run:
                    rest = (torch.device("cuda", rest[0]),) + tuple(rest[1:])  # .to(0): the card, as on CUDA
                if isinstance(kw.get("device"), int) and not isinstance(kw["device"], bool) and not self.s.cpu_run:
                    kw["device"] = torch.device("cuda", kw["device"])
                try:
                    device, dtype, non_blocking, memory_format = torch._C._nn._parse_to(*rest, **kw)
                except Exception:
                    with self.s.call(None, self.s.where_of(t)):
                        return func(*args, **kwargs)
                # positional copy flag: to(device, dtype, non_blocking, copy)
                pos_bools = [a for a in rest if isinstance(a, bool)]
                if len(pos_bools) >= 2:
                    copy = pos_bools[1]
            src = self.s.where_of(t)
            if device is None:
                with self.s.call(None, src):
                    return T.to(t, dtype=dtype, copy=copy, memory_format=memory_format) if dtype is not None \
                        else T.to(t, copy=copy, memory_format=memory_format) if memory_format is not None \
                        else (T.to(t, copy=copy) if copy else t)
            want = self.s.cuda_index(device)
            want = HOST if want is None else want
            here = HOST if src is None else src
            if want == here:
                with self.s.call(None, src):
                    if dtype is not None or copy or memory_format is not None:
                        kw2 = {"copy": copy}
                        if dtype is not None:
                            kw2["dtype"] = dtype
                        if memory_format is not None:
                            kw2["memory_format"] = memory_format
                        return T.to(t, **kw2)
                    return t
            return self._copy_to(t, want, dtype=dtype, memory_format=memory_format)

        # values ------------------------------------------------------------------------------------------
        def _values(self, t):
            from torch._subclasses.fake_tensor import FakeTensor
            if not isinstance(t, FakeTensor):
                return t
            r = self.tracker.shadow.get(t)
            if r is None:
                self.s.assume("the values of a tensor nobody knows read as zeros (.tolist() / .numpy())",
                              self.tracker.where())
                with _disable_current_modes():
                    r = torch.zeros(tuple(t.shape), dtype=t.dtype)
            return r

        def _tolist(self, func, args, kwargs):
            r = self._values(args[0])
            with _disable_current_modes():
                return r.tolist()

        def _numpy(self, func, args, kwargs):
            r = self._values(args[0])
            with _disable_current_modes():
                return r.numpy(**kwargs)

        def _array(self, func, args, kwargs):
            r = self._values(args[0])
            with _disable_current_modes():
                return r.__array__(*args[1:], **kwargs)

        def _record_stream(self, func, args, kwargs):
            t, stream = args[0], args[1] if len(args) > 1 else kwargs.get("stream")
            self.s.record_stream(t, getattr(stream, "stream_id", 0))

        def _pin_memory(self, func, args, kwargs):
            return args[0]  # pinned host memory is host memory: not counted

        def _is_pinned(self, func, args, kwargs):
            return False

        # backward ------------------------------------------------------------------------------------------
        def _start_backward(self, tensors):
            roots = [t.grad_fn for t in tensors if isinstance(t, torch.Tensor) and t.grad_fn is not None]
            self.tracker.watch_graph(roots)
            if self.marks is not None:
                self.marks.backward_starts()

        def _backward(self, func, args, kwargs):
            self._start_backward([args[0]])
            with self.s.call(None, self.s.where_of(args[0])):
                return func(*args, **kwargs)

        def _backward_fn(self, func, args, kwargs):  # torch.autograd.backward(tensors) / grad(outputs)
            first = args[0] if args else kwargs.get("tensors", kwargs.get("outputs"))
            roots = [first] if isinstance(first, torch.Tensor) else list(first or [])
            self._start_backward(roots)
            with self.s.call(None, self._ambient([roots])):
                return func(*args, **kwargs)

    return DeviceMode
