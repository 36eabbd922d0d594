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

import re

import numpy as np

USER, LIB, OP, NOISE = range(4)

_SEP = r"[/\\]"
# Python that belongs to torch, the recorder or the interpreter's plumbing.
# tracekit/record/toy.py is the demo's model: there it plays the user's code.
_INTERNAL_PY = re.compile(
    rf"((^|{_SEP})(torch|torchvision|torchaudio|triton|tracekit(?!{_SEP}record{_SEP}toy\.py)|importlib|runpy|"
    rf"threading|contextlib|functools|unittest|click|_pytest|pluggy|IPython|ipykernel){_SEP})"
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


def frame_kind(filename: str, name: str = "", line: int | None = None) -> int:
    """USER, LIB, OP or NOISE for one frame."""
    if _NATIVE_FILE.search(filename) or "::" in name or (line == 0 and not filename.endswith(".py")):
        return NOISE if _NOISE_NAME.search(name) or not name else OP
    if _INTERNAL_PY.search(filename) or line == 0:
        # line 0 of Python code is a line nobody knew (older recorders' frames entered before profiling
        # began): never shown as the user's line to edit
        return OP
    if _LIB.search(filename):
        return LIB
    return USER


def is_internal(filename: str, name: str = "", line: int | None = None) -> bool:
    """True for frames inside torch, the recorder, native code or Python's own plumbing."""
    return frame_kind(filename, name, line) in (OP, NOISE)


def is_user(frame: dict) -> bool:
    return frame_kind(frame.get("filename", ""), frame.get("name", ""), frame.get("line")) == USER


def user_first(frames: list[dict]) -> list[dict]:
    """Frames reordered: the user's own code (innermost first), then libraries, internals, plumbing."""
    groups = ([], [], [], [])
    for f in frames:
        groups[frame_kind(f.get("filename", ""), f.get("name", ""), f.get("line"))].append(f)
    return groups[USER] + groups[LIB] + groups[OP] + groups[NOISE]


def user_frames(trace, stack_id: int, limit: int = 8) -> list[dict]:
    """Up to `limit` frames of a stack, the user's own code first."""
    return user_first(trace.stack(stack_id))[:limit]


# What internal frames reveal, most telling first: (pattern on the frame name or file, description).
_REVEALS = [
    (re.compile(r"getNewWorkspace|getCUDABlasLtWorkspace|cublasLt?Workspace|getCurrentCUDABlasHandle"),
     "cuBLAS workspace"),
    (re.compile(r"AccumulateGrad"), "p.grad (AccumulateGrad)"),
    (re.compile(r"cached_cast"), "autocast cast"),
    (re.compile(r"(nccl|NCCL|c10d::|ProcessGroup)"), "NCCL / c10d communication buffer"),
    (re.compile(r"autotune|Autotuner|benchmarker"), "Triton autotuning buffer"),
    (re.compile(r"(_fused_adamw?|fused_sgd|_foreach_\w+|multi_tensor_apply)"), "optimizer kernel {0}"),
    (re.compile(r"(\w+Backward\d*)(::apply|_apply_functional)"), "autograd engine: {0}"),
    (re.compile(r"torch::autograd::(Engine|PythonEngine)::"), "autograd engine"),
    (re.compile(r"at::_ops::(\w+)::call"), "aten::{0}"),
    (re.compile(r"THPVariable_(\w+)\("), "torch.{0}"),
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
    seen = {}
    out = np.empty(len(fr), np.int8)
    for i, (f, n, ln) in enumerate(zip(fr.filename.tolist(), fr.name.tolist(), fr.line.tolist())):
        k = (f, n, ln == 0)
        v = seen.get(k)
        if v is None:
            v = seen[k] = frame_kind(s[f], s[n], ln)
        out[i] = v
    memo["kinds"] = out
    return out
