//! Megatron-core 0.19's `GPTModel` built from the local layer spec (`get_gpt_layer_local_spec`:
//! no Transformer Engine, no apex), translated line by line into tracer ops as one
//! tensor-parallel rank runs it. Shapes: `s` positions by `b` sequences (Megatron keeps the
//! sequence first), `n = s * b` rows; `np`, `ng`, `f`, `v` are this rank's heads, query
//! groups, MLP width and vocabulary (`1/tp` of each).
//!
//! What each module allocates (`models/gpt/gpt_model.py`, `transformer/transformer_layer.py`,
//! `transformer/attention.py`, `transformer/dot_product_attention.py`,
//! `fusions/fused_softmax.py`, `models/common/embeddings/rope_utils.py`,
//! `tensor_parallel/layers.py`, `tensor_parallel/cross_entropy.py`, `transformer/mlp.py`):
//! - `VocabParallelEmbedding`: with tp > 1 the ids outside this rank's rows are masked and
//!   shifted (`input_.clone() - start`), the lookup zeroed there and all-reduced in place;
//!   `LanguageModelEmbedding` then copies it to `[s, b, h]` (`transpose(0, 1).contiguous()`).
//! - the norms are `torch.nn.RMSNorm` (`WrappedTorchNorm`, made fp32 and cast to bf16 by
//!   `Float16Module`): `_fused_rms_norm` saves its input and an fp32 `rstd` per row.
//! - with sequence parallelism the embedding's output, the norms and the residual adds work on
//!   `s/tp` rows and the parallel linears gather and scatter the sequence (`model::megatron_sp`).
//! - `ColumnParallelLinear` / `RowParallelLinear` (`LinearWithGradAccumulationAndAsync...`
//!   without gradient-accumulation fusion): `matmul(x, w.t())` saving input and weight, a qkv
//!   bias added out of place; the tensor-parallel reductions are in place.
//! - attention: the fused qkv output viewed per query group and split; the query `reshape`
//!   copies where a rank has more than one query group (the groups' stride does not merge),
//!   and is a view with one; Qwen3's q/k norms; rotary embeddings unfused:
//!   `t[..., :rot]` is `t` itself, the empty `t[..., rot:]` a slice whose backward zero-fills
//!   the input's size, `t * cos + rotate_half(t) * sin` (`cat(-x2, x1)`), `cat((t, t_pass))`;
//!   `cos`/`sin` computed from the cached `freqs` at every call and saved by the products.
//! - `DotProductAttention`: key and value `repeat_interleave`d to the heads; `baddbmm` into a
//!   new `[b·np, s, s]` bf16 tensor beside the persistent "mpu" buffer it is given
//!   (`get_global_memory_buffer`); `FusedScaleMaskSoftmax`'s torch path: `.float()`, the
//!   causal mask (made at every call: fp32 ones, `triu`, `.bool()`) filled in place and saved,
//!   `Softmax` (saves its fp32 result), `.bfloat16()`;
//!   `bmm` with the values, then `permute(...).contiguous()`.
//! - `bias_dropout_add` without fusion: dropout 0 is the identity, `residual + out`.
//! - the MLP: `linear_fc1` to `2f`, `chunk`, `silu(x0) * (x1 + glu_linear_offset)` (the sum
//!   a new tensor), `linear_fc2`; an MoE model's is `MoELayer` (`model::megatron_moe`).
//! - the output layer's logits (bf16, freed once the loss is computed) and
//!   `_VocabParallelCrossEntropy`: `.float()` (the fp32 copy is worked in place into the
//!   softmax, which it saves), the row max with its indices, the targets masked and shifted.
//! - recomputation: `tensor_parallel.checkpoint` of whole layers (`full`, chunks as
//!   `spec::Megatron::checkpointed_chunks` says) or of each layer's core attention
//!   (`selective`, from q, k and v after the rotary embedding), reentrant: the recomputation
//!   runs the whole region when its gradient arrives and keeps its output, and that
//!   gradient, through the region's backward.

use std::cell::{Cell, RefCell};
use std::collections::BTreeMap;
use std::ops::Range;
use std::rc::Rc;

use super::Batch;
use super::megatron_mlp::mlp;
use super::megatron_moe::{EXPERT_PREFIX, Experts, MoeLayer, ROUTER_WEIGHT};
use super::megatron_sp::{
    SequenceParallel, column_parallel, mpu_buffer, row_parallel, scatter_embedding,
};
use crate::arch::{Architecture, Family};
use crate::dtype::DType;
use crate::sim::engine::component::Component;
use crate::sim::engine::tracer::{Bwd, ParamId, T, Tracer};
use crate::sim::strategy::Strategy;
use crate::spec::Megatron;

/// One rank's widths.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Widths {
    pub hidden: u64,
    /// Attention heads and query groups of this rank.
    pub heads: u64,
    pub groups: u64,
    pub head_dim: u64,
    /// MLP width (`ffn_hidden_size / tp`) and vocabulary rows (`vocab / tp`) of this rank.
    pub ffn: u64,
    pub vocab: u64,
    pub tp: u64,
    /// `config.sequence_parallel` (with tp > 1): the activations between the parallel linears
    /// are `1/tp` of the sequence (`model::megatron_sp`).
    pub sequence_parallel: bool,
}

#[derive(Debug)]
struct Layer {
    input_norm: ParamId,
    proj: ParamId,
    qkv: ParamId,
    qkv_bias: Option<ParamId>,
    q_norm: Option<ParamId>,
    k_norm: Option<ParamId>,
    mlp_norm: ParamId,
    mlp: Mlp,
}

/// A layer's MLP: dense (`linear_fc1`, `linear_fc2`) or Megatron's `MoELayer`.
#[derive(Debug)]
enum Mlp {
    Dense { fc1: ParamId, fc2: ParamId },
    Moe(MoeLayer),
}

/// A checkpointed region: whole layers, or one module of a layer (selective recomputation).
#[derive(Clone, Debug)]
enum Region {
    Layers(Range<usize>),
    CoreAttention,
    /// Layer `l`'s dense MLP.
    Mlp(usize),
    /// Layer `l`'s `MoELayer`.
    Moe(usize),
}

/// Tensors this model keeps for the life of the process: the rotary `freqs`
/// (`RotaryEmbedding.forward`, an `lru_cache` per instance).
#[derive(Default)]
struct Cache {
    freqs: Option<T>,
    /// This step's checkpointed regions of this model, by the tracer's id (the chunks of a
    /// virtual pipeline number theirs in one sequence).
    regions: BTreeMap<u32, Region>,
}

/// What a pipeline stage of `GPTModel` holds: its decoder layers, the embedding on the first
/// stage (`pre_process`), the final norm, the output layer and the loss on the last
/// (`post_process`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct StagePart {
    pub layers: u64,
    pub pre_process: bool,
    pub post_process: bool,
}

/// A stage's input: the token ids on the first stage, the received hidden states elsewhere.
#[derive(Clone, Copy, Debug)]
pub(crate) enum StageInput {
    Ids(T),
    Hidden(T),
}

pub(crate) struct GptModel {
    pub(crate) widths: Widths,
    embedding: Option<ParamId>,
    layers: Vec<Layer>,
    /// The final norm and the output layer (the last stage's).
    head: Option<(ParamId, ParamId)>,
    /// Every parameter in `named_parameters()` order, which are vectors (1-D) and which are
    /// local experts'.
    pub(crate) params: Vec<ParamId>,
    pub(crate) vectors: Vec<bool>,
    pub(crate) expert_params: Vec<bool>,
    /// The index in `params` of the tied weight a pipeline's first stage (its embedding) and
    /// last stage (its copy) each hold, marked `shared_embedding`.
    pub(crate) shared_embedding: Option<usize>,
    /// The MoE layers' experts (`None`: a dense model).
    pub(crate) experts: Option<Experts>,
    megatron: Megatron,
    pub(crate) strategy: RefCell<Strategy>,
    cache: RefCell<Cache>,
    /// The "mpu" buffer `baddbmm` is given (`parallel_state`'s `_GLOBAL_MEMORY_BUFFER`): one
    /// per process, shared by the model chunks of a virtual pipeline.
    pub(crate) global_memory_buffer: Rc<Cell<Option<T>>>,
}

impl GptModel {
    /// `GPTModel(config, layer_spec, ...)` on the GPU (`use_cpu_initialization=False`: each
    /// weight made in place, in construction order, which is `named_parameters()` order), the
    /// norms fp32 on the host as `torch.nn.RMSNorm` makes them; `model.cuda()` moves those,
    /// then `Float16Module`'s `bfloat16()` casts them.
    /// A pipeline stage (`pre_process`, `post_process`) holds the part `part` says.
    pub(crate) fn build_stage(
        t: &mut Tracer,
        arch: &Architecture,
        tp: u64,
        sequence_parallel: bool,
        megatron: Megatron,
        part: StagePart,
    ) -> Self {
        let experts = arch.moe.as_ref().map(|moe| Experts {
            count: moe.experts,
            top_k: moe.top_k,
            width: moe.intermediate,
            ep: megatron.expert_parallel,
            etp: megatron.etp(tp),
            router_dtype: if megatron.router_fp32 {
                DType::F32
            } else {
                DType::BF16
            },
            aux_loss: megatron.aux_loss(),
            model_layers: arch.layers,
        });
        let widths = Widths {
            hidden: arch.hidden,
            heads: arch.heads / tp,
            groups: arch.kv_heads / tp,
            head_dim: arch.head_dim,
            ffn: arch.intermediate / tp,
            vocab: megatron.padded_vocab(arch.vocab, tp) / tp,
            tp,
            sequence_parallel: sequence_parallel && tp > 1,
        };
        let Widths {
            hidden: h,
            heads,
            groups,
            head_dim: d,
            ffn: f,
            vocab: v,
            ..
        } = widths;
        let mut params = Vec::new();
        let mut vectors = Vec::new();
        let mut expert_params = Vec::new();
        let mut norms = Vec::new();
        let mut param = |t: &mut Tracer, numel: u64, dtype: DType, label: &'static str| {
            // `torch.nn.RMSNorm` and the MoE router make their weights on the host; the layers
            // make theirs on the GPU.
            let p = if dtype == DType::F32 || label == ROUTER_WEIGHT {
                let p = t.parameter_deferred(numel, dtype, true, label);
                norms.push(p);
                p
            } else {
                t.parameter(numel, dtype, true, label)
            };
            params.push(p);
            vectors.push(dtype == DType::F32 || label.ends_with("bias"));
            expert_params.push(label.starts_with(EXPERT_PREFIX));
            p
        };
        let embedding = part
            .pre_process
            .then(|| param(t, v * h, DType::BF16, "word_embeddings.weight"));
        let qkv_width = (heads + 2 * groups) * d;
        // Qwen3's and Qwen3-MoE's `qk_layernorm`.
        let qk_norm = matches!(arch.family, Family::Qwen3 | Family::Qwen3Moe);
        let layers = (0..part.layers)
            .map(|_| Layer {
                input_norm: param(t, h, DType::F32, "input_layernorm.weight"),
                proj: param(t, h * heads * d, DType::BF16, "linear_proj.weight"),
                qkv: param(t, qkv_width * h, DType::BF16, "linear_qkv.weight"),
                qkv_bias: (arch.family == Family::Qwen2)
                    .then(|| param(t, qkv_width, DType::BF16, "linear_qkv.bias")),
                q_norm: qk_norm.then(|| param(t, d, DType::F32, "q_layernorm.weight")),
                k_norm: qk_norm.then(|| param(t, d, DType::F32, "k_layernorm.weight")),
                mlp_norm: param(t, h, DType::F32, "pre_mlp_layernorm.weight"),
                mlp: match experts {
                    Some(experts) => Mlp::Moe(MoeLayer::build(t, &mut param, h, experts)),
                    None => Mlp::Dense {
                        fc1: param(t, 2 * f * h, DType::BF16, "linear_fc1.weight"),
                        fc2: param(t, h * f, DType::BF16, "linear_fc2.weight"),
                    },
                },
            })
            .collect();
        let head = part.post_process.then(|| {
            let final_norm = param(t, h, DType::F32, "final_layernorm.weight");
            // `share_embeddings_and_output_weights`: a stage holding the embedding multiplies by
            // its weight (`skip_weight_param_allocation`); a last stage without it makes its own,
            // which `setup_embeddings_and_output_layer` zero-fills and sums over the embedding
            // group in place.
            let output = match embedding {
                Some(shared) if arch.tie_word_embeddings => shared,
                _ => param(t, v * h, DType::BF16, "output_layer.weight"),
            };
            (final_norm, output)
        });
        // `setup_embeddings_and_output_layer` marks the tied weight of a stage that holds one
        // end of the model and not the other.
        let shared_embedding = (arch.tie_word_embeddings && part.pre_process != part.post_process)
            .then(|| {
                let shared = embedding.or(head.map(|(_, output)| output))?;
                params.iter().position(|&p| p == shared)
            })
            .flatten();
        // `model.cuda()` (Megatron-LM's `get_model`), then `Float16Module`'s `bfloat16()`.
        for p in norms {
            t.materialize(p);
        }
        for &p in &params {
            t.cast_parameter(p, DType::BF16);
        }
        GptModel {
            widths,
            embedding,
            layers,
            head,
            params,
            vectors,
            expert_params,
            shared_embedding,
            experts,
            megatron,
            strategy: RefCell::new(Strategy::Local),
            cache: RefCell::new(Cache::default()),
            global_memory_buffer: Rc::default(),
        }
    }

    /// `ddp_model(input_ids, position_ids, None, labels=input_ids)`: the per-token losses
    /// `[b, s]` (fp32).
    pub(crate) fn forward(&self, t: &mut Tracer, ids: T, batch: Batch) -> T {
        self.forward_stage(t, StageInput::Ids(ids), batch)
    }

    /// A stage's forward: its layers over the embedded ids or the received hidden states, then
    /// on the last stage the losses; elsewhere the last layer's output `[s, b, h]`.
    pub(crate) fn forward_stage(&self, t: &mut Tracer, input: StageInput, batch: Batch) -> T {
        // Regions are numbered across the micro-batches whose graphs are alive.
        let alive = t.region_count();
        self.cache.borrow_mut().regions.retain(|&id, _| id < alive);
        let n = batch.n();
        let outer = std::mem::replace(&mut t.component, Component::Activations);
        let mut hidden = match input {
            StageInput::Ids(ids) => self.embedding_forward(t, ids, batch),
            // `TransformerBlock` takes `self.input_tensor` as it is (not a view).
            StageInput::Hidden(received) => t.share(received),
        };
        let freqs = self.rotary_freqs(t, batch.s);
        let chunks = self.megatron.checkpointed_chunks(self.layers.len());
        let mut layer = 0;
        while layer < self.layers.len() {
            let chunk = chunks.iter().find(|c| c.start == layer).cloned();
            let end = chunk.as_ref().map_or(layer + 1, |c| c.end);
            if let Some(chunk) = chunk {
                let id = t.begin_reentrant_region(&[hidden]);
                self.push_region(id, Region::Layers(chunk));
            }
            for l in layer..end {
                let next = self.layer_forward(t, l, hidden, freqs, batch);
                t.drop(hidden);
                hidden = next;
            }
            if self.checkpointed_layer(layer) {
                t.end_region();
            }
            layer = end;
        }
        let Some((final_norm, output)) = self.head else {
            t.component = outer;
            return hidden;
        };
        let normed = self.rms_norm(t, hidden, final_norm, self.rows(n));
        t.drop(hidden);
        t.component = Component::LogitsAndLoss;
        let logits = column_parallel(t, normed, output, self.widths.vocab, self.sp());
        t.drop(normed);
        let loss = self.cross_entropy(t, logits, batch);
        t.drop(logits);
        t.component = outer;
        loss
    }

    /// Sequence parallelism's communication, when on.
    fn sp(&self) -> Option<SequenceParallel<'_>> {
        self.widths.sequence_parallel.then_some(SequenceParallel {
            tp: self.widths.tp,
            buffer: &self.global_memory_buffer,
        })
    }

    /// This rank's rows of the `n` between the parallel linears (what a pipeline stage sends).
    pub(crate) fn rows(&self, n: u64) -> u64 {
        if self.widths.sequence_parallel {
            n / self.widths.tp
        } else {
            n
        }
    }

    /// The elements of this chunk's gradients `finalize_model_grads` sums over the tp ranks
    /// (`model::megatron_sp::allreduce_norm_grads`): the norms and MoE routers marked
    /// `sequence_parallel`, and Qwen3's q/k norms (summed by name) with or without it.
    pub(crate) fn tp_summed_grad_numel(&self, t: &Tracer) -> u64 {
        if self.widths.tp == 1 {
            return 0;
        }
        let numel = |p: Option<ParamId>| p.map_or(0, |p| t.numel(t.param(p)));
        let sp = self.widths.sequence_parallel;
        let mut total = 0;
        for layer in &self.layers {
            total += numel(layer.q_norm) + numel(layer.k_norm);
            if sp {
                total += numel(Some(layer.input_norm)) + numel(Some(layer.mlp_norm));
                // `Router` marks its weight `sequence_parallel` as the config says.
                if let Mlp::Moe(moe) = &layer.mlp {
                    total += numel(Some(moe.router()));
                }
            }
        }
        if sp {
            total += numel(self.head.map(|(norm, _)| norm));
        }
        total
    }

    fn push_region(&self, id: u32, region: Region) {
        self.cache.borrow_mut().regions.insert(id, region);
    }

    fn checkpointed_layer(&self, layer: usize) -> bool {
        self.megatron
            .checkpointed_chunks(self.layers.len())
            .iter()
            .any(|c| c.start == layer)
    }

    /// `VocabParallelEmbedding`, whose masks and lookup go as it returns, then
    /// `LanguageModelEmbedding`'s copy to `[s, b, h]`, or with sequence parallelism the
    /// embedding's own copy reduce-scattered and `LanguageModelEmbedding`'s clone of it.
    fn embedding_forward(&self, t: &mut Tracer, ids: T, batch: Batch) -> T {
        let (h, n) = (self.widths.hidden, batch.n());
        let masks = (self.widths.tp > 1).then(|| crate::sim::strategy::tp::mask_ids(t, n));
        let lookup_ids = masks.map_or(ids, |(_, shifted)| shifted);
        let embedding = self.embedding.expect("the first stage holds the embedding");
        let looked_up = t.embedding(embedding, lookup_ids, n, h);
        let drop_masks = |t: &mut Tracer| {
            if let Some((mask, shifted)) = masks {
                t.drop_all(&[mask, shifted]);
            }
        };
        match self.sp() {
            Some(sp) => {
                let embedded = transpose_contiguous(t, looked_up, batch.b);
                t.drop(looked_up);
                let scattered = scatter_embedding(t, embedded, sp);
                t.drop(embedded);
                drop_masks(t);
                let cloned = t.contiguous_copy(scattered);
                t.drop(scattered);
                cloned
            }
            None => {
                drop_masks(t);
                let embedded = transpose_contiguous(t, looked_up, batch.b);
                t.drop(looked_up);
                embedded
            }
        }
    }

    /// `RotaryEmbedding.forward(s)` (an `lru_cache`): `outer(arange(s), inv_freq)` doubled,
    /// `[s, 1, 1, d]` fp32, made once.
    fn rotary_freqs(&self, t: &mut Tracer, s: u64) -> T {
        if let Some(freqs) = self.cache.borrow().freqs {
            return freqs;
        }
        let d = self.widths.head_dim;
        let seq = t.empty(s, DType::F32, "arange(max_seq_len)");
        let outer = t.empty(s * d / 2, DType::F32, "outer(seq, inv_freq)");
        t.drop(seq);
        let freqs = t.empty(s * d, DType::F32, "rotary freqs (cached)");
        t.drop(outer);
        t.mark_persistent(freqs);
        self.cache.borrow_mut().freqs = Some(freqs);
        freqs
    }

    /// `TransformerLayer.forward`.
    fn layer_forward(&self, t: &mut Tracer, l: usize, x: T, freqs: T, batch: Batch) -> T {
        let layer = &self.layers[l];
        let rows = self.rows(batch.n());
        let normed = self.rms_norm(t, x, layer.input_norm, rows);
        let attention = self.attention(t, layer, normed, freqs, batch);
        // `_forward_attention` and `_forward_mlp` hold their norm's output until they return,
        // after the bias-dropout-add.
        let hidden = t.add(x, attention);
        t.drop_all(&[attention, normed]);
        let normed = self.rms_norm(t, hidden, layer.mlp_norm, rows);
        let modules = self.megatron.recompute.modules();
        let (checkpointed, region) = match layer.mlp {
            Mlp::Dense { .. } => (modules.mlp, Region::Mlp(l)),
            Mlp::Moe(_) => (modules.moe, Region::Moe(l)),
        };
        let mlp = if checkpointed {
            let id = t.begin_reentrant_region(&[normed]);
            self.push_region(id, region);
            let out = self.mlp_forward(t, l, normed, rows);
            t.end_region();
            out
        } else {
            self.mlp_forward(t, l, normed, rows)
        };
        let out = t.add(hidden, mlp);
        t.drop_all(&[normed, mlp, hidden]);
        out
    }

    /// Layer `l`'s MLP on the `rows` rows of `x`: its dense `MLP` or its `MoELayer`.
    fn mlp_forward(&self, t: &mut Tracer, l: usize, x: T, rows: u64) -> T {
        match (&self.layers[l].mlp, self.experts) {
            (Mlp::Dense { fc1, fc2 }, _) => mlp(
                t,
                (*fc1, *fc2),
                self.widths.ffn,
                self.widths.hidden,
                x,
                None,
                self.sp(),
            ),
            (Mlp::Moe(moe), Some(experts)) => moe.forward(t, x, rows, self.widths.hidden, experts),
            (Mlp::Moe(_), None) => unreachable!("MoE layers are built with their experts"),
        }
    }

    /// `torch.nn.RMSNorm` over `rows` rows (`_fused_rms_norm`):
    /// the output and an fp32 `rstd` per row, both the input and `rstd` saved.
    fn rms_norm(&self, t: &mut Tracer, x: T, weight: ParamId, rows: u64) -> T {
        let out = t.empty(t.numel(x), t.dtype(x), "rms_norm output");
        let rstd = t.empty(rows, DType::F32, "rms_norm rstd");
        let w = t.param(weight);
        t.record(
            Bwd::LayerNorm,
            &[Some(x), Some(w), None],
            &[out],
            &[x, rstd],
        );
        t.drop(rstd);
        out
    }

    /// `SelfAttention.forward` up to `linear_proj`'s (all-reduced) output.
    fn attention(&self, t: &mut Tracer, layer: &Layer, x: T, freqs: T, batch: Batch) -> T {
        let Widths {
            hidden: h,
            heads,
            groups,
            head_dim: d,
            ..
        } = self.widths;
        let n = batch.n();
        let qkv_width = (heads + 2 * groups) * d;
        let mixed = match (layer.qkv_bias, self.sp()) {
            (Some(bias), None) => t.megatron_linear_bias(x, layer.qkv, bias, qkv_width),
            (bias, sp) => {
                let mixed = column_parallel(t, x, layer.qkv, qkv_width, sp);
                match bias {
                    Some(bias) => {
                        let b = t.param(bias);
                        let biased = t.add(mixed, b);
                        t.drop(mixed);
                        biased
                    }
                    None => mixed,
                }
            }
        };
        let (q_numel, kv_numel) = (n * heads * d, n * groups * d);
        let parts = [
            t.view(mixed, q_numel, "query (split)"),
            t.view(mixed, kv_numel, "key (split)"),
            t.view(mixed, kv_numel, "value (split)"),
        ];
        t.record(Bwd::Split, &[Some(mixed)], &parts, &[]);
        t.drop(mixed);
        let [query_split, key, value] = parts;
        // `query.reshape(sq, b, np, hn)` of the split `[sq, b, ng, np/ng·hn]`: with one query
        // group on this rank only the last dimension splits, a view; with more the groups'
        // stride does not merge and it copies.
        let query_is_view = groups == 1;
        let mut query = if query_is_view {
            query_split
        } else {
            let copy = t.contiguous_copy(query_split);
            t.drop(query_split);
            copy
        };
        let mut key = key;
        if let Some(q_norm) = layer.q_norm {
            // `_fused_rms_norm` makes a (non-contiguous) view contiguous first.
            let contiguous = query_is_view
                .then(|| t.empty(q_numel, t.dtype(query), "query.contiguous() (rms_norm)"));
            let normed = self.rms_norm(t, query, q_norm, n * heads);
            if let Some(contiguous) = contiguous {
                t.drop(contiguous);
            }
            t.drop(query);
            query = normed;
        }
        if let Some(k_norm) = layer.k_norm {
            // `_fused_rms_norm` makes its (non-contiguous) input contiguous first.
            let contiguous = t.empty(kv_numel, t.dtype(key), "key.contiguous() (rms_norm)");
            let normed = self.rms_norm(t, key, k_norm, n * groups);
            t.drop_all(&[contiguous, key]);
            key = normed;
        }
        let query_rot = self.rotary(t, query, freqs, batch.s);
        let key_rot = self.rotary(t, key, freqs, batch.s);
        let context = if self.megatron.recompute.modules().core_attn {
            let id = t.begin_reentrant_region(&[query_rot, key_rot, value]);
            self.push_region(id, Region::CoreAttention);
            let out = self.core_attention(t, query_rot, key_rot, value, batch);
            t.end_region();
            out
        } else {
            self.core_attention(t, query_rot, key_rot, value, batch)
        };
        let out = row_parallel(t, context, layer.proj, h, self.sp());
        // `forward` returns: its `qkv_output` tuple held what `get_query_key_value_tensors`
        // returned (the key and value views keep `linear_qkv`'s output), and its locals the
        // rotated query and key and the context, until now.
        t.drop_all(&[query, key_rot, key, value, query_rot, context]);
        out
    }

    /// `apply_rotary_pos_emb` without fusion (`_apply_rotary_pos_emb_bshd`) on `x`
    /// (`[s, b, heads, d]`), with `freqs` covering the whole head.
    fn rotary(&self, t: &mut Tracer, x: T, freqs: T, s: u64) -> T {
        let numel = t.numel(x);
        let d = self.widths.head_dim;
        // A slice over a whole dimension is the tensor itself (`applySlice`); the empty
        // remainder is a view whose backward zero-fills the input's size.
        let rotated_part = t.share(x);
        let pass = t.slice(x, 0);
        let trig = |t: &mut Tracer, label: &'static str| {
            let f = t.numel(freqs);
            let raw = t.empty(f, DType::F32, "cos/sin(freqs)");
            let scaled = t.empty(f, DType::F32, "* mscale");
            t.drop(raw);
            let cast = t.empty(s * d, t.dtype(x), label);
            t.drop(scaled);
            cast
        };
        let cos = trig(t, "cos_ (rotary)");
        let sin = trig(t, "sin_ (rotary)");
        let by_cos = t.mul(rotated_part, cos);
        let halves = [
            t.view(rotated_part, numel / 2, "x1 (chunk)"),
            t.view(rotated_part, numel / 2, "x2 (chunk)"),
        ];
        t.record(Bwd::Split, &[Some(rotated_part)], &halves, &[]);
        let negated = t.neg(halves[1]);
        let rotated_half = t.cat2(negated, halves[0]);
        t.drop(negated);
        let by_sin = t.mul(rotated_half, sin);
        t.drop(rotated_half);
        let sum = t.add(by_cos, by_sin);
        // `BINARY_OP` releases its left operand, then its right.
        t.drop_all(&[by_cos, by_sin]);
        let out = t.cat2(sum, pass);
        t.drop(sum);
        t.drop_all(&[halves[0], halves[1], sin, cos, pass, rotated_part]);
        out
    }

    /// `DotProductAttention.forward`: the attention context `[s, b, np·d]`.
    fn core_attention(&self, t: &mut Tracer, query: T, key: T, value: T, batch: Batch) -> T {
        let Widths {
            heads,
            groups,
            head_dim: d,
            ..
        } = self.widths;
        let (b, s) = (batch.b, batch.s);
        let n = b * s;
        let repeat = |t: &mut Tracer, x: T, label: &'static str| {
            if heads == groups {
                return t.share(x);
            }
            let out = t.empty(n * heads * d, t.dtype(x), label);
            t.record(Bwd::Reduce, &[Some(x)], &[out], &[]);
            out
        };
        let key = repeat(t, key, "key.repeat_interleave");
        let value = repeat(t, value, "value.repeat_interleave");
        let scores_numel = b * heads * s * s;
        let buffer = mpu_buffer(t, &self.global_memory_buffer, scores_numel);
        let scores = t.empty(scores_numel, t.dtype(query), "baddbmm (attention scores)");
        t.ensure_cublas_workspace();
        t.record(
            Bwd::Baddbmm,
            &[Some(buffer), Some(query), Some(key)],
            &[scores],
            &[query, key],
        );
        // `FusedScaleMaskSoftmax.forward_torch_softmax`.
        let scores32 = t.to(scores, DType::F32);
        let mask = self.causal_mask(t, s);
        let masked = t.view(scores32, scores_numel, "masked_fill_ (in place)");
        t.record(Bwd::MaskedFill, &[Some(scores32)], &[masked], &[mask]);
        // `Softmax` on an fp32 input (its backward takes a gradient-sized scratch).
        let probs32 = t.empty(scores_numel, DType::F32, "softmax (fp32)");
        t.record(Bwd::Softmax, &[Some(masked)], &[probs32], &[probs32]);
        let probs = t.to(probs32, t.dtype(query));
        // `probs` rebound, then `forward_torch_softmax` returns: its mask and fp32 input go.
        t.drop_all(&[probs32, mask, masked, scores32]);
        let context = t.bmm(probs, value, n * heads * d);
        let out = t.contiguous_copy(context);
        t.drop_all(&[context, key, value, scores, probs]);
        out
    }

    /// `get_default_causal_mask(s)`, made again at every call: `triu(ones(s, s), 1).bool()`.
    fn causal_mask(&self, t: &mut Tracer, s: u64) -> T {
        let outer = std::mem::replace(&mut t.component, Component::Inputs);
        let ones = t.empty(s * s, DType::F32, "torch.ones(s, s)");
        let upper = t.empty(s * s, DType::F32, "torch.triu");
        t.drop(ones);
        let mask = t.empty(s * s, DType::Bool, "causal mask");
        t.drop(upper);
        t.component = outer;
        mask
    }

    /// `compute_language_model_loss`: the labels copied to `[s, b]`,
    /// `_VocabParallelCrossEntropy`, the losses copied back to `[b, s]`.
    fn cross_entropy(&self, t: &mut Tracer, logits: T, batch: Batch) -> T {
        let (v, n) = (self.widths.vocab, batch.n());
        // `labels.transpose(0, 1).contiguous()`: the labels themselves with one sequence.
        let labels = (batch.b > 1).then(|| {
            t.empty_as(
                n,
                DType::I64,
                Component::Inputs,
                "labels.transpose.contiguous",
            )
        });
        let logits32 = t.empty(n * v, DType::F32, "logits.float() (softmax, in place)");
        let max = t.empty(n, DType::F32, "logits_max");
        let argmax = t.empty(n, DType::I64, "max indices");
        t.drop(argmax);
        let below = t.empty(n, DType::Bool, "target < vocab_start");
        let above = t.empty(n, DType::Bool, "target >= vocab_end");
        let target_mask = t.empty(n, DType::Bool, "target_mask");
        t.drop_all(&[above, below]);
        let clone = t.empty(n, DType::I64, "target.clone()");
        let masked_target = t.empty(n, DType::I64, "target.clone() - vocab_start");
        t.drop(clone);
        let arange = t.empty(n, DType::I64, "arange(rows)");
        let picked = t.empty(n, DType::F32, "logits_2d[arange, target]");
        let predicted = t.empty(n, DType::F32, "predicted_logits.clone()");
        t.drop_all(&[picked, arange]);
        let sum_exp = t.empty(n, DType::F32, "sum_exp_logits");
        let log = t.empty(n, DType::F32, "log(sum_exp_logits)");
        let loss = t.empty(n, DType::F32, "loss");
        t.drop(log);
        t.record(
            Bwd::VocabParallelCrossEntropy { tokens: n },
            &[Some(logits)],
            &[loss],
            &[logits32, target_mask, masked_target],
        );
        t.drop_all(&[
            sum_exp,
            predicted,
            masked_target,
            target_mask,
            max,
            logits32,
        ]);
        if let Some(labels) = labels {
            t.drop(labels);
        }
        let out = transpose_contiguous(t, loss, batch.b);
        t.drop(loss);
        out
    }

    /// `tensor_parallel.checkpoint`'s recomputation of region `region` in backward: the whole
    /// region runs again (a reentrant checkpoint), its output kept through the region's
    /// backward.
    pub(crate) fn recompute(&self, t: &mut Tracer, region: u32, batch: Batch) {
        let kind = self.cache.borrow().regions[&region].clone();
        let inputs = t.region_inputs(region);
        let freqs = self
            .cache
            .borrow()
            .freqs
            .expect("the forward made the freqs");
        t.begin_recompute(region);
        let outer = std::mem::replace(&mut t.component, Component::Activations);
        let out = match kind {
            Region::Layers(layers) => {
                let mut hidden = t.share(inputs[0]);
                for l in layers.clone() {
                    let next = self.layer_forward(t, l, hidden, freqs, batch);
                    t.drop(hidden);
                    hidden = next;
                }
                // Each MoE dispatcher keeps its recomputed `probs`, and with them the graph
                // back to the checkpoint's detached input, until the layer's next forward.
                let moe: Vec<&MoeLayer> = self.layers[layers]
                    .iter()
                    .filter_map(|layer| match &layer.mlp {
                        Mlp::Moe(moe) => Some(moe),
                        Mlp::Dense { .. } => None,
                    })
                    .collect();
                if !moe.is_empty() {
                    let graph = t.keep_recomputed_graph(region, moe.len() as u32);
                    for layer in moe {
                        layer.hold_graph(graph);
                    }
                }
                hidden
            }
            Region::CoreAttention => self.core_attention(t, inputs[0], inputs[1], inputs[2], batch),
            Region::Mlp(l) => self.mlp_forward(t, l, inputs[0], self.rows(batch.n())),
            Region::Moe(l) => {
                let out = self.mlp_forward(t, l, inputs[0], self.rows(batch.n()));
                // The dispatcher keeps its recomputed `probs`, as under full recomputation.
                if let Mlp::Moe(moe) = &self.layers[l].mlp {
                    moe.hold_graph(t.keep_recomputed_graph(region, 1));
                }
                out
            }
        };
        t.hold_recomputed_output(region, out);
        t.drop(out);
        t.component = outer;
        t.end_recompute();
    }
}

/// `x.transpose(0, 1).contiguous()` between `[b, s, ...]` and `[s, b, ...]`: a copy, except
/// with one sequence, whose transposed layout is already contiguous (`contiguous()` returns `x`).
fn transpose_contiguous(t: &mut Tracer, x: T, b: u64) -> T {
    if b == 1 {
        t.share(x)
    } else {
        t.contiguous_copy(x)
    }
}
