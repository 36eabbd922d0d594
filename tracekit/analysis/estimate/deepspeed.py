"""DeepSpeed's own model-states estimator (estimate_zero2/zero3_model_states_mem_needs), reproduced.

DeepSpeed counts params + grads + optimizer states only, with a 1.5 buffer
factor on CPU, and prints GiB as "GB". Kept separate from our estimator so
users can compare the two.
"""
from __future__ import annotations

BUFFER_FACTOR = 1.5


def zero2(total_params, gpus_per_node=1, nodes=1, cpu_offload=True, buffer_factor=BUFFER_FACTOR):
    """(cpu bytes, gpu bytes) for ZeRO-2, as DeepSpeed computes them."""
    gpus = nodes * gpus_per_node
    if cpu_offload:
        return int(total_params * max(4 * gpus, 16) * buffer_factor), int(2 * total_params)
    return (int(total_params * 4 * gpus_per_node * buffer_factor),
            int(4 * total_params + int(16 * total_params / gpus)))


def zero3(total_params, largest_layer_params, gpus_per_node=1, nodes=1, offload_optimizer=True,
          offload_param=True, zero_init=True, buffer_factor=BUFFER_FACTOR):
    """(cpu bytes, gpu bytes) for ZeRO-3, as DeepSpeed computes them."""
    gpus = nodes * gpus_per_node
    per_node = 1 / nodes
    largest = 4 * largest_layer_params
    if offload_optimizer:
        k = 18 if offload_param else 16
        gpu = largest if offload_param else largest + int(2 * total_params / gpus)
        factor = k * per_node if zero_init else max(4 * gpus_per_node, k * per_node)
        return int(total_params * factor * buffer_factor), int(gpu)
    gpu = largest + int(18 * total_params / gpus)
    cpu = (largest_layer_params if zero_init else total_params) * 4 * gpus_per_node * buffer_factor
    return int(cpu), int(gpu)


def table(stage, total_params, largest_layer_params=0, gpus_per_node=1, nodes=1) -> list[dict]:
    """The rows DeepSpeed's *_all_live prints: every offload option, bytes per CPU and per GPU."""
    rows = []
    if stage == 3:
        for op, oo in ((True, True), (False, True), (False, False)):
            for zi in (True, False):
                cpu, gpu = zero3(total_params, largest_layer_params, gpus_per_node, nodes, oo, op, zi)
                rows.append({"offload_param": "cpu" if op else "none", "offload_optimizer": "cpu" if oo else "none",
                             "zero_init": int(zi), "per_cpu": cpu, "per_gpu": gpu})
    else:
        for oo in (True, False):
            cpu, gpu = zero2(total_params, gpus_per_node, nodes, oo)
            rows.append({"offload_optimizer": "cpu" if oo else "none", "per_cpu": cpu, "per_gpu": gpu})
    return rows
