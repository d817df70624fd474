//! How to simulate a run, and what simulating it produced, whichever loop ran it.

use headroom_alloc::AllocatorConfig;

use headroom_alloc::CachingAllocator;

use super::instance::Instance;
use crate::gpu::{Gpu, Workspaces};
use crate::sim::engine::memory::{
    Keep, Memory, PeakRecord, PhasePeak, RecordedTimeline, SimulatedEvent, SimulatedOom,
};
use crate::sim::engine::tracer::Tracer;

/// Steps the harness runs; the first differs (optimizer states appear during its step).
pub const STEPS: u32 = 3;

/// How to simulate a run.
#[derive(Clone, Debug)]
pub struct Options {
    /// The caching allocator's settings (`PYTORCH_CUDA_ALLOC_CONF`).
    pub allocator: AllocatorConfig,
    /// What the caching allocator may obtain from the device; `None`: no limit.
    pub capacity: Option<u64>,
    /// The cuBLAS and cuBLASLt workspaces of the device's architecture.
    pub workspaces: Workspaces,
    /// The device's total memory, of which a colocated rollout engine takes its share.
    pub device_total: u64,
    /// What the run does after its first out-of-memory error.
    pub after_oom: AfterOom,
    /// Keep every allocation and free ([`Simulation::trace`]).
    pub record_trace: bool,
    /// Keep the component timeline ([`Simulation::timeline`]); every step is then simulated.
    pub record_timeline: bool,
    /// Take a step that provably repeats the previous one from it instead of simulating it
    /// again (see `sim::memo`); tests turn it off to check that.
    pub repeat_steps: bool,
    /// Where ranks differ, simulate this one instead of the worst of those an estimate picks
    /// (`run::simulate`).
    pub only_rank: Option<u64>,
    /// A rank that runs out of memory ends the run: the ranks after it are not simulated, and
    /// the error reported is its own rather than the worst rank's (for a caller that only
    /// needs to know that the run does not fit).
    pub first_oom_ends_run: bool,
}

/// What a run does after its first out-of-memory error, which is recorded in
/// [`Simulation::oom`] in any case.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AfterOom {
    /// PyTorch has freed its cache and retried; the limit is lifted and the run goes on, so
    /// every phase is reported (those after the error no longer physical).
    GoOn,
    /// The run stops there (then only [`Simulation::oom`] means anything), unless the limit
    /// had changed nothing by then: it then goes on as the run without a limit, and says so
    /// in [`Simulation::unlimited`], for a caller that wants that run next.
    StopUnlessUnlimited,
}

impl Options {
    /// A run with this allocator and no device limit on the default GPU's architecture, every
    /// step taken from the previous one where it repeats it, no trace kept.
    pub fn new(allocator: AllocatorConfig) -> Self {
        Options {
            allocator,
            capacity: None,
            workspaces: Gpu::default().workspaces(),
            device_total: Gpu::default().total_bytes,
            after_oom: AfterOom::GoOn,
            record_trace: false,
            record_timeline: false,
            only_rank: None,
            first_oom_ends_run: false,
            repeat_steps: true,
        }
    }

    /// A fresh process: a tracer over this allocator, keeping what the options ask for.
    pub(crate) fn process(&self) -> Tracer {
        Tracer::new(
            Memory::new(
                CachingAllocator::new(self.allocator.clone(), self.capacity),
                Keep {
                    trace: self.record_trace,
                    // The memo takes a repeated step without its samples: keeping the timeline
                    // simulates every step (the memo changes no number).
                    timeline: self.record_timeline,
                },
            ),
            self.workspaces,
        )
    }
}

/// What simulating a run produced.
pub struct Simulation {
    /// The rank simulated: 0 where ranks hold alike, else the one that needs more.
    pub rank: u64,
    pub params: u64,
    pub trainable_params: u64,
    pub weights_loaded: u64,
    pub phases: Vec<PhasePeak>,
    pub peak: PeakRecord,
    pub peak_reserved: u64,
    /// Host bytes the rank keeps (see `Instance::host_bytes`).
    pub host_bytes: u64,
    /// Device bytes a colocated rollout engine adds, outside the allocator, to the most the
    /// run holds at once (its share while awake at the allocator's peak, or when it wakes).
    pub engine_bytes: u64,
    pub trace: Vec<SimulatedEvent>,
    /// The component timeline, when kept.
    pub timeline: Option<RecordedTimeline>,
    /// The first allocation that failed on a device of the given capacity.
    pub oom: Option<SimulatedOom>,
    /// An allocation that fails on any device (1 EiB or more, or past a 64-bit address
    /// space): the run stopped there and its numbers mean nothing.
    pub refused: Option<SimulatedOom>,
    /// Steps taken from the previous one rather than simulated (see `sim::memo`).
    pub repeated_steps: u32,
    /// Steps whose requests were taken from the previous one and served by the allocator
    /// again, the tracer not run.
    pub replayed_steps: u32,
    /// Training passes (forward and backward) whose requests were taken from step 1's and
    /// served by the allocator again, the tracer not run.
    pub replayed_passes: u32,
    /// Each pipeline stage's peak (its rank's), in stage order; empty without pipeline
    /// parallelism.
    pub stages: Vec<StagePeak>,
    /// Whether the numbers are those of the same run without a device limit: none was set,
    /// or it never changed what the allocator did (an out-of-memory error after which the
    /// run went on included; see `Memory::unlimited`).
    pub unlimited: bool,
}

impl Simulation {
    /// The largest reserved peak of the steps (loading left out).
    pub(crate) fn steps_peak_reserved(phases: &[PhasePeak]) -> u64 {
        phases
            .iter()
            .filter(|p| p.step > 0)
            .map(|p| p.peak_reserved)
            .max()
            .unwrap_or(0)
    }

    /// What the process `t` that ran `instance` through `phases` (the load first) reports,
    /// every step simulated.
    pub(crate) fn of_run(t: Tracer, instance: &Instance, phases: Vec<PhasePeak>) -> Self {
        let host_bytes = instance.host_bytes(&t);
        Self::of_process(
            t,
            (instance.param_count, instance.trainable_count),
            instance.weights_loaded,
            host_bytes,
            phases,
        )
    }

    /// What the process `t` reports after `phases` (the load first), every step simulated, of
    /// a model of `(params, trainable)` parameters whose weights took `weights_loaded` bytes.
    pub(crate) fn of_process(
        mut t: Tracer,
        (params, trainable_params): (u64, u64),
        weights_loaded: u64,
        host_bytes: u64,
        phases: Vec<PhasePeak>,
    ) -> Self {
        Simulation {
            rank: 0,
            params,
            trainable_params,
            weights_loaded,
            peak_reserved: Self::steps_peak_reserved(&phases),
            peak: t.mem.peak().clone(),
            host_bytes,
            engine_bytes: 0,
            phases,
            oom: t.mem.oom().cloned(),
            refused: t.mem.refused().cloned(),
            trace: t.mem.take_trace(),
            timeline: t.mem.take_timeline(),
            repeated_steps: 0,
            replayed_steps: 0,
            replayed_passes: 0,
            stages: Vec::new(),
            unlimited: !t.mem.stopped() && t.mem.unlimited(),
        }
    }
}

/// A pipeline stage's peak: that of the rank holding it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StagePeak {
    pub stage: u64,
    /// The stage's rank in the pipeline (its first global rank: `pipeline_rank × dp × tp`).
    pub pipeline_rank: u64,
    pub peak_allocated: u64,
    pub peak_reserved: u64,
}

#[cfg(test)]
impl Options {
    /// The memo tests' run: at `capacity`, the trace kept, with or without the step memo.
    pub(crate) fn memo_test(
        capacity: Option<u64>,
        repeat_steps: bool,
        after_oom: AfterOom,
    ) -> Self {
        Options {
            capacity,
            record_trace: true,
            repeat_steps,
            after_oom,
            ..Options::new(AllocatorConfig::default())
        }
    }
}

#[cfg(test)]
impl Simulation {
    /// Devices around this unlimited run's peaks: none, one byte short of its reserved peak
    /// (the step that reaches it flushes the cache, or runs out), between its peaks, and one
    /// byte short of its allocated peak (an error).
    pub(crate) fn devices_around(&self) -> [Option<u64>; 4] {
        let (reserved, allocated) = (self.peak_reserved, self.peak.allocated);
        [
            None,
            Some(reserved - 1),
            Some(allocated + (reserved - allocated) / 2),
            Some(allocated - 1),
        ]
    }
}
