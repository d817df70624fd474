//! An MoE block under transformers 5.17's expert parallelism (`base_model_ep_plan` applied by
//! `apply_tensor_parallelism`, `distributed/tensor_parallel.py`), as rank 0 of `ep` ranks
//! sees it. Every rank runs every token through every layer:
//!
//! - `grouped_gemm` (`MoEParamShard(Shard(0))`): each expert weight is a `Shard(0)` DTensor
//!   of `experts / ep` experts, and the experts module's `num_experts` is that local count
//!   (the model is built over `Architecture::expert_parallel_shard`); its gradient is stolen
//!   by `AccumulateGrad` as a plain parameter's is (checked on the CPU: the local gradient is
//!   the grouped GEMM's own).
//! - `ep_router` (`EpRouterParallel`): the router runs replicated over all experts; after its
//!   forward the scores of other ranks' experts are zeroed and their indices set to the
//!   sentinel `num_local_experts`, the others remapped to local indices
//!   (`ep_router_slice`).
//! - `moe_tp_experts` (`MoeExpertsParallel`): the experts run on their local parameters
//!   (`to_local()`, views) at the full token shape; `grouped_mm_experts_forward` sorts the
//!   sentinel pairs to the tail and its grouped GEMMs skip them, `batched_mm` clamps them and
//!   weights them by zero. The partial output is all-reduced in place (`_AllReduceForward`),
//!   and the gradients of the hidden states and the scores in place in backward
//!   (`_AllReduceBackward`: `grad.contiguous()` of a contiguous gradient): none of these
//!   allocates through the caching allocator, so none is modelled (NCCL's own buffers are
//!   outside it; under the fake process group nothing moves).

use super::transformer::Model;
use crate::dtype::DType;
use crate::sim::engine::tracer::{T, Tracer};

impl Model {
    /// `EpRouterParallel.transform_output_post_forward` on the router's top-k weights `w` and
    /// indices `idx` (each `tokens × top_k`) as rank 0: the mask of other ranks' experts, the
    /// masked scores (their node keeps the mask), and the local indices with the sentinel.
    /// The router's own outputs are freed when the hook returns (autograd keeps `idx` through
    /// `topk`). Returns the new `(w, idx)`.
    pub(crate) fn ep_router_slice(&self, t: &mut Tracer, w: T, idx: T) -> (T, T) {
        let local = self
            .arch
            .moe
            .as_ref()
            .expect("an MoE family")
            .local_experts();
        let n = t.numel(idx);
        // non_local_mask = (router_indices // num_local_experts) != ep_rank
        let owner = t.empty(n, DType::I64, "router_indices // num_local_experts");
        let non_local = t.empty(n, DType::Bool, "non_local_mask");
        t.drop(owner);
        let scores = t.masked_fill(w, non_local);
        let mut indices = t.empty(n, DType::I64, "router_indices.masked_fill(-1)");
        // `x = f(x)`: the new tensor, then the comparison's temporary, then the old one.
        let mut rebind = |t: &mut Tracer, compare: Option<&'static str>, label| {
            let cond = compare.map(|c| t.empty(n, DType::Bool, c));
            let next = t.empty(n, DType::I64, label);
            if let Some(cond) = cond {
                t.drop(cond);
            }
            t.drop(indices);
            indices = next;
        };
        if local > 1 {
            rebind(t, None, "fmod(router_indices, num_local_experts)");
        } else {
            rebind(t, Some("router_indices > 0"), "masked_fill(> 0, 0)");
            rebind(t, Some("router_indices < 0"), "masked_fill(< 0, -1)");
        }
        rebind(t, Some("router_indices == -1"), "masked_fill(sentinel)");
        t.drop_all(&[non_local, w, idx]);
        (scores, indices)
    }
}
