"""Which frames are the user's code: findings show those first, so frame 0 is the line to edit."""
from __future__ import annotations

import re

from ..model import Trace

# Library and runtime frames: torch itself, the recorder, the interpreter's plumbing.
# tracekit/record/toy.py is the demo's model: there it plays the user's code.
_INTERNAL = re.compile(
    r"((^|[/\\])(torch|torchvision|transformers|accelerate|triton|tracekit(?![/\\]record[/\\]toy\.py)|importlib|runpy|threading|contextlib|"
    r"functools|unittest|click|site-packages[/\\]pytest|_pytest|pluggy)[/\\])"
    r"|^<frozen |^<string>$|^\?\?$|^$"
)
_LIB = re.compile(r"[/\\](site-packages|dist-packages|lib[/\\]python\d)")


def is_internal(filename: str) -> bool:
    """True for frames inside torch, the recorder or Python's own plumbing."""
    return bool(_INTERNAL.search(filename))


def user_first(frames: list[dict]) -> list[dict]:
    """Frames reordered: the user's own code (innermost first), then libraries, then internals."""
    user, lib, internal = [], [], []
    for f in frames:
        fn = f.get("filename", "")
        (internal if is_internal(fn) else lib if _LIB.search(fn) else user).append(f)
    return user + lib + internal


def user_frames(trace: Trace, stack_id: int, limit: int = 8) -> list[dict]:
    """Up to `limit` frames of a stack, the user's own code first."""
    return user_first(trace.stack(stack_id))[:limit]


def where(frames: list[dict]) -> str:
    """`file:line in name` of the first frame, shortened to the last two path parts."""
    if not frames:
        return "(no stack recorded)"
    f = frames[0]
    parts = re.split(r"[/\\]", f["filename"])
    return f"{'/'.join(parts[-2:])}:{f['line']} in {f['name']}"
