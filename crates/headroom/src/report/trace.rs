//! `headroom trace --json` and `headroom replay TRACE --json`: a trace of the real model code
//! replayed through the allocator simulator. Keys mean what they mean in `estimate --json`
//! where the concept is the same (`peak_allocated_bytes`, `breakdown`, `phases`, `gpu`) and in
//! the snapshot `replay --json` (`simulated_peak_*`, `alloc_conf`, `fidelity`).

use serde::Serialize;
use serde_json::{Map, Value};

use super::ComponentBytes;
use crate::trace::{Trace, TraceEstimate};

/// What every trace report says it is.
const SOURCE: &str = "trace";

/// A trace's estimate.
#[derive(Debug, Serialize)]
pub struct TraceJson<'a> {
    /// `trace`: from the real code under fake tensors, not the native model.
    pub source: &'static str,
    /// The trace file read or saved; null when it was a temporary file.
    pub trace_file: Option<&'a str>,
    /// The spec's `model`; null when it does not name one.
    pub model: Option<&'a str>,
    /// What the tracer recorded of its environment: torch, transformers, peft and Python
    /// versions, and more.
    pub env: &'a Map<String, Value>,
    /// `--alloc-conf`; null: the spec's `allocator`, PyTorch's default without one.
    pub alloc_conf: Option<&'a str>,
    /// The largest `max_memory_allocated()` over the steps.
    pub peak_allocated_bytes: u64,
    /// The largest `memory_reserved()` over the steps.
    pub peak_reserved_bytes: u64,
    /// The most held on the device in one phase: reserved plus awake rollout engines (equal to
    /// `peak_reserved_bytes` without engines), the CUDA context aside.
    pub peak_device_bytes: u64,
    pub cuda_context_bytes: u64,
    /// Reserved but unallocated at the peak.
    pub fragmentation_bytes: u64,
    /// The phase of the peak (`step 1 backward`).
    pub peak_phase: &'a str,
    /// The peak phase's iteration, in a pipeline's trace; absent for a run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub peak_iteration: Option<u32>,
    /// Every phase, the load first, in the order they ran.
    pub phases: Vec<TracePhaseJson<'a>>,
    /// What the allocated bytes are made of at the peak, by storage kind (`parameter`,
    /// `activation`, ...), `workspaces` (kernel buffers) and `allocator_rounding`; sums to
    /// `peak_allocated_bytes`.
    pub breakdown: Vec<ComponentBytes>,
    /// A pipeline's rollout engines and the share of the GPU each holds while awake; absent
    /// without engines.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub engines: Vec<TraceEngineJson<'a>>,
    /// Events of the trace file.
    pub trace_events: usize,
    /// Allocations and frees replayed, kernel buffers included.
    pub timeline_events: u64,
    /// Absent without `--gpu`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu: Option<TraceVerdictJson<'a>>,
}

#[derive(Debug, Serialize)]
pub struct TracePhaseJson<'a> {
    pub name: &'a str,
    /// A pipeline's iteration, as `estimate --json` numbers a pipeline's phases; absent for a run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub iteration: Option<u32>,
    pub peak_allocated_bytes: u64,
    pub peak_reserved_bytes: u64,
    /// Held by awake rollout engines at the phase's end; absent without engines.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub engine_bytes: Option<u64>,
}

#[derive(Debug, Serialize)]
pub struct TraceEngineJson<'a> {
    pub name: &'a str,
    pub bytes: u64,
}

/// Whether the run fits the GPU: `estimate`'s verdict, the out-of-memory error placed by its
/// trace event.
#[derive(Debug, Serialize)]
pub struct TraceVerdictJson<'a> {
    pub name: &'a str,
    pub total_bytes: u64,
    pub fits: bool,
    /// The GPU's total less what the run needs; negative: what is missing.
    pub headroom_bytes: i128,
    /// Null when the run does not run out.
    pub oom: Option<TraceOomJson<'a>>,
}

#[derive(Debug, Serialize)]
pub struct TraceOomJson<'a> {
    /// Index of the trace event whose allocation failed.
    pub event: usize,
    pub phase: &'a str,
    /// A pipeline's iteration; absent for a run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub iteration: Option<u32>,
    /// The storage (kind, op, module) or kernel buffer being allocated.
    pub tensor: &'a str,
    pub requested_bytes: u64,
    /// Allocated and reserved bytes at the failure.
    pub allocated_bytes: u64,
    pub reserved_bytes: u64,
    /// PyTorch 2.11's `torch.OutOfMemoryError` message.
    pub message: String,
}

impl<'a> TraceJson<'a> {
    /// `with_verdict`: whether the run was judged against a GPU the user named.
    pub fn new(
        trace: &'a Trace,
        est: &'a TraceEstimate,
        trace_file: Option<&'a str>,
        alloc_conf: Option<&'a str>,
        with_verdict: bool,
    ) -> Self {
        Self {
            source: SOURCE,
            trace_file,
            model: trace.model(),
            env: &trace.env,
            alloc_conf,
            peak_allocated_bytes: est.peak_allocated_bytes,
            peak_reserved_bytes: est.peak_reserved_bytes,
            peak_device_bytes: est.peak_device_bytes,
            cuda_context_bytes: est.cuda_context_bytes,
            fragmentation_bytes: est.fragmentation_bytes,
            peak_phase: &est.peak_phase,
            peak_iteration: est.peak_iteration,
            phases: est
                .phases
                .iter()
                .map(|p| TracePhaseJson {
                    name: &p.name,
                    iteration: p.iteration,
                    peak_allocated_bytes: p.peak_allocated,
                    peak_reserved_bytes: p.peak_reserved,
                    engine_bytes: (!trace.engines.is_empty()).then_some(p.engine_bytes),
                })
                .collect(),
            breakdown: est
                .breakdown
                .iter()
                .map(|&(component, bytes)| ComponentBytes { component, bytes })
                .collect(),
            engines: trace
                .engines
                .iter()
                .map(|e| TraceEngineJson {
                    name: &e.name,
                    bytes: est.gpu.share_bytes(e.gpu_memory_utilization),
                })
                .collect(),
            trace_events: trace.events.len(),
            timeline_events: est.timeline_events,
            gpu: with_verdict.then(|| TraceVerdictJson {
                name: est.gpu.name,
                total_bytes: est.gpu.total_bytes,
                fits: est.fits(),
                headroom_bytes: est.headroom_bytes(),
                oom: est.oom.as_ref().map(|o| TraceOomJson {
                    event: o.event,
                    phase: &o.phase,
                    iteration: o.iteration,
                    tensor: &o.tensor,
                    requested_bytes: o.requested_bytes,
                    allocated_bytes: o.allocated_bytes,
                    reserved_bytes: o.reserved_bytes,
                    message: o.error.to_string(),
                }),
            }),
        }
    }
}

/// `headroom replay` of a trace: what the allocator simulator reserves for its calls. A trace
/// records no device activity, so there is nothing to measure fidelity against.
#[derive(Debug, Serialize)]
pub struct TraceReplayJson<'a> {
    /// The trace file, as given.
    pub file: String,
    /// `trace`.
    pub source: &'static str,
    /// Always null: nothing recorded to compare with.
    pub fidelity: Option<f64>,
    pub trace_events: usize,
    /// The spec's `allocator.expandable_segments` (false without one), the config of the
    /// `simulated_*` numbers.
    pub expandable_segments: bool,
    pub simulated_peak_allocated_bytes: u64,
    pub simulated_peak_reserved_bytes: u64,
    /// `--alloc-conf`; null without it.
    pub alloc_conf: Option<&'a str>,
    /// The same calls under `--alloc-conf`; absent without it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub what_if: Option<WhatIfJson>,
}

#[derive(Debug, Serialize)]
pub struct WhatIfJson {
    pub simulated_peak_allocated_bytes: u64,
    pub simulated_peak_reserved_bytes: u64,
}

impl<'a> TraceReplayJson<'a> {
    pub fn new(
        file: String,
        trace: &Trace,
        expandable_segments: bool,
        baseline: &TraceEstimate,
        alloc_conf: Option<&'a str>,
        what_if: Option<&TraceEstimate>,
    ) -> Self {
        Self {
            file,
            source: SOURCE,
            fidelity: None,
            trace_events: trace.events.len(),
            expandable_segments,
            simulated_peak_allocated_bytes: baseline.peak_allocated_bytes,
            simulated_peak_reserved_bytes: baseline.peak_reserved_bytes,
            alloc_conf,
            what_if: what_if.map(|e| WhatIfJson {
                simulated_peak_allocated_bytes: e.peak_allocated_bytes,
                simulated_peak_reserved_bytes: e.peak_reserved_bytes,
            }),
        }
    }
}
