"""What a CUDA process holds on the card beside PyTorch's caching allocator (never in memory_reserved): the CUDA
context, the kernels loaded (lazily, CUDA_MODULE_LOADING=LAZY), cuBLAS's and cuBLASLt's handles, the attention
kernels. Measured once, on one card and driver (bench/gpu_truth.py probe, tests/fixtures/gpu_truth/probe.jsonl):

    NVIDIA H100 80GB HBM3, driver 580.159.04, torch 2.11.0+cu130 (CUDA 13.0), 2026-11-27, card otherwise idle
    torch.cuda.init()                    +552,402,944 B  (cudaMemGetInfo's used; NVML's per-process figure: 518 MiB)
    first kernel (an elementwise add_)    +96,468,992 B  (92 MiB)
    first cuBLAS matmul (the handle)      +69,206,016 B  (66 MiB; its 32 MiB workspace is the allocator's, reserved)
    first cuBLASLt matmul (addmm + bias)  +67,108,864 B  (64 MiB)
    SDPA flash +0, memory-efficient +2 MiB, cuDNN +18 MiB, math: cuBLAS's (bmm)

The same figures are assumed for every other card and driver (said at the end of a run that reads them).
cudaMemGetInfo's total on that card is 85,017,493,504 B (torch's total_memory; NVML says 81,559 MiB: the driver keeps
480 MiB of it). A real training process there (tests/fixtures/gpu_truth/results.jsonl) held 742 MiB outside torch by
NVML (context, kernels, cuBLAS, cuBLASLt: 740 by this ledger) and 758 MiB with cuDNN attention (758)."""
from __future__ import annotations

MiB = 1 << 20
MEASURED_ON = "an H100 80GB HBM3, driver 580.159.04, torch 2.11 (CUDA 13.0)"
# cudaMemGetInfo's total (= get_device_properties().total_memory) where measured, by torch.cuda.get_device_name()
CUDA_TOTAL = {"NVIDIA H100 80GB HBM3": 85_017_493_504}
CONTEXT = 552_402_944  # torch.cuda.init(): what cudaMemGetInfo counts used on an idle card after it
STAGES = {
    "kernels": 96_468_992,  # the first kernel launched (modules loaded lazily)
    "cublas": 69_206_016,  # the first cuBLAS call: the handle (its workspace is a caching-allocator block)
    "cublaslt": 67_108_864,  # the first cuBLASLt call (addmm with a bias)
    "cudnn_attention": 18 * MiB,
    "efficient_attention": 2 * MiB,
    "flash_attention": 0,
}


def total_memory(card) -> int:
    """cudaMemGetInfo's total for this card: measured where we have it, else the card table's figure."""
    return CUDA_TOTAL.get(getattr(card, "device_name", ""), card.memory)


def outside(stages) -> int:
    """Bytes outside the caching allocator once `stages` have happened (the context always)."""
    return CONTEXT + sum(STAGES.get(s, 0) for s in stages)


def assumption(stages) -> str:
    """The sentence said at the end of a run that read the figure."""
    parts = ["context 526.8 MiB"] + [f"{s.replace('_', ' ')} +{STAGES[s] / MiB:.0f} MiB" for s in
                                       ("kernels", "cublas", "cublaslt", "cudnn_attention", "efficient_attention")
                                       if s in stages and STAGES[s]]
    return (f"the CUDA context and libraries outside the allocator: {outside(stages) / MiB:.1f} MiB ("
            + ", ".join(parts) + f"), measured on {MEASURED_ON}, assumed for this card")
