//! A trace through the caching-allocator simulator. Storages are allocated and freed as
//! recorded; each kernel marker becomes the buffers the native simulator gives that kernel,
//! sized by the same code:
//! - `gemm`: the cuBLAS workspace at a thread's first GEMM and the cuBLASLt one at its first
//!   with a bias epilogue, kept for the life of the process (`Tracer::ensure_cublas_workspace`).
//!   autograd's device thread has workspaces of its own; a GEMM the tracer did not place on a
//!   thread runs on that one in backward phases, as the native simulator's do;
//! - `reduce`: the staging buffer and semaphores of `OuterReduction`, allocated then freed
//!   (`Tracer::reduction_staging`);
//! - `attention_backward`: the kernel's own buffers in the order `Bwd::SdpaFlash`,
//!   `Bwd::SdpaCudnn` and `Bwd::SdpaEfficient` allocate and free them in `backward.rs`.
//!
//! A storage `record_stream` marked as used on another stream than its own is freed as
//! `CUDACachingAllocator.cpp` frees it: `free` records an event on each such stream
//! (`insert_events`) and the block stays out of the pools until `process_events`, at the start
//! of the next `malloc`, sees them complete, or `empty_cache` synchronizes. The replay takes
//! them complete at that next `malloc`: the GPU has caught up with work queued before the
//! free, which is what the native ZeRO-3 and FSDP1 strategies assume when they drop a block
//! used on another stream at once; nothing can tell the two apart before the next request.

use headroom_alloc::{AllocatorConfig, BlockId, CachingAllocator, OutOfMemory};

use super::{AttentionBackward, AttentionKernel, Event, StorageKind, Thread, Trace};
use crate::error::{Error, Result};
use crate::estimate::Limit;
use crate::gpu::{Gpu, Workspaces};
use crate::sim::engine::ops::OuterReduction;
use crate::sim::model::attention::QueryShape;
use crate::sim::model::load::caching_allocator_warmup_bytes;

/// The peaks of one phase, as `max_memory_allocated()` and `max_memory_reserved()` read them
/// after `reset_peak_memory_stats()` at its start.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TracePhasePeak {
    pub name: String,
    /// A pipeline's iteration.
    pub iteration: Option<u32>,
    pub peak_allocated: u64,
    pub peak_reserved: u64,
    /// Device bytes the awake rollout engines hold at its end, outside the caching allocator.
    pub engine_bytes: u64,
}

/// The first allocation the GPU could not serve.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceOom {
    /// Index of the trace event that asked for it.
    pub event: usize,
    pub phase: String,
    /// A pipeline's iteration.
    pub iteration: Option<u32>,
    /// The storage (its kind, op and module) or the kernel buffer.
    pub tensor: String,
    pub requested_bytes: u64,
    /// Allocated and reserved bytes then, after the allocator freed its cache to retry.
    pub allocated_bytes: u64,
    pub reserved_bytes: u64,
    /// The simulator's `torch.OutOfMemoryError`; its `Display` is PyTorch 2.11's message.
    pub error: OutOfMemory,
}

/// A trace replayed on a GPU.
#[derive(Clone, Debug)]
pub struct TraceEstimate {
    /// The largest allocated total over the steps (the load is a phase of its own, as in
    /// `estimate` and `measure`).
    pub peak_allocated_bytes: u64,
    /// The largest reserved total over the steps.
    pub peak_reserved_bytes: u64,
    /// The most held on the device in one phase (not the load): reserved bytes plus awake
    /// rollout engines.
    pub peak_device_bytes: u64,
    /// The phase of the peak allocated total.
    pub peak_phase: String,
    /// Its iteration, in a pipeline's trace.
    pub peak_iteration: Option<u32>,
    pub phases: Vec<TracePhasePeak>,
    /// What the allocated bytes were made of at the peak, by storage kind, then `workspaces`
    /// (kernel buffers) and `allocator_rounding`; sums to `peak_allocated_bytes`.
    pub breakdown: Vec<(&'static str, u64)>,
    /// Reserved but unallocated bytes at the peak.
    pub fragmentation_bytes: u64,
    pub cuda_context_bytes: u64,
    /// Allocations and frees the allocator served, kernel buffers included.
    pub timeline_events: u64,
    pub gpu: Gpu,
    /// What the allocator could obtain; `None`: no limit (the numbers are the run's demand).
    pub capacity_bytes: Option<u64>,
    /// Where the run ran out on `gpu`; the numbers above are then those without a limit.
    pub oom: Option<TraceOom>,
}

impl TraceEstimate {
    /// Device memory the run needs: reserved, awake rollout engines and the CUDA context.
    pub fn device_bytes(&self) -> u64 {
        self.peak_device_bytes + self.cuda_context_bytes
    }

    /// As [`crate::estimate::Estimate::fits`]: at the GPU's capacity, whether it did not run
    /// out; without a limit, whether its demand is below the GPU's total.
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

/// Replays `trace` under `config` on `gpu`: at its capacity, where the allocator frees its
/// cache and retries before running out as PyTorch does, or without a limit. After running
/// out, the numbers are those of the same replay without a limit (what the run would need).
pub fn estimate(
    trace: &Trace,
    gpu: &Gpu,
    limit: Limit,
    config: &AllocatorConfig,
) -> Result<TraceEstimate> {
    let capacity = (limit != Limit::None).then(|| gpu.allocator_capacity());
    let mut outcome = Replay::new(trace, gpu, config, capacity).run()?;
    if outcome.oom.is_some() && outcome.limit_acted && limit == Limit::Gpu {
        let oom = outcome.oom.take();
        outcome = Replay::new(trace, gpu, config, None).run()?;
        outcome.oom = oom;
    }
    let breakdown = (0..HOLDERS)
        .map(|h| (holder_key(h), outcome.peak.breakdown[h]))
        .filter(|&(_, bytes)| bytes > 0)
        .collect();
    let steps = || outcome.phases.iter().filter(|p| p.name != LOAD);
    Ok(TraceEstimate {
        peak_device_bytes: steps()
            .map(|p| p.peak_reserved + p.engine_bytes)
            .max()
            .unwrap_or(0),
        peak_allocated_bytes: outcome.peak.allocated,
        peak_reserved_bytes: steps().map(|p| p.peak_reserved).max().unwrap_or(0),
        peak_phase: outcome
            .peak
            .phase
            .map_or(String::new(), |p| outcome.phases[p].name.clone()),
        peak_iteration: outcome.peak.phase.and_then(|p| outcome.phases[p].iteration),
        breakdown,
        fragmentation_bytes: outcome.peak.reserved - outcome.peak.allocated,
        cuda_context_bytes: gpu.cuda_context_bytes,
        timeline_events: outcome.timeline_events,
        gpu: gpu.clone(),
        capacity_bytes: capacity,
        oom: outcome.oom,
        phases: outcome.phases,
    })
}

/// The phase whose peak does not count (the model being built).
const LOAD: &str = "load";

/// What a rollout engine that cannot wake asks for, named as the native simulator names it.
const ENGINE_WAKE: &str = "rollout engine wake_up (weights + KV cache)";

/// What bytes are charged to: a storage kind, by its index in [`StorageKind::ALL`], then
/// kernel buffers and the allocator's rounding.
const WORKSPACES: usize = StorageKind::ALL.len();
const ROUNDING: usize = WORKSPACES + 1;
const HOLDERS: usize = ROUNDING + 1;

fn holder_key(holder: usize) -> &'static str {
    match holder {
        WORKSPACES => "workspaces",
        ROUNDING => "allocator_rounding",
        kind => StorageKind::ALL[kind].key(),
    }
}

/// The op of a softmax's gradient. CUDA's kernel (`softmax_backward_cuda_out`) computes
/// `tmp = grad * output` into a tensor of the gradient's size, after the result is allocated,
/// and frees it before returning; the CPU kernel the tracer runs makes no such tensor. Both
/// have the result's bytes: the tracer's softmax gradients are never `half_to_float` (the CPU
/// runs a half-precision softmax with an fp32 `dtype` on an fp32 copy).
const SOFTMAX_BACKWARD: &str = "aten._softmax_backward_data.default";

fn holder_of(kind: StorageKind) -> usize {
    StorageKind::ALL
        .iter()
        .position(|&k| k == kind)
        .expect("ALL lists every kind")
}

/// What an allocation is for, named in an out-of-memory verdict.
#[derive(Clone, Copy)]
enum Request {
    Storage(u32),
    Kernel(&'static str),
}

/// A live block and what it is charged to.
#[derive(Clone, Copy)]
struct Live {
    block: BlockId,
    bytes: u64,
    holder: usize,
    /// `record_stream` named a stream other than the one it was allocated on.
    used_elsewhere: bool,
}

#[derive(Default)]
struct Peak {
    allocated: u64,
    /// Reserved bytes at that moment.
    reserved: u64,
    breakdown: [u64; HOLDERS],
    /// Index of its phase.
    phase: Option<usize>,
}

struct Outcome {
    phases: Vec<TracePhasePeak>,
    peak: Peak,
    oom: Option<TraceOom>,
    limit_acted: bool,
    timeline_events: u64,
}

struct Replay<'t> {
    trace: &'t Trace,
    workspaces: Workspaces,
    device_total: u64,
    allocator: CachingAllocator,
    /// The block of each live storage.
    storages: Vec<Option<Live>>,
    /// Blocks freed while other streams used them, waiting for `process_events`.
    pending: Vec<BlockId>,
    live: [u64; HOLDERS],
    peak: Peak,
    /// Whether the main thread (0) and autograd's device thread (1) have their cuBLAS and
    /// cuBLASLt workspaces.
    cublas: [bool; 2],
    cublaslt: [bool; 2],
    phase: usize,
    event: usize,
    oom: Option<TraceOom>,
    timeline_events: u64,
    /// What each rollout engine holds while awake, and whether it is.
    engine_bytes: Vec<u64>,
    awake: Vec<bool>,
    /// What the allocator may obtain with every engine asleep (`None`: no limit).
    capacity: Option<u64>,
}

impl<'t> Replay<'t> {
    fn new(trace: &'t Trace, gpu: &Gpu, config: &AllocatorConfig, capacity: Option<u64>) -> Self {
        Replay {
            trace,
            workspaces: gpu.workspaces(),
            device_total: gpu.total_bytes,
            allocator: CachingAllocator::new(config.clone(), capacity),
            storages: vec![None; trace.storages.len()],
            pending: Vec::new(),
            live: [0; HOLDERS],
            peak: Peak::default(),
            cublas: [false; 2],
            cublaslt: [false; 2],
            phase: 0,
            event: 0,
            oom: None,
            timeline_events: 0,
            engine_bytes: trace
                .engines
                .iter()
                .map(|e| gpu.share_bytes(e.gpu_memory_utilization))
                .collect(),
            awake: vec![false; trace.engines.len()],
            capacity,
        }
    }

    fn run(mut self) -> Result<Outcome> {
        let trace = self.trace;
        let mut phases = Vec::with_capacity(trace.phases.len());
        for (p, phase) in trace.phases.iter().enumerate() {
            let end = trace
                .phases
                .get(p + 1)
                .map_or(trace.events.len(), |next| next.event);
            self.phase = p;
            // The rollout engines a phase begins by waking or putting to sleep switch before its
            // peak counters are reset.
            let events = &trace.events[phase.event..end];
            let switches = events
                .iter()
                .take_while(|e| matches!(e, Event::Engine { .. }))
                .count();
            for (i, event) in events.iter().enumerate() {
                if i == switches {
                    self.allocator.reset_peak_stats();
                }
                self.event = phase.event + i;
                self.apply(event)?;
            }
            if switches == events.len() {
                self.allocator.reset_peak_stats();
            }
            let stats = self.allocator.stats();
            phases.push(TracePhasePeak {
                name: phase.name.clone(),
                iteration: phase.iteration,
                peak_allocated: stats.allocated_bytes.all.peak as u64,
                peak_reserved: stats.reserved_bytes.all.peak as u64,
                engine_bytes: self.awake_engine_bytes(),
            });
        }
        Ok(Outcome {
            phases,
            peak: self.peak,
            oom: self.oom,
            limit_acted: self.allocator.limit_has_acted(),
            timeline_events: self.timeline_events,
        })
    }

    fn apply(&mut self, event: &Event) -> Result<()> {
        match *event {
            Event::Alloc(id) => {
                let storage = &self.trace.storages[id as usize];
                if storage.kind != StorageKind::Host {
                    let (bytes, holder) = (storage.bytes, holder_of(storage.kind));
                    self.storages[id as usize] =
                        self.malloc(bytes, storage.stream, holder, Request::Storage(id))?;
                    if storage.op == SOFTMAX_BACKWARD {
                        let scratch = self.malloc(
                            bytes,
                            storage.stream,
                            holder_of(StorageKind::Temporary),
                            Request::Kernel("softmax backward: grad * output"),
                        )?;
                        self.free(scratch);
                    }
                }
            }
            Event::Free(id) => {
                let live = self.storages[id as usize].take();
                self.free(live);
            }
            Event::RecordStream { storage, stream } => {
                let own = self.trace.storages[storage as usize].stream;
                if let Some(live) = &mut self.storages[storage as usize] {
                    live.used_elsewhere |= stream != own;
                }
            }
            Event::EmptyCache => {
                self.pending.clear();
                self.allocator.empty_cache();
            }
            Event::CachingAllocatorWarmup { weight_bytes } => {
                let stats = self.allocator.stats();
                let unused = stats.reserved_bytes.all.current - stats.allocated_bytes.all.current;
                let bytes = caching_allocator_warmup_bytes(weight_bytes, unused.max(0) as u64);
                let holder = holder_of(StorageKind::Parameter);
                let warmup = self.malloc(
                    bytes,
                    0,
                    holder,
                    Request::Kernel("caching_allocator_warmup"),
                )?;
                self.free(warmup);
            }
            Event::Gemm {
                bias_epilogue,
                thread,
            } => self.gemm(bias_epilogue, thread)?,
            Event::Reduce { outputs, inputs } => self.reduce(outputs, inputs)?,
            Event::AttentionBackward(ref a) => self.attention_backward(a)?,
            Event::Engine { engine, awake } => self.engine(engine as usize, awake),
        }
        Ok(())
    }

    fn awake_engine_bytes(&self) -> u64 {
        let awake = self.engine_bytes.iter().zip(&self.awake);
        awake.filter(|(_, a)| **a).map(|(b, _)| b).sum()
    }

    /// A rollout engine wakes (after `torch.cuda.empty_cache()`, as the frameworks call it, its
    /// share must fit beside what the allocator still reserves) or goes to sleep; the allocator
    /// may obtain the capacity less what awake engines hold, as in the native simulator.
    fn engine(&mut self, engine: usize, awake: bool) {
        if self.awake[engine] == awake {
            return;
        }
        self.awake[engine] = awake;
        if awake {
            self.allocator.empty_cache();
        }
        let (Some(capacity), None) = (self.capacity, &self.oom) else {
            return;
        };
        let held = self.awake_engine_bytes();
        self.allocator
            .set_capacity(Some(capacity.saturating_sub(held)));
        let reserved = self.allocator.stats().reserved_bytes.all.current as u64;
        let bytes = self.engine_bytes[engine];
        if awake && reserved + held > capacity {
            let stats = self.allocator.stats();
            let error = OutOfMemory::Device(headroom_alloc::DeviceOutOfMemory {
                requested: bytes,
                alloc_size: bytes,
                device: 0,
                device_total: capacity,
                device_free: capacity.saturating_sub(reserved + held - bytes),
                allocated_bytes: stats.allocated_bytes.all.current as u64,
                reserved_bytes: reserved,
            });
            self.oom = Some(self.out_of_memory(bytes, Request::Kernel(ENGINE_WAKE), error));
            self.allocator.set_capacity(None);
        }
    }

    /// Index of the thread into `cublas` and `cublaslt`: the one given, or autograd's in the
    /// backward phases.
    fn thread(&self, given: Option<Thread>) -> usize {
        match given {
            Some(Thread::Main) => 0,
            Some(Thread::Autograd) => 1,
            None => usize::from(self.trace.phases[self.phase].name.ends_with("backward")),
        }
    }

    fn gemm(&mut self, bias_epilogue: bool, thread: Option<Thread>) -> Result<()> {
        let thread = self.thread(thread);
        if !self.cublas[thread] {
            self.cublas[thread] = true;
            let bytes = self.workspaces.cublas_bytes;
            self.malloc(bytes, 0, WORKSPACES, Request::Kernel("cuBLAS workspace"))?;
        }
        if bias_epilogue && !self.cublaslt[thread] {
            self.cublaslt[thread] = true;
            let bytes = self.workspaces.cublaslt_bytes;
            self.malloc(bytes, 0, WORKSPACES, Request::Kernel("cuBLASLt workspace"))?;
        }
        Ok(())
    }

    fn reduce(&mut self, outputs: u64, inputs: u64) -> Result<()> {
        let multiprocessors = self.workspaces.multiprocessors;
        let Some(config) = OuterReduction::config(outputs, inputs, multiprocessors, 4) else {
            return Ok(());
        };
        let buffer = self.kernel_buffer(config.buffer_bytes, "reduction staging buffer")?;
        let semaphores = self.kernel_buffer(config.semaphore_bytes, "reduction semaphores")?;
        self.free(buffer);
        self.free(semaphores);
        Ok(())
    }

    fn attention_backward(&mut self, a: &AttentionBackward) -> Result<()> {
        let shape = QueryShape {
            batch: a.batch,
            heads: a.heads,
            seq: a.seq,
            head_dim: a.head_dim,
        };
        match a.kernel {
            AttentionKernel::Flash | AttentionKernel::Cudnn => {
                let bytes = shape.fused_backward_workspace_over(a.key_seq, a.gqa, a.dtype_bytes);
                let workspace = self.kernel_buffer(bytes, "attention backward workspace")?;
                self.free(workspace);
            }
            AttentionKernel::Efficient => {
                let sizes = shape.efficient_backward();
                let accumulator =
                    self.kernel_buffer(sizes.accumulator, "efficient attention: fp32 accumulator")?;
                let delta = self.kernel_buffer(sizes.delta, "efficient attention: delta")?;
                let lse =
                    self.kernel_buffer(sizes.delta, "efficient attention: logsumexp.contiguous()")?;
                self.free(lse);
                self.free(accumulator);
                let workspace =
                    self.kernel_buffer(sizes.workspace, "efficient attention backward workspace")?;
                self.free(delta);
                self.free(workspace);
            }
        }
        Ok(())
    }

    fn kernel_buffer(&mut self, bytes: u64, label: &'static str) -> Result<Option<Live>> {
        self.malloc(bytes, 0, WORKSPACES, Request::Kernel(label))
    }

    /// Serves a request on `stream`'s pools; nothing for 0 bytes, which PyTorch never asks the
    /// allocator for. At the first one the GPU cannot serve, records where and lifts the limit.
    fn malloc(
        &mut self,
        bytes: u64,
        stream: u32,
        holder: usize,
        request: Request,
    ) -> Result<Option<Live>> {
        if bytes == 0 {
            return Ok(None);
        }
        self.process_events();
        let block = match self.allocator.malloc(bytes, stream) {
            Ok(block) => block,
            Err(error) => {
                if self.oom.is_none() {
                    self.oom = Some(self.out_of_memory(bytes, request, error));
                }
                self.allocator.set_capacity(None);
                self.allocator
                    .malloc(bytes, stream)
                    .map_err(|error| self.beyond_any_device(bytes, request, &error))?
            }
        };
        let size = self.allocator.block_size(block);
        self.live[holder] += bytes;
        self.live[ROUNDING] += size - bytes;
        self.timeline_events += 1;
        let allocated = self.allocator.stats().allocated_bytes.all.current as u64;
        if allocated > self.peak.allocated && self.trace.phases[self.phase].name != LOAD {
            self.peak = Peak {
                allocated,
                reserved: self.allocator.stats().reserved_bytes.all.current as u64,
                breakdown: self.live,
                phase: Some(self.phase),
            };
        }
        Ok(Some(Live {
            block,
            bytes,
            holder,
            used_elsewhere: false,
        }))
    }

    /// `process_events`: the blocks freed while other streams used them go back to their
    /// pools (the module doc says when their events complete).
    fn process_events(&mut self) {
        for block in std::mem::take(&mut self.pending) {
            self.allocator.complete_free(block);
        }
    }

    fn free(&mut self, live: Option<Live>) {
        let Some(live) = live else {
            return;
        };
        let size = self.allocator.block_size(live.block);
        if live.used_elsewhere {
            self.allocator.free_requested(live.block);
            self.pending.push(live.block);
        } else {
            self.allocator.free(live.block);
        }
        self.live[live.holder] -= live.bytes;
        self.live[ROUNDING] -= size - live.bytes;
        self.timeline_events += 1;
    }

    fn describe(&self, request: Request) -> String {
        match request {
            Request::Kernel(label) => label.to_string(),
            Request::Storage(id) => {
                let s = &self.trace.storages[id as usize];
                let module = if s.module.is_empty() {
                    "outside any module".to_string()
                } else {
                    format!("in {}", s.module)
                };
                format!("storage {id}: {} from {} {module}", s.kind.key(), s.op)
            }
        }
    }

    fn out_of_memory(&self, bytes: u64, request: Request, mut error: OutOfMemory) -> TraceOom {
        let stats = self.allocator.stats();
        let (mut allocated, mut reserved) = (
            stats.allocated_bytes.all.current as u64,
            stats.reserved_bytes.all.current as u64,
        );
        if let OutOfMemory::Device(device) = &mut error {
            // The simulator knows its capacity; PyTorch prints the device's total.
            device.device_total = self.device_total;
            (allocated, reserved) = (device.allocated_bytes, device.reserved_bytes);
        }
        TraceOom {
            event: self.event,
            phase: self.trace.phases[self.phase].name.clone(),
            iteration: self.trace.phases[self.phase].iteration,
            tensor: self.describe(request),
            requested_bytes: bytes,
            allocated_bytes: allocated,
            reserved_bytes: reserved,
            error,
        }
    }

    /// A request no device serves: 1 EiB or more, or past a 64-bit address space.
    fn beyond_any_device(&self, bytes: u64, request: Request, error: &OutOfMemory) -> Error {
        let field = match request {
            Request::Storage(id) => format!("storages[{id}].bytes"),
            Request::Kernel(_) => format!("events[{}]", self.event),
        };
        Error::BeyondAnyDevice {
            field,
            value: bytes.to_string(),
            allowed: format!(
                "{} at events[{}] cannot be allocated on any device: {error}",
                self.describe(request),
                self.event
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use serde_json::{Value, json};

    use super::*;
    use crate::gpu;

    const MIB: u64 = 1 << 20;

    /// `round_size` under the default config.
    fn round(bytes: u64) -> u64 {
        headroom_alloc::round_size(&AllocatorConfig::default(), bytes)
    }

    fn h100() -> Gpu {
        gpu::find("h100-80gb").expect("a catalog GPU")
    }

    /// A trace of `storages` (bytes, kind) whose `events` run in one step phase after an
    /// empty load, or in the phases given as (name, first event).
    fn trace(storages: &[(u64, &str)], events: Value, phases: &[(&str, usize)]) -> Trace {
        let phases: Vec<Value> = if phases.is_empty() {
            vec![
                json!({"name": "load", "event": 0}),
                json!({"name": "step 1 forward", "event": 0}),
            ]
        } else {
            phases
                .iter()
                .map(|(name, event)| json!({"name": name, "event": event}))
                .collect()
        };
        let storages: Vec<Value> = storages
            .iter()
            .map(|(bytes, kind)| json!({"bytes": bytes, "kind": kind, "op": "aten.empty", "module": ""}))
            .collect();
        let doc = json!({
            "format": "headroom-trace", "version": 1, "spec": {"model": "tiny"}, "env": {},
            "phases": phases, "storages": storages, "events": events,
        });
        crate::trace::from_bytes(doc.to_string().as_bytes(), Path::new("t.json"))
            .expect("a valid trace")
    }

    fn replay(trace: &Trace, gpu: &Gpu, limit: Limit) -> TraceEstimate {
        estimate(trace, gpu, limit, &AllocatorConfig::default()).expect("replayed")
    }

    fn breakdown(est: &TraceEstimate, key: &str) -> u64 {
        est.breakdown
            .iter()
            .find(|(k, _)| *k == key)
            .map_or(0, |&(_, bytes)| bytes)
    }

    #[test]
    fn a_thread_takes_its_cublas_workspaces_once_and_keeps_them() {
        let ws = h100().workspaces();
        let t = trace(
            &[],
            json!([
                ["gemm", false],
                ["gemm", true],
                ["gemm", true],
                ["gemm", false]
            ]),
            &[],
        );
        let est = replay(&t, &h100(), Limit::None);
        assert_eq!(
            breakdown(&est, "workspaces"),
            ws.cublas_bytes + ws.cublaslt_bytes
        );
        assert_eq!(
            est.peak_allocated_bytes,
            ws.cublas_bytes + ws.cublaslt_bytes
        );
        assert_eq!(est.timeline_events, 2);
        // Backward runs on autograd's thread, whose handle gets a workspace of its own.
        let t = trace(
            &[],
            json!([["gemm", false], ["gemm", false]]),
            &[("load", 0), ("step 1 forward", 0), ("step 1 backward", 1)],
        );
        let est = replay(&t, &h100(), Limit::None);
        assert_eq!(est.peak_allocated_bytes, 2 * ws.cublas_bytes);
        assert_eq!(est.peak_phase, "step 1 backward");
        // A thread the tracer names wins over the phase.
        let t = trace(
            &[],
            json!([["gemm", false, 0], ["gemm", false, 0], ["gemm", false, 1]]),
            &[("load", 0), ("step 1 forward", 0), ("step 1 backward", 1)],
        );
        let est = replay(&t, &h100(), Limit::None);
        assert_eq!(est.peak_allocated_bytes, 2 * ws.cublas_bytes);
        assert_eq!(est.peak_phase, "step 1 backward");
        assert_eq!(est.phases[1].peak_allocated, ws.cublas_bytes);
    }

    #[test]
    fn a_reduction_stages_what_outer_reduction_sizes() {
        let gpu = h100();
        let config = OuterReduction::config(2048, 2048, gpu.workspaces().multiprocessors, 4)
            .expect("split over blocks");
        let t = trace(
            &[],
            json!([["reduce", 2048, 2048], ["reduce", 2048, 16]]),
            &[],
        );
        let est = replay(&t, &gpu, Limit::None);
        assert_eq!(
            est.peak_allocated_bytes,
            config.buffer_bytes + round(config.semaphore_bytes)
        );
        // The second fits one block per output: no buffer. Both buffers are freed.
        assert_eq!(est.timeline_events, 4);
        assert_eq!(
            breakdown(&est, "workspaces"),
            config.buffer_bytes + config.semaphore_bytes
        );
    }

    /// The peak allocated of `steps` on a fresh allocator: `Ok(bytes)` allocates, `Err(i)`
    /// frees the `i`-th allocation.
    fn peak_of(steps: &[Result<u64, usize>]) -> u64 {
        let mut allocator = CachingAllocator::new(AllocatorConfig::default(), None);
        let mut blocks = Vec::new();
        for step in steps {
            match *step {
                Ok(bytes) => blocks.push(allocator.malloc(bytes, 0).expect("no limit")),
                Err(i) => allocator.free(blocks[i]),
            }
        }
        allocator.stats().allocated_bytes.all.peak as u64
    }

    #[test]
    fn attention_backward_allocates_the_native_kernels_buffers() {
        let shape = QueryShape {
            batch: 2,
            heads: 16,
            seq: 1000,
            head_dim: 128,
        };
        let flash = |gqa| {
            let t = trace(
                &[],
                json!([["attention_backward", "flash", 2, 16, 1000, 128, gqa, 2]]),
                &[],
            );
            replay(&t, &h100(), Limit::None).peak_allocated_bytes
        };
        for gqa in [false, true] {
            let workspace = shape.fused_backward_workspace(gqa, 2);
            assert_eq!(flash(gqa), peak_of(&[Ok(workspace)]));
        }
        assert!(flash(true) > flash(false));
        // A ring attention step: half the queries against a whole chunk of keys, whose rows
        // size the expanded dk and dv under grouped-query attention.
        let ring = trace(
            &[],
            json!([[
                "attention_backward",
                "flash",
                2,
                16,
                1000,
                128,
                true,
                2,
                2000
            ]]),
            &[],
        );
        assert_eq!(
            replay(&ring, &h100(), Limit::None).peak_allocated_bytes,
            peak_of(&[Ok(shape.fused_backward_workspace_over(2000, true, 2))])
        );
        assert!(
            shape.fused_backward_workspace_over(2000, true, 2)
                > shape.fused_backward_workspace(true, 2)
        );
        let t = trace(
            &[],
            json!([[
                "attention_backward",
                "efficient",
                2,
                16,
                1000,
                128,
                false,
                4
            ]]),
            &[],
        );
        let est = replay(&t, &h100(), Limit::None);
        let sizes = shape.efficient_backward();
        assert_eq!(sizes.accumulator, 2 * 16 * 1000 * 128 * 4);
        assert_eq!(sizes.delta, 2 * 16 * 1024 * 4);
        // backward.rs: accumulator, delta, lse; lse and accumulator go; workspace; delta and
        // workspace go.
        let (acc, delta, ws) = (sizes.accumulator, sizes.delta, sizes.workspace);
        let expected = peak_of(&[
            Ok(acc),
            Ok(delta),
            Ok(delta),
            Err(2),
            Err(0),
            Ok(ws),
            Err(1),
            Err(3),
        ]);
        assert_eq!(est.peak_allocated_bytes, expected);
        assert_eq!(est.timeline_events, 8);
    }

    #[test]
    fn a_softmax_gradient_takes_cudas_scratch_of_its_size_beside_it() {
        let peak = |op: &str| {
            let mut t = trace(
                &[(64 * MIB, "temporary"), (MIB, "temporary")],
                json!([["alloc", 0], ["free", 0], ["alloc", 1]]),
                &[],
            );
            t.storages[0].op = op.to_string();
            let est = replay(&t, &h100(), Limit::None);
            assert_eq!(est.phases[1].peak_allocated, est.peak_allocated_bytes);
            est.peak_allocated_bytes
        };
        assert_eq!(peak("aten.empty"), 64 * MIB);
        assert_eq!(peak(SOFTMAX_BACKWARD), 2 * 64 * MIB);
    }

    #[test]
    fn empty_cache_returns_the_cached_segments() {
        let storages = [(100 * MIB, "activation"), (1024, "temporary")];
        let events = |flush: bool| {
            let mut events = vec![json!(["alloc", 0]), json!(["free", 0])];
            if flush {
                events.push(json!(["empty_cache"]));
            }
            events.extend([json!(["alloc", 1]), json!(["free", 1])]);
            Value::Array(events)
        };
        let reserved_after = |flush: bool| {
            let second = if flush { 3 } else { 2 };
            let t = trace(
                &storages,
                events(flush),
                &[
                    ("load", 0),
                    ("step 1 forward", 0),
                    ("step 1 backward", second),
                ],
            );
            replay(&t, &h100(), Limit::None).phases[2].peak_reserved
        };
        assert_eq!(reserved_after(false), 100 * MIB + 2 * MIB);
        assert_eq!(reserved_after(true), 2 * MIB);
    }

    #[test]
    fn the_loaders_warmup_reserves_the_weights_less_the_cached_bytes() {
        // A 100 MiB block cached, then two 300 MiB weights loaded after the warm-up.
        let storages = [
            (100 * MIB, "temporary"),
            (300 * MIB, "parameter"),
            (300 * MIB, "parameter"),
        ];
        let reserved = |cached: bool| {
            let mut events = Vec::new();
            if cached {
                events.extend([json!(["alloc", 0]), json!(["free", 0])]);
            }
            events.extend([
                json!(["caching_allocator_warmup", 600 * MIB]),
                json!(["alloc", 1]),
                json!(["alloc", 2]),
            ]);
            let t = trace(
                &storages,
                Value::Array(events),
                &[("load", 0), ("step 1 forward", 0)],
            );
            replay(&t, &h100(), Limit::None).phases[1].peak_reserved
        };
        // Both weights carved from the warm-up's one segment.
        assert_eq!(reserved(false), 600 * MIB);
        // transformers asks for 500 MiB, counting on the cached 100 MiB, which a 300 MiB weight
        // cannot use: the second weight takes a segment of its own.
        assert_eq!(reserved(true), 100 * MIB + 500 * MIB + 300 * MIB);
    }

    #[test]
    fn a_storage_the_gpu_cannot_hold_is_an_out_of_memory_verdict() {
        let gpu = gpu::find("2GiB").expect("a custom capacity");
        let t = trace(
            &[(512 * MIB, "parameter"), (2048 * MIB, "activation")],
            json!([["alloc", 0], ["alloc", 1], ["free", 1]]),
            &[("load", 0), ("step 1 forward", 1)],
        );
        let est = replay(&t, &gpu, Limit::Gpu);
        assert!(!est.fits());
        let oom = est.oom.as_ref().expect("runs out");
        assert_eq!((oom.event, oom.phase.as_str()), (1, "step 1 forward"));
        assert_eq!(oom.requested_bytes, 2048 * MIB);
        assert_eq!(oom.allocated_bytes, 512 * MIB);
        assert_eq!(oom.reserved_bytes, 512 * MIB);
        assert!(
            oom.tensor.contains("storage 1: activation"),
            "{}",
            oom.tensor
        );
        assert!(
            oom.error
                .to_string()
                .starts_with("CUDA out of memory. Tried to allocate 2.00 GiB"),
            "{}",
            oom.error
        );
        // The numbers are what the run would need.
        assert_eq!(est.peak_allocated_bytes, 2560 * MIB);
        assert_eq!(breakdown(&est, "parameter"), 512 * MIB);
        assert_eq!(breakdown(&est, "activation"), 2048 * MIB);
        assert!(est.headroom_bytes() < 0);
        // Without a limit there is no verdict to give.
        assert!(replay(&t, &gpu, Limit::None).oom.is_none());
    }

    /// A trace whose storages carry the streams given (bytes, stream).
    fn trace_on_streams(storages: &[(u64, u32)], events: Value) -> Trace {
        let storages: Vec<Value> = storages
            .iter()
            .map(|(bytes, stream)| {
                json!({"bytes": bytes, "kind": "temporary", "op": "aten.empty", "module": "", "stream": stream})
            })
            .collect();
        let doc = json!({
            "format": "headroom-trace", "version": 1, "spec": {"model": "tiny"}, "env": {},
            "phases": [{"name": "load", "event": 0}, {"name": "step 1 forward", "event": 0}],
            "storages": storages, "events": events,
        });
        crate::trace::from_bytes(doc.to_string().as_bytes(), Path::new("t.json"))
            .expect("a valid trace")
    }

    #[test]
    fn a_block_freed_on_one_stream_serves_only_that_streams_requests() {
        let events = json!([["alloc", 0], ["free", 0], ["alloc", 1], ["free", 1]]);
        // The second request on the stream that freed the block reuses its segment...
        let same = trace_on_streams(&[(100 * MIB, 1), (100 * MIB, 1)], events.clone());
        assert_eq!(
            replay(&same, &h100(), Limit::None).peak_reserved_bytes,
            100 * MIB
        );
        // ...one on another stream cannot: the allocator's pools are per stream.
        let other = trace_on_streams(&[(100 * MIB, 1), (100 * MIB, 0)], events);
        let est = replay(&other, &h100(), Limit::None);
        assert_eq!(est.peak_reserved_bytes, 200 * MIB);
        assert_eq!(est.peak_allocated_bytes, 100 * MIB);
        // Without a stream, a storage is the default stream's.
        let t = trace(
            &[(100 * MIB, "temporary"), (100 * MIB, "temporary")],
            json!([["alloc", 0], ["free", 0], ["alloc", 1], ["free", 1]]),
            &[],
        );
        assert_eq!(t.storages[1].stream, 0);
        assert_eq!(
            replay(&t, &h100(), Limit::None).peak_reserved_bytes,
            100 * MIB
        );
    }

    #[test]
    fn a_block_another_stream_used_returns_to_its_pool_at_the_next_request() {
        // Storage 0 on stream 1, used on the default stream, then freed: its allocation ends
        // at the free, and the block waits for the default stream's work, which is done by the
        // next request (storage 1, same stream), so that request reuses it.
        let events = |used_on: u32| {
            json!([
                ["alloc", 0],
                ["record_stream", 0, used_on],
                ["free", 0],
                ["alloc", 1],
                ["free", 1]
            ])
        };
        let storages = [(100 * MIB, 1), (100 * MIB, 1)];
        for used_on in [0, 1] {
            let t = trace_on_streams(&storages, events(used_on));
            let est = replay(&t, &h100(), Limit::None);
            assert_eq!(est.peak_reserved_bytes, 100 * MIB, "used on {used_on}");
            assert_eq!(est.peak_allocated_bytes, 100 * MIB, "used on {used_on}");
        }
        // Freed while used elsewhere, then `empty_cache()`: synchronized, the segment goes.
        let mut flushed = trace_on_streams(
            &[(100 * MIB, 1), (1024, 0)],
            json!([
                ["alloc", 0],
                ["record_stream", 0, 0],
                ["free", 0],
                ["empty_cache"],
                ["alloc", 1],
                ["free", 1]
            ]),
        );
        flushed.phases.push(crate::trace::Phase {
            name: "step 1 backward".into(),
            event: 4,
            iteration: None,
        });
        let est = replay(&flushed, &h100(), Limit::None);
        assert_eq!(est.phases[1].peak_reserved, 100 * MIB);
        assert_eq!(est.phases[2].peak_reserved, 2 * MIB);
    }

    /// A pipeline's trace: `storages` (bytes, kind), one rollout engine with this share of the
    /// device, and `phases` (name, first event) of iteration 0.
    fn with_engine(storages: &[u64], share: f64, events: Value, phases: &[(&str, usize)]) -> Trace {
        let storages: Vec<Value> = storages
            .iter()
            .map(|bytes| json!({"bytes": bytes, "kind": "parameter", "op": "aten.empty", "module": ""}))
            .collect();
        let phases: Vec<Value> = phases
            .iter()
            .map(|(name, event)| json!({"name": name, "event": event, "iteration": 0}))
            .collect();
        let doc = json!({
            "format": "headroom-trace", "version": 1, "spec": {}, "env": {},
            "phases": phases, "storages": storages, "events": events,
            "engines": [{"name": "rollout", "gpu_memory_utilization": share}],
        });
        crate::trace::from_bytes(doc.to_string().as_bytes(), Path::new("t.json"))
            .expect("a valid trace")
    }

    #[test]
    fn an_awake_engine_holds_its_share_beside_the_allocator() {
        let gpu = gpu::find("4GiB").expect("a custom capacity");
        let share = gpu.share_bytes(0.5);
        // load: 1 GiB of parameters; rollout: the engine wakes first thing (before the peak
        // counters are reset, after an empty_cache); train: it sleeps, 1 GiB more fits.
        let events = json!([
            ["alloc", 0],
            ["alloc", 1],
            ["free", 1],
            ["engine", 0, true],
            ["engine", 0, false],
            ["alloc", 2],
        ]);
        let phases = [("load", 0), ("rollout", 3), ("train", 4)];
        let t = with_engine(&[1 << 30, 1 << 30, 1 << 30], 0.5, events.clone(), &phases);
        let est = replay(&t, &gpu, Limit::Gpu);
        let engine: Vec<u64> = est.phases.iter().map(|p| p.engine_bytes).collect();
        assert_eq!(engine, [0, share, 0]);
        // The wake's empty_cache returned the freed GiB before the rollout's counters started.
        assert_eq!(est.phases[1].peak_reserved, 1 << 30);
        // The most the device holds is the rollout's, with the engine, not the train's 2 GiB.
        assert_eq!(est.peak_reserved_bytes, 2 << 30);
        assert_eq!(est.peak_device_bytes, (1 << 30) + share);
        assert!(est.oom.is_none(), "{:?}", est.oom);
        // Awake through the train phase, the engine leaves too little for its GiB.
        let awake = json!([
            ["alloc", 0],
            ["alloc", 1],
            ["free", 1],
            ["engine", 0, true],
            ["alloc", 2],
        ]);
        let t = with_engine(&[1 << 30, 1 << 30, 1 << 30], 0.5, awake, &phases);
        let oom = replay(&t, &gpu, Limit::Gpu).oom.expect("runs out");
        assert_eq!((oom.phase.as_str(), oom.iteration), ("train", Some(0)));
        assert!(oom.tensor.starts_with("storage 2"), "{}", oom.tensor);
        // Without a limit the engine changes no allocator number.
        let t = with_engine(&[1 << 30, 1 << 30, 1 << 30], 0.5, events, &phases);
        assert_eq!(replay(&t, &gpu, Limit::None).peak_reserved_bytes, 2 << 30);
    }

    #[test]
    fn an_engine_that_cannot_wake_beside_the_cache_is_out_of_memory() {
        let gpu = gpu::find("4GiB").expect("a custom capacity");
        let events = json!([["alloc", 0], ["engine", 0, true]]);
        let t = with_engine(&[3 << 30], 0.5, events, &[("load", 0), ("rollout", 1)]);
        let oom = replay(&t, &gpu, Limit::Gpu).oom.expect("cannot wake");
        assert_eq!(oom.tensor, ENGINE_WAKE);
        assert_eq!(oom.requested_bytes, gpu.share_bytes(0.5));
        assert_eq!((oom.phase.as_str(), oom.event), ("rollout", 1));
        assert_eq!(oom.reserved_bytes, 3 << 30);
    }

    #[test]
    fn host_storages_never_reach_the_device() {
        let t = trace(
            &[(4, "host"), (1 << 30, "host"), (512, "optimizer_state")],
            json!([["alloc", 0], ["alloc", 1], ["alloc", 2], ["free", 1]]),
            &[],
        );
        let est = replay(&t, &h100(), Limit::None);
        assert_eq!(est.peak_allocated_bytes, 512);
        assert_eq!(est.breakdown, [("optimizer_state", 512)]);
        assert_eq!(est.timeline_events, 1);
    }

    #[test]
    fn the_peak_skips_the_load_and_counts_rounding_and_fragmentation() {
        let t = trace(
            &[
                (3 * MIB, "parameter"),
                (1000, "activation"),
                (5 * MIB, "temporary"),
            ],
            json!([["alloc", 0], ["alloc", 2], ["free", 2], ["alloc", 1]]),
            &[("load", 0), ("step 1 forward", 3)],
        );
        let est = replay(&t, &h100(), Limit::None);
        assert_eq!(est.peak_allocated_bytes, 3 * MIB + 1024);
        assert_eq!(breakdown(&est, "allocator_rounding"), 24);
        assert_eq!(est.phases[0].peak_allocated, 8 * MIB);
        // A 20 MiB segment holds the 3 and 5 MiB blocks; the small pool has a 2 MiB one.
        assert_eq!(est.peak_reserved_bytes, 22 * MIB);
        assert_eq!(est.fragmentation_bytes, 22 * MIB - est.peak_allocated_bytes);
    }

    #[test]
    fn a_run_past_any_devices_addresses_is_refused_by_name() {
        let n = 5000;
        let storages = vec![(1u64 << 50, "activation"); n];
        let events: Vec<Value> = (0..n).map(|i| json!(["alloc", i])).collect();
        let t = trace(&storages, Value::Array(events), &[]);
        let err = estimate(&t, &h100(), Limit::Gpu, &AllocatorConfig::default())
            .expect_err("refused")
            .to_string();
        assert!(err.starts_with("`storages["), "{err}");
        assert!(err.contains("cannot be allocated on any device"), "{err}");
    }
}
