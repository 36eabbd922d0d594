"""Which frames are the user's code, and what the others reveal.

A frame is the user's when it is Python code outside torch, site-packages and
the interpreter. Everything else is one of:

- library: Python in site-packages other than torch (einops, transformers...);
- op: PyTorch internals that say something (an aten op, an autograd node,
  the autograd engine, autocast, a cuBLAS workspace, an optimizer kernel);
- noise: the allocator and the interpreter's plumbing (`gather_with_cpp`,
  `CUDACachingAllocator.cpp`, `_PyEval_EvalFrameDefault`, libc).

Findings show the user's frames first, so frame 0 is the line to edit; where
a stack has none, `describe` says what the internal frames reveal.
"""
from __future__ import annotations

import functools
import re

import numpy as np

USER, LIB, OP, NOISE = range(4)

_SEP = r"[/\\]"
# Python that belongs to torch, the recorder or the interpreter's plumbing.
# tracekit/record/toy.py is the demo's model: there it plays the user's code.
# tracekit is named by its own modules, not by a folder called tracekit (a checkout of this repository, or a
# user's project of that name, holds the user's code)
_OURS = (rf"(^|{_SEP})tracekit{_SEP}(record{_SEP}(?!toy\.py$)|(analysis|io|simulate|commands|integrations|render)"
         rf"{_SEP}|(cli|api|__main__|__init__|model|errors|units)\.py$)")
_INTERNAL_PY = re.compile(
    rf"((^|{_SEP})(torch|torchvision|torchaudio|triton|importlib|runpy|"
    rf"threading|contextlib|functools|unittest|click|_pytest|pluggy|IPython|ipykernel){_SEP})"
    rf"|{_OURS}"
    rf"|{_SEP}lib{_SEP}python\d[\d.]*{_SEP}(?!site-packages|dist-packages)"
    rf"|{_SEP}torchinductor_[^/\\]*{_SEP}"
    r"|^<frozen |^<string>$|^<eval_with_key>|^<ipython-input|^<__array_function__"
)
_LIB = re.compile(rf"{_SEP}(site-packages|dist-packages){_SEP}")
_NATIVE_FILE = re.compile(r"\.(cpp|cc|cxx|c|h|hpp|cu|cuh|S|s|o|so)$|^\?\?$|^$")
# Native frames that only say "memory was allocated" or "Python ran".
_NOISE_NAME = re.compile(
    r"gather_with_cpp|CapturedTraceback|unwind|CUDACachingAllocator|c10::cuda::|NativeCachingAllocator"
    r"|at::detail::_?empty|at::native::empty|at::empty|at::_ops::empty|intrusive_ptr|StorageImpl|TensorImpl"
    r"|wrap_kernel_functor|c10::impl::|c10::Dispatcher|c10::OperatorHandle|wrapper_CUDA__?empty|create_out"
    r"|set_output_raw_strided|^_?Py|^py|^_start$|^__libc|^start_thread|^__clone|^clone|slot_|cfunction_|method_vectorcall"
    r"|^binary_op|^run_mod|^run_eval|^pymain|^execute_native_thread_routine|^std::|allocate_or_resize_outputs"
    r"|TensorIteratorBase::|at::meta::|dispatch_to|THPVariable_dealloc|THPVariable_clear|decref|subtype_dealloc"
)


# Third-party packages recognised outside site-packages too: an editable install or a source checkout
# (`.../src/transformers/models/...`, `~/code/peft/src/peft/tuners/...`), by their import name.
KNOWN_LIBRARIES = frozenset((
    "transformers", "peft", "accelerate", "bitsandbytes", "flash_attn", "flash_attn_interface", "deepspeed",
    "vllm", "trl", "diffusers", "timm", "xformers", "apex", "megatron", "lightning", "pytorch_lightning",
    "lightning_fabric", "einops", "optimum", "liger_kernel", "unsloth", "unsloth_zoo", "torchtune", "torchao",
    "fairscale", "sentence_transformers", "open_clip", "mamba_ssm", "causal_conv1d", "auto_gptq", "gptqmodel",
    "awq", "hqq", "optimum_quanto", "quanto", "nemo", "colossalai", "fairseq", "sglang", "axolotl", "composer",
    "mmengine", "mmcv", "detectron2", "torchrec", "torch_geometric", "kernels", "huggingface_hub", "datasets",
    "safetensors", "tokenizers",
))
_SITE = re.compile(r"[/\\](?:site|dist)-packages[/\\]")
_NOT_LIBRARY_CODE = r"(?!(examples?|scripts?|tests?|benchmarks?|docs|notebooks|tools){_SEP})".format(_SEP=_SEP)
_EDITABLE = re.compile(rf"(?:^|{_SEP})(?:src{_SEP})?({'|'.join(sorted(KNOWN_LIBRARIES))}){_SEP}{_NOT_LIBRARY_CODE}"
                       rf"(?=[^/\\]+{_SEP})"
                       rf"|{_SEP}src{_SEP}({'|'.join(sorted(KNOWN_LIBRARIES))}){_SEP}")
_EGG = re.compile(r"\.(egg|egg-info|dist-info)$|-\d[^/\\]*$")


@functools.lru_cache(maxsize=65536)
def package_of(filename: str) -> tuple[str | None, str]:
    """(the top-level package a Python file belongs to, how that was found).

    `how` is "site-packages" (the path's part after the last site-packages or
    dist-packages folder, on any machine or OS: `/opt/conda/.../site-packages/transformers/...`,
    `C:\\...\\Lib\\site-packages\\peft\\...`), "known package in the path" (an editable install or a
    checkout: a folder named like a known library with more folders under it, or under `src/`), or
    "" (none: the user's own code, the interpreter, or a native frame)."""
    if not filename or not filename.endswith((".py", ".pyc", ".pyx")):
        return None, ""
    m = None
    for m in _SITE.finditer(filename):
        pass
    if m is not None:
        parts = [p for p in re.split(r"[/\\]", filename[m.end():]) if p]
        while len(parts) > 1 and _EGG.search(parts[0]):  # pkg-1.0-py3.10.egg/pkg/...: the folder inside
            parts = parts[1:]
        if parts:
            top = parts[0]
            for suffix in (".py", ".pyc", ".pyx"):
                if top.endswith(suffix):
                    top = top[:-len(suffix)]
            return top, "site-packages"
    e = _EDITABLE.search(filename)
    if e:
        return e.group(1) or e.group(2), "known package in the path"
    return None, ""


def frame_kind(filename: str, name: str = "", line: int | None = None) -> int:
    """USER, LIB, OP or NOISE for one frame."""
    if _NATIVE_FILE.search(filename) or "::" in name or (line == 0 and not filename.endswith(".py")):
        return NOISE if _NOISE_NAME.search(name) or not name else OP
    pkg, how = package_of(filename)
    if how == "site-packages":  # judge the part inside site-packages only (a venv may live under /opt/torch/)
        last = None
        for last in _SITE.finditer(filename):
            pass
        tail = filename[last.end():] if last is not None else filename
        return OP if _INTERNAL_PY.search("/" + tail) else LIB
    if _INTERNAL_PY.search(filename) or line == 0:
        # line 0 of Python code is a line nobody knew (older recorders' frames entered before profiling
        # began): never shown as the user's line to edit
        return OP
    if pkg is not None or _LIB.search(filename):
        return LIB
    return USER


def is_internal(filename: str, name: str = "", line: int | None = None) -> bool:
    """True for frames inside torch, the recorder, native code or Python's own plumbing."""
    return frame_kind(filename, name, line) in (OP, NOISE)


def is_user(frame: dict) -> bool:
    return frame_kind(frame.get("filename", ""), frame.get("name", ""), frame.get("line")) == USER


def user_first(frames: list[dict]) -> list[dict]:
    """Frames reordered: the user's own code (innermost first), then libraries, internals, plumbing."""
    groups: tuple[list, list, list, list]
    groups = ([], [], [], [])
    for f in frames:
        groups[frame_kind(f.get("filename", ""), f.get("name", ""), f.get("line"))].append(f)
    return groups[USER] + groups[LIB] + groups[OP] + groups[NOISE]


# What internal frames reveal, most telling first: (pattern on the frame name or file, description).
_REVEALS = [
    (re.compile(r"getNewWorkspace|getCUDABlasLtWorkspace|cublasLt?Workspace|getCurrentCUDABlasHandle"),
     "cuBLAS workspace"),
    (re.compile(r"AccumulateGrad"), "p.grad (AccumulateGrad)"),
    (re.compile(r"cached_cast"), "autocast cast"),
    (re.compile(r"(nccl|NCCL|c10d::|ProcessGroup)"), "NCCL / c10d communication buffer"),
    (re.compile(r"autotune|Autotuner|benchmarker"), "Triton autotuning buffer"),
    (re.compile(r"(_fused_adamw?|fused_sgd|_foreach_\w+|multi_tensor_apply)"), "optimizer kernel {0}"),
    (re.compile(r"((?<!\w)\w+Backward\d*)(::apply|_apply_functional)"), "autograd engine: {0}"),
    (re.compile(r"torch::autograd::(Engine|PythonEngine)::"), "autograd engine"),
    (re.compile(r"at::_ops::(\w+)::call"), "aten::{0}"),
    (re.compile(r"THPVariable_(\w{1,256})\("), "torch.{0}"),
]


def describe(frames: list[dict]) -> str:
    """A short phrase for what a stack's internal frames reveal ("" when nothing)."""
    for pattern, text in _REVEALS:
        for f in frames:
            m = pattern.search(f.get("name", "")) or pattern.search(f.get("filename", ""))
            if m:
                return text.format(*(g for g in m.groups() if g)) if m.groups() else text
    for f in frames:
        if frame_kind(f.get("filename", ""), f.get("name", ""), f.get("line")) == LIB:
            return f"{short_path(f['filename'])}:{f['line']} in {f['name']}"
    return ""


def short_path(filename: str) -> str:
    return "/".join(re.split(r"[/\\]", filename)[-2:])


def where(frames: list[dict], what: str = "") -> str:
    """`file:line in name` of the first frame when it is the user's; else what the stack reveals."""
    if frames and is_user(frames[0]):
        f = frames[0]
        return f"{short_path(f['filename'])}:{f['line']} in {f['name']}" + (f" ({what})" if what else "")
    what = what or describe(frames)
    if what:
        return what
    if not frames:
        return "(no stack recorded)"
    f = frames[0]
    return f"{short_path(f['filename'])}:{f['line']} in {f['name']}"


def frame_kinds(trace) -> np.ndarray:
    """frame_kind of every interned frame of a trace (memoised by filename and name)."""
    memo = trace.__dict__.setdefault("_frame_kind_memo", {})
    if "kinds" in memo:
        return memo["kinds"]
    fr, s = trace.frames, trace.strings
    seen: dict = {}
    out = np.empty(len(fr), np.int8)
    for i, (f, n, ln) in enumerate(zip(fr.filename.tolist(), fr.name.tolist(), fr.line.tolist())):
        k = (f, n, ln == 0)
        v = seen.get(k)
        if v is None:
            v = seen[k] = frame_kind(s[f], s[n], ln)
        out[i] = v
    memo["kinds"] = out
    return out


# -- the three frames of a stack: the user's line, the library line, PyTorch's op -------------------

_ATEN_OP = re.compile(r"at::_ops::(\w+?)::(call|redispatch)\b")
_AUTOGRAD_NODE = re.compile(r"((?<!\w)\w+Backward\d*)(::apply|_apply_functional)|(AccumulateGrad)")
_TORCH_PKGS = ("torch", "torchvision", "torchaudio", "functorch")


def frame_op(filename: str, name: str) -> tuple[int, str]:
    """(kind, text) of what a frame says about PyTorch's op: 3 an aten op ("aten::linear"), 2 an autograd
    node ("SiluBackward0"), 1 a Python function of torch ("nn/functional.py:2567 in embedding"), 0 none."""
    m = _ATEN_OP.search(name)
    if m:
        return 3, "aten::" + m.group(1)
    m = _AUTOGRAD_NODE.search(name)
    if m:
        return 2, m.group(1) or m.group(3)
    if filename.endswith(".py") and package_of(filename)[0] in _TORCH_PKGS:
        return 1, f"{short_path(filename)} in {name}"
    return 0, ""


class StackRoles:
    """Per stack id + 1 (0: no stack): the library line and PyTorch's op.

    `library`: frame id of the library line: the innermost frame of third-party code that runs in a
    `forward` method (the line of the model's own code, e.g. `modeling_qwen2.py:470 in forward`, that
    called whatever made the memory), else the innermost third-party frame (-1: none); `inner`: the
    innermost third-party frame of all (a helper the model called, e.g. `loss/loss_utils.py:40 in
    fixed_cross_entropy`; equal to `library` when there is none); `op`: string id
    of the op (the outermost aten op, i.e. the one Python called; else the innermost autograd node;
    else the innermost torch Python function; 0: none); `node`: string id of the innermost autograd
    node (0: none); `ops`: per stack, the frozenset of aten op names it passes through."""

    def __init__(self, library, inner, op, node, ops):
        self.library, self.inner, self.op, self.node, self.ops = library, inner, op, node, ops


def stack_roles(trace) -> StackRoles:
    memo = trace.__dict__.setdefault("_frame_kind_memo", {})
    if "roles" in memo:
        return memo["roles"]
    st, fr, strings = trace.stacks, trace.frames, trace.strings
    n = len(st)
    library = np.full(n + 1, -1, np.int32)
    inner = np.full(n + 1, -1, np.int32)
    op = np.zeros(n + 1, np.int32)
    node = np.zeros(n + 1, np.int32)
    ops: list[frozenset]
    ops = [frozenset()] * (n + 1)
    if n and len(st.frame_ids):
        kinds = frame_kinds(trace)
        op_kind = np.zeros(len(fr), np.int8)
        op_text = np.zeros(len(fr), np.int32)
        seen: dict = {}
        for i, (f, nm) in enumerate(zip(fr.filename.tolist(), fr.name.tolist())):
            v = seen.get((f, nm))
            if v is None:
                k, text = frame_op(strings[f], strings[nm])
                v = seen[(f, nm)] = (k, strings.intern(text) if k else 0)
            op_kind[i], op_text[i] = v
        fids = st.frame_ids
        nonempty = np.diff(st.offsets) > 0
        starts = st.offsets[:-1][nonempty]
        rows = np.flatnonzero(nonempty) + 1
        big = np.iinfo(np.int64).max
        pos = np.arange(len(fids), dtype=np.int64)
        k = op_kind[fids]
        is_lib = kinds[fids] == LIB
        fwd_name = np.zeros(len(strings), bool)
        fwd_name[strings.index.get("forward", 0)] = "forward" in strings.index
        in_forward = is_lib & fwd_name[fr.name[fids]]
        first_any = np.minimum.reduceat(np.where(is_lib, pos, big), starts)
        first_fwd = np.minimum.reduceat(np.where(in_forward, pos, big), starts)
        first_lib = np.where(first_fwd < big, first_fwd, first_any)
        ok = first_any < big
        inner[rows[ok]] = fids[first_any[ok]]
        last_aten = np.maximum.reduceat(np.where(k == 3, pos, -1), starts)
        first_node = np.minimum.reduceat(np.where(k == 2, pos, big), starts)
        first_py = np.minimum.reduceat(np.where(k == 1, pos, big), starts)
        first_outside = np.minimum.reduceat(np.where((kinds[fids] == LIB) | (kinds[fids] == USER), pos, big), starts)
        first_py = np.where(first_py < first_outside, first_py, big)  # torch's own Python, called from outside it
        ok = first_lib < big
        library[rows[ok]] = fids[first_lib[ok]]
        ok = first_node < big
        node[rows[ok]] = op_text[fids[first_node[ok]]]
        pick = np.where(last_aten >= 0, last_aten, np.where(first_node < big, first_node,
                                                             np.where(first_py < big, first_py, -1)))
        ok = pick >= 0
        op[rows[ok]] = op_text[fids[pick[ok]]]
        # the aten ops each stack passes through (for matching a backward node to its forward op)
        aten_rows = np.flatnonzero(k == 3)
        if len(aten_rows):
            owner = np.searchsorted(st.offsets, aten_rows, side="right") - 1
            by_stack: dict = {}
            for s_, t_ in zip(owner.tolist(), op_text[fids[aten_rows]].tolist()):
                by_stack.setdefault(s_, set()).add(strings[t_][6:])
            cache: dict = {}
            for s_, names in by_stack.items():
                key = frozenset(names)
                ops[s_ + 1] = cache.setdefault(key, key)
    memo["roles"] = out = StackRoles(library, inner, op, node, ops)
    return out
