//! A pipeline's estimate: its instances built in one process, its phases simulated for each
//! iteration, the peak over them, and what rollout engines and host copies add.

use std::path::Path;

use headroom_alloc::{AllocatorConfig, OutOfMemory};

use super::{Assumptions, Limit, Timeline, nccl_bytes};
use crate::arch::Architecture;
use crate::dtype::DType;
use crate::error::Result;
use crate::gpu::Gpu;
use crate::sim::harness::pipeline::{
    EngineDef, InstanceDef, PipelinePhase, PipelineSimulation, simulate_pipeline,
};
use crate::sim::{Component, SimulatedOom};
use crate::spec::{EngineSpec, Parallel, PipelineSpec, Precision, RunSpec};

/// Host-to-device (and back) bandwidth of `model.cpu()` / `model.cuda()` through pageable
/// memory: 18.6 GB moved per iteration took 4.8-7.1 s in the shared fixture's run on an H200
/// (bench/pipelines/README.md). A rough time, labelled as such.
pub const PAGEABLE_COPY_BYTES_PER_S: f64 = 3.0e9;

/// A pipeline's estimate on one GPU (per rank when instances are sharded).
#[derive(Clone, Debug)]
pub struct PipelineEstimate {
    pub phases: Vec<PipelinePhase>,
    pub peak_allocated_bytes: u64,
    pub peak_reserved_bytes: u64,
    /// The phase (name, iteration) of the allocated peak.
    pub peak_phase: (String, u32),
    /// What the allocated peak is made of, largest first.
    pub breakdown: Vec<(Component, u64)>,
    pub cuda_context_bytes: u64,
    /// NCCL's communicators when instances are sharded (see `estimate::nccl_bytes`).
    pub nccl_bytes: u64,
    /// Parameter bytes held on the host at most.
    pub host_bytes: u64,
    /// Parameter bytes copied between host and device per iteration, and a rough time for the
    /// pageable copies of `model.cpu()` / `.cuda()` (FSDP2 copies from pinned memory,
    /// overlapped with the pass: 0.1 s per pass measured against 0.04 s resident).
    pub transfer_bytes_per_iteration: u64,
    pub transfer_seconds_per_iteration: Option<f64>,
    pub gpu: Gpu,
    pub capacity_bytes: Option<u64>,
    /// Where the run ran out on `gpu`; the phases are then those of the run without a limit.
    pub oom: Option<SimulatedOom>,
    /// The most the process holds on the device in one phase: PyTorch's reserved bytes plus
    /// awake rollout engines (the CUDA context aside).
    pub peak_device_bytes: u64,
    pub engines: Vec<EngineSummary>,
    /// The versions followed and what is carried over or not modelled for this pipeline.
    pub assumptions: Assumptions,
}

/// A rollout engine's share of the device and the KV cache it leaves room for.
#[derive(Clone, Debug)]
pub struct EngineSummary {
    pub name: String,
    pub bytes: u64,
    pub weight_bytes: u64,
    /// Tokens of KV cache the budget holds at most, its activations aside.
    pub kv_tokens: u64,
}

impl PipelineEstimate {
    pub fn fits(&self) -> bool {
        match self.capacity_bytes {
            Some(_) => self.oom.is_none(),
            None => {
                self.peak_device_bytes + self.cuda_context_bytes + self.nccl_bytes
                    <= self.gpu.total_bytes
            }
        }
    }

    pub fn headroom_bytes(&self) -> i128 {
        self.gpu.total_bytes as i128
            - (self.peak_device_bytes + self.cuda_context_bytes + self.nccl_bytes) as i128
    }
}

/// What an engine holds: `gpu_memory_utilization` of the device's total (vLLM's budget,
/// from `cudaMemGetInfo`'s total), of which its weights in the spec's precision.
fn engine_def(e: &EngineSpec, spec: &RunSpec, arch: &Architecture, gpu: &Gpu) -> EngineDef {
    let weight_bytes = arch.param_count(spec.head())
        * DType::BF16.bytes()
        * if spec.precision == Precision::Fp32 {
            2
        } else {
            1
        };
    EngineDef {
        bytes: gpu.share_bytes(e.gpu_memory_utilization),
        weight_bytes,
        sleep_level: e.sleep_level,
        kv_bytes_per_token: 2 * arch.layers * arch.kv_heads * arch.head_dim * DType::BF16.bytes(),
    }
}

/// Resolve every instance (relative model paths from `spec_dir`) and simulate the pipeline's
/// iterations on `gpu`, at its capacity or without a limit.
pub fn estimate_pipeline(
    spec: &PipelineSpec,
    spec_dir: Option<&Path>,
    gpu: &Gpu,
    limit: Limit,
) -> Result<PipelineEstimate> {
    Ok(estimate_pipeline_with(spec, spec_dir, gpu, limit, false)?.0)
}

/// Like [`estimate_pipeline`], also returning the timeline (see
/// [`super::estimate_timeline`]); each phase of each iteration is a phase of it.
pub fn estimate_pipeline_timeline(
    spec: &PipelineSpec,
    spec_dir: Option<&Path>,
    gpu: &Gpu,
    limit: Limit,
) -> Result<(PipelineEstimate, Timeline)> {
    let (estimate, timeline) = estimate_pipeline_with(spec, spec_dir, gpu, limit, true)?;
    Ok((estimate, timeline.expect("kept")))
}

fn estimate_pipeline_with(
    spec: &PipelineSpec,
    spec_dir: Option<&Path>,
    gpu: &Gpu,
    limit: Limit,
    timeline: bool,
) -> Result<(PipelineEstimate, Option<Timeline>)> {
    let archs = spec
        .instances
        .iter()
        .map(|i| {
            i.spec.check_simulated().map_err(|e| e.prefixed(&i.at))?;
            Ok(i.spec.architecture(spec_dir, &i.at)?.1)
        })
        .collect::<Result<Vec<_>>>()?;
    spec.check_work(&archs.iter().map(|a| a.layers).collect::<Vec<_>>())?;
    let defs: Vec<InstanceDef> = spec
        .instances
        .iter()
        .zip(&archs)
        .map(|(i, arch)| InstanceDef {
            spec: &i.spec,
            arch,
            home: i.home,
            engine: i.engine.as_ref().map(|e| engine_def(e, &i.spec, arch, gpu)),
        })
        .collect();
    let allocator = AllocatorConfig {
        expandable_segments: spec
            .instances
            .iter()
            .any(|i| i.spec.allocator.expandable_segments),
        ..AllocatorConfig::default()
    };
    // One process: its sharded instances share the default process group's communicators.
    let nccl = spec
        .instances
        .iter()
        .map(|i| nccl_bytes(i.spec.parallel.as_ref()))
        .max()
        .unwrap_or(0);
    let capacity = (limit == Limit::Gpu).then(|| gpu.allocator_capacity().saturating_sub(nccl));
    // Where ranks differ (ZeRO partitions), the first and the last rank are simulated and the
    // one that needs more reported, as for a single run (`sim::simulate`).
    let ranks: &[Option<u64>] = if spec
        .instances
        .iter()
        .any(|i| i.spec.parallel.as_ref().is_some_and(Parallel::ranks_differ))
    {
        &[Some(0), None]
    } else {
        &[None]
    };
    let need = |s: &PipelineSimulation| {
        let reserved = s.phases.iter().map(|p| p.peak_reserved).max();
        (
            s.refused.is_some(),
            s.oom.is_some(),
            reserved,
            s.peak.allocated,
        )
    };
    let run = |capacity| {
        ranks
            .iter()
            .map(|&rank| {
                simulate_pipeline(
                    &defs,
                    &spec.phases,
                    spec.iterations,
                    allocator.clone(),
                    capacity,
                    gpu.workspaces(),
                    rank,
                    timeline,
                )
            })
            .max_by_key(need)
            .expect("at least one rank")
    };
    // A run that allocates what no device holds is refused; the instance named is the one
    // with the most tokens per step, the likeliest to shrink.
    let refuse = |refused: &SimulatedOom| {
        let instance = spec
            .instances
            .iter()
            .max_by_key(|x| x.spec.batch_size.saturating_mul(x.spec.seq_len))
            .expect("a pipeline has instances");
        super::beyond_any_device(&format!("{}.", instance.at), &instance.spec, refused)
    };
    let mut sim = run(capacity);
    if let Some(refused) = &sim.refused {
        return Err(refuse(refused));
    }
    let mut oom = sim.oom.take();
    if let Some(OutOfMemory::Device(error)) = oom.as_mut().map(|o| &mut o.error) {
        error.device_total = gpu.total_bytes;
    }
    let oom_sample = sim.timeline.as_ref().and_then(|t| t.oom_sample);
    if oom.is_some() {
        sim = run(None);
        if let Some(refused) = &sim.refused {
            return Err(refuse(refused));
        }
    }
    let peak = sim
        .phases
        .iter()
        .filter(|p| p.name != "load")
        .max_by_key(|p| p.peak_allocated)
        .expect("at least one iteration");
    let first: Vec<&PipelinePhase> = sim.phases.iter().filter(|p| p.iteration == 0).collect();
    let transfer = first.iter().map(|p| p.transfer_bytes).sum::<u64>();
    let pageable = first.iter().map(|p| p.pageable_bytes).sum::<u64>();
    let mut breakdown: Vec<(Component, u64)> = Component::ALL
        .iter()
        .map(|&c| (c, sim.peak.breakdown[c.index()]))
        .filter(|&(_, bytes)| bytes > 0)
        .collect();
    breakdown.sort_by_key(|&(_, bytes)| std::cmp::Reverse(bytes));
    let engines = spec
        .instances
        .iter()
        .zip(&defs)
        .filter_map(|(i, d)| {
            d.engine.map(|e| EngineSummary {
                name: i.name.clone(),
                bytes: e.bytes,
                weight_bytes: e.weight_bytes,
                kv_tokens: e.bytes.saturating_sub(e.weight_bytes) / e.kv_bytes_per_token.max(1),
            })
        })
        .collect();
    let timeline = sim.timeline.as_ref().map(|t| {
        let at = (peak.iteration, peak.name.as_str());
        Timeline::new(t, at, oom.as_ref(), oom_sample)
    });
    let estimate = PipelineEstimate {
        peak_device_bytes: sim
            .phases
            .iter()
            .map(|p| p.peak_reserved + p.engine_bytes)
            .max()
            .unwrap_or(0),
        engines,
        breakdown,
        peak_allocated_bytes: peak.peak_allocated,
        peak_phase: (peak.name.clone(), peak.iteration),
        peak_reserved_bytes: sim
            .phases
            .iter()
            .map(|p| p.peak_reserved)
            .max()
            .unwrap_or(0),
        host_bytes: sim.phases.iter().map(|p| p.host_bytes).max().unwrap_or(0),
        transfer_bytes_per_iteration: transfer,
        transfer_seconds_per_iteration: (pageable > 0)
            .then(|| pageable as f64 / PAGEABLE_COPY_BYTES_PER_S),
        cuda_context_bytes: gpu.cuda_context_bytes,
        nccl_bytes: nccl,
        gpu: gpu.clone(),
        capacity_bytes: capacity,
        oom,
        phases: sim.phases,
        assumptions: Assumptions::pipeline(spec, gpu),
    };
    Ok((estimate, timeline))
}
