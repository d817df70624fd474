//! `headroom models --json`: the built-in models a spec's `model:` can name.

use serde::Serialize;

use crate::arch::{Architecture, Head};

/// One catalog model; the command prints a list of them, sorted by name.
#[derive(Debug, Serialize)]
pub struct ModelJson<'a> {
    /// What `model:` takes.
    pub name: &'a str,
    /// The config's `model_type` (`llama`, `qwen2`, ...).
    pub model_type: &'a str,
    /// Parameters of the causal-LM model transformers builds.
    pub params: u64,
    pub layers: u64,
    pub hidden: u64,
    pub intermediate: u64,
    pub heads: u64,
    pub kv_heads: u64,
    pub head_dim: u64,
    pub vocab: u64,
    pub max_positions: u64,
    pub tie_word_embeddings: bool,
    /// Routed experts per MoE layer and experts per token; absent for dense models.
    pub experts: Option<u64>,
    pub experts_per_token: Option<u64>,
    /// Parameters one token runs through (the total less the experts it skips).
    pub active_params: u64,
}

impl<'a> ModelJson<'a> {
    pub fn new(name: &'a str, a: &'a Architecture) -> Self {
        Self {
            name,
            model_type: &a.model_type,
            params: a.param_count(Head::CausalLm),
            layers: a.layers,
            hidden: a.hidden,
            intermediate: a.intermediate,
            heads: a.heads,
            kv_heads: a.kv_heads,
            head_dim: a.head_dim,
            vocab: a.vocab,
            max_positions: a.max_positions,
            tie_word_embeddings: a.tie_word_embeddings,
            experts: a.moe.as_ref().map(|m| m.experts),
            experts_per_token: a.moe.as_ref().map(|m| m.top_k),
            active_params: a.active_param_count(Head::CausalLm),
        }
    }
}
