//! Megatron-core 0.19's `MoELayer` as `get_gpt_layer_local_spec(num_experts=E,
//! moe_grouped_gemm=False)` builds it, translated into tracer ops as rank 0 of `ep` expert-parallel
//! ranks runs it (`transformer/moe/moe_layer.py`, `router.py`, `token_dispatcher.py`
//! (`MoEAlltoAllTokenDispatcher`), `experts.py` (`SequentialMLP`), `moe_utils.py`). Megatron's
//! defaults otherwise: no z-loss, no capacity factor, no shared expert; the router in the
//! activations' dtype or fp32 (`moe_router_dtype`), with or without the Switch load-balancing loss
//! (`moe_aux_loss_coeff`). Expert tensor parallelism (`etp`) splits each
//! expert's `linear_fc1` (column-parallel) and `linear_fc2` (row-parallel, its reduction left to
//! the dispatcher: `explicit_expert_comm`) over the `etp` ranks of the `expt_tp` group.
//!
//! Routing is data-dependent; the model assumes it balanced: token `i` of a rank's `n` goes to
//! experts `(i·k + j) mod E`, `j < k`, so every expert receives `n·k / E` tokens of every rank
//! (the first `n·k mod E` one more), and every rank's dispatch is the same ([`Experts`]).
//!
//! What a forward allocates, in order:
//! - `TopKRouter`: `RouterGatingLinearFunction` (`mm(x, w.t())`, `[n, E]` logits, saving `x` and
//!   `w`), `topk` (values and int64 indices, the indices saved), `softmax(scores,
//!   dtype=float32)` (an fp32 copy of the bf16 scores, then the softmax, its result saved),
//!   `.type_as(logits)`, then `zeros_like(logits).scatter(1, idx, probs)` (the routed
//!   probabilities, `[n, E]`) and `zeros_like(logits).int().scatter(1, idx, 1).bool()` (the
//!   routing map). An fp32 router casts the input and the weight up for the `mm` (its backward
//!   casts each operand up and each gradient back down), so the logits, the probabilities and
//!   everything the dispatcher makes of them are fp32; each expert's `per_token_scale` product
//!   is then fp32, cast back to bf16.
//! - with the load-balancing loss, in a forward with grad: an fp32 softmax of all the logits
//!   (saved by its backward), its own top k and routing map, the tokens per expert, the Switch
//!   loss `sum(probs.sum(0) * tokens_per_expert) * c` and `MoEAuxLossAutoScaler`, whose output
//!   views `probs`; the metrics tracker's per-layer values are made at the first record.
//! - `dispatch_preprocess`: the token counts (`routing_map.sum(0)`, moved to the host), then
//!   `permute`: `routing_map.T.contiguous()`, its stable `argsort` (`sort`: values, int64
//!   indices, cub's scratch), `[:n·k]` (a view keeping the whole argsort), `% n`,
//!   `probs.T.contiguous()[flat_sorted]` and `tokens.index_select(0, sorted_indices)` (`[n·k, h]`).
//!   The dispatcher keeps `probs`, `routing_map` and the sorted indices as attributes until the
//!   layer's next forward.
//! - with `ep > 1`, `_AllToAll` of the tokens and of the probabilities into new tensors of the
//!   rows this rank receives; the permuted tokens stay referenced until the layer returns.
//! - `dispatch_postprocess`: with `etp > 1`, `gather_from_sequence_parallel_region` of the
//!   tokens and of the probabilities over the `expt_tp` group (`torch.empty` of the `etp` ranks'
//!   rows, nothing saved; backward reduce-scatters the gradient into a new tensor of the rows
//!   this rank sent).
//! - with more than one local expert, `sort_chunks_by_idxs` (`split` then `cat`: a copy) of
//!   the tokens and probabilities by local expert (the gathered ones go when it returns), and
//!   back after the experts.
//! - `SequentialMLP`: each local expert's `MLP` on its `split` rows, the probabilities applied
//!   after the activation (`per_token_scale`), then `torch.cat` of the outputs.
//! - `combine_preprocess`: with `etp > 1`, `reduce_scatter_to_sequence_parallel_region` of the
//!   experts' output (already bf16, the probabilities' dtype) into a new tensor of this rank's
//!   rows (backward all-gathers the gradient).
//! - `_AllToAll` back (`ep > 1`), then `unpermute`: `zeros([n, h]).scatter_add_(0, idx, tokens)`.
//!
//! Under full recomputation the `probs` a layer keeps come from the recomputed forward, an
//! autograd graph that ends in the checkpoint's detached input: that input and the gradient
//! backward stored on it stay until the layer's next forward replaces `probs`.

use std::cell::RefCell;

use super::megatron_mlp::mlp;
use crate::dtype::DType;
use crate::sim::engine::tracer::{Bwd, ParamId, T, Tracer};

/// The router's parameter name: `Router.__init__` makes it on the host (fp32, cast to the
/// parameters' dtype there); `model.cuda()` moves it with the norms.
pub(crate) const ROUTER_WEIGHT: &str = "router.weight";
/// The prefix of the local experts' parameters (`allreduce` false with `ep > 1`: they go to the
/// expert-data-parallel buffer).
pub(crate) const EXPERT_PREFIX: &str = "experts.";

/// The experts of every MoE layer and how rank 0 of `ep` holds and receives them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Experts {
    /// `num_moe_experts` (E).
    pub count: u64,
    /// `moe_router_topk` (k).
    pub top_k: u64,
    /// `moe_ffn_hidden_size`.
    pub width: u64,
    /// `expert_model_parallel_size`.
    pub ep: u64,
    /// `expert_tensor_parallel_size`.
    pub etp: u64,
    /// The router's dtype: the activations' (bf16), or fp32 (`moe_router_dtype: fp32`).
    pub router_dtype: DType,
    /// Whether each training forward computes the Switch load-balancing loss.
    pub aux_loss: bool,
    /// `num_layers` of the whole model: the length of the loss tracker's per-layer values.
    pub model_layers: u64,
}

impl Experts {
    /// Experts on each rank (`num_local_experts`); rank 0 holds experts `0..local`.
    pub fn local(&self) -> u64 {
        self.count / self.ep
    }

    /// Each expert's `moe_ffn_hidden_size` on this rank (`divide(ffn, etp)`).
    pub fn local_width(&self) -> u64 {
        self.width / self.etp
    }

    /// Tokens each expert receives from one rank of `tokens` under the balanced routing.
    pub fn per_expert(&self, tokens: u64) -> Vec<u64> {
        let routed = tokens * self.top_k;
        let (base, extra) = (routed / self.count, routed % self.count);
        (0..self.count)
            .map(|e| base + u64::from(e < extra))
            .collect()
    }

    /// Rows rank 0's local experts receive from the `ep` identical ranks through the
    /// all-to-all.
    pub fn received(&self, tokens: u64) -> Vec<u64> {
        self.per_expert(tokens)
            .into_iter()
            .take(self.local() as usize)
            .map(|rows| rows * self.ep)
            .collect()
    }

    /// Rows each local expert runs on (`tokens_per_expert`): what the `etp` identical ranks of
    /// the `expt_tp` group received, all-gathered.
    pub fn gathered(&self, tokens: u64) -> Vec<u64> {
        self.received(tokens)
            .into_iter()
            .map(|rows| rows * self.etp)
            .collect()
    }
}

/// What `MoEAlltoAllTokenDispatcher` keeps from a forward until the layer's next one.
#[derive(Debug, Default)]
struct Held {
    probs: Option<T>,
    routing_map: Option<T>,
    sorted_indices: Option<T>,
    /// The tracer's kept graph `probs` carries when a full recomputation made it.
    graph: Option<u32>,
}

/// One MoE layer on this rank.
#[derive(Debug)]
pub(crate) struct MoeLayer {
    router: ParamId,
    /// Each local expert's `linear_fc1` and `linear_fc2`.
    experts: Vec<(ParamId, ParamId)>,
    held: RefCell<Held>,
}

impl MoeLayer {
    /// `MoELayer.__init__`: the router, then `SequentialMLP`'s local experts, in
    /// `named_parameters()` order, through `param` (which makes each as the model does).
    pub(crate) fn build(
        t: &mut Tracer,
        param: &mut impl FnMut(&mut Tracer, u64, DType, &'static str) -> ParamId,
        hidden: u64,
        experts: Experts,
    ) -> Self {
        let router = param(t, experts.count * hidden, DType::BF16, ROUTER_WEIGHT);
        let width = experts.local_width();
        let experts = (0..experts.local())
            .map(|_| {
                (
                    param(
                        t,
                        2 * width * hidden,
                        DType::BF16,
                        "experts.linear_fc1.weight",
                    ),
                    param(t, hidden * width, DType::BF16, "experts.linear_fc2.weight"),
                )
            })
            .collect();
        MoeLayer {
            router,
            experts,
            held: RefCell::new(Held::default()),
        }
    }

    /// `MoELayer.forward` on the `n` rows of `x` (`[s, b, h]`): its output, `[n, h]`.
    pub(crate) fn forward(&self, t: &mut Tracer, x: T, n: u64, hidden: u64, spec: Experts) -> T {
        let (probs, routing_map) = self.route(t, x, n, spec);
        // `dispatch_preprocess`: the dispatcher keeps both until the next forward.
        self.hold(t, |held| &mut held.probs, probs);
        if let Some(graph) = self.held.borrow_mut().graph.take() {
            t.release_kept_graph(graph);
        }
        self.hold(t, |held| &mut held.routing_map, routing_map);
        let counts = t.empty(spec.count, DType::I64, "routing_map.sum(dim=0)");
        t.drop(counts);
        // `dispatch_preprocess`: `hidden_states.view(-1, h)`, whose gradient comes back as a view.
        let flat = t.reshape(x, "hidden_states.view(-1, h)");
        let (permuted, permuted_probs, sorted_indices) = permute(t, flat, probs, n, hidden, spec);
        t.drop_all(&[probs, routing_map, flat]);
        self.hold(t, |held| &mut held.sorted_indices, sorted_indices);
        // `token_dispatch`: the all-to-alls (`_AllToAll` returns its input with one rank).
        let received: u64 = spec.received(n).iter().sum();
        let (global, global_probs) = if spec.ep > 1 {
            let tokens = all_to_all(t, permuted, received * hidden);
            let probs = all_to_all(t, permuted_probs, received);
            t.drop(permuted_probs);
            (tokens, probs)
        } else {
            (t.share(permuted), permuted_probs)
        };
        let output = self.experts_compute(t, global, global_probs, hidden, spec, n);
        let combined = if spec.ep > 1 {
            let back = all_to_all(t, output, n * spec.top_k * hidden);
            t.drop(output);
            back
        } else {
            output
        };
        // `unpermute`: `zeros(restore_shape).scatter_add_(0, idx.expand(-1, h), tokens)`.
        let zeros = t.empty(n * hidden, DType::BF16, "unpermute: zeros");
        let out = t.view(zeros, n * hidden, "scatter_add_ (in place)");
        t.record(
            Bwd::GatherBack,
            &[Some(combined)],
            &[out],
            &[sorted_indices],
        );
        // `combine` returns, then `custom_forward`: its locals go in their order
        // (`hidden_states`, the permuted tokens; `probs`; `dispatched_input`).
        t.drop_all(&[
            zeros,
            combined,
            sorted_indices,
            permuted,
            global_probs,
            global,
        ]);
        out
    }

    /// The router's weight.
    pub(crate) fn router(&self) -> ParamId {
        self.router
    }

    /// The recomputation of a checkpoint that just ran this layer made `probs` on kept graph
    /// `graph` (see [`Tracer::keep_recomputed_graph`]).
    pub(crate) fn hold_graph(&self, graph: u32) {
        self.held.borrow_mut().graph = Some(graph);
    }

    /// Replace the dispatcher's attribute with `value` (a reference of its own); the old one goes.
    fn hold(&self, t: &mut Tracer, slot: impl Fn(&mut Held) -> &mut Option<T>, value: T) {
        let kept = t.share(value);
        let old = slot(&mut self.held.borrow_mut()).replace(kept);
        if let Some(old) = old {
            t.drop(old);
        }
    }

    /// `TopKRouter.forward`: the routed probabilities `[n, E]` (in the router's dtype) and the
    /// routing map.
    fn route(&self, t: &mut Tracer, x: T, n: u64, spec: Experts) -> (T, T) {
        let e = spec.count;
        let dtype = spec.router_dtype;
        let w = t.param(self.router);
        // `RouterGatingLinearFunction`: `mm(inp.to(router_dtype), weight.to(router_dtype).t())`,
        // the casts (no-ops in bf16) going as the call returns.
        let casts = (dtype != t.dtype(x)).then(|| {
            [
                t.empty(t.numel(x), dtype, "inp.to(router_dtype)"),
                t.empty(e * t.numel(x) / n, dtype, "weight.to(router_dtype)"),
            ]
        });
        let logits = t.empty(n * e, dtype, "router logits (mm)");
        t.ensure_cublas_workspace();
        if let Some(casts) = casts {
            t.drop_all(&casts);
        }
        t.record(Bwd::RouterGating, &[Some(x), Some(w)], &[logits], &[x, w]);
        let (scores, indices) = t.topk(logits, n * spec.top_k);
        // `softmax(scores, dtype=float32)`: CUDA's half-to-float kernel takes fp16 only, so a
        // bf16 input is cast to fp32 first (`SoftMax.cpp`); `type_as(logits)` casts it back.
        let probs32 = t.softmax_f32(scores);
        let probs = t.to(probs32, dtype);
        t.drop_all(&[probs32, scores]);
        let zeros = t.empty(n * e, dtype, "zeros_like(logits)");
        let routed = t.empty(n * e, dtype, "routing probs (scatter)");
        t.record(Bwd::GatherBack, &[Some(probs)], &[routed], &[indices]);
        t.drop_all(&[zeros, probs]);
        let map = routing_map(t, logits, n * e);
        t.drop(indices);
        let routed = if spec.aux_loss {
            self.aux_loss(t, logits, routed, n, spec)
        } else {
            routed
        };
        t.drop(logits);
        (routed, map)
    }

    /// `TopKRouter.routing`'s load-balancing loss in a training forward:
    /// `compute_routing_scores_for_aux_loss` (an fp32 softmax of every logit, saved by its
    /// backward, then its own top k and routing map), the tokens per expert
    /// (`routing_map.sum(0)`, all-reduced in place over tp × cp), the Switch loss
    /// (`probs.sum(0) * tokens_per_expert`, summed and scaled), the tracker's record and
    /// `MoEAuxLossAutoScaler`, whose output views `probs` and whose backward seeds the loss's
    /// gradient.
    fn aux_loss(&self, t: &mut Tracer, logits: T, probs: T, n: u64, spec: Experts) -> T {
        if !t.grad_enabled() {
            return probs;
        }
        let e = spec.count;
        let scores = t.softmax_f32(logits);
        // `_, top_indices = topk(scores, k)`: the values' backward node (saving the indices)
        // goes with the values, which nothing reads; so nothing is recorded.
        let values = t.empty(n * spec.top_k, DType::F32, "topk values (aux loss)");
        let indices = t.empty(n * spec.top_k, DType::I64, "topk indices (aux loss)");
        let map = routing_map(t, logits, n * e);
        // The function returns: its locals `_` (the values) and `top_indices` go.
        t.drop_all(&[values, indices]);
        let tokens = column_sums(t, n, e);
        let per_expert = t.sum_dim(scores, e);
        t.reduction_staging(e, n, DType::F32);
        let product = t.mul(per_expert, tokens);
        let sum = t.sum_dim(product, 1);
        t.drop(product);
        let loss = t.mul_scalar(sum);
        t.drop_all(&[sum, per_expert, tokens]);
        // `MoEMetricsTracker.record`: `zeros(num_layers)` at the first record of the process,
        // then `values[layer] += (aux_loss / coeff).detach()` in place.
        t.process_global("MoEMetricsTracker values", |t| {
            t.empty(spec.model_layers, DType::F32, "load_balancing_loss values")
        });
        let logged = t.empty(1, DType::F32, "aux_loss / coeff");
        t.drop(logged);
        let scaled = t.view(probs, t.numel(probs), "MoEAuxLossAutoScaler output");
        t.record(
            Bwd::AuxLossScaler,
            &[Some(probs), Some(loss)],
            &[scaled],
            &[loss],
        );
        // `routing` returns: the map and scores for the loss go (the scores stay saved).
        t.drop_all(&[probs, loss, map, scores]);
        scaled
    }

    /// `routed_experts_compute`: gather over the expert-tensor-parallel ranks, sort by local
    /// expert, `SequentialMLP`, sort back, reduce-scatter.
    fn experts_compute(
        &self,
        t: &mut Tracer,
        tokens: T,
        probs: T,
        hidden: u64,
        spec: Experts,
        n: u64,
    ) -> T {
        let rows = spec.gathered(n);
        let (tokens, probs) = if spec.etp > 1 {
            let total: u64 = rows.iter().sum();
            (gather(t, tokens, total * hidden), gather(t, probs, total))
        } else {
            (t.share(tokens), t.share(probs))
        };
        let sorted = self.experts.len() > 1;
        let (tokens, probs) = if sorted {
            let out = (sort_chunks(t, tokens), sort_chunks(t, probs));
            t.drop_all(&[tokens, probs]);
            out
        } else {
            (tokens, probs)
        };
        let width = spec.local_width();
        let output = if self.experts.len() == 1 {
            let (fc1, fc2) = self.experts[0];
            mlp(t, (fc1, fc2), width, hidden, tokens, Some(probs), None)
        } else {
            let token_parts = split(t, tokens, &rows, hidden);
            let prob_parts = split(t, probs, &rows, 1);
            let outputs: Vec<T> = self
                .experts
                .iter()
                .zip(token_parts.iter().zip(&prob_parts))
                .map(|(&(fc1, fc2), (&x, &p))| mlp(t, (fc1, fc2), width, hidden, x, Some(p), None))
                .collect();
            let total = rows.iter().sum::<u64>() * hidden;
            let out = t.empty(total, DType::BF16, "cat(expert outputs)");
            let inputs: Vec<Option<T>> = outputs.iter().copied().map(Some).collect();
            t.record(Bwd::Cat, &inputs, &[out], &[]);
            // `forward` returns: its local `output` (the last expert's) goes first, then
            // `output_local_list`, whose items a list releases last to first.
            for &output in outputs.iter().rev() {
                t.drop(output);
            }
            t.drop_all(&token_parts);
            t.drop_all(&prob_parts);
            out
        };
        // `combine_preprocess`; the experts' input and output stay referenced until
        // `routed_experts_compute` returns.
        let back = if sorted {
            sort_chunks(t, output)
        } else {
            t.share(output)
        };
        let out = if spec.etp > 1 {
            // `reduce_scatter(hidden_states.to(probs.dtype)).to(hidden_states.dtype)`.
            let received: u64 = spec.received(n).iter().sum();
            let up = t.to(back, t.dtype(probs));
            let scattered = reduce_scatter(t, up, received * hidden);
            t.drop(up);
            let down = t.to(scattered, t.dtype(back));
            t.drop(scattered);
            down
        } else {
            t.share(back)
        };
        t.drop_all(&[back, output, tokens, probs]);
        out
    }
}

/// `zeros_like(logits).int().scatter(1, indices, 1).bool()`: the routing map `[n, E]`, each
/// temporary going as the next call returns.
fn routing_map(t: &mut Tracer, logits: T, numel: u64) -> T {
    let zeros = t.empty(numel, t.dtype(logits), "zeros_like(logits)");
    let ints = t.empty(numel, DType::I32, "zeros_like(logits).int()");
    t.drop(zeros);
    let scattered = t.empty(numel, DType::I32, "scatter(1, idx, 1)");
    t.drop(ints);
    let map = t.empty(numel, DType::Bool, "routing_map (.bool())");
    t.drop(scattered);
    map
}

/// `map.sum(dim=0)` of a boolean `[n, E]` routing map: the int64 counts per expert, the map
/// cast to int64 first and its columns reduced through a global staging buffer.
fn column_sums(t: &mut Tracer, n: u64, experts: u64) -> T {
    let sums = t.empty(experts, DType::I64, "map.sum(dim=0)");
    let cast = t.empty(n * experts, DType::I64, "map as int64 (sum)");
    t.reduction_staging(experts, n, DType::I64);
    t.drop(cast);
    sums
}

/// `permute(tokens, routing_map, probs, num_out_tokens=n·k)` without fusion: the permuted tokens
/// `[n·k, h]`, their probabilities and the sorted token indices.
fn permute(t: &mut Tracer, x: T, probs: T, n: u64, hidden: u64, spec: Experts) -> (T, T, T) {
    let (e, out_rows) = (spec.count, n * spec.top_k);
    let transposed = t.empty(n * e, DType::Bool, "routing_map.T.contiguous()");
    let (values, argsort) = t.sort(transposed);
    t.drop(values);
    let flat_sorted = t.view(argsort, out_rows, "argsort[:num_out_tokens]");
    t.drop(argsort);
    let sorted_indices = t.empty(out_rows, DType::I64, "flat_sorted % num_tokens");
    let probs_t = t.contiguous_copy(probs);
    let permuted_probs = t.index_rows(probs_t, flat_sorted, out_rows, "permuted probs");
    t.drop_all(&[probs_t, flat_sorted]);
    // `index_select`: its backward is `zeros(x).index_add_(0, idx, grad)`.
    let permuted = t.empty(
        out_rows * hidden,
        t.dtype(x),
        "tokens.index_select (permuted)",
    );
    t.record(Bwd::Slice, &[Some(x)], &[permuted], &[sorted_indices]);
    t.drop(transposed);
    (permuted, permuted_probs, sorted_indices)
}

/// `_AllToAll.forward`: a new tensor of the `numel` elements this rank receives.
fn all_to_all(t: &mut Tracer, x: T, numel: u64) -> T {
    let out = t.empty(numel, t.dtype(x), "all_to_all output");
    t.record(Bwd::GatherBack, &[Some(x)], &[out], &[]);
    out
}

/// `gather_from_sequence_parallel_region` over the expert-tensor-parallel ranks
/// (`_gather_along_first_dim` with split sizes): a new tensor of the `numel` elements gathered.
fn gather(t: &mut Tracer, x: T, numel: u64) -> T {
    let out = t.empty(numel, t.dtype(x), "all_gather over expt_tp");
    t.record(Bwd::GatherBack, &[Some(x)], &[out], &[]);
    out
}

/// `reduce_scatter_to_sequence_parallel_region` over the expert-tensor-parallel ranks: a new
/// tensor of this rank's `numel` elements.
fn reduce_scatter(t: &mut Tracer, x: T, numel: u64) -> T {
    let out = t.empty(numel, t.dtype(x), "reduce_scatter over expt_tp");
    t.record(Bwd::GatherBack, &[Some(x)], &[out], &[]);
    out
}

/// `sort_chunks_by_idxs` without fusion: `torch.split` into chunks (views), `torch.cat` of them
/// in another order (a copy). Backward slices the gradient (views) and concatenates it back.
fn sort_chunks(t: &mut Tracer, x: T) -> T {
    let numel = t.numel(x);
    let chunks = t.view(x, numel, "split (chunks)");
    t.record(Bwd::Split, &[Some(x)], &[chunks], &[]);
    let out = t.empty(numel, t.dtype(x), "cat (sorted chunks)");
    t.record(Bwd::Cat, &[Some(chunks)], &[out], &[]);
    t.drop(chunks);
    out
}

/// `torch.split(x, rows)` of rows of `width`: one view per part.
fn split(t: &mut Tracer, x: T, rows: &[u64], width: u64) -> Vec<T> {
    let parts: Vec<T> = rows
        .iter()
        .map(|&r| t.view(x, r * width, "split (per expert)"))
        .collect();
    t.record(Bwd::Split, &[Some(x)], &parts, &[]);
    parts
}

/// What the measuring harness adds for balanced routing (`balanced_routing` in
/// `python/headroom_measure/megatron.py`), before the first step: the fixed routing map
/// `[n, E]` (kept), made from `arange(n)[:, None] * k + arange(k)` and its `% E`.
pub(crate) fn harness_routing_map(t: &mut Tracer, n: u64, spec: Experts) -> T {
    let k = spec.top_k;
    let arange = t.empty(n, DType::I64, "arange(tokens)");
    let scaled = t.empty(n, DType::I64, "arange * k");
    t.drop(arange);
    let offsets = t.empty(k, DType::I64, "arange(k)");
    let rows = t.empty(n * k, DType::I64, "expert of each pick");
    t.drop_all(&[offsets, scaled]);
    let map = t.empty(
        n * spec.count,
        DType::Bool,
        "balanced routing map (harness)",
    );
    let modulo = t.empty(n * k, DType::I64, "rows % E");
    t.drop(modulo);
    // `fixed.sum(dim=0).min()` and `.max()` check the map: each sum casts the map to int64 and
    // reduces its columns through a global staging buffer.
    for _ in 0..2 {
        let sums = column_sums(t, n, spec.count);
        let extreme = t.empty(1, DType::I64, "min() / max()");
        t.drop_all(&[sums, extreme]);
    }
    t.drop(rows);
    t.mark_persistent(map);
    map
}

#[cfg(test)]
mod tests {
    use super::*;

    const QWEN3_30B: Experts = Experts {
        count: 128,
        top_k: 8,
        width: 768,
        ep: 1,
        etp: 1,
        router_dtype: DType::BF16,
        aux_loss: false,
        model_layers: 48,
    };

    /// Every expert receives `n·k / E` tokens; the remainder goes one each to the first experts,
    /// as the map `(i·k + j) mod E` sends them.
    #[test]
    fn balanced_routing_spreads_every_pick() {
        assert!(
            QWEN3_30B
                .per_expert(4096)
                .iter()
                .all(|&rows| rows == 4096 * 8 / 128)
        );
        let odd = QWEN3_30B.per_expert(100);
        assert_eq!(odd.iter().sum::<u64>(), 800);
        let direct = (0..100u64)
            .flat_map(|i| (0..8).map(move |j| (i * 8 + j) % 128))
            .fold(vec![0u64; 128], |mut counts, e| {
                counts[e as usize] += 1;
                counts
            });
        assert_eq!(odd, direct);
    }

    /// Rank 0 of `ep` holds `E / ep` experts and receives, from `ep` identical ranks, as many
    /// rows as it sends: `n·k` when they divide evenly.
    #[test]
    fn each_rank_receives_what_it_sends() {
        for ep in [1, 2, 4, 8, 16, 128] {
            let spec = Experts { ep, ..QWEN3_30B };
            let received = spec.received(2048);
            assert_eq!(received.len() as u64, 128 / ep);
            assert_eq!(received.iter().sum::<u64>(), 2048 * 8, "ep {ep}");
            assert!(received.iter().all(|&r| r == 2048 * 8 * ep / 128));
        }
    }

    /// With expert tensor parallelism each local expert runs on the rows its `etp` ranks
    /// received, at `1 / etp` of its width.
    #[test]
    fn expert_tensor_parallel_ranks_gather_their_rows() {
        let spec = Experts {
            ep: 2,
            etp: 4,
            ..QWEN3_30B
        };
        assert_eq!(spec.local_width(), 192);
        let (received, gathered) = (spec.received(2048), spec.gathered(2048));
        assert_eq!(received.iter().sum::<u64>(), 2048 * 8);
        assert_eq!(gathered.iter().sum::<u64>(), 4 * 2048 * 8);
        assert_eq!(gathered.len(), received.len());
    }
}
