//! `megatron:`, the settings of a run under `parallel.framework: megatron` that change memory:
//! Megatron-core's `DistributedOptimizer` (`use_distributed_optimizer`) and activation
//! recomputation (`recompute_granularity`, `recompute_method`, `recompute_num_layers` of
//! `TransformerConfig`). What is modelled of Megatron, and what is refused by name, is checked
//! here in one place.

use std::ops::Range;

use serde_json::Value;

use super::parse::{boolean, choice, positive, unknown_key};
use super::run::{Framework, Mode, Optimizer, Precision, RUN_SPEC_KEY, RunSpec, Strategy, Task};
use crate::arch::Architecture;
use crate::error::{Error, Result};

pub(crate) const MEGATRON_KEYS: &[&str] = &[
    "distributed_optimizer",
    "recompute_granularity",
    "recompute_method",
    "recompute_num_layers",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
];

/// `initialize_model_parallel`'s sizes beside tensor parallelism: accepted at 1, refused by
/// name above it.
const UNMODELLED_SIZES: &[(&str, &str)] = &[
    ("pipeline_model_parallel_size", "pipeline parallelism"),
    ("context_parallel_size", "context parallelism"),
    ("expert_model_parallel_size", "expert parallelism"),
];

/// Megatron-core's memory settings.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Megatron {
    /// `DistributedOptimizer`: fp32 main parameters and Adam states sharded over the
    /// data-parallel ranks, the bf16 parameters viewing one contiguous buffer.
    pub distributed_optimizer: bool,
    pub recompute: Recompute,
}

/// `recompute_granularity`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Recompute {
    #[default]
    None,
    /// `selective` with its default `recompute_modules: [core_attn]`: the core attention of
    /// every layer is checkpointed.
    Selective,
    /// `full`: whole layers checkpointed, `layers` at a time (`uniform`), or the first
    /// `layers` one by one (`block`).
    Full {
        method: RecomputeMethod,
        layers: u64,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecomputeMethod {
    Uniform,
    Block,
}

impl Megatron {
    /// The layer ranges `TransformerBlock._checkpointed_forward` checkpoints as one
    /// `tensor_parallel.checkpoint` each, of a block of `layers` layers: `uniform` chunks of
    /// `n` layers over the whole block, `block` the first `n` layers one by one.
    pub fn checkpointed_chunks(&self, layers: usize) -> Vec<Range<usize>> {
        match self.recompute {
            Recompute::None | Recompute::Selective => Vec::new(),
            Recompute::Full {
                method: RecomputeMethod::Uniform,
                layers: n,
            } => (0..layers)
                .step_by(n as usize)
                .map(|start| start..(start + n as usize).min(layers))
                .collect(),
            Recompute::Full {
                method: RecomputeMethod::Block,
                layers: n,
            } => (0..(n as usize).min(layers)).map(|l| l..l + 1).collect(),
        }
    }
}

/// The `megatron` block.
pub(crate) fn parse_megatron(value: &Value) -> Result<Megatron> {
    let obj = value.as_object().ok_or_else(|| {
        Error::field(
            "megatron",
            value,
            format!("use a mapping {{{}}}", MEGATRON_KEYS.join(", ")),
        )
    })?;
    unknown_key(obj, "megatron.", MEGATRON_KEYS, RUN_SPEC_KEY)?;
    let field = |e: Error| e.prefixed("megatron");
    for &(key, what) in UNMODELLED_SIZES {
        if positive(obj, key, 1).map_err(field)? > 1 {
            return Err(Error::Unsupported {
                what: format!("megatron.{key} {} ({what})", obj[key]),
                supported: "Megatron-core with tensor and data parallelism (pipeline, context \
                            and expert parallel sizes 1)"
                    .into(),
            });
        }
    }
    let distributed_optimizer = boolean(obj, "distributed_optimizer").map_err(field)?;
    #[derive(Clone, Copy, PartialEq)]
    enum Granularity {
        None,
        Selective,
        Full,
    }
    let granularity = match obj.get("recompute_granularity") {
        None | Some(Value::Null) => Granularity::None,
        Some(_) => choice(
            obj,
            "recompute_granularity",
            &[
                ("selective", Granularity::Selective),
                ("full", Granularity::Full),
            ],
            Granularity::None,
        )
        .map_err(field)?,
    };
    let given = |key: &str| obj.get(key).is_some_and(|v| !v.is_null());
    if granularity != Granularity::Full {
        for key in ["recompute_method", "recompute_num_layers"] {
            if given(key) {
                return Err(Error::field(
                    format!("megatron.{key}"),
                    &obj[key],
                    "it applies to recompute_granularity full; leave it out",
                ));
            }
        }
    }
    let recompute = match granularity {
        Granularity::None => Recompute::None,
        Granularity::Selective => Recompute::Selective,
        Granularity::Full => Recompute::Full {
            method: match obj.get("recompute_method") {
                None | Some(Value::Null) => RecomputeMethod::Uniform,
                Some(_) => choice(
                    obj,
                    "recompute_method",
                    &[
                        ("uniform", RecomputeMethod::Uniform),
                        ("block", RecomputeMethod::Block),
                    ],
                    RecomputeMethod::Uniform,
                )
                .map_err(field)?,
            },
            layers: positive(obj, "recompute_num_layers", 1).map_err(field)?,
        },
    };
    Ok(Megatron {
        distributed_optimizer,
        recompute,
    })
}

/// What a Megatron run is modelled for: training a causal LM in bf16 with Adam, Megatron's
/// own DDP (strategy ddp) over `world_size / tp` ranks, no pipeline, HF's checkpointing,
/// LoRA or quantization; sequence parallelism needs Transformer Engine's or apex's norm (the
/// local layer spec's `WrappedTorchNorm` refuses it).
pub(crate) fn check_combinations(spec: &RunSpec) -> Result<()> {
    let framework = spec.parallel.as_ref().map(|p| p.tensor.framework);
    let Some(parallel) = spec
        .parallel
        .as_ref()
        .filter(|_| framework == Some(Framework::Megatron))
    else {
        if spec.megatron.is_some() {
            return Err(Error::field(
                "megatron",
                "this key",
                "it applies to parallel.framework megatron; leave it out or set that",
            ));
        }
        return Ok(());
    };
    if parallel.strategy != Strategy::Ddp {
        return Err(Error::field(
            "parallel.strategy",
            parallel.strategy.name(),
            "with framework megatron use ddp (Megatron's DistributedDataParallel over \
             world_size / tp ranks; megatron.distributed_optimizer shards the optimizer)",
        ));
    }
    if parallel.tensor.sequence_parallel {
        return Err(Error::Unsupported {
            what: "parallel.sequence_parallel with framework megatron".into(),
            supported: "Megatron-core's local layer spec, which refuses sequence parallelism \
                        (its torch norm has no sequence-parallel gradients; Transformer \
                        Engine's is not modelled)"
                .into(),
        });
    }
    let refused = |what: &str| Error::Unsupported {
        what: format!("{what} with framework megatron"),
        supported: "training a causal LM (mode train) in precision bf16 with optimizer adamw, \
                    without lora, quantization or trainer"
            .into(),
    };
    if spec.task != Task::CausalLm {
        return Err(refused("task seq-cls"));
    }
    if spec.mode != Mode::Train {
        return Err(refused("mode forward"));
    }
    if spec.precision != Precision::Bf16 {
        return Err(refused(&format!("precision {}", spec.precision.name())));
    }
    if spec.optimizer != Optimizer::AdamW {
        return Err(refused(&format!("optimizer {}", spec.optimizer.name())));
    }
    if spec.lora.is_some() {
        return Err(refused("lora"));
    }
    if spec.quantization.is_some() {
        return Err(refused("quantization"));
    }
    if spec.trainer.kind != super::TrainerKind::Loop {
        return Err(refused("trainer"));
    }
    if spec.gradient_checkpointing {
        return Err(Error::field(
            "gradient_checkpointing",
            true,
            "it is HF's checkpointing; with framework megatron use \
             megatron.recompute_granularity (full or selective)",
        ));
    }
    if spec.allocator.expandable_segments {
        return Err(Error::Unsupported {
            what: "allocator.expandable_segments with framework megatron".into(),
            supported: "the default caching allocator (the measured rows use it)".into(),
        });
    }
    Ok(())
}

/// What Megatron's GPTModel with the local layer spec needs of the model: a dense Llama-style
/// decoder (RMSNorm, SwiGLU, rotary), an output layer of its own, and heads, query groups,
/// MLP width and vocabulary that divide over the tensor-parallel ranks (query groups at
/// least `tp`: fewer are all-gathered, which is not modelled).
pub(crate) fn check_against(spec: &RunSpec, arch: &Architecture) -> Result<()> {
    use crate::arch::Family;
    let Some(megatron) = spec.megatron.filter(|_| {
        spec.parallel
            .as_ref()
            .is_some_and(|p| p.tensor.framework == Framework::Megatron)
    }) else {
        return Ok(());
    };
    if !matches!(arch.family, Family::Llama | Family::Qwen2 | Family::Qwen3)
        || arch.moe.is_some()
        || arch.mla.is_some()
    {
        return Err(Error::Unsupported {
            what: format!("framework megatron with a {} model", arch.model_type),
            supported: "Megatron's GPTModel as dense Llama, Mistral, Qwen2 and Qwen3 models".into(),
        });
    }
    if arch.tie_word_embeddings {
        return Err(Error::Unsupported {
            what: format!(
                "framework megatron with tied word embeddings ({})",
                arch.model_type
            ),
            supported: "models with an output layer of their own (tie_word_embeddings false)"
                .into(),
        });
    }
    let tp = spec.parallel.as_ref().map_or(1, |p| p.tensor.tp);
    for (what, value) in [
        ("num_attention_heads", arch.heads),
        ("num_key_value_heads", arch.kv_heads),
        ("intermediate_size", arch.intermediate),
        ("vocab_size", arch.vocab),
    ] {
        if !value.is_multiple_of(tp) {
            return Err(Error::field(
                "parallel.tp",
                tp,
                format!("it must divide the model's {what} ({value})"),
            ));
        }
    }
    if let Recompute::Full {
        method: RecomputeMethod::Block,
        layers,
    } = megatron.recompute
        && layers > arch.layers as u64
    {
        return Err(Error::field(
            "megatron.recompute_num_layers",
            layers,
            format!("use at most num_hidden_layers ({})", arch.layers),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn uniform_chunks_cover_every_layer_and_block_the_first_ones() {
        let full = |method, layers| Megatron {
            distributed_optimizer: false,
            recompute: Recompute::Full { method, layers },
        };
        assert_eq!(
            full(RecomputeMethod::Uniform, 2).checkpointed_chunks(4),
            vec![0..2, 2..4]
        );
        assert_eq!(
            full(RecomputeMethod::Uniform, 1).checkpointed_chunks(3),
            vec![0..1, 1..2, 2..3]
        );
        assert_eq!(
            full(RecomputeMethod::Block, 2).checkpointed_chunks(4),
            vec![0..1, 1..2]
        );
        let selective = Megatron {
            distributed_optimizer: true,
            recompute: Recompute::Selective,
        };
        assert!(selective.checkpointed_chunks(4).is_empty());
    }

    #[test]
    fn the_block_names_a_bad_key_or_value() {
        let err = |v: Value| parse_megatron(&v).unwrap_err().to_string();
        assert!(err(json!({"recompute": "full"})).contains("megatron.recompute"));
        assert!(err(json!({"recompute_granularity": "all"})).contains("selective, full"));
        assert!(
            err(json!({"recompute_granularity": "selective", "recompute_num_layers": 2}))
                .contains("applies to recompute_granularity full")
        );
        assert!(err(json!({"distributed_optimizer": "yes"})).contains("true or false"));
        let pp = err(json!({"pipeline_model_parallel_size": 2}));
        assert!(pp.contains("pipeline parallelism"), "{pp}");
        assert!(err(json!({"expert_model_parallel_size": 8})).contains("expert parallelism"));
        assert!(err(json!({"context_parallel_size": 0})).contains("integer >= 1"));
        assert!(parse_megatron(&json!({"pipeline_model_parallel_size": 1})).is_ok());
        assert_eq!(
            parse_megatron(&json!({"recompute_granularity": "full"})).unwrap(),
            Megatron {
                distributed_optimizer: false,
                recompute: Recompute::Full {
                    method: RecomputeMethod::Uniform,
                    layers: 1
                },
            }
        );
    }
}
