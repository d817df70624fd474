//! Architectures: the dimensions of a decoder-only transformer read from its HF `config.json`,
//! and the inventory of parameters transformers builds for it, in the order it builds them
//! (the order matters: it decides where the caching allocator puts each weight).

use serde_json::Value;

use crate::dtype::DType;
use crate::error::{Error, Result, SHOWN_CHARS, shown};
use crate::limits;

mod moe;
pub use moe::{Mla, Moe, Router};

/// The HF model families headroom models tensor by tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Family {
    /// Llama 2/3.x; also Mistral, whose modelling code is Llama's.
    Llama,
    /// Qwen2 / Qwen2.5: Llama with q/k/v biases.
    Qwen2,
    /// Qwen3 dense: Llama with per-head RMSNorm on q and k.
    Qwen3,
    /// Phi-3 / Phi-3.5: fused qkv and gate_up projections.
    Phi3,
    /// Gemma 2: four norms per layer, (1 + w) norms, GeLU-tanh, logit soft-capping.
    Gemma2,
    /// GPT-2: learned positions, LayerNorm, fused c_attn (Conv1D), GeLU MLP, biases everywhere.
    Gpt2,
    /// Gemma 3 text: Gemma 2's layout plus per-head q/k norms, no soft-capping, one full
    /// attention layer in every `sliding_window_pattern`, a rotary table per layer type.
    Gemma3,
    /// OLMo 2: norms after attention and MLP only, q/k RMSNorm over the whole projections.
    Olmo2,
    /// GLM-4: fused gate_up MLP, four norms per layer, rotary embeddings on part of each head.
    Glm4,
    /// Qwen3-MoE: Qwen3's attention, routed experts (softmax router, bf16 weights).
    Qwen3Moe,
    /// Qwen2-MoE: Qwen2's attention, routed experts plus a gated shared expert.
    Qwen2Moe,
    /// Mixtral: Mistral's attention, 8 experts, fp32 routing weights.
    Mixtral,
    /// OLMoE: q/k RMSNorm over the whole projection, 64 experts.
    Olmoe,
    /// DeepSeek-V2: multi-head latent attention, fp32 softmax router, shared experts, dense
    /// first layers.
    DeepseekV2,
    /// DeepSeek-V3: as V2 with a sigmoid, group-limited router.
    DeepseekV3,
    /// gpt-oss: biased attention with sinks, alternating sliding windows, clamped SwiGLU
    /// experts with biases.
    GptOss,
}

pub const SUPPORTED_MODEL_TYPES: &str = "llama, mistral, qwen2, qwen3, phi3, gemma2, \
     gemma3_text, olmo2, glm4, gpt2, qwen3_moe, qwen2_moe, mixtral, olmoe, deepseek_v2, \
     deepseek_v3, gpt_oss";

/// Normalisation layer flavours.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NormKind {
    /// `weight * x.to(input_dtype)` after an fp32 RMS normalisation (Llama, Qwen, Mistral, Phi-3).
    Rms,
    /// `(x * (1 + weight.float())).type_as(x)` (Gemma).
    RmsOnePlus,
    /// `nn.LayerNorm` with bias (GPT-2).
    LayerNorm,
    /// `(weight * x).to(input_dtype)`: the weight multiplies the fp32 normalised rows (gpt-oss).
    RmsWeightFirst,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Architecture {
    pub family: Family,
    pub model_type: String,
    pub hidden: u64,
    pub intermediate: u64,
    pub layers: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub head_dim: u64,
    /// Columns of the output head's logits: the vocabulary, or this rank's share of it.
    pub vocab: u64,
    /// Rows of the input embedding: the vocabulary, or this rank's share where a
    /// tensor-parallel plan splits the embedding too.
    pub embed_vocab: u64,
    pub max_positions: u64,
    pub tie_word_embeddings: bool,
    /// q/k/v projections carry a bias (Qwen2; Llama with `attention_bias`).
    pub qkv_bias: bool,
    /// o_proj carries a bias (`attention_bias` in Llama/Gemma).
    pub o_bias: bool,
    /// MLP projections carry biases (`mlp_bias` in Llama).
    pub mlp_bias: bool,
    pub sliding_window: Option<u64>,
    pub attn_logit_softcapping: Option<f64>,
    pub final_logit_softcapping: Option<f64>,
    /// Dropout probabilities in training (GPT-2's `embd_pdrop`, `attn_pdrop`, `resid_pdrop`;
    /// `attention_dropout` elsewhere, 0 by default).
    pub embedding_dropout: f64,
    pub attention_dropout: f64,
    pub residual_dropout: f64,
    /// Layer `l` attends in a sliding window unless `(l + 1) % pattern == 0` (Gemma 2 and
    /// gpt-oss alternate: 2; Gemma 3: 6); `None`: every layer alike.
    pub sliding_pattern: Option<u64>,
    /// Head dimensions rotary embeddings turn (GLM-4's `partial_rotary_factor`).
    pub rotary_dim: u64,
    /// The routed experts, for MoE families.
    pub moe: Option<Moe>,
    /// Multi-head latent attention (DeepSeek).
    pub mla: Option<Mla>,
}

/// What a parameter is, which decides how its module uses it in forward and backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Module {
    Embed,
    PosEmbed,
    Q,
    K,
    V,
    O,
    /// Phi-3 fused q/k/v.
    Qkv,
    /// GPT-2 fused q/k/v (`c_attn`, a Conv1D).
    CAttn,
    /// GPT-2 attention output (`attn.c_proj`).
    CProjAttn,
    Gate,
    Up,
    /// Phi-3 fused gate/up.
    GateUp,
    Down,
    /// GPT-2 MLP in (`mlp.c_fc`).
    CFc,
    /// GPT-2 MLP out (`mlp.c_proj`).
    CProjMlp,
    InputNorm,
    PostAttnNorm,
    PreFfnNorm,
    PostFfnNorm,
    /// GLM-4's norm on the attention output (`post_self_attn_layernorm`).
    PostSelfAttnNorm,
    /// GLM-4's norm on the MLP output (`post_mlp_layernorm`).
    PostMlpNorm,
    QNorm,
    KNorm,
    FinalNorm,
    LmHead,
    /// The sequence-classification head.
    Score,
    /// An MoE layer's router (`mlp.gate`, gpt-oss `mlp.router`): a bare parameter, not a linear.
    Router,
    /// The experts' fused gate and up projections, one 3-D parameter (`mlp.experts.gate_up_proj`).
    ExpertsGateUp,
    /// The experts' down projections (`mlp.experts.down_proj`).
    ExpertsDown,
    /// The shared expert's MLP (Qwen2-MoE `shared_expert`, DeepSeek `shared_experts`).
    SharedGate,
    SharedUp,
    SharedDown,
    /// Qwen2-MoE's `shared_expert_gate`, a linear to one output.
    SharedExpertGate,
    /// MLA's query down-projection, its norm and up-projection.
    QA,
    QANorm,
    QB,
    /// MLA's key/value latent projection (with the rotary key), its norm and up-projection.
    KvA,
    KvANorm,
    KvB,
    /// gpt-oss's per-head attention sinks.
    Sinks,
}

impl Module {
    /// The module's attribute name in transformers (what LoRA `target_modules` match).
    pub fn hf_name(self) -> &'static str {
        match self {
            Module::Embed => "embed_tokens",
            Module::PosEmbed => "wpe",
            Module::Q => "q_proj",
            Module::K => "k_proj",
            Module::V => "v_proj",
            Module::O => "o_proj",
            Module::Qkv => "qkv_proj",
            Module::CAttn => "c_attn",
            Module::CProjAttn | Module::CProjMlp => "c_proj",
            Module::Gate => "gate_proj",
            Module::Up => "up_proj",
            Module::GateUp => "gate_up_proj",
            Module::Down => "down_proj",
            Module::CFc => "c_fc",
            Module::InputNorm => "input_layernorm",
            Module::PostAttnNorm => "post_attention_layernorm",
            Module::PreFfnNorm => "pre_feedforward_layernorm",
            Module::PostFfnNorm => "post_feedforward_layernorm",
            Module::PostSelfAttnNorm => "post_self_attn_layernorm",
            Module::PostMlpNorm => "post_mlp_layernorm",
            Module::QNorm => "q_norm",
            Module::KNorm => "k_norm",
            Module::FinalNorm => "norm",
            Module::LmHead => "lm_head",
            Module::Score => "score",
            Module::Router => "gate",
            Module::ExpertsGateUp => "gate_up_proj",
            Module::ExpertsDown => "down_proj",
            Module::SharedGate => "gate_proj",
            Module::SharedUp => "up_proj",
            Module::SharedDown => "down_proj",
            Module::SharedExpertGate => "shared_expert_gate",
            Module::QA => "q_a_proj",
            Module::QANorm => "q_a_layernorm",
            Module::QB => "q_b_proj",
            Module::KvA => "kv_a_proj_with_mqa",
            Module::KvANorm => "kv_a_layernorm",
            Module::KvB => "kv_b_proj",
            Module::Sinks => "sinks",
        }
    }

    /// Linear layers (nn.Linear or GPT-2's Conv1D): what LoRA can adapt and bitsandbytes quantises.
    pub fn is_linear(self) -> bool {
        matches!(
            self,
            Module::Q
                | Module::K
                | Module::V
                | Module::O
                | Module::Qkv
                | Module::CAttn
                | Module::CProjAttn
                | Module::Gate
                | Module::Up
                | Module::GateUp
                | Module::Down
                | Module::CFc
                | Module::CProjMlp
                | Module::LmHead
                | Module::Score
                | Module::SharedGate
                | Module::SharedUp
                | Module::SharedDown
                | Module::SharedExpertGate
                | Module::QA
                | Module::QB
                | Module::KvA
                | Module::KvB
        )
    }
}

/// One parameter tensor as transformers creates it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Param {
    pub module: Module,
    pub layer: Option<u32>,
    /// For a weight of a linear: (out_features, in_features); for a vector: (n, 1).
    pub rows: u64,
    pub cols: u64,
    pub is_bias: bool,
}

impl Param {
    pub fn numel(&self) -> u64 {
        self.rows * self.cols
    }
}

/// What kind of head sits on the decoder.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Head {
    CausalLm,
    /// `AutoModelForSequenceClassification` with `num_labels` outputs.
    SequenceClassification {
        labels: u64,
    },
}

fn get<'a>(config: &'a Value, keys: &[&str]) -> Option<&'a Value> {
    keys.iter()
        .find_map(|k| config.get(*k).filter(|v| !v.is_null()))
}

/// An integer from 1 to `max` under the first of `keys` present (`what`: why the limit).
fn required_u64(config: &Value, keys: &[&str], max: u64, what: &str) -> Result<u64> {
    optional_u64(config, keys, max, what)?
        .ok_or_else(|| Error::field(keys[0], "missing", "the model config must set it"))
}

/// Like [`required_u64`], `None` when absent.
fn optional_u64(config: &Value, keys: &[&str], max: u64, what: &str) -> Result<Option<u64>> {
    let Some((key, v)) = keys
        .iter()
        .find_map(|k| config.get(*k).filter(|v| !v.is_null()).map(|v| (*k, v)))
    else {
        return Ok(None);
    };
    match v.as_u64() {
        Some(n) => limits::within(key, n, max, what).map(Some),
        None => Err(Error::field(
            key,
            v,
            format!("use an integer from 1 to {max} ({what})"),
        )),
    }
}

fn flag(config: &Value, key: &str, default: bool) -> bool {
    get(config, &[key])
        .and_then(Value::as_bool)
        .unwrap_or(default)
}

impl Architecture {
    /// The model's buffers as (numel, dtype): rotary `inv_freq` and `original_inv_freq`
    /// (fp32, head_dim / 2); GPT-2 has none.
    pub fn buffers(&self) -> Vec<(u64, DType)> {
        if self.family == Family::Gpt2 {
            return Vec::new();
        }
        // `inv_freq` and `original_inv_freq`; Gemma 3 has a pair per layer type.
        let tables = if self.family == Family::Gemma3 { 4 } else { 2 };
        let mut out = vec![(self.rotary_dim / 2, DType::F32); tables];
        // DeepSeek-V3's routers keep `e_score_correction_bias` in fp32.
        if let Some(moe) = self
            .moe
            .as_ref()
            .filter(|_| self.family == Family::DeepseekV3)
        {
            let routed = (0..self.layers).filter(|&l| moe.routes(l)).count();
            out.extend(std::iter::repeat_n((moe.experts, DType::F32), routed));
        }
        out
    }

    /// Read the architecture from the fields of an HF `config.json`.
    pub fn from_hf_config(config: &Value) -> Result<Self> {
        let model_type = get(config, &["model_type"])
            .and_then(Value::as_str)
            .ok_or_else(|| {
                Error::field(
                    "model_type",
                    "missing",
                    format!("one of {SUPPORTED_MODEL_TYPES}"),
                )
            })?
            .to_string();
        let mistral = model_type == "mistral";
        let family = match model_type.as_str() {
            "llama" | "mistral" => Family::Llama,
            "qwen2" => Family::Qwen2,
            "qwen3" => Family::Qwen3,
            "phi3" => Family::Phi3,
            "gemma2" => Family::Gemma2,
            "gpt2" => Family::Gpt2,
            "gemma3_text" => Family::Gemma3,
            "olmo2" => Family::Olmo2,
            "glm4" => Family::Glm4,
            "qwen3_moe" => Family::Qwen3Moe,
            "qwen2_moe" => Family::Qwen2Moe,
            "mixtral" => Family::Mixtral,
            "olmoe" => Family::Olmoe,
            "deepseek_v2" => Family::DeepseekV2,
            "deepseek_v3" => Family::DeepseekV3,
            "gpt_oss" => Family::GptOss,
            other => {
                return Err(Error::Unsupported {
                    what: format!("model_type {:?}", shown(other, SHOWN_CHARS)),
                    supported: SUPPORTED_MODEL_TYPES.to_string(),
                });
            }
        };
        const REAL_HIDDEN: &str = "real models are up to 25,600 wide";
        const REAL_HEADS: &str = "real models have up to 128 heads";
        let hidden = required_u64(
            config,
            &["hidden_size", "n_embd"],
            limits::MAX_HIDDEN,
            REAL_HIDDEN,
        )?;
        let layers = required_u64(
            config,
            &["num_hidden_layers", "n_layer"],
            limits::MAX_LAYERS,
            "the deepest real models have 126 layers",
        )?;
        let heads = required_u64(
            config,
            &["num_attention_heads", "n_head"],
            limits::MAX_HEADS,
            REAL_HEADS,
        )?;
        let vocab = required_u64(
            config,
            &["vocab_size"],
            limits::MAX_VOCAB,
            "real vocabularies have up to 262,144 tokens",
        )?;
        let kv_heads = optional_u64(
            config,
            &["num_key_value_heads"],
            limits::MAX_HEADS,
            REAL_HEADS,
        )?
        .unwrap_or(heads);
        let moe = Moe::from_hf_config(config, family)?;
        let mla = matches!(family, Family::DeepseekV2 | Family::DeepseekV3)
            .then(|| Mla::from_hf_config(config))
            .transpose()?;
        const REAL_INTERMEDIATE: &str = "real MLPs are up to 73,728 wide";
        let intermediate = match family {
            Family::Gpt2 => optional_u64(
                config,
                &["n_inner"],
                limits::MAX_INTERMEDIATE,
                "or leave it out for 4 × n_embd",
            )?
            .unwrap_or(4 * hidden),
            // MoE configs default it (the dense layers' width, or the experts' where every
            // layer routes).
            _ if moe.is_some() => optional_u64(
                config,
                &["intermediate_size"],
                limits::MAX_INTERMEDIATE,
                REAL_INTERMEDIATE,
            )?
            .unwrap_or(match family {
                Family::Qwen3Moe => 6144,
                Family::Qwen2Moe => 5632,
                Family::DeepseekV2 => 11008,
                Family::DeepseekV3 => 18432,
                _ => moe.as_ref().map_or(0, |m| m.intermediate),
            }),
            _ => required_u64(
                config,
                &["intermediate_size"],
                limits::MAX_INTERMEDIATE,
                REAL_INTERMEDIATE,
            )?,
        };
        if heads % kv_heads != 0 {
            return Err(Error::field(
                "num_key_value_heads",
                kv_heads,
                format!("it must divide num_attention_heads ({heads})"),
            ));
        }
        let head_dim = match config.get("head_dim") {
            // HF configs write `head_dim: null` (or 0) for `hidden_size / num_attention_heads`.
            Some(v) if v.as_u64() == Some(0) => None,
            _ => optional_u64(
                config,
                &["head_dim"],
                limits::MAX_HEAD_DIM,
                "real heads are 64 to 256 wide",
            )?,
        };
        let head_dim = match (head_dim, mla) {
            // DeepSeek's `head_dim` is the rotary width (`__post_init__`).
            (_, Some(mla)) => mla.qk_rope_head_dim,
            (Some(d), None) => d,
            // The config classes' defaults.
            (None, None) if family == Family::GptOss => 64,
            (None, None) if family == Family::Glm4 => 128,
            (None, None) if family == Family::Gemma3 => 256,
            (None, None) => {
                if hidden % heads != 0 {
                    return Err(Error::field(
                        "num_attention_heads",
                        heads,
                        format!("it must divide hidden_size ({hidden}) when head_dim is not given"),
                    ));
                }
                hidden / heads
            }
        };
        let max_positions = optional_u64(
            config,
            &["max_position_embeddings", "n_positions"],
            limits::MAX_POSITIONS,
            "the longest real contexts are 10M tokens",
        )?
        .unwrap_or(2048);
        let default_tie = matches!(family, Family::Gemma2 | Family::Gemma3 | Family::Gpt2);
        let attention_bias = flag(
            config,
            "attention_bias",
            matches!(family, Family::GptOss | Family::Glm4),
        );
        let qkv_bias = match family {
            Family::Qwen2 | Family::Gpt2 => true,
            Family::Qwen2Moe => flag(config, "qkv_bias", true),
            Family::Phi3 | Family::Mixtral => false,
            _ => attention_bias,
        };
        let o_bias = match family {
            Family::Gpt2 => true,
            Family::Llama
            | Family::Gemma2
            | Family::Gemma3
            | Family::Olmo2
            | Family::Qwen3
            | Family::Qwen3Moe
            | Family::Olmoe
            | Family::DeepseekV2
            | Family::DeepseekV3
            | Family::GptOss => attention_bias,
            _ => false,
        };
        let mlp_bias = match family {
            Family::Gpt2 => true,
            Family::Llama => flag(config, "mlp_bias", false),
            _ => false,
        };
        let float = |key: &str| get(config, &[key]).and_then(Value::as_f64);
        let gpt2 = family == Family::Gpt2;
        Ok(Architecture {
            family,
            model_type,
            hidden,
            intermediate,
            layers,
            heads,
            kv_heads,
            head_dim,
            vocab,
            embed_vocab: vocab,
            max_positions,
            tie_word_embeddings: flag(config, "tie_word_embeddings", default_tie),
            qkv_bias,
            o_bias,
            mlp_bias,
            // Each config class's own default where the key is absent.
            sliding_window: match config.get("sliding_window") {
                // Qwen's configs keep the window off unless `use_sliding_window` is set.
                _ if matches!(
                    family,
                    Family::Qwen2 | Family::Qwen3 | Family::Qwen3Moe | Family::Qwen2Moe
                ) && !flag(config, "use_sliding_window", false) =>
                {
                    None
                }
                Some(v) if v.as_u64() == Some(0) => Some(0),
                None if family == Family::GptOss => Some(128),
                None if matches!(family, Family::Gemma2 | Family::Gemma3) => Some(4096),
                None if mistral => Some(4096),
                _ => optional_u64(config, &["sliding_window"], u64::MAX, "a window of tokens")?,
            },
            attn_logit_softcapping: float("attn_logit_softcapping"),
            final_logit_softcapping: float("final_logit_softcapping"),
            embedding_dropout: float("embd_pdrop").unwrap_or(if gpt2 { 0.1 } else { 0.0 }),
            attention_dropout: float("attn_pdrop")
                .or_else(|| float("attention_dropout"))
                .unwrap_or(if gpt2 { 0.1 } else { 0.0 }),
            residual_dropout: float("resid_pdrop").unwrap_or(if gpt2 { 0.1 } else { 0.0 }),
            sliding_pattern: match family {
                Family::Gemma2 | Family::GptOss => Some(2),
                Family::Gemma3 => Some(
                    optional_u64(
                        config,
                        &["sliding_window_pattern"],
                        limits::MAX_LAYERS,
                        "layers per full-attention layer",
                    )?
                    .unwrap_or(6),
                ),
                _ => None,
            },
            rotary_dim: match family {
                Family::Glm4 => {
                    let factor = float("partial_rotary_factor").unwrap_or(0.5);
                    if !(factor > 0.0 && factor <= 1.0) {
                        return Err(Error::field(
                            "partial_rotary_factor",
                            factor,
                            "use a number in (0, 1]",
                        ));
                    }
                    ((head_dim as f64 * factor) as u64).max(2)
                }
                _ => head_dim,
            },
            moe,
            mla,
        })
    }

    /// Whether decoder layer `layer` attends within a sliding window.
    pub fn is_sliding(&self, layer: u64) -> bool {
        match self.sliding_pattern {
            Some(pattern) => self.sliding_window.is_some() && !(layer + 1).is_multiple_of(pattern),
            None => self.sliding_window.is_some(),
        }
    }

    pub fn norm_kind(&self) -> NormKind {
        match self.family {
            Family::Gemma2 | Family::Gemma3 => NormKind::RmsOnePlus,
            Family::Gpt2 => NormKind::LayerNorm,
            Family::GptOss | Family::Olmo2 => NormKind::RmsWeightFirst,
            _ => NormKind::Rms,
        }
    }

    /// What one rank of a tensor-parallel group of `tp` holds and computes: its share of the
    /// attention heads (query and key/value), of the MLP's width and of the head's vocabulary
    /// rows, and of the embedding's where the plan splits it (torchtitan's, not transformers').
    pub fn tensor_parallel_shard(&self, tp: u64, splits_embedding: bool) -> Architecture {
        Architecture {
            heads: self.heads / tp,
            kv_heads: self.kv_heads / tp,
            intermediate: self.intermediate / tp,
            vocab: self.vocab / tp,
            embed_vocab: if splits_embedding {
                self.embed_vocab / tp
            } else {
                self.embed_vocab
            },
            ..self.clone()
        }
    }

    /// What one rank of an expert-parallel group of `ep` holds: `experts / ep` of each MoE
    /// layer's routed experts, everything else whole.
    pub fn expert_parallel_shard(&self, ep: u64) -> Architecture {
        let mut shard = self.clone();
        if let Some(moe) = shard.moe.as_mut() {
            moe.expert_parallel = ep;
        }
        shard
    }

    /// Width of the query projection (`heads * head_dim`).
    pub fn q_dim(&self) -> u64 {
        self.heads * self.head_dim
    }

    /// Width of each of the key and value projections.
    pub fn kv_dim(&self) -> u64 {
        self.kv_heads * self.head_dim
    }

    /// Whether the output head is a separate tensor (not tied to the input embedding).
    pub fn has_separate_lm_head(&self, head: Head) -> bool {
        matches!(head, Head::CausalLm) && !self.tie_word_embeddings
    }

    /// Every parameter, in the order transformers creates them for this head. A tied `lm_head`
    /// is not listed: it is the embedding (transformers creates it, then frees it when tying).
    pub fn parameters(&self, head: Head) -> Vec<Param> {
        let mut out = Vec::with_capacity((self.layers as usize) * 16 + 8);
        let h = self.hidden;
        let vector = |module, layer, n, is_bias| Param {
            module,
            layer,
            rows: n,
            cols: 1,
            is_bias,
        };
        let linear = |out: &mut Vec<Param>, module, layer, rows, cols, bias: bool| {
            out.push(Param {
                module,
                layer,
                rows,
                cols,
                is_bias: false,
            });
            if bias {
                out.push(vector(module, layer, rows, true));
            }
        };
        match self.family {
            Family::Gpt2 => {
                out.push(Param {
                    module: Module::Embed,
                    layer: None,
                    rows: self.embed_vocab,
                    cols: h,
                    is_bias: false,
                });
                out.push(Param {
                    module: Module::PosEmbed,
                    layer: None,
                    rows: self.max_positions,
                    cols: h,
                    is_bias: false,
                });
                for l in 0..self.layers as u32 {
                    let layer = Some(l);
                    out.push(vector(Module::InputNorm, layer, h, false));
                    out.push(vector(Module::InputNorm, layer, h, true));
                    linear(&mut out, Module::CAttn, layer, 3 * h, h, true);
                    linear(&mut out, Module::CProjAttn, layer, h, h, true);
                    out.push(vector(Module::PostAttnNorm, layer, h, false));
                    out.push(vector(Module::PostAttnNorm, layer, h, true));
                    linear(&mut out, Module::CFc, layer, self.intermediate, h, true);
                    linear(
                        &mut out,
                        Module::CProjMlp,
                        layer,
                        h,
                        self.intermediate,
                        true,
                    );
                }
                out.push(vector(Module::FinalNorm, None, h, false));
                out.push(vector(Module::FinalNorm, None, h, true));
            }
            _ => {
                out.push(Param {
                    module: Module::Embed,
                    layer: None,
                    rows: self.embed_vocab,
                    cols: h,
                    is_bias: false,
                });
                let (q, kv, i) = (self.q_dim(), self.kv_dim(), self.intermediate);
                for l in 0..self.layers as u32 {
                    let layer = Some(l);
                    if self.moe.is_some() || self.mla.is_some() {
                        self.moe_layer_parameters(&mut out, l);
                        continue;
                    } else if self.family == Family::Glm4 {
                        linear(&mut out, Module::Q, layer, q, h, self.qkv_bias);
                        linear(&mut out, Module::K, layer, kv, h, self.qkv_bias);
                        linear(&mut out, Module::V, layer, kv, h, self.qkv_bias);
                        linear(&mut out, Module::O, layer, h, q, self.o_bias);
                        linear(&mut out, Module::GateUp, layer, 2 * i, h, false);
                        linear(&mut out, Module::Down, layer, h, i, false);
                        for norm in [
                            Module::InputNorm,
                            Module::PostAttnNorm,
                            Module::PostSelfAttnNorm,
                            Module::PostMlpNorm,
                        ] {
                            out.push(vector(norm, layer, h, false));
                        }
                        continue;
                    } else if self.family == Family::Phi3 {
                        linear(&mut out, Module::O, layer, h, q, self.o_bias);
                        linear(&mut out, Module::Qkv, layer, q + 2 * kv, h, self.qkv_bias);
                        linear(&mut out, Module::GateUp, layer, 2 * i, h, self.mlp_bias);
                        linear(&mut out, Module::Down, layer, h, i, self.mlp_bias);
                    } else {
                        linear(&mut out, Module::Q, layer, q, h, self.qkv_bias);
                        linear(&mut out, Module::K, layer, kv, h, self.qkv_bias);
                        linear(&mut out, Module::V, layer, kv, h, self.qkv_bias);
                        linear(&mut out, Module::O, layer, h, q, self.o_bias);
                        match self.family {
                            Family::Qwen3 | Family::Gemma3 => {
                                out.push(vector(Module::QNorm, layer, self.head_dim, false));
                                out.push(vector(Module::KNorm, layer, self.head_dim, false));
                            }
                            Family::Olmo2 => {
                                out.push(vector(Module::QNorm, layer, q, false));
                                out.push(vector(Module::KNorm, layer, kv, false));
                            }
                            _ => {}
                        }
                        linear(&mut out, Module::Gate, layer, i, h, self.mlp_bias);
                        linear(&mut out, Module::Up, layer, i, h, self.mlp_bias);
                        linear(&mut out, Module::Down, layer, h, i, self.mlp_bias);
                    }
                    if self.family != Family::Olmo2 {
                        out.push(vector(Module::InputNorm, layer, h, false));
                    }
                    out.push(vector(Module::PostAttnNorm, layer, h, false));
                    match self.family {
                        Family::Gemma2 | Family::Gemma3 => {
                            out.push(vector(Module::PreFfnNorm, layer, h, false));
                            out.push(vector(Module::PostFfnNorm, layer, h, false));
                        }
                        Family::Olmo2 => out.push(vector(Module::PostFfnNorm, layer, h, false)),
                        _ => {}
                    }
                }
                out.push(vector(Module::FinalNorm, None, h, false));
            }
        }
        match head {
            Head::CausalLm if !self.tie_word_embeddings => out.push(Param {
                module: Module::LmHead,
                layer: None,
                rows: self.vocab,
                cols: h,
                is_bias: false,
            }),
            Head::CausalLm => {}
            Head::SequenceClassification { labels } => out.push(Param {
                module: Module::Score,
                layer: None,
                rows: labels,
                cols: h,
                is_bias: false,
            }),
        }
        out
    }

    /// One decoder layer of an MoE or MLA family, in `named_parameters()` order: attention,
    /// MLP (routed or dense), then the two norms.
    fn moe_layer_parameters(&self, out: &mut Vec<Param>, l: u32) {
        let layer = Some(l);
        let h = self.hidden;
        let push = |out: &mut Vec<Param>, module, rows, cols, is_bias| {
            out.push(Param {
                module,
                layer,
                rows,
                cols,
                is_bias,
            })
        };
        let linear = |out: &mut Vec<Param>, module, rows, cols, bias: bool| {
            push(out, module, rows, cols, false);
            if bias {
                push(out, module, rows, 1, true);
            }
        };
        match self.mla {
            Some(mla) => {
                let qk = self.heads * mla.qk_head_dim();
                match mla.q_lora_rank {
                    None => linear(out, Module::Q, qk, h, false),
                    Some(r) => {
                        linear(out, Module::QA, r, h, self.qkv_bias);
                        push(out, Module::QANorm, r, 1, false);
                        linear(out, Module::QB, qk, r, false);
                    }
                }
                let kv_a = mla.kv_lora_rank + mla.qk_rope_head_dim;
                linear(out, Module::KvA, kv_a, h, self.qkv_bias);
                push(out, Module::KvANorm, mla.kv_lora_rank, 1, false);
                let kv_b = self.heads * (mla.qk_nope_head_dim + mla.v_head_dim);
                linear(out, Module::KvB, kv_b, mla.kv_lora_rank, false);
                linear(out, Module::O, h, self.heads * mla.v_head_dim, self.o_bias);
            }
            None => {
                let (q, kv) = (self.q_dim(), self.kv_dim());
                linear(out, Module::Q, q, h, self.qkv_bias);
                linear(out, Module::K, kv, h, self.qkv_bias);
                linear(out, Module::V, kv, h, self.qkv_bias);
                linear(out, Module::O, h, q, self.o_bias);
                match self.family {
                    Family::Qwen3Moe => {
                        push(out, Module::QNorm, self.head_dim, 1, false);
                        push(out, Module::KNorm, self.head_dim, 1, false);
                    }
                    Family::Olmoe => {
                        push(out, Module::QNorm, q, 1, false);
                        push(out, Module::KNorm, kv, 1, false);
                    }
                    Family::GptOss => push(out, Module::Sinks, self.heads, 1, false),
                    _ => {}
                }
            }
        }
        let moe = self.moe.as_ref().filter(|m| m.routes(u64::from(l)));
        match moe {
            None => {
                let i = self.intermediate;
                linear(out, Module::Gate, i, h, self.mlp_bias);
                linear(out, Module::Up, i, h, self.mlp_bias);
                linear(out, Module::Down, h, i, self.mlp_bias);
            }
            Some(m) => {
                let (e, i) = (m.local_experts(), m.intermediate);
                let router = |out: &mut Vec<Param>| {
                    linear(
                        out,
                        Module::Router,
                        m.experts,
                        h,
                        self.family == Family::GptOss,
                    )
                };
                let experts = |out: &mut Vec<Param>| {
                    let bias = self.family == Family::GptOss;
                    push(out, Module::ExpertsGateUp, e * 2 * i, h, false);
                    if bias {
                        push(out, Module::ExpertsGateUp, e * 2 * i, 1, true);
                    }
                    push(out, Module::ExpertsDown, e * h, i, false);
                    if bias {
                        push(out, Module::ExpertsDown, e * h, 1, true);
                    }
                };
                let shared = |out: &mut Vec<Param>| {
                    let s = m.shared_intermediate;
                    if s > 0 {
                        linear(out, Module::SharedGate, s, h, false);
                        linear(out, Module::SharedUp, s, h, false);
                        linear(out, Module::SharedDown, h, s, false);
                    }
                    if m.shared_expert_gate {
                        linear(out, Module::SharedExpertGate, 1, h, false);
                    }
                };
                match self.family {
                    // The block creates its experts before its router.
                    Family::Qwen3Moe | Family::DeepseekV2 | Family::DeepseekV3 => {
                        experts(out);
                        router(out);
                    }
                    _ => {
                        router(out);
                        experts(out);
                    }
                }
                shared(out);
            }
        }
        push(out, Module::InputNorm, h, 1, false);
        push(out, Module::PostAttnNorm, h, 1, false);
    }

    /// The key of a parameter in a saved checkpoint (`model.layers.3.mlp.down_proj.weight`).
    pub fn checkpoint_name(&self, p: &Param, head: Head) -> String {
        let leaf = if p.is_bias { "bias" } else { "weight" };
        let layer_scope = |path: &str| format!("model.layers.{}.{path}", p.layer.unwrap_or(0));
        let shared = if self.family == Family::Qwen2Moe {
            "shared_expert"
        } else {
            "shared_experts"
        };
        match p.module {
            Module::ExpertsGateUp | Module::ExpertsDown => {
                let suffix = if p.is_bias { "_bias" } else { "" };
                return layer_scope(&format!("mlp.experts.{}{suffix}", p.module.hf_name()));
            }
            Module::Router if self.family == Family::GptOss => {
                return layer_scope(&format!("mlp.router.{leaf}"));
            }
            Module::Router => return layer_scope("mlp.gate.weight"),
            Module::SharedGate | Module::SharedUp | Module::SharedDown => {
                return layer_scope(&format!("mlp.{shared}.{}.{leaf}", p.module.hf_name()));
            }
            Module::SharedExpertGate => return layer_scope("mlp.shared_expert_gate.weight"),
            Module::Sinks => return layer_scope("self_attn.sinks"),
            Module::QA
            | Module::QANorm
            | Module::QB
            | Module::KvA
            | Module::KvANorm
            | Module::KvB => {
                return layer_scope(&format!("self_attn.{}.{leaf}", p.module.hf_name()));
            }
            _ => {}
        }
        let (root, layers) = match self.family {
            Family::Gpt2 => ("transformer", "h"),
            _ => ("model", "layers"),
        };
        let scope = |module: &str| match p.layer {
            Some(l) => format!("{root}.{layers}.{l}.{module}"),
            None => format!("{root}.{module}"),
        };
        let path = match p.module {
            Module::Embed if self.family == Family::Gpt2 => scope("wte"),
            Module::Embed => scope("embed_tokens"),
            Module::PosEmbed => scope("wpe"),
            Module::FinalNorm if self.family == Family::Gpt2 => scope("ln_f"),
            Module::FinalNorm => scope("norm"),
            Module::LmHead => "lm_head".to_string(),
            Module::Score => match head {
                Head::SequenceClassification { .. } => "score".to_string(),
                Head::CausalLm => unreachable!("no score head on a causal LM"),
            },
            Module::Q
            | Module::K
            | Module::V
            | Module::O
            | Module::Qkv
            | Module::QNorm
            | Module::KNorm => scope(&format!("self_attn.{}", p.module.hf_name())),
            Module::CAttn | Module::CProjAttn => scope(&format!("attn.{}", p.module.hf_name())),
            Module::Gate
            | Module::Up
            | Module::GateUp
            | Module::Down
            | Module::CFc
            | Module::CProjMlp => scope(&format!("mlp.{}", p.module.hf_name())),
            Module::InputNorm if self.family == Family::Gpt2 => scope("ln_1"),
            Module::PostAttnNorm if self.family == Family::Gpt2 => scope("ln_2"),
            Module::InputNorm
            | Module::PostAttnNorm
            | Module::PreFfnNorm
            | Module::PostFfnNorm
            | Module::PostSelfAttnNorm
            | Module::PostMlpNorm => scope(p.module.hf_name()),
            _ => unreachable!("MoE and MLA modules are named above"),
        };
        format!("{path}.{leaf}")
    }

    /// Parameters one token runs through: the total less the routed experts it skips
    /// (`experts - top_k` per MoE layer); the total for dense models.
    pub fn active_param_count(&self, head: Head) -> u64 {
        let total = self.param_count(head);
        let Some(moe) = &self.moe else {
            return total;
        };
        let (h, i) = (self.hidden, moe.intermediate);
        let bias = if self.family == Family::GptOss {
            2 * i + h
        } else {
            0
        };
        let per_expert = 3 * i * h + bias;
        let routed = (0..self.layers).filter(|&l| moe.routes(l)).count() as u64;
        total - routed * (moe.experts - moe.top_k) * per_expert
    }

    /// Total parameter count, as `sum(p.numel() for p in model.parameters())` reports it.
    pub fn param_count(&self, head: Head) -> u64 {
        self.parameters(head).iter().map(Param::numel).sum()
    }
}
