//! The layout search of `fit --gpus N` for a Megatron-core spec (`parallel.framework:
//! megatron`): the candidates [`super`]'s search simulates, ranks and explains as it
//! does the torch-native ones. A candidate is a pipeline (1F1B, or the interleaved schedule with
//! `vpp` model chunks a rank) × tensor parallelism × expert parallelism and expert tensor
//! parallelism (MoE) × Megatron's DDP over the data-parallel ranks left, with the distributed
//! optimizer or not, × the micro-batch
//! that keeps the spec's global batch (`micro_batch × microbatches × dp`, as Megatron's
//! `num_microbatches` calculator requires) × recomputation (none, selective, full).
//!
//! Every candidate's rank is `estimate`'s: each pipeline rank simulated, the worst one kept.
//! Layouts the spec refuses for Megatron (tensor parallelism that does not divide the heads or
//! the vocabulary, tensor parallelism of an MoE model, expert parallelism that does not divide
//! the experts, expert tensor parallelism that does not divide their width, sequence and context
//! parallelism, which the local layer spec cannot run) are made once each and refused by the
//! spec's own checks, which name them.

use super::{
    self as layout, Candidate, Context, Evaluated, GPUS_PER_NODE, LayoutSearch, bandwidth,
    data_parallel, pipeline_keys, pipeline_words, ring,
};
use crate::arch::Architecture;
use crate::spec::{
    Framework, Megatron, Modules, Parallel, PipelineParallel, PipelineSchedule, Recompute,
    RecomputeMethod, RunSpec, Strategy, TensorParallel,
};

/// How `fit --json` names the axes a Megatron layout is chosen on, in the order they are
/// chosen (`vpp` is part of the pipeline's).
pub const AXES: &[&str] = &["pp", "tp", "ep", "etp", "dp"];

/// The most model chunks a rank holds in the interleaved schedules searched: each `vpp` is a
/// pipeline of its own to simulate, and each chunk more divides the bubble less while adding
/// its sends between stages (both in the cost model).
pub const MAX_SEARCHED_VPP: u64 = 8;

/// What the cost model adds for a Megatron layout ([`COST_MODEL`]), in words for reports.
pub const COST_MODEL: &str = "under Megatron-core: two all-reduces a layer each way for tensor \
    parallelism (its fused linear_qkv and linear_fc1), expert parallelism's token all-to-alls \
    (dispatch and combine, forward and backward, again with full recomputation) at NVLink or \
    network bandwidth, never hidden, expert tensor parallelism's all-gather of the dispatched \
    tokens and reduce-scatter of the experts' output (each way, again with full recomputation) \
    at NVLink bandwidth, never hidden, selective recomputation's attention scores computed \
    twice, and the data-parallel reduction of a rank's share (1 / (ep × etp)) of the experts";

/// Whether `spec` is laid out by Megatron-core.
pub fn applies(spec: &RunSpec) -> bool {
    spec.parallel
        .as_ref()
        .is_some_and(|p| p.tensor.framework == Framework::Megatron)
}

/// Every candidate over `ctx.world` GPUs for the spec's `global` batch: each pipeline
/// ([`pipelines`]) × tensor-parallel degree × expert layout ([`expert_layouts`]), at each
/// micro-batch that
/// keeps the global batch, with and without the distributed optimizer (over 2 or more
/// data-parallel ranks), under each recomputation. A layout the spec refuses is one candidate
/// (refused by name); with tensor parallelism, its sequence-parallel and context-parallel
/// variants are too.
pub(super) fn candidates(ctx: &Context, global: u64) -> Vec<Candidate> {
    let base = ctx.spec.megatron.unwrap_or_default();
    let mut out = Vec::new();
    for pipeline in pipelines(ctx) {
        let stage = ctx.world / pipeline.pp;
        for tp in (1..=GPUS_PER_NODE.min(stage)).filter(|tp| stage.is_multiple_of(*tp)) {
            for (ep, etp) in expert_layouts(ctx.arch, &base, stage, tp) {
                let mut parallel = layout(ctx, &pipeline, tp);
                // Megatron's MoELayer trains under tensor parallelism only with sequence
                // parallelism.
                parallel.tensor.sequence_parallel = tp > 1 && ctx.arch.moe.is_some();
                let dp = data_parallel(&parallel);
                let batches = batches(global, dp, &pipeline);
                if batches.is_empty() {
                    continue;
                }
                let plain = Megatron {
                    expert_parallel: ep,
                    // A dense model's is the spec's, which nothing reads.
                    expert_tensor_parallel: match ctx.arch.moe {
                        Some(_) => Some(etp),
                        None => base.expert_tensor_parallel,
                    },
                    ..base
                };
                // The layout alone: a micro-batch of one sequence through each stage.
                let probe = candidate(&parallel, (1, pipeline.pp, 1), plain);
                if admitted(ctx, &probe).is_err() {
                    out.push(probe);
                    continue;
                }
                if tp > 1 {
                    let sequence = (!parallel.tensor.sequence_parallel).then_some(TensorParallel {
                        sequence_parallel: true,
                        ..parallel.tensor
                    });
                    // Context parallelism of 2 over the data-parallel ranks, where they split.
                    let context = TensorParallel {
                        cp: 2,
                        ..parallel.tensor
                    };
                    for tensor in [sequence, dp.is_multiple_of(2).then_some(context)]
                        .into_iter()
                        .flatten()
                    {
                        let variant = Parallel {
                            tensor,
                            ..parallel.clone()
                        };
                        // One micro-batch of one sequence at a time, keeping the global batch.
                        let batch = batches
                            .iter()
                            .copied()
                            .find(|&(micro, _, _)| micro == 1)
                            .unwrap_or(batches[0]);
                        out.push(candidate(&variant, batch, plain));
                    }
                }
                for &batch in &batches {
                    for distributed_optimizer in optimizers(&base, dp) {
                        for recompute in recomputations(ctx.arch, &base) {
                            let m = Megatron {
                                distributed_optimizer,
                                recompute,
                                ..plain
                            };
                            out.push(candidate(&parallel, batch, m));
                        }
                    }
                }
            }
        }
    }
    out
}

/// `parallel` at `(micro-batch, micro-batches through the pipeline, accumulation)` under `m`'s
/// settings.
fn candidate(
    parallel: &Parallel,
    (micro_batch, microbatches, accumulation): (u64, u64, u64),
    m: Megatron,
) -> Candidate {
    let mut parallel = parallel.clone();
    parallel.pipeline.microbatches = microbatches;
    Candidate {
        recompute: matches!(m.recompute, Recompute::Full { .. }),
        parallel,
        micro_batch,
        accumulation,
        megatron: Some(m),
    }
}

/// Whether the spec admits `c`'s layout for the model: Megatron's checks of the spec, those
/// that need the architecture included.
fn admitted(ctx: &Context, c: &Candidate) -> crate::error::Result<()> {
    c.spec(ctx.spec).rechecked()?.check_against(ctx.arch)
}

/// The pipelines Megatron runs the model's layers in over `ctx.world` GPUs: none; 1F1B over
/// each degree that divides the world, the layers split evenly where the degree divides them,
/// else with the first and last stages lighter (`num_layers_in_first_pipeline_stage` and
/// `..._last_...`: the middle stages take `ceil(layers / pp)`, the ends share the rest), the
/// spec's own split at its own degree; the interleaved schedule with each `vpp` from 2 to
/// [`MAX_SEARCHED_VPP`] whose `pp × vpp` chunks split the layers evenly. Each with the
/// micro-batches of one stage (the candidate's replace them).
fn pipelines(ctx: &Context) -> Vec<PipelineParallel> {
    let layers = ctx.arch.layers;
    let own = ctx.spec.parallel.as_ref().map(|p| &p.pipeline);
    let mut out = vec![PipelineParallel::default()];
    for pp in (2..=ctx.world.min(layers)).filter(|pp| ctx.world.is_multiple_of(*pp)) {
        let split = match own.filter(|o| o.pp == pp && o.vpp == 1) {
            Some(o) => o.layers_per_stage.clone(),
            None if layers.is_multiple_of(pp) => None,
            None => lighter_ends(layers, pp),
        };
        if split.is_some() || layers.is_multiple_of(pp) {
            out.push(PipelineParallel {
                pp,
                microbatches: pp,
                layers_per_stage: split,
                ..PipelineParallel::default()
            });
        }
        for vpp in (2..=MAX_SEARCHED_VPP).filter(|v| layers.is_multiple_of(pp * v)) {
            out.push(PipelineParallel {
                pp,
                vpp,
                microbatches: pp,
                schedule: PipelineSchedule::Interleaved1F1B,
                layers_per_stage: None,
            });
        }
    }
    out
}

/// `layers` over `pp >= 2` stages when `pp` does not divide them: the middle stages
/// `ceil(layers / pp)` each, the first and the last the rest (the first the smaller half), as
/// Llama 3's 405B split puts one layer fewer beside the embedding and the output layer;
/// `None` when the ends would be left no layer.
fn lighter_ends(layers: u64, pp: u64) -> Option<Vec<u64>> {
    let middle = layers.div_ceil(pp);
    let rest = layers.checked_sub((pp - 2) * middle)?;
    let first = rest / 2;
    (first >= 1).then(|| {
        let mut split = vec![middle; pp as usize];
        split[0] = first;
        split[pp as usize - 1] = rest - first;
        split
    })
}

/// The `(ep, etp)` an MoE model's experts are laid out over a stage's `ranks` data-parallel
/// ranks with, as `initialize_model_parallel` admits them (`ep × etp` divides the ranks): each
/// expert-parallel degree that divides them, and each expert-tensor-parallel degree within a
/// node that divides what is left (its gather and reduce-scatter run in every MoE layer, on the
/// critical path, as tensor parallelism's do), the spec's own besides. The spec refuses the
/// degrees that do not divide the experts (`ep`) or their width (`etp`). Under tensor
/// parallelism `tp` the experts' degree is 1 (slime's) or `tp` (Megatron-LM's default). `(1, 1)`
/// for a dense model.
fn expert_layouts(arch: &Architecture, base: &Megatron, ranks: u64, tp: u64) -> Vec<(u64, u64)> {
    if arch.moe.is_none() {
        return vec![(1, 1)];
    }
    let divisors = |n: u64| (1..=n).filter(move |d| n.is_multiple_of(*d));
    let mut out = Vec::new();
    for ep in divisors(ranks) {
        let left = ranks / ep;
        let own = base.expert_tensor_parallel;
        for etp in divisors(left) {
            let searched = if tp == 1 {
                etp <= GPUS_PER_NODE
            } else {
                etp == 1 || etp == tp
            };
            if searched || Some(etp) == own {
                out.push((ep, etp));
            }
        }
    }
    out
}

/// The spec's `pipeline` over `tp` tensor-parallel ranks and Megatron's DDP over the rest.
fn layout(ctx: &Context, pipeline: &PipelineParallel, tp: u64) -> Parallel {
    let own = ctx
        .spec
        .parallel
        .clone()
        .expect("a Megatron spec has parallel");
    Parallel {
        strategy: Strategy::Ddp,
        world_size: ctx.world,
        shard_size: ctx.world / (pipeline.pp * tp),
        tensor: TensorParallel {
            tp,
            sequence_parallel: false,
            framework: Framework::Megatron,
            cp: 1,
            ep: 1,
        },
        pipeline: pipeline.clone(),
        ..own
    }
}

/// [`layout::batches`] as Megatron's schedule takes them: the interleaved one in whole groups
/// of `pp` micro-batches.
fn batches(global: u64, dp: u64, pipeline: &PipelineParallel) -> Vec<(u64, u64, u64)> {
    let interleaved = pipeline.schedule == PipelineSchedule::Interleaved1F1B;
    layout::batches(global, dp, pipeline.pp)
        .into_iter()
        .filter(|&(_, microbatches, _)| !interleaved || microbatches.is_multiple_of(pipeline.pp))
        .collect()
}

/// The distributed optimizer off and on over 2 or more data-parallel ranks; the spec's over one
/// or with the optimizer offloaded (which needs it).
fn optimizers(base: &Megatron, dp: u64) -> Vec<bool> {
    if dp > 1 && !base.optimizer_cpu_offload {
        vec![false, true]
    } else {
        vec![base.distributed_optimizer]
    }
}

/// No recomputation, selective (the core attention; with experts, the core attention and the
/// whole `MoELayer` too), full (every layer, one at a time), and the spec's own when it is
/// another.
fn recomputations(arch: &Architecture, base: &Megatron) -> Vec<Recompute> {
    let mut out = vec![
        Recompute::None,
        Recompute::Selective(Modules::default()),
        Recompute::Full {
            method: RecomputeMethod::Uniform,
            layers: 1,
        },
    ];
    if arch.moe.is_some() {
        out.insert(
            2,
            Recompute::Selective(Modules {
                moe: true,
                ..Modules::default()
            }),
        );
    }
    if !out.contains(&base.recompute) {
        out.push(base.recompute);
    }
    out
}

/// A Megatron candidate in words: its pipeline (with an uneven split's layers), tensor, expert
/// and data parallelism, its micro-batches and recomputation.
pub(super) fn name(c: &Candidate, m: &Megatron) -> String {
    let p = &c.parallel;
    let mut parts = Vec::new();
    if let Some(pipeline) = pipeline_words(p) {
        parts.push(match &p.pipeline.layers_per_stage {
            Some(split) => format!("{pipeline} with stages of {} layers", split_words(split)),
            None => pipeline,
        });
    }
    if p.tensor.tp > 1 {
        let sp = if p.tensor.sequence_parallel {
            " + SP"
        } else {
            ""
        };
        parts.push(format!("tp {}{sp}", p.tensor.tp));
    }
    if p.tensor.cp > 1 {
        parts.push(format!("cp {}", p.tensor.cp));
    }
    // Expert (tensor) parallelism spreads each MoE layer's experts over data-parallel ranks.
    // A dense model's candidates leave etp unset; an MoE model's always set it.
    let experts: Vec<String> = [
        ("ep", m.expert_parallel),
        ("etp", m.expert_tensor_parallel.unwrap_or(1)),
    ]
    .into_iter()
    .filter(|&(_, size)| size > 1)
    .map(|(axis, size)| format!("{axis} {size}"))
    .collect();
    parts.push(format!(
        "dp {} (Megatron DDP{}){}",
        data_parallel(p),
        if m.distributed_optimizer {
            ", distributed optimizer"
        } else {
            ""
        },
        if experts.is_empty() {
            String::new()
        } else {
            format!(" with {}", experts.join(" × "))
        }
    ));
    format!(
        "{}, micro-batch {} × {}{}",
        parts.join(" × "),
        c.micro_batch,
        c.pipelined() * c.accumulation,
        match m.recompute {
            Recompute::None => String::new(),
            Recompute::Selective(modules) if modules == Modules::default() => {
                ", selective recompute".into()
            }
            Recompute::Selective(modules) => {
                format!(
                    ", selective recompute of {}",
                    module_names(modules).join(", ")
                )
            }
            Recompute::Full {
                method: RecomputeMethod::Uniform,
                layers: 1,
            } => ", full recompute".into(),
            Recompute::Full {
                method: RecomputeMethod::Uniform,
                layers,
            } => format!(", full recompute of {layers} layers at a time"),
            Recompute::Full {
                method: RecomputeMethod::Block,
                layers,
            } => format!(", full recompute of the first {layers} layers"),
        }
    )
}

/// Why the best layout splits each expert over expert-tensor-parallel ranks when no layout
/// that keeps the experts whole fits (otherwise the cost model's comparison says what the
/// split costs): what it splits and what its collectives cost.
pub(super) fn why_split_experts(s: &LayoutSearch) -> Option<String> {
    let best = s.best()?;
    let tp = |e: &Evaluated| e.candidate.parallel.tensor.tp;
    let etp = best.candidate.megatron?.etp(tp(best));
    let whole = |e: &Evaluated| e.candidate.megatron.is_none_or(|m| m.etp(tp(e)) == 1);
    // A dense model's etp splits nothing (no expert collectives to pay for).
    let splits = etp > 1 && best.time.expert_tensor_s > 0.0;
    (splits && !s.ranked.iter().any(whole)).then(|| {
        format!(
            "no layout that keeps each expert whole on a rank fits: it splits every expert's \
             linear_fc1 and linear_fc2 over etp {etp} ranks, which all-gather the dispatched \
             tokens and reduce-scatter the experts' output in every MoE layer ({:.1}% of its \
             step under the cost model)",
            100.0 * best.time.expert_tensor_s / best.time.total_s
        )
    })
}

/// What binding the device costs the best layout's worst rank when the spec makes every
/// group's NCCL communicator at once (`megatron.eager_nccl_init`): Megatron-LM's own
/// `_initialize_distributed` binds none, so a step's first collectives make only the groups it
/// uses.
pub(super) fn why_eager_nccl(setup: &crate::plan::Setup, s: &LayoutSearch) -> Option<String> {
    let best = s.best()?;
    let spec = best.candidate.spec(&setup.spec);
    let eager = spec.megatron.filter(|m| m.eager_nccl_init)?;
    let (_, arch) = spec.architecture(setup.spec_dir, "").ok()?;
    let lazy = RunSpec {
        megatron: Some(Megatron {
            eager_nccl_init: false,
            ..eager
        }),
        ..spec.clone()
    };
    let groups = crate::estimate::megatron_groups(&spec, &arch, 0);
    let used = groups.iter().filter(|g| g.used).count();
    let saved = crate::estimate::run_nccl_bytes(&spec, &arch, None)
        .saturating_sub(crate::estimate::run_nccl_bytes(&lazy, &arch, None));
    Some(format!(
        "its ranks make all {} process groups' NCCL communicators at once \
         (megatron.eager_nccl_init: init_process_group bound to the device); without device_id, \
         as Megatron-LM's _initialize_distributed calls it, the {used} a step uses are made at \
         their first collective and a rank keeps {} more free",
        groups.len(),
        crate::units::gib(saved)
    ))
}

/// A stage split in words, runs of equal counts folded: `7, 8 × 14, 7`.
fn split_words(split: &[u64]) -> String {
    let mut runs: Vec<(u64, usize)> = Vec::new();
    for &n in split {
        match runs.last_mut() {
            Some((last, count)) if *last == n => *count += 1,
            _ => runs.push((n, 1)),
        }
    }
    runs.iter()
        .map(|&(n, count)| match count {
            1 => n.to_string(),
            _ => format!("{n} × {count}"),
        })
        .collect::<Vec<_>>()
        .join(", ")
}

/// The keys a Megatron candidate writes over the spec: its batch, its whole `parallel` block and
/// its whole `megatron` block (the spec's other Megatron settings kept).
pub(super) fn spec_keys(c: &Candidate, m: &Megatron) -> serde_json::Value {
    let p = &c.parallel;
    let mut parallel = serde_json::json!({
        "strategy": p.strategy.name(),
        "world_size": p.world_size,
        "framework": "megatron",
        "tp": p.tensor.tp,
    });
    if p.tensor.sequence_parallel {
        parallel["sequence_parallel"] = true.into();
    }
    if p.tensor.cp > 1 {
        parallel["cp"] = p.tensor.cp.into();
    }
    pipeline_keys(&mut parallel, &p.pipeline);
    let mut megatron = serde_json::json!({"distributed_optimizer": m.distributed_optimizer});
    match m.recompute {
        Recompute::None => {}
        Recompute::Selective(modules) => {
            megatron["recompute_granularity"] = "selective".into();
            if modules != Modules::default() {
                megatron["recompute_modules"] = module_names(modules).into();
            }
        }
        Recompute::Full { method, layers } => {
            megatron["recompute_granularity"] = "full".into();
            megatron["recompute_method"] = match method {
                RecomputeMethod::Uniform => "uniform",
                RecomputeMethod::Block => "block",
            }
            .into();
            megatron["recompute_num_layers"] = layers.into();
        }
    }
    if m.expert_parallel > 1 {
        megatron["expert_model_parallel_size"] = m.expert_parallel.into();
    }
    if let Some(etp) = m
        .expert_tensor_parallel
        .filter(|&etp| etp > 1 || p.tensor.tp > 1)
    {
        megatron["expert_tensor_parallel_size"] = etp.into();
    }
    if m.transformer_engine {
        megatron["transformer_impl"] = "transformer_engine".into();
    }
    if m.optimizer_cpu_offload {
        megatron["optimizer_cpu_offload"] = true.into();
    }
    if m.overlap_cpu_optimizer_d2h_h2d {
        megatron["overlap_cpu_optimizer_d2h_h2d"] = true.into();
    }
    if m.router_fp32 {
        megatron["moe_router_dtype"] = "fp32".into();
    }
    if m.aux_loss() {
        megatron["moe_aux_loss_coeff"] = m.aux_loss_coeff.into();
    }
    if m.vocab_divisible_by > 1 {
        megatron["make_vocab_size_divisible_by"] = m.vocab_divisible_by.into();
    }
    serde_json::json!({
        "batch_size": c.micro_batch * c.pipelined(),
        "parallel": parallel,
        "megatron": megatron,
    })
}

/// `recompute_modules` as Megatron names them.
fn module_names(modules: Modules) -> Vec<&'static str> {
    [
        ("core_attn", modules.core_attn),
        ("mlp", modules.mlp),
        ("moe", modules.moe),
    ]
    .into_iter()
    .filter_map(|(name, on)| on.then_some(name))
    .collect()
}

/// What the cost model ([`super::step_time`]) counts differently for a Megatron
/// candidate.
pub(super) struct Cost {
    /// The parameters whose gradients a rank's data-parallel groups reduce, times `tp × pp`:
    /// the dense ones and `1 / (ep × etp)` of the experts.
    pub params: f64,
    /// The forward FLOPs a token of selective recomputation's modules run again.
    pub recompute_flops_per_token: f64,
    /// Expert parallelism's all-to-alls for one micro-batch on one rank.
    pub all_to_all_per_micro_s: f64,
    /// Expert tensor parallelism's all-gathers and reduce-scatters for one micro-batch on one
    /// rank.
    pub gather_per_micro_s: f64,
}

impl Cost {
    pub(super) fn of(spec: &RunSpec, arch: &Architecture, c: &Candidate, m: &Megatron) -> Self {
        let p = &c.parallel;
        let (ep, etp) = (m.expert_parallel, m.etp(p.tensor.tp));
        let routed = arch.moe.as_ref().map_or(0, |moe| {
            (0..arch.layers).filter(|&l| moe.routes(l)).count() as u64
        });
        let (expert_params, top_k) = arch.moe.as_ref().map_or((0, 0), |moe| {
            (
                routed * moe.experts * 3 * moe.intermediate * arch.hidden,
                moe.top_k,
            )
        });
        let params = arch.param_count(spec.head()) - expert_params + expert_params / (ep * etp);
        // Selective recomputation runs its modules' forwards again: the core attention's `QKᵀ`
        // and scores times `V` (`2 × seq_len × heads × head_dim` FLOPs a token each; the local
        // spec's unfused attention computes the whole score matrix), and 2 FLOPs a token for
        // each weight of a dense MLP or of an MoE layer's router and routed experts.
        let modules = m.recompute.modules();
        let dense_layers = arch.layers - routed;
        let recompute_flops_per_token = [
            (
                modules.core_attn,
                (arch.layers * 2 * 2 * spec.seq_len * arch.heads * arch.head_dim) as f64,
            ),
            (
                modules.mlp,
                (dense_layers * 2 * 3 * arch.hidden * arch.intermediate) as f64,
            ),
            (
                modules.moe,
                arch.moe.as_ref().map_or(0.0, |moe| {
                    (routed * 2 * (moe.experts + top_k * 3 * moe.intermediate) * arch.hidden) as f64
                }),
            ),
        ]
        .into_iter()
        .filter_map(|(on, flops)| on.then_some(flops))
        .sum();
        // Each collective runs twice a layer in forward (dispatch and combine; the gather and the
        // reduce-scatter), twice in backward, and twice more when the forward is recomputed.
        // Under balanced routing a rank sends and receives the `top_k` rows of each of its
        // tokens (`micro_batch × seq_len × top_k × hidden` bf16 elements; the routing
        // probabilities beside them are `1 / hidden` of that, left out).
        let passes = if c.recompute || modules.moe { 6.0 } else { 4.0 };
        let bytes = (c.micro_batch * spec.seq_len * top_k * arch.hidden * 2) as f64;
        let layers = routed as f64 / p.pipeline.pp as f64;
        // The expert-parallel ranks are `etp` GPUs apart (`RankGenerator`'s expert order
        // `tp-cp-ep-dp-pp` with `tp = etp`).
        let all_to_all_per_micro_s = if ep > 1 {
            layers * passes * ring(ep) * bytes / bandwidth(ep, etp)
        } else {
            0.0
        };
        // The `etp` adjacent ranks of the `expt_tp` group all-gather what each received
        // (`etp` times its rows) and reduce-scatter the experts' output back to each.
        let gather_per_micro_s = if etp > 1 {
            layers * passes * ring(etp) * (etp as f64 * bytes) / bandwidth(etp, 1)
        } else {
            0.0
        };
        Cost {
            params: params as f64,
            recompute_flops_per_token,
            all_to_all_per_micro_s,
            gather_per_micro_s,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn example(name: &str) -> RunSpec {
        let path = format!("{}/../../examples/{name}", env!("CARGO_MANIFEST_DIR"));
        RunSpec::from_file(std::path::Path::new(&path)).expect("example")
    }

    /// The candidates of `spec` over its own GPUs, with its architecture.
    fn all(spec: &RunSpec) -> (Vec<Candidate>, Architecture, u64) {
        let (_, arch) = spec.architecture(None, "").expect("catalog model");
        let world = spec.parallel.as_ref().expect("parallel").world_size;
        let ctx = Context {
            spec,
            arch: &arch,
            world,
        };
        let global = layout::global_batch(spec, world);
        (candidates(&ctx, global), arch, global)
    }

    /// Over the 405B's 512 GPUs: the spec's own layout is a candidate; every other one the spec
    /// admits keeps the global batch (or comes closest where dp does not divide it) and is a
    /// spec Megatron runs, sequence parallelism inside a pipeline among them; those it refuses
    /// are context parallelism, named.
    #[test]
    fn the_405b_candidates_hold_its_own_layout_and_only_what_megatron_runs() {
        let spec = example("llama-3.1-405b-megatron-tp8-pp16-512xh100.yaml");
        let (all, arch, global) = all(&spec);
        assert_eq!(global, 64);
        assert!(all.iter().any(|c| c.spec(&spec) == spec), "the spec's own");
        let mut refused = std::collections::BTreeSet::new();
        let mut sequence_parallel_admitted = false;
        for c in &all {
            let p = &c.parallel;
            assert_eq!(
                p.pipeline.pp * p.tensor.cp * p.tensor.tp * data_parallel(p),
                512
            );
            match c
                .spec(&spec)
                .rechecked()
                .and_then(|s| s.check_against(&arch))
            {
                Ok(_) => {
                    assert_eq!(p.tensor.cp, 1, "{}", c.name());
                    sequence_parallel_admitted |= p.tensor.sequence_parallel && p.pipeline.pp > 1;
                    let dp = data_parallel(p);
                    if global.is_multiple_of(dp) {
                        assert_eq!(c.global_batch(), global, "{}", c.name());
                    }
                }
                Err(e) => {
                    refused.insert(e.to_string().split(" is not").next().map(String::from));
                }
            }
        }
        let refused: Vec<_> = refused.into_iter().flatten().collect();
        assert_eq!(refused, ["parallel.cp with framework megatron"]);
        assert!(
            sequence_parallel_admitted,
            "sequence parallelism inside a pipeline"
        );
        // The interleaved schedule where pp × vpp divides the 126 layers: pp 2 alone.
        let interleaved: std::collections::BTreeSet<(u64, u64)> = all
            .iter()
            .filter(|c| c.parallel.pipeline.schedule == PipelineSchedule::Interleaved1F1B)
            .map(|c| (c.parallel.pipeline.pp, c.parallel.pipeline.vpp))
            .collect();
        assert_eq!(
            interleaved.into_iter().collect::<Vec<_>>(),
            [(2, 3), (2, 7)]
        );
    }

    /// Qwen3-235B-A22B over 64 GPUs: expert parallelism over each divisor of a stage's ranks,
    /// and tensor parallelism only with sequence parallelism (Megatron's MoELayer refuses it
    /// otherwise in training), its experts split 1 or tp ways.
    #[test]
    fn an_moe_model_gets_expert_parallelism_and_tensor_parallelism_with_sequence_parallelism() {
        let spec = example("qwen3-235b-a22b-megatron-grpo-slime.yaml");
        let (candidates, arch, _) = all(&spec);
        let admitted: Vec<&Candidate> = candidates
            .iter()
            .filter(|c| {
                c.spec(&spec)
                    .rechecked()
                    .and_then(|s| s.check_against(&arch))
                    .is_ok()
            })
            .collect();
        for c in &admitted {
            let (tp, m) = (c.parallel.tensor.tp, c.megatron.expect("megatron"));
            assert!(
                tp == 1 || c.parallel.tensor.sequence_parallel,
                "{}",
                c.name()
            );
            assert!(tp == 1 || m.etp(tp) == 1 || m.etp(tp) == tp, "{}", c.name());
        }
        assert!(admitted.iter().any(|c| c.parallel.tensor.tp > 1));
        let eps: std::collections::BTreeSet<u64> = admitted
            .iter()
            .map(|c| c.megatron.expect("megatron").expert_parallel)
            .collect();
        assert_eq!(
            eps.into_iter().collect::<Vec<_>>(),
            [1, 2, 4, 8, 16, 32, 64]
        );
        // The MoE layers' own selective recomputation, which a dense model's candidates lack.
        let recomputes_experts =
            |c: &Candidate| c.megatron.is_some_and(|m| m.recompute.modules().moe);
        assert!(admitted.iter().any(|c| recomputes_experts(c)));
        let dense = example("llama-3.1-70b-megatron-tp8-pp4-64xh100.yaml");
        assert!(!all(&dense).0.iter().any(recomputes_experts));
    }

    /// Qwen3-30B-A3B's 128 experts made 1024 wide (4 layers) over `world` GPUs, with the
    /// spec's own `megatron` block.
    fn wide_experts(world: u64, megatron: serde_json::Value) -> RunSpec {
        RunSpec::from_value(&serde_json::json!({
            "model": "qwen3-30b-a3b",
            "model_config": {"model_type": "qwen3_moe", "hidden_size": 2048,
                "intermediate_size": 6144, "moe_intermediate_size": 1024,
                "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": true,
                "decoder_sparse_step": 1, "mlp_only_layers": [], "vocab_size": 151936,
                "tie_word_embeddings": false, "num_hidden_layers": 4},
            "precision": "bf16", "optimizer": "adamw", "batch_size": 1, "seq_len": 1024,
            "parallel": {"strategy": "ddp", "world_size": world, "tp": 1,
                "framework": "megatron"},
            "megatron": megatron,
        }))
        .expect("spec")
    }

    /// `(pp, ep, etp)` of a Megatron candidate.
    fn expert_layout(c: &Candidate) -> (u64, u64, u64) {
        let m = c.megatron.expect("megatron");
        (
            c.parallel.pipeline.pp,
            m.expert_parallel,
            m.etp(c.parallel.tensor.tp),
        )
    }

    /// Over 12 GPUs the expert layouts the spec admits are Megatron's (`ep` dividing the 128
    /// experts, `etp` their width of 1024, `ep × etp` a stage's ranks); the others are refused
    /// by name.
    #[test]
    fn expert_tensor_parallelism_takes_the_degrees_megatron_admits() {
        let spec = wide_experts(12, serde_json::json!({}));
        let (all, arch, _) = all(&spec);
        let mut admitted = std::collections::BTreeSet::new();
        let mut refused = std::collections::BTreeMap::new();
        for c in all.iter().filter(|c| c.parallel.tensor.tp == 1) {
            match c
                .spec(&spec)
                .rechecked()
                .and_then(|s| s.check_against(&arch))
            {
                Ok(_) => {
                    admitted.insert(expert_layout(c));
                }
                Err(e) => {
                    refused.insert(expert_layout(c), e.to_string());
                }
            }
        }
        // Pipelines of 2, 3 (stages of 1, 2 and 1 layers) and 4 stages, of 6, 4 and 3 ranks.
        assert_eq!(
            admitted.into_iter().collect::<Vec<_>>(),
            [
                (1, 1, 1),
                (1, 1, 2),
                (1, 1, 4),
                (1, 2, 1),
                (1, 2, 2),
                (1, 4, 1),
                (2, 1, 1),
                (2, 1, 2),
                (2, 2, 1),
                (3, 1, 1),
                (3, 1, 2),
                (3, 1, 4),
                (3, 2, 1),
                (3, 2, 2),
                (3, 4, 1),
                (4, 1, 1),
            ]
        );
        for etp in [3, 6] {
            let why = &refused[&(1, 1, etp)];
            assert!(
                why.contains(&format!(
                    "megatron.expert_tensor_parallel_size`: {etp} is not"
                )) && why.contains("a divisor of moe_intermediate_size (1024)"),
                "{why}"
            );
        }
        assert!(refused[&(1, 3, 1)].contains("a divisor of num_experts (128)"));
        assert!(!refused.contains_key(&(1, 1, 12)), "beyond a node");
    }

    /// Expert tensor parallelism stays within a node (8 GPUs) but for the spec's own degree.
    #[test]
    fn expert_tensor_parallelism_beyond_a_node_is_the_specs_own() {
        let etps = |spec: &RunSpec| -> std::collections::BTreeSet<u64> {
            all(spec).0.iter().map(|c| expert_layout(c).2).collect()
        };
        let plain = wide_experts(32, serde_json::json!({}));
        assert_eq!(etps(&plain).into_iter().collect::<Vec<_>>(), [1, 2, 4, 8]);
        let own = wide_experts(32, serde_json::json!({"expert_tensor_parallel_size": 16}));
        assert_eq!(etps(&own).into_iter().collect::<Vec<_>>(), [1, 2, 4, 8, 16]);
    }

    #[test]
    fn lighter_ends_split_as_llama_3_405b_did() {
        let split = lighter_ends(126, 16).expect("a split");
        assert_eq!(split.len(), 16);
        assert_eq!(split.iter().sum::<u64>(), 126);
        assert_eq!((split[0], split[1], split[14], split[15]), (7, 8, 8, 7));
        assert_eq!(lighter_ends(94, 4), Some(vec![23, 24, 24, 23]));
        assert_eq!(lighter_ends(7, 2), Some(vec![3, 4]));
        assert_eq!(lighter_ends(5, 4), None, "the ends would hold nothing");
        assert_eq!(split_words(&split), "7, 8 × 14, 7");
    }
}
