//! Context parallelism as torchtitan applies it (torch 2.11's
//! `torch.distributed.tensor.experimental.context_parallel`), on one rank of the
//! context-parallel group (the ranks differ only in their ring's steps: rank 0 runs only
//! partial ones, the last rank only full ones, the ranks between both kinds; see
//! `engine::ring_attention`). The data-parallel strategy it wraps (FSDP2 over
//! `dp × cp` ranks, torchtitan's `dp_shard_cp` mesh, or tensor parallelism over that) runs
//! its hooks as it does without it.
//!
//! Each step's batch is sharded on the sequence when the context is entered: the head-tail
//! load balancer's indices (`torch.tensor(..., dtype=int32)`), `torch.gather` of the batch into
//! their order, this rank's chunk (`distribute_tensor(..., src_data_rank=None)`, contiguous:
//! a copy unless there is one sequence) cloned, and the batch `resize_`d in place (its storage
//! keeps the full size) and filled with it. The model then runs on `seq_len / cp` tokens per
//! sequence: transformers derives the rotary positions, the causal mask (none: SDPA's
//! `is_causal`) and the shifted labels of its loss from the local shard, so every activation
//! and the loss are the shard's. Attention is the ring (`engine::ring_attention`).

use crate::dtype::DType;
use crate::sim::engine::component::Component;
use crate::sim::engine::tracer::{T, Tracer};

use super::Strategy;

pub(crate) struct ContextParallel {
    /// Ranks of the context-parallel group.
    pub(crate) cp: u64,
    /// This rank's place in it.
    pub(crate) rank: u64,
    /// The strategy of the other mesh dimensions.
    pub(crate) data: Strategy,
}

/// The step's batch as `context_parallel` leaves it, and what its generator frame keeps until
/// the context exits (`shards`: this rank's chunk; `shard`: its clone).
pub(crate) struct ShardedBatch {
    pub(crate) inputs: T,
    kept: [T; 2],
}

impl ShardedBatch {
    /// The context exits after backward, and the loop drops its batch.
    pub(crate) fn release(self, t: &mut Tracer) {
        t.drop_all(&self.kept);
        t.drop(self.inputs);
    }
}

impl ContextParallel {
    /// The step's batch (`ids.clone()`, `rows × seq_len` ids) sharded in place by
    /// `context_parallel(mesh, buffers=[inputs], buffer_seq_dims=[1],
    /// no_restore_buffers={inputs})`: this rank's `rows × seq_len / cp` ids in the full-size
    /// storage.
    pub(crate) fn shard_batch(
        &self,
        t: &mut Tracer,
        ids: T,
        rows: u64,
        seq_len: u64,
    ) -> ShardedBatch {
        let outer = std::mem::replace(&mut t.component, Component::Inputs);
        let inputs = t.empty(t.numel(ids), DType::I64, "ids.clone() (the step's batch)");
        let indices = t.empty(seq_len, DType::I32, "head-tail load-balance indices");
        let ordered = t.empty(
            rows * seq_len,
            DType::I64,
            "torch.gather(batch, 1, indices)",
        );
        let local = seq_len / self.cp;
        let chunk = t.empty(rows * local, DType::I64, "this rank's chunk");
        t.drop_all(&[ordered, indices]);
        let shard = t.empty(rows * local, DType::I64, "shard.clone()");
        t.component = outer;
        ShardedBatch {
            inputs,
            kept: [chunk, shard],
        }
    }
}
