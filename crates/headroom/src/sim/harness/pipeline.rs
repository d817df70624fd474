//! Several models in one process: a pipeline's instances are built in order into one tracer
//! and one caching allocator, then each iteration runs its phases. A phase runs passes of some
//! instances (a training step, or a no-grad log-prob pass), after moving others out of the
//! way; so where each instance lives shows in allocated and reserved bytes alike. The order
//! of operations is that of the measuring harness (`python/headroom_measure/pipeline.py`).
//!
//! Moves are `model.cpu()` / `model.cuda()`: parameters only (optimizer states stay). Around a
//! phase, the instances it offloads go out first, then `empty_cache()`, then the host-homed
//! instances it runs come in; after its passes those go back out, `empty_cache()`, and the
//! offloaded ones come back.

use headroom_alloc::{AllocatorConfig, CachingAllocator};

use super::instance::Instance;
use crate::arch::Architecture;
use crate::dtype::DType;
use crate::gpu::Workspaces;
use crate::sim::engine::component::Component;
use crate::sim::engine::memory::{Keep, Memory, OnOom, PeakRecord, RecordedTimeline, SimulatedOom};
use crate::sim::engine::tracer::{T, Tracer};
use crate::spec::{Home, Pass, PhaseDef, RunSpec};

/// A model the pipeline builds.
pub struct InstanceDef<'a> {
    pub spec: &'a RunSpec,
    pub arch: &'a Architecture,
    pub home: Home,
    /// A rollout engine: its memory is its own pool, outside the caching allocator.
    pub engine: Option<EngineDef>,
}

/// A rollout engine's device memory (see `crate::spec::EngineSpec`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct EngineDef {
    /// Held while awake: its `gpu_memory_utilization` share of the device.
    pub bytes: u64,
    pub weight_bytes: u64,
    pub sleep_level: Option<u8>,
    /// KV cache bytes per token (keys and values of every layer).
    pub kv_bytes_per_token: u64,
}

/// One phase of one iteration, as the harness reads it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PipelinePhase {
    pub iteration: u32,
    pub name: String,
    pub peak_allocated: u64,
    pub peak_reserved: u64,
    pub end_allocated: u64,
    pub end_reserved: u64,
    /// Parameter bytes copied between host and device during the phase (both ways).
    pub transfer_bytes: u64,
    /// Bytes that went through pageable `model.cpu()` / `.cuda()` copies (the slow kind).
    pub pageable_bytes: u64,
    /// Parameter bytes on the host at most during the phase (pageable copies: a model moved
    /// out is freed on the device once copied, and on the host once moved back), a sleeping
    /// engine's weights included.
    pub host_bytes: u64,
    /// Device bytes rollout engines hold during the phase, outside the caching allocator.
    pub engine_bytes: u64,
}

pub struct PipelineSimulation {
    pub phases: Vec<PipelinePhase>,
    /// The allocated peak after loading, and what it was made of.
    pub peak: PeakRecord,
    pub oom: Option<SimulatedOom>,
    /// An allocation that fails on any device; the run stopped there (see
    /// `Simulation::refused`).
    pub refused: Option<SimulatedOom>,
    /// The component timeline, when kept.
    pub timeline: Option<RecordedTimeline>,
}

/// Simulate `iterations` of `phases` over `instances` (the specs were validated by the caller)
/// as rank `rank` sees them (`None`: the last; see [`crate::spec::Parallel::ranks_differ`]),
/// on a device with these library workspaces, keeping the component timeline when `timeline`.
#[allow(clippy::too_many_arguments)]
pub fn simulate_pipeline(
    instances: &[InstanceDef],
    phases: &[PhaseDef],
    iterations: u32,
    allocator: AllocatorConfig,
    capacity: Option<u64>,
    workspaces: Workspaces,
    rank: Option<u64>,
    timeline: bool,
) -> PipelineSimulation {
    let keep = Keep {
        trace: false,
        timeline,
    };
    let mut t = Tracer::new(
        Memory::new(CachingAllocator::new(allocator, capacity), keep),
        workspaces,
    );
    t.mem.on_oom(OnOom::Stop);
    let zero = t.empty_as(1, DType::F32, Component::Inputs, "torch.zeros(1)");
    t.drop(zero);

    let mut out = Vec::new();
    let begin = |t: &mut Tracer, name: &str, iteration: u32| {
        t.mem.begin_measured_phase(phase_name(name), iteration);
    };
    let end = |t: &Tracer, name: &str, iteration, transfer: (u64, u64), host_bytes| {
        let stats = t.mem.allocator.stats();
        PipelinePhase {
            iteration,
            name: name.to_string(),
            peak_allocated: t.mem.phase_peak().peak_allocated,
            peak_reserved: stats.reserved_bytes.all.peak as u64,
            end_allocated: t.mem.allocated(),
            end_reserved: stats.reserved_bytes.all.current as u64,
            transfer_bytes: transfer.0,
            pageable_bytes: transfer.1,
            host_bytes,
            engine_bytes: 0,
        }
    };

    // load: every instance in order, then the inputs (one `input_ids` per batch shape).
    begin(&mut t, "load", 0);
    let mut engines = Engines {
        defs: instances.iter().map(|d| d.engine).collect(),
        awake: vec![false; instances.len()],
        capacity,
    };
    let mut models: Vec<Option<Instance>> = Vec::new();
    for (i, d) in instances.iter().enumerate() {
        if d.engine.is_some() {
            // Created awake; one that sleeps is put to sleep at once, so the trainer can load.
            engines.wake(&mut t, i);
            if d.engine.is_some_and(|e| e.sleep_level.is_some()) {
                engines.sleep(&mut t, i);
            }
            models.push(None);
        } else {
            models.push(Some(Instance::build(&mut t, d.spec, d.arch, d.home, rank)));
        }
    }
    let mut inputs: Vec<((u64, u64), T)> = Vec::new();
    for m in models.iter().flatten() {
        let shape = (m.batch.b, m.batch.s);
        if !inputs.iter().any(|(s, _)| *s == shape) {
            let ids = t.empty_as(m.batch.n(), DType::I64, Component::Inputs, "input_ids");
            inputs.push((shape, ids));
        }
    }
    let host = |t: &Tracer, models: &[Option<Instance>], engines: &Engines| {
        models
            .iter()
            .flatten()
            .map(|m| m.host_bytes(t))
            .sum::<u64>()
            + engines.host_bytes()
    };
    let mut record = end(&t, "load", 0, (0, 0), host(&t, &models, &engines));
    record.engine_bytes = engines.device_bytes();
    out.push(record);

    'iterations: for iteration in 0..iterations {
        for phase in phases {
            if t.mem.stopped() {
                break 'iterations;
            }
            // Between phases, engines the next one does not run go to sleep, then those it
            // runs wake up (a failure to wake is the next phase's).
            t.mem.start_phase(phase_name(&phase.name), iteration);
            for i in 0..instances.len() {
                let runs = phase.passes.iter().any(|p| p.instance == i);
                if !runs && engines.sleeps(i) {
                    engines.sleep(&mut t, i);
                }
            }
            for pass in &phase.passes {
                if engines.defs[pass.instance].is_some() {
                    engines.wake(&mut t, pass.instance);
                }
            }
            begin(&mut t, &phase.name, iteration);
            let mut pageable = 0;
            let mut streamed = 0;
            let mut host_peak = host(&t, &models, &engines);
            let mut evicted = Vec::new();
            for &i in &phase.offload {
                let Some(m) = &models[i] else { continue };
                if m.placed().into_iter().any(|p| t.is_materialized(p)) {
                    pageable += m.to_cpu(&mut t);
                    evicted.push(i);
                }
            }
            let mut states_out = Vec::new();
            for &i in &phase.offload_optimizer {
                let Some(m) = &models[i] else { continue };
                let moved = m.optimizer_to_cpu(&mut t);
                if moved > 0 {
                    pageable += moved;
                    states_out.push(i);
                }
            }
            // The evicted and the host-homed models are all on the host now.
            host_peak = host_peak
                .max(host(&t, &models, &engines) + optimizer_host(&t, &models, &states_out));
            if !evicted.is_empty() || !states_out.is_empty() {
                t.mem.allocator.empty_cache();
            }
            let mut brought = Vec::new();
            for pass in &phase.passes {
                let i = pass.instance;
                let Some(m) = &models[i] else { continue };
                if instances[i].home == Home::Cpu
                    && !m.model.strategy.borrow().streams_from_host()
                    && !brought.contains(&i)
                {
                    pageable += m.to_gpu(&mut t);
                    brought.push(i);
                }
            }
            if t.mem.keeps_timeline() {
                // What the instances this phase does not run hold through it, for the picture.
                let idle = models
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| !phase.passes.iter().any(|p| p.instance == *i))
                    .filter_map(|(_, m)| m.as_ref())
                    .flat_map(|m| {
                        let params = m.placed().into_iter().map(|p| t.param(p));
                        params.chain(m.optimizer.tensors()).collect::<Vec<_>>()
                    });
                let idle = t.live_by_component(idle);
                t.mem.set_idle(idle);
            }
            for pass in &phase.passes {
                // An engine generates in its own memory.
                let Some(m) = &mut models[pass.instance] else {
                    continue;
                };
                let shape = (m.batch.b, m.batch.s);
                let ids = inputs
                    .iter()
                    .find(|(s, _)| *s == shape)
                    .expect("inputs of every shape")
                    .1;
                for _ in 0..pass.repeat {
                    streamed += m.streamed_bytes(&t);
                    match pass.pass {
                        Pass::Train => m.train_step(&mut t, ids),
                        Pass::Forward => m.logprob_pass(&mut t, ids),
                        Pass::Generate { new_tokens } => m.generate_pass(&mut t, ids, new_tokens),
                    }
                    if t.mem.stopped() {
                        break;
                    }
                }
            }
            for &i in &brought {
                pageable += models[i].as_ref().map_or(0, |m| m.to_cpu(&mut t));
            }
            if !brought.is_empty() || !evicted.is_empty() || !states_out.is_empty() {
                t.mem.allocator.empty_cache();
            }
            for &i in &evicted {
                pageable += models[i].as_ref().map_or(0, |m| m.to_gpu(&mut t));
            }
            for &i in &states_out {
                pageable += models[i].as_ref().map_or(0, |m| m.optimizer_to_gpu(&mut t));
            }
            let transfer = (pageable + streamed, pageable);
            let mut record = end(&t, &phase.name, iteration, transfer, host_peak);
            record.engine_bytes = engines.device_bytes();
            out.push(record);
        }
    }
    drop(models);
    PipelineSimulation {
        phases: out,
        peak: t.mem.peak().clone(),
        oom: t.mem.oom().cloned(),
        refused: t.mem.refused().cloned(),
        timeline: t.mem.take_timeline(),
    }
}

/// Optimizer-state bytes of the instances `moved` to the host.
fn optimizer_host(t: &Tracer, models: &[Option<Instance>], moved: &[usize]) -> u64 {
    moved
        .iter()
        .filter_map(|&i| models[i].as_ref())
        .map(|m| m.optimizer.tensors().map(|s| t.bytes(s)).sum::<u64>())
        .sum()
}

/// The rollout engines of a pipeline and whether each is awake; the caching allocator gets the
/// device's capacity less what awake engines hold.
struct Engines {
    defs: Vec<Option<EngineDef>>,
    awake: Vec<bool>,
    /// What the caching allocator may hold with every engine asleep (`None`: no limit).
    capacity: Option<u64>,
}

impl Engines {
    fn device_bytes(&self) -> u64 {
        self.defs
            .iter()
            .zip(&self.awake)
            .filter(|(_, a)| **a)
            .filter_map(|(d, _)| d.map(|e| e.bytes))
            .sum()
    }

    /// Weights of engines asleep at level 1 (kept in host memory).
    fn host_bytes(&self) -> u64 {
        self.defs
            .iter()
            .zip(&self.awake)
            .filter(|(_, a)| !**a)
            .filter_map(|(d, _)| *d)
            .filter(|e| e.sleep_level == Some(1))
            .map(|e| e.weight_bytes)
            .sum()
    }

    fn sleeps(&self, i: usize) -> bool {
        self.awake[i] && self.defs[i].is_some_and(|e| e.sleep_level.is_some())
    }

    fn limit(&self, t: &mut Tracer) {
        if let Some(capacity) = self.capacity {
            let limit = capacity.saturating_sub(self.device_bytes());
            t.mem.allocator.set_capacity(Some(limit));
        }
    }

    fn sleep(&mut self, t: &mut Tracer, i: usize) {
        self.awake[i] = false;
        self.limit(t);
    }

    /// `wake_up()`, after `torch.cuda.empty_cache()` as the frameworks call it: the engine's
    /// memory must fit beside what the caching allocator still holds.
    fn wake(&mut self, t: &mut Tracer, i: usize) {
        if self.awake[i] {
            return;
        }
        self.awake[i] = true;
        t.mem.allocator.empty_cache();
        self.limit(t);
        if let Some(capacity) = self.capacity {
            let engine = self.defs[i].map_or(0, |e| e.bytes);
            t.mem.outside_allocation(
                engine,
                capacity,
                "rollout engine wake_up (weights + KV cache)",
            );
        }
    }
}

/// Phase names as the memory record keeps them (`&'static str`): the pipeline's few names are
/// interned once per process.
fn phase_name(name: &str) -> &'static str {
    use std::collections::HashSet;
    use std::sync::{Mutex, OnceLock};
    static NAMES: OnceLock<Mutex<HashSet<&'static str>>> = OnceLock::new();
    let mut names = NAMES
        .get_or_init(Default::default)
        .lock()
        .expect("no panic while interning");
    match names.get(name) {
        Some(&n) => n,
        None => {
            let n: &'static str = Box::leak(name.to_string().into_boxed_str());
            names.insert(n);
            n
        }
    }
}
