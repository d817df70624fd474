//! A pipeline-parallel rank as torchtitan runs one with torch 2.11's
//! `torch.distributed.pipelining` (the harness: `python/headroom_measure/pp.py`): the rank's
//! stages built over their layers, then three steps of `schedule.step()` (every micro-batch's
//! forward and backward in the order `strategy::pp::rank_order` gives) and `optimizer.step()`.
//!
//! What each piece holds, after `stage.py` and `schedules.py`:
//! - a stage's parameters: its decoder layers, the input embedding on the first stage, the
//!   final norm and the output head on the last (each stage is its own model over its layers,
//!   materialised in `parameters()` order; one optimizer steps every stage of the rank);
//! - `_initialize_stage(s)`, in the first step: each stage's two one-element tensors of the
//!   neighbour handshake, then `_prepare_forward_infra`'s receive buffer per micro-batch of
//!   every stage but the first (the stage's input shape, `requires_grad_(True)`: the leaf its
//!   backward accumulates the input gradient into), then `_prepare_backward_infra`'s gradient
//!   receive buffer per micro-batch of every stage but the last; all kept for the run;
//! - a forward keeps its output (and on the last stage the logits and the loss, computed right
//!   after) in `fwd_cache` until that micro-batch's backward, which starts from the loss or from
//!   the output with the received gradient; the loss stays in the schedule's list to the end
//!   of the step;
//! - a stage's input gradient is taken off its receive buffer (`val.grad = None`) and sent:
//!   `Schedule1F1B` holds the send ops until the next backward has made its own,
//!   `ScheduleGPipe` until the next backward starts, `ScheduleInterleaved1F1B` sends it at once;
//! - parameter gradients accumulate over the micro-batches (`scale_grads` divides them in
//!   place at the end).
//!
//! With strategy fsdp (torchtitan's PP × FSDP2: a `(pp, dp)` mesh, pp outermost) each stage is
//! `fully_shard`ed over the data-parallel ranks (`strategy::fsdp::Fsdp` over the stage's own
//! parameters, `parallel.units` as torchtitan's `apply_fsdp` lays them out), and the schedule
//! drives it as `stage.py` and `schedules.py` do: gradient sync off before every micro-batch's
//! backward, the root's final callback after it, `perform_reduce_grad` after the stage's last
//! backward (at the end of `step()` for the single-stage schedules, right after it for the
//! interleaved one), and for the interleaved schedule the UNSHARD and RESHARD actions of
//! `_add_unshard_reshard` ([`unshard_plan`]). The optimizer steps the shards. With tensor
//! parallelism under it (a `(pp, dp, tp)` mesh, without sequence parallelism: stages exchange
//! whole hidden states) each stage is built over its tensor-parallel share and
//! `strategy::tp::TensorParallel` wraps its FSDP2, as for a run without a pipeline.

use super::instance::{ModelHooks, attention_impl, autocast_dtype, param_dtype};
use super::simulation::{Options, STEPS, Simulation, StagePeak};
use crate::arch::{Architecture, Module, Param};
use crate::dtype::DType;
use crate::sim::cores::{on_every_core, spreads};
use crate::sim::engine::component::Component;
use crate::sim::engine::memory::{Keep, Memory, OnOom};
use crate::sim::engine::tracer::{ParamId, T, Tracer};
use crate::sim::memo::{Memo, Script, measured_phase};
use crate::sim::model::Batch;
use crate::sim::model::heads::{for_causal_lm_loss, lm_head};
use crate::sim::model::transformer::{DecoderInput, Model};
use crate::sim::optim::OptimizerState;
use crate::sim::strategy::Strategy;
use crate::sim::strategy::fsdp::Fsdp;
use crate::sim::strategy::pp::{Action, rank_order};
use crate::sim::strategy::tp::TensorParallel;
use crate::spec::{self, PipelineParallel, PipelineSchedule, RunSpec};
use headroom_alloc::CachingAllocator;
use std::cell::{RefCell, RefMut};

/// One stage of the rank.
struct Stage {
    index: u64,
    first: bool,
    last: bool,
    model: Model,
    /// Per micro-batch: the receive buffer and its leaf (every stage but the first).
    inputs: Vec<(T, ParamId)>,
    /// Per micro-batch: the buffer the next stage's input gradient lands in (every stage but
    /// the last).
    output_grads: Vec<T>,
}

impl Stage {
    /// The stage's FSDP2 state, when it is sharded.
    fn fsdp(&self) -> Option<RefMut<'_, Fsdp>> {
        RefMut::filter_map(self.model.strategy.borrow_mut(), Strategy::fsdp_mut).ok()
    }
}

/// A micro-batch between its forward and its backward on one stage (`fwd_cache`).
struct InFlight {
    stage: u64,
    microbatch: u64,
    output: T,
    loss: Option<T>,
    first_region: u32,
}

/// Simulate every pipeline rank (or `options.only_rank`'s) and report the one that needs most,
/// with each stage's peak.
pub(crate) fn simulate(spec: &RunSpec, arch: &Architecture, options: &Options) -> Simulation {
    let repeat_steps = options.repeat_steps && !options.record_timeline;
    let parallel = spec.parallel.as_ref().expect("a pipeline-parallel spec");
    let (pipeline, world) = (&parallel.pipeline, parallel.world_size);
    // A stage's ranks hold alike: each stage's first rank stands for it.
    let ranks_per_stage = world / pipeline.pp;
    let firsts: Vec<u64> = (0..pipeline.pp).map(|p| p * ranks_per_stage).collect();
    worst_rank(
        options,
        &firsts,
        |global| pipeline.pipeline_rank(global.min(world - 1), world) * ranks_per_stage,
        |t, global| simulate_rank(spec, arch, t, global / ranks_per_stage, repeat_steps),
    )
}

/// Run `rank` (a process, a global rank) for each of `ranks`, or for `options.only_rank` as
/// `only` maps it, and report the one that needs most (an error first, then the reserved and
/// the allocated peak), with each stage's peak (the most of its ranks'); under
/// `options.first_oom_ends_run` the first rank that runs out ends the run.
pub(crate) fn worst_rank(
    options: &Options,
    ranks: &[u64],
    only: impl Fn(u64) -> u64,
    rank: impl Fn(Tracer, u64) -> Simulation + Sync,
) -> Simulation {
    let run = |global: u64| {
        let mut t = Tracer::new(
            Memory::new(
                CachingAllocator::new(options.allocator.clone(), options.capacity),
                Keep {
                    trace: options.record_trace,
                    timeline: options.record_timeline,
                },
            ),
            options.workspaces,
        );
        if options.after_oom != super::simulation::AfterOom::GoOn {
            // Another rank may need more: a rank that runs out stops there.
            t.mem.on_oom(OnOom::Stop);
        }
        Simulation {
            rank: global,
            ..rank(t, global)
        }
    };
    if let Some(global) = options.only_rank {
        return run(only(global));
    }
    let ran_out = |s: &Simulation| s.oom.is_some() || s.refused.is_some();
    let mut sims: Vec<Simulation> = if !spreads() {
        let mut sims = Vec::new();
        for &global in ranks {
            let sim = run(global);
            let stop = ran_out(&sim) && options.first_oom_ends_run;
            sims.push(sim);
            if stop {
                break;
            }
        }
        sims
    } else {
        on_every_core(ranks, |_| 0, |&global| run(global))
    };
    // Ranks past the first that runs out are not reported when it ends the run, however
    // they were simulated.
    if options.first_oom_ends_run
        && let Some(first) = sims.iter().position(ran_out)
    {
        sims.truncate(first + 1);
    }
    // The run is the one without a limit only where every rank's is.
    let unlimited = sims.iter().all(|s| s.unlimited);
    let mut stages: Vec<StagePeak> = sims.iter().flat_map(|s| s.stages.clone()).collect();
    stages.sort_by_key(|s| (s.stage, s.peak_reserved, s.peak_allocated));
    // A stage's ranks differ where each holds its own shard: the stage's peak is its worst.
    stages.dedup_by(|later, kept| {
        let same = later.stage == kept.stage;
        if same {
            *kept = later.clone();
        }
        same
    });
    let need = |s: &Simulation| {
        (
            s.refused.is_some(),
            s.oom.is_some(),
            s.peak_reserved,
            s.peak.allocated,
        )
    };
    let worst = sims
        .into_iter()
        .reduce(|a, b| if need(&b) > need(&a) { b } else { a })
        .expect("at least one rank");
    Simulation {
        stages,
        unlimited,
        ..worst
    }
}

/// Pipeline rank `pp_rank`'s process `t`: load, then the measured steps, each taken from the
/// one before where it provably repeats it (`sim::memo`, with `repeat_steps`): the stages'
/// receive buffers are among the state compared, and their strategies must be at rest.
fn simulate_rank(
    spec: &RunSpec,
    arch: &Architecture,
    mut t: Tracer,
    pp_rank: u64,
    repeat_steps: bool,
) -> Simulation {
    let parallel = spec.parallel.as_ref().expect("a pipeline-parallel spec");
    let pipeline = &parallel.pipeline;
    let (pp, microbatches) = (pipeline.pp, pipeline.microbatches);
    let stage_count = pipeline.stages();
    let split = pipeline.stage_layers(arch.layers);
    let batch = Batch {
        b: spec.batch_size / microbatches,
        s: spec.seq_len,
    };
    let dtype = param_dtype(spec);
    let autocast = autocast_dtype(spec);
    let sharded = Some(parallel).filter(|p| p.strategy == spec::Strategy::Fsdp);
    let tp = parallel.tensor.tp;
    // Under FSDP2's mixed-precision policy the stages compute, and send, in `param_dtype`.
    let compute_dtype = sharded
        .and_then(|p| p.mixed_precision)
        .map_or(dtype, |m| m.param_dtype);
    // torch.zeros(1, device="cuda"): the context and a first small segment; the tensor dies.
    let zero = t.empty_as(1, DType::F32, Component::Inputs, "torch.zeros(1)");
    t.drop(zero);

    let attention = attention_impl(spec, arch);
    let head = spec.head();
    let mut stages = Vec::new();
    let mut trainable = Vec::new();
    for index in (pp_rank..stage_count).step_by(pp as usize) {
        let (first, last) = (index == 0, index == stage_count - 1);
        let mut stage_arch = Architecture {
            layers: split[index as usize],
            ..arch.clone()
        };
        // A tensor-parallel rank builds its share of every layer (and of the vocabulary).
        if tp > 1 {
            stage_arch = stage_arch.tensor_parallel_shard(tp, true);
        }
        let from = t.params.len();
        let mut model = Model::build_on_meta(
            &mut t,
            &stage_arch,
            head,
            compute_dtype,
            &|_| true,
            attention,
        );
        let kept = |param: &Param| {
            param.layer.is_some()
                || (first && param.module == Module::Embed)
                || (last && matches!(param.module, Module::FinalNorm | Module::LmHead))
        };
        if let Some(parallel) = sharded {
            let fsdp = Fsdp::shard(&mut t, &stage_arch, head, from, dtype, parallel, &kept);
            trainable.extend(fsdp.device_shards());
            let mut strategy = Strategy::Fsdp(fsdp);
            if tp > 1 {
                strategy = Strategy::Tensor(Box::new(TensorParallel {
                    tp,
                    sequence: false,
                    sequences: batch.b,
                    data: strategy,
                    plan: crate::spec::Framework::Torchtitan,
                }));
            }
            model.strategy = RefCell::new(strategy);
        } else {
            // `to_empty`: only the modules the stage kept.
            for (offset, param) in stage_arch.parameters(head).iter().enumerate() {
                if kept(param) {
                    t.materialize(from + offset);
                    trainable.push(from + offset);
                }
            }
            t.persistent_buffers(&stage_arch.buffers(), "rotary inv_freq");
        }
        model.checkpointing = spec.gradient_checkpointing;
        model.inputs_require_grads = model.checkpointing;
        stages.push(Stage {
            index,
            first,
            last,
            model,
            inputs: Vec::new(),
            output_grads: Vec::new(),
        });
    }
    let weights_loaded = t.mem.allocated();
    let mut optimizer = OptimizerState::new(spec.optimizer);
    let ids = t.empty_as(
        spec.rows() * spec.seq_len,
        DType::I64,
        Component::Inputs,
        "input_ids",
    );
    let mut phases = vec![t.mem.phase_peak()];
    let order = rank_order(pipeline.schedule, pp, pipeline.vpp, microbatches, pp_rank);
    // Step 1 makes the receive buffers and the optimizer's states: step 2 never starts where
    // it did (not comparing only means simulating). Its schedule, which reads neither, is
    // made from step 1's requests where it provably repeats step 1's (`sim::memo`): the
    // schedule recorded from after the receive buffers are made, the losses' release with it.
    let mut memo = Memo::new(repeat_steps, repeat_steps, false);
    let at_rest = |stages: &[Stage]| stages.iter().all(|s| s.model.strategy.borrow().at_rest());
    // What a schedule reads besides the parameters: the inputs and the gradient receive
    // buffers (the activation receive buffers are leaves, among the parameters).
    let pass_roots = |stages: &[Stage]| -> Vec<T> {
        [ids]
            .into_iter()
            .chain(stages.iter().flat_map(|s| s.output_grads.iter().copied()))
            .collect()
    };
    for step in 1..=STEPS {
        if t.mem.stopped() {
            break;
        }
        let roots: Vec<T> = optimizer.tensors().chain(pass_roots(&stages)).collect();
        if memo.take_step(&mut t, step, STEPS, &roots, at_rest(&stages), &mut phases) {
            continue;
        }
        let mut script: Script = Vec::new();
        let mut phase = |t: &mut Tracer, name: &'static str, f: &mut dyn FnMut(&mut Tracer)| {
            measured_phase(t, step, name, &mut script, &mut phases, f)
        };
        let aside: Vec<T> = optimizer.tensors().collect();
        if let Some(pass) =
            memo.pass_to_replay(&mut t, &pass_roots(&stages), &aside, at_rest(&stages))
        {
            if memo.replay_pass(&mut t, pass, &mut phase) {
                break;
            }
        } else {
            let mut losses = Vec::new();
            let mut start = None;
            phase(&mut t, "schedule", &mut |t| {
                if step == 1 {
                    initialize(
                        t,
                        &mut stages,
                        microbatches,
                        batch,
                        arch.hidden,
                        compute_dtype,
                    );
                }
                start = memo.begin_pass(t, step, &pass_roots(&stages), at_rest(&stages));
                losses = run_schedule(t, &stages, &order, pipeline, ids, batch, autocast);
            });
            let mut pass_script = vec![(Some("schedule"), t.mem.requests_recorded())];
            t.drop_all(&losses);
            if t.mem.stopped() {
                break;
            }
            if let Some(start) = start {
                pass_script.push((None, t.mem.requests_recorded()));
                memo.end_pass(
                    &mut t,
                    start,
                    pass_script,
                    &pass_roots(&stages),
                    at_rest(&stages),
                );
            }
        }
        phase(&mut t, "optimizer", &mut |t| optimizer.step(t, &trainable));
        for &p in &trainable {
            if let Some(g) = t.params[p].grad.take() {
                t.drop(g);
            }
        }
        memo.end_step(&mut t, phases.len(), script);
    }
    let peak_reserved = Simulation::steps_peak_reserved(&phases);
    let params = arch.parameters(head).iter().map(|p| p.numel()).sum();
    let peak = t.mem.peak().clone();
    Simulation {
        rank: 0,
        params,
        trainable_params: params,
        weights_loaded,
        stages: stages
            .iter()
            .map(|s| StagePeak {
                stage: s.index,
                pipeline_rank: pp_rank,
                peak_allocated: peak.allocated,
                peak_reserved,
            })
            .collect(),
        phases,
        peak,
        peak_reserved,
        host_bytes: 0,
        engine_bytes: 0,
        oom: t.mem.oom().cloned(),
        refused: t.mem.refused().cloned(),
        trace: t.mem.take_trace(),
        timeline: t.mem.take_timeline(),
        repeated_steps: memo.repeated_steps,
        replayed_steps: memo.replayed_steps,
        replayed_passes: memo.replayed_passes,
        unlimited: !t.mem.stopped() && t.mem.unlimited(),
    }
}

/// `_initialize_stage(s)` in the first `step()`: the neighbour handshake's tensors, then the
/// forward receive buffers, then the gradient receive buffers (see the module doc).
fn initialize(
    t: &mut Tracer,
    stages: &mut [Stage],
    microbatches: u64,
    batch: Batch,
    hidden: u64,
    dtype: DType,
) {
    let outer = std::mem::replace(&mut t.component, Component::Communication);
    let mut handshake = Vec::new();
    for _ in stages.iter() {
        handshake.push(t.empty(1, DType::F32, "p2p init recv_tensor (zeros(1))"));
        handshake.push(t.empty(1, DType::F32, "p2p init send_tensor"));
    }
    let activation = batch.n() * hidden;
    for stage in stages.iter_mut().filter(|s| !s.first) {
        for _ in 0..microbatches {
            let buffer = t.empty(activation, dtype, "pipeline recv buffer (activations)");
            let leaf = t.make_input_leaf(buffer);
            stage.inputs.push((buffer, leaf));
        }
    }
    for stage in stages.iter_mut().filter(|s| !s.last) {
        for _ in 0..microbatches {
            let buffer = t.empty(activation, dtype, "pipeline recv buffer (gradients)");
            stage.output_grads.push(buffer);
        }
    }
    t.drop_all(&handshake);
    t.component = outer;
}

/// One `schedule.step()`: the rank's actions in order. Returns the losses the schedule hands
/// back (the last stage's, one per micro-batch).
fn run_schedule(
    t: &mut Tracer,
    stages: &[Stage],
    order: &[Action],
    pipeline: &PipelineParallel,
    ids: T,
    batch: Batch,
    autocast: Option<DType>,
) -> Vec<T> {
    let (schedule, microbatches) = (pipeline.schedule, pipeline.microbatches);
    let stage_of = |index: u64| {
        stages
            .iter()
            .find(|s| s.index == index)
            .expect("the rank holds the stage")
    };
    // The harness runs `step()` under one autocast context: its cache keeps one cast of each
    // weight for every micro-batch, until a checkpoint's recomputation in backward clears it.
    let outer = t.enter_autocast(autocast);
    let mut in_flight: Vec<InFlight> = Vec::new();
    let mut losses = Vec::new();
    // The input gradient the schedule's send ops still hold.
    let mut sending: Option<T> = None;
    // The last forward's output, as `_step_microbatches`'s local `output` holds it.
    let mut last_output: Option<T> = None;
    let interleaved = schedule == PipelineSchedule::Interleaved1F1B;
    let plan = if interleaved {
        unshard_plan(order)
    } else {
        vec![Default::default(); order.len()]
    };
    let mut backwards_done = vec![0u64; stages.len()];
    for (&action, (reshard, unshard)) in order.iter().zip(&plan) {
        for &stage in reshard {
            if let Some(mut fsdp) = stage_of(stage).fsdp() {
                fsdp.reshard_all(t);
            }
        }
        for &stage in unshard {
            if let Some(mut fsdp) = stage_of(stage).fsdp() {
                fsdp.unshard_async(t);
            }
        }
        let (Action::Forward { stage, .. } | Action::Backward { stage, .. }) = action;
        if let Some(mut fsdp) = stage_of(stage).fsdp() {
            fsdp.wait_unshard(t);
        }
        match action {
            Action::Forward { stage, microbatch } => {
                let s = stage_of(stage);
                let first_region = t.region_count();
                let input = if s.first {
                    // `tensor_split` of the batch: a view of its rows.
                    DecoderInput::Ids(t.view(ids, batch.n(), "micro-batch (tensor_split)"))
                } else {
                    DecoderInput::Embeds(s.inputs[microbatch as usize].0)
                };
                let hidden = s.model.decoder_from(t, input, batch, s.last);
                if let DecoderInput::Ids(view) = input {
                    t.drop(view);
                }
                // The last stage returns the logits.
                let output = if s.last {
                    let component = std::mem::replace(&mut t.component, Component::LogitsAndLoss);
                    let logits = lm_head(t, &s.model, hidden);
                    t.component = component;
                    t.drop(hidden);
                    logits
                } else {
                    hidden
                };
                s.model.forward_done(t);
                // `output = forward_one_chunk(...)`: the single-stage schedules' local lets the
                // previous micro-batch's output go only now.
                if schedule != PipelineSchedule::Interleaved1F1B
                    && let Some(previous) = last_output.replace(t.share(output))
                {
                    t.drop(previous);
                }
                // The schedule's `loss_fn` (HF's `ForCausalLMLoss`) on the logits at once.
                let loss = s
                    .last
                    .then(|| for_causal_lm_loss(t, &s.model, output, batch));
                in_flight.push(InFlight {
                    stage,
                    microbatch,
                    output,
                    loss,
                    first_region,
                });
            }
            Action::Backward { stage, microbatch } => {
                let s = stage_of(stage);
                let at = in_flight
                    .iter()
                    .position(|f| f.stage == stage && f.microbatch == microbatch)
                    .expect("a backward follows its forward");
                let done = in_flight.remove(at);
                if schedule == PipelineSchedule::GPipe
                    && let Some(sent) = sending.take()
                {
                    t.drop(sent);
                }
                let mut hooks = ModelHooks {
                    model: &s.model,
                    batch,
                    autocast,
                    first_region: done.first_region,
                };
                // `backward_maybe_with_nosync`: no reduction, no resharding.
                if let Some(mut fsdp) = s.fsdp() {
                    fsdp.set_gradient_sync(false);
                }
                s.model.strategy.borrow_mut().backward_begins();
                if !s.last
                    && let Some(mut fsdp) = s.fsdp()
                {
                    fsdp.stage_output_pre_backward(t);
                }
                match done.loss {
                    Some(loss) => {
                        t.backward_graph(loss, None, &mut hooks);
                        losses.push(loss);
                    }
                    None => {
                        let grad = s.output_grads[microbatch as usize];
                        t.backward_graph(done.output, Some(grad), &mut hooks);
                    }
                }
                s.model.strategy.borrow_mut().finish_backward(t);
                t.drop(done.output);
                let position = stages.iter().position(|x| x.index == stage).expect("held");
                backwards_done[position] += 1;
                // The runtime's REDUCE_GRAD right after the stage's last backward.
                if interleaved
                    && backwards_done[position] == microbatches
                    && let Some(mut fsdp) = s.fsdp()
                {
                    fsdp.reduce_grad(t);
                }
                if !s.first {
                    let grad = t.take_grad(s.inputs[microbatch as usize].1);
                    let held = match schedule {
                        PipelineSchedule::Interleaved1F1B => {
                            grad.into_iter().for_each(|g| t.drop(g));
                            None
                        }
                        _ => grad,
                    };
                    if let Some(sent) = std::mem::replace(&mut sending, held) {
                        t.drop(sent);
                    }
                }
            }
        }
    }
    for s in stages {
        if let Some(mut fsdp) = s.fsdp() {
            if interleaved {
                // The RESHARDs that close the interleaved schedule.
                fsdp.reshard_all(t);
            } else {
                // The single-stage schedules' `perform_reduce_grad`, before `step()` returns.
                fsdp.reduce_grad(t);
            }
        }
    }
    for held in sending.into_iter().chain(last_output) {
        t.drop(held);
    }
    t.free_graph();
    t.exit_autocast(outer);
    losses
}

/// `_add_unshard_reshard(max_active_stages=3)`: before each action, the stages to reshard
/// (active, and not among the next three distinct stages to compute) and then to unshard
/// (among them, not yet active), in that order.
fn unshard_plan(order: &[Action]) -> Vec<(Vec<u64>, Vec<u64>)> {
    const MAX_ACTIVE_STAGES: usize = 3;
    let stage = |a: &Action| match *a {
        Action::Forward { stage, .. } | Action::Backward { stage, .. } => stage,
    };
    // A set of small integers iterates in ascending order.
    let mut active = std::collections::BTreeSet::new();
    (0..order.len())
        .map(|i| {
            let mut next = Vec::new();
            for a in &order[i..] {
                if !next.contains(&stage(a)) {
                    next.push(stage(a));
                    if next.len() == MAX_ACTIVE_STAGES {
                        break;
                    }
                }
            }
            let evict: Vec<u64> = active
                .iter()
                .copied()
                .filter(|s| !next.contains(s))
                .collect();
            let fetch: Vec<u64> = next
                .iter()
                .copied()
                .filter(|s| !active.contains(s))
                .collect();
            for s in &evict {
                active.remove(s);
            }
            active.extend(fetch.iter().copied());
            (evict, fetch)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::harness::simulation::AfterOom;
    use serde_json::json;

    /// A pipeline's ranks take step 3 from step 2, or its requests, where step 2 provably
    /// repeats (plain stages, FSDP2 stages with and without tensor parallelism, 1F1B and
    /// interleaved), and report what simulating every step reports, to the byte: every rank's
    /// phases and stages, the worst rank, its peak and trace, also on devices that flush the
    /// cache or run out.
    #[test]
    fn pipeline_steps_repeat_as_simulated_ones() {
        let pipeline = |parallel: serde_json::Value, checkpointing: bool| {
            // Llama-3.1-8B's widths over 4 layers (its own output head: stages untied).
            json!({"model": "llama-3.1-8b", "precision": "bf16", "optimizer": "adamw",
                   "model_config": {"model_type": "llama", "hidden_size": 4096,
                       "intermediate_size": 14336, "num_attention_heads": 32,
                       "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256,
                       "num_hidden_layers": 4, "tie_word_embeddings": false},
                   "batch_size": 4, "seq_len": 512, "gradient_checkpointing": checkpointing,
                   "parallel": parallel})
        };
        let specs = [
            pipeline(
                json!({"strategy": "none", "world_size": 2, "pp": 2, "microbatches": 4}),
                false,
            ),
            pipeline(
                json!({"strategy": "fsdp", "world_size": 8, "pp": 2, "microbatches": 4,
                       "reshard_after_forward": false}),
                true,
            ),
            pipeline(
                json!({"strategy": "fsdp", "world_size": 8, "pp": 2, "vpp": 2,
                       "schedule": "interleaved-1f1b", "microbatches": 4,
                       "reshard_after_forward": false}),
                false,
            ),
            pipeline(
                json!({"strategy": "fsdp", "world_size": 8, "pp": 2, "tp": 2,
                       "framework": "torchtitan", "microbatches": 4,
                       "reshard_after_forward": false}),
                true,
            ),
        ];
        let (mut repeated, mut ooms, mut passes) = (0, 0, 0);
        for value in specs {
            let spec = RunSpec::from_value(&value).expect("valid spec");
            let model = spec.resolve_model(None).expect("known model");
            let arch = Architecture::from_hf_config(&model.config).expect("valid config");
            let run = |capacity, repeat_steps, after_oom| {
                simulate(
                    &spec,
                    &arch,
                    &Options::memo_test(capacity, repeat_steps, after_oom),
                )
            };
            for capacity in run(None, false, AfterOom::GoOn).devices_around() {
                for after_oom in [AfterOom::GoOn, AfterOom::StopUnlessUnlimited] {
                    let fast = run(capacity, true, after_oom);
                    let slow = run(capacity, false, after_oom);
                    let context = format!("{value} {capacity:?}");
                    assert_eq!(fast.phases, slow.phases, "{context}");
                    assert_eq!(fast.stages, slow.stages, "{context}");
                    assert_eq!(fast.rank, slow.rank, "{context}");
                    assert_eq!(fast.peak_reserved, slow.peak_reserved, "{context}");
                    assert_eq!(fast.peak.allocated, slow.peak.allocated, "{context}");
                    assert_eq!(fast.peak.breakdown, slow.peak.breakdown, "{context}");
                    assert_eq!(fast.trace, slow.trace, "{context}");
                    assert_eq!(fast.oom, slow.oom, "{context}");
                    assert_eq!(fast.unlimited, slow.unlimited, "{context}");
                    repeated += fast.repeated_steps + fast.replayed_steps;
                    passes += fast.replayed_passes;
                    ooms += u32::from(slow.oom.is_some());
                }
            }
            let unlimited = run(None, true, AfterOom::GoOn);
            assert!(
                unlimited.repeated_steps + unlimited.replayed_steps > 0,
                "{value}: step 3 simulated again"
            );
            // The reported rank's step 2 schedule is made from step 1's requests.
            assert!(
                unlimited.replayed_passes > 0,
                "{value}: step 2's schedule simulated"
            );
        }
        assert!(passes >= 8, "{passes} schedules from step 1's requests");
        assert!(repeated >= 8, "{repeated} steps taken from the one before");
        assert!(ooms >= 4, "{ooms} runs out of memory");
    }

    fn stages_of(plan: &[(Vec<u64>, Vec<u64>)]) -> (Vec<u64>, Vec<u64>) {
        let reshards = plan.iter().flat_map(|p| p.0.clone()).collect();
        let unshards = plan.iter().flat_map(|p| p.1.clone()).collect();
        (reshards, unshards)
    }

    /// Two stages a rank: both unsharded before the first action, in the order they compute,
    /// and each resharded only once it has no action left.
    #[test]
    fn two_stages_are_unsharded_up_front_and_resharded_when_done() {
        let order = rank_order(PipelineSchedule::Interleaved1F1B, 2, 2, 4, 1);
        let plan = unshard_plan(&order);
        assert_eq!(plan[0], (vec![], vec![1, 3]));
        let (reshards, unshards) = stages_of(&plan[1..]);
        assert!(unshards.is_empty());
        for (i, (evict, _)) in plan.iter().enumerate() {
            for s in evict {
                let stage = |a: &Action| match *a {
                    Action::Forward { stage, .. } | Action::Backward { stage, .. } => stage,
                };
                assert!(
                    !order[i..].iter().any(|a| stage(a) == *s),
                    "{s} resharded early"
                );
            }
        }
        assert_eq!(reshards, [3], "the stage whose backwards end first");
    }

    /// Four stages a rank: at most three active, the one computed furthest ahead resharded
    /// for the next, every stage unsharded before each of its actions.
    #[test]
    fn more_stages_than_three_evict_the_furthest() {
        let order = rank_order(PipelineSchedule::Interleaved1F1B, 2, 4, 4, 0);
        let plan = unshard_plan(&order);
        let mut active = std::collections::BTreeSet::new();
        for (action, (evict, fetch)) in order.iter().zip(&plan) {
            for s in evict {
                assert!(active.remove(s), "{s} resharded while not active");
            }
            for &s in fetch {
                assert!(active.insert(s), "{s} unsharded twice");
            }
            assert!(active.len() <= 3);
            let (Action::Forward { stage, .. } | Action::Backward { stage, .. }) = *action;
            assert!(active.contains(&stage), "{action:?} on a sharded stage");
        }
        assert_eq!(plan[0].1, [0, 2, 4], "the first three stages it computes");
        let (reshards, _) = stages_of(&plan);
        assert!(!reshards.is_empty(), "a fourth stage makes room");
    }
}
