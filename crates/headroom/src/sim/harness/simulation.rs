//! What simulating a run produced, whichever loop ran it.

use super::instance::Instance;
use crate::sim::engine::memory::{PeakRecord, PhasePeak, SimulatedEvent, SimulatedOom};
use crate::sim::engine::tracer::Tracer;

/// Steps the harness runs; the first differs (optimizer states appear during its step).
pub const STEPS: u32 = 3;

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
    pub trace: Vec<SimulatedEvent>,
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
    /// Whether the numbers are those of the same run without a device limit: none was set,
    /// or it never changed what the allocator did (an out-of-memory error after which the
    /// run went on included; see `Memory::unlimited`).
    pub unlimited: bool,
}

impl Simulation {
    /// What the process `t` that ran `instance` through `phases` (the load first) reports,
    /// every step simulated.
    pub(crate) fn of_run(mut t: Tracer, instance: &Instance, phases: Vec<PhasePeak>) -> Self {
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
            refused: t.mem.refused().cloned(),
            trace: t.mem.take_trace(),
            repeated_steps: 0,
            replayed_steps: 0,
            replayed_passes: 0,
            unlimited: !t.mem.stopped() && t.mem.unlimited(),
        }
    }
}
