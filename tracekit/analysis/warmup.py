"""A torch.compile warm-up: the first iteration of a compiled run, kept apart from the iterations.

The first call of a compiled model traces and compiles it (dynamo, aot_autograd, inductor, autotuning):
seconds in which little memory moves, then the iterations run at their own pace. On a time axis those
seconds squeeze every iteration into the right edge. The warm-up is iteration 0 (with what comes before
it) when the file shows torch.compile (its generated code or its compiler in the stacks) and that
iteration lasts more than WARMUP_FACTOR times the median of the others, in time when the file has times,
else in entries. The viewer opens on the iterations after it (the whole trace stays a zoom away).
"""
from __future__ import annotations

import re
from typing import Any

import numpy as np

from ..model import NO_TIME, Trace
from .memo import per_trace

WARMUP_FACTOR = 3.0
# generated code and the compiler's runtime (dynamo's own frames are not enough: torch.optim wraps its
# methods in torch._dynamo.disable, so they appear in every optimizer step)
_RE_COMPILE = re.compile(r"<eval_with_key>|fx_generated_\w*\.py$|torchinductor_|torch[/\\]_inductor[/\\]"
                         r"|[/\\]_aot_autograd[/\\]")


@per_trace
def compiled(trace: Trace) -> bool:
    """Whether any stack of the file runs torch.compile's code (generated graphs, dynamo, inductor)."""
    strings = trace.strings
    used: Any
    used = np.unique(trace.frames.filename) if len(trace.frames) else []
    return any(_RE_COMPILE.search(strings[int(i)]) for i in used)


@per_trace
def compile_warmup(trace: Trace, device: int) -> dict | None:
    """{"first_index", "last_index", "seconds" or None, "entries", "why"} of the warm-up, or None."""
    from .phases import phases

    if not compiled(trace):
        return None
    ph = phases(trace)[device]
    its = ph.iterations()
    if len(its) < 2 or its[0][0] != 0:
        return None
    t = trace.events.time_us[trace.events.device_slice(device)]
    timed = len(t) and not (t == NO_TIME).any()

    def span(first, last, nxt):
        end = nxt if nxt is not None else last
        return float(t[end] - t[first]) if timed else float(end - first)

    spans = [span(f, last, its[k + 1][1] if k + 1 < len(its) else None) for k, (_, f, last) in enumerate(its)]
    rest = float(np.median(spans[1:]))
    first = 0 if its[0][1] > 0 else its[0][1]
    whole = span(first, its[0][2], its[1][1])
    if rest <= 0 or whole <= WARMUP_FACTOR * rest:
        return None
    unit = "s" if timed else "entries"
    shown = f"{whole / 1e6:.2f} s" if timed else f"{int(whole)} entries"
    rest_shown = f"{rest / 1e6:.3f} s" if timed else f"{int(rest)} entries"
    return {"first_index": int(first), "last_index": int(its[1][1] - 1),
            "seconds": whole / 1e6 if timed else None, "entries": int(its[1][1] - first), "unit": unit,
            "why": f"torch.compile in the stacks; iteration 0 takes {shown}, the others {rest_shown} (median)"}
