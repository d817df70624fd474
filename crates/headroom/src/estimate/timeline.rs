//! The timeline a picture of an estimate is drawn from: allocated bytes by component and
//! reserved bytes over the run's allocations, phase by phase, cut to a bounded number of
//! points that keep every phase's peak, with the peak and the out-of-memory point marked.

use crate::sim::{Component, RecordedTimeline, SimulatedOom};

/// Points a timeline keeps at most (a phase keeps at least [`MIN_PHASE_POINTS`]).
pub const MAX_POINTS: usize = 2000;
const MIN_PHASE_POINTS: usize = 4;

/// The device after one allocation, free or change of component.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TimelinePoint {
    /// Its place among all the run's allocations, frees and changes of component.
    pub event: usize,
    /// Live bytes per component, in [`Component::ALL`] order (sum: allocated).
    pub by_component: [u64; Component::COUNT],
    /// Reserved bytes: the most among the events the point stands for.
    pub reserved: u64,
}

impl TimelinePoint {
    pub fn allocated(&self) -> u64 {
        self.by_component.iter().sum()
    }
}

/// One phase: its events and its points.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TimelinePhase {
    /// The step (or a pipeline's iteration) and the phase's name.
    pub step: u32,
    pub name: String,
    pub events: std::ops::Range<usize>,
    pub points: std::ops::Range<usize>,
    /// Live bytes per component that models the phase does not run hold through it (a
    /// pipeline's other instances), within each point's `by_component`.
    pub idle: [u64; Component::COUNT],
}

/// Where the run ran out of memory: the estimate's [`SimulatedOom`] placed on the timeline.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TimelineOom {
    /// The point of the allocation that failed (the same allocation in the run without a
    /// limit, whose timeline this is).
    pub point: usize,
    pub step: u32,
    pub phase: String,
    pub tensor: String,
    pub requested_bytes: u64,
}

/// A run's timeline, as drawn.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Timeline {
    pub points: Vec<TimelinePoint>,
    pub phases: Vec<TimelinePhase>,
    /// Allocations, frees and changes of component of the whole run.
    pub events: usize,
    /// Points a phase keeps at most.
    pub points_per_phase: usize,
    /// The point of the estimate's peak: the largest allocated total of the phase it names.
    pub peak: Option<usize>,
    pub oom: Option<TimelineOom>,
}

impl Timeline {
    /// `recorded` cut to at most [`MAX_POINTS`] points (more only with more than
    /// `MAX_POINTS / 4` phases): each phase's samples fall into buckets, and each bucket keeps
    /// its largest allocated total (with the reserved bytes of the bucket's most), so no
    /// phase's peak is lost. `peak` is the step and phase of the estimate's peak; `oom` the
    /// estimate's error, whose sample `oom_sample` is.
    pub fn new(
        recorded: &RecordedTimeline,
        peak: (u32, &str),
        oom: Option<&SimulatedOom>,
        oom_sample: Option<usize>,
    ) -> Self {
        let budget = (MAX_POINTS / recorded.phases.len().max(1)).max(MIN_PHASE_POINTS);
        let mut points = Vec::new();
        let mut phases = Vec::new();
        let mut oom_point = None;
        for (i, phase) in recorded.phases.iter().enumerate() {
            let events = recorded.phase_samples(i);
            let first_point = points.len();
            let n = events.len();
            let buckets = n.min(budget);
            for b in 0..buckets {
                let bucket = events.start + b * n / buckets..events.start + (b + 1) * n / buckets;
                let samples = &recorded.samples[bucket.clone()];
                let top = bucket.start
                    + samples
                        .iter()
                        .enumerate()
                        .max_by_key(|(j, s)| (s.allocated(), std::cmp::Reverse(*j)))
                        .map_or(0, |(j, _)| j);
                let reserved = samples.iter().map(|s| s.reserved).max().unwrap_or(0);
                let mut keep = vec![top];
                if let Some(o) = oom_sample.filter(|o| bucket.contains(o) && *o != top) {
                    keep.push(o);
                    keep.sort_unstable();
                }
                for k in keep {
                    if Some(k) == oom_sample {
                        oom_point = Some(points.len());
                    }
                    points.push(TimelinePoint {
                        event: k,
                        by_component: recorded.samples[k].live,
                        reserved,
                    });
                }
            }
            phases.push(TimelinePhase {
                step: phase.step,
                name: phase.phase.to_string(),
                events,
                points: first_point..points.len(),
                idle: phase.idle,
            });
        }
        let peak = phases
            .iter()
            .filter(|p| (p.step, p.name.as_str()) == peak)
            .flat_map(|p| p.points.clone())
            .max_by_key(|&i| (points[i].allocated(), std::cmp::Reverse(i)));
        Timeline {
            peak,
            oom: oom.zip(oom_point).map(|(o, point)| TimelineOom {
                point,
                step: o.step,
                phase: o.phase.to_string(),
                tensor: o.tensor.to_string(),
                requested_bytes: o.requested_bytes,
            }),
            events: recorded.samples.len(),
            points_per_phase: budget,
            points,
            phases,
        }
    }

    /// The phase a point falls in.
    pub fn phase_of(&self, point: usize) -> Option<&TimelinePhase> {
        self.phases.iter().find(|p| p.points.contains(&point))
    }

    /// The phase an event falls in.
    pub fn phase_of_event(&self, event: usize) -> Option<&TimelinePhase> {
        self.phases.iter().find(|p| p.events.contains(&event))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::{PhaseStart, Sample};

    fn sample(weights: u64, activations: u64, reserved: u64) -> Sample {
        let mut live = [0; Component::COUNT];
        live[Component::Weights.index()] = weights;
        live[Component::Activations.index()] = activations;
        Sample { live, reserved }
    }

    #[test]
    fn cutting_keeps_every_phase_peak_and_the_oom_sample() {
        let mut samples = vec![sample(10, 0, 16)];
        // a long forward with one spike, then a backward
        samples.extend((0..10_000).map(|i| sample(10, i % 7, 32)));
        samples[4321].live[Component::Activations.index()] = 1000;
        samples.extend((0..10_000).map(|i| sample(10, 5 + i % 3, 64)));
        let recorded = RecordedTimeline {
            samples,
            phases: vec![
                PhaseStart {
                    first_sample: 0,
                    step: 0,
                    phase: "load",
                    idle: [0; Component::COUNT],
                },
                PhaseStart {
                    first_sample: 1,
                    step: 1,
                    phase: "forward",
                    idle: [0; Component::COUNT],
                },
                PhaseStart {
                    first_sample: 10_001,
                    step: 1,
                    phase: "backward",
                    idle: [0; Component::COUNT],
                },
            ],
            oom_sample: None,
        };
        let timeline = Timeline::new(&recorded, (1, "forward"), None, Some(15_000));
        assert!(timeline.points.len() <= MAX_POINTS + 1);
        let peak = &timeline.points[timeline.peak.expect("a peak")];
        assert_eq!((peak.event, peak.allocated()), (4321, 1010));
        assert!(timeline.points.iter().any(|p| p.event == 15_000));
        assert_eq!(
            timeline.phase_of(timeline.peak.unwrap()).unwrap().name,
            "forward"
        );
        let backward = &timeline.phases[2];
        let top = backward
            .points
            .clone()
            .map(|i| timeline.points[i].allocated())
            .max();
        assert_eq!(top, Some(17));
        assert!(
            backward
                .points
                .clone()
                .all(|i| timeline.points[i].reserved == 64)
        );
    }
}
