//! DeepSeek's multi-head latent attention (`DeepseekV2Attention.forward`,
//! `DeepseekV3Attention.forward`): queries through an optional low-rank bottleneck, keys and
//! values expanded from one compressed latent per token, a decoupled rotary key shared by the
//! heads. Query and key heads are `qk_nope + qk_rope` wide, value heads `v_head_dim`.

use super::Batch;
use super::attention::{self, Heads};
use super::transformer::{Layer, LayerContext, Model, heads_view};
use crate::arch::Family;
use crate::dtype::DType;
use crate::sim::engine::tracer::{Bwd, T, Tracer};

impl Model {
    pub(crate) fn mla_attention(
        &self,
        t: &mut Tracer,
        layer: &Layer,
        x: T,
        ctx: &LayerContext,
        batch: Batch,
    ) -> T {
        let a = &self.arch;
        let mla = a.mla.expect("an MLA family");
        let n = batch.n();
        let (heads, nope, rope) = (a.heads, mla.qk_nope_head_dim, mla.qk_rope_head_dim);
        // q = q_proj(x), or q_b_proj(q_a_layernorm(q_a_proj(x)))
        let q = match mla.q_lora_rank {
            None => self.hooked_linear(t, layer.q.expect("q_proj"), x),
            Some(_) => {
                let qa = self.hooked_linear(t, layer.q_a.expect("q_a_proj"), x);
                let normed = self.hooked_norm(t, qa, layer.q_a_norm.expect("q_a_layernorm"));
                t.drop(qa);
                let qb = self.hooked_linear(t, layer.q_b.expect("q_b_proj"), normed);
                t.drop(normed);
                qb
            }
        };
        let q_heads = heads_view(t, q, true);
        let [q_pass, q_rot] = t.split_at(q_heads, n * heads * nope);
        t.drop(q_heads);
        // compressed_kv = kv_a_proj_with_mqa(x); k_pass, k_rot = split(...)
        let kv_a = self.hooked_linear(t, layer.kv_a.expect("kv_a_proj_with_mqa"), x);
        let [k_latent, k_rot] = t.split_at(kv_a, n * mla.kv_lora_rank);
        let latent = self.hooked_norm(t, k_latent, layer.kv_a_norm.expect("kv_a_layernorm"));
        t.drop(k_latent);
        let (q_rot, k_rot) = self.mla_rotary(t, ctx, q_rot, k_rot);
        // query_states = cat(q_pass, q_rot); then `expand_kv` of the latent
        let query = t.cat2(q_pass, q_rot);
        t.drop(q_pass);
        let kv = self.hooked_linear(t, layer.kv_b.expect("kv_b_proj"), latent);
        t.drop(latent);
        let kv_heads = heads_view(t, kv, true);
        let [k_nope, v] = t.split_at(kv_heads, n * heads * nope);
        t.drop(kv_heads);
        // key_states = k_pass.new_empty(...); its two slices copied in
        let k_rot_heads = t.view(k_rot, n * heads * rope, "k_rot.expand(-1, heads, -1, -1)");
        t.record(Bwd::Reduce, &[Some(k_rot)], &[k_rot_heads], &[]);
        t.drop(k_rot);
        let key = t.empty(n * heads * mla.qk_head_dim(), t.dtype(query), "key_states");
        t.record(
            Bwd::SliceCopies,
            &[Some(k_nope), Some(k_rot_heads)],
            &[key],
            &[],
        );
        t.drop_all(&[k_nope, k_rot_heads]);
        let out = attention::attention(
            t,
            a,
            Heads::of(a),
            self.attention,
            query,
            key,
            v,
            ctx.mask,
            batch,
            self.arch.attention_dropout > 0.0,
            None,
        );
        t.drop_all(&[query, key, v]);
        let proj = self.hooked_linear(t, layer.o.expect("o_proj"), out);
        t.drop(out);
        // The forward's locals (`q`, the rotated `q_pe`, `compressed_kv`, the expanded
        // `kv`) go at its return.
        t.drop_all(&[q, q_rot, kv_a, kv]);
        proj
    }

    /// Rotary embeddings on the query's and the shared key's rotary parts: V3's interleaved
    /// `apply_rotary_pos_emb_interleave`, V2's complex product in fp32 (`apply_rotary_emb`).
    fn mla_rotary(&self, t: &mut Tracer, ctx: &LayerContext, q: T, k: T) -> (T, T) {
        if self.arch.family == Family::DeepseekV3 {
            let out = ctx.apply_rotary(t, q, k);
            t.drop_all(&[q, k]);
            return out;
        }
        let (freqs, _) = ctx.rotary_tables();
        // xq_ = view_as_complex(xq.float()); out = view_as_real(xq_ * freqs).type_as(xq):
        // the product goes with its expression, the fp32 copies at the function's return.
        let x32: Vec<T> = [q, k].iter().map(|&x| t.to(x, DType::F32)).collect();
        let mut rotated = Vec::new();
        for (&x, &x32) in [q, k].iter().zip(&x32) {
            let product = t.mul(x32, freqs);
            rotated.push(t.to(product, t.dtype(x)));
            t.drop(product);
        }
        t.drop_all(&x32);
        t.drop_all(&[q, k]);
        (rotated[0], rotated[1])
    }
}
