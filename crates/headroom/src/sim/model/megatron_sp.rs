//! Megatron-core 0.19's tensor-parallel linears as one rank runs them, with sequence
//! parallelism (`config.sequence_parallel`) or without (`tensor_parallel/layers.py`,
//! `tensor_parallel/mappings.py`, `models/common/embeddings/language_model_embedding.py`).
//!
//! Without it the activations between the linears are whole on every rank and the reductions
//! are all-reduces in place. With it they are `1/tp` of the sequence (the norms, residual adds
//! and dropouts work on `s/tp` rows):
//! - `VocabParallelEmbedding` (`reduce_scatter_embeddings`: rotary positions, no token types)
//!   copies its lookup to `[s, b, h]` and reduce-scatters it into a new `[s/tp, b, h]`;
//!   `LanguageModelEmbedding` then clones that (`clone_scatter_output_in_embedding`).
//! - `ColumnParallelLinear` (`LinearWithGradAccumulationAndAsyncCommunication` with
//!   `sequence_parallel`) all-gathers its input into the persistent "mpu" buffer
//!   (`get_global_memory_buffer()`, the one `DotProductAttention` hands `baddbmm`) and saves the
//!   sharded input; backward gathers it there again, computes the whole input gradient, a
//!   sharded one to reduce-scatter it into, then the weight's gradient.
//! - `RowParallelLinear` reduce-scatters its output into a new `[s/tp, b, h]`
//!   (`reduce_scatter_to_sequence_parallel_region`), whose backward all-gathers the gradient
//!   into a new whole tensor.
//! - `finalize_model_grads` (`_allreduce_non_tensor_model_parallel_grads`) sums the norms'
//!   gradients over the tp ranks, flattened into one fp32 temporary.

use std::cell::Cell;

use crate::dtype::DType;
use crate::sim::engine::component::Component;
use crate::sim::engine::tracer::{Bwd, ParamId, T, Tracer};

/// Sequence parallelism over `tp` ranks, and the process's "mpu" buffer its gathers use.
#[derive(Clone, Copy)]
pub(crate) struct SequenceParallel<'a> {
    pub tp: u64,
    pub buffer: &'a Cell<Option<T>>,
}

/// `parallel_state.get_global_memory_buffer().get_tensor(shape, bf16, "mpu")`: made at the
/// first request, made again (the old one freed once the new one exists) when a later request
/// is larger.
pub(crate) fn mpu_buffer(t: &mut Tracer, buffer: &Cell<Option<T>>, numel: u64) -> T {
    match buffer.get() {
        Some(current) if t.numel(current) >= numel => current,
        old => {
            let new = t.empty_as(numel, DType::BF16, Component::Workspaces, "mpu buffer");
            match old {
                Some(old) => t.replace_persistent(old, new),
                None => t.mark_persistent(new),
            }
            buffer.set(Some(new));
            new
        }
    }
}

/// `ColumnParallelLinear` on `x` to `out_features` (no bias: a bias is added by the caller).
pub(crate) fn column_parallel(
    t: &mut Tracer,
    x: T,
    weight: ParamId,
    out_features: u64,
    sp: Option<SequenceParallel>,
) -> T {
    let Some(sp) = sp else {
        return t.megatron_linear(x, weight, out_features);
    };
    let w = t.param(weight);
    let gathered = t.numel(x) * sp.tp;
    let in_features = t.numel(w) / out_features;
    mpu_buffer(t, sp.buffer, gathered);
    let out = t.empty(
        gathered / in_features * out_features,
        t.dtype(w),
        "linear output (gathered input)",
    );
    t.ensure_cublas_workspace();
    t.record(
        Bwd::SequenceParallelLinear { tp: sp.tp },
        &[Some(x), Some(w)],
        &[out],
        &[x, w],
    );
    out
}

/// `RowParallelLinear` on `x` to `out_features`: with sequence parallelism its output
/// reduce-scattered into a new tensor of this rank's rows.
pub(crate) fn row_parallel(
    t: &mut Tracer,
    x: T,
    weight: ParamId,
    out_features: u64,
    sp: Option<SequenceParallel>,
) -> T {
    let out = t.megatron_linear(x, weight, out_features);
    match sp {
        Some(sp) => {
            let scattered = reduce_scatter(t, out, sp.tp);
            t.drop(out);
            scattered
        }
        None => out,
    }
}

/// `reduce_scatter_to_sequence_parallel_region`: a new tensor of this rank's `1/tp` of `x`'s
/// rows; its backward all-gathers the gradient into a new whole one.
pub(crate) fn reduce_scatter(t: &mut Tracer, x: T, tp: u64) -> T {
    let out = t.empty(
        t.numel(x) / tp,
        t.dtype(x),
        "reduce_scatter to sequence parallel",
    );
    t.record(Bwd::GatherBack, &[Some(x)], &[out], &[]);
    out
}

/// `VocabParallelEmbedding`'s sequence-parallel end: the `[s, b, h]` copy reduce-scattered
/// into this rank's rows (`LanguageModelEmbedding` clones them once the embedding's locals
/// are gone).
pub(crate) fn scatter_embedding(t: &mut Tracer, embedded: T, sp: SequenceParallel) -> T {
    reduce_scatter(t, embedded, sp.tp)
}

/// `_allreduce_non_tensor_model_parallel_grads` with tp > 1: the gradients summed over the tp
/// ranks (`numel` elements of fp32 main gradients) flattened into one temporary
/// (`_flatten_dense_tensors`) and copied back in place.
pub(crate) fn allreduce_norm_grads(t: &mut Tracer, numel: u64) {
    if numel == 0 {
        return;
    }
    let outer = std::mem::replace(&mut t.component, Component::Gradients);
    let flat = t.empty(
        numel,
        DType::F32,
        "_flatten_dense_tensors (tp-summed grads)",
    );
    t.drop(flat);
    t.component = outer;
}
