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
        }
    }
}
