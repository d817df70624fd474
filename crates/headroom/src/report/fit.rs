//! `headroom fit --json`: the largest micro-batch and sequence that fit a GPU, and the
//! configurations that fit.

use serde::Serialize;

use super::assumptions::AssumptionsJson;
use super::layouts::LayoutsJson;
use crate::gpu::Gpu;
use crate::plan::{self, Evaluation, FitReport, Knobs, Resident, Setup};

#[derive(Debug, Serialize)]
pub struct FitJson<'a> {
    pub model: &'a str,
    pub gpu: &'a Gpu,
    /// Data-parallel ranks, one GPU each.
    pub gpus: u32,
    /// Models kept on the same GPU without training (`--resident`).
    pub residents: &'a [Resident],
    /// The spec as it is.
    pub spec: ConfigurationJson,
    /// Null when not even a micro-batch of 1 fits.
    pub max_micro_batch: Option<u64>,
    /// Null when not even one token fits.
    pub max_seq_len: Option<u64>,
    /// The model's position limit, the cap of the sequence search.
    pub max_positions: u64,
    /// Configurations evaluated by the search.
    pub evaluated: usize,
    /// The configurations that fit and that no other beats at once on memory, step time,
    /// fidelity and number of changes.
    pub pareto: Vec<ConfigurationJson>,
    /// The spec's estimate's versions, the GPU's constants and warnings.
    pub assumptions: AssumptionsJson<'a>,
    /// Whether `pareto` was searched: the knobs keep data parallelism, so a tensor-parallel
    /// spec leaves its layout to `layouts`.
    pub knobs_searched: bool,
    /// The layout search over several GPUs (data, tensor and sequence parallelism ×
    /// micro-batch × recomputation).
    pub layouts: LayoutsJson,
}

/// A configuration of the search, evaluated.
#[derive(Debug, Serialize)]
pub struct ConfigurationJson {
    /// The changes from the spec, in words; empty for the spec as it is.
    pub changes: Vec<String>,
    pub knobs: KnobsJson,
    pub peak_allocated_bytes: u64,
    pub peak_reserved_bytes: u64,
    /// Reserved, CUDA context and NCCL: what the process holds on the device.
    pub device_bytes: u64,
    /// The GPU's total less `device_bytes`; negative: what is missing.
    pub headroom_bytes: i128,
    pub fits: bool,
    /// Step time relative to the spec's, same tokens per optimizer step.
    pub slowdown: f64,
    /// `exact`, or how far the training departs from the spec's.
    pub fidelity: &'static str,
    /// Part of the memory is computed from the breakdown, not simulated.
    pub computed: bool,
}

/// The settings of one configuration.
#[derive(Debug, Serialize)]
pub struct KnobsJson {
    pub optimizer: &'static str,
    pub gradient_checkpointing: bool,
    /// `full`, `lora` or `qlora`.
    pub adapter: &'static str,
    pub expandable_segments: bool,
    pub micro_batch: u64,
    pub gradient_accumulation: u64,
    pub seq_len: u64,
    /// `none`, `zero1`, `zero2` or `zero3`.
    pub sharding: &'static str,
    pub cpu_offload: bool,
    pub fused_loss: bool,
    /// DPO's reference log-probs computed once before training (TRL's
    /// `precompute_ref_log_probs`).
    pub precompute_ref_log_probs: bool,
    pub residents_off_gpu: bool,
}

impl<'a> FitJson<'a> {
    pub fn new(setup: &'a Setup, r: &'a FitReport) -> Self {
        Self {
            model: &r.estimate.model,
            gpu: &setup.gpu,
            gpus: setup.gpus,
            residents: &setup.residents,
            spec: ConfigurationJson::new(setup, &r.baseline),
            max_micro_batch: r.max_micro_batch,
            max_seq_len: r.max_seq_len,
            max_positions: r.max_positions,
            evaluated: r.evaluated,
            pareto: r
                .front
                .iter()
                .map(|e| ConfigurationJson::new(setup, e))
                .collect(),
            assumptions: AssumptionsJson::new(&r.estimate.assumptions, &setup.gpu),
            knobs_searched: r.knobs_searched,
            layouts: LayoutsJson::new(setup, &r.layouts),
        }
    }
}

impl ConfigurationJson {
    pub fn new(setup: &Setup, e: &Evaluation) -> Self {
        Self {
            changes: plan::describe(setup, &e.knobs),
            knobs: KnobsJson::new(&e.knobs),
            peak_allocated_bytes: e.peak_allocated_bytes,
            peak_reserved_bytes: e.peak_reserved_bytes,
            device_bytes: e.device_bytes,
            headroom_bytes: e.headroom_bytes(&setup.gpu),
            fits: e.fits,
            slowdown: e.slowdown,
            fidelity: e.fidelity.key(),
            computed: e.computed,
        }
    }
}

impl KnobsJson {
    fn new(k: &Knobs) -> Self {
        Self {
            optimizer: k.optimizer.name(),
            gradient_checkpointing: k.gradient_checkpointing,
            adapter: k.adapter.key(),
            expandable_segments: k.expandable_segments,
            micro_batch: k.micro_batch,
            gradient_accumulation: k.accumulation,
            seq_len: k.seq_len,
            sharding: k.sharding.key(),
            cpu_offload: k.cpu_offload,
            fused_loss: k.fused_loss,
            precompute_ref_log_probs: k.precompute_ref_log_probs,
            residents_off_gpu: k.residents_off_gpu,
        }
    }
}
