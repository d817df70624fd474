//! `headroom estimate`: resolve a spec, simulate its run, and summarise what PyTorch would
//! report; [`estimate_pipeline`] does the same for several models in one process.

mod assumptions;
mod nccl;
mod pipeline;
mod timeline;

pub use assumptions::Assumptions;
pub use nccl::{Communicator, MegatronGroup, megatron_groups, nccl_bytes, run_nccl_bytes};
pub use pipeline::{
    EngineSummary, PAGEABLE_COPY_BYTES_PER_S, PipelineEstimate, estimate_pipeline,
    estimate_pipeline_timeline,
};
pub use timeline::{MAX_POINTS, Timeline, TimelineOom, TimelinePhase, TimelinePoint};

use std::path::Path;

use headroom_alloc::{AllocatorConfig, OutOfMemory};

use crate::arch::Architecture;
use crate::error::{Error, Result};
use crate::gpu::Gpu;
use crate::sim::{self, Component, PhasePeak, SimulatedEvent, SimulatedOom};
use crate::spec::RunSpec;

/// The estimate of one run spec.
#[derive(Clone, Debug)]
pub struct Estimate {
    pub model: String,
    /// How the run is spread over GPUs: the numbers are then per GPU (rank).
    pub parallel: Option<crate::spec::Parallel>,
    pub arch: Architecture,
    pub params: u64,
    pub trainable_params: u64,
    /// `memory_allocated()` right after the model is built.
    pub weights_loaded_bytes: u64,
    /// The largest `max_memory_allocated()` over all phases of all steps.
    pub peak_allocated_bytes: u64,
    /// The largest `memory_reserved()` (segments held by the caching allocator).
    pub peak_reserved_bytes: u64,
    /// Memory outside the allocator: the CUDA context (and the first small segment).
    pub cuda_context_bytes: u64,
    /// NCCL's communicators and buffers, also outside the allocator (multi-GPU runs).
    pub nccl_bytes: u64,
    /// Under Megatron-core, the communicators that make up most of `nccl_bytes`, one per
    /// process group made (`estimate::nccl`); empty otherwise.
    pub nccl_communicators: Vec<nccl::Communicator>,
    /// A colocated vLLM engine's share beyond the allocator's peak (GRPO with
    /// `vllm_mode: colocate`): vLLM's contract, not a measurement.
    pub engine_bytes: u64,
    /// Host memory the run keeps beside the GPU's (per rank): DeepSpeed's `offload_optimizer`
    /// masters, gradients and states, FSDP2's offloaded shards.
    pub host_bytes: u64,
    pub phases: Vec<PhasePeak>,
    /// What the allocated bytes were made of at the peak; sums to `peak_allocated_bytes`.
    pub breakdown: Vec<(Component, u64)>,
    /// The phase and step of the peak.
    pub peak_phase: &'static str,
    pub peak_step: u32,
    pub gpu: Gpu,
    /// What the caching allocator could obtain in the simulation; `None`: no limit (the
    /// estimate is the run's demand, whatever the GPU).
    pub capacity_bytes: Option<u64>,
    /// Where the run ran out of memory on `gpu`, with PyTorch's message. The numbers above are
    /// then those of the same run without a limit: what it would need.
    pub oom: Option<SimulatedOom>,
    /// The versions followed and what is carried over or not modelled for this run.
    pub assumptions: Assumptions,
    /// The rank the numbers above are of: the one that needs most (0 where ranks hold
    /// alike: data-parallel replicas and shards, the ranks of a tensor-parallel group).
    pub worst_rank: u64,
    /// Each pipeline stage's peak, in stage order; empty without pipeline parallelism.
    pub stages: Vec<sim::StagePeak>,
    /// The GPU's capacity never changed what the allocator did (every simulated rank's): the
    /// same run on any GPU of the same architecture with at least this capacity.
    pub unlimited: bool,
}

impl Estimate {
    /// The load's allocated peak where it is above every step's (`peak_allocated_bytes` leaves
    /// the load out): what `max_memory_allocated()` reports of the whole run then. Its reserved
    /// bytes stay in every later phase's, so `device_bytes` covers it either way.
    pub fn load_peak_above_steps(&self) -> Option<u64> {
        self.phases
            .iter()
            .filter(|p| p.step == 0)
            .map(|p| p.peak_allocated)
            .max()
            .filter(|&load| load > self.peak_allocated_bytes)
    }

    /// Device memory the run needs: reserved plus what lives outside the allocator.
    pub fn device_bytes(&self) -> u64 {
        self.peak_reserved_bytes + self.cuda_context_bytes + self.nccl_bytes + self.engine_bytes
    }

    /// Whether the run fits its GPU. Simulated at the GPU's capacity, it fits when it did not
    /// run out (the allocator may have freed its cache to get there); simulated without a
    /// limit, when its demand is below the GPU's total.
    pub fn fits(&self) -> bool {
        match self.capacity_bytes {
            Some(_) => self.oom.is_none(),
            None => self.device_bytes() <= self.gpu.total_bytes,
        }
    }

    /// The GPU's total less what the run holds at its peak (negative: how much is missing).
    pub fn headroom_bytes(&self) -> i128 {
        self.gpu.total_bytes as i128 - self.device_bytes() as i128
    }
}

/// Resolve `spec` (relative paths from `spec_dir`) and estimate it on `gpu`: the caching
/// allocator gets the GPU's capacity, so that it frees its cache and retries before running out
/// as PyTorch does.
pub fn estimate(spec: &RunSpec, spec_dir: Option<&Path>, gpu: &Gpu) -> Result<Estimate> {
    Ok(estimate_with_trace(spec, spec_dir, gpu, Limit::Gpu, false)?.0)
}

/// Whether the simulated device runs out.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Limit {
    /// At the GPU's capacity (less the CUDA context).
    Gpu,
    /// Never: the estimate is the run's demand.
    None,
    /// At the GPU's capacity, and a run that runs out is not simulated again for its demand:
    /// its numbers stop at the failure (a search only needs to know that it does not fit).
    GpuUntilOom,
}

/// Like [`estimate`], for one rank of a layout whose ranks differ (DeepSpeed ZeRO's
/// partitions, pipeline stages, the distributed optimizer's shards): what a measurement of
/// that rank alone is compared with.
pub fn estimate_rank(
    spec: &RunSpec,
    spec_dir: Option<&Path>,
    gpu: &Gpu,
    rank: u64,
) -> Result<Estimate> {
    estimate_rank_with_limit(spec, spec_dir, gpu, Limit::Gpu, rank)
}

/// Like [`estimate_rank`], with the limit chosen. A rank outside the world is refused.
pub fn estimate_rank_with_limit(
    spec: &RunSpec,
    spec_dir: Option<&Path>,
    gpu: &Gpu,
    limit: Limit,
    rank: u64,
) -> Result<Estimate> {
    let world = spec.parallel.as_ref().map_or(1, |p| p.world_size);
    if rank >= world {
        return Err(Error::field(
            "--rank",
            rank,
            format!("a rank of the spec's world: 0 to {}", world - 1),
        ));
    }
    Ok(estimate_ranks(spec, spec_dir, gpu, limit, Keep::default(), Some(rank))?.0)
}

/// What an estimate keeps of its simulated run besides the numbers.
#[derive(Clone, Copy, Debug, Default)]
struct Keep {
    trace: bool,
    timeline: bool,
}

/// Like [`estimate`], with the limit chosen, also returning the timeline of allocated bytes by
/// component and of reserved bytes (that of the run without a limit where the limited one ran
/// out, with the error placed on it).
pub fn estimate_timeline(
    spec: &RunSpec,
    spec_dir: Option<&Path>,
    gpu: &Gpu,
    limit: Limit,
) -> Result<(Estimate, Timeline)> {
    let keep = Keep {
        trace: false,
        timeline: true,
    };
    let (estimate, _, timeline) = estimate_ranks(spec, spec_dir, gpu, limit, keep, None)?;
    Ok((estimate, timeline.expect("kept")))
}

/// Like [`estimate`], with the limit chosen, also returning every allocation and free of the
/// simulated run (when `trace`).
pub fn estimate_with_trace(
    spec: &RunSpec,
    spec_dir: Option<&Path>,
    gpu: &Gpu,
    limit: Limit,
    trace: bool,
) -> Result<(Estimate, Vec<SimulatedEvent>)> {
    let keep = Keep {
        trace,
        timeline: false,
    };
    let (estimate, events, _) = estimate_ranks(spec, spec_dir, gpu, limit, keep, None)?;
    Ok((estimate, events))
}

/// The estimate of the worst rank, or of `rank` alone.
fn estimate_ranks(
    spec: &RunSpec,
    spec_dir: Option<&Path>,
    gpu: &Gpu,
    limit: Limit,
    keep: Keep,
    rank: Option<u64>,
) -> Result<(Estimate, Vec<SimulatedEvent>, Option<Timeline>)> {
    spec.check_simulated()?;
    let (model, arch) = spec.architecture(spec_dir, "")?;
    if let Some(parallel) = &spec.parallel {
        // A forward-only zero1/zero2 model is refused by the spec (a plain copy); zero3 builds
        // an inference engine without an optimizer.
        if parallel.strategy.is_deepspeed()
            && spec.mode == crate::spec::Mode::Train
            && spec.optimizer != crate::spec::Optimizer::AdamW
        {
            return Err(Error::Unsupported {
                what: format!("optimizer {} with DeepSpeed ZeRO", spec.optimizer.name()),
                supported: "adamw (DeepSpeed's torch_adam: torch.optim.AdamW, foreach; \
                            DeepSpeedCPUAdam under offload_optimizer)"
                    .into(),
            });
        }
    }
    let allocator = AllocatorConfig {
        expandable_segments: spec.allocator.expandable_segments,
        ..AllocatorConfig::default()
    };
    let (nccl, nccl_communicators) = nccl::run_nccl(spec, &arch, rank);
    let capacity = (limit != Limit::None).then(|| gpu.allocator_capacity().saturating_sub(nccl));
    // With an error, the limited run stops there and only the error is kept, unless the limit
    // had changed nothing by then: the run went on as the one without a limit.
    let mut options = sim::Options {
        capacity,
        workspaces: gpu.workspaces(),
        device_total: gpu.total_bytes,
        after_oom: sim::AfterOom::StopUnlessUnlimited,
        record_trace: keep.trace,
        record_timeline: keep.timeline,
        only_rank: rank,
        first_oom_ends_run: limit == Limit::GpuUntilOom,
        ..sim::Options::new(allocator)
    };
    let mut sim = sim::simulate(spec, &arch, &options);
    if let Some(refused) = &sim.refused {
        return Err(beyond_any_device("", spec, refused));
    }
    let mut oom = sim.oom.take();
    if let Some(OutOfMemory::Device(error)) = oom.as_mut().map(|o| &mut o.error) {
        // The simulator knows its capacity; PyTorch prints the device's total.
        error.device_total = gpu.total_bytes;
    }
    // The run without a limit makes the same requests: its sample there is the same allocation.
    let oom_sample = sim.timeline.as_ref().and_then(|t| t.oom_sample);
    if oom.is_some() && !sim.unlimited && limit == Limit::Gpu {
        // The limited run stopped being physical at the failure; report the demand.
        options.capacity = None;
        options.after_oom = sim::AfterOom::GoOn;
        sim = sim::simulate(spec, &arch, &options);
        if let Some(refused) = &sim.refused {
            return Err(beyond_any_device("", spec, refused));
        }
    }
    let breakdown = Component::ALL
        .iter()
        .map(|&c| (c, sim.peak.breakdown[c.index()]))
        .filter(|&(_, bytes)| bytes > 0)
        .collect();
    let assumptions = Assumptions::run(spec, gpu).with_model(spec, &arch);
    let estimate = Estimate {
        model: model.name,
        parallel: spec.parallel.clone(),
        params: sim.params,
        trainable_params: sim.trainable_params,
        weights_loaded_bytes: sim.weights_loaded,
        peak_allocated_bytes: sim.peak.allocated,
        peak_reserved_bytes: sim.peak_reserved,
        cuda_context_bytes: gpu.cuda_context_bytes,
        nccl_bytes: nccl,
        nccl_communicators,
        engine_bytes: sim.engine_bytes,
        host_bytes: sim.host_bytes,
        phases: sim.phases,
        breakdown,
        peak_phase: sim.peak.phase,
        peak_step: sim.peak.step,
        arch,
        gpu: gpu.clone(),
        capacity_bytes: capacity,
        oom,
        assumptions,
        worst_rank: sim.rank,
        stages: sim.stages.clone(),
        unlimited: sim.unlimited,
    };
    let timeline = sim.timeline.as_ref().map(|t| {
        let peak = (estimate.peak_step, estimate.peak_phase);
        Timeline::new(t, peak, estimate.oom.as_ref(), oom_sample)
    });
    Ok((estimate, sim.trace, timeline))
}

/// The error for a run that allocates what no device can hold (`refused`): its batch (at
/// `prefix`, `instances[0].` in a pipeline) is what to shrink.
pub(crate) fn beyond_any_device(prefix: &str, spec: &RunSpec, refused: &SimulatedOom) -> Error {
    let why = match refused.error {
        OutOfMemory::MoreThanOneExabyte { .. } => "PyTorch refuses a tensor of 1 EiB or more",
        OutOfMemory::Device(_) => "the simulated device's 4 EiB of addresses are spent",
    };
    Error::BeyondAnyDevice {
        field: format!("{prefix}batch_size"),
        value: spec.batch_size.to_string(),
        allowed: format!(
            "at seq_len {} the run allocates `{}` ({} bytes) in {} of step {}, where {why}; \
             use a smaller batch_size or seq_len",
            spec.seq_len, refused.tensor, refused.requested_bytes, refused.phase, refused.step
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::nccl_bytes;
    use crate::spec::RunSpec;

    fn nccl_mib(parallel: serde_json::Value) -> u64 {
        let spec = RunSpec::from_value(&serde_json::json!({
            "model": "llama-3.1-8b",
            "seq_len": 4096,
            "parallel": parallel,
        }))
        .expect("spec");
        nccl_bytes(spec.parallel.as_ref()) >> 20
    }

    /// One communicator for a one-dimensional group over the world, one per mesh dimension
    /// beside the default group's (bench/nccl-x4, call 3).
    #[test]
    fn nccl_is_charged_per_communicator_of_the_layout() {
        let fsdp = nccl_mib(serde_json::json!({"strategy": "fsdp", "world_size": 4}));
        let hsdp =
            nccl_mib(serde_json::json!({"strategy": "fsdp", "world_size": 4, "shard_size": 2}));
        let tp_alone = nccl_mib(serde_json::json!({
            "strategy": "none", "world_size": 4, "tp": 4, "sequence_parallel": true,
        }));
        let dp_tp = nccl_mib(serde_json::json!({
            "strategy": "fsdp", "world_size": 4, "tp": 2, "sequence_parallel": true,
        }));
        let pp = nccl_mib(serde_json::json!({
            "strategy": "none", "world_size": 2, "pp": 2, "microbatches": 2,
        }));
        assert_eq!(
            (fsdp, tp_alone, pp, hsdp, dp_tp),
            (992, 1386, 1440, 1964, 1964)
        );
    }
}
