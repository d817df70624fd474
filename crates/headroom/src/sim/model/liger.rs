//! liger-kernel 0.8.5 as `use_liger_kernel=True` patches a model (`apply_liger_kernel` at the
//! start of `Trainer.train()`; `liger_kernel/transformers/monkey_patch.py`): its Triton RMSNorm,
//! SwiGLU and RoPE replace the decoder's, and, under transformers' `Trainer` alone, its fused
//! linear cross-entropy replaces the LM head and the loss (TRL 1.16 turns that one off and keeps
//! its own fused head). Each function names the liger function it mirrors.

use super::Batch;
use crate::dtype::DType;
use crate::sim::engine::component::Component;
use crate::sim::engine::tracer::{Bwd, ParamId, T, Tracer};

/// Streaming multiprocessors of an H100 SXM or H200: the rows of `LigerRMSNorm`'s
/// per-SM weight-gradient buffer (carried over to other GPUs).
pub(crate) const SM_COUNT: u64 = 132;

/// Which liger kernels a model runs.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct Kernels {
    /// `liger_rotary_pos_emb`: q and k rotated in place (a module-wide patch, so a reference
    /// model built before `train()` has it too).
    pub rope: bool,
    /// `LigerRMSNorm` and `LigerSwiGLUMLP` on this model's modules.
    pub layers: bool,
    /// `lce_forward`: the fused linear cross-entropy in place of the LM head and the loss
    /// (transformers' `Trainer` only).
    pub fused_linear_cross_entropy: bool,
}

/// `LigerRMSNormFunction` (`in_place=True`, llama casting): the output in the input's dtype
/// and a per-row fp32 `rstd`; it saves the input itself and `rstd`. Its backward writes the
/// input's gradient into the output's, and sums a trained weight's gradient over a
/// `[sm_count, width]` fp32 buffer.
pub(crate) fn rms_norm(t: &mut Tracer, x: T, weight: ParamId) -> T {
    let width = t.numel(t.param(weight));
    let rows = t.numel(x) / width.max(1);
    let out = t.empty(t.numel(x), t.dtype(x), "LigerRMSNorm Y");
    let rstd = t.empty(rows, DType::F32, "LigerRMSNorm RSTD");
    let w = t.param(weight);
    t.record(
        Bwd::LigerRmsNorm {
            width,
            partial_rows: SM_COUNT,
        },
        &[Some(x), Some(w)],
        &[out],
        &[x, rstd],
    );
    t.drop(rstd);
    out
}

/// `LigerSiLUMulFunction`: `silu(gate) * up` into one new tensor; it saves `gate` and `up`,
/// and its backward writes their gradients into them in place.
pub(crate) fn silu_mul(t: &mut Tracer, gate: T, up: T) -> T {
    let out = t.empty(t.numel(gate), t.dtype(up), "LigerSiLUMulFunction c");
    t.record(
        Bwd::InPlacePair,
        &[Some(gate), Some(up)],
        &[out],
        &[gate, up],
    );
    out
}

/// `LigerRopeFunction`: q (or k) rotated in place in its projection's buffer; only `cos` and
/// `sin` are saved, and the backward rotates the gradient in place too.
pub(crate) fn rotate(t: &mut Tracer, x: T, cos: T, sin: T) -> T {
    let out = t.view(x, t.numel(x), "liger RoPE (in place)");
    t.record(Bwd::InPlace, &[Some(x)], &[out], &[cos, sin]);
    out
}

/// `lce_forward` under `Trainer` with labels: the backbone's last hidden states and the LM
/// head's `[vocab, width]` weight go through
/// `LigerForCausalLMLoss` → `LigerFusedLinearCrossEntropyFunction`
/// (`ops/fused_linear_cross_entropy.py`) with `num_items_in_batch` (sum reduction). Every
/// position is a row; the rows are taken in chunks of `next_power_of_2(rows / ceil(vocab /
/// hidden))`, and the gradients of the hidden states and of the head's weight are computed
/// in the forward, in their own dtypes, and saved: the backward only scales them. No logits
/// outlive a chunk, and the hidden states are not kept.
pub(crate) fn fused_linear_cross_entropy(
    t: &mut Tracer,
    weight: ParamId,
    [vocab, width]: [u64; 2],
    hidden: T,
    batch: Batch,
) -> T {
    let outer = std::mem::replace(&mut t.component, Component::Inputs);
    let padded = t.empty(batch.b * (batch.s + 1), DType::I64, "F.pad(labels, (0, 1))");
    let shifted = t.empty(batch.n(), DType::I64, "shift_labels.contiguous()");
    t.component = Component::LogitsAndLoss;
    let w = t.param(weight);
    let rows = batch.n();
    let input_dtype = t.dtype(hidden);
    let weight_dtype = t.dtype(w);
    let grad_input = t.empty(rows * width, input_dtype, "FLCE grad_input (zeros_like)");
    let trains_weight = t.requires_grad(w) && t.requires_grad(hidden) && t.grad_enabled();
    let grad_weight =
        trains_weight.then(|| t.empty(vocab * width, weight_dtype, "FLCE grad_weight"));
    let loss_1d = t.empty(rows, DType::F32, "FLCE loss_1d");
    let target_mask = t.empty(rows, DType::Bool, "target != ignore_index");
    let count = t.empty(1, DType::I64, "target_mask.sum()");
    t.drop(count);
    let chunk = chunk_rows(rows, vocab, width);
    let autocast = t.autocast_dtype();
    let direct = input_dtype == weight_dtype && autocast.is_none_or(|d| d == input_dtype);
    t.ensure_cublas_workspace();
    if direct {
        // One `[chunk, vocab]` logits buffer; each chunk's logits, their gradient and both
        // products go through it and the saved buffers with `out=`.
        let logits = t.empty(chunk * vocab, input_dtype, "FLCE logits_storage");
        if input_dtype == DType::F32 && trains_weight {
            // fp32 gradients take the legacy `grad_weight += mm(...)`: a `[vocab, hidden]`
            // product per chunk.
            for _ in 0..rows.div_ceil(chunk) {
                let product = t.empty(vocab * width, DType::F32, "mm(grad_logits.t(), x)");
                t.drop(product);
            }
        }
        t.drop(logits);
    } else {
        // fp32 hidden states and weight under autocast: each chunk casts its rows and the
        // weight (a view's cast is never cached) for its logits, then the weight again
        // (cached while the model's forward lasts when it trains) for the input's gradient.
        let low = autocast.unwrap_or(DType::BF16);
        for start in (0..rows).step_by(chunk.max(1) as usize) {
            let c = (rows - start).min(chunk);
            let x = t.empty(c * width, low, "x_chunk (autocast)");
            let wt = t.empty(vocab * width, low, "weight.t() (autocast, uncached)");
            let logits = t.empty(c * vocab, low, "FLCE logits chunk");
            t.drop_all(&[wt, x]);
            let cast = t.autocast_weight(w);
            let product = t.empty(c * width, low, "grad_logits @ weight");
            t.drop_all(&[product, cast]);
            if trains_weight {
                let x = t.empty(c * width, low, "x_chunk.to(grad dtype)");
                t.drop(x);
            }
            t.drop(logits);
        }
    }
    let loss = t.empty(1, DType::F32, "torch.sum(loss_1d)");
    t.drop_all(&[target_mask, loss_1d]);
    let saved: Vec<T> = std::iter::once(grad_input).chain(grad_weight).collect();
    t.record(
        Bwd::LigerFusedLinearCrossEntropy,
        &[Some(hidden), Some(w)],
        &[loss],
        &saved,
    );
    t.drop_all(&saved);
    let divided = t.mul_scalar(loss);
    t.drop_all(&[loss, shifted, padded]);
    t.component = outer;
    divided
}

/// Rows of one chunk (`fused_linear_cross_entropy_forward`): `min(next_power_of_2(cdiv(rows,
/// cdiv(vocab, hidden))), rows)`.
fn chunk_rows(rows: u64, vocab: u64, hidden: u64) -> u64 {
    let factor = vocab.div_ceil(hidden.max(1)).max(1);
    rows.div_ceil(factor).next_power_of_two().min(rows).max(1)
}

#[cfg(test)]
mod tests {
    use super::chunk_rows;

    #[test]
    fn chunks_follow_liger_s_table() {
        // Qwen2.5-0.5B (896, 151936) at 4096 rows: 32 x 128; Llama-3.1-8B at 8192: 256 x 32.
        assert_eq!(chunk_rows(4096, 151_936, 896), 32);
        assert_eq!(chunk_rows(8192, 128_256, 4096), 256);
        assert_eq!(chunk_rows(3, 151_936, 896), 1);
    }
}
