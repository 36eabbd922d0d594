"""GPUs `tracekit estimate --gpu NAME` knows: device memory and compute capability.

Memory is the total the driver reports (nvidia-smi's MiB); what tensors can use is less: the CUDA
context and the libraries' handles take some hundreds of MiB, which a simulation does not model (the
report says so). The compute capability picks what the CUDA code would pick: the SDPA backend
(cuDNN first on sm90 / sm10x, flash from sm80, memory-efficient from sm50) and the cuBLAS workspace
(32 MiB on sm90 / sm10x / sm12x, else 8 MiB + 128 KiB).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from ...errors import TracekitError

MiB = 1 << 20


@dataclass(frozen=True)
class Gpu:
    name: str
    memory: int  # bytes
    sm: tuple  # compute capability (major, minor)


GPUS = (
    Gpu("H100 80GB", 81559 * MiB, (9, 0)),
    Gpu("H200 141GB", 143771 * MiB, (9, 0)),
    Gpu("A100 80GB", 81920 * MiB, (8, 0)),
    Gpu("A100 40GB", 40960 * MiB, (8, 0)),
    Gpu("L40S 48GB", 46068 * MiB, (8, 9)),
    Gpu("L4 24GB", 23034 * MiB, (8, 9)),
    Gpu("RTX 4090 24GB", 24564 * MiB, (8, 9)),
    Gpu("A10G 24GB", 23028 * MiB, (8, 6)),
    Gpu("T4 16GB", 15360 * MiB, (7, 5)),
    Gpu("V100 16GB", 16384 * MiB, (7, 0)),
)
DEFAULT = "H100 80GB"
# names people type -> the entry (the bare model name picks its largest memory)
ALIASES = {"h100": "H100 80GB", "h200": "H200 141GB", "a100": "A100 80GB", "l40s": "L40S 48GB",
           "l4": "L4 24GB", "4090": "RTX 4090 24GB", "rtx4090": "RTX 4090 24GB", "a10g": "A10G 24GB",
           "a10": "A10G 24GB", "t4": "T4 16GB", "v100": "V100 16GB"}


def _norm(text: str) -> str:
    return re.sub(r"[\s_\-]+", "", text.lower()).replace("nvidia", "").replace("geforce", "")


def gpu(name: str | None) -> Gpu:
    """The GPU named (case, spaces and dashes ignored: "h100", "A100-40GB", "rtx 4090"); TracekitError otherwise."""
    if not name:
        return gpu(DEFAULT)
    want = _norm(name)
    for g in GPUS:
        if _norm(g.name) == want:
            return g
    if want in ALIASES:
        return gpu(ALIASES[want])
    for g in GPUS:  # "a10040gb" -> "A100 40GB", "h10080" -> "H100 80GB"
        base, mem = _norm(g.name)[:-4], _norm(g.name)[-4:-2]
        if want in (base + mem, base + mem + "g", base + mem + "gb"):
            return g
    raise TracekitError(f"unknown GPU {name!r}; known: {', '.join(g.name for g in GPUS)}")


def names() -> list[str]:
    return [g.name for g in GPUS]
