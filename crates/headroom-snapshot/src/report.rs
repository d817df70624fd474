//! The `--json` output of `headroom snapshot` and `headroom replay`, as types: each `*Json`
//! struct is the contract of one command's JSON. They follow the rules of `headroom::report`
//! (keys sorted by printing through `serde_json::Value`, sizes in bytes, `null` for an empty
//! `Option`) and live here, beside the types they read, so that this crate needs nothing of
//! the estimator.
//!
//! Summary types whose JSON is exactly their fields ([`TraceSummary`] and what it holds,
//! [`Fragmentation`]) derive `Serialize` themselves and are embedded as they are.

use serde::Serialize;

use crate::{Fragmentation, ReplayReport, SegmentStep, Summary, TraceSummary};

/// `headroom snapshot --json`: the memory state at the snapshot and the trace's peak.
#[derive(Debug, Serialize)]
pub struct SnapshotJson<'a> {
    /// The snapshot file, as given.
    pub file: String,
    pub reserved_bytes: u64,
    pub allocated_bytes: u64,
    pub active_bytes: u64,
    pub requested_bytes: u64,
    /// How many segments there are.
    pub segments: usize,
    pub segment_counts: SegmentCountsJson,
    /// The same as `fragmentation.largest_free_block_bytes`, at the top for quick reads.
    pub largest_free_block_bytes: u64,
    pub fragmentation: &'a Fragmentation,
    /// The `PYTORCH_CUDA_ALLOC_CONF` the snapshot recorded; null when none.
    pub allocator_conf: Option<&'a str>,
    /// The trace's entries; 0 without a trace.
    pub trace_events: usize,
    /// Null without a trace.
    pub trace_peak_active_bytes: Option<u64>,
    /// The trace of the device with the most entries; null without a trace.
    pub trace: Option<&'a TraceSummary>,
}

#[derive(Debug, Serialize)]
pub struct SegmentCountsJson {
    pub large: usize,
    pub small: usize,
    pub expandable: usize,
}

impl<'a> SnapshotJson<'a> {
    pub fn new(file: String, s: &'a Summary) -> Self {
        let trace = s.trace.as_ref();
        Self {
            file,
            reserved_bytes: s.reserved_bytes,
            allocated_bytes: s.allocated_bytes,
            active_bytes: s.active_bytes,
            requested_bytes: s.requested_bytes,
            segments: s.segments.total,
            segment_counts: SegmentCountsJson {
                large: s.segments.large,
                small: s.segments.small,
                expandable: s.segments.expandable,
            },
            largest_free_block_bytes: s.fragmentation.largest_free_block_bytes,
            fragmentation: &s.fragmentation,
            allocator_conf: s.allocator_conf.as_deref(),
            trace_events: trace.map_or(0, |t| t.events),
            trace_peak_active_bytes: trace.map(|t| t.peak_active_bytes),
            trace,
        }
    }
}

/// `headroom replay --json`: how much of the recorded segment activity the simulator
/// reproduces, and what it reserved.
#[derive(Debug, Serialize)]
pub struct ReplayJson<'a> {
    /// The snapshot file, as given.
    pub file: String,
    pub device: usize,
    /// `--alloc-conf`; null when the replay ran under the recorded config.
    pub alloc_conf: Option<&'a str>,
    /// True under `--ignore-addresses`: new segments placed by headroom's driver model, not at
    /// the recorded `cudaMalloc` addresses.
    pub ignore_addresses: bool,
    /// Recorded segment events reproduced in order, as a fraction of those recorded.
    pub fidelity: f64,
    /// False when `fidelity` is a lower bound.
    pub fidelity_exact: bool,
    pub segment_events: SegmentEventsJson,
    /// Null when every event matched.
    pub first_divergence: Option<DivergenceJson>,
    pub trace_events: usize,
    pub initial_reserved_bytes: u64,
    pub recorded_peak_reserved_bytes: u64,
    pub simulated_peak_reserved_bytes: u64,
    pub recorded_final_reserved_bytes: u64,
    pub simulated_final_reserved_bytes: u64,
    pub simulated_peak_allocated_bytes: u64,
    /// Segments and live blocks rebuilt before the first entry, and segments that could not be.
    pub restored_segments: usize,
    pub restored_blocks: usize,
    pub unrestored_segments: usize,
    /// Cache flushes inferred from runs of segment frees.
    pub cache_flushes: usize,
    /// Frees of addresses the replay has no block for.
    pub unmatched_frees: usize,
    /// Allocations the simulator refused.
    pub failed_allocs: usize,
}

#[derive(Debug, Serialize)]
pub struct SegmentEventsJson {
    pub recorded: usize,
    pub simulated: usize,
    /// The longest common subsequence of the two.
    pub matched: usize,
}

#[derive(Debug, Serialize)]
pub struct DivergenceJson {
    /// Position in the list of segment events.
    pub segment_event_index: usize,
    /// The recorded event's index in the device trace; null past the recorded list's end.
    pub trace_index: Option<usize>,
    /// The recorded event; null when the simulation did more.
    pub expected: Option<SegmentStepJson>,
    /// The simulated event; null when the simulation did less.
    pub got: Option<SegmentStepJson>,
}

#[derive(Debug, Serialize)]
pub struct SegmentStepJson {
    /// `segment_alloc`, `segment_free`, `segment_map` or `segment_unmap`.
    pub action: &'static str,
    pub size: u64,
}

impl<'a> ReplayJson<'a> {
    pub fn new(
        file: String,
        alloc_conf: Option<&'a str>,
        ignore_addresses: bool,
        r: &ReplayReport,
    ) -> Self {
        let step = |s: Option<SegmentStep>| {
            s.map(|s| SegmentStepJson {
                action: s.action.name(),
                size: s.size,
            })
        };
        Self {
            file,
            device: r.device,
            alloc_conf,
            ignore_addresses,
            fidelity: r.fidelity,
            fidelity_exact: r.fidelity_exact,
            segment_events: SegmentEventsJson {
                recorded: r.recorded_segment_events,
                simulated: r.simulated_segment_events,
                matched: r.matched_segment_events,
            },
            first_divergence: r.first_divergence.map(|d| DivergenceJson {
                segment_event_index: d.segment_event_index,
                trace_index: d.trace_index,
                expected: step(d.expected),
                got: step(d.got),
            }),
            trace_events: r.trace_events,
            initial_reserved_bytes: r.initial_reserved_bytes,
            recorded_peak_reserved_bytes: r.recorded_peak_reserved_bytes,
            simulated_peak_reserved_bytes: r.simulated_peak_reserved_bytes,
            recorded_final_reserved_bytes: r.recorded_final_reserved_bytes,
            simulated_final_reserved_bytes: r.simulated_final_reserved_bytes,
            simulated_peak_allocated_bytes: r.simulated_peak_allocated_bytes,
            restored_segments: r.restored_segments,
            restored_blocks: r.restored_blocks,
            unrestored_segments: r.unrestored_segments,
            cache_flushes: r.cache_flushes,
            unmatched_frees: r.unmatched_frees,
            failed_allocs: r.failed_allocs,
        }
    }
}
