//! Forward ops with PyTorch's memory semantics: what each allocates, what autograd saves for
//! its backward, and how autocast changes dtypes. Each mirrors the ATen op (and its entry in
//! `derivatives.yaml`) the HF modelling code calls.

use super::component::Component;
use super::tracer::{Bwd, ParamId, T, Tracer};
use crate::dtype::DType;

/// Type promotion of a binary op between two full tensors.
fn promote(a: DType, b: DType) -> DType {
    if a == DType::F32 || b == DType::F32 {
        DType::F32
    } else {
        a
    }
}

impl Tracer {
    /// `x.to(dtype)`: a no-op (same tensor) when the dtype already matches.
    pub(crate) fn to(&mut self, x: T, dtype: DType) -> T {
        if self.dtype(x) == dtype {
            return self.share(x);
        }
        let out = self.empty(self.numel(x), dtype, "x.to(dtype)");
        self.record(Bwd::ToCopy, &[Some(x)], &[out], &[]);
        out
    }

    /// `a * b` with broadcasting (the output has the larger size). `mul` saves each operand
    /// for the other's gradient.
    pub(crate) fn mul(&mut self, a: T, b: T) -> T {
        let numel = self.numel(a).max(self.numel(b));
        let out = self.empty(numel, promote(self.dtype(a), self.dtype(b)), "a * b");
        let mut saved = smallvec::SmallVec::<[T; 2]>::new();
        // MulBackward0 releases `other` before `self`.
        if self.requires_grad(a) {
            saved.push(b);
        }
        if self.requires_grad(b) {
            saved.push(a);
        }
        self.record(Bwd::Mul, &[Some(a), Some(b)], &[out], &saved);
        out
    }

    /// `x /= other` (broadcast): in place, so `x` keeps its dtype. Where autograd records it,
    /// `DivBackward0` needs the original `x` for `other`'s gradient, so the op clones `x` first
    /// and saves the clone. Returns `x` as the op left it.
    pub(crate) fn div_in_place(&mut self, x: T, other: T) -> T {
        let records = self.grad_enabled() && (self.requires_grad(x) || self.requires_grad(other));
        let original = records.then(|| {
            self.empty(
                self.numel(x),
                self.dtype(x),
                "x.clone() (div_'s original self)",
            )
        });
        let out = self.view(x, self.numel(x), "x /= other (in place)");
        let saved: smallvec::SmallVec<[T; 2]> = std::iter::once(other).chain(original).collect();
        self.record(Bwd::Mul, &[Some(x), Some(other)], &[out], &saved);
        if let Some(original) = original {
            self.drop(original);
        }
        self.drop(x);
        out
    }

    /// `x * scalar` (or `x / scalar`, or a 0-dim tensor that does not promote).
    pub(crate) fn mul_scalar(&mut self, x: T) -> T {
        let out = self.empty(self.numel(x), self.dtype(x), "x * scalar");
        self.record(Bwd::MulScalar, &[Some(x)], &[out], &[]);
        out
    }

    /// `a + b` with broadcasting and type promotion.
    pub(crate) fn add(&mut self, a: T, b: T) -> T {
        let numel = self.numel(a).max(self.numel(b));
        let out = self.empty(numel, promote(self.dtype(a), self.dtype(b)), "a + b");
        self.record(Bwd::Add, &[Some(a), Some(b)], &[out], &[]);
        out
    }

    /// `x.view(...)` or `x.reshape(...)` of a contiguous tensor: it allocates nothing, and its
    /// `ViewBackward0` passes the gradient on only when the engine runs it (after any
    /// `AccumulateGrad` made ready beside it).
    pub(crate) fn reshape(&mut self, x: T, label: &'static str) -> T {
        let out = self.view(x, self.numel(x), label);
        self.record(Bwd::View, &[Some(x)], &[out], &[]);
        out
    }

    pub(crate) fn add_scalar(&mut self, x: T) -> T {
        let out = self.empty(self.numel(x), self.dtype(x), "x + scalar");
        self.record(Bwd::AddScalar, &[Some(x)], &[out], &[]);
        out
    }

    pub(crate) fn neg(&mut self, x: T) -> T {
        let out = self.empty(self.numel(x), self.dtype(x), "-x");
        self.record(Bwd::Neg, &[Some(x)], &[out], &[]);
        out
    }

    /// `torch.pow(x, 3.0)`: saves `x`.
    pub(crate) fn pow3(&mut self, x: T) -> T {
        let out = self.empty(self.numel(x), self.dtype(x), "x.pow(3)");
        self.record(Bwd::Pow2, &[Some(x)], &[out], &[x]);
        out
    }

    /// An input as an op on autocast's fp32 list sees it: half tensors are cast (uncached).
    pub(crate) fn autocast_fp32(&mut self, x: T) -> T {
        match self.autocast_dtype() {
            Some(_) if self.dtype(x).is_half() => self.to(x, DType::F32),
            _ => self.share(x),
        }
    }

    /// `x.split(n / 3, dim=-1)` into three equal views; backward concatenates their gradients.
    pub(crate) fn split3(&mut self, x: T) -> [T; 3] {
        let third = self.numel(x) / 3;
        let parts = [
            self.view(x, third, "split[0]"),
            self.view(x, third, "split[1]"),
            self.view(x, third, "split[2]"),
        ];
        self.record(Bwd::Split, &[Some(x)], &parts, &[]);
        parts
    }

    /// `x.pow(2)`: saves `x`.
    pub(crate) fn pow2(&mut self, x: T) -> T {
        let out = self.empty(self.numel(x), self.dtype(x), "x.pow(2)");
        self.record(Bwd::Pow2, &[Some(x)], &[out], &[x]);
        out
    }

    /// `x.mean(-1, keepdim=True)` over a last dimension of `last`.
    pub(crate) fn mean_last(&mut self, x: T, last: u64) -> T {
        let out = self.empty(self.numel(x) / last, self.dtype(x), "x.mean(-1)");
        self.record(Bwd::MeanLastDim, &[Some(x)], &[out], &[]);
        out
    }

    /// `torch.rsqrt(x)`: saves its result.
    pub(crate) fn rsqrt(&mut self, x: T) -> T {
        let out = self.empty(self.numel(x), self.dtype(x), "rsqrt(x)");
        self.record(Bwd::Rsqrt, &[Some(x)], &[out], &[out]);
        out
    }

    /// `F.silu(x)`: saves `x`.
    pub(crate) fn silu(&mut self, x: T) -> T {
        let out = self.empty(self.numel(x), self.dtype(x), "silu(x)");
        self.record(Bwd::Silu, &[Some(x)], &[out], &[x]);
        out
    }

    /// `gelu(x, approximate="tanh")`: saves `x`.
    pub(crate) fn gelu_tanh(&mut self, x: T) -> T {
        let out = self.empty(self.numel(x), self.dtype(x), "gelu_tanh(x)");
        self.record(Bwd::GeluTanh, &[Some(x)], &[out], &[x]);
        out
    }

    /// `torch.tanh(x)`: saves its result.
    pub(crate) fn tanh(&mut self, x: T) -> T {
        let out = self.empty(self.numel(x), self.dtype(x), "tanh(x)");
        self.record(Bwd::Tanh, &[Some(x)], &[out], &[out]);
        out
    }

    /// `torch.cat((a, b), dim=-1)`.
    pub(crate) fn cat2(&mut self, a: T, b: T) -> T {
        let out = self.empty(self.numel(a) + self.numel(b), self.dtype(a), "cat");
        self.record(Bwd::Cat, &[Some(a), Some(b)], &[out], &[]);
        out
    }

    /// `x[..., i:j]`: a view of `numel` elements; its backward scatters into zeros.
    pub(crate) fn slice(&mut self, x: T, numel: u64) -> T {
        let out = self.view(x, numel, "x[..., i:j]");
        self.record(Bwd::Slice, &[Some(x)], &[out], &[]);
        out
    }

    /// `x.contiguous()` of a non-contiguous tensor: a copy.
    pub(crate) fn contiguous_copy(&mut self, x: T) -> T {
        let out = self.empty(self.numel(x), self.dtype(x), "x.contiguous()");
        self.record(Bwd::Clone, &[Some(x)], &[out], &[]);
        out
    }

    /// `F.embedding(ids, weight)` with `rows` looked-up rows of width `width`: saves the ids.
    pub(crate) fn embedding(&mut self, weight: ParamId, ids: T, rows: u64, width: u64) -> T {
        let w = self.param(weight);
        let out = self.empty(rows * width, self.dtype(w), "embedding(ids)");
        self.record(Bwd::Embedding, &[Some(w)], &[out], &[ids]);
        out
    }

    /// `F.embedding` of a vocabulary-sharded weight under tensor parallelism over `tp` ranks:
    /// the lookup of the local rows; the weight's gradient is every rank's rows (`Replicate`).
    pub(crate) fn embedding_sharded(
        &mut self,
        weight: ParamId,
        ids: T,
        rows: u64,
        width: u64,
        tp: u64,
    ) -> T {
        let w = self.param(weight);
        let out = self.empty(rows * width, self.dtype(w), "embedding(ids) (vocab shard)");
        self.record(
            Bwd::EmbeddingReplicatedGrad { tp },
            &[Some(w)],
            &[out],
            &[ids],
        );
        out
    }

    /// A weight as the current autocast region sees it: fp32 leaves that require grad are cast
    /// once and cached until the region exits (`cached_cast` in `autocast_mode.cpp`); other
    /// fp32 weights are cast on every use.
    pub(crate) fn autocast_weight(&mut self, w: T) -> T {
        let Some(low) = self.autocast_dtype() else {
            return self.share(w);
        };
        if self.dtype(w) != DType::F32 {
            return self.share(w);
        }
        let cacheable = self.is_param(w) && self.requires_grad(w);
        if cacheable && let Some(cast) = self.autocast_cached(w) {
            self.pass_cached_cast(cast);
            return self.share(cast);
        }
        let component = self.component;
        self.component = super::component::Component::AutocastCopies;
        let cast = self.weight_cast(w, low);
        self.component = component;
        if cacheable {
            let kept = self.share(cast);
            self.autocast_cache_insert(w, kept);
        }
        cast
    }

    /// An activation as autocast hands it to a matmul: cast (never cached) when fp32.
    pub(crate) fn autocast_input(&mut self, x: T) -> T {
        match self.autocast_dtype() {
            Some(low) if self.dtype(x) == DType::F32 => self.to(x, low),
            _ => self.share(x),
        }
    }

    /// `F.linear(x, w, b)` on `tokens` rows (`matmul`/`addmm` on the flattened input).
    /// Saves the input for the weight's gradient and the weight for the input's gradient.
    pub(crate) fn linear(
        &mut self,
        x: T,
        weight: ParamId,
        bias: Option<ParamId>,
        out_features: u64,
        conv1d: bool,
    ) -> T {
        // `AddmmBackward0` makes the input's gradient first, `MmBackward0` the weight's.
        self.linear_ordered(x, weight, bias, out_features, conv1d, bias.is_some())
    }

    /// Megatron's `LinearWithGradAccumulationAndAsyncCommunication` without sequence
    /// parallelism (`ColumnParallelLinear`, `RowParallelLinear`): `F.linear` forward; its
    /// backward makes the input's gradient (`grad_output.matmul(weight)`) before the weight's
    /// (`grad_output.t().matmul(total_input)`).
    pub(crate) fn megatron_linear(&mut self, x: T, weight: ParamId, out_features: u64) -> T {
        self.linear_ordered(x, weight, None, out_features, false, true)
    }

    /// Megatron's `LinearWithGradAccumulationAndAsyncCommunication` with a bias (Qwen2's
    /// qkv): `matmul(x, w.t())`, then `output + bias` into a new tensor (the product goes as
    /// the function returns); its backward makes the input's gradient, the weight's, then the
    /// bias's (`grad_output.sum(dim=0)`).
    pub(crate) fn megatron_linear_bias(
        &mut self,
        x: T,
        weight: ParamId,
        bias: ParamId,
        out_features: u64,
    ) -> T {
        let (w, b) = (self.param(weight), self.param(bias));
        let tokens = self.numel(x) / (self.numel(w) / out_features);
        let product = self.empty(tokens * out_features, self.dtype(w), "linear output");
        self.ensure_cublas_workspace();
        let out = self.empty(tokens * out_features, self.dtype(w), "output + bias");
        self.record(
            Bwd::Linear {
                bias: true,
                input_grad_first: true,
            },
            &[Some(x), Some(w), Some(b)],
            &[out],
            &[x, w],
        );
        self.drop(product);
        out
    }

    fn linear_ordered(
        &mut self,
        x: T,
        weight: ParamId,
        bias: Option<ParamId>,
        out_features: u64,
        conv1d: bool,
        input_grad_first: bool,
    ) -> T {
        // Autocast's wrapper casts the arguments as C++ evaluates them, last first:
        // `F.linear(input, weight, bias)` casts bias, weight, input; GPT-2's Conv1D,
        // `torch.addmm(bias, x, weight)`, casts weight, x, bias.
        let w = self.param(weight);
        let cast_bias = |t: &mut Tracer| {
            bias.map(|b| {
                let b = t.param(b);
                t.autocast_weight(b)
            })
        };
        let (w_c, x_c, b_c) = if conv1d {
            let w_c = self.autocast_weight(w);
            let x_c = self.autocast_input(x);
            (w_c, x_c, cast_bias(self))
        } else {
            let b_c = cast_bias(self);
            let w_c = self.autocast_weight(w);
            (w_c, self.autocast_input(x), b_c)
        };
        let tokens = self.numel(x_c) / (self.numel(w_c) / out_features);
        let out = self.empty(tokens * out_features, self.dtype(w_c), "linear output");
        self.ensure_cublas_workspace();
        if bias.is_some() {
            self.ensure_cublaslt_workspace();
        }
        let mut saved = smallvec::SmallVec::<[T; 2]>::new();
        if self.requires_grad(w_c) {
            saved.push(x_c);
        }
        if self.requires_grad(x_c) {
            saved.push(w_c);
        }
        self.record(
            Bwd::Linear {
                bias: bias.is_some(),
                input_grad_first,
            },
            &[Some(x_c), Some(w_c), b_c],
            &[out],
            &saved,
        );
        self.drop(x_c);
        self.drop(w_c);
        if let Some(b_c) = b_c {
            self.drop(b_c);
        }
        out
    }

    /// bitsandbytes `Linear4bit.forward` over a 4-bit weight of `n` elements:
    /// `matmul_4bit(x.to(bf16), weight, bias.to(bf16)).to(x.dtype)`. For training-sized inputs
    /// bitsandbytes dequantises the weight and calls `F.linear` (`_dequant_linear_fallback`):
    /// fp32 absmax, absmax plus offset, the bf16 weight, then the product. Only the packed
    /// weight is kept for backward.
    pub(crate) fn linear_4bit(
        &mut self,
        x: T,
        weight: ParamId,
        bias: Option<ParamId>,
        out_features: u64,
        n: u64,
    ) -> T {
        let compute = DType::BF16;
        let input_dtype = self.dtype(x);
        let x_c = self.to(x, compute);
        let b_c = bias.map(|b| {
            let b = self.param(b);
            self.to(b, compute)
        });
        let blocks = n.div_ceil(64);
        let outer = std::mem::replace(
            &mut self.component,
            super::component::Component::LoraQuantExtras,
        );
        let absmax_dq = self.empty(blocks, DType::F32, "4-bit: absmax dequantised");
        let absmax = self.empty(blocks, DType::F32, "4-bit: absmax + offset");
        let dequantised = self.empty(n, compute, "4-bit: dequantised weight");
        self.component = outer;
        let tokens = self.numel(x_c) / (n / out_features);
        let out = self.empty(tokens * out_features, compute, "4-bit linear output");
        self.ensure_cublas_workspace();
        if bias.is_some() {
            self.ensure_cublaslt_workspace();
        }
        self.drop_all(&[absmax_dq, absmax, dequantised]);
        let packed = self.param(weight);
        self.record(
            Bwd::MatMul4Bit { weights: n },
            &[Some(x_c), Some(packed), b_c],
            &[out],
            &[],
        );
        if let Some(b_c) = b_c {
            self.drop(b_c);
        }
        self.drop(x_c);
        let result = self.to(out, input_dtype);
        self.drop(out);
        result
    }

    /// Batched `torch.matmul(a, b)` of attention scores or outputs (autocast casts fp32
    /// operands, `b` first); saves both operands.
    pub(crate) fn bmm(&mut self, a: T, b: T, out_numel: u64) -> T {
        let b = self.autocast_input(b);
        let a = self.autocast_input(a);
        let out = self.empty(out_numel, self.dtype(a), "matmul (attention)");
        let mut saved = smallvec::SmallVec::<[T; 2]>::new();
        if self.requires_grad(b) {
            saved.push(a);
        }
        if self.requires_grad(a) {
            saved.push(b);
        }
        self.record(Bwd::Bmm, &[Some(a), Some(b)], &[out], &saved);
        self.drop_all(&[a, b]);
        out
    }

    /// `softmax(x, dim=-1, dtype=float32)`: casts, then saves the fp32 result.
    pub(crate) fn softmax_f32(&mut self, x: T) -> T {
        let x32 = self.to(x, DType::F32);
        let out = self.empty(self.numel(x), DType::F32, "softmax (fp32)");
        self.record(Bwd::Softmax, &[Some(x32)], &[out], &[out]);
        self.drop(x32);
        out
    }

    /// `log_softmax(x, -1)`: saves its result.
    pub(crate) fn log_softmax(&mut self, x: T) -> T {
        let out = self.empty(self.numel(x), self.dtype(x), "log_softmax");
        self.record(Bwd::LogSoftmax, &[Some(x)], &[out], &[out]);
        out
    }

    /// `nll_loss(log_probs, target, reduction="mean")`: a scalar; `NllLossBackward0` saves its
    /// input (`self_`), the target and the total weight. The input outlives the forward where
    /// nothing else saves it: autocast's fp32 cast of bf16 log-probs, say.
    pub(crate) fn nll_loss(&mut self, log_probs: T, target: T) -> T {
        let out = self.empty(1, self.dtype(log_probs), "nll_loss");
        let total_weight = self.empty(1, self.dtype(log_probs), "nll_loss total_weight");
        self.record(
            Bwd::NllLoss,
            &[Some(log_probs)],
            &[out],
            &[log_probs, target, total_weight],
        );
        self.drop(total_weight);
        out
    }

    /// `x.mean()` (all elements) to a scalar.
    pub(crate) fn mean_all(&mut self, x: T) -> T {
        let out = self.empty(1, self.dtype(x), "x.mean()");
        self.record(Bwd::Reduce, &[Some(x)], &[out], &[]);
        out
    }

    /// `nn.Dropout(p)` in training with 0 < p < 1 (`native_dropout`): output and a bool
    /// mask, which is saved.
    pub(crate) fn dropout(&mut self, x: T) -> T {
        let mask = self.empty(self.numel(x), DType::Bool, "dropout mask");
        let out = self.empty(self.numel(x), self.dtype(x), "dropout output");
        self.record(Bwd::Dropout, &[Some(x)], &[out], &[mask]);
        self.drop(mask);
        out
    }

    /// The global staging buffer (and its semaphores) CUDA's reduction kernel allocates and
    /// frees when it splits each of `outputs` sums of `inputs` values over several blocks
    /// (`gpu_reduce_kernel` after `setReduceConfig` in `Reduce.cuh`), for a contiguous tensor
    /// reduced over its outer dimensions, accumulating in `accumulator` (fp32 for floating
    /// sums, int64 for integer and bool ones).
    pub(crate) fn reduction_staging(&mut self, outputs: u64, inputs: u64, accumulator: DType) {
        let Some(config) = OuterReduction::config(
            outputs,
            inputs,
            self.workspaces.multiprocessors,
            accumulator.bytes(),
        ) else {
            return;
        };
        let outer = std::mem::replace(&mut self.component, Component::Workspaces);
        let buffer = self.empty(config.buffer_bytes, DType::U8, "reduction staging buffer");
        let semaphores = self.empty(config.semaphore_bytes, DType::U8, "reduction semaphores");
        self.drop_all(&[buffer, semaphores]);
        self.component = outer;
    }

    /// The current thread's cuBLAS workspace, allocated at its first GEMM and kept for the
    /// life of the process (`setWorkspaceForHandle`: one per handle and stream), of the
    /// device's size.
    pub(crate) fn ensure_cublas_workspace(&mut self) {
        let thread = self.thread;
        if !self.cublas_workspace[thread] {
            self.cublas_workspace[thread] = true;
            let ws = self.empty_as(
                self.workspaces.cublas_bytes,
                DType::U8,
                Component::Workspaces,
                "cuBLAS workspace",
            );
            self.made_once(ws);
            self.mark_persistent(ws);
        }
    }

    /// The current thread's cuBLASLt workspace, allocated at its first `addmm` with a bias
    /// epilogue (`getCUDABlasLtWorkspace`), of the device's size.
    pub(crate) fn ensure_cublaslt_workspace(&mut self) {
        let thread = self.thread;
        if !self.cublaslt_workspace[thread] {
            self.cublaslt_workspace[thread] = true;
            let ws = self.empty_as(
                self.workspaces.cublaslt_bytes,
                DType::U8,
                Component::Workspaces,
                "cuBLASLt workspace",
            );
            self.made_once(ws);
            self.mark_persistent(ws);
        }
    }
}

/// `setReduceConfig` for a sum over the outer dimensions of a contiguous tensor (the output's
/// elements are the innermost, vectorised by up to 4): its block shape and how many blocks
/// share each output (`ctas_per_output`). `None`: one block per output, no staging buffer.
/// Shared with `headroom::trace`, whose `reduce` events stage through the same buffer.
pub(crate) struct OuterReduction {
    pub(crate) buffer_bytes: u64,
    pub(crate) semaphore_bytes: u64,
}

impl OuterReduction {
    /// `mnt_wrapper<T>::MAX_NUM_THREADS`.
    const MAX_THREADS: u64 = 512;
    const WARP: u64 = 32;
    const MIN_VALUES_PER_THREAD: u64 = 16;
    const MAX_VALUES_PER_THREAD: u64 = 256;
    const THREADS_PER_MULTIPROCESSOR: u64 = 2048;

    /// `accumulator_bytes`: `sizeof(arg_t)`, 4 for fp32 sums, 8 for int64 ones.
    pub(crate) fn config(
        outputs: u64,
        inputs: u64,
        multiprocessors: u64,
        accumulator_bytes: u64,
    ) -> Option<OuterReduction> {
        if outputs == 0 || inputs <= 1 {
            return None;
        }
        let last_pow2 = |n: u64| 1u64 << (63 - n.max(1).leading_zeros());
        // `get_output_vec_size`: 4, halved until it divides the outputs.
        let mut vec = 4;
        while !outputs.is_multiple_of(vec) {
            vec /= 2;
        }
        let max_threads = Self::MAX_THREADS / vec;
        let pow2 = |d: u64| {
            if d < max_threads {
                last_pow2(d)
            } else {
                max_threads
            }
        };
        let (dim0, dim1) = (outputs / vec, inputs);
        let mut width = pow2(dim0).min(Self::WARP);
        let height = pow2(dim1).min(max_threads / width);
        width = pow2(dim0).min(max_threads / height);
        let threads = width * height;
        // The block's x splits the outputs; its y splits the inputs when each thread would
        // otherwise sum enough of them.
        let mut step_output = width;
        let mut step_input = 1;
        let threshold = (height * 16).min(Self::MAX_VALUES_PER_THREAD);
        let across_warps = inputs.div_ceil(step_input) >= threshold;
        if across_warps {
            step_input *= height;
        } else {
            step_output *= height;
        }
        let target_grid = multiprocessors * (Self::THREADS_PER_MULTIPROCESSOR / threads);
        let grid = (outputs / vec).div_ceil(step_output);
        let per_thread = inputs.div_ceil(step_input);
        if !across_warps || per_thread < Self::MAX_VALUES_PER_THREAD || grid > target_grid {
            return None;
        }
        let by_grid = target_grid.div_ceil(grid);
        let by_values = per_thread.div_ceil(Self::MIN_VALUES_PER_THREAD);
        let at_most = per_thread.div_ceil(Self::MAX_VALUES_PER_THREAD);
        let ctas = by_grid.min(by_values).max(at_most);
        if ctas <= 1 {
            return None;
        }
        Some(OuterReduction {
            buffer_bytes: accumulator_bytes * outputs * ctas * width * vec,
            semaphore_bytes: 4 * grid,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::OuterReduction;

    /// A 2048 x 2048 bf16 gradient summed to an RMSNorm weight of 2048 on an H100 allocates a
    /// 32 MiB staging buffer (measured: bench/moe snapshots of Qwen3-30B-A3B's norms).
    #[test]
    fn a_column_sum_over_many_rows_stages_through_global_memory() {
        let config = OuterReduction::config(2048, 2048, 132, 4).expect("split over blocks");
        assert_eq!(config.buffer_bytes, 32 << 20);
        // A few rows fit one block per output.
        assert!(OuterReduction::config(2048, 16, 132, 4).is_none());
    }

    /// The Megatron harness's `routing_map.sum(dim=0)` over 128 experts accumulates in int64:
    /// 2, 4 and 8 MiB staged for 1024, 2048 and 4096 tokens on an H100 or H200 (the snapshots of
    /// bench/megatron-moe-sp, bench/megatron-dp-ranks and bench/megatron-moe), none for 512.
    #[test]
    fn an_integer_column_sum_stages_eight_byte_partials() {
        let staged = |rows| OuterReduction::config(128, rows, 132, 8).map(|c| c.buffer_bytes);
        assert_eq!(staged(1024), Some(2 << 20));
        assert_eq!(staged(2048), Some(4 << 20));
        assert_eq!(staged(4096), Some(8 << 20));
        assert_eq!(staged(512), None);
    }
}
