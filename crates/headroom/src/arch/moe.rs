//! Mixture-of-experts layers and multi-head latent attention as transformers 5.x reads them
//! from a config: which layers route, how many experts, how the router scores them, and the
//! low-rank projections of DeepSeek's attention.

use serde_json::Value;

use super::{Family, get, optional_u64};
use crate::error::{Error, Result};
use crate::limits;

/// How a family's router turns logits into the top-k weights (each `*TopKRouter.forward`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Router {
    /// `softmax(logits, dtype=float)`, top-k, optional renormalisation, cast back to the
    /// logits' dtype (Qwen2/3-MoE, OLMoE).
    Softmax,
    /// Mixtral: as `Softmax`, always renormalised, and the weights stay fp32.
    SoftmaxFp32,
    /// DeepSeek-V2: the router runs in fp32 (copies of the input and the weight), softmax,
    /// top-k, times `routed_scaling_factor` (fp32 weights).
    DeepseekV2,
    /// DeepSeek-V3: fp32 router, sigmoid scores plus the correction bias, group-limited top-k,
    /// gathered scores, optional renormalisation, scaled (fp32 weights).
    DeepseekV3,
    /// gpt-oss: a biased linear, top-k on the logits, softmax over the k values in their dtype.
    GptOss,
}

/// The routed experts of an MoE model.
#[derive(Clone, Debug, PartialEq)]
pub struct Moe {
    /// Routed experts per MoE layer (`num_experts`, `num_local_experts`, `n_routed_experts`).
    pub experts: u64,
    /// Experts per token (`num_experts_per_tok`).
    pub top_k: u64,
    /// Each expert's MLP width (`moe_intermediate_size`; `intermediate_size` in Mixtral, OLMoE
    /// and gpt-oss).
    pub intermediate: u64,
    /// The always-on shared expert's width (Qwen2-MoE's `shared_expert_intermediate_size`,
    /// DeepSeek's `moe_intermediate_size * n_shared_experts`), 0 for none.
    pub shared_intermediate: u64,
    /// Qwen2-MoE scales the shared expert by `sigmoid(shared_expert_gate(x))`.
    pub shared_expert_gate: bool,
    pub norm_topk_prob: bool,
    pub router: Router,
    /// DeepSeek's `first_k_dense_replace`: the first layers keep a dense MLP.
    pub first_dense: u64,
    /// Qwen's `decoder_sparse_step`: layer `l` routes when `(l + 1) % step == 0`.
    pub sparse_step: u64,
    /// Qwen's `mlp_only_layers`.
    pub mlp_only: Vec<u64>,
    /// `output_router_logits`: every MoE layer's logits are kept for the load-balancing loss.
    pub output_router_logits: bool,
    /// Ranks that split the routed experts (transformers' `base_model_ep_plan`): each holds
    /// `experts / expert_parallel` of every MoE layer; the router still scores all of them.
    pub expert_parallel: u64,
}

impl Moe {
    /// Whether decoder layer `layer` routes its tokens to experts (else it runs a dense MLP).
    pub fn routes(&self, layer: u64) -> bool {
        layer >= self.first_dense
            && (layer + 1).is_multiple_of(self.sparse_step)
            && !self.mlp_only.contains(&layer)
    }

    /// The experts one rank holds and runs (`module.num_experts` after `MoEParamShard`).
    pub fn local_experts(&self) -> u64 {
        self.experts / self.expert_parallel
    }

    /// Read the MoE fields of `family` from an HF config, with transformers' defaults.
    pub(super) fn from_hf_config(config: &Value, family: Family) -> Result<Option<Moe>> {
        const REAL_EXPERTS: &str = "real models have up to 384 routed experts";
        const REAL_WIDTH: &str = "real experts are up to 73,728 wide";
        let flag = |key: &str, default: bool| {
            get(config, &[key])
                .and_then(Value::as_bool)
                .unwrap_or(default)
        };
        let count = |keys: &[&str], default: u64, max: u64, what: &str| -> Result<u64> {
            Ok(optional_u64(config, keys, max, what)?.unwrap_or(default))
        };
        let (experts_key, experts_default, top_k_default) = match family {
            Family::Qwen3Moe => ("num_experts", 128, 8),
            Family::Qwen2Moe => ("num_experts", 60, 4),
            Family::Olmoe => ("num_experts", 64, 8),
            Family::Mixtral => ("num_local_experts", 8, 2),
            Family::GptOss => ("num_local_experts", 128, 4),
            Family::DeepseekV2 => ("n_routed_experts", 64, 0),
            Family::DeepseekV3 => ("n_routed_experts", 256, 8),
            _ => return Ok(None),
        };
        let experts = count(
            &[experts_key],
            experts_default,
            limits::MAX_EXPERTS,
            REAL_EXPERTS,
        )?;
        let top_k = match optional_u64(
            config,
            &["num_experts_per_tok"],
            limits::MAX_EXPERTS,
            "experts per token",
        )? {
            Some(k) => k,
            None if top_k_default > 0 => top_k_default,
            None => {
                return Err(Error::field(
                    "num_experts_per_tok",
                    "missing",
                    "the model config must set it",
                ));
            }
        };
        if top_k > experts {
            return Err(Error::field(
                "num_experts_per_tok",
                top_k,
                format!("at most the number of experts ({experts})"),
            ));
        }
        let expert_width =
            |key: &str, default: u64| count(&[key], default, limits::MAX_INTERMEDIATE, REAL_WIDTH);
        let intermediate = match family {
            Family::Qwen3Moe => expert_width("moe_intermediate_size", 768)?,
            Family::Qwen2Moe => expert_width("moe_intermediate_size", 1408)?,
            Family::DeepseekV2 => expert_width("moe_intermediate_size", 1407)?,
            Family::DeepseekV3 => expert_width("moe_intermediate_size", 2048)?,
            Family::Mixtral => expert_width("intermediate_size", 14336)?,
            Family::Olmoe => expert_width("intermediate_size", 2048)?,
            _ => expert_width("intermediate_size", 2880)?,
        };
        let shared_intermediate = match family {
            Family::Qwen2Moe => expert_width("shared_expert_intermediate_size", 5632)?,
            Family::DeepseekV2 | Family::DeepseekV3 => {
                let default = if family == Family::DeepseekV2 { 2 } else { 1 };
                let n = match get(config, &["n_shared_experts"]) {
                    Some(v) if v.as_u64() == Some(0) => 0,
                    _ => count(&["n_shared_experts"], default, 64, "shared experts")?,
                };
                intermediate * n
            }
            _ => 0,
        };
        let router = match family {
            Family::Mixtral => Router::SoftmaxFp32,
            Family::DeepseekV2 => Router::DeepseekV2,
            Family::DeepseekV3 => Router::DeepseekV3,
            Family::GptOss => Router::GptOss,
            _ => Router::Softmax,
        };
        let first_dense = match family {
            Family::DeepseekV2 | Family::DeepseekV3 => {
                let default = if family == Family::DeepseekV3 { 3 } else { 0 };
                match get(config, &["first_k_dense_replace"]) {
                    Some(v) if v.as_u64() == Some(0) => 0,
                    _ => count(
                        &["first_k_dense_replace"],
                        default,
                        limits::MAX_LAYERS,
                        "layers",
                    )?,
                }
            }
            _ => 0,
        };
        let sparse_step = match family {
            Family::Qwen3Moe | Family::Qwen2Moe => count(
                &["decoder_sparse_step"],
                1,
                limits::MAX_LAYERS,
                "a step in layers",
            )?,
            _ => 1,
        };
        let mlp_only = match get(config, &["mlp_only_layers"]) {
            None => Vec::new(),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_u64().ok_or_else(|| {
                        Error::field("mlp_only_layers", v, "a list of layer indices")
                    })
                })
                .collect::<Result<_>>()?,
            Some(other) => {
                return Err(Error::field(
                    "mlp_only_layers",
                    other,
                    "a list of layer indices",
                ));
            }
        };
        Ok(Some(Moe {
            experts,
            top_k,
            intermediate,
            shared_intermediate,
            shared_expert_gate: family == Family::Qwen2Moe,
            norm_topk_prob: match family {
                Family::Mixtral => true,
                Family::DeepseekV3 => flag("norm_topk_prob", true),
                Family::DeepseekV2 | Family::GptOss => false,
                _ => flag("norm_topk_prob", false),
            },
            router,
            first_dense,
            sparse_step,
            mlp_only,
            output_router_logits: flag("output_router_logits", false),
            expert_parallel: 1,
        }))
    }
}

/// DeepSeek's multi-head latent attention: queries through an optional low-rank bottleneck,
/// keys and values through a shared compressed latent plus a decoupled rotary key.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Mla {
    /// `q_lora_rank`; `None`: a plain `q_proj` (DeepSeek-V2-Lite).
    pub q_lora_rank: Option<u64>,
    pub kv_lora_rank: u64,
    pub qk_nope_head_dim: u64,
    pub qk_rope_head_dim: u64,
    pub v_head_dim: u64,
}

impl Mla {
    /// Width of each query and key head (`qk_nope_head_dim + qk_rope_head_dim`).
    pub fn qk_head_dim(&self) -> u64 {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    pub(super) fn from_hf_config(config: &Value) -> Result<Mla> {
        const REAL_RANK: &str = "real latent ranks are up to 4096";
        const REAL_HEAD: &str = "real heads are 32 to 256 wide";
        let q_lora_rank = match config.get("q_lora_rank") {
            Some(Value::Null) => None,
            None => Some(1536),
            Some(_) => optional_u64(config, &["q_lora_rank"], limits::MAX_HIDDEN, REAL_RANK)?,
        };
        let dim = |key: &str, default: u64| -> Result<u64> {
            Ok(optional_u64(config, &[key], limits::MAX_HEAD_DIM, REAL_HEAD)?.unwrap_or(default))
        };
        Ok(Mla {
            q_lora_rank,
            kv_lora_rank: optional_u64(config, &["kv_lora_rank"], limits::MAX_HIDDEN, REAL_RANK)?
                .unwrap_or(512),
            qk_nope_head_dim: dim("qk_nope_head_dim", 128)?,
            qk_rope_head_dim: dim("qk_rope_head_dim", 64)?,
            v_head_dim: dim("v_head_dim", 128)?,
        })
    }
}
