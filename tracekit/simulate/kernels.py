"""What CUDA kernels and CUDA autocast would do, emulated on fake CPU tensors (for the simulator, engine.py).

Each rule here is a fact about PyTorch's CUDA code, named where it comes from:

- autocast: the CUDA policy lists of aten/src/ATen/autocast_mode.h (AT_FORALL_LOWER_PRECISION_FP,
  AT_FORALL_FP32, AT_FORALL_FP32_SET_OPT_DTYPE, AT_FORALL_DIFFERENT_REDISPATCH_SIGNATURE,
  AT_FORALL_PROMOTE, banned binary_cross_entropy) and cached_cast's weight cache
  (autocast_mode.cpp): fp32 leaves that require grad are cast once per autocast region.
  torch.autocast("cuda") switches itself off without CUDA, and CPU autocast casts other lists,
  so the CUDA policy is installed as Python kernels on the AutocastCPU key while simulating.
- scaled_dot_product_attention: the backend the CUDA dispatcher picks
  (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp: priority order, cuDNN first on sm90/sm10x,
  each backend's constraints) and what its kernel allocates: cuDNN (_cudnn_attention_forward /
  backward), flash (flash_api.cpp mha_fwd / mha_bwd), memory-efficient (attention.cu,
  attention_backward.cu), math (the composite, run as it is).
- cuBLAS: one workspace per (thread's handle, stream), from the caching allocator, kept for the
  process (CublasHandlePool.cpp getChosenWorkspaceSize: ":4096:8" = 32 MiB on sm90/sm10x/sm12x,
  else ":4096:2:16:8" = 8 MiB + 128 KiB). Forward runs on the Python thread, backward on the
  autograd engine's device thread: two handles, two workspaces in training.
- reductions (sum, mean, amax, norm, argmax...): gpu_reduce_kernel (aten/src/ATen/native/cuda/Reduce.cuh) splits a
  long reduction over several blocks per output when the output is small (setReduceConfig: ctas_per_output > 1) and
  then takes a staging buffer and a semaphore array from the caching allocator for the kernel's length. A Linear's
  bias gradient (the sum over the batch of a [8192, 2048] fp32 gradient) takes 128 MiB + 64 B that way on an H100.
"""
from __future__ import annotations

import contextlib
import math
import weakref

import torch

aten = torch.ops.aten

# -- cuBLAS ------------------------------------------------------------------------------------------------

# aten ops whose CUDA kernels call cuBLAS / cuBLASLt (and so take the thread's handle and its workspace)
GEMM_OPS = frozenset({
    aten.mm.default, aten.addmm.default, aten.bmm.default, aten.baddbmm.default, aten.addbmm.default,
    aten.mv.default, aten.addmv.default, aten.dot.default, aten.vdot.default, aten._addmm_activation.default,
    aten.mm.out, aten.addmm.out, aten.bmm.out, aten.baddbmm.out,
    # under torch.inference_mode a dispatch mode sees linear itself (its addmm / mm run inside the CUDA kernel call)
    aten.linear.default,
})


# cublasLt (addmm with a 1-D bias: CUDABlas gemm_and_bias) has a workspace of its own per thread's handle and
# stream in torch 2.11 (CUBLASLT_WORKSPACE_SIZE, 1024 KiB by default; seen as a 1 MiB block live throughout in
# the H100 recordings of tests/fixtures/cuda)
CUBLASLT_WORKSPACE_BYTES = 1024 * 1024
LT_OPS = frozenset({aten.addmm.default, aten._addmm_activation.default, aten.addmm.out})


def uses_cublaslt(func, args) -> bool:
    if func is aten.linear.default:  # at::linear: addmm(bias, ...) for a 2-D or a contiguous input with a 1-D bias
        if len(args) < 3 or not isinstance(args[0], torch.Tensor) or not isinstance(args[2], torch.Tensor):
            return False
        x, bias = args[0], args[2]
        return bias.dim() == 1 and (x.dim() == 2 or x.is_contiguous()) and \
            bias.dtype in (torch.float32, torch.float16, torch.bfloat16)
    if func not in LT_OPS or not args:
        return False
    bias = args[0]
    return isinstance(bias, torch.Tensor) and bias.dim() == 1 and \
        bias.dtype in (torch.float32, torch.float16, torch.bfloat16)


def cublas_workspace_bytes(sm: tuple) -> int:
    """CublasHandlePool.cpp: 4096 KiB x 8 on Hopper, Blackwell (major 9, 10, 12), else 4096 KiB x 2 + 16 KiB x 8."""
    major = sm[0]
    return 4096 * 8 * 1024 if major in (9, 10, 12) else 4096 * 1024 * 2 + 16 * 1024 * 8


# -- reductions (Reduce.cuh) --------------------------------------------------------------------------------

def _acc_bytes(dtype) -> int:
    """sizeof(acc_type<scalar_t, true>): float for 16- and 32-bit floats, double, int64 for integers and bool."""
    if dtype in (torch.float16, torch.bfloat16, torch.float32):
        return 4
    if dtype is torch.complex64:
        return 8
    if dtype is torch.complex128:
        return 16
    return 8


# op -> how its arg_t (the staging buffer's element) is sized: "acc" the accumulate type, "self" the element, "pair"
# thrust::pair<acc_t, int64_t> (argmax / max.dim)
REDUCTIONS = {
    aten.sum.default: "acc", aten.sum.dim_IntList: "acc", aten.mean.default: "acc", aten.mean.dim: "acc",
    aten.nansum.default: "acc", aten.prod.default: "acc", aten.prod.dim_int: "acc",
    aten.linalg_vector_norm.default: "acc", aten.amax.default: "self", aten.amin.default: "self",
    aten.max.dim: "pair", aten.min.dim: "pair", aten.argmax.default: "pair", aten.argmin.default: "pair",
}
# maxThreadsPerMultiProcessor by compute capability (CUDA's tables)
_THREADS_PER_SM = {(7, 5): 1024, (8, 6): 1536, (8, 7): 1536, (8, 9): 1536, (12, 0): 1536}


def _last_pow2(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _reduce_dims(func, args, kwargs, ndim):
    """The dimensions an op of REDUCTIONS reduces (all of them for a full reduction), or None for none."""
    name = func._schema.name.split("::")[-1]
    ov = func._overloadname
    dim = None
    if name in ("sum", "mean", "nansum") and ov == "dim_IntList" or (name == "mean" and ov == "dim"):
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
    elif name in ("amax", "amin"):
        dim = args[1] if len(args) > 1 else kwargs.get("dim", [])
    elif name == "linalg_vector_norm":
        dim = args[2] if len(args) > 2 else kwargs.get("dim")
    elif name == "prod" and ov == "dim_int" or name in ("max", "min") and ov == "dim":
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
    elif name in ("argmax", "argmin"):
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
    if dim is None or dim == [] or dim == ():
        return set(range(ndim))
    if isinstance(dim, int):
        dim = [dim]
    return {d % ndim if ndim else 0 for d in dim}


def reduce_scratch(func, args, kwargs, sm: tuple, sms: int):
    """The staging buffer and semaphores (bytes) that gpu_reduce_kernel takes for this reduction, or None when
    setReduceConfig keeps every output's reduction within one block (no global reduction).

    TensorIterator's layout first: size-1 dimensions dropped, the reduced dimensions moved in front, each group ordered
    by the input's strides, neighbours coalesced; then setReduceConfig with vt0 = input_vec_size = 4 and
    MAX_NUM_THREADS 512 (every dtype but complex double), the card's multiprocessors and threads per multiprocessor."""
    kind = REDUCTIONS.get(func)
    x = args[0] if args else None
    if kind is None or not isinstance(x, torch.Tensor) or x.numel() == 0 or not sms:
        return None
    elem = x.element_size()
    arg_bytes = {"acc": _acc_bytes(x.dtype), "self": elem, "pair": 16}[kind]
    red = _reduce_dims(func, args, kwargs, x.dim())
    if kind == "pair" and (args[1] if len(args) > 1 else kwargs.get("dim")) is None and func in (
            aten.argmax.default, aten.argmin.default):
        red = set(range(x.dim()))
    dims = [(int(n), int(st), i in red) for i, (n, st) in enumerate(zip(x.shape, x.stride())) if n != 1]
    dims.reverse()  # TensorIterator starts from the fastest (last) dimension
    dims.sort(key=lambda d: (not d[2], d[1]))  # stable: reduced first, then by stride
    merged: list = []
    for n, st, r in dims:
        if merged and merged[-1][2] == r and merged[-1][0] * merged[-1][1] == st:
            pn, pst, _ = merged[-1]
            merged[-1] = (pn * n, pst, r)
        else:
            merged.append((n, st, r))
    nred = sum(1 for d in merged if d[2])
    ndim = len(merged)
    num_outputs = 1
    for n, _, r in merged:
        if not r:
            num_outputs *= n
    inputs_per_output = x.numel() // max(1, num_outputs)
    if ndim and not nred:
        return None  # nothing reduced: a copy
    output_vec = 1
    if ndim == 0:
        on_fastest, fastest, dim0, dim1 = True, 1, 1, 1
    else:
        on_fastest = nred == ndim or merged[0][1] < merged[nred][1]
        if on_fastest:
            dim0, dim1, fastest = inputs_per_output, num_outputs, merged[0][1]
        else:
            dim0, dim1, fastest = num_outputs, inputs_per_output, merged[nred][1]
    if fastest == 1 and ndim:
        if on_fastest and dim0 >= 128 and nred == 1:  # vectorize along the input (input_vec_size 4)
            dim0 //= 4
        elif not on_fastest:
            vec = 4
            for n in [merged[nred][0]] + [st for j, (_, st, _) in enumerate(merged) if j != nred]:
                while n % vec:
                    vec //= 2
            output_vec = vec
            dim0 //= output_vec
    max_threads = 512 // output_vec
    d0 = _last_pow2(dim0) if dim0 < max_threads else max_threads
    d1 = _last_pow2(dim1) if dim1 < max_threads else max_threads
    bw = min(d0, 32)
    bh = min(d1, max_threads // bw)
    bw = min(d0, max_threads // bh)
    threads = bw * bh
    step_in = step_out = 1
    block_x_reduce = ndim == 0 or on_fastest
    if block_x_reduce:
        step_in *= bw
    else:
        step_out *= bw
    if -(-inputs_per_output // step_in) >= min(bh * 16, 256):
        split_warps = True
        step_in *= bh
    else:
        split_warps = False
        step_out *= bh
    per_sm = _THREADS_PER_SM.get(tuple(sm), 2048)
    target = sms * (per_sm // threads)
    grid_x = -(-(num_outputs // output_vec) // step_out)
    vpt = -(-inputs_per_output // step_in)
    if not (split_warps and vpt >= 256 and grid_x <= target):
        return None
    ctas = max(min(-(-target // grid_x), -(-vpt // 16)), -(-vpt // 256))
    if ctas <= 1:
        return None
    size = arg_bytes * num_outputs * ctas
    if not block_x_reduce:
        size *= bw * output_vec
    return size, 4 * grid_x


# -- autocast ----------------------------------------------------------------------------------------------

LOWER_PRECISION_FP = (
    "_convolution.deprecated", "_convolution", "conv1d", "conv2d", "conv3d", "conv_tbc", "conv_transpose1d",
    "conv_transpose2d.input", "conv_transpose3d.input", "convolution", "prelu", "addmm", "addmv", "addr",
    "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm", "chain_matmul",
    "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell", "lstm_cell", "gru_cell",
    "rnn_tanh_cell", "rnn_relu_cell", "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
    # registered beside the list for CUDA (autocast_mode.cpp)
    "cudnn_convolution", "cudnn_convolution_transpose",
)
FP32 = (
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p", "reciprocal", "rsqrt",
    "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar", "softplus", "layer_norm",
    "native_layer_norm", "rms_norm", "group_norm", "frobenius_norm.dim", "nuclear_norm", "nuclear_norm.dim",
    "cosine_similarity", "poisson_nll_loss", "cosine_embedding_loss", "nll_loss", "nll_loss2d",
    "hinge_embedding_loss", "kl_div", "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss",
    "margin_ranking_loss", "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss",
    "multi_margin_loss", "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "upsample_nearest1d", "_upsample_nearest_exact1d", "upsample_nearest2d", "_upsample_nearest_exact2d",
    "upsample_nearest3d", "_upsample_nearest_exact3d", "upsample_linear1d", "upsample_bilinear2d",
    "_upsample_bilinear2d_aa", "upsample_trilinear3d", "upsample_bicubic2d", "_upsample_bicubic2d_aa",
)
FP32_SET_OPT_DTYPE = (
    "prod", "prod.dim_int", "prod.dim_Dimname", "softmax.int", "softmax.Dimname", "log_softmax.int",
    "log_softmax.Dimname", "cumprod", "cumprod.dimname", "cumsum", "cumsum.dimname", "linalg_vector_norm",
    "linalg_matrix_norm", "linalg_matrix_norm.str_ord", "sum", "sum.dim_IntList", "sum.dim_DimnameList",
)
# norm overloads without a dtype redispatch to the overload with one, dtype float (fp32_append_dtype)
FP32_APPEND_DTYPE = {
    "norm.Scalar": "norm.ScalarOpt_dtype",
    "norm.ScalarOpt_dim": "norm.ScalarOpt_dim_dtype",
    "norm.names_ScalarOpt_dim": "norm.names_ScalarOpt_dim_dtype",
}
PROMOTE = ("addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler", "index_put",
           "tensordot", "scatter_add")
BANNED = ("binary_cross_entropy",)


def cuda_policy() -> dict:
    """op name ("mm", "pow.Tensor_Scalar") -> policy."""
    policy = {}
    for names, p in ((LOWER_PRECISION_FP, "lower"), (FP32, "fp32"), (FP32_SET_OPT_DTYPE, "fp32_set_opt_dtype"),
                     (tuple(FP32_APPEND_DTYPE), "fp32_append_dtype"), (PROMOTE, "promote"), (BANNED, "banned")):
        for n in names:
            policy[n] = p
    return policy


def _overload(name: str):
    base, _, ov = name.partition(".")
    packet = getattr(aten, base, None)
    if packet is None:
        return None
    return getattr(packet, ov or "default", None)


def registered_ops(key: str) -> set:
    """Qualified names ("aten::mm", "aten::pow.Tensor_Scalar") with a kernel for dispatch key `key`."""
    return {n for n in torch._C._dispatch_get_all_op_names()
            if n.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(n, key)}


_EXCLUDE_AUTOCAST = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


class CudaAutocast:
    """CUDA autocast's policy, in force on fake CPU tensors while `installed()` is active.

    `region(dtype)` is the `torch.autocast("cuda", dtype)` of the workload: it enables the
    AutocastCPU key (where the policy sits), reports CUDA autocast as enabled to code that asks
    (torch.is_autocast_enabled()), and clears the weight-cast cache when it exits, as CUDA's does.
    `on_cast(True/False)` is called around each cast autocast makes (the simulator names the
    allocation `at::autocast::cached_cast`)."""

    def __init__(self, on_cast=None, is_host=None):
        self.on_cast = on_cast or (lambda active, weight: None)
        self.is_host = is_host or (lambda t: False)
        self.cache = {}  # id(weight) -> (weakref to weight, cast copy)
        self._lib = None

    @property
    def dtype(self):
        """The running autocast region's dtype (CPU autocast's key carries the CUDA policy)."""
        return torch.get_autocast_dtype("cpu")

    # -- the casts -----------------------------------------------------------------------------------------
    def eligible(self, t) -> bool:
        return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64 \
            and not self.is_host(t)

    def cached_cast(self, to_type, arg):
        """autocast_mode.cpp cached_cast, for a Tensor, an optional Tensor or a list of them."""
        if isinstance(arg, (list, tuple)):
            return type(arg)(self.cached_cast(to_type, a) for a in arg)
        if not self.eligible(arg) or arg.dtype == to_type:
            return arg
        can_cache = (to_type == self.dtype and arg.dtype == torch.float32 and arg.requires_grad and arg.is_leaf
                     and not arg._is_view() and torch.is_autocast_cache_enabled())
        if can_cache:
            hit = self.cache.get(id(arg))
            if hit is not None and hit[0]() is arg:
                return hit[1]
        self.on_cast(True, can_cache)
        try:
            casted = arg.to(to_type)
        finally:
            self.on_cast(False, can_cache)
        if can_cache:
            self.cache[id(arg)] = (weakref.ref(arg), casted)
        return casted

    def cast_all(self, to_type, args, kwargs):
        """Cast every argument, last first: the wrappers call (*F)(cached_cast(args)...), and GCC evaluates a
        call's arguments right to left (the H100 recordings show a linear's bias cast, then its weight, then
        its input)."""
        names = list(kwargs)
        cast_kw = {n: self.cached_cast(to_type, kwargs[n]) for n in reversed(names)}
        cast_args = [self.cached_cast(to_type, a) for a in reversed(args)][::-1]
        return cast_args, {n: cast_kw[n] for n in names}

    def promote_type(self, args) -> torch.dtype:
        current = self.dtype
        for a in _tensors(args):
            if self.eligible(a):
                if a.dtype == torch.float32 or current == torch.float32:
                    current = torch.float32
        return current

    def kernel(self, name: str, policy: str):
        op = _overload(name)
        exclude = _EXCLUDE_AUTOCAST
        if policy in ("lower", "fp32"):
            def k(*args, **kwargs):
                to = self.dtype if policy == "lower" else torch.float32
                with torch._C._ExcludeDispatchKeyGuard(exclude):
                    args, kwargs = self.cast_all(to, args, kwargs)
                    return op(*args, **kwargs)
        elif policy == "fp32_set_opt_dtype":
            names = [a.name for a in op._schema.arguments]
            at = names.index("dtype") if "dtype" in names else None

            def k(*args, **kwargs):
                with torch._C._ExcludeDispatchKeyGuard(exclude):
                    if args and self.eligible(args[0]) and at is not None:  # set_opt_dtype: unless given, float
                        if at < len(args):
                            if args[at] is None:
                                args = args[:at] + (torch.float32,) + args[at + 1:]
                        elif kwargs.get("dtype") is None:
                            kwargs = dict(kwargs, dtype=torch.float32)
                    return op(*args, **kwargs)
        elif policy == "fp32_append_dtype":
            target = _overload(FP32_APPEND_DTYPE[name])

            def k(*args, **kwargs):
                with torch._C._ExcludeDispatchKeyGuard(exclude):
                    first = args[0] if args else None
                    dtype = torch.float32 if self.eligible(first) else first.dtype
                    return target(*args, **kwargs, dtype=dtype)
        elif policy == "promote":
            def k(*args, **kwargs):
                with torch._C._ExcludeDispatchKeyGuard(exclude):
                    to_type = self.promote_type(list(args) + list(kwargs.values()))
                    args, kwargs = self.cast_all(to_type, args, kwargs)
                    return op(*args, **kwargs)
        elif policy == "banned":
            def k(*args, **kwargs):
                raise RuntimeError(f"torch.nn.functional.{name} and torch.nn.{name} are unsafe to autocast "
                                   "(CUDA autocast refuses them): use binary_cross_entropy_with_logits")
        else:  # CPU autocast has it, CUDA autocast does not: run it as it comes
            def k(*args, **kwargs):
                with torch._C._ExcludeDispatchKeyGuard(exclude):
                    return op(*args, **kwargs)
        return k

    # -- installation ----------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def installed(self):
        """Python kernels on AutocastCPU: CUDA's policy for CUDA's ops, pass-through for CPU-only ones."""
        import warnings
        policy = cuda_policy()
        cpu_only = {n[len("aten::"):] for n in registered_ops("AutocastCPU")} - set(policy)
        lib = torch.library.Library("aten", "IMPL")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                for name, p in policy.items():
                    if _overload(name) is not None:
                        lib.impl(name, self.kernel(name, p), "AutocastCPU")
                for name in cpu_only:
                    if _overload(name) is not None:
                        lib.impl(name, self.kernel(name, "passthrough"), "AutocastCPU")
            self._lib = lib
            clear = torch.clear_autocast_cache

            def clear_both():  # torch.autocast.__exit__ at nesting 0 (checkpoint recomputes included)
                self.cache.clear()
                clear()
            torch.clear_autocast_cache = clear_both
            try:
                yield self
            finally:
                torch.clear_autocast_cache = clear
        finally:
            self._lib = None
            lib._destroy()
            self.cache.clear()

    @contextlib.contextmanager
    def region(self, dtype):
        """`with torch.autocast("cuda", dtype=dtype):` as CUDA would run it."""
        was_cuda = (torch.is_autocast_enabled("cuda"), torch.get_autocast_dtype("cuda"))
        torch.set_autocast_enabled("cuda", True)
        torch.set_autocast_dtype("cuda", dtype)
        try:
            with torch.autocast("cpu", dtype=dtype):
                try:
                    yield
                finally:
                    self.cache.clear()  # autocast's __exit__ clears the cache at nesting 0
        finally:
            torch.set_autocast_enabled("cuda", was_cuda[0])
            torch.set_autocast_dtype("cuda", was_cuda[1])

    def active(self) -> bool:
        return self._lib is not None and torch.is_autocast_enabled("cpu")


def _tensors(args):
    for a in args:
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            yield from (x for x in a if isinstance(x, torch.Tensor))


# -- scaled_dot_product_attention ----------------------------------------------------------------------------

CUDNN, FLASH, EFFICIENT, MATH = "cudnn_attention", "flash_attention", "efficient_attention", "math"


def priority_order(sm: tuple) -> tuple:
    """sdp_utils.cpp priority_order: cuDNN first on sm90 / sm10x (check_prefer_cudnn_attention, cuDNN > 9.15,
    the CUDA 13 wheels), else flash, efficient, math, cuDNN."""
    if sm[0] in (9, 10):
        return (CUDNN, FLASH, EFFICIENT, MATH)
    return (FLASH, EFFICIENT, MATH, CUDNN)


def _requires_grad(q, k, v) -> bool:
    return torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))


def _heads_ok(q, k, v, enable_gqa) -> bool:
    """check_batch_size_and_num_heads_dense: equal batch; equal heads, or q heads a multiple of k heads with
    enable_gqa (grouped-query attention)."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return False
    if not (q.size(0) == k.size(0) == v.size(0)):
        return False
    hq, hk, hv = q.size(1), k.size(1), v.size(1)
    if hq == hk == hv:
        return True
    return bool(enable_gqa) and hk == hv and hq % hk == 0


def can_use(backend, sm, q, k, v, mask, dropout, is_causal, enable_gqa) -> bool:
    half = q.dtype in (torch.float16, torch.bfloat16)
    dq, dk, dv = q.size(-1), k.size(-1), v.size(-1)
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        return backend == MATH
    if min(q.size(-2), k.size(-2)) == 0:
        return backend == MATH
    if backend == MATH:
        return True
    if not _heads_ok(q, k, v, enable_gqa):
        return False
    if backend == CUDNN:
        if not (sm[0] >= 8 and half) or sm > (12, 1):
            return False
        if dropout * 16.0 != math.floor(dropout * 16.0):
            return False
        if q.size(0) > 65535 or q.size(1) > 65535:
            return False
        limit = 256 if sm[0] in (9, 10) else 128  # cuDNN >= 9.22 with d256 support on sm90 / sm10x
        if dq > limit or dv > limit or dq % 8 or dv % 8 or k.size(-2) == 1:
            return False
        if _requires_grad(q, k, v) and sm[0] in (9, 10):  # check_cudnn_d256_bprop_head_dim
            if not ((dq <= 128 and dv <= 128) or (dq, dv) in ((192, 128), (256, 256))):
                return False
        return True
    if backend == FLASH:
        if mask is not None or not half or not ((8, 0) <= sm <= (12, 1)):
            return False
        if not (dq == dk == dv and dq <= 256):
            return False
        if _requires_grad(q, k, v) and ((8, 6) <= sm <= (8, 9) or (12, 0) <= sm <= (12, 1)):
            if not (dq <= 192 or (dropout == 0 and dq > 224)):
                return False
        if is_causal and q.size(-2) != k.size(-2):
            return False
        return True
    if backend == EFFICIENT:
        if not ((5, 0) <= sm <= (12, 1)):
            return False
        allowed = (torch.float16, torch.float32, torch.bfloat16) if sm[0] >= 8 else (torch.float16, torch.float32)
        if q.dtype not in allowed:
            return False
        align = (8 if half else 4) if sm[0] >= 8 else (8 if half and sm[0] >= 7 else 1)
        if dq != dk or dq % align or dv % align:
            return False
        return True
    return False


def enabled(backend) -> bool:
    """torch.backends.cuda's switches (torch.nn.attention.sdpa_kernel sets them)."""
    b = torch.backends.cuda
    try:
        return {CUDNN: b.cudnn_sdp_enabled, FLASH: b.flash_sdp_enabled, EFFICIENT: b.mem_efficient_sdp_enabled,
                MATH: b.math_sdp_enabled}[backend]()
    except Exception:
        return True


def select_backend(sm, q, k, v, mask, dropout, is_causal, enable_gqa) -> str:
    for b in priority_order(sm):
        if enabled(b) and can_use(b, sm, q, k, v, mask, dropout, is_causal, enable_gqa):
            return b
    return MATH


def _round_up(n, m):
    return (n + m - 1) // m * m


def _empty_like(t, dtype=None):
    return torch.empty_like(t, dtype=dtype or t.dtype)


def _bshd(t):
    """A (B, H, S, D) tensor's memory as (B, S, H, D), the layout the fused kernels write (a view back)."""
    b, h, s, d = t.shape
    return torch.empty((b, s, h, d), dtype=t.dtype, device=t.device).transpose(1, 2)


NODE_NAMES = {CUDNN: "ScaledDotProductCudnnAttention", FLASH: "ScaledDotProductFlashAttention",
              EFFICIENT: "ScaledDotProductEfficientAttention"}


def attention_function(backend: str, name_op):
    """An autograd Function making the allocations of the CUDA kernel `backend` (forward and backward) on fake
    tensors and saving what the real autograd node saves (its backward node is named like torch's, less the
    trailing 0)."""

    def forward(ctx, q, k, v, mask, dropout, is_causal, scale, enable_gqa):
        lse_needed = any(ctx.needs_input_grad[:3])
        if backend == CUDNN:  # _cudnn_attention_forward: philox seed and offset on the device, out like q
            with name_op("_scaled_dot_product_cudnn_attention"):
                seed = torch.empty((), dtype=torch.int64, device=q.device)
                offset = torch.empty((), dtype=torch.int64, device=q.device)
                out = _empty_like(q)
                lse = torch.empty((q.size(0), q.size(1), q.size(2), 1), dtype=torch.float32,
                                  device=q.device) if lse_needed else None
            saved = [seed, offset, lse]
        elif backend == FLASH:  # mha_fwd: out like q in (B, S, H, D); seed / offset are CPU scalars
            with name_op("_scaled_dot_product_flash_attention"):
                out = _empty_like(q.transpose(1, 2)).transpose(1, 2)
                lse = torch.empty((q.size(0), q.size(1), q.size(2)), dtype=torch.float32, device=q.device)
            saved = [lse]
        else:  # _efficient_attention_forward: res (B, M, H, Kv); logsumexp padded to 32 queries
            with name_op("_scaled_dot_product_efficient_attention"):
                out = _bshd(q)
                lse = torch.empty((q.size(0), q.size(1), _round_up(q.size(2), 32) if lse_needed else 0),
                                  dtype=torch.float32, device=q.device)
                if q.dtype != torch.float32 and q.size(-1) > 128:  # kNeedsOutputAccumulatorBuffer
                    acc = torch.empty(out.shape, dtype=torch.float32, device=q.device)
                    del acc
            saved = [lse]
        extra = [t for t in saved if t is not None] + ([mask] if mask is not None else [])
        ctx.save_for_backward(q, k, v, out, *extra)
        return out

    def backward(ctx, grad_out):
        q, k, v = ctx.saved_tensors[:3]
        if backend == CUDNN:  # _cudnn_attention_backward: dq, dk, dv like q, k, v
            with name_op("_scaled_dot_product_cudnn_attention_backward"):
                dq, dk, dv = _empty_like(q), _empty_like(k), _empty_like(v)
        elif backend == FLASH:  # mha_bwd
            with name_op("_scaled_dot_product_flash_attention_backward"):
                b, hq, sq, d = q.shape
                hk, sk = k.size(1), k.size(2)
                dq = _empty_like(q.transpose(1, 2)).transpose(1, 2)
                dk = _empty_like(k.transpose(1, 2)).transpose(1, 2)
                dv = _empty_like(v.transpose(1, 2)).transpose(1, 2)
                sq_r = _round_up(sq, 128)
                d_r = _round_up(d, 32) if d <= 192 else 256
                softmax_d = torch.empty((b, hq, sq_r), dtype=torch.float32, device=q.device)
                dq_accum = torch.empty((b, sq_r, hq, d_r), dtype=torch.float32, device=q.device)
                if hk != hq:  # dk / dv for every query head, then summed into the kv heads
                    dk_exp = torch.empty((b, sk, hq, d), dtype=q.dtype, device=q.device)
                    dv_exp = torch.empty((b, sk, hq, v.size(-1)), dtype=q.dtype, device=q.device)
                    del dk_exp, dv_exp
                del softmax_d, dq_accum
        else:  # _efficient_attention_backward
            with name_op("_scaled_dot_product_efficient_attention_backward"):
                dq = torch.empty_strided(q.shape, q.stride(), dtype=q.dtype, device=q.device)
                dk = torch.empty_strided(k.shape, k.stride(), dtype=k.dtype, device=k.device)
                dv = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device)
                b, h, sq, d = q.shape
                delta = torch.empty((b, h, sq), dtype=torch.float32, device=q.device)
                ws = None
                if q.dtype != torch.float32:  # gradQ accumulated in fp32 (kNeedsAccumGradQ)
                    ws = torch.empty((b, h, _round_up(sq, 64), d), dtype=torch.float32, device=q.device)
                del delta, ws
        return dq, dk, dv, None, None, None, None, None

    name = NODE_NAMES.get(backend, "ScaledDotProductAttention")
    return type(name, (torch.autograd.Function,),
                {"forward": staticmethod(forward), "backward": staticmethod(backward)})


class CudaComposites:
    """scaled_dot_product_attention and dropout as their CUDA composites run them, installed as Python kernels on
    CompositeImplicitAutograd while `installed()` is active (dispatcher-level, so they also hold inside the
    autograd engine, where checkpointing re-runs the forward and Python's function modes are off).

    - scaled_dot_product_attention (attention.cpp): the backend select_sdp_backend picks for this GPU, the
      boolean mask made additive (convert_boolean_attn_mask), the efficient kernel's mask padded to 16
      (preprocess_mask), then the backend's own allocations (attention_function). Autocast has cast q, k, v
      before (the lower-precision policy on AutocastCPU).
    - dropout (Dropout.cpp): on CUDA 0 < p < 1 takes the fused native_dropout, which saves a bool mask; CPU's
      composite multiplies by a noise tensor of the input's dtype."""

    def __init__(self, sm, name_op):
        self.sm, self.name_op = sm, name_op
        self.functions = {}
        self.used = {}

    def sdpa(self, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, *, scale=None,
             enable_gqa=False):
        backend = select_backend(self.sm, query, key, value, attn_mask, dropout_p, is_causal, enable_gqa)
        self.used[backend] = self.used.get(backend, 0) + 1
        if backend == MATH:
            return aten._scaled_dot_product_attention_math(query, key, value, attn_mask, dropout_p, is_causal, None,
                                                           scale=scale, enable_gqa=enable_gqa)[0]
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            with self.name_op("scaled_dot_product_attention"):
                zero = torch.scalar_tensor(0.0, dtype=query.dtype, device=attn_mask.device)
                attn_mask = torch.where(attn_mask.logical_not(), float("-inf"), zero)
        if attn_mask is not None and backend == EFFICIENT and attn_mask.size(-1) % 16:
            with self.name_op("scaled_dot_product_attention"):
                s = attn_mask.size(-1)
                attn_mask = torch.nn.functional.pad(attn_mask, (0, _round_up(s, 16) - s))[..., :s]
        fn = self.functions.get(backend)
        if fn is None:
            fn = self.functions[backend] = attention_function(backend, self.name_op)
        return fn.apply(query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa)

    @staticmethod
    def dropout(input, p, train):
        if not train or p == 0 or input.numel() == 0:
            return input
        if p == 1:
            return input.mul(torch.zeros((), dtype=input.dtype, device=input.device))
        if input.is_floating_point() and 0 < p < 1:
            return aten.native_dropout(input, p, train)[0]
        noise = torch.empty_like(input).bernoulli_(1 - p).div_(1 - p)
        return input * noise

    @contextlib.contextmanager
    def installed(self):
        import warnings
        lib = torch.library.Library("aten", "IMPL")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                lib.impl("scaled_dot_product_attention", self.sdpa, "CompositeImplicitAutograd")
                lib.impl("dropout", self.dropout, "CompositeImplicitAutograd")
            yield self
        finally:
            lib._destroy()
