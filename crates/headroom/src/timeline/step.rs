//! A whole run as the measuring harness performs it (shared/calibration/README.md): build the
//! model on the GPU, wrap it (LoRA, checkpointing), then three steps of forward, backward,
//! `optimizer.step()` and `zero_grad(set_to_none=True)`, each phase's peak read like
//! `torch.cuda.max_memory_allocated()` after `reset_peak_memory_stats()`.

use headroom_alloc::{AllocatorConfig, CachingAllocator, Checkpoint, Decision};

use super::component::Component;
use super::instance::{Home, Instance};
use super::memory::{Memory, OnOom, PeakRecord, Request, SimulatedOom, TraceEvent};
use super::tracer::{BackwardHooks, Scope, StoredGrad, T, Tracer, TracerState};
use super::transformer::{Batch, Model};
use crate::arch::Architecture;
use crate::dtype::DType;
use crate::spec::{Mode, Parallel, Precision, RunSpec, Task};

/// Steps the harness runs; the first differs (optimizer states appear during its step).
pub const STEPS: u32 = 3;

/// The peak of one measured phase.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PhasePeak {
    pub step: u32,
    pub phase: &'static str,
    pub peak_allocated: u64,
    pub peak_reserved: u64,
}

/// What simulating a run produced.
pub struct Simulation {
    pub params: u64,
    pub trainable_params: u64,
    pub weights_loaded: u64,
    pub phases: Vec<PhasePeak>,
    pub peak: PeakRecord,
    pub peak_reserved: u64,
    /// Host bytes the rank keeps (see `Instance::host_bytes`).
    pub host_bytes: u64,
    pub trace: Vec<TraceEvent>,
    /// The first allocation that failed on a device of the given capacity.
    pub oom: Option<SimulatedOom>,
    /// Steps taken from the previous one rather than simulated (see `simulate_steps`).
    pub repeated_steps: u32,
    /// Steps whose requests were taken from the previous one and served by the allocator
    /// again, the tracer not run (see `simulate_steps`).
    pub replayed_steps: u32,
    /// Training passes (forward and backward) whose requests were taken from step 1's and
    /// served by the allocator again, the tracer not run (see `simulate_steps`).
    pub replayed_passes: u32,
    /// Whether the numbers are those of the same run without a device limit: none was set,
    /// or it never changed what the allocator did (an out-of-memory error after which the
    /// run went on included; see `Memory::unlimited`).
    pub unlimited: bool,
}

pub(super) struct Checkpointing<'a> {
    pub(super) model: &'a Model,
    pub(super) batch: Batch,
    pub(super) autocast: Option<DType>,
}

impl BackwardHooks for Checkpointing<'_> {
    fn recompute(&mut self, tracer: &mut Tracer, region: u32) {
        self.model
            .recompute_layer(tracer, region, self.batch, self.autocast);
    }

    fn unit_backward_begins(&mut self, tracer: &mut Tracer, unit: u32) {
        if let Some(sharded) = &self.model.sharded {
            sharded.borrow_mut().pre_backward(tracer, unit);
        }
        if let Some(zero3) = &self.model.zero3
            && let Some(g) = zero3.borrow_mut().gathers.as_mut()
        {
            g.unit_backward_begins(tracer, unit);
        }
    }

    fn unit_backward_done(&mut self, tracer: &mut Tracer, unit: u32) {
        if let Some(sharded) = &self.model.sharded {
            sharded.borrow_mut().post_backward(tracer, unit);
        }
        if let Some(zero3) = &self.model.zero3
            && let Some(g) = zero3.borrow_mut().gathers.as_mut()
        {
            g.unit_backward_done(tracer, unit);
        }
    }

    fn grad_accumulated(&mut self, tracer: &mut Tracer, param: super::tracer::ParamId) {
        if let Some(zero) = &self.model.zero {
            zero.borrow_mut().grad_hook(tracer, param);
        }
        if let Some(zero3) = &self.model.zero3 {
            zero3.borrow_mut().grad_hook(tracer, param);
        }
    }
}

/// `loss.backward()` through the model's hooks, FSDP's final callback and DeepSpeed's
/// backward epilogue included.
pub(super) fn backward(
    t: &mut Tracer,
    model: &Model,
    loss: T,
    batch: Batch,
    autocast: Option<DType>,
) {
    let mut hooks = Checkpointing {
        model,
        batch,
        autocast,
    };
    if let Some(zero3) = &model.zero3
        && let Some(g) = zero3.borrow_mut().gathers.as_mut()
    {
        g.backward_begins();
    }
    t.backward(loss, &mut hooks);
    if let Some(sharded) = &model.sharded {
        sharded.borrow_mut().finish_backward(t);
    }
    if let Some(zero) = &model.zero {
        zero.borrow_mut().finish_backward(t);
    }
    if let Some(zero3) = &model.zero3 {
        zero3.borrow_mut().finish_backward(t);
    }
}

pub(super) fn param_dtype(spec: &RunSpec) -> DType {
    match spec.precision {
        Precision::Bf16 => DType::BF16,
        Precision::Fp32 | Precision::AmpBf16 | Precision::AmpFp16 => DType::F32,
    }
}

pub(super) fn autocast_dtype(spec: &RunSpec) -> Option<DType> {
    match spec.precision {
        Precision::Fp32 => None,
        Precision::AmpBf16 | Precision::Bf16 => Some(DType::BF16),
        Precision::AmpFp16 => Some(DType::F16),
    }
}

/// A simulated step, kept to show that the next one repeats it.
struct StepRecord {
    /// The state it started from.
    tracer: TracerState,
    allocator: Checkpoint,
    /// How the allocator served each of its requests.
    decisions: Vec<Decision>,
    /// Its phases (the last entries of `phases` when it ended).
    phases: usize,
    trace: std::ops::Range<usize>,
    /// What it asked of the device, when recorded (the step before the last) and complete:
    /// `prefix`, the training pass it made from step 1's requests (kept, not recorded again),
    /// then `requests`.
    prefix: Vec<Request>,
    requests: Option<Vec<Request>>,
    /// Its phases' names and their requests (ranges of `requests`).
    script: Vec<(&'static str, std::ops::Range<usize>)>,
}

/// Step 1's training pass (forward and backward), recorded so that step 2's can be made from
/// its requests (see `simulate_steps`).
struct PassRecord {
    /// The state it started from, as a pass reads it, and the persistent tensors then.
    start: TracerState,
    persistent: usize,
    /// The cuBLAS and cuBLASLt workspace flags it left.
    workspaces: ([bool; 2], [bool; 2]),
    /// What it asked of the device (workspaces left out), and where the backward's begin.
    requests: Vec<Request>,
    backward: usize,
    /// The gradients it stored.
    grads: Vec<StoredGrad>,
}

/// Simulate the run of `spec` on `arch`; `record_trace` keeps every allocation and free.
/// `capacity` is what the caching allocator may obtain from the device (`None`: no limit);
/// when it runs out, as PyTorch frees its cache and retries first, the failure is recorded in
/// [`Simulation::oom`] and the run continues without the limit.
pub fn simulate(
    spec: &RunSpec,
    arch: &Architecture,
    allocator: AllocatorConfig,
    capacity: Option<u64>,
    record_trace: bool,
) -> Simulation {
    simulate_steps(spec, arch, allocator, capacity, record_trace, true, false)
}

/// [`simulate`] for a caller that, after an out-of-memory error, wants the run without a
/// limit. The run stops at its first error (then only [`Simulation::oom`] means anything),
/// unless the limit had changed nothing by then: it then goes on as the run without a limit,
/// and says so in [`Simulation::unlimited`]. Without an error it is [`simulate`].
pub fn simulate_to_first_oom(
    spec: &RunSpec,
    arch: &Architecture,
    allocator: AllocatorConfig,
    capacity: Option<u64>,
    record_trace: bool,
) -> Simulation {
    simulate_steps(spec, arch, allocator, capacity, record_trace, true, true)
}

/// [`simulate`]; `repeat_steps` lets a step that provably repeats the previous one be taken
/// from it instead of simulated again (tests turn it off to check that).
///
/// The step loop is deterministic: what a step asks of the allocator depends only on the
/// tracer's state (live tensors, parameters, optimizer states), never on the allocator, and
/// the allocator answers deterministically from its layout. So when step k starts in the
/// same tracer state as step k-1 (up to tensor ids) and the allocator's layout is step k-1's
/// plus whole free segments that, checked decision by decision, change nothing
/// (`CachingAllocator::repeats_from`), step k makes the same requests, gets the same blocks
/// and has the same allocated bytes at every point: its phases peak as step k-1's did, its
/// reserved bytes stay where they start (every new segment of step k-1 is found again among
/// those spare ones), no peak is exceeded, and it ends in the state it started from (the
/// spare segments are exactly step k-1's new ones, all used again where they were made).
/// Every later step then repeats it exactly.
///
/// When only the allocator's side fails (the tracer state is the previous step's), the step
/// still makes the previous step's requests: model code never reads what the allocator
/// answered (allocations are only kept, freed and compared), so the tracer's requests in a
/// step depend on its state at the start alone. The last step then makes those requests,
/// recorded in order with the phases they fall in, to the allocator again instead of running
/// the tracer: the allocator, peaks, breakdown and trace see exactly what they would have
/// seen. The tracer is left where the step started; nothing reads it after the last step.
/// A record that frees or recharges an allocation made before it (or a run that stopped
/// while recording) is not used.
///
/// Step 2 of training never starts in step 1's state (the optimizer's states and the cuBLAS
/// workspaces appeared since), but its training pass reads neither: it reads the parameters,
/// the buffers, the autocast cache, the inputs and the workspace flags, and stores gradients
/// that `zero_grad` removed. So when the part of the state a pass reads is step 1's, and the
/// workspace flags are those step 1's pass left, step 2's pass makes step 1's requests less
/// the workspaces' (which only a flag not yet set makes), and ends as step 1's did: the
/// requests are made again and the gradients stored on what they allocate. Step 1's pass
/// must end in the state it started from apart from its gradients and workspaces, each
/// gradient a plain tensor allocated by a recorded request. Step 2's own record (for step 3)
/// then starts with those requests, kept rather than recorded again.
pub(crate) fn simulate_steps(
    spec: &RunSpec,
    arch: &Architecture,
    allocator: AllocatorConfig,
    capacity: Option<u64>,
    record_trace: bool,
    repeat_steps: bool,
    stop_at_oom: bool,
) -> Simulation {
    // DeepSpeed ZeRO's ranks hold different partitions (see `zero.rs`): the first and the
    // last rank are simulated, and the one that needs more reported (an out-of-memory error
    // first, then the larger reserved and allocated peaks). Without a limit another rank may
    // need more, so such a run that runs out stops there.
    let ranks_differ = spec.parallel.as_ref().is_some_and(Parallel::ranks_differ);
    let run = |rank| {
        let mut t = Tracer::new(Memory::new(
            CachingAllocator::new(allocator.clone(), capacity),
            record_trace,
        ));
        if stop_at_oom {
            t.mem.on_oom(if ranks_differ {
                OnOom::Stop
            } else {
                OnOom::StopUnlessUnlimited
            });
        }
        simulate_rank(spec, arch, t, repeat_steps, rank)
    };
    let last = run(None);
    if !ranks_differ {
        return last;
    }
    let first = run(Some(0));
    let need = |s: &Simulation| (s.oom.is_some(), s.peak_reserved, s.peak.allocated);
    if need(&first) > need(&last) {
        first
    } else {
        last
    }
}

/// [`simulate_steps`] on one rank (`None`: the last), in a fresh process `t`.
fn simulate_rank(
    spec: &RunSpec,
    arch: &Architecture,
    mut t: Tracer,
    repeat_steps: bool,
    rank: Option<u64>,
) -> Simulation {
    // torch.zeros(1, device="cuda"): the context and a first small segment; the tensor dies.
    let zero = t.empty_as(1, DType::F32, Component::Inputs, "torch.zeros(1)");
    t.drop(zero);

    let train = spec.mode == Mode::Train;
    let mut instance = Instance::build(&mut t, spec, arch, Home::Gpu, rank);
    let batch = instance.batch;
    let ids = t.empty_as(batch.n(), DType::I64, Component::Inputs, "input_ids");
    // Building (or loading) the model is reported as step 0's "load" phase.
    let mut phases = vec![PhasePeak {
        step: 0,
        phase: "load",
        peak_allocated: t.mem.phase_peak(),
        peak_reserved: t.mem.allocator.stats().reserved_bytes.all.peak as u64,
    }];
    let mut previous: Option<StepRecord> = None;
    let mut repeated_steps = 0;
    let mut replayed_steps = 0;
    let passes_repeat = repeat_steps
        && train
        && spec.parallel.is_none()
        && spec.optimizer != crate::spec::Optimizer::None;
    let mut first_pass: Option<PassRecord> = None;
    let mut replayed_passes = 0;
    // A step found to repeat the previous one: its phases and trace events.
    let mut repeating: Option<(usize, std::ops::Range<usize>)> = None;
    'steps: for step in 1..=STEPS {
        if t.mem.stopped() {
            break;
        }
        // Step 1 of training creates the optimizer's states, so step 2 never starts where step 1
        // did: not worth comparing (not comparing only means simulating).
        let worth_comparing = step > 1 || !train || spec.optimizer == crate::spec::Optimizer::None;
        // Collectives' buffers are not part of the compared state: sharded runs simulate
        // every step.
        let repeat_steps = repeat_steps && spec.parallel.is_none();
        if repeat_steps && repeating.is_none() && worth_comparing {
            let roots: Vec<T> = instance.optimizer.tensors().chain([ids]).collect();
            let mut buffer = Vec::new();
            if let Some(prev) = previous.take() {
                let same_tracer = t.state_is(Scope::Step, &roots, &prev.tracer);
                if same_tracer
                    && t.mem
                        .allocator
                        .repeats_from(&prev.allocator, &prev.decisions)
                {
                    // Reserved bytes no longer change: every phase peaks where the step starts.
                    let reserved = t.mem.allocator.stats().reserved_bytes.all.current as u64;
                    let first = phases.len() - prev.phases;
                    for i in first..phases.len() {
                        let p = phases[i].clone();
                        phases.push(PhasePeak {
                            step,
                            peak_reserved: reserved,
                            ..p
                        });
                    }
                    t.mem.repeat_trace(prev.trace.clone());
                    let end = t.mem.trace_len();
                    repeating = Some((prev.phases, end - prev.trace.len()..end));
                    repeated_steps += 1;
                    continue;
                }
                if same_tracer
                    && step == STEPS
                    && let Some(requests) = &prev.requests
                {
                    let record = [&prev.prefix[..], requests];
                    replay_step(&mut t, step, record, &prev.script, &mut phases);
                    replayed_steps += 1;
                    continue;
                }
                buffer = prev.decisions;
            }
            // The last step has no next one to compare with.
            if step < STEPS {
                t.mem.allocator.record_decisions_into(buffer);
                // Only the last step is ever replayed.
                if step + 1 == STEPS {
                    t.mem.record_requests();
                }
                previous = Some(StepRecord {
                    tracer: t.state(Scope::Step, &roots),
                    allocator: t.mem.allocator.checkpoint(),
                    decisions: Vec::new(),
                    phases: phases.len(),
                    trace: t.mem.trace_len()..0,
                    prefix: Vec::new(),
                    requests: None,
                    script: Vec::new(),
                });
            }
        }
        if let Some((count, trace)) = &repeating {
            repeated_steps += 1;
            let first = phases.len() - count;
            for i in first..phases.len() {
                let p = phases[i].clone();
                phases.push(PhasePeak { step, ..p });
            }
            t.mem.repeat_trace(trace.clone());
            continue;
        }
        let mut script = Vec::new();
        let mut phase = |t: &mut Tracer, name: &'static str, f: &mut dyn FnMut(&mut Tracer)| {
            let first = t.mem.requests_recorded();
            t.mem.start_phase(name, step);
            t.mem.allocator.reset_peak_stats();
            f(t);
            script.push((name, first..t.mem.requests_recorded()));
            phases.push(PhasePeak {
                step,
                phase: name,
                peak_allocated: t.mem.phase_peak(),
                peak_reserved: t.mem.allocator.stats().reserved_bytes.all.peak as u64,
            });
        };
        if !train {
            phase(&mut t, "forward", &mut |t| instance.logprob_pass(t, ids));
            end_step(&mut t, &mut previous, phases.len(), script);
            continue;
        }
        let no_grads = |t: &Tracer| t.params.iter().all(|p| p.grad.is_none());
        let replay = first_pass.take().filter(|pass| {
            let aside: Vec<T> = instance.optimizer.tensors().collect();
            let scope = Scope::Pass {
                persistent: pass.persistent,
                aside: &aside,
            };
            no_grads(&t)
                && (t.cublas_workspace, t.cublaslt_workspace) == pass.workspaces
                && t.state_is(scope, &[ids], &pass.start)
        });
        if let Some(pass) = replay {
            // Room for every `Malloc` (fewer than the requests).
            let mut allocations = Vec::with_capacity(pass.requests.len());
            // Step 1's requests are this step's: a record of this step starts with them.
            let kept = t.mem.record_is_empty();
            let (forward, backward) = pass.requests.split_at(pass.backward);
            for (name, requests) in [("forward", forward), ("backward", backward)] {
                phase(&mut t, name, &mut |t| {
                    if kept {
                        t.mem.replay_as_recorded(requests, &mut allocations)
                    } else {
                        t.mem.replay(requests, &mut allocations)
                    }
                });
                if t.mem.stopped() {
                    break 'steps;
                }
            }
            t.restore_grads(&pass.grads, &allocations);
            if kept && let Some(record) = previous.as_mut() {
                for g in &pass.grads {
                    t.mem.adopt(g.malloc(), &allocations[g.malloc() as usize]);
                }
                record.prefix = pass.requests;
            }
            replayed_passes += 1;
        } else {
            // Step 1 records its pass for step 2 (see above).
            let persistent = t.persistent_count();
            let scope = Scope::Pass {
                persistent,
                aside: &[],
            };
            let start = (passes_repeat && step == 1 && no_grads(&t)).then(|| {
                t.mem.record_requests();
                t.state(scope, &[ids])
            });
            let mut loss: Option<T> = None;
            phase(&mut t, "forward", &mut |t| {
                loss = Some(instance.forward_for_loss(t, ids));
            });
            if t.mem.stopped() {
                break;
            }
            let backward = t.mem.requests_recorded();
            let loss = loss.expect("the forward phase produced a loss");
            phase(&mut t, "backward", &mut |t| instance.backward(t, loss));
            if t.mem.stopped() {
                break;
            }
            if let Some(start) = start {
                let grads = t.stored_grads();
                let ends_as_started = t.state_is(scope, &[ids], &start);
                let requests = t.mem.take_requests();
                if let (Some(grads), Some(requests), true) = (grads, requests, ends_as_started) {
                    first_pass = Some(PassRecord {
                        start,
                        persistent,
                        workspaces: (t.cublas_workspace, t.cublaslt_workspace),
                        requests,
                        backward,
                        grads,
                    });
                }
            }
        }
        if spec.optimizer != crate::spec::Optimizer::None {
            phase(&mut t, "optimizer", &mut |t| instance.optimizer_step(t));
        }
        instance.zero_grad(&mut t);
        end_step(&mut t, &mut previous, phases.len(), script);
    }
    Simulation {
        params: instance.param_count,
        trainable_params: instance.trainable_count,
        weights_loaded: instance.weights_loaded,
        peak_reserved: phases
            .iter()
            .filter(|p| p.step > 0)
            .map(|p| p.peak_reserved)
            .max()
            .unwrap_or(0),
        peak: t.mem.peak().clone(),
        host_bytes: instance.host_bytes(&t),
        phases,
        oom: t.mem.oom().cloned(),
        trace: t.mem.take_trace(),
        repeated_steps,
        replayed_steps,
        replayed_passes,
        unlimited: !t.mem.stopped() && t.mem.unlimited(),
    }
}

/// Makes the recorded requests of a step again, `record[0]` then `record[1]`, phase by phase
/// as `script` lays them out (see `simulate_steps`), as step `step`: what the step loop does
/// around each phase, with the requests in place of the tracer.
fn replay_step(
    t: &mut Tracer,
    step: u32,
    record: [&[Request]; 2],
    script: &[(&'static str, std::ops::Range<usize>)],
    phases: &mut Vec<PhasePeak>,
) {
    let split = record[0].len();
    let mut allocations = Vec::with_capacity(split + record[1].len());
    let mut replay = |t: &mut Tracer, r: std::ops::Range<usize>| {
        t.mem.replay(
            &record[0][r.start.min(split)..r.end.min(split)],
            &mut allocations,
        );
        t.mem.replay(
            &record[1][r.start.max(split) - split..r.end.max(split) - split],
            &mut allocations,
        );
    };
    let mut done = 0;
    for (name, range) in script {
        replay(t, done..range.start);
        t.mem.start_phase(name, step);
        t.mem.allocator.reset_peak_stats();
        replay(t, range.clone());
        phases.push(PhasePeak {
            step,
            phase: name,
            peak_allocated: t.mem.phase_peak(),
            peak_reserved: t.mem.allocator.stats().reserved_bytes.all.peak as u64,
        });
        done = range.end;
        // The loop stops after a phase that ran out; what follows would change nothing.
        if t.mem.stopped() {
            return;
        }
    }
    replay(t, done..split + record[1].len());
}

/// Close the record of the step just simulated: its decisions, phases, trace events and
/// requests.
fn end_step(
    t: &mut Tracer,
    record: &mut Option<StepRecord>,
    phases: usize,
    script: Vec<(&'static str, std::ops::Range<usize>)>,
) {
    if let Some(r) = record {
        r.decisions = t.mem.allocator.take_decisions();
        t.mem.allocator.record_decisions(false);
        r.phases = phases - r.phases;
        r.trace = r.trace.start..t.mem.trace_len();
        r.requests = t.mem.take_requests();
        r.script = script;
    }
}

/// The harness's training forward: `model(input_ids=ids, labels=ids).loss` (causal LM) or
/// `model(input_ids=ids).logits.float().pow(2).mean()` (sequence classification). The
/// output object is dropped when the function returns; only the loss survives.
pub(super) fn train_forward(
    t: &mut Tracer,
    model: &Model,
    spec: &RunSpec,
    ids: T,
    batch: Batch,
) -> T {
    let hidden = model.decoder(t, ids, batch);
    match spec.task {
        Task::CausalLm => {
            let (loss, logits) = causal_lm_loss(t, model, hidden, batch);
            model.forward_done(t);
            t.drop(hidden);
            t.drop(logits);
            loss
        }
        Task::SeqCls => {
            let pooled = sequence_classification(t, model, hidden, batch);
            model.forward_done(t);
            t.drop(hidden);
            let outer = t.component;
            let f = t.to(pooled, DType::F32);
            let sq = t.pow2(f);
            let loss = t.mean_all(sq);
            t.drop_all(&[sq, f, pooled]);
            t.component = outer;
            loss
        }
    }
}

/// `lm_head` then `ForCausalLMLoss`: fp32 logits, shifted labels, cross entropy.
fn causal_lm_loss(t: &mut Tracer, model: &Model, hidden: T, batch: Batch) -> (T, T) {
    let outer = std::mem::replace(&mut t.component, Component::LogitsAndLoss);
    let logits = lm_head(t, model, hidden);
    let logits32 = t.to(logits, DType::F32);
    t.component = Component::Inputs;
    let padded = t.empty(
        batch.b * (batch.s + 1),
        DType::I64,
        "labels = pad(labels, (0, 1))",
    );
    let shift = t.empty(batch.n(), DType::I64, "shift_labels.contiguous()");
    t.component = Component::LogitsAndLoss;
    let log_probs = t.log_softmax(logits32);
    let loss = t.nll_loss(log_probs, shift);
    t.drop(log_probs);
    t.drop_all(&[logits32, padded, shift]);
    t.component = outer;
    (loss, logits)
}

/// The output head (tied or not), with Gemma-2's final soft-capping.
pub(super) fn lm_head(t: &mut Tracer, model: &Model, hidden: T) -> T {
    let a = &model.arch;
    let (weight, bias) = match model.lm_head {
        Some(head) => (head.weight, head.bias),
        None => (model.embed, None),
    };
    let params: Vec<_> = std::iter::once(weight).chain(bias).collect();
    model.z3_pre(t, super::zero3_gather::ZModule::LmHead, &params, true);
    let mut logits = t.linear(hidden, weight, bias, a.vocab, false);
    model.z3_post(t);
    if a.final_logit_softcapping.is_some() {
        let div = t.mul_scalar(logits);
        t.drop(logits);
        let th = t.tanh(div);
        t.drop(div);
        logits = t.mul_scalar(th);
        t.drop(th);
    }
    logits
}

/// `GenericForSequenceClassification.forward`: score every position, pick each sequence's
/// last non-pad token.
fn sequence_classification(t: &mut Tracer, model: &Model, hidden: T, batch: Batch) -> T {
    let score = model
        .score
        .expect("a sequence-classification model has a score head");
    let logits = t.linear(hidden, score.weight, score.bias, score.out_features, false);
    let outer = std::mem::replace(&mut t.component, Component::Inputs);
    let mask = t.empty(batch.n(), DType::Bool, "input_ids != pad_token_id");
    let mask32 = t.empty(batch.n(), DType::I32, "non_pad_mask");
    t.drop(mask);
    let indices = t.empty(batch.s, DType::I32, "token_indices");
    let prod = t.empty(batch.n(), DType::I32, "token_indices * non_pad_mask");
    let last = t.empty(batch.b, DType::I64, "last_non_pad_token");
    t.drop(prod);
    let rows = t.empty(batch.b, DType::I64, "arange(batch_size)");
    t.component = outer;
    let pooled = t.empty(
        batch.b * score.out_features,
        t.dtype(logits),
        "pooled_logits",
    );
    t.record(
        super::tracer::Bwd::Slice,
        &[Some(logits)],
        &[pooled],
        &[rows, last],
    );
    t.drop_all(&[rows, last, indices, mask32, logits]);
    pooled
}

/// The no-grad reference log-prob pass: `logits = model(ids).logits` under the autocast
/// `autocast`, then outside it `log_softmax(logits.float(), -1)` gathered at the next tokens.
/// Leaving autocast clears its weight-cast cache before the fp32 logits exist.
pub(super) fn logprob_forward(
    t: &mut Tracer,
    model: &Model,
    ids: T,
    batch: Batch,
    autocast: Option<DType>,
) {
    let outer_autocast = t.enter_autocast(autocast);
    let hidden = model.decoder(t, ids, batch);
    let outer = std::mem::replace(&mut t.component, Component::LogitsAndLoss);
    let logits = lm_head(t, model, hidden);
    model.forward_done(t);
    t.drop(hidden);
    t.exit_autocast(outer_autocast);
    let logits32 = t.to(logits, DType::F32);
    let log_probs = t.log_softmax(logits32);
    t.drop(logits32);
    let gathered = t.empty(
        batch.b * (batch.s - 1),
        DType::F32,
        "gather(log_probs, next tokens)",
    );
    t.drop_all(&[gathered, log_probs, logits]);
    t.component = outer;
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec_and_arch(value: &serde_json::Value) -> (RunSpec, Architecture) {
        let spec = RunSpec::from_value(value).expect("valid spec");
        let model = spec.resolve_model(None).expect("known model");
        let arch = Architecture::from_hf_config(&model.config).expect("valid config");
        (spec, arch)
    }

    /// Two simulations report the same: phases, peaks and what they were made of, trace.
    fn assert_same_numbers(a: &Simulation, b: &Simulation, context: &str) {
        assert_eq!(a.phases, b.phases, "{context}");
        assert_eq!(a.peak_reserved, b.peak_reserved, "{context}");
        assert_eq!(a.peak.allocated, b.peak.allocated, "{context}");
        assert_eq!(a.peak.breakdown, b.peak.breakdown, "{context}");
        let place = |s: &Simulation| (s.peak.phase, s.peak.step);
        assert_eq!(place(a), place(b), "{context}");
        assert_eq!(a.trace, b.trace, "{context}");
    }

    /// A limited run that goes on past its out-of-memory error (the limit had changed nothing)
    /// is the run without a limit, to the byte; one that stops is not used for it.
    #[test]
    fn limited_runs_that_go_on_equal_unlimited_ones() {
        let specs = [
            json!({"model": "qwen2.5-0.5b", "precision": "amp-bf16", "optimizer": "adamw",
                   "batch_size": 1, "seq_len": 512, "gradient_checkpointing": true}),
            json!({"model": "qwen2.5-0.5b", "precision": "bf16", "batch_size": 2, "seq_len": 256,
                   "lora": {"r": 8, "alpha": 16, "targets": "all-linear", "dropout": 0.05}}),
            json!({"model": "qwen2.5-0.5b", "precision": "fp32", "optimizer": "sgd",
                   "batch_size": 1, "seq_len": 128}),
        ];
        let (mut went_on, mut stopped) = (0, 0);
        for value in specs {
            let (spec, arch) = spec_and_arch(&value);
            let run = |capacity, stop| {
                let allocator = AllocatorConfig::default();
                simulate_steps(&spec, &arch, allocator, capacity, true, true, stop)
            };
            let unlimited = run(None, false);
            assert!(unlimited.unlimited);
            // From less than the weights to just short of the reserved peak.
            for eighth in 1..8 {
                let capacity = unlimited.peak_reserved * eighth / 8;
                let limited = run(Some(capacity), true);
                if limited.oom.is_none() {
                    continue;
                }
                if !limited.unlimited {
                    stopped += 1;
                    continue;
                }
                went_on += 1;
                assert_same_numbers(&limited, &unlimited, &format!("{value} {capacity}"));
                // The error is the one a run that goes on after it records.
                assert_eq!(limited.oom, run(Some(capacity), false).oom, "{value}");
            }
        }
        assert!(
            went_on >= 3,
            "{went_on} limited runs went on as unlimited ones"
        );
        assert!(
            stopped >= 3,
            "{stopped} limited runs stopped at their error"
        );
    }

    /// Taking a step from the previous one, or its requests, gives what simulating it gives,
    /// to the byte.
    #[test]
    fn repeated_steps_equal_simulated_ones() {
        let specs = [
            json!({"model": "qwen2.5-0.5b", "precision": "bf16", "optimizer": "adamw",
                   "batch_size": 2, "seq_len": 256}),
            json!({"model": "qwen2.5-0.5b", "precision": "amp-bf16", "optimizer": "adamw",
                   "batch_size": 1, "seq_len": 512, "gradient_checkpointing": true}),
            json!({"model": "qwen2.5-0.5b", "precision": "bf16", "batch_size": 2, "seq_len": 256,
                   "lora": {"r": 8, "alpha": 16, "targets": "all-linear", "dropout": 0.05}}),
            json!({"model": "qwen2.5-0.5b", "precision": "bf16", "quantization": "nf4",
                   "kbit_prepare": true, "batch_size": 1, "seq_len": 256,
                   "gradient_checkpointing": true,
                   "lora": {"r": 8, "alpha": 16, "targets": "all-linear", "dropout": 0.05}}),
            json!({"model": "qwen2.5-0.5b", "precision": "bf16", "mode": "forward",
                   "batch_size": 2, "seq_len": 256}),
            json!({"model": "qwen2.5-0.5b", "precision": "fp32", "optimizer": "sgd",
                   "batch_size": 1, "seq_len": 128}),
        ];
        let (mut repeated, mut ooms, mut limited_repeats) = (0, 0, 0);
        let (mut replayed, mut replayed_ooms) = (0, 0);
        let (mut passes, mut passes_in_ooms, mut both) = (0, 0, 0);
        for value in specs {
            let (spec, arch) = spec_and_arch(&value);
            let run = |capacity, repeat| {
                simulate_steps(
                    &spec,
                    &arch,
                    AllocatorConfig::default(),
                    capacity,
                    true,
                    repeat,
                    false,
                )
            };
            let unlimited = run(None, false);
            // Also on a device just large enough, one between that and the allocated peak
            // (cache flushes), and one short of the allocated peak (an OOM).
            let reserved = unlimited.peak_reserved;
            let allocated = unlimited.peak.allocated;
            let capacities = [
                None,
                Some(reserved),
                // Short by a byte of the unlimited run's reserved peak: the step that reaches
                // it (often the last) flushes the cache, or runs out.
                Some(reserved - 1),
                Some(allocated + (reserved - allocated) / 2),
                Some(allocated - 1),
            ];
            for capacity in capacities {
                let (fast, slow) = (run(capacity, true), run(capacity, false));
                assert_same_numbers(&fast, &slow, &value.to_string());
                assert_eq!(fast.oom, slow.oom, "{value}");
                assert_eq!(
                    (fast.params, fast.trainable_params, fast.weights_loaded),
                    (slow.params, slow.trainable_params, slow.weights_loaded)
                );
                assert_eq!(
                    (
                        slow.repeated_steps,
                        slow.replayed_steps,
                        slow.replayed_passes
                    ),
                    (0, 0, 0)
                );
                // Stopping at the first error finds the same error, and without one the run.
                let stopped = simulate_steps(
                    &spec,
                    &arch,
                    AllocatorConfig::default(),
                    capacity,
                    true,
                    true,
                    true,
                );
                assert_eq!(stopped.oom, slow.oom, "{value}");
                if slow.oom.is_none() {
                    assert_eq!(stopped.phases, slow.phases, "{value}");
                    assert_eq!(stopped.trace, slow.trace, "{value}");
                    assert_eq!(stopped.peak_reserved, slow.peak_reserved, "{value}");
                }
                if capacity.is_none() {
                    repeated += fast.repeated_steps;
                }
                replayed += fast.replayed_steps;
                replayed_ooms += fast.replayed_steps * u32::from(slow.oom.is_some());
                passes += fast.replayed_passes;
                passes_in_ooms += fast.replayed_passes * u32::from(slow.oom.is_some());
                both += u32::from(fast.replayed_passes > 0 && fast.replayed_steps > 0);
                ooms += usize::from(slow.oom.is_some());
                limited_repeats += fast.repeated_steps * u32::from(capacity.is_some());
            }
        }
        // Half of these runs repeat their last step; the short devices run out, and a device
        // limit does not keep steps from repeating.
        assert!(repeated >= 3, "{repeated} steps repeated");
        assert!(ooms >= 3, "{ooms} runs out of memory");
        assert!(
            limited_repeats >= 3,
            "{limited_repeats} steps repeated on limited devices"
        );
        // Others make the last step's requests again (the allocator decides differently),
        // also in runs that flush the cache or run out of memory.
        assert!(replayed >= 6, "{replayed} steps replayed");
        assert!(
            replayed_ooms >= 3,
            "{replayed_ooms} replayed steps in runs out of memory"
        );
        // Step 2's training pass is made from step 1's requests in every training run with
        // an optimizer (five specs, five devices each), also where the run runs out.
        assert!(passes >= 20, "{passes} training passes replayed");
        assert!(
            passes_in_ooms >= 3,
            "{passes_in_ooms} replayed training passes in runs out of memory"
        );
        // Step 3 made from a record that starts with the replayed pass of step 2.
        assert!(both >= 3, "{both} runs replay both a pass and a step");
    }
}
