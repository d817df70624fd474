//! What is live, by component, and what is reserved after every allocation, free and change
//! of component, with the start of every phase: the timeline a picture is drawn from. Kept
//! only when one is asked for (`sim::Options::record_timeline`), so an estimate that draws
//! nothing pays one branch per allocation.

use super::super::component::Component;

/// The device after one allocation, free or change of component.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Sample {
    /// Bytes requested by live allocations, per component; allocator rounding included, so
    /// they sum to the allocated bytes.
    pub live: [u64; Component::COUNT],
    /// Segments the caching allocator holds.
    pub reserved: u64,
}

impl Sample {
    pub fn allocated(&self) -> u64 {
        self.live.iter().sum()
    }
}

/// Where a phase starts in the samples.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PhaseStart {
    pub first_sample: usize,
    pub step: u32,
    pub phase: &'static str,
    /// Live bytes per component that models the phase does not run hold while it runs (a
    /// pipeline's other instances); included in every sample's `live`.
    pub idle: [u64; Component::COUNT],
}

/// Every sample of a run, in order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct RecordedTimeline {
    pub samples: Vec<Sample>,
    /// In order; the first starts at sample 0.
    pub phases: Vec<PhaseStart>,
    /// The sample of the allocation that ran out of memory (the device limit's first error).
    pub oom_sample: Option<usize>,
}

impl RecordedTimeline {
    pub(crate) fn new() -> Self {
        RecordedTimeline {
            samples: Vec::new(),
            phases: vec![PhaseStart {
                first_sample: 0,
                step: 0,
                phase: "load",
                idle: [0; Component::COUNT],
            }],
            oom_sample: None,
        }
    }

    /// A phase starts here; one that took no sample gives way to it, and naming the running
    /// phase again changes nothing.
    pub(crate) fn start_phase(&mut self, phase: &'static str, step: u32) {
        let first_sample = self.samples.len();
        if let Some(last) = self.phases.last_mut() {
            if last.phase == phase && last.step == step {
                return;
            }
            if last.first_sample == first_sample {
                self.phases.pop();
                if let Some(before) = self.phases.last()
                    && before.phase == phase
                    && before.step == step
                {
                    return;
                }
            }
        }
        self.phases.push(PhaseStart {
            first_sample,
            step,
            phase,
            idle: [0; Component::COUNT],
        });
    }

    /// What models the running phase does not run hold ([`PhaseStart::idle`]).
    pub(crate) fn set_idle(&mut self, idle: [u64; Component::COUNT]) {
        if let Some(phase) = self.phases.last_mut() {
            phase.idle = idle;
        }
    }

    pub(crate) fn push(&mut self, live: [u64; Component::COUNT], reserved: u64) {
        self.samples.push(Sample { live, reserved });
    }

    /// The next sample is the allocation that ran out.
    pub(crate) fn mark_oom(&mut self) {
        self.oom_sample.get_or_insert(self.samples.len());
    }

    /// The samples of phase `i`.
    pub fn phase_samples(&self, i: usize) -> std::ops::Range<usize> {
        let end = self
            .phases
            .get(i + 1)
            .map_or(self.samples.len(), |p| p.first_sample);
        self.phases[i].first_sample..end
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_phase_without_samples_gives_way_and_a_repeated_name_is_one_phase() {
        let mut t = RecordedTimeline::new();
        t.start_phase("forward", 1);
        t.push([0; Component::COUNT], 0);
        t.start_phase("forward", 1);
        t.start_phase("empty", 1);
        t.start_phase("backward", 1);
        t.push([0; Component::COUNT], 0);
        let names: Vec<_> = t.phases.iter().map(|p| p.phase).collect();
        assert_eq!(names, ["forward", "backward"]);
        assert_eq!(t.phase_samples(0), 0..1);
        assert_eq!(t.phase_samples(1), 1..2);
    }
}
