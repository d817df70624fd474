//! `megatron:`, the settings of a run under `parallel.framework: megatron` that change memory:
//! Megatron-core's `DistributedOptimizer` (`use_distributed_optimizer`) and activation
//! recomputation (`recompute_granularity`, `recompute_method`, `recompute_num_layers` of
//! `TransformerConfig`), expert parallelism (`expert_model_parallel_size`), expert tensor
//! parallelism (`expert_tensor_parallel_size`), the interleaved schedule's
//! `overlap_p2p_comm`, whether NCCL's communicators are made at once (`eager_nccl_init`), the
//! selectively recomputed modules (`recompute_modules`, `moe_layer_recompute`) and the MoE
//! router's dtype and load-balancing loss (`moe_router_dtype`, `moe_aux_loss_coeff`,
//! `moe_router_load_balancing_type`), read here;
//! `RunSpec::check_megatron` and [`check_moe`] say what of Megatron is modelled and refuse the
//! rest by name.

use std::ops::Range;

use serde_json::Value;

use super::parse::{RUN_SPEC_KEY, boolean, choice, positive, unknown_key};
use super::{ExpertsImpl, RunSpec};
use crate::arch::{Architecture, Family, Router};
use crate::error::{Error, Result};

pub(crate) const MEGATRON_KEYS: &[&str] = &[
    "distributed_optimizer",
    "recompute_granularity",
    "recompute_method",
    "recompute_num_layers",
    "pipeline_model_parallel_size",
    "context_parallel_size",
    "expert_model_parallel_size",
    "expert_tensor_parallel_size",
    "transformer_impl",
    "optimizer_cpu_offload",
    "optimizer_offload_fraction",
    "overlap_cpu_optimizer_d2h_h2d",
    "overlap_p2p_comm",
    "overlap_p2p_comm_warmup_flush",
    "eager_nccl_init",
    "recompute_modules",
    "moe_layer_recompute",
    "moe_router_dtype",
    "moe_aux_loss_coeff",
    "moe_router_load_balancing_type",
    "make_vocab_size_divisible_by",
];

/// The largest `make_vocab_size_divisible_by` taken: far above any vocabulary's rounding, and
/// small enough that the padded vocabulary stays a size the simulator can hold.
const MAX_VOCAB_MULTIPLE: u64 = 1 << 20;

/// `initialize_model_parallel`'s sizes beside tensor parallelism: accepted at 1, refused by
/// name above it.
const UNMODELLED_SIZES: &[(&str, &str)] = &[
    (
        "pipeline_model_parallel_size",
        "pipeline parallelism: set parallel.pp",
    ),
    ("context_parallel_size", "context parallelism"),
];

/// Megatron-core's memory settings.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Megatron {
    /// `DistributedOptimizer`: fp32 main parameters and Adam states sharded over the
    /// data-parallel ranks, the bf16 parameters viewing one contiguous buffer.
    pub distributed_optimizer: bool,
    pub recompute: Recompute,
    /// `expert_model_parallel_size`: each rank holds `num_experts / ep` experts of every MoE
    /// layer, whose gradients are reduced over the `world / ep` expert-data-parallel ranks.
    pub expert_parallel: u64,
    /// `expert_tensor_parallel_size`: each expert's `linear_fc1` and `linear_fc2` split over
    /// `etp` ranks, which all-gather their tokens before the experts and reduce-scatter the
    /// outputs after. `None`: unset, which Megatron-LM takes as the tensor-parallel size
    /// ([`Megatron::etp`]).
    pub expert_tensor_parallel: Option<u64>,
    /// `transformer_impl: transformer_engine`: the run uses Transformer Engine's layer spec,
    /// which is not modelled; the estimate is the local spec's and says so.
    pub transformer_engine: bool,
    /// `--optimizer-cpu-offload` as Megatron-LM runs it: with the distributed optimizer,
    /// `--use-precision-aware-optimizer` (which it requires) and the whole optimizer on the
    /// host (`--optimizer-offload-fraction` 1.0, its default): `HybridDeviceOptimizer` keeps
    /// the fp32 main parameters and Adam's states in host memory.
    pub optimizer_cpu_offload: bool,
    /// `--overlap-cpu-optimizer-d2h-h2d`: the offloaded optimizer copies gradients to the host
    /// and updated parameters back on streams of its own.
    pub overlap_cpu_optimizer_d2h_h2d: bool,
    /// `overlap_p2p_comm` as given; unset, Megatron-LM's default (on unless
    /// `--no-overlap-p2p-communication`), which it turns off without interleaving.
    pub overlap_p2p_comm: Option<bool>,
    /// Whether the default process group is bound to the device
    /// (`init_process_group(device_id=...)`, as older Megatron-LM and the measuring
    /// harness does), so that torch makes every group's NCCL communicator at once; unset, as
    /// Megatron-LM's `_initialize_distributed` now calls it, a group's communicator is made at
    /// its first collective and the groups no step uses cost nothing.
    pub eager_nccl_init: bool,
    /// `moe_router_dtype: fp32`: `RouterGatingLinearFunction` casts the input and the router's
    /// weight to fp32 and returns fp32 logits, so the routing probabilities stay fp32 through
    /// the dispatcher to each expert's `per_token_scale`.
    pub router_fp32: bool,
    /// The Switch load-balancing loss's coefficient (`moe_aux_loss_coeff` under
    /// `moe_router_load_balancing_type: aux_loss`; 0 without one): above 0, each router's
    /// training forward also takes an fp32 softmax of every logit, its own top k and routing
    /// map, and attaches the loss to `probs`.
    pub aux_loss_coeff: f64,
    /// Megatron-LM's `--make-vocab-size-divisible-by` (its default 128): the vocabulary padded
    /// to a multiple of it times tp (`_vocab_size_with_padding`), the embedding, the output
    /// layer and the logits with it; 1 (unset) is megatron-core's `GPTModel` as given.
    pub vocab_divisible_by: u64,
}

impl Default for Megatron {
    fn default() -> Self {
        Megatron {
            distributed_optimizer: false,
            recompute: Recompute::None,
            expert_parallel: 1,
            expert_tensor_parallel: None,
            transformer_engine: false,
            optimizer_cpu_offload: false,
            overlap_cpu_optimizer_d2h_h2d: false,
            overlap_p2p_comm: None,
            eager_nccl_init: false,
            router_fp32: false,
            aux_loss_coeff: 0.0,
            vocab_divisible_by: 1,
        }
    }
}

/// `recompute_granularity`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Recompute {
    #[default]
    None,
    /// `selective`: the `recompute_modules` of every layer are checkpointed, one
    /// `tensor_parallel.checkpoint` each (default `[core_attn]`).
    Selective(Modules),
    /// `full`: whole layers checkpointed, `layers` at a time (`uniform`), or the first
    /// `layers` one by one (`block`).
    Full {
        method: RecomputeMethod,
        layers: u64,
    },
}

/// The `recompute_modules` of `selective` recomputation that the local layer spec runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Modules {
    /// `core_attn`: `DotProductAttention` (the score matrix, softmax and context).
    pub core_attn: bool,
    /// `mlp`: a dense layer's `MLP` (an MoE layer's is left alone, as Megatron does).
    pub mlp: bool,
    /// `moe`: the whole `MoELayer` (router, dispatch, experts, combine).
    pub moe: bool,
}

impl Default for Modules {
    /// `TransformerConfig.__post_init__`'s default, `["core_attn"]`.
    fn default() -> Self {
        Modules {
            core_attn: true,
            mlp: false,
            moe: false,
        }
    }
}

/// `recompute_modules` Megatron accepts that the local layer spec does not run this way or
/// that headroom has not measured, and why.
const UNMODELLED_MODULES: &[(&str, &str)] = &[
    ("moe_act", "needs moe_grouped_gemm (Transformer Engine)"),
    ("layernorm", "checkpoints Transformer Engine's norms"),
    (
        "mla_up_proj",
        "multi-latent attention is not modelled under megatron",
    ),
    (
        "shared_experts",
        "shared experts are not modelled under megatron",
    ),
    ("gdn_norm_out", "gated delta net is not modelled"),
];

impl Recompute {
    /// The modules `selective` recomputes; none otherwise.
    pub fn modules(&self) -> Modules {
        match self {
            Recompute::Selective(modules) => *modules,
            Recompute::None | Recompute::Full { .. } => Modules {
                core_attn: false,
                mlp: false,
                moe: false,
            },
        }
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RecomputeMethod {
    Uniform,
    Block,
}

impl Megatron {
    /// The vocabulary Megatron-LM builds under tensor parallelism `tp`: `vocab` padded to a
    /// multiple of `make_vocab_size_divisible_by × tp`.
    pub fn padded_vocab(&self, vocab: u64, tp: u64) -> u64 {
        let multiple = self.vocab_divisible_by.saturating_mul(tp);
        vocab.div_ceil(multiple).saturating_mul(multiple)
    }

    /// Whether each router computes the load-balancing loss.
    pub fn aux_loss(&self) -> bool {
        self.aux_loss_coeff > 0.0
    }

    /// The experts' data-parallel ranks, `stage_ranks / (ep × etp)`, when their parameters
    /// are reduced apart from the dense ones (`allreduce` false: `use_expert_pgs` of the
    /// parallel linears, with `ep > 1` or `etp > 1`); `None` when they share the dense buffer.
    /// Only a model with experts asks.
    pub fn expert_data_parallel(&self, stage_ranks: u64, tp: u64) -> Option<u64> {
        let (ep, etp) = (self.expert_parallel, self.etp(tp));
        (ep > 1 || etp > 1).then(|| stage_ranks / (ep * etp))
    }

    /// The expert-tensor-parallel size under tensor parallelism `tp`: as given, or tp
    /// (`arguments.py`: an unset `expert_tensor_parallel_size` is `tensor_model_parallel_size`).
    pub fn etp(&self, tp: u64) -> u64 {
        self.expert_tensor_parallel.unwrap_or(tp)
    }

    /// Whether the interleaved schedule of `vpp` chunks a rank overlaps its p2p communication.
    pub fn overlaps_p2p(&self, vpp: u64) -> bool {
        vpp > 1 && self.overlap_p2p_comm.unwrap_or(true)
    }

    /// The layer ranges `TransformerBlock._checkpointed_forward` checkpoints as one
    /// `tensor_parallel.checkpoint` each, of a block of `layers` layers: `uniform` chunks of
    /// `n` layers over the whole block, `block` the first `n` layers one by one.
    pub fn checkpointed_chunks(&self, layers: usize) -> Vec<Range<usize>> {
        match self.recompute {
            Recompute::None | Recompute::Selective(_) => Vec::new(),
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

/// `optimizer_cpu_offload` and the settings that go with it: `optimizer_offload_fraction`
/// (only Megatron-LM's default 1.0: a part of the optimizer left on the GPU is not modelled)
/// and `overlap_cpu_optimizer_d2h_h2d`; both flags.
fn parse_cpu_offload(
    obj: &serde_json::Map<String, Value>,
    distributed: bool,
) -> Result<(bool, bool)> {
    let offload = boolean(obj, "optimizer_cpu_offload").map_err(|e| e.prefixed("megatron"))?;
    let given = |key: &str| obj.get(key).filter(|v| !v.is_null());
    // Without the offload only their defaults (which the harness records) are taken.
    let defaults = [
        ("optimizer_offload_fraction", Value::from(1.0)),
        ("overlap_cpu_optimizer_d2h_h2d", Value::Bool(false)),
    ];
    for (key, default) in defaults {
        let is_default =
            |v: &&Value| v.as_f64() == default.as_f64() && v.as_bool() == default.as_bool();
        if let Some(value) = given(key).filter(|v| !offload && !is_default(v)) {
            return Err(Error::field(
                format!("megatron.{key}"),
                value,
                "it applies to optimizer_cpu_offload true; leave it out",
            ));
        }
    }
    let overlap =
        boolean(obj, "overlap_cpu_optimizer_d2h_h2d").map_err(|e| e.prefixed("megatron"))?;
    if let Some(value) = given("optimizer_offload_fraction") {
        match value.as_f64() {
            Some(1.0) => {}
            Some(f) if (0.0..1.0).contains(&f) => {
                return Err(Error::Unsupported {
                    what: format!("megatron.optimizer_offload_fraction {value}"),
                    supported: "1.0 (Megatron-LM's default): the whole optimizer on the host; \
                                a part of it left on the GPU is not modelled"
                        .into(),
                });
            }
            _ => {
                return Err(Error::field(
                    "megatron.optimizer_offload_fraction",
                    value,
                    "a number from 0 to 1 (Megatron-LM's default 1.0 offloads the whole optimizer)",
                ));
            }
        }
    }
    if offload && !distributed {
        return Err(Error::field(
            "megatron.optimizer_cpu_offload",
            true,
            "false, or distributed_optimizer true: Megatron-LM runs the offload with \
             --use-precision-aware-optimizer, which needs the distributed optimizer",
        ));
    }
    Ok((offload, overlap))
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
                supported: "Megatron-core with tensor, expert and data parallelism (pipeline \
                            and context parallel sizes 1)"
                    .into(),
            });
        }
    }
    let distributed_optimizer = boolean(obj, "distributed_optimizer").map_err(field)?;
    let expert_parallel = positive(obj, "expert_model_parallel_size", 1).map_err(field)?;
    let expert_tensor_parallel = match obj.get("expert_tensor_parallel_size") {
        None | Some(Value::Null) => None,
        Some(_) => Some(positive(obj, "expert_tensor_parallel_size", 1).map_err(field)?),
    };
    let transformer_engine = choice(
        obj,
        "transformer_impl",
        &[("local", false), ("transformer_engine", true)],
        false,
    )
    .map_err(field)?;
    let (optimizer_cpu_offload, overlap_cpu_optimizer_d2h_h2d) =
        parse_cpu_offload(obj, distributed_optimizer)?;
    let eager_nccl_init = boolean(obj, "eager_nccl_init").map_err(field)?;
    let overlap_p2p_comm = match obj.get("overlap_p2p_comm") {
        None | Some(Value::Null) => None,
        Some(_) => Some(boolean(obj, "overlap_p2p_comm").map_err(field)?),
    };
    if boolean(obj, "overlap_p2p_comm_warmup_flush").map_err(field)? {
        return Err(Error::Unsupported {
            what: "megatron.overlap_p2p_comm_warmup_flush true".into(),
            supported: "the interleaved schedule with overlap_p2p_comm true or false and \
                        overlap_p2p_comm_warmup_flush false (Megatron-LM's default)"
                .into(),
        });
    }
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
    // `--moe-layer-recompute`: `TransformerConfig.__post_init__` turns it into selective
    // recomputation with `moe` among the modules, and refuses it with full.
    let moe_layer_recompute = boolean(obj, "moe_layer_recompute").map_err(field)?;
    if moe_layer_recompute && granularity == Granularity::Full {
        return Err(Error::field(
            "megatron.moe_layer_recompute",
            true,
            "false with recompute_granularity full (Megatron refuses both), or use \
             recompute_granularity selective",
        ));
    }
    if given("recompute_modules") && granularity != Granularity::Selective {
        return Err(Error::field(
            "megatron.recompute_modules",
            &obj["recompute_modules"],
            "it applies to recompute_granularity selective; leave it out",
        ));
    }
    let mut modules = match obj.get("recompute_modules") {
        None | Some(Value::Null) => Modules::default(),
        Some(value) => parse_modules(value)?,
    };
    modules.moe |= moe_layer_recompute;
    let recompute = match granularity {
        Granularity::None if moe_layer_recompute => Recompute::Selective(modules),
        Granularity::None => Recompute::None,
        Granularity::Selective => Recompute::Selective(modules),
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
    let router_fp32 = match obj.get("moe_router_dtype") {
        None | Some(Value::Null) => false,
        Some(_) => choice(obj, "moe_router_dtype", &[("fp32", true)], false).map_err(field)?,
    };
    let coefficient = match obj.get("moe_aux_loss_coeff") {
        None | Some(Value::Null) => 0.0,
        Some(value) => value
            .as_f64()
            .filter(|c| c.is_finite() && *c >= 0.0)
            .ok_or_else(|| {
                Error::field(
                    "megatron.moe_aux_loss_coeff",
                    value,
                    "a number >= 0 (Megatron's default 0 computes no loss)",
                )
            })?,
    };
    let balancing = match obj.get("moe_router_load_balancing_type") {
        None | Some(Value::Null) => true,
        Some(_) => choice(
            obj,
            "moe_router_load_balancing_type",
            &[("aux_loss", true), ("none", false)],
            true,
        )
        .map_err(field)?,
    };
    Ok(Megatron {
        distributed_optimizer,
        recompute,
        expert_parallel,
        expert_tensor_parallel,
        transformer_engine,
        optimizer_cpu_offload,
        overlap_cpu_optimizer_d2h_h2d,
        overlap_p2p_comm,
        eager_nccl_init,
        router_fp32,
        aux_loss_coeff: if balancing { coefficient } else { 0.0 },
        vocab_divisible_by: match positive(obj, "make_vocab_size_divisible_by", 1).map_err(field)? {
            n if n > MAX_VOCAB_MULTIPLE => {
                return Err(Error::field(
                    "megatron.make_vocab_size_divisible_by",
                    n,
                    format!(
                        "an integer from 1 to {MAX_VOCAB_MULTIPLE} (Megatron-LM's default is 128)"
                    ),
                ));
            }
            n => n,
        },
    })
}

/// `recompute_modules`: a list of module names, each modelled or refused by name.
fn parse_modules(value: &Value) -> Result<Modules> {
    const KEY: &str = "megatron.recompute_modules";
    const ALLOWED: &str = "a list of core_attn, mlp, moe";
    let names = value
        .as_array()
        .ok_or_else(|| Error::field(KEY, value, ALLOWED))?;
    let mut modules = Modules {
        core_attn: false,
        mlp: false,
        moe: false,
    };
    for name in names {
        match name.as_str() {
            Some("core_attn") => modules.core_attn = true,
            Some("mlp") => modules.mlp = true,
            Some("moe") => modules.moe = true,
            Some(other) => {
                return Err(
                    match UNMODELLED_MODULES.iter().find(|(known, _)| *known == other) {
                        Some((_, why)) => Error::Unsupported {
                            what: format!("{KEY} {other} ({why})"),
                            supported: "core_attn, mlp and moe with the local layer spec".into(),
                        },
                        None => Error::field(KEY, name, ALLOWED),
                    },
                );
            }
            None => return Err(Error::field(KEY, name, ALLOWED)),
        }
    }
    Ok(modules)
}

/// What Megatron's `MoELayer` with the local layer spec is modelled for, given the model and the
/// run's `world` ranks and tensor-parallel size `tp` (`parallel_state.initialize_model_parallel`,
/// `BaseMoELayer`, `MoELayer.forward`): Qwen3-MoE's softmax router renormalised over the top k
/// (`moe_router_pre_softmax` false), every layer routed, no shared expert; `ep` dividing the
/// experts and the world; tensor parallelism only with sequence parallelism (`MoELayer.forward`
/// refuses it otherwise in training), each rank routing its `1/tp` of the sequence; `etp`
/// dividing the experts' width (`ColumnParallelLinear`'s `divide`) and `ep × etp` the ranks.
pub(crate) fn check_moe(spec: &RunSpec, megatron: &Megatron, arch: &Architecture) -> Result<()> {
    // A pipeline stage's ranks: expert parallelism divides them (`RankGenerator`'s expert layout).
    let (world, tp) = spec
        .parallel
        .as_ref()
        .map_or((1, 1), |p| (p.world_size / p.pipeline.pp, p.tensor.tp));
    let (ep, etp) = (megatron.expert_parallel, megatron.etp(tp));
    let Some(moe) = &arch.moe else {
        // Megatron-LM resolves an unset expert tensor parallelism to tp for a dense model too
        // (and its harness records that): tp is as good as 1 where there are no experts.
        let etp = megatron.expert_tensor_parallel.filter(|&etp| etp != tp);
        for (key, size) in [
            ("expert_model_parallel_size", ep),
            ("expert_tensor_parallel_size", etp.unwrap_or(1)),
        ] {
            if size > 1 {
                return Err(Error::field(
                    format!("megatron.{key}"),
                    size,
                    "use 1 with a dense model (Megatron needs num_moe_experts for expert \
                     parallelism)",
                ));
            }
        }
        let moe_only = [
            ("moe_router_dtype", megatron.router_fp32, "fp32"),
            (
                "moe_aux_loss_coeff",
                megatron.aux_loss(),
                "a coefficient > 0",
            ),
        ];
        if let Some((key, _, given)) = moe_only.into_iter().find(|&(_, set, _)| set) {
            return Err(Error::field(
                format!("megatron.{key}"),
                given,
                "leave it out with a dense model: it applies to MoE routers",
            ));
        }
        return Ok(());
    };
    let routes_every_layer = (0..arch.layers).all(|l| moe.routes(l));
    // Megatron's `TopKRouter` (`moe_router_pre_softmax` false: top-k of the logits, then a
    // softmax over the k) computes what Qwen3-MoE with `norm_topk_prob` and Mixtral compute.
    let renormalised_softmax = match arch.family {
        Family::Qwen3Moe => moe.router == Router::Softmax && moe.norm_topk_prob,
        Family::Mixtral => true,
        _ => false,
    };
    if !renormalised_softmax || moe.shared_intermediate > 0 || !routes_every_layer {
        return Err(Error::Unsupported {
            what: format!("framework megatron with this {} model", arch.model_type),
            supported: "Megatron's MoELayer for Qwen3-MoE and Mixtral models: every layer \
                        routed (no mlp_only_layers, decoder_sparse_step 1), norm_topk_prob true, \
                        no shared expert"
                .into(),
        });
    }
    let sequence_parallel = spec
        .parallel
        .as_ref()
        .is_some_and(|p| p.tensor.sequence_parallel);
    if tp > 1 && !sequence_parallel {
        return Err(Error::field(
            "parallel.sequence_parallel",
            false,
            format!(
                "true with parallel.tp {tp} and an MoE model: Megatron's MoELayer.forward \
                 raises in training when tensor parallelism runs without sequence parallelism"
            ),
        ));
    }
    if spec.routing_factor != 1.0 || spec.experts != ExpertsImpl::default() {
        return Err(Error::Unsupported {
            what: "routing or experts_implementation with framework megatron".into(),
            supported: "Megatron's SequentialMLP under balanced routing (leave both out)".into(),
        });
    }
    if !moe.experts.is_multiple_of(ep) {
        return Err(Error::field(
            "megatron.expert_model_parallel_size",
            ep,
            format!("a divisor of num_experts ({})", moe.experts),
        ));
    }
    if !moe.intermediate.is_multiple_of(etp) {
        return Err(Error::field(
            "megatron.expert_tensor_parallel_size",
            etp,
            format!(
                "a divisor of moe_intermediate_size ({}): each expert's linear_fc1 and \
                 linear_fc2 are split over the expert-tensor-parallel ranks",
                moe.intermediate
            ),
        ));
    }
    if !world.is_multiple_of(etp) {
        return Err(Error::field(
            "megatron.expert_tensor_parallel_size",
            etp,
            format!(
                "a divisor of parallel.world_size / pp ({world}): the expert-data-parallel \
                 ranks are world_size / (pp * ep * expert_tensor_parallel_size)"
            ),
        ));
    }
    if !world.is_multiple_of(ep * etp) {
        return Err(Error::field(
            "megatron.expert_model_parallel_size",
            ep,
            format!(
                "a divisor of parallel.world_size / (pp * expert_tensor_parallel_size) ({}): \
                 the expert-data-parallel ranks are world_size / (pp * ep * \
                 expert_tensor_parallel_size)",
                world / etp
            ),
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
            recompute: Recompute::Full { method, layers },
            ..Megatron::default()
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
            recompute: Recompute::Selective(Modules::default()),
            ..Megatron::default()
        };
        assert!(selective.checkpointed_chunks(4).is_empty());
    }

    #[test]
    fn selective_modules_follow_megatrons_config() {
        let parsed = |v: Value| parse_megatron(&v).unwrap().recompute;
        let err = |v: Value| parse_megatron(&v).unwrap_err().to_string();
        assert_eq!(
            parsed(json!({"recompute_granularity": "selective"})),
            Recompute::Selective(Modules::default())
        );
        // `--moe-layer-recompute` alone: selective, the default core_attn and moe.
        assert_eq!(
            parsed(json!({"moe_layer_recompute": true})),
            Recompute::Selective(Modules {
                core_attn: true,
                mlp: false,
                moe: true
            })
        );
        assert_eq!(
            parsed(json!({"recompute_granularity": "selective",
                "recompute_modules": ["moe", "mlp"]})),
            Recompute::Selective(Modules {
                core_attn: false,
                mlp: true,
                moe: true
            })
        );
        assert!(
            err(json!({"recompute_granularity": "full", "moe_layer_recompute": true}))
                .contains("megatron.moe_layer_recompute")
        );
        assert!(
            err(json!({"recompute_modules": ["moe"]}))
                .contains("applies to recompute_granularity selective")
        );
        let act =
            err(json!({"recompute_granularity": "selective", "recompute_modules": ["moe_act"]}));
        assert!(
            act.contains("moe_act") && act.contains("grouped_gemm"),
            "{act}"
        );
        assert!(
            err(json!({"recompute_granularity": "selective", "recompute_modules": ["attn"]}))
                .contains("core_attn, mlp, moe")
        );
        assert!(
            err(json!({"recompute_granularity": "selective", "recompute_modules": "moe"}))
                .contains("a list of")
        );
    }

    #[test]
    fn the_router_settings_say_when_a_loss_is_computed() {
        let parsed = |v: Value| parse_megatron(&v).unwrap();
        let err = |v: Value| parse_megatron(&v).unwrap_err().to_string();
        assert!(parsed(json!({"moe_router_dtype": "fp32"})).router_fp32);
        // Megatron-LM's `_vocab_size_with_padding`: Qwen3's 151,936 under tp 4 and 128.
        let padded = parsed(json!({"make_vocab_size_divisible_by": 128}));
        assert_eq!(padded.padded_vocab(151_936, 4), 152_064);
        assert_eq!(padded.padded_vocab(151_936, 1), 151_936);
        assert_eq!(parsed(json!({})).padded_vocab(151_936, 4), 151_936);
        assert!(
            err(json!({"make_vocab_size_divisible_by": 0}))
                .contains("megatron.make_vocab_size_divisible_by")
        );
        assert!(
            err(json!({"make_vocab_size_divisible_by": u64::MAX}))
                .contains("an integer from 1 to 1048576")
        );
        assert!(err(json!({"moe_router_dtype": "fp64"})).contains("megatron.moe_router_dtype"));
        // Megatron's defaults: `aux_loss` balancing with a coefficient of 0, so no loss.
        assert!(!parsed(json!({})).aux_loss());
        assert!(!parsed(json!({"moe_aux_loss_coeff": 0})).aux_loss());
        assert!(parsed(json!({"moe_aux_loss_coeff": 1e-3})).aux_loss());
        assert!(
            !parsed(json!({"moe_aux_loss_coeff": 1e-3, "moe_router_load_balancing_type": "none"}))
                .aux_loss()
        );
        assert!(err(json!({"moe_aux_loss_coeff": -1})).contains("a number >= 0"));
        assert!(
            err(json!({"moe_router_load_balancing_type": "sinkhorn"})).contains("aux_loss, none")
        );
    }

    /// Megatron-LM's offload: the distributed optimizer, the whole optimizer on the host; the
    /// settings that go with it only beside it.
    #[test]
    fn the_cpu_offload_is_megatron_lms_and_its_settings_go_with_it() {
        let parsed = |v: Value| {
            parse_megatron(&v).map(|m| (m.optimizer_cpu_offload, m.overlap_cpu_optimizer_d2h_h2d))
        };
        let err = |v: Value| parse_megatron(&v).unwrap_err().to_string();
        let offload = json!({"distributed_optimizer": true, "optimizer_cpu_offload": true,
            "optimizer_offload_fraction": 1.0, "overlap_cpu_optimizer_d2h_h2d": true});
        assert_eq!(parsed(offload).unwrap(), (true, true));
        assert!(
            err(json!({"optimizer_cpu_offload": true}))
                .contains("--use-precision-aware-optimizer, which needs the distributed optimizer")
        );
        let partial = err(
            json!({"distributed_optimizer": true, "optimizer_cpu_offload": true,
            "optimizer_offload_fraction": 0.5}),
        );
        assert!(
            partial.contains("optimizer_offload_fraction 0.5"),
            "{partial}"
        );
        assert!(
            err(
                json!({"distributed_optimizer": true, "optimizer_cpu_offload": true,
                "optimizer_offload_fraction": 2})
            )
            .contains("a number from 0 to 1")
        );
        assert!(
            err(json!({"overlap_cpu_optimizer_d2h_h2d": true}))
                .contains("applies to optimizer_cpu_offload true")
        );
        assert!(
            err(json!({"optimizer_offload_fraction": 0.5}))
                .contains("applies to optimizer_cpu_offload true")
        );
        let recorded = json!({"optimizer_cpu_offload": false, "optimizer_offload_fraction": 1.0,
            "overlap_cpu_optimizer_d2h_h2d": false});
        assert_eq!(parsed(recorded).unwrap(), (false, false));
        assert!(
            err(
                json!({"distributed_optimizer": true, "optimizer_cpu_offload": true,
                "overlap_cpu_optimizer_d2h_h2d": "yes"})
            )
            .contains("megatron.overlap_cpu_optimizer_d2h_h2d")
        );
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
        assert_eq!(
            parse_megatron(&json!({"expert_tensor_parallel_size": 4}))
                .unwrap()
                .expert_tensor_parallel,
            Some(4)
        );
        assert!(
            err(json!({"expert_tensor_parallel_size": 0}))
                .contains("megatron.expert_tensor_parallel_size")
        );
        assert!(err(json!({"transformer_impl": "te"})).contains("local, transformer_engine"));
        let te = parse_megatron(&json!({"transformer_impl": "transformer_engine",
            "optimizer_cpu_offload": true, "distributed_optimizer": true}))
        .unwrap();
        assert!(te.transformer_engine && te.optimizer_cpu_offload);
        assert_eq!(
            parse_megatron(&json!({"expert_model_parallel_size": 8}))
                .unwrap()
                .expert_parallel,
            8
        );
        assert!(err(json!({"context_parallel_size": 0})).contains("integer >= 1"));
        assert!(err(json!({"overlap_p2p_comm": 1})).contains("megatron.overlap_p2p_comm"));
        let flush = err(json!({"overlap_p2p_comm_warmup_flush": true}));
        assert!(
            flush.contains("overlap_p2p_comm_warmup_flush true"),
            "{flush}"
        );
        let given = |v: Value| parse_megatron(&json!({"overlap_p2p_comm": v})).unwrap();
        // Megatron-LM overlaps an interleaved schedule unless told not to, and no other.
        assert!(given(Value::Null).overlaps_p2p(2) && !given(Value::Null).overlaps_p2p(1));
        assert!(!given(json!(false)).overlaps_p2p(2) && given(json!(true)).overlaps_p2p(3));
        assert!(parse_megatron(&json!({"pipeline_model_parallel_size": 1})).is_ok());
        assert_eq!(
            parse_megatron(&json!({"recompute_granularity": "full"})).unwrap(),
            Megatron {
                recompute: Recompute::Full {
                    method: RecomputeMethod::Uniform,
                    layers: 1
                },
                ..Megatron::default()
            }
        );
    }
}
