"""The simulated GPU: a CPU-only torch runs as if `torch.cuda` had the named card.

Every tensor is a fake tensor (FakeTensorMode: shapes, dtypes and strides, no data, no memory). A
tensor's storage lives on the simulated device or on the host; which is decided as CUDA decides it:
a factory or `.to()` / `.cuda()` asking for `cuda` makes device storage, an op with a device input
makes device outputs, a factory inside an op on device tensors (a composite's temporaries) makes
device storage, everything else is host memory (not counted). `t.device`, `t.is_cuda` and
`t.get_device()` answer `cuda:N` for device tensors outside the fake-tensor machinery itself.

Each device storage is one request to the model of PyTorch's caching allocator (analysis/allocator,
served online: addresses, blocks, segments, `memory_allocated`, out-of-memory) and one `alloc` entry
in the device's request stream; its release (a weak reference on the storage) is its `free`. Where the
CUDA kernels allocate what CPU kernels do not, the rules of `kernels.py` apply (CUDA autocast's op lists
and weight cache, the SDPA backend the card would pick, cuBLAS workspaces per thread, fused dropout).

Data-dependent values: small tensors carry their real values beside them ("shadows", computed on the
CPU from other shadows), so control flow on token ids, masks, counters and routing is exact. A value
nobody can know (the loss, a prediction) reads as a placeholder: False, 0 or 0.0; `isfinite` is true
and `isnan` / `isinf` false; generation runs to `max_new_tokens`; data-dependent sizes with unknown
values take their upper bound; MoE routing is even (or `worst`: every token to the first experts).
Every placeholder used is counted and said once at the end (`Session.assumptions`).

Never on a fake `cuda` device: with the CPU build of torch that aborts the process at the first
autograd node (no CUDA device guard); the fake tensors' own device stays `cpu`.
"""
from __future__ import annotations

import contextlib
import os
import sys
import time
import weakref
from types import FrameType

from ..errors import TracekitError

ALIGN = 512
TOP_DOWN_START = 0x7FF500000000  # the first segment's end (an H100's first cudaMalloc lands near 0x7ff49...)
MAX_SHADOW = 1 << 20  # elements: tensors up to this size carry real values when their inputs do
MAX_VALUE_FREE = 1 << 16  # elements: ones_like / zeros_like / isfinite outputs given values without inputs' values
HOST = -1  # a storage on the host (not counted)


class SimulationError(TracekitError):
    """The simulation cannot go on (said in one line)."""


class WorkloadError(SimulationError):
    """The workload would fail on the GPU too (an index past a table...): no estimate stands in for it."""


# -- frames ------------------------------------------------------------------------------------------------

_SKIP_FILES = ("torch/utils/_python_dispatch.py", "torch/_subclasses/", "torch/_ops.py", "torch/utils/_stats.py",
               "torch/_compile.py", "torch/_dynamo/", "torch/overrides.py", "torch/utils/_pytree.py",
               "torch/_prims_common/", "torch/_decomp/", "torch/_refs/", "torch/_meta_registrations.py",
               "torch/fx/", "torch/_library/", "tracekit/simulate/engine.py", "tracekit/simulate/kernels.py",
               "tracekit/simulate/cuda_api.py", "tracekit/simulate/calls.py", "tracekit/simulate/hf_model.py", "tracekit/simulate/runner.py",
               "tracekit/simulate/distributed.py", "tracekit/record/script.py", "<frozen runpy>")


_SKIPPED: dict[str, bool] = {}


def _skip(filename: str) -> bool:
    got = _SKIPPED.get(filename)
    if got is None:
        f = filename.replace("\\", "/")
        got = _SKIPPED[filename] = any(s in f for s in _SKIP_FILES)
    return got


class StackFrames:
    """Frame dicts, interned (the same line is one dict), and the stacks torch's history would record."""

    def __init__(self):
        self._frames = {}
        self.op_stack = []  # names of the ops being run (innermost last)
        self.native_stack = []  # C++ frames of a library's own code being modelled (innermost last)
        self.cast = 0  # > 0 while autocast casts
        self.weight_cast = 0  # > 0 while autocast makes its cached copy of a weight

    def frame(self, filename, line, name):
        key = (filename, line, name)
        f = self._frames.get(key)
        if f is None:
            f = self._frames[key] = {"filename": filename, "line": line, "name": name}
        return f

    def python(self) -> list:
        """The Python stack, innermost first, less the simulator's own frames. On the autograd engine's thread
        (backward) a CUDA run has no Python frames but those of Python code run by backward itself."""
        import torch
        out = []
        f: FrameType | None = sys._getframe(2)
        backward = torch._C._current_autograd_node() is not None
        while f is not None:
            co = f.f_code
            if backward and co.co_name in ("_engine_run_backward", "backward", "grad") and \
                    co.co_filename.replace("\\", "/").endswith(("torch/autograd/graph.py", "torch/autograd/__init__.py")):
                break
            if not _skip(co.co_filename):
                out.append(self.frame(co.co_filename, f.f_lineno, co.co_name))
            f = f.f_back
            if len(out) >= 64:
                break
        return out

    def cpp(self, op: str | None) -> list:
        import torch
        out = []
        if self.cast:
            out.append(self.frame("autocast_mode.cpp", 0, "at::autocast::cached_cast(c10::ScalarType, at::Tensor const&, c10::DeviceType)"))
        names = list(self.op_stack)
        if op and (not names or names[-1] != op):
            names.append(op)
        for n in reversed(names):
            out.append(self.frame("", 0, f"at::_ops::{n}::call"))
        out.extend(reversed(self.native_stack))  # the library's C++ that runs the ops (c10d's Reducer...)
        node = torch._C._current_autograd_node()
        if node is not None:
            name = node.name()
            if name.startswith("torch::autograd::"):
                name = name.rsplit("::", 1)[-1]
            out.append(self.frame("", 0, f"torch::autograd::generated::{name}::apply(std::vector<at::Tensor>&&)"))
            out.append(self.frame("engine.cpp", 0, "torch::autograd::Engine::evaluate_function"))
        return out

    def stack(self, op=None) -> list:
        return self.cpp(op) + self.python()

    @contextlib.contextmanager
    def native(self, filename, name):
        """Allocations made inside a library's C++ function (c10d's Reducer, gloo's work): its frame in their stacks."""
        self.native_stack.append(self.frame(filename, 0, name))
        try:
            yield
        finally:
            self.native_stack.pop()

    def on_cast(self, active, weight):
        self.cast += 1 if active else -1
        self.weight_cast += 1 if (active and weight) else (-1 if weight else 0)

    @contextlib.contextmanager
    def op(self, name):
        self.op_stack.append(name)
        try:
            yield
        finally:
            self.op_stack.pop()


# -- one simulated device ----------------------------------------------------------------------------------

class SimDevice:
    """One simulated CUDA device: the caching allocator (the model, served online), every entry of its request
    stream since the start (for `-o`), and torch's own memory history while the script records it."""

    def __init__(self, index, card, config, clock, metadata):
        from ..analysis.allocator.core import Allocator, Device
        self.index = index
        self.card = card
        self.clock = clock
        self.metadata = metadata  # callable: the user_metadata string now
        self.alog = []
        from . import ledger
        # what the process holds outside the allocator (ledger.py, measured): none for `--gpu none` and the
        # estimate's own runs (cards with no context share)
        self.measured = bool(card.context_bytes)
        self.total = ledger.total_memory(card) if self.measured else card.memory
        self.stages = set()  # "kernels", "cublas", "cublaslt", "<sdpa backend>" once they have happened
        self.sdpa_used = dict  # -> the SDPA backends run so far (the session's composites)
        self.outside_read = False  # the ledger was read (mem_get_info, an OOM): said at the end
        usable = max(0, self.total - self.outside())
        self._low = TOP_DOWN_START
        self.allocator = Allocator(config, Device(capacity=usable, total_memory=self.total, addresses=self._top_down),
                                   log=self.alog)
        self.config = config
        self.entries = []  # every entry since the start
        self.history = None  # torch's history (a list) while recording
        self.history_max = 0
        self.history_context = "all"
        self.history_stacks = "all"
        self.blocks = {}  # sid -> Block
        self.frames_of = {}  # block addr -> frames of its alloc
        self.pending = []  # blocks freed while used on other streams (free_completed at the next malloc)
        self.stream_uses = {}  # sid -> set of streams (record_stream)
        self.requested = 0
        self.peak_requested = 0
        self.num_allocs = 0
        self.num_frees = 0
        self.oom_observers = []
        self.fraction = None

    def outside(self) -> int:
        """Bytes the CUDA context and the libraries hold now (ledger.py)."""
        from . import ledger
        if not self.measured:
            return 0
        return ledger.outside(self.stages | set(self.sdpa_used()))

    def stage(self, name):
        """Something that loads memory outside the allocator happened (the first kernel, the first cuBLAS call...)."""
        if name not in self.stages:
            self.stages.add(name)
            self.allocator.device.capacity = max(0, self.total - self.outside())

    def _top_down(self, size, stream, small, expandable):
        """A new segment's address as cudaMalloc gives it (measured on an H100, driver 580): below the last one, so the
        caching allocator's ties between free blocks of one size (the lower address wins) fall on the newest
        segment, as on the GPU. Expandable segments keep the model's own addresses."""
        if expandable:
            return None
        self._low -= -(-int(size) // (2 << 20)) * (2 << 20)
        return self._low

    # trace entries ---------------------------------------------------------------------------
    def _emit(self, action, addr, size, stream, frames):
        marks, own = self.metadata()
        e = {"action": action, "addr": addr, "size": int(size), "stream": stream, "time_us": self.clock(),
             "frames": frames, "user_metadata": marks or own}
        self.entries.append(e)
        if self.history is not None:
            if marks and marks != own:  # torch's history holds the script's own metadata, never our marks
                e = dict(e, user_metadata=own)
            if self.history_context == "state" or (self.history_context == "alloc" and action != "alloc"
                                                   and not action.startswith("segment")):
                e = dict(e, frames=[])
            elif self.history_stacks == "python":
                e = dict(e, frames=[f for f in frames if f["filename"].endswith(".py") or f["filename"].startswith("<")])
            self.history.append(e)
            if self.history_max and len(self.history) > self.history_max * 2:
                del self.history[:len(self.history) - self.history_max]
        return e

    def _drain_allocator_log(self, frames):
        for action, addr, size, stream in self.alog:
            if action in ("segment_alloc", "segment_free", "segment_map", "segment_unmap"):
                self._emit(action, addr, size, stream, frames)
        self.alog.clear()

    # requests --------------------------------------------------------------------------------
    def malloc(self, sid, size, stream, frames):
        from ..analysis.allocator.core import OutOfMemory
        self.process_events(frames)
        a = self.allocator
        self.last_malloc = (sid, len(self.entries), len(self.history) if self.history is not None else 0,
                            a.peak_allocated, a.peak_reserved, self.peak_requested)
        try:
            block = a.malloc(int(size), stream)
        except OutOfMemory:
            block = None
        if block is None:  # raised outside the handler: the script sees torch's error alone, as on the GPU
            self._drain_allocator_log(frames)
            self._oom(size, stream, frames)
        self._drain_allocator_log(frames)
        self.blocks[sid] = block
        if self.history is not None:  # torch keeps a block's context only while its history records
            self.frames_of[block.addr] = frames
        self.requested += int(size)
        self.peak_requested = max(self.peak_requested, self.requested)
        self.num_allocs += 1
        self._emit("alloc", block.addr, size, stream, frames)
        return block

    def undo_last_malloc(self, sid):
        """Take back the last request as if it had never been made (CUDA added in place where fake tensors copied)."""
        last_sid, n_entries, n_history, peak_a, peak_r, peak_q = self.last_malloc
        assert last_sid == sid
        a = self.allocator
        block = self.blocks.pop(sid)
        self.frames_of.pop(block.addr, None)
        self.requested -= block.requested
        self.num_allocs -= 1
        made_segment = any(e["action"] in ("segment_alloc", "segment_map") for e in self.entries[n_entries:])
        a.free(block)
        if made_segment and block.prev is None and block.next is None and block.es is None and block.free:
            a.release_block(block)
        self.alog.clear()
        a.peak_allocated, a.peak_reserved, self.peak_requested = peak_a, peak_r, peak_q
        del self.entries[n_entries:]
        if self.history is not None:
            del self.history[n_history:]

    def free(self, sid, frames):
        block = self.blocks.pop(sid, None)
        if block is None:
            return
        addr, req, stream = block.addr, block.requested, block.stream  # caching merges the block: its address moves
        self.requested -= req
        self.num_frees += 1
        uses = self.stream_uses.pop(sid, None)
        other = bool(uses and (uses - {stream}))
        self.allocator.free(block, completed=not other)
        self._emit("free_requested", addr, req, stream, frames)
        self.frames_of.pop(addr, None)
        if other:
            self.pending.append((block, addr, req, stream))
        else:
            self._emit("free_completed", addr, req, stream, frames)

    def process_events(self, frames):
        """The other streams' work is done by the next request (a GPU that keeps up): pending frees complete."""
        if not self.pending:
            return
        for b, addr, req, stream in self.pending:
            self.allocator.complete_free(b)
            self._emit("free_completed", addr, req, stream, frames)
        self.pending.clear()

    def empty_cache(self):
        self.process_events([])
        self.allocator.release_cached()
        self._drain_allocator_log([])

    def _oom(self, size, stream, frames):
        import torch
        a = self.allocator
        rounded = a.config.round_size(int(size))
        free = self.device_free()
        self._emit("oom", 0, rounded, stream, frames)["device_free"] = free
        if self.history:
            self.history[-1]["device_free"] = free
        for fn in list(self.oom_observers):
            try:
                fn(self.index, rounded, self.total - free, free)
            except Exception:
                pass
        total = self.total
        used = total - free
        limit = ""
        if a.allowed is not None:
            limit = (f" this process has a memory allowance of {_fmt(a.allowed)}.")
        msg = (f"CUDA out of memory. Tried to allocate {_fmt(rounded)}. GPU {self.index} has a total capacity of "
               f"{_fmt(total)} of which {_fmt(free)} is free. Including non-PyTorch memory, this process has "
               f"{_fmt(used)} memory in use.{limit} Of the allocated memory {_fmt(a.allocated)} is allocated by PyTorch, "
               f"and {_fmt(a.reserved - a.allocated)} is reserved by PyTorch but unallocated. If reserved but "
               "unallocated memory is large try setting PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True to avoid "
               "fragmentation.  See documentation for Memory Management  "
               "(https://pytorch.org/docs/stable/notes/cuda.html#environment-variables)")
        raise torch.OutOfMemoryError(msg)

    def device_free(self) -> int:
        """cudaMemGetInfo's free: the total less the ledger (ledger.py) and what the allocator reserved."""
        self.outside_read = True
        self.allocator.device.capacity = max(0, self.total - self.outside())
        return max(0, self.total - self.outside() - self.allocator.reserved)

    # torch.cuda's figures ----------------------------------------------------------------------
    def reset_peaks(self):
        a = self.allocator
        a.peak_allocated = a.allocated
        a.peak_reserved = a.reserved
        self.peak_requested = self.requested

    def stats(self) -> dict:
        a = self.allocator
        nseg = len(a.segments) + sum(1 for _ in a.expandable)
        out = {}
        for pool in ("all", "large_pool", "small_pool"):
            for key, cur, peak in (("allocated_bytes", a.allocated, a.peak_allocated),
                                   ("reserved_bytes", a.reserved, a.peak_reserved),
                                   ("active_bytes", a.allocated, a.peak_allocated),
                                   ("requested_bytes", self.requested, self.peak_requested)):
                if pool != "all":
                    cur = peak = 0 if pool == "small_pool" else None
                    if cur is None:
                        continue
                out[f"{key}.{pool}.current"] = cur
                out[f"{key}.{pool}.peak"] = peak
                out[f"{key}.{pool}.allocated"] = cur
                out[f"{key}.{pool}.freed"] = 0
        out.update({"allocation.all.current": len(self.blocks), "allocation.all.allocated": self.num_allocs,
                    "allocation.all.freed": self.num_frees, "segment.all.current": nseg,
                    "num_alloc_retries": a.retries, "num_ooms": a.ooms, "num_sync_all_streams": 0,
                    "num_device_alloc": 0, "num_device_free": 0, "max_split_size": -1})
        return dict(sorted(out.items()))

    def segments(self) -> list:
        """The final segments as torch's snapshot writes them."""
        out = []
        for seg in self.allocator.snapshot():
            blocks = []
            allocated = active = requested = 0
            for b in seg["blocks"]:
                fr = self.frames_of.get(b["address"], []) if b["state"] != "inactive" else []
                blocks.append(dict(b, frames=fr))
                if b["state"] == "active_allocated":
                    allocated += b["size"]
                if b["state"] != "inactive":
                    active += b["size"]
                    requested += b["requested_size"]
            first = seg["blocks"][0]["address"] if seg["blocks"] else seg["address"]
            out.append({"device": self.index, "address": seg["address"], "total_size": seg["total_size"],
                        "allocated_size": allocated, "active_size": active, "requested_size": requested,
                        "stream": seg["stream"], "segment_type": seg["segment_type"], "segment_pool_id": (0, 0),
                        "is_expandable": seg["is_expandable"], "frames": self.frames_of.get(first, []),
                        "blocks": blocks})
        return out


def _fmt(n: int) -> str:
    """c10's format_size."""
    n = int(n)
    if n <= 1024:
        return f"{n} bytes"
    if n <= 1048576:
        return f"{n / 1024:.2f} KiB"
    if n <= 1073741824:
        return f"{n / 1048576:.2f} MiB"
    return f"{n / 1073741824:.2f} GiB"


# -- the session -----------------------------------------------------------------------------------------------

class Session:
    """Everything one simulated run holds: the card, its devices, the fake-tensor mode, the dispatch tracker, the
    device mode, streams, the marks for `-o`, and the assumptions made."""

    def __init__(self, card, *, alloc_conf=None, routing="even", devices=1, rank=0, world_size=1):
        from ..analysis.allocator.config import DEFAULT, parse_alloc_conf as parse
        self.card = card
        self.config = parse(alloc_conf) if alloc_conf else DEFAULT
        self.alloc_conf = alloc_conf or ""
        self.routing = routing
        self.rank, self.world_size = rank, world_size
        self.backends = {}  # device type -> the process group's backend for it (distributed.py)
        self.ndevices = max(1, devices)
        self.frames = StackFrames()
        self.t0 = int(time.time() * 1e6)
        self._clock = 0
        self.metadata = ""  # our marks (tracekit:iter=N:phase=P), for -o
        self.user_metadata = ""  # the script's own (torch.cuda.memory._set_memory_metadata)
        self.devices = {}
        self.current_device = 0
        self.current_stream = {}  # device -> stream id
        self.depth = 0  # > 0 inside the fake-tensor machinery: tensors say their real (cpu) device there
        self.target = None  # where the storages made now go (device index, HOST) when a call says so
        self.ambient = None  # the device of the running call's tensors (a composite's factories go there)
        self.dev_of = {}  # id(storage) -> device index
        self.sids = {}  # id(storage) -> sid
        self.sid_seq = 0
        self.info = {}  # sid -> dict (size, device, entry index, phase, ...)
        self.assumptions = {}
        self.tags = []  # (kind, sid, name)
        self.marks = None
        self.compiled = 0
        self.fake_mode = None
        self.untracked = 0  # > 0 while ops make metadata only (DTensor's sharding propagation on global shapes)
        self.resized = {}  # id(storage) -> device, for storages freed by resize_(0)
        self.finalized = set()  # id(storage) with a finalizer
        self.cpu_run = False  # --gpu none: host storages are what is simulated (device 0 stands for the host)

    # clock and devices ----------------------------------------------------------------------------
    def now(self) -> int:
        self._clock += 1
        return self.t0 + self._clock

    def device(self, index) -> SimDevice:
        d = self.devices.get(index)
        if d is None:
            if not (0 <= index < self.ndevices):
                raise RuntimeError(f"CUDA error: invalid device ordinal (the simulated machine has "
                                   f"{self.ndevices} device{'s' if self.ndevices != 1 else ''})")
            d = self.devices[index] = SimDevice(index, self.card, self.config, self.now,
                                                lambda: (self.metadata, self.user_metadata))
            d.sdpa_used = lambda: getattr(getattr(self, "composites", None), "used", None) or {}
            if self.fraction is not None:
                d.allocator.allowed = int(self.fraction * d.total)
        return d

    fraction = None

    def stream_of(self, index) -> int:
        return self.current_stream.get(index, 0)

    def assume(self, what: str, where: str = ""):
        key = (what, where)
        self.assumptions[key] = self.assumptions.get(key, 0) + 1

    def cuda_index(self, d):
        """The device index a device argument names when it is a CUDA device, else None."""
        import torch
        if d is None:
            return None
        if isinstance(d, int) and not isinstance(d, bool):
            return d
        if isinstance(d, str):
            if not d.startswith("cuda"):
                return None
            d = torch.device(d)
        if isinstance(d, torch.device):
            if d.type != "cuda":
                return None
            return self.current_device if d.index is None else d.index
        return None

    def where_of(self, t):
        """Device index of a tensor's storage, or None (host)."""
        try:
            return self.dev_of.get(id(t.untyped_storage()))
        except Exception:
            return None

    @contextlib.contextmanager
    def call(self, target, ambient, inside=True):
        """A torch call runs: where its storages go; inside it (torch's own Python, kernels, backward's hooks)
        tensors say their real device, so torch's internals never meet a `cuda` they cannot run (`inside`)."""
        old = (self.target, self.ambient)
        self.target, self.ambient = target, ambient
        self.depth += inside
        try:
            yield
        finally:
            self.depth -= inside
            self.target, self.ambient = old

    # storages -------------------------------------------------------------------------------------
    def register(self, t, op, device):
        try:
            st = t.untyped_storage()
        except Exception:
            return None
        return self.register_storage(st, op, device, dtype=str(t.dtype).replace("torch.", ""), shape=tuple(t.shape))

    def register_storage(self, st, op, device, dtype="", shape=()):
        key = id(st)
        sid = self.sids.get(key)
        nbytes = st.nbytes()
        if sid is not None:
            info = self.info.get(sid)
            if info is not None and info["size"] != nbytes:  # resized in place
                self._release(key, sid)
            else:
                return sid
        if device is None or device == HOST:
            return None
        if nbytes == 0:
            self.resized[key] = device  # a storage freed by resize_(0) keeps its device for resize_(n)
            return None
        self.sid_seq += 1
        sid = self.sid_seq
        import torch
        dev = self.device(device)
        frames = self.frames.stack(op)
        stream = self.stream_of(device)
        dev.malloc(sid, nbytes, stream, frames)
        self.sids[key] = sid
        self.dev_of[key] = device
        node = torch._C._current_autograd_node()
        self.info[sid] = dict(size=int(nbytes), op=op, device=device, entry=len(dev.entries) - 1,
                              metadata=self.metadata, backward=node is not None,
                              node=id(node) if node is not None else None,
                              weight_cast=self.frames.weight_cast > 0, dtype=dtype, shape=shape)
        if key not in self.finalized:
            self.finalized.add(key)
            weakref.finalize(st, self._storage_died, key)
        return sid

    def _storage_died(self, key):
        self.finalized.discard(key)
        self.resized.pop(key, None)
        sid = self.sids.get(key)
        if sid is not None:
            self._release(key, sid)

    def storage_resized(self, st):
        """UntypedStorage.resize_ (FSDP's free_storage / alloc_storage): a free and a new request."""
        key = id(st)
        sid = self.sids.get(key)
        device = self.dev_of.get(key, self.resized.get(key))
        if sid is not None:
            info = self.info.get(sid)
            if info is not None and info["size"] == st.nbytes():
                return
            self._release(key, sid)
        if device is not None:
            self.dev_of[key] = device
            self.register_storage(st, "resize_", device)

    def _release(self, key, sid):
        if self.sids.get(key) == sid:
            del self.sids[key]
            self.dev_of.pop(key, None)
        info = self.info.get(sid)
        if info is None or "free_entry" in info:
            return
        dev = self.devices.get(info["device"])
        if dev is None:
            return
        pending = self.pending_accumulation
        if pending is not None:
            self.pending_accumulation = None
            old, new, index = pending
            if sid == old and len(dev.entries) == index + 1 and new in dev.blocks:
                # InputBuffer::accumulate on CUDA: old_var.add_(var) in place (the buffer held the only reference);
                # fake tensors are a tensor subclass and take old_var + var: undo the copy, the sum lives in old's block
                self._undo_accumulation(dev, old, new)
                return
        try:
            frames = self.frames.python()
        except Exception:
            frames = []
        dev.free(sid, frames)
        info["free_entry"] = len(dev.entries) - 1

    pending_accumulation = None
    accumulated = 0

    def _undo_accumulation(self, dev, old, new):
        dev.undo_last_malloc(new)
        dev.blocks[new] = dev.blocks.pop(old)
        info = self.info.pop(new)
        self.info[new] = dict(self.info[old], node=info.get("node"))
        self.info[old]["merged_into"] = new
        self.accumulated += 1

    def record_stream(self, t, stream_id):
        sid = self.sids.get(id(t.untyped_storage()))
        if sid is not None:
            self.device_streams(sid).add(stream_id)

    def device_streams(self, sid):
        info = self.info[sid]
        return self.devices[info["device"]].stream_uses.setdefault(sid, set())

    # what the run holds at the end -----------------------------------------------------------------------
    def peak_allocated(self, device=0) -> int:
        d = self.devices.get(device)
        return d.allocator.peak_allocated if d else 0

    def summary_assumptions(self) -> list:
        from . import ledger
        out = []
        for d in self.devices.values():
            if d.outside_read and d.measured:
                out.append(ledger.assumption(d.stages | set(d.sdpa_used())) + f" (cuda:{d.index})")
        for (what, where), n in sorted(self.assumptions.items(), key=lambda kv: -kv[1]):
            out.append(f"{what}{(' at ' + where) if where else ''}{f' ({n}x)' if n > 1 else ''}")
        return out


# -- fake tensors that say where they live ------------------------------------------------------------------

@contextlib.contextmanager
def device_aware_fake_tensors(session):
    """FakeTensor.device / is_cuda / get_device / data_ptr answer for the simulated device outside the fake-tensor
    machinery (which keeps seeing `cpu`); torch.optim takes its foreach path for them as for CUDA tensors;
    Module._apply's swap of a fake parameter keeps the parameter object (ties stay tied)."""
    import torch
    import torch.optim.optimizer as optmod
    import torch.utils._foreach_utils as fu
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    S = session
    saved = {name: FakeTensor.__dict__.get(name) for name in ("device", "is_cuda", "is_cpu", "get_device",
                                                                "data_ptr", "__torch_dispatch__", "record_stream")}
    mode_dispatch = FakeTensorMode.__torch_dispatch__
    orig_device = FakeTensor.device
    orig_tensor_dispatch = FakeTensor.__dict__["__torch_dispatch__"]

    def where(self):
        if S.depth or S.cpu_run:
            return None
        try:
            return S.dev_of.get(id(self.untyped_storage()))
        except Exception:
            return None

    def device(self):
        d = where(self)
        if d is not None and not self.fake_mode.in_kernel_invocation:
            return torch.device("cuda", d)
        return orig_device.fget(self)

    def is_cuda(self):
        return where(self) is not None

    def is_cpu(self):
        return where(self) is None and orig_device.fget(self).type == "cpu"

    def get_device(self):
        d = where(self)
        return -1 if d is None else d

    def data_ptr(self):
        sid = S.sids.get(id(self.untyped_storage()))
        info = S.info.get(sid) if sid is not None else None
        if info is not None:
            dev = S.devices.get(info["device"])
            b = dev.blocks.get(sid) if dev else None
            if b is not None:
                return b.addr + self.storage_offset() * self.element_size()
        return 0x10000 + (id(self.untyped_storage()) & 0xFFFFFFFF) * 16

    def mode_dispatch_wrapped(self, func, types, args=(), kwargs=None):
        S.depth += 1
        try:
            return mode_dispatch(self, func, types, args, kwargs)
        finally:
            S.depth -= 1

    inner = orig_tensor_dispatch.__func__

    def tensor_dispatch(cls, func, types, args=(), kwargs=None):
        S.depth += 1
        try:
            return inner(cls, func, types, args, kwargs)
        finally:
            S.depth -= 1

    swap = torch.utils.swap_tensors

    def swap_tensors(t1, t2):
        if isinstance(t1, FakeTensor) and isinstance(t2, FakeTensor):
            with torch.no_grad():
                t1.data = t2.data if isinstance(t2, torch.nn.Parameter) else t2
            return
        return swap(t1, t2)

    storage_resize = torch.UntypedStorage.resize_

    def resize_(self, size):
        out = storage_resize(self, size)
        try:
            S.storage_resized(self)
        except Exception as e:  # an out-of-memory error is the script's to see
            if isinstance(e, torch.OutOfMemoryError):
                raise
        return out

    old_types = (list(optmod._foreach_supported_types), list(fu._foreach_supported_types))
    FakeTensor.device = property(device)
    FakeTensor.is_cuda = property(is_cuda)
    FakeTensor.is_cpu = property(is_cpu)
    FakeTensor.get_device = get_device
    FakeTensor.data_ptr = data_ptr
    FakeTensor.record_stream = lambda self, stream: S.record_stream(self, getattr(stream, "stream_id", 0))
    FakeTensor.__torch_dispatch__ = classmethod(tensor_dispatch)
    FakeTensorMode.__torch_dispatch__ = mode_dispatch_wrapped
    torch.utils.swap_tensors = swap_tensors
    torch.UntypedStorage.resize_ = resize_
    optmod._foreach_supported_types.append(FakeTensor)
    fu._foreach_supported_types.append(FakeTensor)
    try:
        yield
    finally:
        for name, v in saved.items():
            if v is None:
                try:
                    delattr(FakeTensor, name)
                except AttributeError:
                    pass
            else:
                setattr(FakeTensor, name, v)
        FakeTensorMode.__torch_dispatch__ = mode_dispatch
        torch.utils.swap_tensors = swap
        torch.UntypedStorage.resize_ = storage_resize
        optmod._foreach_supported_types[:] = old_types[0]
        fu._foreach_supported_types[:] = old_types[1]


# -- the tracker: every storage's creation and release, shadows, placeholders ------------------------------------

def _tracker_class():
    import torch
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException, FakeTensor
    from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes
    from torch.utils._pytree import tree_flatten, tree_map

    from torch.utils.weak import WeakTensorKeyDictionary

    from . import kernels as ck

    aten = torch.ops.aten
    RANDOM = {aten.bernoulli.default, aten.bernoulli.p, aten.bernoulli_.float, aten.rand.default,
              aten.randn.default, aten.randint.low, aten.randint.default, aten.normal_.default, aten.uniform_.default,
              aten.native_dropout.default, aten.randperm.default, aten.exponential_.default, aten.multinomial.default,
              aten.random_.default, getattr(aten.random_, "from"), aten.random_.to}
    SCALAR = {aten._local_scalar_dense.default, aten.is_nonzero.default, aten.equal.default, aten.item.default}
    LIKE = {aten.zeros_like.default, aten.ones_like.default, aten.full_like.default, aten.new_zeros.default,
            aten.new_ones.default, aten.new_full.default}
    TRUE_IF = {aten.isfinite.default}
    FALSE_IF = {aten.isnan.default, aten.isinf.default, aten.isneginf.default, aten.isposinf.default}
    ADD = aten.add.Tensor
    # backward formulas that write in place into a tensor they just made (gather_backward: new_zeros().scatter_add_)
    # but take the out-of-place op for tensor subclasses (FunctionsManual.cpp areAnyTensorSubclassLike): fake tensors
    INPLACE_IN_CUDA = {aten.scatter_add.default, aten.index_add.default, aten.index_put.default,
                       aten.scatter.src, aten.scatter.value, aten.masked_scatter.default, aten.index_fill.int_Scalar}
    LOOKUPS_EMB = aten.embedding.default
    LOOKUPS = {aten.embedding.default, aten.index_select.default}
    TOPK = aten.topk.default
    HISTC = aten.histc.default
    GROUPED_MM = getattr(aten, "_grouped_mm", None) and aten._grouped_mm.default
    # ops that launch no kernel (an empty tensor, a host-to-device copy is a cudaMemcpy): the ledger's first kernel
    NO_KERNEL = {aten.empty.memory_format, aten.empty_strided.default, aten._to_copy.default, aten.copy_.default,
                 aten.empty_like.default, aten.new_empty.default, aten.new_empty_strided.default}
    from torch._prims_common import is_non_overlapping_and_dense_or_false as _dense

    class Tracker(TorchDispatchMode):
        def __init__(self, session):
            super().__init__()
            self.s = session
            self.shadow = WeakTensorKeyDictionary()  # fake tensor -> real tensor (small ones only)
            self.workspaces = {}  # (kind, device, thread, stream) -> sid
            self.prehook_node = None
            self.node_inputs = set()
            self.sm = session.card.sm

        def sid_of(self, t):
            try:
                return self.s.sids.get(id(t.untyped_storage()))
            except Exception:
                return None

        # shadows ---------------------------------------------------------------------------------
        def _real(self, a):
            if isinstance(a, torch.Tensor):
                if not isinstance(a, FakeTensor):
                    return a
                s = self.shadow.get(a)
                if s is None:
                    raise KeyError
                return s
            return a

        def _shadow_run(self, func, args, kwargs, out, flat_in=None):
            flat_out = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
            if any(t.numel() > MAX_SHADOW for t in flat_out):
                return
            if func in RANDOM:
                return
            if flat_in is not None and not func._schema.is_mutable and func not in LIKE and func not in TRUE_IF \
                    and func not in FALSE_IF and func is not TOPK:
                shadow = self.shadow
                for t in flat_in:  # the usual case: an input without a known value, nothing to compute
                    if isinstance(t, FakeTensor) and t not in shadow:
                        return
            try:
                rargs = tree_map(self._real, args)
                rkwargs = tree_map(self._real, kwargs)
            except KeyError:
                if func in LIKE or func in TRUE_IF or func in FALSE_IF:
                    self._args = args
                    self._value_free_shadow(func, out)
                    return
                if func is TOPK:
                    self._routing_shadow(args, out)
                    return
                if func._schema.is_mutable:  # a mutated tensor's shadow is no longer its value
                    for i, a in enumerate(func._schema.arguments):
                        if a.alias_info is not None and a.alias_info.is_write and i < len(args):
                            for t in tree_flatten(args[i])[0]:
                                if isinstance(t, torch.Tensor):
                                    self.shadow.pop(t, None)
                return
            if "device" in rkwargs:
                rkwargs = dict(rkwargs, device="cpu")
            try:
                with _disable_current_modes():
                    rout = func(*rargs, **rkwargs)
            except Exception:
                return
            for f, r in zip(tree_flatten(out)[0], tree_flatten(rout)[0]):
                if isinstance(f, torch.Tensor) and isinstance(r, torch.Tensor):
                    self.shadow[f] = r

        def _value_free_shadow(self, func, out):
            """Outputs whose values do not depend on the inputs' values (ones_like...), or that a planning run
            takes as given (isfinite: true, isnan: false)."""
            if not isinstance(out, torch.Tensor):
                return
            if out.numel() > MAX_VALUE_FREE:  # masks and flags are small; an optimizer's zeros_like state is not
                return
            shape = tuple(out.shape)
            with _disable_current_modes():
                if func in TRUE_IF:
                    r = torch.ones(shape, dtype=torch.bool)
                elif func in FALSE_IF:
                    r = torch.zeros(shape, dtype=torch.bool)
                elif func in (aten.ones_like.default, aten.new_ones.default):
                    r = torch.ones(shape, dtype=out.dtype)
                elif func in (aten.zeros_like.default, aten.new_zeros.default):
                    r = torch.zeros(shape, dtype=out.dtype)
                elif func is aten.full_like.default and len(self._args) > 1 and not isinstance(self._args[1], torch.Tensor):
                    r = torch.full(shape, self._args[1], dtype=out.dtype)
                elif func is aten.new_full.default and len(self._args) > 2 and not isinstance(self._args[2], torch.Tensor):
                    r = torch.full(shape, self._args[2], dtype=out.dtype)
                else:
                    return
            self.shadow[out] = r

        def _routing_shadow(self, args, out):
            """topk over values nobody knows (an MoE router's logits): the indices the routing policy gives."""
            x, k = args[0], args[1]
            dim = args[2] if len(args) > 2 else -1
            if not isinstance(out, (tuple, list)) or len(out) != 2 or out[1].numel() > MAX_SHADOW:
                return
            idx = out[1]
            n = x.size(dim)
            if idx.dim() == 0 or n == 0:
                return
            with _disable_current_modes():
                moved = list(idx.shape)
                d = dim % idx.dim()
                rows = 1
                for i, s in enumerate(moved):
                    if i != d:
                        rows *= s
                if self.s.routing == "worst":
                    base = torch.arange(k).expand(rows, k)
                else:  # even: token t takes experts t*k .. t*k+k-1 (mod n)
                    base = (torch.arange(rows)[:, None] * k + torch.arange(k)[None, :]) % n
                shape = [s for i, s in enumerate(moved) if i != d] + [k]
                r = base.reshape(shape).movedim(-1, d).contiguous().to(idx.dtype)
            self.shadow[idx] = r
            self.s.assume("top-k over values nobody knows (MoE routing, sampling): "
                          + ("every token to the first experts" if self.s.routing == "worst"
                             else "tokens spread evenly over the experts"), self.where())

        # dispatch ----------------------------------------------------------------------------------
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            s = self.s
            if any(t is not FakeTensor and t is not torch.Tensor and not issubclass(t, torch.nn.Parameter)
                   for t in types):
                # a wrapper subclass (DTensor, NF4 tensors...): its own dispatch runs the ops on its inner
                # tensors, which come back here
                return NotImplemented
            if func in SCALAR:
                return self._scalar(func, args, kwargs)
            if func in LOOKUPS:
                self._check_indices(func, args)
            if func is HISTC:
                return self._histc(args, kwargs)
            if s.untracked or s.fake_mode is not None and \
                    torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) not in (None, s.fake_mode):
                # another fake-tensor mode runs this (DTensor's sharding propagation on full-size metadata, a
                # compiler tracing): its tensors are no one's memory, on the GPU either
                return func(*args, **kwargs)
            forced = None
            dev = kwargs.get("device")
            if isinstance(dev, torch.device) and dev.type == "cuda":
                # a `cuda` that reached the op itself (a device remembered earlier, used inside another torch call
                # where the function-level rules do not run): the op runs on the fake tensors' own device
                forced = s.current_device if dev.index is None else dev.index
                kwargs = dict(kwargs, device=torch.device("cpu"))
            flat_in = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
            try:
                out = func(*args, **kwargs)
            except (DynamicOutputShapeException, DataDependentOutputException):
                out = self._dynamic(func, args, kwargs)
            except Exception as e:
                from torch._subclasses.fake_tensor import UnsupportedOperatorException
                text = str(e)
                if isinstance(e, UnsupportedOperatorException) or "no fake impl" in text or \
                        "'Meta' backend" in text or "does not have a meta" in text.lower():
                    raise SimulationError(f"{func} has no fake kernel, so it cannot be simulated (at {self.where()}); "
                                          "a custom op needs register_fake") from None
                if func is not GROUPED_MM or not isinstance(e, RuntimeError):
                    raise
                out = self._grouped_mm(args, kwargs)
            target = s.target if forced is None else forced
            if s.cpu_run:
                target = 0
            elif target is None:
                target = next((d for d in (s.where_of(t) for t in flat_in) if d is not None), None)
                if target is None and not flat_in:
                    target = s.ambient
            name = func.__name__
            if "." in name:
                base, ov = name.split(".", 1)
                name = base if ov == "default" else f"{base}_{ov}"
            if target is not None and target != HOST:
                for t in tree_flatten(out)[0]:
                    if isinstance(t, torch.Tensor):
                        s.register(t, name, target)
                if func is ADD:
                    self._maybe_accumulation(args, kwargs, out)
                elif func in INPLACE_IN_CUDA:
                    self._maybe_subclass_copy(args, out)
                if not s.cpu_run and func not in NO_KERNEL:
                    s.device(target).stage("kernels")
                if func in ck.GEMM_OPS and not s.cpu_run:
                    self._workspace("cublas", target)
                if not s.cpu_run and ck.uses_cublaslt(func, args):
                    self._workspace("cublaslt", target)
                if func in ck.REDUCTIONS and not s.cpu_run:
                    self._reduce_scratch(func, args, kwargs, target, name)
            self._shadow_run(func, args, kwargs, out, flat_in)
            return out

        def _grouped_mm(self, args, kwargs):
            """torch._grouped_mm's meta kernel asks for bf16 where CUDA's kernel (sm80+) takes fp32 too: the shape."""
            a, b = args[0], args[1]
            offs = args[2] if len(args) > 2 else kwargs.get("offs")
            dtype = kwargs.get("out_dtype") or a.dtype
            if a.dim() == 2 and b.dim() == 3:
                shape = (a.size(0), b.size(-1))
            elif a.dim() == 3 and b.dim() == 3:
                shape = (a.size(0), a.size(1), b.size(-1))
            elif a.dim() == 2 and b.dim() == 2:
                shape = (offs.size(0), a.size(0), b.size(-1))
            else:
                shape = (a.size(0) * a.size(1) if a.dim() == 3 else a.size(0), b.size(-1))
            return torch.empty(shape, dtype=dtype)

        def _histc(self, args, kwargs):
            """histc: CUDA takes integer inputs (MoE routers count tokens per expert with it), CPU does not."""
            x = args[0]
            bins = args[1] if len(args) > 1 else kwargs.get("bins", 100)
            out = torch.empty((bins,), dtype=x.dtype)
            d = self.s.where_of(x)
            if d is not None:
                self.s.register(out, "histc", d)
            real = self.shadow.get(x)
            if real is not None:
                rest = [a for a in args[2:]]
                with _disable_current_modes():
                    self.shadow[out] = torch.histc(real.double(), bins, *rest, **{k: v for k, v in kwargs.items()
                                                                                  if k != "bins"}).to(x.dtype)
            return out

        def _scalar(self, func, args, kwargs):
            try:
                rargs = tree_map(self._real, args)
            except KeyError:
                t = args[0]
                if func is aten.equal.default or t.dtype == torch.bool:
                    v = False
                elif t.is_floating_point() or t.is_complex():
                    v = 0.0
                else:
                    v = 0
                self.s.assume(f"a value nobody knows read as {v!r} ({_what(func)})", self.where())
                return v
            with _disable_current_modes():
                return func(*rargs, **kwargs)

        def _dynamic(self, func, args, kwargs):
            """An op whose output size depends on values: from the real values where we have them, else its
            upper bound (every element selected)."""
            try:
                rargs = tree_map(self._real, args)
                rkwargs = tree_map(self._real, kwargs)
                with _disable_current_modes():
                    real = func(*rargs, **rkwargs)
            except KeyError:
                real = None
            x = args[0]
            if real is None and getattr(func, "namespace", "aten") != "aten":
                return self._custom_dynamic(func, args, kwargs)
            if real is None:
                self.s.assume(f"a data-dependent size taken at its upper bound ({_what(func)})", self.where())
                n = x.numel()
                if func in (aten.nonzero.default, aten.argwhere.default):
                    shapes = [((n, x.dim()), torch.int64)]
                elif func is aten.nonzero_static.default:
                    shapes = [((kwargs.get("size", args[1] if len(args) > 1 else n), x.dim()), torch.int64)]
                elif func in (aten._unique2.default,):
                    shapes = [((n,), x.dtype), ((tuple(x.shape)), torch.int64), ((n,), torch.int64)]
                elif func is aten.unique_consecutive.default:
                    shapes = [((n,), x.dtype), ((tuple(x.shape)), torch.int64), ((n,), torch.int64)]
                else:
                    shapes = [((n,), x.dtype if func is not aten.bincount.default else torch.int64)]
                outs = [torch.empty(sh, dtype=dt) for sh, dt in shapes]
                return outs[0] if len(outs) == 1 else tuple(outs)
            flat, spec = tree_flatten(real)
            fakes = []
            for r in flat:
                if isinstance(r, torch.Tensor):
                    f = torch.empty_strided(tuple(r.shape), tuple(r.stride()), dtype=r.dtype)
                    fakes.append(f)
                else:
                    fakes.append(r)
            from torch.utils._pytree import tree_unflatten
            out = tree_unflatten(fakes, spec)
            for f, r in zip(fakes, flat):
                if isinstance(f, torch.Tensor) and r.numel() <= MAX_SHADOW:
                    self.shadow[f] = r
            return out

        def _custom_dynamic(self, func, args, kwargs):
            """A custom op whose fake kernel asks for a data-dependent size (`ctx.new_dynamic_size()`, e.g.
            bitsandbytes' int8 outlier columns): its own fake kernel again, the size its `max`, or without one the
            largest dimension of its inputs."""
            from torch._library.fake_impl import FakeImplCtx
            dims = [int(d) for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor) for d in t.shape]
            bound = max(dims, default=0)
            ask = FakeImplCtx.new_dynamic_size

            def new_dynamic_size(ctx, *, min=0, max=None):
                return int(max) if max is not None else bound
            self.s.assume(f"a data-dependent size taken at its upper bound ({_what(func)})", self.where())
            FakeImplCtx.new_dynamic_size = new_dynamic_size
            try:
                return func(*args, **kwargs)
            finally:
                FakeImplCtx.new_dynamic_size = ask

        def _check_indices(self, func, args):
            """An index past the table is a device-side assert on CUDA: check the real indices we have."""
            weight, indices = (args[0], args[1]) if func is LOOKUPS_EMB else (args[0], args[2])
            real = self.shadow.get(indices) if isinstance(indices, torch.Tensor) else None
            if real is None or real.numel() == 0:
                return
            rows = weight.size(0)
            with _disable_current_modes():
                top, low = int(real.max()), int(real.min())
            if top >= rows or low < -rows:
                raise WorkloadError(f"index {top} is out of range for a table of {rows} rows in "
                                    f"{self.where()} (a sequence longer than the model's positions, or a token "
                                    "id past its vocabulary): CUDA stops with a device-side assert there")

        def _maybe_accumulation(self, args, kwargs, out):
            """An `old + new` the autograd engine makes when a gradient slot receives a second gradient
            (InputBuffer::accumulate); if old is released right away CUDA would have added in place."""
            node = torch._C._current_autograd_node()
            if node is None or torch.is_grad_enabled() or kwargs.get("alpha", 1) != 1 or len(args) != 2:
                return
            old, new = args
            if not (isinstance(old, torch.Tensor) and isinstance(new, torch.Tensor)):
                return
            if old.shape != new.shape or old.dtype != new.dtype or old.shape != out.shape or not _dense(old):
                return
            if self.prehook_node is not node:
                return
            st = old.untyped_storage()
            if torch._C._storage_Use_Count(st._cdata) != 2:
                return
            so, sn, sout = self.sid_of(old), self.sid_of(new), self.sid_of(out)
            if so is None or sn is None or sout is None or so in self.node_inputs:
                return
            io, inn = self.s.info.get(so), self.s.info.get(sn)
            if io is None or inn is None or not io.get("backward") or io.get("node") == id(node) \
                    or not inn.get("backward") or inn.get("node") != id(node) and not new._is_view():
                return
            self.s.pending_accumulation = (so, sout, self.s.info[sout]["entry"])

        def _maybe_subclass_copy(self, args, out):
            """`made.scatter_add(...)` inside a backward node, on a tensor the node just made: CUDA writes in place
            (the formula's own path); if `made` is released right away, undo the copy."""
            node = torch._C._current_autograd_node()
            if node is None or not args or not isinstance(args[0], torch.Tensor) or not isinstance(out, torch.Tensor):
                return
            old = args[0]
            if old.shape != out.shape or old.dtype != out.dtype or not _dense(old):
                return
            if torch._C._storage_Use_Count(old.untyped_storage()._cdata) != 2:
                return
            so, sout = self.sid_of(old), self.sid_of(out)
            io = self.s.info.get(so) if so is not None else None
            if io is None or sout is None or io.get("node") != id(node):
                return
            self.s.pending_accumulation = (so, sout, self.s.info[sout]["entry"])

        def prehook(self, grad_outputs):
            self.prehook_node = torch._C._current_autograd_node()
            self.node_inputs = {self.sid_of(g) for g in grad_outputs if isinstance(g, torch.Tensor)}
            return None

        def watch_graph(self, roots):
            """Pre-hooks on every node reachable from `roots` (the grad_fns backward starts from)."""
            seen, todo = set(), list(roots)
            while todo:
                fn = todo.pop()
                if fn is None or id(fn) in seen:
                    continue
                seen.add(id(fn))
                try:
                    fn.register_prehook(self.prehook)
                except Exception:
                    pass
                todo.extend(f for f, _ in fn.next_functions)

        def _workspace(self, kind, device):
            """cuBLAS / cuBLASLt keep one workspace per (thread's handle, stream): the Python thread runs forward
            and the optimizer, the autograd engine's device thread runs backward."""
            thread = "backward" if torch._C._current_autograd_node() is not None else "forward"
            stream = self.s.stream_of(device)
            key = (kind, device, thread, stream)
            if key in self.workspaces:
                return
            self.s.device(device).stage(kind)
            fr = self.s.frames
            if kind == "cublas":
                size = ck.cublas_workspace_bytes(self.sm)
                frames = [fr.frame("CublasHandlePool.cpp", 0, "at::cuda::getNewWorkspace()"),
                          fr.frame("CublasHandlePool.cpp", 0, "at::cuda::getCurrentCUDABlasHandle()")]
            else:
                size = ck.CUBLASLT_WORKSPACE_BYTES
                frames = [fr.frame("CublasHandlePool.cpp", 0, "at::cuda::getCUDABlasLtWorkspace()")]
            frames = frames + fr.cpp(None) + fr.python()
            s = self.s
            s.sid_seq += 1
            sid = s.sid_seq
            dev = s.device(device)
            dev.malloc(sid, size, stream, frames)
            self.workspaces[key] = sid
            s.info[sid] = dict(size=size, op=f"{kind}_workspace", device=device, entry=len(dev.entries) - 1,
                               metadata=s.metadata, backward=thread == "backward", node=None, weight_cast=False,
                               workspace=thread)

        def _reduce_scratch(self, func, args, kwargs, device, name):
            """gpu_reduce_kernel's staging buffer and semaphores (a reduction split over blocks per output): taken
            after the output, released when the kernel is launched (semaphores first)."""
            try:
                need = ck.reduce_scratch(func, args, kwargs, self.sm, self.s.card.sms)
            except Exception:
                need = None
            if need is None:
                return
            s = self.s
            dev = s.device(device)
            stream = s.stream_of(device)
            frames = s.frames.stack(name)
            sids = []
            for size in need:
                s.sid_seq += 1
                dev.malloc(s.sid_seq, size, stream, frames)
                sids.append(s.sid_seq)
            for sid in reversed(sids):
                dev.free(sid, frames)

        def where(self) -> str:
            for f in self.s.frames.python():
                fn = f["filename"].replace("\\", "/")
                if "/torch/" not in fn and "site-packages" not in fn:
                    return f"{fn.rsplit('/', 1)[-1]}:{f['line']}"
            return "?"

    return Tracker


def _what(func) -> str:
    return {"_local_scalar_dense": ".item() / int() / float()", "item": ".item() / int() / float()",
            "is_nonzero": "bool()", "equal": "torch.equal"}.get(
        func.__name__.split(".")[0], func.__name__.split(".")[0])
