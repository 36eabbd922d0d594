"""`torch.cuda` as the simulated card answers it: availability, devices and their properties, streams and
events, the caching allocator's counters (`memory_allocated`, `max_memory_reserved`, `memory_stats`,
`mem_get_info`...), `empty_cache`, the memory fraction, RNG state, and torch's memory history
(`torch.cuda.memory._record_memory_history` / `_snapshot` / `_dump_snapshot`: the snapshot the GPU run
would have written, in PyTorch's format). `torch.autocast("cuda")` runs CUDA's autocast policy (kernels.py)
on the fake tensors. Everything is put back when `installed()` exits.
"""
from __future__ import annotations

import contextlib
import pickle


class Properties:
    """torch.cuda.get_device_properties(): what scripts read of it."""

    def __init__(self, card, index):
        self.name = card.device_name
        from . import ledger
        self.total_memory = ledger.total_memory(card) if card.context_bytes else card.memory
        self.major, self.minor = card.sm
        self.multi_processor_count = card.sms
        self.is_integrated = False
        self.is_multi_gpu_board = False
        self.L2_cache_size = 50 << 20
        self.max_threads_per_multi_processor = 2048
        self.warp_size = 32
        self.uuid = f"GPU-simulated-{index}"
        self.gcnArchName = ""
        self.pci_bus_id = index
        self.pci_device_id = 0
        self.pci_domain_id = 0

    def __repr__(self):
        return (f"_CudaDeviceProperties(name='{self.name}', major={self.major}, minor={self.minor}, "
                f"total_memory={self.total_memory // (1 << 20)}MB, multi_processor_count={self.multi_processor_count}, "
                "simulated=True)")


def make_api(session):
    """The replacement functions and classes, bound to `session`."""
    import torch

    S = session
    streams = {}

    def idx(device=None):
        if device is None:
            return S.current_device
        if isinstance(device, int):
            return device
        got = S.cuda_index(device)
        return S.current_device if got is None else got

    class Stream:
        """A CUDA stream of the simulated device: its id is what the allocator's pools and the trace see."""
        _next = [1]

        def __new__(cls, device=None, priority=0, stream_id=None, **kw):
            self = object.__new__(cls)
            self.device_index = idx(device)
            self.device = torch.device("cuda", self.device_index)
            self.priority = priority
            if stream_id is None:
                cls._next[0] += 1
                stream_id = 0x7E0000 + cls._next[0] * 0x100
            self.stream_id = stream_id
            self.cuda_stream = stream_id
            self.device_type = 1
            return self

        def __init__(self, *a, **k):
            pass

        def wait_event(self, event):
            pass

        def wait_stream(self, stream):
            pass

        def record_event(self, event=None):
            event = event or Event()
            event.record(self)
            return event

        def query(self):
            return True

        def is_capturing(self):
            return False

        def synchronize(self):
            S.device(self.device_index).process_events([])

        def __eq__(self, other):
            return isinstance(other, Stream) and other.stream_id == self.stream_id and \
                other.device_index == self.device_index

        def __hash__(self):
            return hash((self.stream_id, self.device_index))

        def __enter__(self):
            self._prev = S.current_stream.get(self.device_index, 0)
            S.current_stream[self.device_index] = self.stream_id
            return self

        def __exit__(self, *exc):
            S.current_stream[self.device_index] = self._prev

        def __repr__(self):
            return f"<torch.cuda.Stream device=cuda:{self.device_index} cuda_stream={self.stream_id:#x} (simulated)>"

    class ExternalStream(Stream):
        def __new__(cls, stream_ptr, device=None, **kw):
            return Stream.__new__(cls, device=device, stream_id=stream_ptr)

    class Event:
        def __init__(self, enable_timing=False, blocking=False, interprocess=False, external=False):
            self.t = None

        def record(self, stream=None):
            self.t = S.now()

        def wait(self, stream=None):
            pass

        def query(self):
            return True

        def synchronize(self):
            pass

        def elapsed_time(self, end):
            return 0.0

        def ipc_handle(self):
            raise RuntimeError("IPC handles of simulated events cannot be shared")

    def default_stream(device=None):
        i = idx(device)
        key = (i, 0)
        if key not in streams:
            streams[key] = Stream(device=i, stream_id=0)
        return streams[key]

    def current_stream(device=None):
        i = idx(device)
        sid = S.current_stream.get(i, 0)
        key = (i, sid)
        if key not in streams:
            streams[key] = Stream(device=i, stream_id=sid)
        return streams[key]

    def set_stream(stream):
        if stream is not None:
            S.current_stream[stream.device_index] = stream.stream_id

    @contextlib.contextmanager
    def stream(s):
        if s is None:
            yield
            return
        prev_dev, prev = S.current_device, S.current_stream.get(s.device_index, 0)
        S.current_stream[s.device_index] = s.stream_id
        S.current_device = s.device_index
        try:
            yield
        finally:
            S.current_stream[s.device_index] = prev
            S.current_device = prev_dev

    class StreamContext:
        def __init__(self, s):
            self.s = s
            self.cm = None

        def __enter__(self):
            self.cm = stream(self.s)
            self.cm.__enter__()

        def __exit__(self, *exc):
            return self.cm.__exit__(*exc)

    class device:
        def __init__(self, device):
            self.idx = idx(device) if device is not None and device != -1 else -1
            self.prev = None

        def __enter__(self):
            self.prev = S.current_device
            if self.idx != -1:
                S.device(self.idx)
                S.current_device = self.idx

        def __exit__(self, *exc):
            S.current_device = self.prev
            return False

    def set_device(device):
        i = idx(device)
        if i is not None and i >= 0:
            S.device(i)  # an ordinal past the machine fails as on CUDA
            S.current_device = i

    def mem_get_info(device=None):
        d = S.device(idx(device))
        return (d.device_free(), d.total)

    def memory_allocated(device=None):
        return S.device(idx(device)).allocator.allocated

    def max_memory_allocated(device=None):
        return S.device(idx(device)).allocator.peak_allocated

    def memory_reserved(device=None):
        return S.device(idx(device)).allocator.reserved

    def max_memory_reserved(device=None):
        return S.device(idx(device)).allocator.peak_reserved

    def reset_peak_memory_stats(device=None):
        S.device(idx(device)).reset_peaks()

    def memory_stats(device=None):
        return S.device(idx(device)).stats()

    def memory_stats_as_nested_dict(device=None):
        out = {}
        for k, v in memory_stats(device).items():
            cur = out
            parts = k.split(".")
            for p in parts[:-1]:
                cur = cur.setdefault(p, {})
            cur[parts[-1]] = v
        return out

    def memory_summary(device=None, abbreviated=False):
        d = S.device(idx(device))
        a = d.allocator
        from .engine import _fmt
        rows = [("Allocated memory", a.allocated, a.peak_allocated), ("Active memory", a.allocated, a.peak_allocated),
                ("Requested memory", d.requested, d.peak_requested), ("GPU reserved memory", a.reserved, a.peak_reserved),
                ("Non-releasable memory", a.reserved - a.allocated, a.peak_reserved)]
        line = "|" + "=" * 75 + "|"
        out = [line, f"|{'PyTorch CUDA memory summary, device ID ' + str(d.index) + ' (simulated ' + S.card.name + ')':^75}|",
               line, f"| {'Metric':<25}| {'Cur Usage':>12} | {'Peak Usage':>12} |", line]
        for name, cur, peak in rows:
            out.append(f"| {name:<25}| {_fmt(cur):>12} | {_fmt(peak):>12} |")
        out += [line, f"| {'Allocations':<25}| {len(d.blocks):>12} | {'':>12} |",
                f"| {'Segments':<25}| {len(a.segments):>12} | {'':>12} |",
                f"| {'OOMs':<25}| {a.ooms:>12} | {'cudaMalloc retries: ' + str(a.retries):>12} |", line]
        return "\n".join(out) + "\n"

    def empty_cache():
        for d in S.devices.values():
            d.empty_cache()

    def set_per_process_memory_fraction(fraction, device=None):
        if not isinstance(fraction, float):
            raise TypeError("Invalid type for fraction argument, must be `float`")
        if fraction < 0 or fraction > 1:
            raise ValueError(f"Invalid fraction value: {fraction}. Allowed range: 0~1")
        d = S.device(idx(device))
        d.allocator.allowed = int(fraction * d.total)

    def get_per_process_memory_fraction(device=None):
        a = S.device(idx(device)).allocator
        return 1.0 if a.allowed is None else a.allowed / S.device(idx(device)).total

    def get_device_properties(device=None):
        return Properties(S.card, idx(device))

    def get_device_name(device=None):
        return S.card.device_name

    def get_device_capability(device=None):
        return tuple(S.card.sm)

    def is_bf16_supported(including_emulation=True):
        return S.card.sm[0] >= 8 or including_emulation

    def synchronize(device=None):
        for d in S.devices.values():
            d.process_events([])

    def rng_state(device=None):
        from torch.utils._python_dispatch import _disable_current_modes
        with _disable_current_modes(), torch._subclasses.fake_tensor.unset_fake_temporarily():
            return torch.zeros(16, dtype=torch.uint8)

    def noop(*a, **k):
        return None

    # torch's memory history ------------------------------------------------------------------------
    def record_memory_history(enabled="all", context="all", stacks="all", max_entries=None, device=None,
                              clear_history=False, compile_context=False, global_record_annotations=False,
                              skip_actions=None, **kw):
        if enabled in (True,):
            enabled = "all"
        if enabled in (False,):
            enabled = None
        targets = [S.device(idx(device))] if device is not None else \
            [S.device(i) for i in range(S.ndevices)]
        for d in targets:
            if enabled is None:
                d.history_enabled = False
                if d.history is not None:
                    d.history_kept = d.history
                d.history = None
                continue
            if d.history is None or clear_history:
                d.history = list(getattr(d, "history_kept", None) or []) if not clear_history else []
            d.history_max = int(max_entries) if max_entries not in (None,) and int(max_entries) < (1 << 62) else 0
            d.history_context = context or "state"
            d.history_stacks = stacks
        S.recording_history = enabled is not None

    def snapshot(device=None, augment_with_fx_traces=False):
        segs, traces = [], []
        for i in range(S.ndevices):
            d = S.devices.get(i)
            if d is None:
                traces.append([])
                continue
            segs += d.segments()
            h = d.history if d.history is not None else (getattr(d, "history_kept", None) or [])
            if d.history_max and len(h) > d.history_max:
                h = h[-d.history_max:]
            traces.append([dict(e) for e in h])
        cfg = S.config
        settings = {"PYTORCH_CUDA_ALLOC_CONF": S.alloc_conf, "max_split_size": -1 if cfg.max_split_size >= (1 << 62)
                    else cfg.max_split_size, "garbage_collection_threshold": cfg.garbage_collection_threshold,
                    "expandable_segments": bool(cfg.expandable_segments), "pinned_num_register_threads": 1,
                    "release_lock_on_malloc": False, "pinned_use_host_register": False,
                    "roundup_power2_divisions": {}}
        return {"segments": segs, "device_traces": traces, "allocator_settings": settings,
                "external_annotations": []}

    def dump_snapshot(filename="dump_snapshot.pickle", augment_with_fx_traces=False):
        s = snapshot()
        with open(filename, "wb") as f:
            pickle.dump(s, f)

    def attach_oom_observer(fn):
        for i in range(S.ndevices):
            S.device(i).oom_observers.append(fn)

    def set_memory_metadata(text):
        S.user_metadata = str(text)

    def get_memory_metadata():
        return S.user_metadata

    api = {
        "is_available": lambda: True, "is_initialized": lambda: True, "_lazy_init": noop, "init": noop,
        "device_count": lambda: S.ndevices, "current_device": lambda: S.current_device, "set_device": set_device,
        "device": device, "device_of": lambda t: device(S.where_of(t) if S.where_of(t) is not None else -1),
        "get_device_name": get_device_name, "get_device_properties": get_device_properties,
        "get_device_capability": get_device_capability, "is_bf16_supported": is_bf16_supported,
        "synchronize": synchronize, "current_stream": current_stream, "default_stream": default_stream,
        "set_stream": set_stream, "stream": stream, "Stream": Stream, "ExternalStream": ExternalStream,
        "Event": Event, "StreamContext": StreamContext, "mem_get_info": mem_get_info,
        "memory_allocated": memory_allocated, "max_memory_allocated": max_memory_allocated,
        "memory_reserved": memory_reserved, "max_memory_reserved": max_memory_reserved,
        "memory_cached": memory_reserved, "max_memory_cached": max_memory_reserved,
        "reset_peak_memory_stats": reset_peak_memory_stats, "reset_max_memory_allocated": reset_peak_memory_stats,
        "reset_max_memory_cached": reset_peak_memory_stats, "reset_accumulated_memory_stats": noop,
        "memory_stats": memory_stats, "memory_stats_as_nested_dict": memory_stats_as_nested_dict,
        "memory_summary": memory_summary, "memory_snapshot": lambda *a, **k: snapshot()["segments"],
        "empty_cache": empty_cache, "set_per_process_memory_fraction": set_per_process_memory_fraction,
        "get_per_process_memory_fraction": get_per_process_memory_fraction,
        "manual_seed": noop, "manual_seed_all": noop, "seed": noop, "seed_all": noop, "initial_seed": lambda: 0,
        "get_rng_state": rng_state, "set_rng_state": noop,
        "get_rng_state_all": lambda: [rng_state() for _ in range(S.ndevices)], "set_rng_state_all": noop,
        "ipc_collect": noop, "get_arch_list": lambda: [f"sm_{S.card.sm[0]}{S.card.sm[1]}"],
        "is_current_stream_capturing": lambda: False,
        "_record_memory_history": record_memory_history, "_snapshot": snapshot, "_dump_snapshot": dump_snapshot,
        "_set_memory_metadata": set_memory_metadata, "_get_memory_metadata": get_memory_metadata,
        "_attach_out_of_memory_observer": attach_oom_observer, "_get_device_index": lambda d=None, optional=False,
        allow_cpu=False: idx(d), "utilization": lambda device=None: 0, "temperature": lambda device=None: 40,
        "power_draw": lambda device=None: 0, "clock_rate": lambda device=None: 0,
    }
    return api


@contextlib.contextmanager
def installed(session, autocast=None):
    """torch.cuda (and its submodules), torch.backends.cuda / cudnn and torch.autocast("cuda") answer for the
    simulated card while this is active."""
    import torch
    import torch.amp.autocast_mode as am
    import torch.cuda.memory as cm
    import torch.cuda.random as cr

    api = make_api(session)
    saved = []

    def put(obj, name, value):
        try:
            old = obj.__dict__.get(name, _MISSING)
        except AttributeError:
            old = getattr(obj, name, _MISSING)
        saved.append((obj, name, old))
        setattr(obj, name, value)

    for name, value in api.items():
        put(torch.cuda, name, value)
        if name in cm.__dict__:
            put(cm, name, value)
        if name in cr.__dict__:
            put(cr, name, value)
    nvtx = type("nvtx", (), {"range_push": staticmethod(lambda *a, **k: 0), "range_pop": staticmethod(lambda: 0),
                             "mark": staticmethod(lambda *a, **k: None),
                             "range": staticmethod(lambda *a, **k: contextlib.nullcontext())})
    put(torch.cuda, "nvtx", nvtx)
    put(torch._C, "_cuda_setMemoryMetadata", api["_set_memory_metadata"])
    put(torch._C, "_cuda_attach_out_of_memory_observer", api["_attach_out_of_memory_observer"])
    put(cm, "_attach_out_of_memory_observer", api["_attach_out_of_memory_observer"])
    put(torch._C, "_cuda_getMemoryMetadata", api["_get_memory_metadata"])
    put(torch._C, "_cuda_getDeviceCount", lambda: session.ndevices)
    put(torch._C, "_cuda_getCurrentRawStream", lambda device=None: session.stream_of(session.current_device))
    for name in ("_get_accelerator", "_accelerator_getAccelerator"):
        if hasattr(torch._C, name):
            put(torch._C, name, lambda *a, **k: torch.device("cuda"))
    put(torch.backends.cuda, "is_built", lambda: True)
    put(torch.backends.cudnn, "is_available", lambda: True)
    put(torch.backends.cudnn, "version", lambda: 91002)
    try:
        import torch.cuda.amp.common as amp_common
        put(amp_common, "amp_definitely_not_available", lambda: False)
    except Exception:
        pass

    # torch.accelerator (what FSDP2's default mesh, and device-generic code, ask): the simulated card
    try:
        import torch.accelerator as acc
        import torch.accelerator.memory as accm
        accel = {"is_available": lambda *a, **k: True,
                 "current_accelerator": lambda *a, **k: torch.device("cuda", session.current_device),
                 "device_count": api["device_count"], "current_device_index": api["current_device"],
                 "current_device_idx": api["current_device"], "set_device_index": api["set_device"],
                 "set_device_idx": api["set_device"], "synchronize": api["synchronize"],
                 "current_stream": api["current_stream"], "set_stream": api["set_stream"],
                 "get_device_capability": lambda d=None: {"major": session.card.sm[0], "minor": session.card.sm[1]},
                 "device_index": api["device"]}
        for name, fn in accel.items():
            if hasattr(acc, name):
                put(acc, name, fn)
        for name in ("memory_allocated", "max_memory_allocated", "memory_reserved", "max_memory_reserved",
                     "reset_peak_memory_stats", "memory_stats", "empty_cache"):
            for mod in (acc, accm):
                if hasattr(mod, name):
                    put(mod, name, api[name])
        if hasattr(accm, "get_memory_info"):
            put(accm, "get_memory_info", api["mem_get_info"])
            put(acc, "get_memory_info", api["mem_get_info"])
    except ImportError:
        pass

    # torch.autocast("cuda"): CUDA's state for code that asks, CPU autocast's key where the CUDA policy sits
    enter, exit_ = am.autocast.__enter__, am.autocast.__exit__

    def a_enter(self):
        out = enter(self)
        if self.device == "cuda" and autocast is not None:
            inner = am.autocast("cpu", dtype=self.fast_dtype, enabled=self._enabled, cache_enabled=self._cache_enabled)
            enter(inner)
            self._tracekit_inner = inner
        return out

    def a_exit(self, *exc):
        inner = getattr(self, "_tracekit_inner", None)
        if inner is not None:
            exit_(inner, *exc)
            self._tracekit_inner = None
        return exit_(self, *exc)

    put(am.autocast, "__enter__", a_enter)
    put(am.autocast, "__exit__", a_exit)
    put(torch, "device", device_naming_the_card(torch.device))
    try:
        yield api
    finally:
        for obj, name, value in reversed(saved):
            if value is _MISSING:
                try:
                    delattr(obj, name)
                except AttributeError:
                    pass
            else:
                setattr(obj, name, value)


_MISSING = object()


def device_naming_the_card(real):
    """torch.device as a class whose bare index (`torch.device(0)`, what `device_map={"": 0}` and
    `device_map="auto"` lead to) names the simulated card, as it names the accelerator on a CUDA machine; this
    CPU build would raise "Cannot access accelerator device". Everything else is torch.device itself:
    what it makes, and isinstance / issubclass."""

    class DeviceType(type):
        def __instancecheck__(cls, obj):
            return isinstance(obj, real)

        def __subclasscheck__(cls, sub):
            return isinstance(sub, type) and issubclass(sub, real)

        def __call__(cls, *args, **kwargs):
            if len(args) == 1 and not kwargs and isinstance(args[0], int) and not isinstance(args[0], bool):
                return real("cuda", args[0])
            return real(*args, **kwargs)

    return DeviceType("device", (), {"__module__": "torch", "__doc__": real.__doc__})
