//! `fit --json`'s `layouts`: the layout search over several GPUs, its best layout and why.

use serde::Serialize;

use crate::gpu::Gpu;
use crate::plan::Layouts;
use crate::plan::layout::megatron as megatron_layout;
use crate::plan::layout::{self, Evaluated, LayoutSearch, Outcome};
use crate::spec::{Recompute, RunSpec};

/// How many ranked layouts the report lists.
pub const LISTED: usize = 10;

#[derive(Debug, Serialize)]
pub struct LayoutsJson {
    /// Whether the layout search ran.
    pub searched: bool,
    /// Why it did not (one GPU, adapters, a model whose tensor parallelism is not modelled);
    /// null when it ran.
    pub not_searched: Option<String>,
    /// The parallel axes searched, in the order they are chosen (`pp`, `tp`, `cp`, `sp`, `dp`;
    /// for a Megatron-core spec `pp`, `tp`, `ep`, `etp`, `dp`).
    pub axes: Vec<&'static str>,
    pub gpus: Option<u64>,
    /// Sequences per optimizer step the spec trains with over these GPUs: a layout that keeps
    /// it is `exact`.
    pub global_batch: Option<u64>,
    /// Candidates the axes made (layout × micro-batch × recomputation).
    pub candidates: usize,
    /// Distinct rank simulations they needed (the others repeat one).
    pub simulated: usize,
    /// Candidates the estimator or the spec refuses, and each distinct reason.
    pub refused: usize,
    pub refusals: Vec<String>,
    pub out_of_memory: usize,
    pub fitting: usize,
    /// Of those that fit, the ones left out of `ranked` because they recompute what their
    /// layout need not: the same layout and micro-batch keeps its margin, faster, with less
    /// recomputation.
    pub needless_recompute: usize,
    /// What a layout must keep free to be ranked with the safe ones.
    pub margin_rule: &'static str,
    /// How `time_per_token` is estimated.
    pub cost_model: String,
    /// The first of `ranked`; null when none fits.
    pub best: Option<LayoutJson>,
    /// Why the best is best, in sentences.
    pub why_best: Vec<String>,
    /// The layouts that fit, best first (the first ten), without those that recompute needlessly.
    pub ranked: Vec<LayoutJson>,
    /// When none fits: the layout that needs least (micro-batch 1, recomputation) and its
    /// demand without a limit; null otherwise.
    pub closest: Option<ClosestJson>,
}

/// One candidate that fits.
#[derive(Debug, Serialize)]
pub struct LayoutJson {
    /// The layout in words.
    pub name: String,
    /// The spec keys that run it: `estimate` of the spec with these gives these numbers.
    pub spec: serde_json::Value,
    /// Pipeline ranks (1: none), their schedule (`1f1b`, `interleaved-1f1b`; null without a
    /// pipeline), stages per rank and the micro-batches a step runs through it.
    pub pp: u64,
    pub schedule: Option<&'static str>,
    pub vpp: u64,
    pub microbatches: u64,
    pub tp: u64,
    pub sequence_parallel: bool,
    /// Context-parallel ranks each sequence is cut over (1: none).
    pub cp: u64,
    /// Expert-parallel ranks each MoE layer's experts are spread over (1: none): data-parallel
    /// ranks, `dp / ep` of them holding each expert.
    pub ep: u64,
    /// Expert-tensor-parallel ranks each expert's `linear_fc1` and `linear_fc2` are split over
    /// (1: none), within each expert-parallel rank's: `dp / (ep × etp)` ranks hold each slice.
    pub etp: u64,
    pub dp: u64,
    /// `parallel.strategy` over the data-parallel ranks.
    pub strategy: &'static str,
    /// `parallel.framework`: `megatron` for Megatron-core's layouts, else `torchtitan`.
    pub framework: &'static str,
    /// Megatron's distributed optimizer; null for the torch-native layouts.
    pub distributed_optimizer: Option<bool>,
    pub micro_batch: u64,
    pub gradient_accumulation: u64,
    /// Full recomputation of every decoder layer.
    pub recompute: bool,
    /// Megatron's `recompute_granularity` (`none`, `selective`, `full`); null for the
    /// torch-native layouts.
    pub recompute_granularity: Option<&'static str>,
    pub global_batch: u64,
    /// It keeps the spec's global batch.
    pub exact: bool,
    /// One micro-batch per optimizer step, the whole step simulated; false: with gradient
    /// accumulation, whose later micro-batches also hold the gradients of those before, not
    /// simulated (the numbers are the first micro-batch's).
    pub simulated: bool,
    pub peak_allocated_bytes: u64,
    pub peak_reserved_bytes: u64,
    pub nccl_bytes: u64,
    pub device_bytes: u64,
    pub headroom_bytes: i128,
    pub margin_bytes: u64,
    pub within_margin: bool,
    /// Time per token relative to the best layout's, under the cost model.
    pub time_per_token: f64,
    /// The cost model's seconds per optimizer step and their parts.
    pub model_step_s: f64,
    pub model_compute_s: f64,
    pub model_tensor_comm_s: f64,
    pub model_expert_comm_s: f64,
    pub model_expert_tensor_comm_s: f64,
    pub model_pipeline_bubble_s: f64,
    pub model_pipeline_sends_s: f64,
    pub model_data_comm_exposed_s: f64,
}

#[derive(Debug, Serialize)]
pub struct ClosestJson {
    pub name: String,
    pub spec: serde_json::Value,
    pub device_bytes: u64,
    /// Negative: what it lacks.
    pub headroom_bytes: i128,
}

impl LayoutsJson {
    pub fn new(setup: &crate::plan::Setup, layouts: &Layouts) -> Self {
        match layouts {
            Layouts::NotSearched(why) => Self {
                searched: false,
                not_searched: Some(why.clone()),
                axes: axes(&setup.spec),
                gpus: None,
                global_batch: None,
                candidates: 0,
                simulated: 0,
                refused: 0,
                refusals: Vec::new(),
                out_of_memory: 0,
                fitting: 0,
                needless_recompute: 0,
                margin_rule: layout::MARGIN_RULE,
                cost_model: cost_model(&setup.spec),
                best: None,
                why_best: Vec::new(),
                ranked: Vec::new(),
                closest: None,
            },
            Layouts::Searched(s) => Self::searched(setup, s),
        }
    }

    fn searched(setup: &crate::plan::Setup, s: &LayoutSearch) -> Self {
        let gpu = &setup.gpu;
        let best_time = s.best().map_or(1.0, |b| b.time.per_token_s);
        let ranked: Vec<LayoutJson> = s
            .ranked
            .iter()
            .take(LISTED)
            .map(|e| LayoutJson::new(gpu, e, best_time))
            .collect();
        Self {
            searched: true,
            not_searched: None,
            axes: axes(&setup.spec),
            gpus: Some(s.gpus),
            global_batch: Some(s.global_batch),
            candidates: s.candidates,
            simulated: s.simulated,
            refused: s.refused,
            refusals: s.refusals.clone(),
            out_of_memory: s.out_of_memory,
            fitting: s.ranked.len() + s.needless_recompute,
            needless_recompute: s.needless_recompute,
            margin_rule: layout::MARGIN_RULE,
            cost_model: cost_model(&setup.spec),
            best: s.best().map(|e| LayoutJson::new(gpu, e, best_time)),
            why_best: layout::reasons(setup, s),
            ranked,
            closest: s.closest.as_ref().map(|(c, est)| ClosestJson {
                name: c.name(),
                spec: c.spec_keys(),
                device_bytes: est.device_bytes(),
                headroom_bytes: gpu.total_bytes as i128 - est.device_bytes() as i128,
            }),
        }
    }
}

/// The axes the search of `spec`'s layouts chooses.
fn axes(spec: &RunSpec) -> Vec<&'static str> {
    if megatron_layout::applies(spec) {
        megatron_layout::AXES.to_vec()
    } else {
        layout::AXES.iter().map(|a| a.name).collect()
    }
}

/// The cost model of the search of `spec`'s layouts, in words.
pub fn cost_model(spec: &RunSpec) -> String {
    if megatron_layout::applies(spec) {
        format!("{}; {}", layout::COST_MODEL, megatron_layout::COST_MODEL)
    } else {
        layout::COST_MODEL.to_string()
    }
}

impl LayoutJson {
    fn new(gpu: &Gpu, e: &Evaluated, best_time: f64) -> Self {
        let c = &e.candidate;
        let p = &c.parallel;
        let n = match &e.outcome {
            Outcome::Fits(n) => *n,
            _ => unreachable!("only candidates that fit are ranked"),
        };
        Self {
            name: c.name(),
            spec: c.spec_keys(),
            pp: p.pipeline.pp,
            schedule: (p.pipeline.pp > 1).then(|| p.pipeline.schedule.name()),
            vpp: p.pipeline.vpp,
            microbatches: c.pipelined(),
            tp: p.tensor.tp,
            sequence_parallel: p.tensor.sequence_parallel,
            cp: p.tensor.cp,
            ep: c.megatron.map_or(1, |m| m.expert_parallel),
            etp: c
                .megatron
                .map_or(1, |m| m.expert_tensor_parallel.unwrap_or(1)),
            dp: layout::data_parallel(p),
            strategy: p.strategy.name(),
            framework: if c.megatron.is_some() {
                "megatron"
            } else {
                "torchtitan"
            },
            distributed_optimizer: c.megatron.map(|m| m.distributed_optimizer),
            micro_batch: c.micro_batch,
            gradient_accumulation: c.accumulation,
            recompute: c.recompute,
            recompute_granularity: c.megatron.map(|m| match m.recompute {
                Recompute::None => "none",
                Recompute::Selective(_) => "selective",
                Recompute::Full { .. } => "full",
            }),
            global_batch: c.global_batch(),
            exact: e.exact,
            simulated: e.simulated,
            peak_allocated_bytes: n.peak_allocated_bytes,
            peak_reserved_bytes: n.peak_reserved_bytes,
            nccl_bytes: n.nccl_bytes,
            device_bytes: n.device_bytes,
            headroom_bytes: gpu.total_bytes as i128 - n.device_bytes as i128,
            margin_bytes: e.margin_bytes,
            within_margin: e.within_margin(gpu),
            time_per_token: e.time.per_token_s / best_time,
            model_step_s: e.time.total_s,
            model_compute_s: e.time.compute_s,
            model_tensor_comm_s: e.time.tensor_s,
            model_expert_comm_s: e.time.expert_s,
            model_expert_tensor_comm_s: e.time.expert_tensor_s,
            model_pipeline_bubble_s: e.time.bubble_s,
            model_pipeline_sends_s: e.time.sends_s,
            model_data_comm_exposed_s: e.time.data_exposed_s,
        }
    }
}
