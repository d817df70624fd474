//! The HF decoder forward passes, translated line by line into tracer ops. Each function names
//! the transformers function it mirrors; a Python name going out of scope is a `drop`.
//! Shapes: `b` sequences of `s` tokens, `n = b * s` rows.

use std::cell::RefCell;

use super::attention::{self, Heads, Masks};
use super::release::ReleaseCode;
use super::{AttentionImpl, Batch, liger};
use crate::arch::{Architecture, Family, Head, Module, NormKind, Param};
use crate::dtype::DType;
use crate::sim::engine::component::Component;
use crate::sim::engine::tracer::{Bwd, ParamId, T, Tracer};
use crate::sim::strategy::{ModuleKey, Strategy, Unit};
use crate::spec::ExpertsImpl;

/// A linear layer's parameters, with its LoRA adapter when peft wrapped it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Linear {
    pub weight: ParamId,
    pub bias: Option<ParamId>,
    pub out_features: u64,
    pub in_features: u64,
    /// GPT-2's `Conv1D` (`addmm(bias, x, weight)`) rather than `nn.Linear`.
    pub conv1d: bool,
    pub lora: Option<LoraAdapter>,
    /// A bitsandbytes `Linear4bit` holding this many (unpacked) weights.
    pub nf4: Option<u64>,
}

/// A tensor of a saved checkpoint, as `from_pretrained` loads it.
pub(crate) struct CheckpointTensor {
    /// Its key (the file is sorted by key).
    pub name: String,
    pub param: ParamId,
    /// Quantised to 4 bits on load: the number of weights.
    pub quantized: Option<u64>,
}

/// The tensors of a checkpoint as `from_pretrained` reads them; `nf4`: the decoder's linear
/// weights are quantised to 4 bits as they arrive.
#[derive(Default)]
pub(crate) struct Checkpoint {
    pub tensors: Vec<CheckpointTensor>,
    pub nf4: bool,
}

/// peft's `lora_A` (r x in) and `lora_B` (out x r), fp32 by default (`autocast_adapter_dtype`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct LoraAdapter {
    pub a: ParamId,
    pub b: ParamId,
    pub r: u64,
    /// `lora_dropout > 0` (an `nn.Dropout`, else `nn.Identity`).
    pub dropout: bool,
}

impl Linear {
    /// `nn.Linear.forward`, or peft's `lora.Linear.forward`:
    /// `result = base(x); x = x.to(lora_A.dtype); result = result + B(A(dropout(x))) * scaling`.
    pub(crate) fn forward(&self, t: &mut Tracer, x: T) -> T {
        let Some(n) = self.nf4 else {
            let result = t.linear(x, self.weight, self.bias, self.out_features, self.conv1d);
            let Some(lora) = self.lora else {
                return result;
            };
            return self.lora_forward(t, x, result, lora, true);
        };
        let base = t.linear_4bit(x, self.weight, self.bias, self.out_features, n);
        let Some(lora) = self.lora else {
            return base;
        };
        // peft's bnb `Linear4bit` LoRA: a defensive `result.clone()`, and no input cast
        // while autocast is on.
        let result = t.contiguous_copy(base);
        t.drop(base);
        let cast_input = t.autocast_dtype().is_none();
        self.lora_forward(t, x, result, lora, cast_input)
    }

    fn lora_forward(
        &self,
        t: &mut Tracer,
        x: T,
        result: T,
        lora: LoraAdapter,
        cast_input: bool,
    ) -> T {
        let result_dtype = t.dtype(result);
        let adapter_dtype = t.dtype(t.param(lora.a));
        let outer = std::mem::replace(&mut t.component, Component::LoraQuantExtras);
        let xa = if cast_input {
            t.to(x, adapter_dtype)
        } else {
            t.share(x)
        };
        let xd = if lora.dropout {
            t.dropout(xa)
        } else {
            t.share(xa)
        };
        let a_out = t.linear(xd, lora.a, None, lora.r, false);
        t.drop(xd);
        let b_out = t.linear(a_out, lora.b, None, self.out_features, false);
        t.drop(a_out);
        let scaled = t.mul_scalar(b_out);
        t.drop(b_out);
        t.component = outer;
        let sum = t.add(result, scaled);
        t.drop_all(&[scaled, result]);
        let out = t.to(sum, result_dtype);
        t.drop_all(&[sum, xa]);
        out
    }
}

/// A router's parameters (`mlp.gate.weight`; gpt-oss's router has a bias).
#[derive(Clone, Copy, Debug)]
pub(crate) struct RouterParams {
    pub weight: ParamId,
    pub bias: Option<ParamId>,
}

/// peft's `ParamWrapper` on one 3-D expert parameter: `lora_A` is (r·E, in), `lora_B`
/// (out, r·E), fp32.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ExpertLora {
    pub a: ParamId,
    pub b: ParamId,
}

/// The experts module's parameters.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Experts {
    pub gate_up: ParamId,
    pub gate_up_bias: Option<ParamId>,
    pub down: ParamId,
    pub down_bias: Option<ParamId>,
    pub gate_up_lora: Option<ExpertLora>,
    pub down_lora: Option<ExpertLora>,
}

impl Experts {
    pub(crate) fn params(&self) -> Vec<ParamId> {
        [
            Some(self.gate_up),
            self.gate_up_bias,
            Some(self.down),
            self.down_bias,
        ]
        .into_iter()
        .flatten()
        .collect()
    }
}

/// A norm's parameters (LayerNorm has a bias).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Norm {
    pub weight: ParamId,
    pub bias: Option<ParamId>,
}

#[derive(Clone, Debug, Default)]
pub(crate) struct Layer {
    pub q: Option<Linear>,
    pub k: Option<Linear>,
    pub v: Option<Linear>,
    pub qkv: Option<Linear>,
    pub o: Option<Linear>,
    pub gate: Option<Linear>,
    pub up: Option<Linear>,
    pub gate_up: Option<Linear>,
    pub down: Option<Linear>,
    pub input_norm: Option<Norm>,
    pub post_attn_norm: Option<Norm>,
    pub pre_ffn_norm: Option<Norm>,
    pub post_ffn_norm: Option<Norm>,
    pub post_self_attn_norm: Option<Norm>,
    pub post_mlp_norm: Option<Norm>,
    pub q_norm: Option<Norm>,
    pub k_norm: Option<Norm>,
    /// MLA's low-rank query and key/value projections and their norms.
    pub q_a: Option<Linear>,
    pub q_a_norm: Option<Norm>,
    pub q_b: Option<Linear>,
    pub kv_a: Option<Linear>,
    pub kv_a_norm: Option<Norm>,
    pub kv_b: Option<Linear>,
    /// gpt-oss's attention sinks.
    pub sinks: Option<ParamId>,
    /// A routed MoE block's router and experts.
    pub router: Option<RouterParams>,
    pub experts: Option<Experts>,
    /// The shared expert's MLP and Qwen2-MoE's gate on it.
    pub shared_gate: Option<Linear>,
    pub shared_up: Option<Linear>,
    pub shared_down: Option<Linear>,
    pub shared_expert_gate: Option<Linear>,
}

/// What the decoder stack starts from.
#[derive(Clone, Copy)]
pub(crate) enum DecoderInput {
    /// Token ids, looked up in the input embedding.
    Ids(T),
    /// Hidden states (`inputs_embeds`).
    Embeds(T),
}

/// The model as built on the GPU: its architecture and parameter handles.
pub(crate) struct Model {
    pub arch: Architecture,
    pub dtype: DType,
    pub embed: ParamId,
    pub pos_embed: Option<ParamId>,
    pub layers: Vec<Layer>,
    pub final_norm: Norm,
    /// The output head; `None` when tied to the embedding.
    pub lm_head: Option<Linear>,
    pub score: Option<Linear>,
    pub attention: AttentionImpl,
    /// Decoder layers run under non-reentrant gradient checkpointing.
    pub checkpointing: bool,
    /// `enable_input_require_grads()`: the embedding output requires grad even when the
    /// embedding is frozen.
    pub inputs_require_grads: bool,
    /// The parallel strategy wrapping it, whose hooks run in forward and backward.
    pub strategy: RefCell<Strategy>,
    /// What the followed transformers release's code does differently from 5.17's.
    pub release: ReleaseCode,
    /// The caller passes a 2-D `attention_mask` (every trainer's collator makes one): 4.53 to
    /// 4.57's `create_causal_mask` then looks for packed sequences no more, and an all-ones mask
    /// lets SDPA's `is_causal` do (`Masks::create`).
    pub passes_attention_mask: bool,
    /// While generating: each layer's key and value states go to the KV cache
    /// (`DynamicCache`: the prefill's tensors are kept as they are).
    pub kv_cache: Option<RefCell<Vec<(T, T)>>>,
    /// peft's `disable_adapter()`: the LoRA linears run their base layer alone (TRL's
    /// reference pass of a LoRA policy).
    pub adapters_disabled: bool,
    /// liger-kernel's replacements this model runs (`use_liger_kernel`).
    pub liger: liger::Kernels,
    /// Which function runs the experts of MoE layers.
    pub experts_impl: ExpertsImpl,
    /// The busiest expert's tokens over an even share (the per-expert loop's largest tensors).
    pub routing_factor: f64,
    /// Router logits kept for the load-balancing loss (`output_router_logits`).
    pub router_logits: RefCell<Vec<T>>,
}

impl Model {
    /// Create the parameters in transformers' order, as `from_config` does on the GPU.
    pub(crate) fn build(
        t: &mut Tracer,
        arch: &Architecture,
        head: Head,
        dtype: DType,
        trainable: &dyn Fn(&Param) -> bool,
        attention: AttentionImpl,
    ) -> Model {
        Self::register(t, arch, head, dtype, trainable, attention, None, false)
    }

    /// Register the parameters in transformers' order without allocating them: built on the
    /// meta device (FSDP2 allocates each parameter's shard afterwards) or on the host (nothing
    /// is on the GPU until the model is moved there).
    pub(crate) fn build_on_meta(
        t: &mut Tracer,
        arch: &Architecture,
        head: Head,
        dtype: DType,
        trainable: &dyn Fn(&Param) -> bool,
        attention: AttentionImpl,
    ) -> Model {
        Self::register(t, arch, head, dtype, trainable, attention, None, true)
    }

    /// Register the parameters in `model.parameters()` order. With `loading` they are not
    /// allocated here: each is listed with its checkpoint name for `from_pretrained` to
    /// materialise (decoder linears as bitsandbytes 4-bit weights when the checkpoint says
    /// so). `on_cpu`: none is allocated, and no buffer is created on the GPU.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn register(
        t: &mut Tracer,
        arch: &Architecture,
        head: Head,
        dtype: DType,
        trainable: &dyn Fn(&Param) -> bool,
        attention: AttentionImpl,
        mut loading: Option<&mut Checkpoint>,
        on_cpu: bool,
    ) -> Model {
        let mut layers = vec![Layer::default(); arch.layers as usize];
        let mut embed = None;
        let mut pos_embed = None;
        let mut final_norm: Option<Norm> = None;
        let mut lm_head = None;
        let mut score = None;
        let params = arch.parameters(head);
        let mut i = 0;
        while i < params.len() {
            let p = params[i];
            let quantized = loading.as_ref().is_some_and(|c| c.nf4)
                && p.layer.is_some()
                && p.module.is_linear();
            let mut register = |t: &mut Tracer, p: &Param, quantized: bool| match loading
                .as_deref_mut()
            {
                None if on_cpu => t.parameter_deferred(p.numel(), dtype, trainable(p), "parameter"),
                None => t.parameter(p.numel(), dtype, trainable(p), "parameter"),
                Some(checkpoint) => {
                    let (numel, dt) = if quantized {
                        (p.numel().div_ceil(2), DType::U8)
                    } else {
                        (p.numel(), dtype)
                    };
                    let id =
                        t.parameter_deferred(numel, dt, trainable(p) && !quantized, "parameter");
                    checkpoint.tensors.push(CheckpointTensor {
                        name: arch.checkpoint_name(p, head),
                        param: id,
                        quantized: quantized.then_some(p.numel()),
                    });
                    id
                }
            };
            let id = register(t, &p, quantized);
            if p.module.is_linear() || matches!(p.module, Module::Embed | Module::PosEmbed) {
                t.set_matrix(id, p.rows, p.cols);
            }
            let bias = match params.get(i + 1) {
                Some(next)
                    if next.is_bias
                        && next.module == p.module
                        && next.layer == p.layer
                        && !p.is_bias =>
                {
                    i += 1;
                    Some(register(t, next, false))
                }
                _ => None,
            };
            i += 1;
            let linear = Linear {
                weight: id,
                bias,
                out_features: p.rows,
                in_features: p.cols,
                conv1d: arch.family == Family::Gpt2 && p.module != Module::LmHead,
                lora: None,
                nf4: quantized.then_some(p.numel()),
            };
            let norm = Norm { weight: id, bias };
            match p.module {
                Module::Embed => embed = Some(id),
                Module::PosEmbed => pos_embed = Some(id),
                Module::FinalNorm => final_norm = Some(norm),
                Module::LmHead => lm_head = Some(linear),
                Module::Score => score = Some(linear),
                m => {
                    let layer = &mut layers[p.layer.expect("per-layer parameter") as usize];
                    match m {
                        Module::Q => layer.q = Some(linear),
                        Module::K => layer.k = Some(linear),
                        Module::V => layer.v = Some(linear),
                        Module::O | Module::CProjAttn => layer.o = Some(linear),
                        Module::Qkv | Module::CAttn => layer.qkv = Some(linear),
                        Module::Gate => layer.gate = Some(linear),
                        Module::Up | Module::CFc => layer.up = Some(linear),
                        Module::GateUp => layer.gate_up = Some(linear),
                        Module::Down | Module::CProjMlp => layer.down = Some(linear),
                        Module::InputNorm => layer.input_norm = Some(norm),
                        Module::PostAttnNorm => layer.post_attn_norm = Some(norm),
                        Module::PreFfnNorm => layer.pre_ffn_norm = Some(norm),
                        Module::PostFfnNorm => layer.post_ffn_norm = Some(norm),
                        Module::PostSelfAttnNorm => layer.post_self_attn_norm = Some(norm),
                        Module::PostMlpNorm => layer.post_mlp_norm = Some(norm),
                        Module::QNorm => layer.q_norm = Some(norm),
                        Module::KNorm => layer.k_norm = Some(norm),
                        Module::QA => layer.q_a = Some(linear),
                        Module::QANorm => layer.q_a_norm = Some(norm),
                        Module::QB => layer.q_b = Some(linear),
                        Module::KvA => layer.kv_a = Some(linear),
                        Module::KvANorm => layer.kv_a_norm = Some(norm),
                        Module::KvB => layer.kv_b = Some(linear),
                        Module::Sinks => layer.sinks = Some(id),
                        Module::Router => layer.router = Some(RouterParams { weight: id, bias }),
                        Module::ExpertsGateUp => {
                            layer.experts = Some(Experts {
                                gate_up: id,
                                gate_up_bias: bias,
                                down: id,
                                down_bias: None,
                                gate_up_lora: None,
                                down_lora: None,
                            })
                        }
                        Module::ExpertsDown => {
                            let experts = layer
                                .experts
                                .as_mut()
                                .expect("gate_up_proj is created before down_proj");
                            experts.down = id;
                            experts.down_bias = bias;
                        }
                        Module::SharedGate => layer.shared_gate = Some(linear),
                        Module::SharedUp => layer.shared_up = Some(linear),
                        Module::SharedDown => layer.shared_down = Some(linear),
                        Module::SharedExpertGate => layer.shared_expert_gate = Some(linear),
                        _ => unreachable!("handled above"),
                    }
                }
            }
        }
        if loading.is_none() && !on_cpu {
            t.persistent_buffers(&arch.buffers(), "rotary inv_freq");
        }
        if arch.tie_word_embeddings
            && matches!(head, Head::CausalLm)
            && loading.is_none()
            && !on_cpu
        {
            // `lm_head` is created, initialised, then replaced by the embedding when tying.
            let untied = t.empty_as(
                arch.vocab * arch.hidden,
                dtype,
                Component::Weights,
                "untied lm_head (freed by tie_weights)",
            );
            t.drop(untied);
        }
        Model {
            arch: arch.clone(),
            dtype,
            embed: embed.expect("every architecture has an embedding"),
            pos_embed,
            layers,
            final_norm: final_norm.expect("every architecture has a final norm"),
            lm_head,
            score,
            attention,
            checkpointing: false,
            inputs_require_grads: false,
            strategy: RefCell::new(Strategy::Local),
            release: ReleaseCode::default(),
            passes_attention_mask: false,
            kv_cache: None,
            adapters_disabled: false,
            liger: liger::Kernels::default(),
            experts_impl: ExpertsImpl::default(),
            routing_factor: 1.0,
            router_logits: RefCell::new(Vec::new()),
        }
    }

    /// `GPT2Attention`'s `bias` buffer in transformers 4.57: `torch.tril(torch.ones((n, n),
    /// dtype=torch.bool))` for `n = n_positions`, one per layer, kept for the life of the
    /// process (5.x builds masks in `masking_utils` instead).
    pub(crate) fn gpt2_causal_buffers(t: &mut Tracer, arch: &Architecture) {
        let n = arch.max_positions;
        for _ in 0..arch.layers {
            let ones = t.empty_as(n * n, DType::Bool, Component::Weights, "torch.ones((n, n))");
            let tril = t.empty_as(n * n, DType::Bool, Component::Weights, "attn.bias (tril)");
            t.drop(ones);
            t.mark_persistent(tril);
        }
    }

    /// Every linear layer in `named_modules()` order (the order peft wraps them in): each
    /// layer's in the order its parameters are created.
    pub(crate) fn linears_mut(&mut self) -> Vec<(Module, &mut Linear)> {
        let mut order: Vec<Vec<Module>> = vec![Vec::new(); self.layers.len()];
        for p in self.arch.parameters(Head::CausalLm) {
            if let Some(l) = p.layer.filter(|_| p.module.is_linear() && !p.is_bias) {
                order[l as usize].push(p.module);
            }
        }
        let mut out = Vec::new();
        for (layer, modules) in self.layers.iter_mut().zip(order) {
            let Layer {
                q,
                k,
                v,
                qkv,
                o,
                gate,
                up,
                gate_up,
                down,
                q_a,
                q_b,
                kv_a,
                kv_b,
                shared_gate,
                shared_up,
                shared_down,
                shared_expert_gate,
                ..
            } = layer;
            let mut slots = [
                Some(q),
                Some(k),
                Some(v),
                Some(qkv),
                Some(o),
                Some(gate),
                Some(up),
                Some(gate_up),
                Some(down),
                Some(q_a),
                Some(q_b),
                Some(kv_a),
                Some(kv_b),
                Some(shared_gate),
                Some(shared_up),
                Some(shared_down),
                Some(shared_expert_gate),
            ];
            for module in modules {
                let slot = match module {
                    Module::Q => 0,
                    Module::K => 1,
                    Module::V => 2,
                    Module::Qkv | Module::CAttn => 3,
                    Module::O | Module::CProjAttn => 4,
                    Module::Gate => 5,
                    Module::Up | Module::CFc => 6,
                    Module::GateUp => 7,
                    Module::Down | Module::CProjMlp => 8,
                    Module::QA => 9,
                    Module::QB => 10,
                    Module::KvA => 11,
                    Module::KvB => 12,
                    Module::SharedGate => 13,
                    Module::SharedUp => 14,
                    Module::SharedDown => 15,
                    Module::SharedExpertGate => 16,
                    _ => continue,
                };
                if let Some(linear) = slots[slot].take().and_then(Option::as_mut) {
                    out.push((module, linear));
                }
            }
        }
        if let Some(head) = self.lm_head.as_mut() {
            out.push((Module::LmHead, head));
        }
        if let Some(score) = self.score.as_mut() {
            out.push((Module::Score, score));
        }
        out
    }

    /// The decoder stack: `Qwen2Model.forward` (and its siblings). Returns the final hidden
    /// states `(n, hidden)`. Under gradient checkpointing each layer is a recomputed region.
    pub(crate) fn decoder(&self, t: &mut Tracer, ids: T, batch: Batch) -> T {
        self.decoder_from(t, DecoderInput::Ids(ids), batch, true)
    }

    /// The decoder stack from token ids or from `inputs_embeds` (a later pipeline stage's
    /// received hidden states), with the final norm or without it (`nn.Identity()` in its place
    /// on a stage that is not the last).
    pub(crate) fn decoder_from(
        &self,
        t: &mut Tracer,
        input: DecoderInput,
        batch: Batch,
        final_norm: bool,
    ) -> T {
        let a = &self.arch;
        let n = batch.n();
        self.unit_pre_forward(t, Unit::Root);
        self.module_pre_forward(t, ModuleKey::Root, &[], false);
        self.module_pre_forward(t, ModuleKey::Model, &[], false);
        let ids = match input {
            DecoderInput::Ids(ids) => ids,
            DecoderInput::Embeds(embeds) => {
                let inputs_embeds = t.share(embeds);
                return self.layers_from(t, inputs_embeds, batch, final_norm);
            }
        };
        self.unit_pre_forward(t, Unit::Embedding);
        self.module_pre_forward(t, ModuleKey::Params(self.embed), &[self.embed], false);
        let mut inputs_embeds = self.embedding_lookup(t, ids, n);
        self.module_post_forward(t);
        self.unit_post_forward(t, Unit::Embedding);
        if matches!(a.family, Family::Gemma2 | Family::Gemma3) {
            // `Gemma2TextScaledWordEmbedding`: `* embed_scale.to(weight.dtype)`.
            let scaled = t.mul_scalar(inputs_embeds);
            t.drop(inputs_embeds);
            inputs_embeds = scaled;
        }
        if self.inputs_require_grads && t.grad_enabled() && !t.requires_grad(inputs_embeds) {
            t.make_grad_leaf(inputs_embeds);
        }
        self.layers_from(t, inputs_embeds, batch, final_norm)
    }

    /// `Qwen2Model.forward` from `inputs_embeds` on: positions, masks and rotary tables, the
    /// layers, then the final norm (`final_norm`) or the hidden states as they are.
    fn layers_from(&self, t: &mut Tracer, inputs_embeds: T, batch: Batch, final_norm: bool) -> T {
        let a = &self.arch;
        let position_ids = if self.release.materialises_causal_mask {
            // `cache_position = arange(past, past + s)`; `position_ids =
            // cache_position.unsqueeze(0)`.
            t.empty(batch.s, DType::I64, "cache_position")
        } else {
            // `position_ids = arange(s) + past_seen_tokens`
            let arange = t.empty(batch.s, DType::I64, "arange(s)");
            let position_ids = t.empty(batch.s, DType::I64, "position_ids");
            t.drop(arange);
            position_ids
        };
        // GPT-2 adds learned positions before building the mask; the others keep
        // `hidden_states = inputs_embeds` (the name `inputs_embeds` keeps the embedding output
        // alive until the forward returns).
        let position_embeds = self.pos_embed.map(|pos| {
            self.module_pre_forward(t, ModuleKey::Params(pos), &[pos], false);
            let out = t.embedding(pos, position_ids, batch.s, a.hidden);
            self.module_post_forward(t);
            out
        });
        let mut h = match position_embeds {
            Some(pe) => t.add(inputs_embeds, pe),
            None => t.share(inputs_embeds),
        };
        // `_preprocess_mask_arguments` looks for packed sequences only without an
        // `attention_mask` and a cache (a generating model passes both).
        let packed_4_57 = self.release.materialises_causal_mask
            && !self.passes_attention_mask
            && self.kv_cache.is_none();
        let masks = Masks::create(
            t,
            a,
            batch,
            self.attention,
            self.activation_dtype(),
            packed_4_57,
        );
        let rope = if a.family == Family::Gpt2 {
            Rope::none()
        } else {
            self.module_pre_forward(t, ModuleKey::Rotary, &[], false);
            let rope = Rope::compute(t, a, batch, self.activation_dtype());
            self.module_post_forward(t);
            rope
        };
        // Gemma 3 computes a table per layer type (full first, then sliding).
        let local_rope = (a.family == Family::Gemma3).then(|| {
            self.module_pre_forward(t, ModuleKey::Rotary, &[], false);
            let rope = Rope::compute(t, a, batch, self.activation_dtype());
            self.module_post_forward(t);
            rope
        });
        if a.embedding_dropout > 0.0 {
            let dropped = t.dropout(h);
            t.drop(h);
            h = dropped;
        }
        for layer in 0..self.layers.len() {
            let table = match &local_rope {
                Some(local) if a.is_sliding(layer as u64) => local,
                _ => &rope,
            };
            let ctx = LayerContext {
                cos: table.cos,
                sin: table.sin,
                mask: masks.for_layer(a, layer),
            };
            // The checkpoint keeps the layer's arguments to recompute it; FSDP's hooks run
            // inside it (and not when it recomputes).
            let checkpointed = self.checkpointing && t.grad_enabled();
            if checkpointed {
                t.begin_region(&ctx.region_inputs(h));
            }
            self.unit_pre_forward(t, Unit::Layer(layer));
            let next = self.layer_forward(t, layer, h, &ctx, batch);
            self.unit_post_forward(t, Unit::Layer(layer));
            if checkpointed {
                t.end_region();
            }
            t.drop(h);
            h = next;
        }
        // The final norm starts the head's unit; a classifier's ends with it.
        self.unit_pre_forward(t, Unit::Head);
        let out = if final_norm {
            self.hooked_norm(t, h, self.final_norm)
        } else {
            t.share(h)
        };
        if self.score.is_some() {
            self.unit_post_forward(t, Unit::Head);
        }
        t.drop(h);
        t.drop(inputs_embeds);
        t.drop(position_ids);
        if let Some(pe) = position_embeds {
            t.drop(pe);
        }
        masks.release(t);
        rope.release(t);
        if let Some(local) = local_rope {
            local.release(t);
        }
        self.module_post_forward(t);
        out
    }

    /// The strategy's forward pre-hook of a module (its parameters fetched); `input_grad`:
    /// whether its input requires grad (its post-backward hook runs).
    pub(crate) fn module_pre_forward(
        &self,
        t: &mut Tracer,
        module: ModuleKey,
        params: &[ParamId],
        input_grad: bool,
    ) {
        self.strategy
            .borrow_mut()
            .module_pre_forward(t, module, params, input_grad);
    }

    /// The strategy's forward post-hook of the innermost running module.
    pub(crate) fn module_post_forward(&self, t: &mut Tracer) {
        self.strategy.borrow_mut().module_post_forward(t);
    }

    pub(crate) fn unit_pre_forward(&self, t: &mut Tracer, unit: Unit) {
        self.strategy.borrow_mut().unit_pre_forward(t, unit);
    }

    pub(crate) fn unit_post_forward(&self, t: &mut Tracer, unit: Unit) {
        self.strategy.borrow_mut().unit_post_forward(t, unit);
    }

    /// `embed_tokens(ids)`; under tensor parallelism the row-parallel lookup of this rank's
    /// vocabulary rows, reduced over the group.
    fn embedding_lookup(&self, t: &mut Tracer, ids: T, n: u64) -> T {
        let strategy = self.strategy.borrow();
        let Some(tp) = strategy
            .tensor_parallel()
            .filter(|tp| tp.splits_embedding())
        else {
            return t.embedding(self.embed, ids, n, self.arch.hidden);
        };
        let (mask, shifted) = crate::sim::strategy::tp::mask_ids(t, n);
        let partial = t.embedding_sharded(self.embed, shifted, n, self.arch.hidden, tp.tp);
        t.drop(shifted);
        let out = tp.row_output(t, partial);
        t.drop(mask);
        out
    }

    /// The input a block's column-parallel linears share (all-gathered under sequence
    /// parallelism); the block's input itself without tensor parallelism.
    pub(crate) fn block_input(&self, t: &mut Tracer, x: T) -> T {
        match self.strategy.borrow().tensor_parallel() {
            Some(tp) => tp.block_input(t, x),
            None => t.share(x),
        }
    }

    /// What one column-parallel linear reads of its block's input.
    pub(crate) fn linear_input(&self, t: &mut Tracer, x: T) -> T {
        match self.strategy.borrow().tensor_parallel() {
            Some(tp) => tp.linear_input(t, x),
            None => t.share(x),
        }
    }

    /// A row-parallel linear's output reduced over the group; the output itself without
    /// tensor parallelism.
    pub(crate) fn row_output(&self, t: &mut Tracer, out: T) -> T {
        match self.strategy.borrow().tensor_parallel() {
            Some(tp) => tp.row_output(t, out),
            None => out,
        }
    }

    /// A column-parallel linear of a block's input.
    fn column_linear(&self, t: &mut Tracer, linear: Linear, x: T) -> T {
        let input = self.linear_input(t, x);
        let out = self.hooked_linear(t, linear, input);
        t.drop(input);
        out
    }

    /// A linear layer's forward inside its module's ZeRO-3 hooks.
    pub(crate) fn hooked_linear(&self, t: &mut Tracer, linear: Linear, x: T) -> T {
        self.linear_pre_forward(t, linear);
        let out = self.active(linear).forward(t, x);
        self.module_post_forward(t);
        out
    }

    /// The linear as it runs now: without its adapter while adapters are disabled.
    pub(crate) fn active(&self, linear: Linear) -> Linear {
        if self.adapters_disabled {
            Linear {
                lora: None,
                ..linear
            }
        } else {
            linear
        }
    }

    fn linear_pre_forward(&self, t: &mut Tracer, linear: Linear) {
        let params: Vec<ParamId> = std::iter::once(linear.weight).chain(linear.bias).collect();
        self.module_pre_forward(t, ModuleKey::Params(linear.weight), &params, true);
    }

    /// A norm inside its module's ZeRO-3 hooks.
    pub(crate) fn hooked_norm(&self, t: &mut Tracer, x: T, norm: Norm) -> T {
        let params: Vec<ParamId> = std::iter::once(norm.weight).chain(norm.bias).collect();
        self.module_pre_forward(t, ModuleKey::Params(norm.weight), &params, true);
        let out = self.norm(t, x, norm);
        self.module_post_forward(t);
        out
    }

    /// The end of the model's forward (the loss included): the root's post-forward hook.
    pub(crate) fn forward_done(&self, t: &mut Tracer) {
        self.unit_post_forward(t, Unit::Root);
        self.module_post_forward(t);
    }

    /// The dtype of the residual stream: the parameters' (fp32 under autocast with fp32 weights).
    pub(crate) fn activation_dtype(&self) -> DType {
        self.dtype
    }

    /// `torch.utils.checkpoint` recomputation of decoder layer `layer` during backward, from
    /// the arguments its region `region` kept, under the autocast the forward ran in. It runs
    /// on the autograd engine's thread, where that context is the outermost: its exit clears
    /// autocast's cache (one per process), though the caller's thread is inside a context of
    /// its own (a pipeline schedule's step); the caller's state is then as it was.
    pub(crate) fn recompute_layer(
        &self,
        t: &mut Tracer,
        region: u32,
        layer: usize,
        batch: Batch,
        autocast: Option<DType>,
    ) {
        let inputs = t.region_inputs(region);
        let ctx = LayerContext::from_region_inputs(&inputs);
        t.begin_recompute(region);
        let caller = t.enter_autocast(autocast);
        let out = self.layer_forward(t, layer, inputs[0], &ctx, batch);
        t.exit_autocast(None);
        t.enter_autocast(caller);
        t.drop(out);
        self.strategy.borrow_mut().recompute_ends(t);
        t.end_recompute();
    }

    /// One decoder layer (`Qwen2DecoderLayer.forward` and siblings).
    pub(crate) fn layer_forward(
        &self,
        t: &mut Tracer,
        index: usize,
        h: T,
        ctx: &LayerContext,
        batch: Batch,
    ) -> T {
        let layer = &self.layers[index];
        let family = self.arch.family;
        self.module_pre_forward(t, ModuleKey::Layer(index), &[], true);
        let residual = t.share(h);
        // OLMo 2 has no norm before attention.
        let x = match layer.input_norm {
            Some(norm) => self.hooked_norm(t, h, norm),
            None => t.share(h),
        };
        self.module_pre_forward(t, ModuleKey::Attention(index), &[], true);
        let block = self.block_input(t, x);
        let mut attn = self.attention_block(t, layer, block, ctx, batch);
        self.module_post_forward(t);
        t.drop_all(&[block, x]);
        let attn_out_norm = match family {
            Family::Gemma2 | Family::Gemma3 | Family::Olmo2 => layer.post_attn_norm,
            _ => layer.post_self_attn_norm,
        };
        if let Some(norm) = attn_out_norm {
            let normed = self.hooked_norm(t, attn, norm);
            t.drop(attn);
            attn = normed;
        }
        if self.arch.residual_dropout > 0.0 {
            attn = self.resid_dropout(t, attn);
        }
        let h2 = t.add(residual, attn);
        t.drop_all(&[attn, residual]);
        let residual = t.share(h2);
        let ffn_norm = match family {
            Family::Gemma2 | Family::Gemma3 => layer.pre_ffn_norm,
            Family::Olmo2 => None,
            _ => layer.post_attn_norm,
        };
        let x = match ffn_norm {
            Some(norm) => self.hooked_norm(t, h2, norm),
            None => t.share(h2),
        };
        let routes = self
            .arch
            .moe
            .as_ref()
            .is_some_and(|m| m.routes(index as u64));
        match self.zero3_leaf_block(index) {
            Some(params) => self.module_pre_forward(t, ModuleKey::MoeLeaf(index), &params, true),
            None => self.module_pre_forward(t, ModuleKey::Mlp(index), &[], true),
        }
        let block = self.block_input(t, x);
        let mut m = if routes {
            self.moe_block(t, index, block)
        } else {
            self.mlp(t, index, block)
        };
        self.module_post_forward(t);
        t.drop_all(&[block, x]);
        if let Some(norm) = layer.post_ffn_norm.or(layer.post_mlp_norm) {
            let normed = self.hooked_norm(t, m, norm);
            t.drop(m);
            m = normed;
        }
        if self.arch.residual_dropout > 0.0 {
            m = self.resid_dropout(t, m);
        }
        let out = t.add(residual, m);
        t.drop_all(&[m, residual, h2]);
        self.module_post_forward(t);
        out
    }

    fn resid_dropout(&self, t: &mut Tracer, x: T) -> T {
        let out = t.dropout(x);
        t.drop(x);
        out
    }

    /// The norm layers: `Qwen2RMSNorm`, `Gemma2RMSNorm`, `nn.LayerNorm`.
    pub(crate) fn norm(&self, t: &mut Tracer, x: T, norm: Norm) -> T {
        match self.arch.norm_kind() {
            NormKind::Rms if self.liger.layers => liger::rms_norm(t, x, norm.weight),
            NormKind::Rms => rms_norm(t, x, norm.weight),
            NormKind::RmsOnePlus => rms_norm_one_plus(t, x, norm.weight),
            NormKind::LayerNorm => layer_norm(t, x, norm, self.arch.hidden),
            NormKind::RmsWeightFirst => rms_norm_weight_first(t, x, norm.weight),
        }
    }

    fn attention_block(
        &self,
        t: &mut Tracer,
        layer: &Layer,
        x: T,
        ctx: &LayerContext,
        batch: Batch,
    ) -> T {
        let a = &self.arch;
        if a.mla.is_some() {
            return self.mla_attention(t, layer, x, ctx, batch);
        }
        let (q, k, v) = match (layer.qkv, a.family) {
            (Some(qkv), Family::Phi3) => {
                // qkv = qkv_proj(x); q, k, v = slices of it (views).
                let fused = self.hooked_linear(t, qkv, x);
                let q = t.slice(fused, batch.n() * a.q_dim());
                let k = t.slice(fused, batch.n() * a.kv_dim());
                let v = t.slice(fused, batch.n() * a.kv_dim());
                t.drop(fused);
                (q, k, v)
            }
            (Some(c_attn), _) => {
                // GPT-2: query, key, value = c_attn(x).split(embed_dim, dim=2).
                let fused = self.hooked_linear(t, c_attn, x);
                let [q, k, v] = t.split3(fused);
                t.drop(fused);
                (q, k, v)
            }
            _ => {
                // Rotary embeddings (and eager attention) hand back head-major gradients.
                let rotary_copy = (a.family != Family::Gpt2 && !self.liger.rope)
                    || self.attention == AttentionImpl::Eager;
                // So do eager attention and context parallelism's ring (its dk and dv are one
                // contiguous buffer).
                let value_copy = self.attention == AttentionImpl::Eager
                    || self.strategy.borrow().context_parallel().is_some();
                let (ql, kl, vl) = (
                    self.active(layer.q.expect("q_proj")),
                    self.active(layer.k.expect("k_proj")),
                    self.active(layer.v.expect("v_proj")),
                );
                let (q, k) = if matches!(a.family, Family::Olmoe | Family::Olmo2) {
                    // OLMoE normalises the whole q and k projections before the head split.
                    let olmoe_heads = |t: &mut Tracer, proj: Linear, norm: Option<Norm>| {
                        let out = self.hooked_linear(t, proj, x);
                        let normed = self.hooked_norm(t, out, norm.expect("q/k norm"));
                        t.drop(out);
                        let heads = heads_view(t, normed, rotary_copy);
                        t.drop(normed);
                        heads
                    };
                    (
                        olmoe_heads(t, ql, layer.q_norm),
                        olmoe_heads(t, kl, layer.k_norm),
                    )
                } else {
                    // Qwen3 normalises each projection's heads before the next projection
                    // (`q_norm(q_proj(x).view(...))`); Gemma 3 after all three.
                    let norm_at_once = matches!(a.family, Family::Qwen3 | Family::Qwen3Moe);
                    let heads = |t: &mut Tracer, proj: Linear, norm: Option<Norm>| {
                        self.linear_pre_forward(t, proj);
                        let input = self.linear_input(t, x);
                        let out = projection_heads(t, input, proj, rotary_copy);
                        t.drop(input);
                        self.module_post_forward(t);
                        match norm.filter(|_| norm_at_once) {
                            Some(norm) => {
                                let normed = self.hooked_norm(t, out, norm);
                                t.drop(out);
                                normed
                            }
                            None => out,
                        }
                    };
                    (heads(t, ql, layer.q_norm), heads(t, kl, layer.k_norm))
                };
                self.linear_pre_forward(t, vl);
                let input = self.linear_input(t, x);
                let v = projection_heads(t, input, vl, value_copy);
                t.drop(input);
                self.module_post_forward(t);
                (q, k, v)
            }
        };
        let (mut q, mut k) = (q, k);
        if let (Some(qn), Some(kn), Family::Gemma3) = (layer.q_norm, layer.k_norm, a.family) {
            // Gemma 3: q_norm / k_norm over head_dim, after the three projections.
            let qq = self.hooked_norm(t, q, qn);
            t.drop(q);
            q = qq;
            let kk = self.hooked_norm(t, k, kn);
            t.drop(k);
            k = kk;
        }
        let (q, k) = if a.family == Family::Gpt2 {
            (q, k)
        } else {
            let (qr, kr) = if self.liger.rope {
                let (cos, sin) = ctx.rotary_tables();
                (liger::rotate(t, q, cos, sin), liger::rotate(t, k, cos, sin))
            } else if a.rotary_dim < a.head_dim {
                ctx.apply_partial_rotary(t, q, k, a.rotary_dim, a.head_dim)
            } else {
                ctx.apply_rotary(t, q, k)
            };
            t.drop_all(&[q, k]);
            (qr, kr)
        };
        if let Some(cache) = &self.kv_cache {
            let entry = (t.share(k), t.share(v));
            cache.borrow_mut().push(entry);
        }
        let sinks = layer.sinks.map(|p| t.param(p));
        let cp = self
            .strategy
            .borrow()
            .context_parallel()
            .map(|c| (c.cp, c.rank));
        let out = match cp {
            Some((cp, rank)) => attention::ring(t, Heads::of(a), q, k, v, batch, cp, rank),
            None => attention::attention(
                t,
                a,
                Heads {
                    repeated_inputs: self.release.sdpa_repeats_kv,
                    contiguous_inputs: self.release.sdpa_contiguous_inputs,
                    ..Heads::of(a)
                },
                self.attention,
                q,
                k,
                v,
                ctx.mask,
                batch,
                self.dropout_in_attention(),
                sinks,
            ),
        };
        // `attn_output = self.o_proj(attn_output)`; the states die as the forward returns.
        let o = layer.o.expect("o_proj");
        let proj = self.hooked_linear(t, o, out);
        t.drop(out);
        t.drop_all(&[q, k, v]);
        self.row_output(t, proj)
    }

    fn dropout_in_attention(&self) -> bool {
        self.arch.attention_dropout > 0.0
    }

    /// `Qwen2MLP`, `Phi3MLP` (fused gate_up, chunked), `GPT2MLP` (c_fc, gelu, c_proj).
    fn mlp(&self, t: &mut Tracer, index: usize, x: T) -> T {
        let a = &self.arch;
        let layer = &self.layers[index];
        let down = layer.down.expect("down_proj");
        let hidden = match a.family {
            Family::Phi3 | Family::Glm4 => {
                let gu = layer.gate_up.expect("gate_up_proj");
                let fused = self.hooked_linear(t, gu, x);
                let half = t.numel(fused) / 2;
                let gate = t.slice(fused, half);
                let up = t.slice(fused, half);
                t.drop(fused);
                self.module_pre_forward(t, ModuleKey::Activation(index), &[], true);
                let act = t.silu(gate);
                self.module_post_forward(t);
                let prod = t.mul(up, act);
                t.drop_all(&[gate, up, act]);
                prod
            }
            Family::Gpt2 => {
                let fc = layer.up.expect("c_fc");
                let h = self.hooked_linear(t, fc, x);
                self.module_pre_forward(t, ModuleKey::Activation(index), &[], true);
                let act = gelu_new(t, h);
                self.module_post_forward(t);
                t.drop(h);
                act
            }
            _ if self.liger.layers => {
                // `LigerSwiGLUMLP.forward`: down_proj(LigerSiLUMulFunction(gate, up)).
                let (g, u) = (layer.gate.expect("gate_proj"), layer.up.expect("up_proj"));
                let gate = self.hooked_linear(t, g, x);
                let up = self.hooked_linear(t, u, x);
                let prod = liger::silu_mul(t, gate, up);
                t.drop_all(&[gate, up]);
                prod
            }
            _ => {
                let (g, u) = (layer.gate.expect("gate_proj"), layer.up.expect("up_proj"));
                let gate = self.column_linear(t, g, x);
                self.module_pre_forward(t, ModuleKey::Activation(index), &[], true);
                let act = match a.family {
                    Family::Gemma2 | Family::Gemma3 => t.gelu_tanh(gate),
                    _ => t.silu(gate),
                };
                self.module_post_forward(t);
                t.drop(gate);
                let up = self.column_linear(t, u, x);
                let prod = t.mul(act, up);
                t.drop_all(&[act, up]);
                prod
            }
        };
        let out = self.hooked_linear(t, down, hidden);
        t.drop(hidden);
        self.row_output(t, out)
    }
}

/// `proj(x).view(hidden_shape).transpose(1, 2)`.
fn projection_heads(t: &mut Tracer, x: T, proj: Linear, copy_in_backward: bool) -> T {
    let out = proj.forward(t, x);
    let heads = heads_view(t, out, copy_in_backward);
    t.drop(out);
    heads
}

/// `x.view(hidden_shape).transpose(1, 2)`: a view whose backward reshapes the gradient back.
pub(crate) fn heads_view(t: &mut Tracer, out: T, copy_in_backward: bool) -> T {
    let heads = t.view(out, t.numel(out), "view(b, s, heads, d).transpose(1, 2)");
    t.record(
        Bwd::HeadSplit {
            copy: copy_in_backward,
        },
        &[Some(out)],
        &[heads],
        &[],
    );
    heads
}

/// The fp32 rows of an RMSNorm, `x.float() * rsqrt(x.float().pow(2).mean(-1) + eps)`, and the
/// variance (saved by its backward) for the caller to release.
fn rms_normalised(t: &mut Tracer, x: T, weight: ParamId) -> (T, T) {
    let x32 = t.to(x, DType::F32);
    let width = norm_width(t, weight);
    let sq = t.pow2(x32);
    let variance = t.mean_last(sq, width);
    t.drop(sq);
    let v_eps = t.add_scalar(variance);
    let r = t.rsqrt(v_eps);
    t.drop(v_eps);
    let y = t.mul(x32, r);
    t.drop_all(&[r, x32]);
    (y, variance)
}

/// `Qwen2RMSNorm.forward`: `weight * normed.to(input_dtype)`.
fn rms_norm(t: &mut Tracer, x: T, weight: ParamId) -> T {
    let input_dtype = t.dtype(x);
    let (y, variance) = rms_normalised(t, x, weight);
    let yb = t.to(y, input_dtype);
    let w = t.param(weight);
    let out = t.mul(w, yb);
    t.drop(yb);
    t.drop_all(&[y, variance]);
    out
}

/// `GptOssRMSNorm.forward` (and OLMo 2's): `(weight * normed_fp32).to(input_dtype)`, so the
/// product is fp32 and the weight's gradient keeps the fp32 normalised rows.
fn rms_norm_weight_first(t: &mut Tracer, x: T, weight: ParamId) -> T {
    let input_dtype = t.dtype(x);
    let (y, variance) = rms_normalised(t, x, weight);
    let w = t.param(weight);
    let product = t.mul(w, y);
    t.drop_all(&[y, variance]);
    let out = t.to(product, input_dtype);
    t.drop(product);
    out
}

/// `Gemma2RMSNorm.forward`: `(norm(x.float()) * (1 + weight.float())).type_as(x)`.
fn rms_norm_one_plus(t: &mut Tracer, x: T, weight: ParamId) -> T {
    let input_dtype = t.dtype(x);
    let width = norm_width(t, weight);
    let xf = t.to(x, DType::F32);
    // _norm: x * rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    let sq = t.pow2(xf);
    let mean = t.mean_last(sq, width);
    t.drop(sq);
    let m_eps = t.add_scalar(mean);
    t.drop(mean);
    let r = t.rsqrt(m_eps);
    t.drop(m_eps);
    let normed = t.mul(xf, r);
    t.drop_all(&[r, xf]);
    // output * (1.0 + self.weight.float())
    let w = t.param(weight);
    let wf = t.to(w, DType::F32);
    let one_plus = t.add_scalar(wf);
    t.drop(wf);
    let scaled = t.mul(normed, one_plus);
    t.drop_all(&[one_plus, normed]);
    let out = t.to(scaled, input_dtype);
    t.drop(scaled);
    out
}

/// `nn.LayerNorm` (`native_layer_norm`: output plus fp32 mean and rstd per row, all saved).
/// Autocast runs it in fp32 (its `fp32` policy casts half inputs and weights, uncached).
fn layer_norm(t: &mut Tracer, x: T, norm: Norm, width: u64) -> T {
    let b = norm.bias.map(|b| {
        let b = t.param(b);
        t.autocast_fp32(b)
    });
    let w = t.param(norm.weight);
    let w = t.autocast_fp32(w);
    let x = t.autocast_fp32(x);
    let rows = t.numel(x) / width;
    let out = t.empty(t.numel(x), t.dtype(x), "layer_norm output");
    let mean = t.empty(rows, DType::F32, "layer_norm mean");
    let rstd = t.empty(rows, DType::F32, "layer_norm rstd");
    t.record(
        Bwd::LayerNorm,
        &[Some(x), Some(w), b],
        &[out],
        &[x, mean, rstd],
    );
    t.drop_all(&[mean, rstd, x, w]);
    if let Some(b) = b {
        t.drop(b);
    }
    out
}

/// `NewGELUActivation` (GPT-2's `gelu_new`), unfused:
/// `0.5 * x * (1.0 + tanh(sqrt(2 / pi) * (x + 0.044715 * pow(x, 3.0))))`. Under autocast
/// `pow` runs in fp32, so everything after it is fp32.
fn gelu_new(t: &mut Tracer, x: T) -> T {
    let half = t.mul_scalar(x);
    let x32 = t.autocast_fp32(x);
    let cube = t.pow3(x32);
    t.drop(x32);
    let scaled = t.mul_scalar(cube);
    t.drop(cube);
    let inner = t.add(x, scaled);
    t.drop(scaled);
    let arg = t.mul_scalar(inner);
    t.drop(inner);
    let th = t.tanh(arg);
    t.drop(arg);
    let one_plus = t.add_scalar(th);
    t.drop(th);
    let out = t.mul(half, one_plus);
    t.drop_all(&[half, one_plus]);
    out
}

fn norm_width(t: &Tracer, weight: ParamId) -> u64 {
    t.numel(t.param(weight))
}

/// Rotary embeddings: `cos`, `sin` of shape (1, s, head_dim), computed once per forward.
pub(crate) struct Rope {
    pub(crate) cos: Option<T>,
    pub(crate) sin: Option<T>,
}

impl Rope {
    fn none() -> Rope {
        Rope {
            cos: None,
            sin: None,
        }
    }

    /// `Qwen2RotaryEmbedding.forward` (no grad, fp32, then cast to the activations' dtype).
    fn compute(t: &mut Tracer, a: &Architecture, batch: Batch, dtype: DType) -> Rope {
        let half = a.rotary_dim / 2;
        let grad = t.set_grad_enabled(false);
        let autocast = t.enter_autocast(None);
        let pos_f = t.empty(batch.s, DType::F32, "rotary position_ids.float()");
        let freqs = t.empty(half * batch.s, DType::F32, "rotary freqs (matmul)");
        t.ensure_cublas_workspace();
        let emb = t.empty(
            a.rotary_dim * batch.s,
            DType::F32,
            "rotary emb = cat(freqs, freqs)",
        );
        let cos_raw = t.empty(a.rotary_dim * batch.s, DType::F32, "emb.cos()");
        let cos = t.empty(
            a.rotary_dim * batch.s,
            DType::F32,
            "cos * attention_scaling",
        );
        t.drop(cos_raw);
        let sin_raw = t.empty(a.rotary_dim * batch.s, DType::F32, "emb.sin()");
        let sin = t.empty(
            a.rotary_dim * batch.s,
            DType::F32,
            "sin * attention_scaling",
        );
        t.drop(sin_raw);
        let cos_out = t.to(cos, dtype);
        let sin_out = t.to(sin, dtype);
        t.drop_all(&[pos_f, freqs, emb, cos, sin]);
        t.exit_autocast(autocast);
        t.set_grad_enabled(grad);
        Rope {
            cos: Some(cos_out),
            sin: Some(sin_out),
        }
    }

    fn release(self, t: &mut Tracer) {
        if let Some(c) = self.cos {
            t.drop(c);
        }
        if let Some(s) = self.sin {
            t.drop(s);
        }
    }
}

/// What a decoder layer is called with besides its hidden states: the rotary tables and its
/// attention mask (kept by a checkpointed layer for its recomputation).
pub(crate) struct LayerContext {
    cos: Option<T>,
    sin: Option<T>,
    pub(crate) mask: Option<T>,
}

impl LayerContext {
    fn region_inputs(&self, h: T) -> Vec<T> {
        [Some(h), self.cos, self.sin, self.mask]
            .into_iter()
            .flatten()
            .collect()
    }

    fn from_region_inputs(inputs: &[T]) -> LayerContext {
        // Same order as `region_inputs`; GPT-2 has no rotary tables.
        let rest = &inputs[1..];
        let (cos, sin, mask) = match rest.len() {
            0 => (None, None, None),
            1 => (None, None, Some(rest[0])),
            2 => (Some(rest[0]), Some(rest[1]), None),
            _ => (Some(rest[0]), Some(rest[1]), Some(rest[2])),
        };
        LayerContext { cos, sin, mask }
    }

    /// `apply_rotary_pos_emb`: `q * cos + rotate_half(q) * sin`, same for k.
    /// `cos` and `sin`.
    pub(crate) fn rotary_tables(&self) -> (T, T) {
        (
            self.cos.expect("rotary tables"),
            self.sin.expect("rotary tables"),
        )
    }

    pub(crate) fn apply_rotary(&self, t: &mut Tracer, q: T, k: T) -> (T, T) {
        let (cos, sin) = self.rotary_tables();
        let qe = rotate(t, q, cos, sin);
        let ke = rotate(t, k, cos, sin);
        (qe, ke)
    }
}

impl LayerContext {
    /// GLM-4's `apply_rotary_pos_emb`: the first half of the tables repeated pairwise, the
    /// first `rotary` dims of each head turned (`rotate_half` stacks the negated odd and the
    /// even elements), then concatenated with the rest.
    pub(crate) fn apply_partial_rotary(
        &self,
        t: &mut Tracer,
        q: T,
        k: T,
        rotary: u64,
        head_dim: u64,
    ) -> (T, T) {
        let (cos, sin) = self.rotary_tables();
        let tables = t.numel(cos);
        let cos_r = t.empty(tables, t.dtype(cos), "cos[..., :d/2].repeat_interleave(2)");
        let sin_r = t.empty(tables, t.dtype(sin), "sin[..., :d/2].repeat_interleave(2)");
        let turn = |t: &mut Tracer, x: T| {
            let rot_numel = t.numel(x) / head_dim * rotary;
            let [x_rot, x_pass] = t.split_at(x, rot_numel);
            let xc = t.mul(x_rot, cos_r);
            let half = rot_numel / 2;
            let odd = t.slice(x_rot, half);
            let even = t.slice(x_rot, half);
            let neg = t.neg(odd);
            let stacked = t.cat2(neg, even);
            t.drop_all(&[neg, odd, even]);
            let rs = t.mul(stacked, sin_r);
            t.drop(stacked);
            let embedded = t.add(xc, rs);
            t.drop_all(&[xc, rs]);
            let out = t.cat2(embedded, x_pass);
            t.drop_all(&[embedded, x_rot, x_pass]);
            out
        };
        let qe = turn(t, q);
        let ke = turn(t, k);
        t.drop_all(&[cos_r, sin_r]);
        (qe, ke)
    }
}

fn rotate(t: &mut Tracer, x: T, cos: T, sin: T) -> T {
    let xc = t.mul(x, cos);
    // rotate_half: cat((-x2, x1), dim=-1)
    let half = t.numel(x) / 2;
    let x1 = t.slice(x, half);
    let x2 = t.slice(x, half);
    let neg = t.neg(x2);
    let rot = t.cat2(neg, x1);
    t.drop(neg);
    t.drop_all(&[x1, x2]);
    let rs = t.mul(rot, sin);
    t.drop(rot);
    let out = t.add(xc, rs);
    // `BINARY_OP` releases its left operand first.
    t.drop_all(&[xc, rs]);
    out
}
