//! Taking a step from the one before it, when it provably repeats it, instead of simulating
//! it again. Nothing here changes a number: a step taken from a record peaks, reserves and
//! traces exactly as the simulated step would have.
//!
//! The step loop is deterministic: what a step asks of the allocator depends only on the
//! tracer's state (live tensors, parameters, optimizer states), never on the allocator, and
//! the allocator answers deterministically from its layout. So when step k starts in the
//! same tracer state as step k-1 (up to tensor ids) and the allocator's layout is step k-1's
//! plus whole free segments that, checked decision by decision, change nothing
//! (`CachingAllocator::repeats_from`), step k makes the same requests, gets the same blocks
//! and has the same allocated bytes at every point: its phases peak as step k-1's did, its
//! reserved bytes stay where they start (every new segment of step k-1 is found again among
//! those spare ones), no peak is exceeded, and it ends in the state it started from (the
//! spare segments are exactly step k-1's new ones, all used again where they were made).
//! Every later step then repeats it exactly.
//!
//! The process's state is also what the tracer's walk does not see: the parallel strategies'
//! own (FSDP2's units and the buffers it holds over a step) and the FSDP unit the hooks
//! left current (part of the walk). A step is compared only where every strategy is at rest
//! (`Strategy::at_rest`): in the one state its configuration fixes, so two steps that start at
//! rest start in the same strategy state, and a step that repeats another ends at rest as that
//! one did. Requests are recorded with their stream, which a replay allocates on again.
//!
//! When only the allocator's side fails (the tracer state is the previous step's), the step
//! still makes the previous step's requests: model code never reads what the allocator
//! answered (allocations are only kept, freed and compared), so the tracer's requests in a
//! step depend on its state at the start alone. The last step then makes those requests,
//! recorded in order with the phases they fall in, to the allocator again instead of running
//! the tracer: the allocator, peaks, breakdown and trace see exactly what they would have
//! seen. The tracer is left where the step started; nothing reads it after the last step.
//! A record that frees or recharges an allocation made before it (or a run that stopped
//! while recording) is not used.
//!
//! Step 2 of training never starts in step 1's state (the optimizer's states and the cuBLAS
//! workspaces appeared since), but its training pass reads neither: it reads the parameters,
//! the buffers, the autocast cache, the inputs and the workspace flags, and stores gradients
//! that `zero_grad` removed. So when the part of the state a pass reads is step 1's, and the
//! workspace flags are those step 1's pass left, step 2's pass makes step 1's requests less
//! the workspaces' (which only a flag not yet set makes), and ends as step 1's did: the
//! requests are made again and the gradients stored on what they allocate. Step 1's pass
//! must end in the state it started from apart from its gradients and workspaces, each
//! gradient a plain tensor allocated by a recorded request, or a view of one that only
//! gradients hold (FSDP2's sharded gradients, views of the reduce-scatter output). Step 2's own
//! record (for step 3) then starts with those requests, kept rather than recorded again.
//!
//! A strategy's state is no part of the pass's compared state either: a pass is recorded, and
//! made again, only where every strategy is at rest where step 1's pass starts, where it ends
//! and where step 2's starts, so both passes start in the one strategy state the
//! configuration fixes. A pipeline rank's pass is its schedule, recorded from after step 1
//! made the receive buffers (which the schedule reads, as roots, and does not make again).

use std::ops::Range;

use headroom_alloc::{Checkpoint, Decision};

use super::engine::memory::{PhasePeak, Request};
use super::engine::tracer::{Scope, StoredGrads, T, Tracer, TracerState};

/// A step's phases by name, with the range of its requests each made.
pub(crate) type Script = Vec<(&'static str, Range<usize>)>;

/// Runs one measured phase: its name, and what it does to the tracer.
pub(crate) type RunPhase<'a> =
    dyn FnMut(&mut Tracer, &'static str, &mut dyn FnMut(&mut Tracer)) + 'a;

/// Runs one measured phase of step `step` (`f`): its peak goes to `phases`, and the range of
/// the requests it recorded to `script`, which a replay of the step lays out again.
pub(crate) fn measured_phase(
    t: &mut Tracer,
    step: u32,
    name: &'static str,
    script: &mut Script,
    phases: &mut Vec<PhasePeak>,
    f: &mut dyn FnMut(&mut Tracer),
) {
    let first = t.mem.requests_recorded();
    t.mem.begin_measured_phase(name, step);
    f(t);
    script.push((name, first..t.mem.requests_recorded()));
    phases.push(t.mem.phase_peak());
}

/// What the memo knows of a run's steps so far.
pub(crate) struct Memo {
    /// Whole steps may be taken from the previous one.
    steps: bool,
    /// Step 2's training pass may be made from step 1's requests.
    passes: bool,
    /// Step 1 may be compared with the next one: it creates no optimizer state.
    compare_first: bool,
    previous: Option<StepRecord>,
    /// A step found to repeat the previous one: its phases and trace events.
    repeating: Option<(usize, Range<usize>)>,
    first_pass: Option<PassRecord>,
    /// Steps taken from the previous one rather than simulated.
    pub(crate) repeated_steps: u32,
    /// Steps whose requests were taken from the previous one and served by the allocator
    /// again, the tracer not run.
    pub(crate) replayed_steps: u32,
    /// Training passes whose requests were taken from step 1's and served by the allocator
    /// again, the tracer not run.
    pub(crate) replayed_passes: u32,
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
    trace: Range<usize>,
    /// What it asked of the device, when recorded (the step before the last) and complete:
    /// `prefix`, the training pass it made from step 1's requests (kept, not recorded again),
    /// then `requests`.
    prefix: Vec<Request>,
    requests: Option<Vec<Request>>,
    /// Its phases' names and their requests (ranges of `requests`).
    script: Script,
}

/// The phases of a recorded training pass: each one's name (`None`: requests made between
/// measured phases) and where its requests end.
pub(crate) type PassScript = Vec<(Option<&'static str>, usize)>;

/// Step 1's training pass (forward and backward), recorded so that step 2's can be made from
/// its requests.
pub(crate) struct PassRecord {
    /// The state it started from, as a pass reads it, and the persistent tensors then.
    start: TracerState,
    persistent: usize,
    /// The cuBLAS and cuBLASLt workspace flags it left.
    workspaces: ([bool; 2], [bool; 2]),
    /// What it asked of the device (workspaces left out), phase by phase.
    requests: Vec<Request>,
    script: PassScript,
    /// The gradients it stored.
    grads: StoredGrads,
}

/// A training pass being recorded: the state it started from, as a pass reads it.
pub(crate) struct PassStart {
    state: TracerState,
    persistent: usize,
}

impl Memo {
    /// `steps`: whole steps may repeat (a run without collectives, whose buffers are not
    /// part of the compared state); `passes`: step 2's training pass may be made from step
    /// 1's; `compare_first`: step 1 creates no optimizer state.
    pub(crate) fn new(steps: bool, passes: bool, compare_first: bool) -> Self {
        Memo {
            steps,
            passes,
            compare_first,
            previous: None,
            repeating: None,
            first_pass: None,
            repeated_steps: 0,
            replayed_steps: 0,
            replayed_passes: 0,
        }
    }

    /// Before step `step`, whose state the caller holds as `roots`: takes the step from the
    /// previous one where it repeats it (pushing its phases), and says whether it did;
    /// otherwise starts recording it for the next one to compare with. `at_rest`: what the
    /// caller holds outside the tracer and the roots (the parallel strategies' state) is in
    /// the one state its configuration fixes (`Strategy::at_rest`); a step that does not start
    /// there is neither compared nor recorded.
    pub(crate) fn take_step(
        &mut self,
        t: &mut Tracer,
        step: u32,
        last_step: u32,
        roots: &[T],
        at_rest: bool,
        phases: &mut Vec<PhasePeak>,
    ) -> bool {
        let worth_comparing = step > 1 || self.compare_first;
        if self.repeating.is_none() && !at_rest {
            self.previous = None;
        }
        if self.steps && self.repeating.is_none() && worth_comparing && at_rest {
            let mut buffer = Vec::new();
            if let Some(prev) = self.previous.take() {
                let same_tracer = t.state_is(Scope::Step, roots, &prev.tracer);
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
                    self.repeating = Some((prev.phases, end - prev.trace.len()..end));
                    self.repeated_steps += 1;
                    return true;
                }
                if same_tracer
                    && step == last_step
                    && let Some(requests) = &prev.requests
                {
                    let record = [&prev.prefix[..], requests];
                    replay_step(t, step, record, &prev.script, phases);
                    self.replayed_steps += 1;
                    return true;
                }
                buffer = prev.decisions;
            }
            // The last step has no next one to compare with.
            if step < last_step {
                t.mem.allocator.record_decisions_into(buffer);
                // Only the last step is ever replayed.
                if step + 1 == last_step {
                    t.mem.record_requests();
                }
                self.previous = Some(StepRecord {
                    tracer: t.state(Scope::Step, roots),
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
        if let Some((count, trace)) = &self.repeating {
            self.repeated_steps += 1;
            let first = phases.len() - count;
            for i in first..phases.len() {
                let p = phases[i].clone();
                phases.push(PhasePeak { step, ..p });
            }
            t.mem.repeat_trace(trace.clone());
            return true;
        }
        false
    }

    /// Closes the record of the step just simulated: its decisions, phases, trace events and
    /// requests.
    pub(crate) fn end_step(&mut self, t: &mut Tracer, phases: usize, script: Script) {
        if let Some(r) = &mut self.previous {
            r.decisions = t.mem.allocator.take_decisions();
            t.mem.allocator.record_decisions(false);
            r.phases = phases - r.phases;
            r.trace = r.trace.start..t.mem.trace_len();
            r.requests = t.mem.take_requests();
            r.script = script;
        }
    }

    /// Step 1's training pass, where this pass provably makes its requests: no gradient is
    /// stored, the workspace flags are those it left, every strategy is at rest (`at_rest`, as
    /// it was where step 1's pass started and ended), and the state it reads (the caller's
    /// `roots`, and not the optimizer's `aside`) is the one it started from.
    pub(crate) fn pass_to_replay(
        &mut self,
        t: &mut Tracer,
        roots: &[T],
        aside: &[T],
        at_rest: bool,
    ) -> Option<PassRecord> {
        self.first_pass.take().filter(|pass| {
            let scope = Scope::Pass {
                persistent: pass.persistent,
                aside,
            };
            at_rest
                && no_grads(t)
                && (t.cublas_workspace, t.cublaslt_workspace) == pass.workspaces
                && t.state_is(scope, roots, &pass.start)
        })
    }

    /// Makes step 1's pass requests again, phase by phase as its script lays them out, and
    /// stores its gradients on what they allocate. Returns whether the run stopped.
    pub(crate) fn replay_pass(
        &mut self,
        t: &mut Tracer,
        pass: PassRecord,
        phase: &mut RunPhase<'_>,
    ) -> bool {
        // Room for every `Malloc` (fewer than the requests).
        let mut allocations = Vec::with_capacity(pass.requests.len());
        // Step 1's requests are this step's: a record of this step starts with them.
        let kept = t.mem.record_is_empty();
        let mut done = 0;
        for &(name, end) in &pass.script {
            let requests = &pass.requests[done..end];
            done = end;
            let mut replay = |t: &mut Tracer| {
                if kept {
                    t.mem.replay_as_recorded(requests, &mut allocations)
                } else {
                    t.mem.replay(requests, &mut allocations)
                }
            };
            match name {
                Some(name) => phase(t, name, &mut replay),
                None => replay(t),
            }
            if t.mem.stopped() {
                return true;
            }
        }
        t.restore_grads(&pass.grads, &allocations);
        if kept && let Some(record) = self.previous.as_mut() {
            for malloc in pass.grads.mallocs() {
                t.mem.adopt(malloc, &allocations[malloc as usize]);
            }
            record.prefix = pass.requests;
        }
        self.replayed_passes += 1;
        false
    }

    /// Before step `step`'s training pass is simulated, from the state the caller holds as
    /// `roots`: step 1 records it for step 2, where every strategy is at rest (`at_rest`).
    pub(crate) fn begin_pass(
        &mut self,
        t: &mut Tracer,
        step: u32,
        roots: &[T],
        at_rest: bool,
    ) -> Option<PassStart> {
        let persistent = t.persistent_count();
        let scope = Scope::Pass {
            persistent,
            aside: &[],
        };
        (self.passes && step == 1 && at_rest && no_grads(t)).then(|| {
            t.mem.record_requests();
            PassStart {
                state: t.state(scope, roots),
                persistent,
            }
        })
    }

    /// After a recorded pass, whose phases' requests ended where `script` says (the last
    /// entry ending where the pass did): kept for step 2 where it ended as it started,
    /// gradients apart, with every strategy at rest (`at_rest`).
    pub(crate) fn end_pass(
        &mut self,
        t: &mut Tracer,
        start: PassStart,
        script: PassScript,
        roots: &[T],
        at_rest: bool,
    ) {
        let scope = Scope::Pass {
            persistent: start.persistent,
            aside: &[],
        };
        let grads = t.stored_grads();
        let ends_as_started = at_rest && t.state_is(scope, roots, &start.state);
        let requests = t.mem.take_requests();
        if let (Some(grads), Some(requests), true) = (grads, requests, ends_as_started) {
            debug_assert_eq!(script.last().map(|p| p.1), Some(requests.len()));
            self.first_pass = Some(PassRecord {
                start: start.state,
                persistent: start.persistent,
                workspaces: (t.cublas_workspace, t.cublaslt_workspace),
                requests,
                script,
                grads,
            });
        }
    }
}

fn no_grads(t: &Tracer) -> bool {
    t.params.iter().all(|p| p.grad.is_none())
}

/// Makes the recorded requests of a step again, `record[0]` then `record[1]`, phase by phase
/// as `script` lays them out, as step `step`: what the step loop does around each phase, with
/// the requests in place of the tracer.
fn replay_step(
    t: &mut Tracer,
    step: u32,
    record: [&[Request]; 2],
    script: &[(&'static str, Range<usize>)],
    phases: &mut Vec<PhasePeak>,
) {
    let split = record[0].len();
    let mut allocations = Vec::with_capacity(split + record[1].len());
    let mut replay = |t: &mut Tracer, r: Range<usize>| {
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
        t.mem.begin_measured_phase(name, step);
        replay(t, range.clone());
        phases.push(t.mem.phase_peak());
        done = range.end;
        // The loop stops after a phase that ran out; what follows would change nothing.
        if t.mem.stopped() {
            return;
        }
    }
    replay(t, done..split + record[1].len());
}
