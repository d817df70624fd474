//! A Megatron-core run as the measuring harness performs it (`python/headroom_measure/
//! megatron.py`): rank 0 builds `GPTModel`, `Float16Module`, `DistributedDataParallel` and the
//! optimizer, makes the inputs, then takes three steps of what `forward_backward_no_pipelining`
//! does with one micro-batch: the forward and pretrain_gpt's loss
//! (`sum(losses.view(-1).float() * loss_mask) / loss_mask.sum()`), `backward()` with the
//! gradient buffers' (in-place) reductions, `optimizer.step()`. Zeroing the gradient buffer
//! and the main gradients frees nothing. An MoE model's routing is made balanced by the
//! harness, which keeps a fixed routing map for it.

use super::simulation::{AfterOom, Options, STEPS, Simulation};
use super::stages::worst_rank;
use crate::arch::{Architecture, Param};
use crate::dtype::DType;
use crate::sim::engine::component::Component;
use crate::sim::engine::memory::OnOom;
use crate::sim::engine::tracer::{BackwardHooks, Bwd, ParamId, T, Tracer};
use crate::sim::model::Batch;
use crate::sim::model::megatron::{GptModel, StagePart};
use crate::sim::model::megatron_moe::{Experts, harness_routing_map};
use crate::sim::model::megatron_sp::allreduce_norm_grads;
use crate::sim::optim::OptimizerState;
use crate::sim::strategy::Strategy;
use crate::sim::strategy::megatron::{
    ChunkParams, DataParallelRank, MegatronDdp, MegatronOptimizer, ReduceGroups,
};
use crate::spec::{Optimizer, RunSpec};

/// What the backward engine calls into: the recomputation of checkpointed regions and the
/// gradient buffer's hook on the model's parameters (those below `received`; from it on are a
/// pipeline stage's received tensors, whose gradient the schedule takes).
pub(super) struct Hooks<'a> {
    pub(super) model: &'a GptModel,
    pub(super) batch: Batch,
    pub(super) received: ParamId,
}

impl BackwardHooks for Hooks<'_> {
    fn recompute(&mut self, tracer: &mut Tracer, region: u32) {
        self.model.recompute(tracer, region, self.batch);
    }

    fn grad_accumulated(&mut self, tracer: &mut Tracer, param: ParamId) {
        if param >= self.received {
            return;
        }
        self.model
            .strategy
            .borrow_mut()
            .grad_accumulated(tracer, param);
    }
}

/// Simulate the Megatron run of `spec` (`parallel.framework: megatron`) on `arch`: rank 0, and
/// the last rank too where the data-parallel ranks' optimizer shards differ (`ranks`), the one
/// that needs most reported; or `options.only_rank`.
pub(crate) fn simulate(spec: &RunSpec, arch: &Architecture, options: &Options) -> Simulation {
    let ranks = ranks(spec, arch);
    let world = spec.parallel.as_ref().map_or(1, |p| p.world_size);
    if ranks.len() > 1 || options.only_rank.is_some() {
        return worst_rank(
            options,
            &ranks,
            |global| global.min(world - 1),
            |t, global| simulate_rank(spec, arch, t, global),
        );
    }
    let mut t = options.process();
    if options.after_oom == AfterOom::StopUnlessUnlimited {
        t.mem.on_oom(OnOom::StopUnlessUnlimited);
    }
    simulate_rank(spec, arch, t, 0)
}

/// The global ranks an estimate simulates: each pipeline stage's first rank, then under the
/// distributed optimizer each stage's last (a search that stops at the first rank that runs
/// out tries every stage before a second shard). Megatron orders ranks tensor-parallel first,
/// then data-parallel, pipeline stages outermost (`tp-cp-ep-dp-pp`), so a stage's first rank holds
/// the first `1/dp` of each gradient buffer (the last parameters: the head and the last
/// layers) and its last rank the last `1/dp` (the first parameters: the embedding), and each
/// makes its fp32 main parameters of other parts, in another order; the ranks between hold
/// parts of the layers alone.
pub(super) fn ranks(spec: &RunSpec, arch: &Architecture) -> Vec<u64> {
    let parallel = spec
        .parallel
        .as_ref()
        .expect("framework megatron comes with a parallel block");
    let stage_ranks = parallel.world_size / parallel.pipeline.pp;
    let groups = reduce_groups(spec, arch, 0);
    let shards_differ = spec.megatron.unwrap_or_default().distributed_optimizer
        && (groups.dense.size > 1 || groups.experts.is_some_and(|e| e.size > 1));
    let firsts = (0..parallel.pipeline.pp).map(|stage| stage * stage_ranks);
    let lasts = (0..parallel.pipeline.pp)
        .map(|stage| (stage + 1) * stage_ranks - 1)
        .filter(|_| shards_differ && stage_ranks > 1);
    firsts.chain(lasts).collect()
}

/// Global rank `global`'s data-parallel group and place in it, and its expert-data-parallel
/// one where the experts are reduced apart (`parallel_state.py`'s `RankGenerator`s: the dense
/// ranks ordered tp, dp within a stage; the experts' etp, ep, expert dp).
fn reduce_groups(spec: &RunSpec, arch: &Architecture, global: u64) -> ReduceGroups {
    let parallel = spec
        .parallel
        .as_ref()
        .expect("framework megatron comes with a parallel block");
    let megatron = spec.megatron.unwrap_or_default();
    let tp = parallel.tensor.tp;
    let stage_ranks = parallel.world_size / parallel.pipeline.pp;
    let in_stage = global % stage_ranks;
    let dp = stage_ranks / tp;
    let experts = megatron
        .expert_data_parallel(stage_ranks, tp)
        .filter(|_| arch.moe.is_some())
        .map(|size| {
            let expert_model = stage_ranks / size;
            DataParallelRank {
                size,
                rank: in_stage / expert_model % size,
            }
        });
    ReduceGroups {
        dense: DataParallelRank {
            size: dp,
            rank: in_stage / tp % dp,
        },
        experts,
    }
}

/// Global rank `global`'s process `t` without a pipeline: load, then the measured steps.
fn simulate_rank(spec: &RunSpec, arch: &Architecture, mut t: Tracer, global: u64) -> Simulation {
    let whole = StagePart {
        layers: arch.layers,
        pre_process: true,
        post_process: true,
    };
    let model = load(&mut t, spec, arch, &[whole], global).remove(0);
    let weights_loaded = t.mem.allocated();
    let mut phases = vec![t.mem.phase_peak()];
    let batch = Batch {
        b: spec.batch_size,
        s: spec.seq_len,
    };
    let [ids, positions, loss_mask] = inputs(&mut t, batch, model.experts);
    // Megatron's optimizer wraps its own; this one is never stepped.
    let mut unused = OptimizerState::new(Optimizer::None);
    for step in 1..=STEPS {
        if t.mem.stopped() {
            break;
        }
        t.mem.begin_measured_phase("forward", step);
        let loss = forward_loss(&mut t, &model, ids, loss_mask, batch);
        phases.push(t.mem.phase_peak());
        if t.mem.stopped() {
            break;
        }
        t.mem.begin_measured_phase("backward", step);
        t.backward(
            loss,
            &mut Hooks {
                model: &model,
                batch,
                received: ParamId::MAX,
            },
        );
        t.drop(loss);
        let summed = model.tp_summed_grad_numel(&t);
        allreduce_norm_grads(&mut t, summed);
        phases.push(t.mem.phase_peak());
        if t.mem.stopped() {
            break;
        }
        t.mem.begin_measured_phase("optimizer", step);
        model.strategy.borrow_mut().step(&mut t, &mut unused);
        phases.push(t.mem.phase_peak());
    }
    t.drop_all(&[ids, positions, loss_mask]);
    let params = global_params(spec, arch);
    let host_bytes = model.strategy.borrow().host_bytes(&t).unwrap_or(0);
    Simulation::of_process(t, (params, params), weights_loaded, host_bytes, phases)
}

/// The model's parameters, all trained: a tensor-parallel weight counts its global size, and
/// the embedding and the output layer (one matrix when tied) their padded vocabulary.
pub(super) fn global_params(spec: &RunSpec, arch: &Architecture) -> u64 {
    let tp = spec.parallel.as_ref().map_or(1, |p| p.tensor.tp);
    let padding = spec
        .megatron
        .unwrap_or_default()
        .padded_vocab(arch.vocab, tp)
        - arch.vocab;
    let matrices = if arch.tie_word_embeddings { 1 } else { 2 };
    let params: u64 = arch.parameters(spec.head()).iter().map(Param::numel).sum();
    params + padding * arch.hidden * matrices
}

/// `torch.zeros(1)` after `init_process_group`, then the model chunks (the stage `parts` of the
/// model: one, or one per virtual pipeline stage), each its DDP gradient buffer, and the
/// optimizer over all of them, as global rank `global` of the `world_size / (tp × pp)`
/// data-parallel ranks builds it. The first chunk's strategy steps the optimizer.
pub(super) fn load(
    t: &mut Tracer,
    spec: &RunSpec,
    arch: &Architecture,
    parts: &[StagePart],
    global: u64,
) -> Vec<GptModel> {
    let parallel = spec
        .parallel
        .as_ref()
        .expect("framework megatron comes with a parallel block");
    let tp = parallel.tensor.tp;
    let megatron = spec.megatron.unwrap_or_default();
    let zero = t.empty_as(1, DType::F32, Component::Inputs, "torch.zeros(1)");
    t.drop(zero);
    let mut chunks: Vec<GptModel> = parts
        .iter()
        .map(|&part| {
            GptModel::build_stage(
                t,
                arch,
                tp,
                parallel.tensor.sequence_parallel,
                megatron,
                part,
            )
        })
        .collect();
    let shared = chunks[0].global_memory_buffer.clone();
    for chunk in &mut chunks[1..] {
        chunk.global_memory_buffer = shared.clone();
    }
    let params: Vec<ChunkParams> = chunks
        .iter()
        .map(|m| ChunkParams {
            params: &m.params,
            vectors: &m.vectors,
            experts: &m.expert_params,
            shared_embedding: m.shared_embedding,
        })
        .collect();
    let ddp = MegatronDdp::wrap(
        t,
        &params,
        reduce_groups(spec, arch, global),
        MegatronOptimizer {
            distributed: megatron.distributed_optimizer,
            cpu_offload: megatron.optimizer_cpu_offload,
            overlap_copies: megatron.overlap_cpu_optimizer_d2h_h2d,
        },
    );
    *chunks[0].strategy.borrow_mut() = Strategy::Megatron(Box::new(ddp));
    for chunk in &chunks[1..] {
        *chunk.strategy.borrow_mut() =
            Strategy::Megatron(Box::new(MegatronDdp::gradient_hooks_only()));
    }
    chunks
}

/// The harness's inputs of one (micro-)batch, made once: `input_ids`, `position_ids`,
/// `loss_mask`, and for an MoE model the fixed balanced routing map.
pub(super) fn inputs(t: &mut Tracer, batch: Batch, experts: Option<Experts>) -> [T; 3] {
    let outer = std::mem::replace(&mut t.component, Component::Inputs);
    let ids = t.empty(batch.n(), DType::I64, "input_ids");
    let positions = t.empty(batch.s, DType::I64, "position_ids (arange)");
    let loss_mask = t.empty(batch.n(), DType::F32, "loss_mask");
    if let Some(experts) = experts {
        harness_routing_map(t, batch.n(), experts);
    }
    t.component = outer;
    [ids, positions, loss_mask]
}

/// The forward and pretrain_gpt's `loss_func`.
fn forward_loss(t: &mut Tracer, model: &GptModel, ids: T, loss_mask: T, batch: Batch) -> T {
    let losses = model.forward(t, ids, batch);
    loss_func(t, losses, loss_mask)
}

/// pretrain_gpt's `loss_func` on the per-token `losses` (dropped): `losses.view(-1).float()`
/// (already fp32) times the mask, summed, over `loss_mask.sum()`.
pub(super) fn loss_func(t: &mut Tracer, losses: T, loss_mask: T) -> T {
    let outer = std::mem::replace(&mut t.component, Component::LogitsAndLoss);
    let masked = t.mul(losses, loss_mask);
    t.drop(losses);
    let sum = t.empty(1, DType::F32, "torch.sum(losses * loss_mask)");
    t.record(Bwd::Sum, &[Some(masked)], &[sum], &[]);
    t.drop(masked);
    let tokens = t.empty(1, DType::F32, "loss_mask.sum()");
    let loss = t.mul(sum, tokens);
    t.drop_all(&[sum, tokens]);
    t.component = outer;
    loss
}
