//! Mixture-of-experts blocks as transformers 5.x runs them: each family's router
//! (`*TopKRouter.forward`), its experts under the selected implementation
//! (`integrations/moe.py`: `grouped_mm_experts_forward`, `batched_mm_experts_forward`, or the
//! class's own per-expert loop), shared experts, and peft's LoRA on the fused expert weights
//! (`lora.ParamWrapper`).
//!
//! Routing: the grouped and batched paths allocate by the number of (token, expert) pairs
//! `S = tokens × top_k` alone, whatever the router chose. Only the per-expert loop depends on
//! how tokens spread; it assumes an even spread, or the spec's `max_tokens_per_expert_factor`
//! for the busiest expert.

use super::transformer::{ExpertLora, Experts, Layer, Model};
use crate::arch::{Family, Moe, Router};
use crate::dtype::DType;
use crate::sim::engine::tracer::{Bwd, ParamId, T, Tracer};
use crate::sim::strategy::ModuleKey;
use crate::spec::ExpertsImpl;

/// What the experts receive from the router: tokens `x` (n, H), chosen experts `idx` (n, k)
/// and their weights `w` (n, k).
struct Routed {
    x: T,
    idx: T,
    w: T,
}

impl Model {
    fn moe_config(&self) -> &Moe {
        self.arch.moe.as_ref().expect("an MoE family")
    }

    /// The parameters of decoder layer `index`'s sparse MoE block where DeepSpeed makes the
    /// block a ZeRO-3 leaf module: the classes of `leaf_module_config.py`'s
    /// `DEFAULT_LEAF_MODULE_CLASSES` (Mixtral's, Qwen2-MoE's and Qwen3-MoE's
    /// `*SparseMoeBlock`), which `engine._configure_distributed_model` flags whatever the
    /// stage; only ZeRO-3's hooks read the flag.
    pub(crate) fn zero3_leaf_block(&self, index: usize) -> Option<Vec<ParamId>> {
        let moe = self.arch.moe.as_ref()?;
        let leaf = matches!(
            self.arch.family,
            Family::Mixtral | Family::Qwen2Moe | Family::Qwen3Moe
        );
        if !leaf || !moe.routes(index as u64) {
            return None;
        }
        let layer = &self.layers[index];
        let router = layer.router.expect("router");
        let experts = layer.experts.expect("experts");
        let loras = [experts.gate_up_lora, experts.down_lora]
            .into_iter()
            .flatten()
            .flat_map(|l| [l.a, l.b]);
        let shared = [
            layer.shared_gate,
            layer.shared_up,
            layer.shared_down,
            layer.shared_expert_gate,
        ]
        .into_iter()
        .flatten()
        .flat_map(|l| {
            [
                Some(l.weight),
                l.bias,
                l.lora.map(|a| a.a),
                l.lora.map(|a| a.b),
            ]
            .into_iter()
            .flatten()
        });
        Some(
            std::iter::once(router.weight)
                .chain(router.bias)
                .chain(experts.params())
                .chain(loras)
                .chain(shared)
                .collect(),
        )
    }

    /// The sparse MoE block of decoder layer `index` on the post-attention norm's output `x`.
    pub(crate) fn moe_block(&self, t: &mut Tracer, index: usize, x: T) -> T {
        let layer = &self.layers[index];
        let tokens = t.numel(x) / self.arch.hidden;
        match self.arch.family {
            Family::Qwen2Moe => {
                // shared = shared_expert(x); routed = experts(x, ...);
                // out = routed + sigmoid(shared_expert_gate(x)) * shared
                let shared = self.shared_expert(t, layer, x);
                let (w, idx) = self.route(t, layer, x, tokens);
                let routed = self.experts(t, layer, Routed { x, idx, w }, tokens);
                let gate =
                    self.hooked_linear(t, layer.shared_expert_gate.expect("shared_expert_gate"), x);
                let sig = t.sigmoid(gate);
                t.drop(gate);
                let scaled = t.mul(sig, shared);
                t.drop_all(&[sig, shared]);
                let out = t.add(routed, scaled);
                t.drop_all(&[routed, scaled]);
                out
            }
            Family::DeepseekV2 | Family::DeepseekV3 => {
                let (w, idx) = self.route(t, layer, x, tokens);
                let routed = self.experts(t, layer, Routed { x, idx, w }, tokens);
                let shared = self.shared_expert(t, layer, x);
                let out = t.add(routed, shared);
                t.drop_all(&[routed, shared]);
                out
            }
            _ => {
                let (w, idx) = self.route(t, layer, x, tokens);
                self.experts(t, layer, Routed { x, idx, w }, tokens)
            }
        }
    }

    /// The shared expert, a dense SwiGLU MLP (`Qwen2MoeMLP`, `DeepseekV2MLP`).
    fn shared_expert(&self, t: &mut Tracer, layer: &Layer, x: T) -> T {
        let gate = self.hooked_linear(t, layer.shared_gate.expect("shared gate_proj"), x);
        let act = t.silu(gate);
        t.drop(gate);
        let up = self.hooked_linear(t, layer.shared_up.expect("shared up_proj"), x);
        let prod = t.mul(act, up);
        t.drop_all(&[act, up]);
        let out = self.hooked_linear(t, layer.shared_down.expect("shared down_proj"), prod);
        t.drop(prod);
        out
    }

    /// The router: returns the top-k weights (n, k) and expert indices (n, k), under expert
    /// parallelism sliced to this rank's experts.
    fn route(&self, t: &mut Tracer, layer: &Layer, x: T, tokens: u64) -> (T, T) {
        let moe = self.moe_config();
        let router = layer.router.expect("router");
        let (e, k) = (moe.experts, moe.top_k);
        let params: Vec<ParamId> = std::iter::once(router.weight).chain(router.bias).collect();
        self.module_pre_forward(t, ModuleKey::Params(router.weight), &params, true);
        let routed = match moe.router {
            Router::Softmax | Router::SoftmaxFp32 => {
                // `hidden_states.reshape(-1, self.hidden_dim)`: the input's gradient reaches
                // the block after the router weight's `AccumulateGrad` (and its hooks).
                let flat = t.reshape(x, "hidden_states.reshape(-1, hidden_dim)");
                let logits = t.linear(flat, router.weight, None, e, false);
                t.drop(flat);
                let logits_dtype = t.dtype(logits);
                let probs = t.softmax_f32(logits);
                self.keep_router_logits(t, logits);
                let (values, idx) = t.topk(probs, tokens * k);
                t.drop(probs);
                let values = if moe.norm_topk_prob {
                    renormalise(t, values, tokens, false)
                } else {
                    values
                };
                let w = if moe.router == Router::Softmax {
                    let cast = t.to(values, logits_dtype);
                    t.drop(values);
                    cast
                } else {
                    values
                };
                (w, idx)
            }
            Router::GptOss => {
                let logits = t.linear(x, router.weight, router.bias, e, false);
                let (top, idx) = t.topk(logits, tokens * k);
                self.keep_router_logits(t, logits);
                let w = t.softmax(top);
                t.drop(top);
                (w, idx)
            }
            Router::DeepseekV2 | Router::DeepseekV3 => {
                // F.linear(x.type(float32), weight.type(float32))
                let x32 = t.to(x, DType::F32);
                let w = t.param(router.weight);
                let w32 = t.to(w, DType::F32);
                // Under autocast the product is half precision again.
                let logits = t.bmm(x32, w32, tokens * e);
                t.drop_all(&[x32, w32]);
                let out = if moe.router == Router::DeepseekV2 {
                    let scores = t.softmax_f32(logits);
                    let (values, idx) = t.topk(scores, tokens * k);
                    t.drop(scores);
                    let scaled = t.mul_scalar(values);
                    t.drop(values);
                    (scaled, idx)
                } else {
                    let scores = t.sigmoid(logits);
                    let idx = self.v3_group_limited_choice(t, scores, tokens);
                    let chosen = t.gather(scores, idx);
                    t.drop(scores);
                    let chosen = if moe.norm_topk_prob {
                        renormalise(t, chosen, tokens, true)
                    } else {
                        chosen
                    };
                    let scaled = t.mul_scalar(chosen);
                    t.drop(chosen);
                    (scaled, idx)
                };
                t.drop(logits);
                out
            }
        };
        self.module_post_forward(t);
        if moe.expert_parallel > 1 {
            let (w, idx) = routed;
            return self.ep_router_slice(t, w, idx);
        }
        routed
    }

    /// DeepSeek-V3's choice of experts (indices only, so nothing is recorded): scores plus
    /// the fp32 correction bias, the best groups, the others masked to -inf, then top-k.
    fn v3_group_limited_choice(&self, t: &mut Tracer, scores: T, tokens: u64) -> T {
        let moe = self.moe_config();
        let grad = t.set_grad_enabled(false);
        let e = moe.experts;
        let biased = t.empty(tokens * e, DType::F32, "scores + e_score_correction_bias");
        debug_assert_eq!(t.numel(scores), tokens * e);
        let groups = t.empty(tokens * e, DType::F32, "group top-2");
        let group_scores = t.empty(tokens * e, DType::F32, "group scores");
        t.drop(groups);
        let group_idx = t.empty(tokens * e, DType::I64, "topk(group_scores)");
        let group_mask = t.empty(tokens * e, DType::F32, "group_mask");
        t.drop_all(&[group_idx, group_scores]);
        let score_mask = t.empty(tokens * e, DType::F32, "score_mask (expand.reshape)");
        let as_bool = t.empty(tokens * e, DType::Bool, "score_mask.bool()");
        let inverted = t.empty(tokens * e, DType::Bool, "~score_mask");
        let masked = t.empty(tokens * e, DType::F32, "masked_fill(-inf)");
        t.drop_all(&[inverted, as_bool, score_mask, group_mask, biased]);
        let values = t.empty(tokens * moe.top_k, DType::F32, "topk values");
        let idx = t.empty(tokens * moe.top_k, DType::I64, "topk indices");
        t.drop_all(&[values, masked]);
        t.set_grad_enabled(grad);
        idx
    }

    /// `output_router_logits`: the recorder keeps each MoE layer's logits for the
    /// load-balancing loss; otherwise they go.
    fn keep_router_logits(&self, t: &mut Tracer, logits: T) {
        if self.moe_config().output_router_logits && t.grad_enabled() {
            self.router_logits.borrow_mut().push(logits);
        } else {
            t.drop(logits);
        }
    }

    fn experts(&self, t: &mut Tracer, layer: &Layer, routed: Routed, tokens: u64) -> T {
        let ex = layer.experts.expect("experts");
        self.module_pre_forward(t, ModuleKey::Params(ex.gate_up), &ex.params(), true);
        let lora = !self.adapters_disabled;
        // peft's `_activate_lora`: each wrapped parameter's parametrization is registered,
        // outermost (down) first, and its consistency check evaluates `W + BA` once.
        if lora {
            for (w, l) in [(ex.down, ex.down_lora), (ex.gate_up, ex.gate_up_lora)] {
                if l.is_some() {
                    let check = t.empty(
                        t.numel(t.param(w)),
                        t.dtype(t.param(w)),
                        "parametrization check (W + BA)",
                    );
                    t.drop(check);
                }
            }
        }
        let out = match self.experts_impl {
            ExpertsImpl::GroupedMm => self.grouped_mm_experts(t, &ex, &routed, tokens),
            ExpertsImpl::BatchedMm => self.batched_mm_experts(t, &ex, &routed, tokens),
            ExpertsImpl::Eager => self.eager_experts(t, &ex, &routed, tokens),
        };
        t.drop_all(&[routed.idx, routed.w]);
        self.module_post_forward(t);
        out
    }

    /// An expert parameter as the experts read it: the parameter, or under peft's
    /// `ParamWrapper` the cached `baddbmm(W, B, A)`, a full copy that requires grad.
    fn expert_weight(&self, t: &mut Tracer, w: ParamId, lora: Option<ExpertLora>) -> T {
        let base = t.param(w);
        match lora.filter(|_| !self.adapters_disabled) {
            None => t.share(base),
            Some(l) => {
                let dtype = t.dtype(base);
                let b = t.param(l.b);
                let lhs = t.to(b, dtype);
                let a = t.param(l.a);
                let rhs = t.to(a, dtype);
                let merged = t.baddbmm(base, lhs, rhs);
                t.drop_all(&[lhs, rhs]);
                merged
            }
        }
    }

    /// `grouped_mm_experts_forward`: sort the (token, expert) pairs by expert, gather their
    /// rows, two grouped GEMMs around the gate, weight, restore the order, sum over k. The
    /// function's locals (the gathered rows, the sorted weights, the last `proj_out`, the
    /// down projection's gathered bias) live to its return.
    fn grouped_mm_experts(&self, t: &mut Tracer, ex: &Experts, r: &Routed, tokens: u64) -> T {
        let moe = self.moe_config();
        let (h, i, e) = (self.arch.hidden, moe.intermediate, moe.local_experts());
        let s = tokens * moe.top_k;
        let (ids_g, perm) = t.sort(r.idx);
        let rows = t.empty(s, DType::I64, "perm // top_k");
        let selected = t.index_rows(r.x, rows, s * h, "hidden_states[perm // top_k]");
        t.drop(rows);
        let w_g = t.index_rows(r.w, perm, s, "top_k_weights[perm]");
        let as_int = t.empty(s, DType::I32, "expert_ids_g.int()");
        let counts = t.empty(e, DType::I32, "histc");
        let offsets = t.empty(e, DType::I32, "offsets (cumsum)");
        let sentinel = t.empty(s, DType::Bool, "expert_ids_g >= num_experts");
        let gate_up_bias = ex.gate_up_bias.map(|b| {
            let b = t.param(b);
            t.index_rows(b, ids_g, s * 2 * i, "gate_up_proj_bias[expert_ids_g]")
        });
        // `selected_hidden_states_g.masked_fill_(...)`: the local is the masked tensor now.
        let selected = {
            let masked = t.masked_fill_in_place(selected, sentinel);
            t.drop(selected);
            masked
        };
        let w_gu = self.expert_weight(t, ex.gate_up, ex.gate_up_lora);
        let mut proj = t.grouped_mm(selected, w_gu, s * 2 * i);
        t.drop(w_gu);
        if let Some(bias) = gate_up_bias {
            proj = add_in_place(t, proj, bias);
        }
        let filled = t.masked_fill(proj, sentinel);
        t.drop(proj);
        let act = self.expert_gate(t, filled);
        t.drop(filled);
        // `selected_biases` rebound: the gate-up projection's goes once the down one's is made.
        let down_bias = ex.down_bias.map(|b| {
            let b = t.param(b);
            t.index_rows(b, ids_g, s * h, "down_proj_bias[expert_ids_g]")
        });
        if let Some(bias) = gate_up_bias {
            t.drop(bias);
        }
        let w_d = self.expert_weight(t, ex.down, ex.down_lora);
        let mut out = t.grouped_mm(act, w_d, s * h);
        t.drop_all(&[act, w_d]);
        if let Some(bias) = down_bias {
            out = add_in_place(t, out, bias);
        }
        let proj_out = t.masked_fill(out, sentinel);
        t.drop(out);
        let weighted = t.mul(proj_out, w_g);
        let inv_perm = t.empty(s, DType::I64, "inv_perm");
        let arange = t.empty(s, DType::I64, "arange(S)");
        t.drop(arange);
        let reordered = t.index_rows(weighted, inv_perm, s * h, "weighted_out[inv_perm]");
        t.drop(weighted);
        // weighted_out.view(num_tokens, num_top_k, hidden_dim).sum(dim=1)
        let summed = t.view_sum(reordered, tokens * h);
        let out = t.to(summed, t.dtype(r.x));
        // The function's locals go at its return, in the order they were first bound.
        t.drop_all(&[
            ids_g, perm, selected, w_g, as_int, counts, offsets, sentinel,
        ]);
        if let Some(bias) = down_bias {
            t.drop(bias);
        }
        t.drop_all(&[proj_out, reordered, inv_perm, summed]);
        out
    }

    /// `batched_mm_experts_forward`: each token repeated k times, each pair's expert weights
    /// gathered (S copies of an expert's matrices), batched matmuls, weighted sum over k. The
    /// function's locals (the repeated tokens, the clamped ids, the down projection's gathered
    /// weights and bias, the last `proj_out` and `weighted_out`) live to its return.
    fn batched_mm_experts(&self, t: &mut Tracer, ex: &Experts, r: &Routed, tokens: u64) -> T {
        let moe = self.moe_config();
        let (h, i) = (self.arch.hidden, moe.intermediate);
        let s = tokens * moe.top_k;
        let repeated = t.empty(s * h, t.dtype(r.x), "repeat_interleave(top_k)");
        t.record(Bwd::Reduce, &[Some(r.x)], &[repeated], &[]);
        let ids = t.empty(s, DType::I64, "expert_ids.clamp()");
        let w_gu = self.expert_weight(t, ex.gate_up, ex.gate_up_lora);
        let gathered_gu = t.index_rows(w_gu, ids, s * 2 * i * h, "gate_up_proj[expert_ids]");
        t.drop(w_gu);
        let gate_up_bias = ex.gate_up_bias.map(|b| {
            let b = t.param(b);
            t.index_rows(b, ids, s * 2 * i, "gate_up_proj_bias[expert_ids]")
        });
        let mut proj = t.bmm(repeated, gathered_gu, s * 2 * i);
        if let Some(bias) = gate_up_bias {
            proj = add_in_place(t, proj, bias);
        }
        let act = self.expert_gate(t, proj);
        t.drop(proj);
        // `selected_weights` and `selected_biases` rebound: each old one goes once its new
        // one is made.
        let w_d = self.expert_weight(t, ex.down, ex.down_lora);
        let gathered_d = t.index_rows(w_d, ids, s * h * i, "down_proj[expert_ids]");
        t.drop_all(&[w_d, gathered_gu]);
        let down_bias = ex.down_bias.map(|b| {
            let b = t.param(b);
            t.index_rows(b, ids, s * h, "down_proj_bias[expert_ids]")
        });
        if let Some(bias) = gate_up_bias {
            t.drop(bias);
        }
        let mut out = t.bmm(act, gathered_d, s * h);
        t.drop(act);
        if let Some(bias) = down_bias {
            out = add_in_place(t, out, bias);
        }
        let weighted = t.mul(out, r.w);
        // weighted_out.view(num_tokens, num_top_k, hidden_dim).sum(dim=1)
        let summed = t.view_sum(weighted, tokens * h);
        let result = t.to(summed, t.dtype(r.x));
        // The function's locals go at its return, in the order they were first bound.
        t.drop_all(&[repeated, ids, gathered_d]);
        if let Some(bias) = down_bias {
            t.drop(bias);
        }
        t.drop_all(&[out, weighted, summed]);
        result
    }

    /// The experts class's own `forward`: for each expert that received tokens, gather them,
    /// its MLP on its slice of the fused weights, weight, and `index_add_` into the output.
    fn eager_experts(&self, t: &mut Tracer, ex: &Experts, r: &Routed, tokens: u64) -> T {
        let moe = self.moe_config();
        let (h, i, e, k) = (self.arch.hidden, moe.intermediate, moe.experts, moe.top_k);
        let s = tokens * k;
        let mut out = t.empty(tokens * h, t.dtype(r.x), "zeros_like(hidden_states)");
        let grad = t.set_grad_enabled(false);
        let one_hot = t.empty(s * e, DType::I64, "one_hot(top_k_index)");
        let hits_sum = t.empty(e, DType::I64, "expert_mask.sum()");
        let hit = t.empty(e, DType::Bool, "> 0");
        t.drop(hits_sum);
        let hit_list = t.nonzero(e.min(s));
        t.drop(hit);
        t.set_grad_enabled(grad);
        let w_gu = self.expert_weight(t, ex.gate_up, ex.gate_up_lora);
        let w_d = self.expert_weight(t, ex.down, ex.down_lora);
        for n_e in self.tokens_per_expert(s, e) {
            let pairs = t.nonzero(n_e);
            let current = t.index_rows(r.x, pairs, n_e * h, "hidden_states[token_idx]");
            let gate_up_w = t.slice(w_gu, 2 * i * h);
            let mut proj = t.bmm(current, gate_up_w, n_e * 2 * i);
            t.drop_all(&[gate_up_w, current]);
            if let Some(b) = ex.gate_up_bias {
                let b = t.param(b);
                let bias = t.slice(b, 2 * i);
                proj = add_in_place(t, proj, bias);
                t.drop(bias);
            }
            let act = self.expert_gate(t, proj);
            t.drop(proj);
            let down_w = t.slice(w_d, h * i);
            let mut down = t.bmm(act, down_w, n_e * h);
            t.drop_all(&[down_w, act]);
            if let Some(b) = ex.down_bias {
                let b = t.param(b);
                let bias = t.slice(b, h);
                down = add_in_place(t, down, bias);
                t.drop(bias);
            }
            let weight = t.index_rows(r.w, pairs, n_e, "top_k_weights[token_idx, top_k_pos]");
            let weighted = t.mul(down, weight);
            t.drop_all(&[down, weight]);
            let cast = t.to(weighted, t.dtype(out));
            t.drop(weighted);
            let added = t.view(out, tokens * h, "index_add_ (in place)");
            t.record(Bwd::IndexAdd, &[Some(out), Some(cast)], &[added], &[pairs]);
            t.drop_all(&[out, cast, pairs]);
            out = added;
        }
        t.drop_all(&[w_gu, w_d, one_hot, hit_list]);
        out
    }

    /// Tokens each hit expert receives: an even spread of the `s` pairs over the experts, the
    /// busiest getting `max_tokens_per_expert_factor` times its share.
    fn tokens_per_expert(&self, s: u64, e: u64) -> Vec<u64> {
        let hits = e.min(s);
        let even = s / hits;
        let busiest = ((even as f64 * self.routing_factor).round() as u64).clamp(even, s);
        let mut left = s - busiest;
        let mut out = vec![busiest];
        for j in 1..hits {
            let share = left / (hits - j);
            out.push(share);
            left -= share;
        }
        out
    }

    /// The experts' activation on the (S, 2I) projection: SwiGLU on its halves, or gpt-oss's
    /// clamped GLU on the interleaved columns. Returns (S, I).
    fn expert_gate(&self, t: &mut Tracer, proj: T) -> T {
        let [gate, up] = t.chunk2(proj);
        if self.arch.family == Family::GptOss {
            // gate = gate.clamp(max=limit); up = up.clamp(-limit, limit)
            // glu = gate * sigmoid(gate * alpha); out = (up + 1) * glu
            let gate_c = t.clamp(gate);
            let up_c = t.clamp(up);
            t.drop_all(&[gate, up]);
            let scaled = t.mul_scalar(gate_c);
            let sig = t.sigmoid(scaled);
            t.drop(scaled);
            let glu = t.mul(gate_c, sig);
            t.drop_all(&[gate_c, sig]);
            let up1 = t.add_scalar(up_c);
            t.drop(up_c);
            let out = t.mul(up1, glu);
            t.drop_all(&[up1, glu]);
            out
        } else {
            let act = t.silu(gate);
            let out = t.mul(act, up);
            t.drop_all(&[gate, up, act]);
            out
        }
    }

    /// `load_balancing_loss_func` over the kept router logits: per layer a softmax in the
    /// logits' dtype (saved), its top-k, per-expert counts and probability sums; returns the
    /// auxiliary loss (a scalar) to add, or `None` when the logits are not kept.
    pub(crate) fn load_balancing_loss(&self, t: &mut Tracer, tokens: u64) -> Option<T> {
        let logits: Vec<T> = std::mem::take(&mut *self.router_logits.borrow_mut());
        if logits.is_empty() {
            return None;
        }
        let moe = self.moe_config();
        let e = moe.experts;
        let mut tokens_sum = t.empty(e, DType::F32, "tokens_per_expert_sum");
        let mut probs_sum = t.empty(e, DType::F32, "router_prob_sum");
        for l in logits {
            let probs = t.softmax(l);
            t.drop(l);
            let (values, idx) = t.topk(probs, tokens * moe.top_k);
            t.drop(values);
            let counts = t.empty(e, DType::I64, "bincount");
            t.drop(idx);
            let counts_f = t.empty(e, DType::F32, "bincount.float()");
            t.drop(counts);
            let next_tokens = t.add(tokens_sum, counts_f);
            t.drop_all(&[counts_f, tokens_sum]);
            tokens_sum = next_tokens;
            let probs_f = t.to(probs, DType::F32);
            t.drop(probs);
            let summed = t.sum_dim(probs_f, e);
            t.drop(probs_f);
            let next_probs = t.add(probs_sum, summed);
            t.drop_all(&[summed, probs_sum]);
            probs_sum = next_probs;
        }
        let per_expert = t.mul_scalar(tokens_sum);
        let prob_per_expert = t.mul_scalar(probs_sum);
        t.drop_all(&[tokens_sum, probs_sum]);
        let product = t.mul(per_expert, prob_per_expert);
        t.drop_all(&[per_expert, prob_per_expert]);
        let sum = t.mean_all(product);
        t.drop(product);
        let loss = t.mul_scalar(sum);
        t.drop(sum);
        Some(loss)
    }
}

/// `values /= values.sum(dim=-1, keepdim=True)` over each token's `k` values (DeepSeek-V3
/// adds `1e-20` to the sum first, `plus_eps`): in place, so the weights keep their dtype
/// where autocast sums in fp32.
fn renormalise(t: &mut Tracer, values: T, tokens: u64, plus_eps: bool) -> T {
    let sum = t.sum_dim(values, tokens);
    let denominator = if plus_eps {
        let d = t.add_scalar(sum);
        t.drop(sum);
        d
    } else {
        sum
    };
    let out = t.div_in_place(values, denominator);
    t.drop(denominator);
    out
}

/// `a.add_(b)`: the result shares `a`'s storage; `b`'s gradient is the incoming one.
fn add_in_place(t: &mut Tracer, a: T, b: T) -> T {
    let out = t.view(a, t.numel(a), "add_ (in place)");
    t.record(Bwd::Add, &[Some(a), Some(b)], &[out], &[]);
    t.drop(a);
    out
}
