//! Tensor parallelism as torchtitan's Llama plan applies it to an HF decoder (torch 2.11's
//! `torch.distributed.tensor.parallel`), or transformers' own plan (`tensor_parallel.py`'s
//! `colwise`/`rowwise` styles, the same DTensor redistributions), as rank 0 sees it; the ranks
//! of the tensor-parallel group hold alike. The data-parallel mesh dimension is the wrapped
//! strategy's (FSDP2 over `world_size / tp` ranks, or none), whose hooks run as they do
//! without it.
//!
//! Where transformers' plan differs: the embedding is not in it (a plain tensor of every
//! vocabulary row, looked up whole), and the head is `colwise_gather_output`: its
//! `Shard(-1)` logits are all-gathered to `Replicate` (`all_gather_into_tensor` on dim 0, then
//! `torch.cat` of the chunks on the last dim: a copy) and the model's own loss runs on the
//! whole logits; the gather's backward clones this rank's chunk of their gradient.
//!
//! What each part of the plan allocates, after `style.py`, `_redistribute.py`,
//! `placement_types.py`, `_functional_collectives.py` and `loss.py`:
//! - parameters: q/k/v and gate/up `ColwiseParallel` (`Shard(0)`), o/down `RowwiseParallel`
//!   (`Shard(1)`), the embedding `RowwiseParallel` (`Shard(0)`, its vocabulary rows), the head
//!   `ColwiseParallel`: each rank holds `1/tp` of each (the model is built over the local
//!   widths: `heads / tp`, `kv_heads / tp`, `intermediate / tp`, `vocab / tp`); norms are
//!   replicated.
//! - a column-parallel linear without sequence parallelism wraps its (replicated) input with
//!   `DTensor.from_local`: nothing in forward; in backward the input's gradient is `Partial`
//!   and is all-reduced to `Replicate` (`funcol.all_reduce` is out of place: a new tensor), once
//!   per linear (q, k and v each).
//! - a row-parallel linear's output is `Partial`: all-reduced to `Replicate` (a new tensor, the
//!   partial freed), whose backward passes the gradient through (`Replicate -> Partial` is
//!   skipped in backward); with sequence parallelism reduce-scattered to `Shard(1)`: the
//!   partial is chunked on the sequence and concatenated (`torch.cat`, a full copy), the
//!   output is `1/tp`; its backward all-gathers the gradient.
//! - with sequence parallelism each block's input (`PrepareModuleInput`, the head's
//!   `input_layouts=Shard(1)`) is all-gathered from `Shard(1)`: `all_gather_into_tensor`
//!   concatenates on dim 0, and with more than one sequence `_maybe_view_chunk_cat` copies it
//!   into sequence order (the first buffer freed); its backward reduce-scatters the summed
//!   `Partial` gradient of q, k and v (or gate and up) once.
//! - the embedding's lookup is `_MaskPartial`: a mask of the ids outside this rank's rows and
//!   the shifted ids (`clone() - offset`), then the full-size lookup, reduced as a row-parallel
//!   output is. Its weight's gradient comes out of `embedding_dense_backward` `Replicate`: every
//!   vocabulary row, `tp` times the shard (measured: the optimizer step of tensor parallelism
//!   alone, which steps it against `Shard(0)` states, and a segment at the end of backward that
//!   FSDP2 frees once it has copied this rank's rows into its reduce-scatter input).
//! - under sequence parallelism the residual stream and the norms are DTensors (HF derives
//!   the positions from the embedding output's global shape, so the plan keeps
//!   `use_local_output=False` there): autograd sums their gradients out of place, never into a
//!   tensor subclass (`can_accumulate_inplace`), as it does the gathered block input's.
//! - `loss_parallel`: the log-softmax over the vocabulary shards subtracts an all-reduced max
//!   and takes `exp` into a temporary before the result; `nll_loss`'s backward builds its
//!   gradient from `zeros_like(x) + exp(x)` times the incoming one.

use crate::dtype::DType;
use crate::sim::engine::component::Component;
use crate::sim::engine::tracer::{Bwd, T, Tracer};
use crate::spec::Framework;

use super::Strategy;

pub(crate) struct TensorParallel {
    /// Ranks of the tensor-parallel group.
    pub(crate) tp: u64,
    /// Sequence parallelism between the blocks.
    pub(crate) sequence: bool,
    /// Sequences per micro-batch (`all_gather`'s copy into sequence order needs more than one).
    pub(crate) sequences: u64,
    /// The strategy of the data-parallel mesh dimension.
    pub(crate) data: Strategy,
    /// Whose plan: torchtitan's (vocabulary-parallel embedding and loss) or transformers'.
    pub(crate) plan: Framework,
}

impl TensorParallel {
    /// Whether the embedding's vocabulary rows are split (`RowwiseParallel` on it).
    pub(crate) fn splits_embedding(&self) -> bool {
        self.plan != Framework::Transformers
    }

    /// Whether the cross-entropy runs on the vocabulary shards (`loss_parallel`), rather than
    /// on logits gathered whole.
    pub(crate) fn loss_parallel(&self) -> bool {
        self.plan != Framework::Transformers
    }

    /// The head's `Shard(-1)` logits made `Replicate` where the plan gathers them
    /// (`colwise_gather_output`): the chunks all-gathered on dim 0, then concatenated on the
    /// last dim; the shard is freed. Under `loss_parallel` the shard itself.
    pub(crate) fn head_output(&self, t: &mut Tracer, shard: T) -> T {
        if self.loss_parallel() {
            return shard;
        }
        let (numel, dtype) = (t.numel(shard) * self.tp, t.dtype(shard));
        let outer = std::mem::replace(&mut t.component, Component::Communication);
        let raw = t.empty(numel, dtype, "all_gather_into_tensor (logits shards)");
        t.component = outer;
        let out = t.empty(
            numel,
            dtype,
            "logits gathered (chunks cat on the vocabulary)",
        );
        t.drop(raw);
        t.record(Bwd::ChunkOfGathered, &[Some(shard)], &[out], &[]);
        t.drop(shard);
        out
    }

    /// `all_gather_tensor(x, gather_dim=1)`: the dim-0 concatenation of every rank's shard,
    /// copied into sequence order when there is more than one sequence. The result is charged
    /// as what it is used for; the buffer copied from, to communication.
    fn all_gather(&self, t: &mut Tracer, numel: u64, dtype: DType) -> T {
        if self.sequences == 1 {
            return t.empty(numel, dtype, "all_gather_into_tensor (sequence shards)");
        }
        let outer = std::mem::replace(&mut t.component, Component::Communication);
        let raw = t.empty(numel, dtype, "all_gather_into_tensor (sequence shards)");
        t.component = outer;
        let out = t.empty(numel, dtype, "all-gathered, chunks cat in sequence order");
        t.drop(raw);
        out
    }

    /// `reduce_scatter_tensor(x, scatter_dim=1)`: the sequence chunks concatenated on dim 0 (a
    /// copy, charged to communication), then this rank's `1/tp`.
    fn reduce_scatter(&self, t: &mut Tracer, numel: u64, dtype: DType) -> T {
        let outer = std::mem::replace(&mut t.component, Component::Communication);
        let chunks = t.empty(numel, dtype, "reduce_scatter input (sequence chunks cat)");
        t.component = outer;
        let out = t.empty(numel / self.tp, dtype, "reduce-scattered (sequence shard)");
        t.drop(chunks);
        out
    }

    /// The input of a block's column-parallel linears: all-gathered from the sequence shards
    /// under sequence parallelism, else the replicated tensor itself.
    pub(crate) fn block_input(&self, t: &mut Tracer, x: T) -> T {
        if !self.sequence {
            return t.share(x);
        }
        let numel = t.numel(x) * self.tp;
        let out = self.all_gather(t, numel, t.dtype(x));
        t.record(Bwd::ReduceScatter { tp: self.tp }, &[Some(x)], &[out], &[]);
        // Inside the block the column-parallel outputs are local tensors again.
        t.dtensor = false;
        out
    }

    /// One column-parallel linear's `DTensor.from_local` of a replicated input: a view whose
    /// gradient is all-reduced; under sequence parallelism the gathered input itself.
    pub(crate) fn linear_input(&self, t: &mut Tracer, x: T) -> T {
        if self.sequence {
            return t.share(x);
        }
        let view = t.view(x, t.numel(x), "DTensor.from_local (replicated input)");
        t.record(Bwd::AllReduce, &[Some(x)], &[view], &[]);
        view
    }

    /// A row-parallel output (`Partial`) made `Replicate` (all-reduce) or `Shard(1)`
    /// (reduce-scatter).
    pub(crate) fn row_output(&self, t: &mut Tracer, partial: T) -> T {
        let (numel, dtype) = (t.numel(partial), t.dtype(partial));
        let out = if self.sequence {
            // The sequence-sharded output stays a DTensor (`use_local_output=False`), as does
            // the residual stream it joins.
            t.dtensor = true;
            let out = self.reduce_scatter(t, numel, dtype);
            t.record(
                Bwd::AllGather {
                    tp: self.tp,
                    sequences: self.sequences,
                },
                &[Some(partial)],
                &[out],
                &[],
            );
            out
        } else {
            let out = t.empty(numel, dtype, "all_reduce (out of place)");
            t.record(Bwd::Clone, &[Some(partial)], &[out], &[]);
            out
        };
        t.drop(partial);
        out
    }

    /// `_log_softmax` of `loss.py` over the vocabulary shard `x` (fp32, `rows` rows): the
    /// all-reduced row max, `shifted = x - max`, `exp(shifted)` summed and all-reduced, then
    /// `shifted - log(sumexp)`; `_log_softmax`'s autograd node saves the result.
    pub(crate) fn log_softmax(&self, t: &mut Tracer, x: T, rows: u64) -> T {
        let (numel, dtype) = (t.numel(x), t.dtype(x));
        let amax = t.empty(rows, dtype, "amax(x) (vocab shard)");
        let max = t.empty(rows, dtype, "all_reduce(max)");
        t.drop(amax);
        let shifted = t.empty(numel, dtype, "x - max (vocab shard)");
        let exp = t.empty(numel, dtype, "exp(shifted) (vocab shard)");
        let sum = t.empty(rows, dtype, "sum(exp)");
        t.drop(exp);
        let sumexp = t.empty(rows, dtype, "all_reduce(sum)");
        t.drop(sum);
        let lse = t.empty(rows, dtype, "log(sumexp)");
        let out = t.empty(numel, dtype, "log_softmax (vocab shard)");
        t.drop_all(&[lse, sumexp, shifted, max]);
        t.record(Bwd::LogSoftmaxParallel, &[Some(x)], &[out], &[out]);
        out
    }

    /// `nll_loss` over the vocabulary shard (`_nll_loss_forward`): a scalar; its backward is
    /// `_nll_loss_and_log_softmax_backward`.
    pub(crate) fn nll_loss(&self, t: &mut Tracer, log_probs: T, target: T) -> T {
        let out = t.empty(1, t.dtype(log_probs), "nll_loss");
        let total_weight = t.empty(1, t.dtype(log_probs), "nll_loss total_weight");
        t.record(
            Bwd::NllLossParallel,
            &[Some(log_probs)],
            &[out],
            &[target, total_weight],
        );
        t.drop(total_weight);
        out
    }
}

/// A vocabulary-parallel embedding's id masking (torch's `_MaskPartial._partition_value`,
/// Megatron's `VocabParallelEmbedding`): the mask of ids outside this rank's vocabulary rows
/// (kept until the lookup is reduced) and the shifted ids the lookup reads.
pub(crate) fn mask_ids(t: &mut Tracer, n: u64) -> (T, T) {
    let outer = std::mem::replace(&mut t.component, Component::Inputs);
    let below = t.empty(n, DType::Bool, "ids < offset");
    let above = t.empty(n, DType::Bool, "ids >= offset + rows");
    let mask = t.empty(n, DType::Bool, "ids outside the rank's rows");
    t.drop_all(&[above, below]);
    let clone = t.empty(n, DType::I64, "ids.clone()");
    let shifted = t.empty(n, DType::I64, "ids - offset");
    t.drop(clone);
    t.component = outer;
    (mask, shifted)
}
