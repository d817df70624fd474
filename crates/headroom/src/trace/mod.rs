//! Trace files (`docs/trace-format.md`): the storage allocations and frees of a run's steps as
//! the real model code made them under PyTorch's fake tensors, with markers where CUDA
//! kernels allocate inside themselves, replayed through the caching-allocator simulator.
//!
//! - [`read`] and [`from_bytes`] read a `.json` or `.json.gz` trace, refusing anything outside
//!   the format or past [`crate::limits`] by name;
//! - [`estimate`] expands the kernel markers into the buffers the native simulator gives those
//!   kernels (the same sizing code) and replays everything at a GPU's capacity, or without a
//!   limit.

mod read;
mod replay;

pub use read::{from_bytes, is_json, read};
pub use replay::{TraceEstimate, TraceOom, TracePhasePeak, estimate};

use headroom_alloc::AllocatorConfig;
use serde_json::{Map, Value};

use crate::error::{Error, Result};

/// The `format` every trace file names.
pub const FORMAT: &str = "headroom-trace";

/// The newest `version` of the format, the one `headroom trace` writes: version 2 writes
/// storages as columns and allocations and frees as bare integers; version 1 (one object per
/// storage, every event a list) reads as well.
pub const VERSION: u64 = 2;

/// A trace file, checked: every storage an event names exists, is allocated once and freed at
/// most once after that, and the phases cover every event in order.
#[derive(Clone, Debug, PartialEq)]
pub struct Trace {
    /// The spec as the harness ran it.
    pub spec: Value,
    /// Versions of torch, transformers, peft and Python, and what else the tracer recorded.
    pub env: Map<String, Value>,
    pub phases: Vec<Phase>,
    pub storages: Vec<Storage>,
    pub events: Vec<Event>,
    /// A pipeline's rollout engines, which hold a share of the device outside the caching
    /// allocator while awake.
    pub engines: Vec<Engine>,
}

/// A vLLM-style rollout engine colocated with the traced pipeline (see
/// [`crate::spec::EngineSpec`]): awake, it holds `gpu_memory_utilization` of the device's total.
#[derive(Clone, Debug, PartialEq, serde::Deserialize)]
pub struct Engine {
    pub name: String,
    pub gpu_memory_utilization: f64,
}

/// Where a phase (`load`, `step 1 forward`, ...) begins.
#[derive(Clone, Debug, PartialEq, Eq, serde::Deserialize)]
pub struct Phase {
    pub name: String,
    /// Index of its first event.
    pub event: usize,
    /// A pipeline's iteration (its phases repeat by name); absent in a run's trace.
    #[serde(default)]
    pub iteration: Option<u32>,
}

/// One storage the allocator is asked for.
#[derive(Clone, Debug, PartialEq, Eq, serde::Deserialize)]
pub struct Storage {
    /// As requested, before the allocator rounds it.
    pub bytes: u64,
    pub kind: StorageKind,
    /// The op that made it (`aten.mm.default`).
    pub op: String,
    /// The innermost module running then; empty outside any module.
    pub module: String,
    /// The CUDA stream it is allocated on, whose pools serve it: 0 the default stream, others
    /// numbered by the tracer (FSDP2's all-gather and reduce-scatter streams). Absent: 0.
    #[serde(default)]
    pub stream: u32,
}

/// What a storage holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum StorageKind {
    Parameter,
    Buffer,
    Gradient,
    OptimizerState,
    Input,
    Activation,
    Temporary,
    /// In host memory (an optimizer's `step` counters): never asks the CUDA allocator.
    Host,
}

impl StorageKind {
    pub const ALL: [StorageKind; 8] = [
        StorageKind::Parameter,
        StorageKind::Buffer,
        StorageKind::Gradient,
        StorageKind::OptimizerState,
        StorageKind::Input,
        StorageKind::Activation,
        StorageKind::Temporary,
        StorageKind::Host,
    ];

    /// As the trace file spells it, and the `component` of a trace's breakdown.
    pub fn key(self) -> &'static str {
        match self {
            StorageKind::Parameter => "parameter",
            StorageKind::Buffer => "buffer",
            StorageKind::Gradient => "gradient",
            StorageKind::OptimizerState => "optimizer_state",
            StorageKind::Input => "input",
            StorageKind::Activation => "activation",
            StorageKind::Temporary => "temporary",
            StorageKind::Host => "host",
        }
    }
}

/// One entry of `events`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Event {
    /// `["alloc", i]`: storage `i` is allocated.
    Alloc(u32),
    /// `["free", i]`: storage `i` is freed.
    Free(u32),
    /// `["empty_cache"]`.
    EmptyCache,
    /// `["caching_allocator_warmup", weight_bytes]`: transformers' loader reserves the weights'
    /// bytes in one allocation, less what the allocator holds unused at that moment, which
    /// only the replay knows.
    CachingAllocatorWarmup { weight_bytes: u64 },
    /// `["gemm", bias_epilogue]` or `["gemm", bias_epilogue, thread]`: a cuBLAS GEMM ran,
    /// on `thread` when the tracer says which.
    Gemm {
        bias_epilogue: bool,
        thread: Option<Thread>,
    },
    /// `["reduce", outputs, inputs]`: `outputs` sums of `inputs` values each, over a tensor's
    /// outer dimensions.
    Reduce { outputs: u64, inputs: u64 },
    /// `["attention_backward", kernel, batch, heads, seq, head_dim, gqa, dtype_bytes(, key_seq)]`.
    AttentionBackward(Box<AttentionBackward>),
    /// `["engine", index, awake]`: rollout engine `index` wakes (after `empty_cache()`) or
    /// goes to sleep.
    Engine { engine: u32, awake: bool },
    /// `["record_stream", i, stream]`: `Tensor.record_stream` of live storage `i` on `stream`
    /// (numbered as storages' streams are); freed, its block waits for that stream's work
    /// before it is reused.
    RecordStream { storage: u32, stream: u32 },
}

/// The thread a GEMM runs on: each has its own cuBLAS handle and so its own workspaces.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Thread {
    /// Python's (`0` in the file).
    Main,
    /// autograd's device thread, which runs the backward (`1`).
    Autograd,
}

/// The backward of a fused attention kernel, with the query's shape.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionBackward {
    pub kernel: AttentionKernel,
    pub batch: u64,
    pub heads: u64,
    pub seq: u64,
    pub head_dim: u64,
    /// Grouped-query attention inside the kernel (`enable_gqa`).
    pub gqa: bool,
    /// Bytes of an element of q, k and v.
    pub dtype_bytes: u64,
    /// The key's rows: `seq` but where a ring attention step attends part of the queries.
    pub key_seq: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AttentionKernel {
    Flash,
    Cudnn,
    Efficient,
}

impl Trace {
    /// The allocator config the traced run asked for: its spec's `allocator`
    /// (`expandable_segments`), PyTorch's default otherwise.
    pub fn allocator_config(&self) -> Result<AllocatorConfig> {
        let expandable = match &self.spec["allocator"]["expandable_segments"] {
            Value::Null => false,
            Value::Bool(on) => *on,
            other => {
                return Err(Error::field(
                    "spec.allocator.expandable_segments",
                    other,
                    "use true or false",
                ));
            }
        };
        Ok(AllocatorConfig {
            expandable_segments: expandable,
            ..AllocatorConfig::default()
        })
    }

    /// The spec's `model` when it names one.
    pub fn model(&self) -> Option<&str> {
        self.spec["model"].as_str()
    }
}
