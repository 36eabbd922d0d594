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
    """One card: what changes with it in a simulation is here and nowhere else."""

    name: str
    memory: int  # bytes (get_device_properties().total_memory)
    sm: tuple  # compute capability (major, minor): SDPA backend, cuBLAS workspace, bf16 support
    device_name: str = ""  # torch.cuda.get_device_name()
    sms: int = 0  # multiprocessors
    # what the CUDA context and the libraries' handles take before PyTorch's allocator gets any memory (never
    # reserved by it, so never in max_memory_reserved): an estimate until measured per card and driver
    context_bytes: int = 512 * MiB

    @property
    def bf16(self) -> bool:
        return self.sm[0] >= 8


GPUS = (
    Gpu("H100 80GB", 81559 * MiB, (9, 0), "NVIDIA H100 80GB HBM3", 132),
    Gpu("H200 141GB", 143771 * MiB, (9, 0), "NVIDIA H200", 132),
    Gpu("A100 80GB", 81920 * MiB, (8, 0), "NVIDIA A100-SXM4-80GB", 108),
    Gpu("A100 40GB", 40960 * MiB, (8, 0), "NVIDIA A100-SXM4-40GB", 108),
    Gpu("L40S 48GB", 46068 * MiB, (8, 9), "NVIDIA L40S", 142),
    Gpu("L4 24GB", 23034 * MiB, (8, 9), "NVIDIA L4", 58),
    Gpu("RTX 4090 24GB", 24564 * MiB, (8, 9), "NVIDIA GeForce RTX 4090", 128),
    Gpu("RTX 3090 24GB", 24576 * MiB, (8, 6), "NVIDIA GeForce RTX 3090", 82),
    Gpu("A10G 24GB", 23028 * MiB, (8, 6), "NVIDIA A10G", 80),
    Gpu("T4 16GB", 15360 * MiB, (7, 5), "Tesla T4", 40),
    Gpu("V100 16GB", 16384 * MiB, (7, 0), "Tesla V100-SXM2-16GB", 80),
)
DEFAULT = "H100 80GB"
# names people type -> the entry (the bare model name picks its largest memory)
ALIASES = {"h100": "H100 80GB", "h200": "H200 141GB", "a100": "A100 80GB", "l40s": "L40S 48GB",
           "l4": "L4 24GB", "4090": "RTX 4090 24GB", "rtx4090": "RTX 4090 24GB", "a10g": "A10G 24GB",
           "a10": "A10G 24GB", "t4": "T4 16GB", "v100": "V100 16GB", "3090": "RTX 3090 24GB",
           "rtx3090": "RTX 3090 24GB"}


def _norm(text: str) -> str:
    return re.sub(r"[\s_\-]+", "", text.lower()).replace("nvidia", "").replace("geforce", "")


# `tracekit simulate --gpu none`: no GPU, the script's CPU tensors are the memory simulated (no caching allocator of
# CUDA's kind on the host: the blocks are the requests in 512-byte multiples, nothing is reserved beyond them)
NONE = Gpu("none", 1 << 50, (0, 0), "cpu", 0, 0)


def gpu(name: str | None) -> Gpu:
    """The GPU named (case, spaces and dashes ignored: "h100", "A100-40GB", "rtx 4090"); TracekitError otherwise."""
    if not name:
        return gpu(DEFAULT)
    if str(name).strip().lower() in ("none", "cpu"):
        return NONE
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
