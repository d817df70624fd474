"""What the real code decides because its tensors are on a CUDA GPU, reproduced for fake tensors
on the CPU.

PyTorch's autograd engine cannot run a backward over fake CUDA tensors on a machine without a
GPU (`GraphTask::stash_current_streams` asks the CUDA driver for a primary context), so the
tracer keeps its fake tensors on the CPU device and makes the decisions that would differ
take CUDA's branch:

- **Autocast.** `torch.autocast("cuda", ...)` enables CPU autocast with the same dtype, and every
  operator with a CPU autocast kernel gets CUDA's policy instead (`autocast_mode.cpp`): lower
  precision for GEMMs and attention, fp32 for the numerically sensitive ops, an fp32 `dtype`
  for reductions and softmax, the widest type for the promoting ops, pass-through for operators
  only CPU autocast lists (`cat`, `stack`, `cross_entropy_loss`, ...). Leaf fp32 weights cast to
  the lower precision are cached until the outermost autocast region exits, as
  `cached_cast` does.
- **Attention.** `F.scaled_dot_product_attention` picks the kernel an sm90 GPU would (flash,
  cuDNN, memory-efficient or math, as `select_sdp_backend` does in torch 2.11) and calls that
  kernel's operator, whose fake implementation gives CUDA's outputs and whose backward is
  CUDA's.
- **Dropout.** `F.dropout` in training takes CUDA's fused `native_dropout` (a bool mask), not
  the CPU's composite (a mask in the input's dtype).
- **Grouped GEMMs.** `torch._grouped_mm` of fp32 or fp16 matrices (the experts under `amp-bf16`,
  whose weights stay fp32) runs on CUDA, through the per-group `mm_out` fallback into the same
  output; torch's meta function, written for the bf16 CUTLASS kernel, refuses them.
- **Optimizers.** `torch.optim` takes its foreach and fused paths for fake CPU tensors as for
  CUDA ones (the per-parameter loop allocates different temporaries).
"""

from __future__ import annotations

import contextlib

LOWER_PRECISION = {
    "_convolution", "_convolution.deprecated", "conv1d", "conv2d", "conv3d", "conv_tbc",
    "conv_transpose1d", "conv_transpose2d.input", "conv_transpose3d.input", "convolution",
    "cudnn_convolution", "cudnn_convolution_transpose", "_cudnn_rnn", "prelu", "addmm", "addmv",
    "addr", "matmul", "einsum", "mm", "mv", "linalg_vecdot", "linear", "addbmm", "baddbmm", "bmm",
    "chain_matmul", "linalg_multi_dot", "_thnn_fused_lstm_cell", "_thnn_fused_gru_cell",
    "lstm_cell", "gru_cell", "rnn_tanh_cell", "rnn_relu_cell",
    "_scaled_dot_product_flash_attention", "scaled_dot_product_attention",
}  # fmt: skip
FP32 = {
    "acos", "asin", "cosh", "erfinv", "exp", "expm1", "log", "log10", "log2", "log1p",
    "reciprocal", "rsqrt", "sinh", "tan", "pow.Tensor_Scalar", "pow.Tensor_Tensor", "pow.Scalar",
    "softplus", "layer_norm", "native_layer_norm", "group_norm", "frobenius_norm.dim",
    "nuclear_norm", "nuclear_norm.dim", "cosine_similarity", "poisson_nll_loss",
    "cosine_embedding_loss", "nll_loss", "nll_loss2d", "hinge_embedding_loss", "kl_div",
    "l1_loss", "smooth_l1_loss", "huber_loss", "mse_loss", "margin_ranking_loss",
    "multilabel_margin_loss", "soft_margin_loss", "triplet_margin_loss", "multi_margin_loss",
    "binary_cross_entropy_with_logits", "dist", "pdist", "cdist", "renorm", "logsumexp",
    "upsample_nearest1d", "upsample_nearest2d", "upsample_nearest3d", "_upsample_nearest_exact1d",
    "_upsample_nearest_exact2d", "_upsample_nearest_exact3d", "upsample_linear1d",
    "upsample_bilinear2d", "_upsample_bilinear2d_aa", "upsample_trilinear3d",
    "upsample_bicubic2d", "_upsample_bicubic2d_aa",
    # `norm` appends an fp32 dtype (fp32_append_dtype); casting its input to fp32 first is the
    # same memory to within the input's fp32 copy, and no traced model calls it.
    "norm.Scalar", "norm.ScalarOpt_dim", "norm.names_ScalarOpt_dim",
}  # fmt: skip
FP32_SET_OPT_DTYPE = {
    "prod", "prod.dim_int", "prod.dim_Dimname", "softmax.int", "softmax.Dimname",
    "log_softmax.int", "log_softmax.Dimname", "cumprod", "cumprod.dimname", "cumsum",
    "cumsum.dimname", "linalg_vector_norm", "linalg_matrix_norm", "linalg_matrix_norm.str_ord",
    "sum", "sum.dim_IntList", "sum.dim_DimnameList",
}  # fmt: skip
PROMOTE = {
    "addcdiv", "addcmul", "atan2", "bilinear", "cross", "dot", "vdot", "grid_sampler",
    "index_put", "tensordot", "scatter_add",
}  # fmt: skip
BANNED = {"binary_cross_entropy"}


class EmulationError(RuntimeError):
    """This torch's CUDA autocast lists an operator the emulation has no policy for, or the traced
    code calls another library's operator whose CUDA autocast kernel the emulation does not have."""


def _policies() -> dict[str, str]:
    table = {}
    for names, policy in (
        (LOWER_PRECISION, "lower"),
        (FP32, "fp32"),
        (FP32_SET_OPT_DTYPE, "set_opt_dtype"),
        (PROMOTE, "promote"),
        (BANNED, "banned"),
    ):
        for name in names:
            table[name] = policy
    return table


class _CastCache:
    """`cached_cast`'s cache: a leaf fp32 tensor that requires grad is cast once per autocast
    region; the cast lives until the outermost region exits."""

    def __init__(self):
        self.casts: dict[int, tuple] = {}

    def cast(self, torch, t, dtype):
        cacheable = (
            dtype != torch.float32
            and t.dtype == torch.float32
            and t.requires_grad
            and t.is_leaf
            and not t._is_view()
            and torch.is_autocast_cache_enabled()
        )
        if not cacheable:
            return t.to(dtype)
        key = id(t)
        hit = self.casts.get(key)
        if hit is not None and hit[0]() is t:
            return hit[1]
        import weakref

        out = t.to(dtype)
        self.casts[key] = (weakref.ref(t), out)
        return out

    def clear(self):
        self.casts.clear()


def _eligible(torch, x) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64


class CudaEmulation:
    """Installs CUDA's decisions for the life of a `with` block."""

    def __init__(self):
        self._stack = contextlib.ExitStack()
        self.cache = _CastCache()

    def __enter__(self):
        import torch

        self._install_autocast(torch)
        self._install_optimizer_defaults(torch)
        self._stack.enter_context(_SdpaPatch())
        self._stack.enter_context(_DropoutPatch())
        self._stack.enter_context(_GroupedMmPatch())
        self._stack.enter_context(_RmsNormPatch())
        return self

    def __exit__(self, *exc):
        return self._stack.__exit__(*exc)

    # -- autocast ---------------------------------------------------------------------------

    def _install_autocast(self, torch):
        """Every operator with a CPU or CUDA autocast kernel gets CUDA's policy as its CPU one.
        ATen's follow the tables above; other libraries' CUDA autocast kernels (torchvision's
        `roi_align`, `nms`, ...: inputs cast to fp32) are not emulated, so calling one under
        autocast is refused by name, and installing them changes nothing for code that does not."""
        policies = _policies()
        cuda_ops = set(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCUDA"))
        cpu_ops = set(torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU"))
        unknown = sorted(n.removeprefix("aten::") for n in cuda_ops if n.startswith("aten::") and n[6:] not in policies)
        if unknown:
            raise EmulationError(
                f"torch {torch.__version__}'s CUDA autocast lists operators headroom's tracer has no policy for: "
                f"{', '.join(unknown)}"
            )
        libraries = {}
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "overriding a previously registered kernel"
            for qualified in sorted(cuda_ops | cpu_ops):
                namespace, _, name = qualified.partition("::")
                if qualified not in cuda_ops:
                    policy = "pass"
                elif namespace == "aten":
                    policy = policies[name]
                else:
                    policy = "foreign"
                if namespace not in libraries:
                    libraries[namespace] = torch.library.Library(namespace, "IMPL")
                    self._stack.callback(libraries[namespace]._destroy)
                kernel = self._kernel(torch, qualified, policy)
                # over the library's own kernel, which comes back when `libraries` are destroyed
                libraries[namespace].impl(name, kernel, "AutocastCPU", allow_override=True)

        real_init = torch.amp.autocast_mode.autocast.__init__
        real_clear = torch.clear_autocast_cache
        cache = self.cache

        def init(self_, device_type, *args, **kwargs):
            if device_type == "cuda":
                device_type = "cpu"
            real_init(self_, device_type, *args, **kwargs)

        def clear():
            cache.clear()
            real_clear()

        torch.amp.autocast_mode.autocast.__init__ = init
        torch.clear_autocast_cache = clear
        self._stack.callback(setattr, torch.amp.autocast_mode.autocast, "__init__", real_init)
        self._stack.callback(setattr, torch, "clear_autocast_cache", real_clear)

    def _kernel(self, torch, qualified: str, policy: str):
        namespace, _, name = qualified.partition("::")
        base, _, overload = name.partition(".")
        op = getattr(getattr(getattr(torch.ops, namespace), base), overload or "default")
        exclude = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)
        cache = self.cache
        from torch.utils._pytree import tree_map

        names = [a.name for a in op._schema.arguments]
        dtype_at = names.index("dtype") if "dtype" in names else len(names)

        def below(*args, **kwargs):
            with torch._C._ExcludeDispatchKeyGuard(exclude):
                return op(*args, **kwargs)

        if policy == "pass":
            return below
        if policy == "banned":

            def banned(*args, **kwargs):
                raise RuntimeError(f"{name} is unsafe to autocast (torch raises the same on CUDA)")

            return banned
        if policy == "foreign":

            def foreign(*args, **kwargs):
                raise EmulationError(
                    f"`{qualified}` runs under CUDA autocast with its library's own casts, which headroom's tracer "
                    "does not emulate"
                )

            return foreign

        def kernel(*args, **kwargs):
            with torch._C._ExcludeDispatchKeyGuard(exclude):
                if policy == "set_opt_dtype":
                    first = next((a for a in args if isinstance(a, torch.Tensor)), None)
                    if first is not None and _eligible(torch, first):
                        if dtype_at < len(args):
                            if args[dtype_at] is None:
                                args = (*args[:dtype_at], torch.float32, *args[dtype_at + 1 :])
                        elif kwargs.get("dtype") is None:
                            kwargs = {**kwargs, "dtype": torch.float32}
                    return op(*args, **kwargs)
                if policy == "lower":
                    target = torch.get_autocast_dtype("cpu")
                elif policy == "fp32":
                    target = torch.float32
                else:  # promote: the widest eligible floating type
                    lower = torch.get_autocast_dtype("cpu")
                    tensors = [a for a in (*args, *kwargs.values()) if _eligible(torch, a)]
                    target = torch.float32 if any(t.dtype == torch.float32 for t in tensors) else lower

                def cast(x):
                    if _eligible(torch, x) and x.dtype != target:
                        return cache.cast(torch, x, target)
                    return x

                return op(*tree_map(cast, args), **tree_map(cast, kwargs))

        return kernel

    # -- optimizers -------------------------------------------------------------------------

    def _install_optimizer_defaults(self, torch):
        import torch.optim.optimizer as optimizer
        from torch._subclasses.fake_tensor import FakeTensor

        # Parameters over fake tensors are of the subclass's type, which `torch.optim` does not
        # take for its foreach and fused kernels.
        optimizer._foreach_supported_types.append(FakeTensor)
        self._stack.callback(optimizer._foreach_supported_types.remove, FakeTensor)
        for attr in ("_get_foreach_kernels_supported_devices", "_get_fused_kernels_supported_devices"):
            real = getattr(optimizer, attr)
            setattr(optimizer, attr, lambda real=real: [*real(), "cpu"])
            self._stack.callback(setattr, optimizer, attr, real)


def select_attention_kernel(query, key, value, attn_mask, enable_gqa: bool) -> str:
    """The kernel torch 2.11's `select_sdp_backend` picks on an sm90 GPU: flash for half
    precision without a mask (one head dim for queries, keys and values, a multiple of 8 up to
    256), cuDNN for half precision with one, and for latent attention's 192-wide query and key
    heads with 128-wide values, which cuDNN takes on sm90 (`check_cudnn_tensor_shapes`) and flash
    does not; memory-efficient for the rest it supports, math otherwise."""
    import torch

    head_dim, value_dim = query.shape[-1], value.shape[-1]
    half = query.dtype in (torch.float16, torch.bfloat16)
    one_dim = value_dim == head_dim
    masked = attn_mask is not None
    gqa = enable_gqa and key.shape[-3] != query.shape[-3]
    if half and one_dim and not masked and head_dim <= 256 and head_dim % 8 == 0:
        return "flash"
    if half and ((one_dim and masked and head_dim <= 256) or (head_dim, value_dim) == (192, 128)):
        return "cudnn"
    if not gqa and head_dim % 4 == 0:
        return "efficient"
    return "math"


def cuda_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """`F.scaled_dot_product_attention` as CUDA's composite runs it: autocast's cast, then the
    chosen kernel's operator (which autograd records with CUDA's backward)."""
    import torch

    if torch.is_autocast_enabled("cpu"):
        lower = torch.get_autocast_dtype("cpu")
        query, key, value = (t.to(lower) if t.dtype == torch.float32 else t for t in (query, key, value))
        if attn_mask is not None and attn_mask.is_floating_point() and attn_mask.dtype == torch.float32:
            attn_mask = attn_mask.to(lower)
    kernel = select_attention_kernel(query, key, value, attn_mask, enable_gqa)
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        # `convert_boolean_attn_mask`: the kernels take an additive mask in the query's dtype,
        # `where(mask, 0, -inf)` over the mask's shape (cuDNN's variant fills a finite minimum).
        fill = torch.scalar_tensor(float("-inf"), dtype=query.dtype, device=attn_mask.device)
        attn_mask = torch.where(attn_mask, 0.0, fill)
        del fill
    with torch.autocast("cpu", enabled=False):
        if kernel == "flash":
            return torch.ops.aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, False, scale=scale
            )[0]
        needs_grad = any(t.requires_grad for t in (query, key, value))
        if kernel == "cudnn":
            return torch.ops.aten._scaled_dot_product_cudnn_attention(
                query, key, value, attn_mask, needs_grad, dropout_p, is_causal, False, scale=scale
            )[0]
        if kernel == "efficient":
            return torch.ops.aten._scaled_dot_product_efficient_attention(
                query, key, value, attn_mask, needs_grad, dropout_p, is_causal, scale=scale
            )[0]
        return torch.ops.aten._scaled_dot_product_attention_math(
            query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
        )[0]


class _SdpaPatch:
    """Routes `F.scaled_dot_product_attention` to `cuda_sdpa`. A patch rather than a
    `TorchFunctionMode`: the autograd engine does not carry function modes into the backward,
    where checkpointing recomputes the forward."""

    def __enter__(self):
        import torch.nn.functional as F

        self._real = F.scaled_dot_product_attention

        def scaled_dot_product_attention(*args, **kwargs):
            return cuda_sdpa(*args, **kwargs)

        # Named as torch's: context parallelism patches `F.<its __name__>` with the ring.
        F.scaled_dot_product_attention = scaled_dot_product_attention
        return self

    def __exit__(self, *exc):
        import torch.nn.functional as F

        F.scaled_dot_product_attention = self._real
        return False


class _DropoutPatch:
    """`F.dropout` as `at::dropout` runs it on a CUDA tensor (`is_fused_kernel_acceptable`):
    `native_dropout` for 0 < p < 1 in training, which keeps a bool mask for the backward."""

    def __enter__(self):
        import torch
        import torch.nn.functional as F

        self._real = real = F.dropout

        def dropout(input, p=0.5, training=True, inplace=False):
            if training and 0 < p < 1 and not inplace and input.numel() > 0:
                return torch.native_dropout(input, p, True)[0]
            return real(input, p, training, inplace)

        F.dropout = dropout
        return self

    def __exit__(self, *exc):
        import torch.nn.functional as F

        F.dropout = self._real
        return False


class _RmsNormPatch:
    """`F.rms_norm` (`torch.nn.RMSNorm`) as `rms_norm_symint` runs it on a CUDA tensor: one fused kernel,
    `_fused_rms_norm`, whose outputs are the normalized tensor (the input's dtype) and the per-row inverse
    RMS (`rstd`, fp32, the normalized dimensions kept as 1s), both saved for its backward,
    `_fused_rms_norm_backward`, which makes the input's and the weight's gradients in their dtypes. On the
    CPU the op decomposes into fp32 temporaries of the whole input (the upcast, `pow`, `mul`) that CUDA never
    makes."""

    def __enter__(self):
        import torch
        import torch.nn.functional as F

        self._real = F.rms_norm

        class FusedRmsNorm(torch.autograd.Function):
            @staticmethod
            def forward(ctx, input, weight, dims: int):
                out = torch.empty_like(input, memory_format=torch.contiguous_format)
                rstd = input.new_empty((*input.shape[: input.dim() - dims], *([1] * dims)), dtype=torch.float32)
                ctx.save_for_backward(input, weight, rstd)
                return out

            @staticmethod
            def backward(ctx, grad):
                input, weight, rstd = ctx.saved_tensors
                grad_input = torch.empty_like(input, memory_format=torch.contiguous_format)
                grad_weight = torch.empty_like(weight) if weight is not None and ctx.needs_input_grad[1] else None
                return grad_input, grad_weight, None

        def rms_norm(input, normalized_shape, weight=None, eps=None):
            return FusedRmsNorm.apply(input, weight, len(normalized_shape))

        F.rms_norm = rms_norm
        return self

    def __exit__(self, *exc):
        import torch.nn.functional as F

        F.rms_norm = self._real
        return False


class _GroupedMmPatch:
    """`torch._grouped_mm`'s fake implementation as `_grouped_mm_cuda` decides (GroupedBlas.cpp,
    GroupedMMUtils.h): matrices of one dtype among bf16, fp16 and fp32, bf16 on the CUTLASS kernel
    and the others through `_grouped_mm_fallback`, whose `mm_out` per group writes into the output
    `create_grouped_gemm_output_tensor` made, of `mat_a`'s dtype. torch's meta function refuses all
    but bf16; it looks up `_meta_grouped_mm_common` when called, so the patch goes there."""

    def __enter__(self):
        import torch
        import torch._meta_registrations as meta

        self._real = real = meta._meta_grouped_mm_common
        fallback_dtypes = (torch.float32, torch.float16)

        def common(mat_a, mat_b, scale_a, scale_b, offs=None, bias=None, scale_result=None, out_dtype=None,
                   use_fast_accum=False):  # fmt: skip
            if scale_a is None and scale_b is None and mat_a.dtype == mat_b.dtype and mat_a.dtype in fallback_dtypes:
                torch._check(mat_a.dim() in (2, 3) and mat_b.dim() in (2, 3), lambda: "mat_a and mat_b must be 2 or 3d")
                torch._check(
                    (mat_a.dim() == 2 and mat_b.dim() == 2) or mat_a.size(-1) == mat_b.size(-2),
                    lambda: "contraction dimension of mat_a and mat_b must match",
                )
                torch._check(out_dtype in (None, mat_a.dtype), lambda: "Grouped gemm output dtype must match `mat_a` dtype")
                torch._check(bias is None, lambda: "Bias not supported yet")
                return meta._create_grouped_mm_output_tensor(mat_a, mat_b, offs, out_dtype)
            return real(mat_a, mat_b, scale_a, scale_b, offs, bias, scale_result, out_dtype, use_fast_accum)

        meta._meta_grouped_mm_common = common
        return self

    def __exit__(self, *exc):
        import torch._meta_registrations as meta

        meta._meta_grouped_mm_common = self._real
        return False
