"""Run a script as if it had the GPU: `tracekit simulate [--gpu NAME] -- python train.py ARGS`.

The parent (commands/simulate.py) starts the same interpreter with a bootstrap (as `tracekit record` does,
record/script.py), so the script's output, arguments, exit code and traceback are its own:

    python -c BOOTSTRAP SETTINGS_JSON path|module|code TARGET ARGS...

The bootstrap builds a `Session` (engine.py) for the card and installs, for the whole run: torch.cuda's answers
(cuda_api.py), fake tensors that know their device, the dispatch tracker, the device rules of calls
(calls.py), CUDA's autocast policy and composites (kernels.py), a fake process group under --world-size
(distributed.py), the phases for `-o`, and what cannot run on fake tensors said as a policy (torch.compile
runs eager, checkpoints are not written, DataLoader workers run in the main process, generation runs to
max_new_tokens). At the end it writes `-o` and says, once, the peaks and the assumptions made.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import sys

BOOTSTRAP = "from tracekit.simulate.runner import main; main()"


# -- phases, iterations and tags (for -o), from global hooks --------------------------------------------------

class SimulatedMarks:
    """Iterations and phases as our recorder writes them (user_metadata `tracekit:iter=N:phase=P` and the
    tracekit key): forward from the outermost module call, backward from backward's start, optimizer from
    the optimizer's step hooks; an iteration ends with its optimizer step. Tags: parameters, gradients and
    optimizer state from the optimizers seen, parameters and buffers of the modules run."""

    def __init__(self, session):
        self.s = session
        self.phases, self.iterations = [], []
        self.iteration = None
        self.phase = None
        self.t_phase = self.t_iter = None
        self.depth = 0
        self.handles = []
        self.seen_modules = set()
        self.next_iteration = 0

    # the marks -------------------------------------------------------------------------------------------
    def _md(self):
        if self.iteration is None:
            return ""
        return f"tracekit:iter={self.iteration}" + (f":phase={self.phase}" if self.phase else "")

    def start_iteration(self, i=None):
        self.iteration = self.next_iteration if i is None else i
        self.next_iteration = self.iteration + 1
        self.t_iter = self.s.now()
        self.s.metadata = self._md()

    def start_phase(self, phase):
        if self.iteration is None:
            self.start_iteration()
        self.end_phase()
        self.phase, self.t_phase = phase, self.s.now()
        self.s.metadata = self._md()

    def end_phase(self):
        if self.phase is not None:
            self.phases.append({"iteration": self.iteration, "phase": self.phase, "start_us": self.t_phase,
                                "end_us": self.s.now()})
            self.phase = None
            self.s.metadata = self._md()

    def end_iteration(self):
        if self.iteration is None:
            return
        self.end_phase()
        self.iterations.append({"iteration": self.iteration, "start_us": self.t_iter, "end_us": self.s.now()})
        self.iteration = None
        self.s.metadata = ""

    # hooks -----------------------------------------------------------------------------------------------
    def backward_starts(self):
        if self.iteration is not None or self.phase == "forward":
            self.start_phase("backward")

    def install(self):
        import torch
        from torch.nn.modules import module as mm
        from torch.optim import optimizer as om
        # always_call: a forward that raises still ends (non-reentrant checkpointing's early stop ends its recomputation
        # by raising), so the outermost call is told apart again
        self.handles = [mm.register_module_forward_pre_hook(self._pre),
                        mm.register_module_forward_hook(self._post, always_call=True),
                        om.register_optimizer_step_pre_hook(self._opt_pre),
                        om.register_optimizer_step_post_hook(self._opt_post)]
        self._torch = torch
        return self

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles = []

    def _pre(self, module, args):
        if self.depth == 0 and self._torch._C._current_autograd_node() is None:
            # a training forward starts an iteration; one under no_grad (evaluation, generation) marks nothing
            if self.phase in (None, "optimizer") and self._torch.is_grad_enabled():
                if self.phase == "optimizer":
                    self.end_iteration()
                self.start_phase("forward")
            if id(module) not in self.seen_modules:
                self._tag_module(module)
        self.depth += 1

    def _post(self, module, args, *out):
        self.depth = max(0, self.depth - 1)

    def _tag_module(self, module):
        self.seen_modules.add(id(module))
        for name, p in module.named_parameters(recurse=True):
            self._tag("parameter", p, name)
        for name, b in module.named_buffers(recurse=True):
            self._tag("parameter", b, name)

    def _tag(self, kind, t, name):
        for inner in inner_tensors(t):
            try:
                sid = self.s.sids.get(id(inner.untyped_storage()))
            except Exception:
                sid = None
            if sid is not None:
                self.s.tags.append((kind, sid, name))

    def _opt_pre(self, opt, args, kwargs):
        if self.iteration is None:
            self.start_iteration()
        for g in opt.param_groups:
            for p in g["params"]:
                self._tag("parameter", p, "")
                if p.grad is not None:
                    self._tag("gradient", p.grad, ".grad")
        self.start_phase("optimizer")

    def _opt_post(self, opt, args, kwargs):
        for state in opt.state.values():
            for key, value in state.items():
                if isinstance(value, self._torch.Tensor) and key != "step":
                    self._tag("optimizer_state", value, key)
        self.end_iteration()


def inner_tensors(t) -> list:
    """The plain tensors a tensor holds: itself, or a wrapper subclass's inner tensors (DTensor's local shard)."""
    import torch
    if not isinstance(t, torch.Tensor):
        return []
    flatten = getattr(type(t), "__tensor_flatten__", None)
    if flatten is None:
        return [t]
    try:
        # wrapper subclasses define __tensor_flatten__; torch.Tensor's stub does not
        names, _ = t.__tensor_flatten__()  # type: ignore[attr-defined]
    except Exception:
        return []
    out = []
    for n in names:
        out += inner_tensors(getattr(t, n, None))
    return out


# -- policies for what fake tensors cannot do -------------------------------------------------------------------

class _PostImport:
    """Patch a module as soon as it is imported (transformers' checks that would take fake tensors for tracing)."""

    def __init__(self, patches):
        self.patches = patches  # module name -> fn(module)
        self.done = set()

    def find_spec(self, name, path=None, target=None):
        if name not in self.patches or name in self.done:
            return None
        import importlib.util
        self.done.add(name)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            self.done.discard(name)
        if spec is None or spec.loader is None:
            return None
        loader, fn = spec.loader, self.patches[name]

        class Loader:
            def create_module(self, spec):
                return loader.create_module(spec)

            def exec_module(self, module):
                loader.exec_module(module)
                try:
                    fn(module)
                except Exception:
                    pass
        spec.loader = Loader()
        return spec


def _patch_import_utils(mod):
    mod.is_fake_tensor = lambda *a, **k: False


def _patch_safetensors(session):
    """safetensors' load_file(device="cuda") reads on the host (outside the fake tensors), then moves each tensor as
    the device says: fake tensors of the same shapes on the simulated card (its own CUDA path cannot run here)."""
    def patch(mod):
        load_file = mod.load_file

        def load(filename, device="cpu"):
            import torch
            from torch._subclasses.fake_tensor import unset_fake_temporarily
            from torch.utils._python_dispatch import _disable_current_modes
            with _disable_current_modes(), unset_fake_temporarily():
                out = load_file(filename, device="cpu")
            where = session.cuda_index(device if not isinstance(device, int) else torch.device("cuda", device))
            if where is None:
                return {k: v.clone() for k, v in out.items()}
            return {k: v.to(f"cuda:{where}") for k, v in out.items()}
        mod.load_file = load
    return patch


_SAFETENSORS_DTYPES = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16", "I64": "int64",
                       "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool", "U16": "uint16",
                       "U32": "uint32", "U64": "uint64", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}


def _patch_safe_open(session):
    """safetensors' safe_open (what from_pretrained reads through, tensor by tensor): the file is opened on the host;
    a tensor of up to MAX_SHADOW elements is read as it is (its values kept: position tables, small buffers), a
    bigger one is a fake tensor of its shape and dtype, nothing read (weights' values are unknown anyway); each then
    goes where the file was opened for (`device=0` / "cuda": the simulated card)."""
    def patch(mod):
        real_open = getattr(mod, "safe_open", None)
        if real_open is None or getattr(real_open, "_tracekit", False):
            return
        import math

        import torch
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from torch.utils._python_dispatch import _disable_current_modes

        from .engine import MAX_SHADOW

        def host():
            stack = contextlib.ExitStack()
            stack.enter_context(_disable_current_modes())
            stack.enter_context(unset_fake_temporarily())
            return stack

        class Slice:
            def __init__(self, inner, where):
                self._s, self._where = inner, where

            def __getattr__(self, name):
                return getattr(self._s, name)

            def __getitem__(self, index):
                shape = list(self._s.get_shape())
                dtype = getattr(torch, _SAFETENSORS_DTYPES.get(self._s.get_dtype(), ""), None)
                if dtype is None or math.prod(shape) <= MAX_SHADOW:
                    with host():
                        out = self._s[index]
                else:
                    with host():
                        cut = torch.empty(shape, dtype=dtype, device="meta")[index].shape
                    out = torch.empty(cut, dtype=dtype)  # a fake host tensor: the shape, no values
                    session.assume("weights read from safetensors files are not read (their values are unknown; "
                                   "only tensors up to 1M elements are read)")
                return out if self._where is None else out.to(torch.device("cuda", self._where))

        class SafeOpen:
            _tracekit = True

            def __init__(self, filename, framework="pt", device="cpu", *a, **k):
                where = device if isinstance(device, int) and not isinstance(device, bool) else \
                    session.cuda_index(device) if isinstance(device, (str, torch.device)) else None
                self._where = None if session.cpu_run else where
                with host():
                    self._f = real_open(filename, framework=framework, device="cpu", *a, **k)

            def __enter__(self):
                self._f.__enter__()
                return self

            def __exit__(self, *exc):
                return self._f.__exit__(*exc)

            def __getattr__(self, name):
                return getattr(self._f, name)

            def get_slice(self, name):
                with host():
                    inner = self._f.get_slice(name)
                return Slice(inner, self._where)

            def get_tensor(self, name):
                return self.get_slice(name)[...]

        mod.safe_open = SafeOpen
    return patch


def _patch_dtensor(session):
    """DTensor (FSDP2's parameters) says the device of its local shard outside torch's internals, as a fake tensor does
    (its wrapper's own device is fixed when made, inside the machinery, as `cpu`): torch.optim takes its foreach path."""
    def patch(mod):
        import torch
        cls = getattr(mod, "DTensor", None)
        if cls is None:
            return
        base = torch.Tensor.device

        def device(self):
            if not session.depth and not session.cpu_run:
                d = session.where_of(self._local_tensor)
                if d is not None:
                    return torch.device("cuda", d)
            return base.__get__(self)
        cls.device = property(device)
        cls.is_cuda = property(lambda self: device(self).type == "cuda")
    return patch


def _patch_sharding_prop(session):
    """DTensor's sharding propagation runs each op on fake global-shape tensors in a fake mode of its own on the GPU; here
    it finds ours: what it makes is metadata, not memory."""
    def patch(mod):
        cls = getattr(mod, "ShardingPropagator", None)
        fn = getattr(cls, "_propagate_tensor_meta_non_cached", None)
        if fn is None:
            return

        def wrapped(self, *a, **k):
            session.untracked += 1
            try:
                return fn(self, *a, **k)
            finally:
                session.untracked -= 1
        cls._propagate_tensor_meta_non_cached = wrapped
    return patch


def _patch_fsdp_grads(session):
    """FSDP2 keeps each unit's full (unsharded) gradients from backward until the unit's `post_backward`
    reduce-scatters and frees them: tag them `gradient` there, as the recorder does (record/hooks.patch_fsdp), else
    they read as temporaries made and freed in backward. The wrapper calls the original and returns what it returns."""
    def patch(mod):
        cls = getattr(mod, "FSDPParamGroup", None)
        original = getattr(cls, "post_backward", None)
        if original is None or getattr(original, "_tracekit_simulated", False):
            return

        def post_backward(group, *args, **kwargs):
            marks = _ACTIVE[-1].marks if _ACTIVE else None
            if marks is not None:
                from ..record.distributed import fsdp2_unsharded_grads
                for param, g in fsdp2_unsharded_grads(group):
                    marks._tag("gradient", g, f"{param}.grad (unsharded, before its reduce-scatter)")
            return original(group, *args, **kwargs)
        post_backward._tracekit_simulated = True
        post_backward.__wrapped__ = original
        cls.post_backward = post_backward
    return patch


_ACTIVE: list = []  # the sessions running (innermost last): patches made once per process find theirs here


def _patch_stopping(session):
    def patch(mod):
        import torch
        cls = getattr(mod, "EosTokenCriteria", None)
        if cls is None:
            return

        def call(self, input_ids, scores, **kwargs):
            session.assume("generation runs to max_new_tokens (an end-of-sequence token is never produced)")
            return torch.zeros((input_ids.shape[0],), dtype=torch.bool, device=input_ids.device)
        cls.__call__ = call
        stop = getattr(mod, "StopStringCriteria", None)
        if stop is not None:
            stop.__call__ = call
    return patch


@contextlib.contextmanager
def policies(session):
    """torch.compile runs eager; torch.save writes no fake tensors; torch.load reads on the host, then moves
    as map_location says; DataLoader workers run in the main process."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensor
    from torch.utils._pytree import tree_leaves

    saved = []

    def put(obj, name, value):
        saved.append((obj, name, getattr(obj, name)))
        setattr(obj, name, value)

    said = "torch.compile runs eager (inductor's buffers are not simulated: eager's memory is the bound)"

    def compile_(model=None, *a, **k):
        if model is None:  # @torch.compile(...) as a decorator factory
            return lambda m: compile_(m, *a, **k)
        if isinstance(model, torch.nn.Module):
            session.assume(said)
            return model
        import functools

        @functools.wraps(model)
        def eager(*args, **kwargs):  # a library's compiled helper: said when it runs, not when it is defined
            session.assume(said)
            return model(*args, **kwargs)
        return eager

    def module_compile(self, *a, **k):
        session.assume("torch.compile runs eager (inductor's buffers are not simulated: eager's memory is the bound)")

    orig_save = torch.save

    def save(obj, f, *a, **k):
        try:
            leaves = tree_leaves(obj)
        except Exception:
            leaves = []
        if any(isinstance(x, FakeTensor) for x in leaves) or _has_fake(obj):
            session.assume("torch.save writes nothing (the simulation has no tensor values)")
            return None
        return orig_save(obj, f, *a, **k)

    orig_load = torch.load

    def load(f, map_location=None, *a, **k):
        from torch._subclasses.fake_tensor import unset_fake_temporarily
        from torch.utils._python_dispatch import _disable_current_modes
        with _disable_current_modes(), unset_fake_temporarily():
            obj = orig_load(f, *a, map_location="cpu", **k)
        where = None
        if map_location is not None and not callable(map_location) and not isinstance(map_location, dict):
            where = session.cuda_index(map_location)

        def move(x):
            if isinstance(x, torch.Tensor) and not isinstance(x, FakeTensor):
                return x.to(f"cuda:{where}") if where is not None else x.clone()
            return x
        from torch.utils._pytree import tree_map
        try:
            return tree_map(move, obj)
        except Exception:
            return obj

    dl_init = torch.utils.data.DataLoader.__init__

    def dl(self, *a, **k):
        if k.get("num_workers"):
            session.assume("DataLoader workers run in the main process (num_workers=0)")
            k["num_workers"] = 0
            k.pop("prefetch_factor", None)
            k["persistent_workers"] = False
        if len(a) >= 6 and a[5]:
            a = list(a)
            a[5] = 0
            session.assume("DataLoader workers run in the main process (num_workers=0)")
        return dl_init(self, *a, **k)

    import importlib.metadata as metadata
    orig_version = metadata.version

    def version(name):
        try:
            return orig_version(name)
        except metadata.PackageNotFoundError:
            found = _checkout_version(name)
            if found is None:
                raise
            session.assume(f"{name} is the checkout on the path, as if installed (version {found} from its "
                           "pyproject.toml)")
            return found

    put(metadata, "version", version)

    import concurrent.futures as cf

    def submit(self, fn, /, *args, **kwargs):
        session.assume("thread pools run their work in the calling thread (torch's modes are per thread)")
        future = cf.Future()
        try:
            future.set_result(fn(*args, **kwargs))
        except BaseException as e:
            if not isinstance(e, Exception):
                raise
            future.set_exception(e)
        return future

    put(cf.ThreadPoolExecutor, "submit", submit)
    put(torch.Tensor, "_make_subclass", staticmethod(_subclass_over_fake(torch.Tensor._make_subclass)))
    put(torch, "compile", compile_)
    put(torch.nn.Module, "compile", module_compile)
    put(torch, "save", save)
    put(torch, "load", load)
    put(torch.utils.data.DataLoader, "__init__", dl)
    try:
        yield
    finally:
        for obj, name, value in reversed(saved):
            setattr(obj, name, value)


def _subclass_over_fake(make_subclass):
    """`torch.Tensor._make_subclass(cls, data)` over a fake tensor: the fake tensor itself, its class a subclass of
    both (FakeTensor first, so the fake mode still dispatches its ops; then `cls`, so its methods, attributes and
    isinstance checks hold). bitsandbytes' Params4bit and Int8Params (QLoRA), and any Parameter subclass made this
    way, then run as written: their quantization and 4-bit matmuls are custom ops with fake kernels."""
    from torch._subclasses.fake_tensor import FakeTensor
    classes = {}

    def make(cls, data, require_grad=False, *a, **k):
        if not isinstance(data, FakeTensor) or issubclass(cls, FakeTensor) or a or k:
            return make_subclass(cls, data, require_grad, *a, **k)
        both = classes.get(cls)
        if both is None:
            both = classes[cls] = type(cls.__name__, (FakeTensor, cls), {"__module__": cls.__module__,
                                                                         "detach": _detach_keeping_class})
        t = data.detach()
        t.requires_grad_(bool(require_grad))
        t.__class__ = both
        return t
    return make


def _detach_keeping_class(self):
    """detach() of a subclass over a fake tensor keeps the class and its attributes, as nn.Parameter and Module._apply
    (which swaps fake parameters) require."""
    from torch._subclasses.fake_tensor import FakeTensor
    t = FakeTensor.detach(self)
    t.__class__ = type(self)
    t.__dict__.update(self.__dict__)
    return t


def _checkout_version(name):
    """The version a project on sys.path but not installed would have: `project.version` of the
    pyproject.toml at the root of a path entry whose `project.name` is `name` (PEP 503 names compare
    equal). A script run from a checkout (PYTHONPATH=., no `pip install -e .`) that asks for its own
    version at import would otherwise stop before it allocates anything; on its GPU machine it was
    installed. None when no such project is on the path."""
    try:
        import tomllib
    except ImportError:  # Python 3.10
        return None

    def norm(n):
        return re.sub(r"[-_.]+", "-", str(n)).lower()
    want = norm(name)
    for entry in sys.path:
        path = os.path.join(entry or os.getcwd(), "pyproject.toml")
        try:
            if os.path.getsize(path) > 1 << 20:
                continue
            with open(path, "rb") as f:
                project = tomllib.load(f).get("project") or {}
        except (OSError, ValueError):
            continue
        if isinstance(project, dict) and norm(project.get("name", "")) == want:
            v = project.get("version")
            return str(v) if isinstance(v, str) else "0+checkout"
    return None


def _has_fake(obj) -> bool:
    try:
        import torch
        if isinstance(obj, torch.nn.Module):
            return True
        if isinstance(obj, dict):
            return any(_has_fake(v) for v in list(obj.values())[:64])
    except Exception:
        pass
    return False


# -- the whole run --------------------------------------------------------------------------------------------

@contextlib.contextmanager
def simulation(card, *, alloc_conf=None, routing="even", world_size=1, rank=0, devices=None, marks=True):
    """Everything installed; yields the Session. Use around a script or the built-in training step."""
    import torch
    import torch._dynamo  # noqa: F401 - imported before torch.cuda answers for the card (it checks how torch was built)
    from torch._subclasses.fake_tensor import FakeTensorMode

    from . import cuda_api, kernels
    from .calls import device_mode_class
    from .engine import Session, _tracker_class, device_aware_fake_tensors

    cpu = card.name == "none"
    ndev = 1 if cpu else (devices or max(1, world_size if world_size > 1 else 1))
    session = Session(card, alloc_conf=alloc_conf, routing=routing, devices=ndev, rank=rank, world_size=world_size)
    session.cpu_run = cpu
    if world_size > 1 and not cpu:
        session.current_device = rank % ndev
    hook = _PostImport({"transformers.utils.import_utils": _patch_import_utils,
                        "transformers.generation.stopping_criteria": _patch_stopping(session),
                        "safetensors.torch": _patch_safetensors(session),
                        "safetensors": _patch_safe_open(session),
                        "torch.distributed.tensor._api": _patch_dtensor(session),
                        "torch.distributed.tensor._sharding_prop": _patch_sharding_prop(session),
                        "torch.distributed.fsdp._fully_shard._fsdp_param_group": _patch_fsdp_grads(session)})
    for name, fn in hook.patches.items():  # already imported (the built-in step): patch now
        if name in sys.modules:
            fn(sys.modules[name])
    sys.meta_path.insert(0, hook)
    tracker = _tracker_class()(session)
    mk = SimulatedMarks(session) if marks else None
    autocast = kernels.CudaAutocast(on_cast=session.frames.on_cast)
    composites = kernels.CudaComposites(tuple(card.sm), session.frames.op)
    session.tracker, session.marks, session.composites = tracker, mk, composites
    old_grad = torch.is_grad_enabled()
    _ACTIVE.append(session)
    try:
        with contextlib.ExitStack() as stack:
            if not cpu:  # --gpu none: the script's own CPU run, torch.cuda as this machine has it
                stack.enter_context(cuda_api.installed(session, autocast))
                stack.enter_context(autocast.installed())
                stack.enter_context(composites.installed())
            stack.enter_context(policies(session))
            if world_size > 1:
                from .distributed import fake_process_group
                stack.enter_context(fake_process_group(session))
            stack.enter_context(device_aware_fake_tensors(session))
            session.fake_mode = stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
            stack.enter_context(tracker)
            stack.enter_context(device_mode_class()(session, tracker, mk))
            if mk is not None:
                mk.install()
                stack.callback(mk.remove)
            yield session
    finally:
        torch.set_grad_enabled(old_grad)
        if session in _ACTIVE:
            _ACTIVE.remove(session)
        try:
            sys.meta_path.remove(hook)
        except ValueError:
            pass


def main():
    """The bootstrap: sys.argv is ['-c', SETTINGS_JSON, MODE, TARGET, *ARGS]."""
    from ..record.script import _exit_code, _hide_bootstrap_frames, _run
    settings = json.loads(sys.argv[1])
    mode, target, args = sys.argv[2], sys.argv[3], sys.argv[4:]
    _hide_bootstrap_frames()
    from ..analysis.estimate.gpus import gpu
    from .engine import SimulationError
    card = gpu(settings.get("gpu"))
    world, rank = int(settings.get("world_size", 1)), int(settings.get("rank", 0))
    if world > 1:
        os.environ.update({"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world),
                           "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                           "MASTER_PORT": os.environ.get("MASTER_PORT", "29500"), "GROUP_RANK": "0"})
    code, error = 0, None
    session = None
    try:
        with simulation(card, alloc_conf=os.environ.get("PYTORCH_CUDA_ALLOC_CONF") or None,
                        routing=settings.get("routing", "even"), world_size=world, rank=rank,
                        devices=settings.get("devices")) as session:
            try:
                _run(mode, target, args)
            finally:
                if session.marks is not None:
                    session.marks.end_iteration()
    except SystemExit as e:
        code = _exit_code(e.code)
        if code and not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except SimulationError as e:
        print(f"tracekit simulate: {e}", file=sys.stderr)
        code = 2
    except KeyboardInterrupt:
        _finish(session, settings, 130)
        raise
    except BaseException as e:  # the script's own failure: its traceback, as Python prints it
        error = e
        code = 1
    if error is not None:
        _drop_our_frames(error)
        sys.excepthook(type(error), error, error.__traceback__)
    _finish(session, settings, code)
    sys.stdout.flush()
    os._exit(code) if settings.get("hard_exit") else sys.exit(code)


def _drop_our_frames(error):
    """The script's traceback as the GPU run would print it: without the simulator's own frames."""
    ours = ("tracekit/simulate/", "tracekit/record/script.py", "torch/utils/_python_dispatch.py", "torch/_ops.py",
            "torch/_compile.py", "torch/_dynamo/eval_frame.py")
    seen = set()
    e = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        tb, keep = e.__traceback__, []
        while tb is not None:
            if not any(o in tb.tb_frame.f_code.co_filename.replace("\\", "/") for o in ours):
                keep.append(tb)
            tb = tb.tb_next
        for a, b in zip(keep, keep[1:] + [None]):
            a.tb_next = b
        if keep:
            e.__traceback__ = keep[0]
        e = e.__cause__ or e.__context__


def _finish(session, settings, code):
    if session is None:
        return
    out = settings.get("output")
    if out:
        try:
            from .output import write
            path = write(session, out, settings)
            print(f"tracekit simulate: wrote {path}", file=sys.stderr)
        except Exception as e:  # noqa: BLE001 - the run's own result stands; say why the file is missing
            print(f"tracekit simulate: could not write {out} ({type(e).__name__}: {e})", file=sys.stderr)
    from .engine import _fmt
    lines = []
    for i, d in sorted(session.devices.items()):
        a = d.allocator
        where = "cpu (the host, simulated)" if session.cpu_run else f"cuda:{i} ({session.card.name}, simulated)"
        lines.append(f"{where}: peak allocated {_fmt(a.peak_allocated)} "
                     f"({a.peak_allocated:,} B)" + ("" if session.cpu_run else
                                                  f", peak reserved {_fmt(a.peak_reserved)} ({a.peak_reserved:,} B)")
                     + (f", {a.ooms} out-of-memory error{'s' if a.ooms != 1 else ''}" if a.ooms else ""))
    if not lines:
        lines.append("no tensor was put on the simulated GPU")
    print("tracekit simulate: " + "\n  ".join(lines), file=sys.stderr)
    assumptions = session.summary_assumptions()
    if assumptions:
        print("tracekit simulate: assumed: " + "; ".join(assumptions[:12])
              + (f"; and {len(assumptions) - 12} more" if len(assumptions) > 12 else ""), file=sys.stderr)
