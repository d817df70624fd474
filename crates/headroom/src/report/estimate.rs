//! `headroom estimate --json`: a run spec's peak memory and what it is made of, or a
//! pipeline's per phase; and the lines of `--timeline`.

use serde::Serialize;

use super::ComponentBytes;
use super::assumptions::AssumptionsJson;
use crate::estimate::Estimate;
use crate::estimate::PipelineEstimate;
use crate::gpu::Gpu;
use crate::sim::{SimulatedEvent, SimulatedOom};

/// The estimate of one run spec (also `estimate` in `measure --json`).
#[derive(Debug, Serialize)]
pub struct EstimateJson<'a> {
    pub model: &'a str,
    pub params: u64,
    pub trainable_params: u64,
    /// `memory_allocated()` right after the model is built.
    pub weights_loaded_bytes: u64,
    /// The largest `max_memory_allocated()` over every phase.
    pub peak_allocated_bytes: u64,
    /// The largest `memory_reserved()`.
    pub peak_reserved_bytes: u64,
    pub cuda_context_bytes: u64,
    pub nccl_bytes: u64,
    /// Under Megatron-core: each NCCL communicator the rank makes (one per process group made;
    /// all of them with `megatron.eager_nccl_init`, the ones a step uses otherwise), with its
    /// bytes; `nccl_bytes` adds NCCL's kernels and the run's own growth. Absent otherwise.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub nccl_communicators: Vec<CommunicatorJson>,
    /// A colocated vLLM engine's share beyond the allocator's peak (GRPO with
    /// `use_vllm` and `vllm_mode: colocate`); absent otherwise.
    #[serde(skip_serializing_if = "is_zero")]
    pub engine_bytes: u64,
    /// Host memory kept beside the GPU's (offloaded optimizer states, parameters).
    pub host_bytes: u64,
    /// The phase of the peak: `load`, `forward`, `backward`, `optimizer`.
    pub peak_phase: &'a str,
    pub peak_step: u32,
    /// Every phase of every step, in the order they run.
    pub phases: Vec<StepPhaseJson<'a>>,
    /// What the allocated bytes are made of at the peak; sums to `peak_allocated_bytes`.
    pub breakdown: Vec<ComponentBytes>,
    /// Absent for one GPU; for several, the numbers are per GPU.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub per_gpu_of: Option<ParallelJson<'a>>,
    /// The rank the top-level numbers and `breakdown` are of: the one that needs most.
    pub worst_rank: WorstRankJson,
    /// Every pipeline stage's peak, in order (one stage without pipeline parallelism).
    pub stages: Vec<StageJson>,
    /// Absent without `--gpu`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu: Option<VerdictJson<'a>>,
    /// The versions followed, the GPU's constants (the H200's without `--gpu`) and warnings.
    pub assumptions: AssumptionsJson<'a>,
}

#[derive(Debug, Serialize)]
pub struct StepPhaseJson<'a> {
    pub name: &'a str,
    /// 0 for loading the model, then 1, 2, 3.
    pub step: u32,
    pub peak_allocated_bytes: u64,
    pub peak_reserved_bytes: u64,
}

#[derive(Debug, Serialize)]
pub struct ParallelJson<'a> {
    pub strategy: &'a str,
    pub world_size: u64,
    /// Tensor-parallel ranks (1: none); the strategy spreads `world_size / tp`.
    pub tp: u64,
    pub sequence_parallel: bool,
    /// Context-parallel ranks (1: none): each holds `seq_len / cp` of every sequence.
    pub cp: u64,
    /// Absent without pipeline parallelism.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pipeline: Option<PipelineParallelJson>,
}

/// The pipeline mesh dimension: `pp` ranks of `vpp` stages each, `microbatches` per step.
#[derive(Debug, Serialize)]
pub struct PipelineParallelJson {
    pub pp: u64,
    pub vpp: u64,
    pub microbatches: u64,
    pub schedule: &'static str,
}

/// A rank, named by its global index and its pipeline stage.
#[derive(Debug, Serialize)]
pub struct WorstRankJson {
    pub rank: u64,
    pub stage: u64,
}

/// One pipeline stage: the decoder layers it holds, its ranks and its worst rank's peak.
#[derive(Debug, Serialize)]
pub struct StageJson {
    pub stage: u64,
    pub first_layer: u64,
    pub layers: u64,
    pub ranks: u64,
    pub worst_rank: u64,
    pub peak_allocated_bytes: u64,
    pub peak_reserved_bytes: u64,
}

impl StageJson {
    /// Every stage of `est`: one holding the whole model without pipeline parallelism.
    fn list(est: &Estimate) -> Vec<StageJson> {
        let Some(parallel) = est.parallel.as_ref().filter(|p| p.pipeline.pp > 1) else {
            return vec![StageJson {
                stage: 0,
                first_layer: 0,
                layers: est.arch.layers,
                ranks: est.parallel.as_ref().map_or(1, |p| p.world_size),
                worst_rank: est.worst_rank,
                peak_allocated_bytes: est.peak_allocated_bytes,
                peak_reserved_bytes: est.peak_reserved_bytes,
            }];
        };
        let ranks = parallel.world_size / parallel.pipeline.pp;
        let layers = parallel.pipeline.stage_layers(est.arch.layers);
        est.stages
            .iter()
            .map(|s| StageJson {
                stage: s.stage,
                first_layer: layers[..s.stage as usize].iter().sum(),
                layers: layers[s.stage as usize],
                ranks,
                worst_rank: s.pipeline_rank * ranks,
                peak_allocated_bytes: s.peak_allocated,
                peak_reserved_bytes: s.peak_reserved,
            })
            .collect()
    }
}

/// One NCCL communicator of a Megatron-core rank.
#[derive(Debug, Serialize)]
pub struct CommunicatorJson {
    /// The process group's `group_desc` (`default_pg`: the default group).
    pub group: &'static str,
    pub ranks: u64,
    /// Whether a training step runs a collective over it.
    pub used: bool,
    pub bytes: u64,
}

impl<'a> EstimateJson<'a> {
    /// `with_verdict`: whether the run was judged against a GPU the user named.
    pub fn new(est: &'a Estimate, with_verdict: bool) -> Self {
        Self {
            model: &est.model,
            params: est.params,
            trainable_params: est.trainable_params,
            weights_loaded_bytes: est.weights_loaded_bytes,
            peak_allocated_bytes: est.peak_allocated_bytes,
            peak_reserved_bytes: est.peak_reserved_bytes,
            cuda_context_bytes: est.cuda_context_bytes,
            nccl_bytes: est.nccl_bytes,
            nccl_communicators: est
                .nccl_communicators
                .iter()
                .map(|c| CommunicatorJson {
                    group: c.group.name,
                    ranks: c.group.size,
                    used: c.group.used,
                    bytes: c.bytes,
                })
                .collect(),
            engine_bytes: est.engine_bytes,
            host_bytes: est.host_bytes,
            peak_phase: est.peak_phase,
            peak_step: est.peak_step,
            phases: est
                .phases
                .iter()
                .map(|p| StepPhaseJson {
                    name: p.phase,
                    step: p.step,
                    peak_allocated_bytes: p.peak_allocated,
                    peak_reserved_bytes: p.peak_reserved,
                })
                .collect(),
            breakdown: ComponentBytes::list(&est.breakdown),
            per_gpu_of: est.parallel.as_ref().map(|p| ParallelJson {
                strategy: p.strategy.name(),
                world_size: p.world_size,
                tp: p.tensor.tp,
                sequence_parallel: p.tensor.sequence_parallel,
                cp: p.tensor.cp,
                pipeline: (p.pipeline.pp > 1).then(|| PipelineParallelJson {
                    pp: p.pipeline.pp,
                    vpp: p.pipeline.vpp,
                    microbatches: p.pipeline.microbatches,
                    schedule: p.pipeline.schedule.name(),
                }),
            }),
            worst_rank: WorstRankJson {
                rank: est.worst_rank,
                stage: est.parallel.as_ref().map_or(0, |p| {
                    p.pipeline.pipeline_rank(est.worst_rank, p.world_size)
                }),
            },
            stages: StageJson::list(est),
            gpu: with_verdict.then(|| {
                VerdictJson::new(
                    &est.gpu,
                    est.fits(),
                    est.headroom_bytes(),
                    est.oom.as_ref(),
                    At::Step,
                )
            }),
            assumptions: AssumptionsJson::new(&est.assumptions, &est.gpu),
        }
    }
}

/// Whether the run fits the GPU, and where it runs out when it does not.
#[derive(Debug, Serialize)]
pub struct VerdictJson<'a> {
    pub name: &'a str,
    pub total_bytes: u64,
    pub fits: bool,
    /// The GPU's total less what the run needs; negative: what is missing.
    pub headroom_bytes: i128,
    /// Null when the run does not run out (or was not simulated at the GPU's capacity).
    pub oom: Option<OomJson<'a>>,
}

/// Where PyTorch runs out, and its message.
#[derive(Debug, Serialize)]
pub struct OomJson<'a> {
    /// `step` for a run spec, `iteration` for a pipeline.
    #[serde(flatten)]
    pub at: At,
    pub phase: &'a str,
    /// The timeline's label of the tensor being allocated.
    pub tensor: &'a str,
    pub requested_bytes: u64,
    /// PyTorch 2.11's `torch.OutOfMemoryError` message.
    pub message: String,
}

/// A step of a run spec or an iteration of a pipeline; prints as `"step": n` or
/// `"iteration": n`.
#[derive(Clone, Copy, Debug, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum At {
    Step(u32),
    Iteration(u32),
}

impl<'a> VerdictJson<'a> {
    fn new(
        gpu: &'a Gpu,
        fits: bool,
        headroom_bytes: i128,
        oom: Option<&'a SimulatedOom>,
        at: fn(u32) -> At,
    ) -> Self {
        Self {
            name: gpu.name,
            total_bytes: gpu.total_bytes,
            fits,
            headroom_bytes,
            oom: oom.map(|o| OomJson {
                at: at(o.step),
                phase: o.phase,
                tensor: o.tensor,
                requested_bytes: o.requested_bytes,
                message: o.error.to_string(),
            }),
        }
    }
}

/// The estimate of a pipeline: several models in one process, per phase of each iteration.
#[derive(Debug, Serialize)]
pub struct PipelineJson<'a> {
    pub peak_allocated_bytes: u64,
    pub peak_reserved_bytes: u64,
    pub cuda_context_bytes: u64,
    pub nccl_bytes: u64,
    /// The most the process holds on the device in one phase: reserved bytes plus awake
    /// rollout engines, the CUDA context aside.
    pub peak_device_bytes: u64,
    pub peak_phase: PeakPhaseJson<'a>,
    /// What the allocated bytes are made of at the peak.
    pub breakdown: Vec<ComponentBytes>,
    /// Parameter bytes held on the host at most.
    pub host_bytes: u64,
    /// Parameter bytes copied between host and device per iteration.
    pub transfer_bytes_per_iteration: u64,
    /// A rough time for pageable copies; null when the copies come from pinned memory,
    /// overlapped with the passes.
    pub transfer_seconds_per_iteration: Option<f64>,
    pub phases: Vec<PipelinePhaseJson<'a>>,
    /// vLLM-style engines and the share of the GPU they take while awake.
    pub engines: Vec<EngineJson<'a>>,
    /// Absent without `--gpu`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu: Option<VerdictJson<'a>>,
    /// The versions followed, the GPU's constants (the H200's without `--gpu`) and warnings.
    pub assumptions: AssumptionsJson<'a>,
}

#[derive(Debug, Serialize)]
pub struct PeakPhaseJson<'a> {
    pub name: &'a str,
    pub iteration: u32,
}

#[derive(Debug, Serialize)]
pub struct PipelinePhaseJson<'a> {
    pub name: &'a str,
    pub iteration: u32,
    pub peak_allocated_bytes: u64,
    pub peak_reserved_bytes: u64,
    pub host_bytes: u64,
    /// Bytes copied between host and device in the phase.
    pub transfer_bytes: u64,
    pub engine_bytes: u64,
}

#[derive(Debug, Serialize)]
pub struct EngineJson<'a> {
    pub name: &'a str,
    pub bytes: u64,
    pub weight_bytes: u64,
    /// The KV-cache tokens the rest of its share could hold.
    pub kv_cache_tokens_at_most: u64,
}

impl<'a> PipelineJson<'a> {
    /// `with_verdict`: whether the run was judged against a GPU the user named.
    pub fn new(est: &'a PipelineEstimate, with_verdict: bool) -> Self {
        Self {
            peak_allocated_bytes: est.peak_allocated_bytes,
            peak_reserved_bytes: est.peak_reserved_bytes,
            cuda_context_bytes: est.cuda_context_bytes,
            nccl_bytes: est.nccl_bytes,
            peak_device_bytes: est.peak_device_bytes,
            peak_phase: PeakPhaseJson {
                name: &est.peak_phase.0,
                iteration: est.peak_phase.1,
            },
            breakdown: ComponentBytes::list(&est.breakdown),
            host_bytes: est.host_bytes,
            transfer_bytes_per_iteration: est.transfer_bytes_per_iteration,
            transfer_seconds_per_iteration: est.transfer_seconds_per_iteration,
            phases: est
                .phases
                .iter()
                .map(|p| PipelinePhaseJson {
                    name: &p.name,
                    iteration: p.iteration,
                    peak_allocated_bytes: p.peak_allocated,
                    peak_reserved_bytes: p.peak_reserved,
                    host_bytes: p.host_bytes,
                    transfer_bytes: p.transfer_bytes,
                    engine_bytes: p.engine_bytes,
                })
                .collect(),
            engines: est
                .engines
                .iter()
                .map(|e| EngineJson {
                    name: &e.name,
                    bytes: e.bytes,
                    weight_bytes: e.weight_bytes,
                    kv_cache_tokens_at_most: e.kv_tokens,
                })
                .collect(),
            gpu: with_verdict.then(|| {
                VerdictJson::new(
                    &est.gpu,
                    est.fits(),
                    est.headroom_bytes(),
                    est.oom.as_ref(),
                    At::Iteration,
                )
            }),
            assumptions: AssumptionsJson::new(&est.assumptions, &est.gpu),
        }
    }
}

/// One line of `--timeline`: a simulated allocation or free, for comparing with a recorded
/// trace.
#[derive(Debug, Serialize)]
pub struct TimelineEventJson {
    /// True for an allocation, false for a free.
    pub alloc: bool,
    pub bytes: u64,
    /// The simulated block's address: a free names the allocation it returns.
    pub address: u64,
    pub component: &'static str,
    /// What the tensor is, as the timeline names it.
    pub label: &'static str,
}

impl TimelineEventJson {
    pub fn new(e: &SimulatedEvent) -> Self {
        Self {
            alloc: e.alloc,
            bytes: e.bytes,
            address: e.address,
            component: e.component.key(),
            label: e.label,
        }
    }
}

fn is_zero(bytes: &u64) -> bool {
    *bytes == 0
}
