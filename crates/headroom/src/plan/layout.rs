//! The layout search of `fit --gpus N`: how to spread a full training run over N GPUs
//! (pipeline, tensor, context, sequence and data parallelism), at which micro-batch, with or
//! without recomputing activations. Every candidate is simulated by the estimator at the GPU's capacity; none is
//! computed from a formula. Candidates are ranked as a user picks one:
//!
//! 1. fidelity: layouts that keep the spec's global batch (the same optimisation) first, and
//!    among them those simulated whole (one micro-batch a step) before those that accumulate
//!    micro-batches, whose kept gradients the training loop's simulation does not run;
//! 2. the safety margin ([`margin_bytes`]): a layout that fits with less to spare comes after
//!    every one that keeps it;
//! 3. estimated step time ([`StepTime`]: a cost model, not a measurement);
//! 4. less device memory.
//!
//! Each parallel axis is one entry of [`AXES`]: the degrees it may take once the axes before
//! it have chosen theirs, how a layout names it, and its communication in the cost model. A
//! new axis (expert parallelism) is one more entry, and a field of `Parallel`. Combinations the
//! spec refuses (inside a pipeline: a data-parallel wrapper other than FSDP2 over all of a
//! stage's data-parallel ranks, context or sequence parallelism) are never made: the spec's
//! own rule decides, so the search lays out what it admits, torchtitan's PP × FSDP2 (× TP)
//! included.
//!
//! Candidates whose rank is provably the same simulation are simulated once ([`RankMemo`]);
//! the others run on every core, pipelines (the longest simulations) first. A candidate that runs out of memory stops there: the
//! search needs to know it does not fit, not its demand.

pub mod megatron;

use std::collections::HashMap;
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use super::{HALF_EFFICIENCY_TOKENS, SAFETY_MARGIN, Setup};
use crate::arch::Architecture;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::estimate::{self, Estimate, Limit};
use crate::gpu::Gpu;
use crate::sim::cores::on_every_core;
use crate::spec::{
    Framework, Fsdp1Options, FsdpUnits, Megatron, Mode, Parallel, PipelineParallel,
    PipelineSchedule, Precision, Recompute, RunSpec, Strategy, TensorParallel, TrainerKind,
};

/// GPUs of one node: a tensor-parallel group stays within one, on NVLink.
pub const GPUS_PER_NODE: u64 = 8;

/// One parallel axis of a layout.
pub struct Axis {
    /// How `fit --json` names the axis (`layouts.axes`).
    pub name: &'static str,
    /// The layouts this axis makes of one the axes before it chose (each with this axis
    /// set; none when no degree is valid).
    expand: fn(&Context, &Parallel) -> Vec<Parallel>,
    /// This axis in a layout's name, `None` when the layout does not use it.
    words: fn(&Parallel) -> Option<String>,
    /// This axis's communication in one step, under the cost model.
    comm: fn(&CostInputs, &Parallel) -> Comm,
}

/// The axes, in the order they are chosen: the model-parallel ones first (torchtitan's mesh
/// `pp, dp, cp, tp` from the outside in), then data parallelism over the GPUs they leave.
/// Expert parallelism, once a strategy the search lays out shards experts, is an `ep` entry
/// before `dp`.
pub const AXES: &[Axis] = &[
    Axis {
        name: "pp",
        expand: pipeline_degrees,
        words: pipeline_words,
        comm: pipeline_comm,
    },
    Axis {
        name: "tp",
        expand: tensor_degrees,
        words: |p| {
            let sp = if p.tensor.sequence_parallel {
                " + SP"
            } else {
                ""
            };
            (p.tensor.tp > 1).then(|| format!("tp {}{sp}", p.tensor.tp))
        },
        comm: tensor_comm,
    },
    Axis {
        name: "cp",
        expand: context_degrees,
        words: |p| (p.tensor.cp > 1).then(|| format!("cp {}", p.tensor.cp)),
        comm: context_comm,
    },
    Axis {
        name: "sp",
        expand: sequence_choices,
        // Named with tensor parallelism, whose ranks it shards the sequence over.
        words: |_| None,
        // Its collectives replace tensor parallelism's: counted there.
        comm: |_, _| Comm::default(),
    },
    Axis {
        name: "dp",
        expand: data_strategies,
        words: |p| Some(data_words(p)),
        comm: data_comm,
    },
];

/// What every axis reads: the model, the spec and the GPUs.
pub struct Context<'a> {
    pub spec: &'a RunSpec,
    pub arch: &'a Architecture,
    pub world: u64,
}

/// GPUs each model replica spans: the product of the model-parallel degrees.
fn model_parallel(p: &Parallel) -> u64 {
    p.pipeline.pp * p.tensor.cp * p.tensor.tp
}

/// Data-parallel ranks of a layout: the replicas that each take their own sequences.
pub fn data_parallel(p: &Parallel) -> u64 {
    p.world_size / model_parallel(p)
}

/// The ranks FSDP2 shards one pipeline stage's parameters over: the data- and
/// context-parallel ones (torchtitan's `dp_shard_cp` mesh).
fn shard_ranks(p: &Parallel) -> u64 {
    p.world_size / (p.pipeline.pp * p.tensor.tp)
}

/// Pipeline parallelism: none, and each degree of 2 or more that divides the world and the
/// spec admits for the model (a dense decoder with an output head of its own and a decoder
/// layer for every stage; an uneven split gives the first stages one more), under 1F1B and
/// under interleaved 1F1B with two stages per rank. GPipe holds every micro-batch's
/// activations at once for the same bubble as 1F1B: never the better layout. The
/// micro-batches are the candidate's ([`candidates`]).
fn pipeline_degrees(ctx: &Context, p: &Parallel) -> Vec<Parallel> {
    let mut out = vec![p.clone()];
    for pp in (2..=ctx.world).filter(|pp| ctx.world.is_multiple_of(*pp)) {
        for (schedule, vpp) in [
            (PipelineSchedule::OneFOneB, 1),
            (PipelineSchedule::Interleaved1F1B, 2),
        ] {
            let pipeline = PipelineParallel {
                pp,
                vpp,
                microbatches: pp,
                schedule,
                layers_per_stage: None,
            };
            if crate::spec::check_pipeline_parallel(&pipeline, ctx.arch, pp, false).is_ok() {
                out.push(Parallel {
                    pipeline,
                    ..p.clone()
                });
            }
        }
    }
    out
}

pub(super) fn pipeline_words(p: &Parallel) -> Option<String> {
    let pipeline = &p.pipeline;
    (pipeline.pp > 1).then(|| match pipeline.schedule {
        PipelineSchedule::Interleaved1F1B => {
            format!(
                "pp {} (interleaved 1F1B, vpp {})",
                pipeline.pp, pipeline.vpp
            )
        }
        s => format!("pp {} ({})", pipeline.pp, s.name().to_uppercase()),
    })
}

/// Tokens of each sequence a context-parallel rank keeps at least in the search: shorter
/// chunks make the ring's blocks too small to hide its exchange, and its simulation walks
/// `cp - 1` ring steps a layer.
pub const MIN_CONTEXT_TOKENS: u64 = 1024;
/// The largest context-parallel degree searched.
pub const MAX_SEARCHED_CP: u64 = 32;

/// Context parallelism: none, and each degree from 2 to [`MAX_SEARCHED_CP`] that divides the
/// GPUs a pipeline stage's tensor-parallel groups leave and leaves each rank
/// [`MIN_CONTEXT_TOKENS`], where the model and run admit the ring (a dense Llama-style decoder,
/// SDPA, no sliding window, half-precision compute) and the sequence cuts into the load
/// balancer's `2 × cp` chunks.
fn context_degrees(ctx: &Context, p: &Parallel) -> Vec<Parallel> {
    let mut out = vec![p.clone()];
    if crate::spec::check_context_parallel(ctx.spec, ctx.arch).is_err() {
        return out;
    }
    let left = p.world_size / (p.pipeline.pp * p.tensor.tp);
    let most = MAX_SEARCHED_CP.min(ctx.spec.seq_len / MIN_CONTEXT_TOKENS);
    for cp in (2..=left.min(most)).filter(|cp| left.is_multiple_of(*cp)) {
        if ctx.spec.seq_len.is_multiple_of(2 * cp) {
            out.push(Parallel {
                tensor: TensorParallel { cp, ..p.tensor },
                ..p.clone()
            });
        }
    }
    out
}

/// Tensor parallelism: degrees that divide a pipeline stage's GPUs, stay within a node, and
/// divide the heads, KV heads, MLP width and vocabulary of a model whose plan the estimator
/// knows.
fn tensor_degrees(ctx: &Context, p: &Parallel) -> Vec<Parallel> {
    let stage = ctx.world / p.pipeline.pp;
    (1..=GPUS_PER_NODE.min(stage))
        .filter(|&tp| stage.is_multiple_of(tp))
        .filter(|&tp| {
            let tensor = TensorParallel { tp, ..p.tensor };
            tp == 1 || crate::spec::check_tensor_parallel(tensor, ctx.arch).is_ok()
        })
        .map(|tp| Parallel {
            tensor: TensorParallel { tp, ..p.tensor },
            ..p.clone()
        })
        .collect()
}

/// Sequence parallelism: off, and on where tensor parallelism shards a rank's sequence
/// (`seq_len / cp` tokens) that divides over it.
fn sequence_choices(ctx: &Context, p: &Parallel) -> Vec<Parallel> {
    let tp = p.tensor.tp;
    let mut out = vec![Parallel {
        tensor: TensorParallel {
            sequence_parallel: false,
            ..p.tensor
        },
        ..p.clone()
    }];
    if tp > 1 && (ctx.spec.seq_len / p.tensor.cp).is_multiple_of(tp) {
        out.push(Parallel {
            tensor: TensorParallel {
                sequence_parallel: true,
                ..p.tensor
            },
            ..p.clone()
        });
    }
    out
}

/// The strategies of the data-parallel dimension: with tensor or context parallelism FSDP2
/// over the data- and context-parallel ranks (as torchtitan composes them; full shard or not
/// resharding after forward) or nothing when one replica spans every GPU; without, DDP,
/// DeepSpeed ZeRO-1/2/3, FSDP2 and HSDP over each shard group that divides the ranks. A spec
/// with FSDP2's mixed precision keeps the FSDP2 family, whose policy the others cannot say.
/// Within a pipeline, those the spec admits (`check_pipeline_layout` and the layout's own
/// checks): nothing, or FSDP2 over each stage's data-parallel ranks (torchtitan's PP × FSDP2)
/// not resharding after forward, as torchtitan does by default there.
fn data_strategies(ctx: &Context, p: &Parallel) -> Vec<Parallel> {
    let dp = data_parallel(p);
    let shard = shard_ranks(p);
    let plain = p.tensor.tp == 1 && p.tensor.cp == 1 && dp > 1;
    let with = |strategy, shard_size, reshard_after_forward| Parallel {
        strategy,
        world_size: ctx.world,
        shard_size,
        reshard_after_forward,
        // FSDP2's units are the spec's; the other strategies have none.
        units: if strategy == Strategy::Fsdp {
            p.units
        } else {
            FsdpUnits::Layers
        },
        ..p.clone()
    };
    let mut out = Vec::new();
    // Without a data-parallel wrapper torch's AdamW steps plain tensors beside DTensors only
    // where sequence parallelism makes the norms DTensors too (`spec::parse_tensor_parallel`).
    let alone = p.tensor.tp == 1 || p.tensor.sequence_parallel;
    if shard == 1 && model_parallel(p) > 1 && alone && p.mixed_precision.is_none() {
        out.push(with(Strategy::NoDataParallel, 1, true));
    }
    if shard > 1 {
        // Inside a pipeline, torchtitan's default (`reshard_after_forward = not pp_enabled`):
        // resharding would gather a stage's parameters again for every micro-batch, exposed.
        if p.pipeline.pp == 1 {
            out.push(with(Strategy::Fsdp, shard, true));
        }
        out.push(with(Strategy::Fsdp, shard, false));
    }
    if plain {
        for group in (2..dp).filter(|s| dp.is_multiple_of(*s)) {
            out.push(with(Strategy::Fsdp, group, true));
        }
        if p.mixed_precision.is_none() {
            for strategy in [
                Strategy::Ddp,
                Strategy::Zero1,
                Strategy::Zero2,
                Strategy::Zero3,
            ] {
                out.push(with(strategy, dp, true));
            }
        }
    }
    out.retain(|l| {
        l.clone().checked().is_ok()
            && crate::spec::check_pipeline_layout(
                &l.pipeline,
                l.strategy,
                [l.tensor.tp, l.tensor.cp],
                l.world_size,
            )
            .is_ok()
    });
    out
}

fn data_words(p: &Parallel) -> String {
    let dp = data_parallel(p);
    match p.strategy {
        Strategy::Fsdp if p.shard_size < shard_ranks(p) => {
            format!("dp {dp} (HSDP {} × {})", dp / p.shard_size, p.shard_size)
        }
        Strategy::Fsdp if !p.reshard_after_forward => format!("dp {dp} (FSDP2, no reshard)"),
        Strategy::Fsdp => format!("dp {dp} (FSDP2)"),
        Strategy::NoDataParallel => "dp 1".to_string(),
        s => format!("dp {dp} ({})", s.name().to_uppercase()),
    }
}

/// A layout, a micro-batch and recomputation: one candidate of the search.
#[derive(Clone, Debug, PartialEq)]
pub struct Candidate {
    /// With a pipeline, its `microbatches` are the micro-batches one step runs through it.
    pub parallel: Parallel,
    pub micro_batch: u64,
    /// Steps of the training loop per optimizer step on each data-parallel rank (gradient
    /// accumulation); a pipeline's own micro-batches are not counted here.
    pub accumulation: u64,
    /// Activation checkpointing of every decoder layer (full recomputation).
    pub recompute: bool,
    /// A Megatron-core layout's own settings (`megatron:`: expert parallelism, the distributed
    /// optimizer, recomputation, which `recompute` then says is full); `None` for the
    /// torch-native layouts ([`megatron`]).
    pub megatron: Option<Megatron>,
}

impl Candidate {
    /// Micro-batches one step of the training loop runs on each data-parallel rank: the
    /// pipeline's, or one.
    pub fn pipelined(&self) -> u64 {
        self.parallel.pipeline.microbatches
    }

    /// Sequences per optimizer step over every data-parallel rank.
    pub fn global_batch(&self) -> u64 {
        self.micro_batch * self.pipelined() * self.accumulation * data_parallel(&self.parallel)
    }

    /// This candidate without recomputation: what its variants under each recomputation share.
    fn without_recompute(&self) -> Candidate {
        Candidate {
            recompute: false,
            megatron: self.megatron.map(|m| Megatron {
                recompute: Recompute::None,
                ..m
            }),
            ..self.clone()
        }
    }

    /// The layout in words: each axis it uses, then the micro-batch and recomputation.
    pub fn name(&self) -> String {
        if let Some(m) = &self.megatron {
            return megatron::name(self, m);
        }
        let parts: Vec<String> = AXES
            .iter()
            .filter_map(|a| (a.words)(&self.parallel))
            .collect();
        format!(
            "{}, micro-batch {} × {}{}",
            parts.join(" × "),
            self.micro_batch,
            self.pipelined() * self.accumulation,
            if self.recompute { ", recompute" } else { "" }
        )
    }

    /// The spec this candidate runs: the spec (a training loop of its own, whose accumulation
    /// changes nothing a step holds) with its layout, micro-batch and checkpointing replaced.
    /// `estimate` of it gives this candidate's numbers to the byte.
    pub fn spec(&self, base: &RunSpec) -> RunSpec {
        let mut spec = base.clone();
        spec.parallel = Some(self.parallel.clone());
        spec.batch_size = self.micro_batch * self.pipelined();
        spec.gradient_checkpointing = self.recompute;
        if self.megatron.is_some() {
            // Megatron recomputes as `megatron:` says; HF's checkpointing is not its own.
            spec.gradient_checkpointing = false;
            spec.megatron = self.megatron;
        }
        spec
    }

    /// The keys of the spec that differ from a spec without `parallel`: what to write in it.
    pub fn spec_keys(&self) -> serde_json::Value {
        if let Some(m) = &self.megatron {
            return megatron::spec_keys(self, m);
        }
        let p = &self.parallel;
        let mut parallel = serde_json::json!({
            "strategy": p.strategy.name(),
            "world_size": p.world_size,
        });
        if p.strategy == Strategy::Fsdp && !p.reshard_after_forward {
            parallel["reshard_after_forward"] = false.into();
        }
        if p.strategy == Strategy::Fsdp && p.shard_size < shard_ranks(p) {
            parallel["shard_size"] = p.shard_size.into();
        }
        if p.tensor.tp > 1 {
            parallel["tp"] = p.tensor.tp.into();
            parallel["sequence_parallel"] = p.tensor.sequence_parallel.into();
            parallel["framework"] = "torchtitan".into();
        }
        if p.tensor.cp > 1 {
            parallel["cp"] = p.tensor.cp.into();
        }
        pipeline_keys(&mut parallel, &p.pipeline);
        if let Some(mp) = &p.mixed_precision {
            let mut policy = serde_json::json!({"param_dtype": mp.param_dtype.to_string()});
            if let Some(reduce) = mp.reduce_dtype {
                policy["reduce_dtype"] = reduce.to_string().into();
            }
            parallel["mixed_precision"] = policy;
        }
        let mut keys = serde_json::json!({
            "batch_size": self.micro_batch * self.pipelined(),
            "gradient_checkpointing": self.recompute,
            "parallel": parallel,
        });
        if let Some(units) = (p.units != FsdpUnits::Layers).then(|| p.units.name()) {
            keys["parallel"]["units"] = units.into();
        }
        keys
    }
}

/// A pipeline's keys in a layout's `parallel` block.
pub(super) fn pipeline_keys(parallel: &mut serde_json::Value, pipeline: &PipelineParallel) {
    if pipeline.pp > 1 {
        parallel["pp"] = pipeline.pp.into();
        parallel["schedule"] = pipeline.schedule.name().into();
        if pipeline.vpp > 1 {
            parallel["vpp"] = pipeline.vpp.into();
        }
        parallel["microbatches"] = pipeline.microbatches.into();
        if let Some(split) = &pipeline.layers_per_stage {
            parallel["layers_per_stage"] = split.clone().into();
        }
    }
}

/// What the estimator said of a candidate's rank.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// It ran its steps at the GPU's capacity.
    Fits(Numbers),
    /// It ran out of memory in this phase and step (of the first rank simulated that did).
    OutOfMemory { phase: &'static str, step: u32 },
    /// The estimator does not model it, or the spec refuses it: why.
    Refused(String),
}

/// The numbers of a simulated rank that fits, as `estimate` reports them.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Numbers {
    pub peak_allocated_bytes: u64,
    pub peak_reserved_bytes: u64,
    pub nccl_bytes: u64,
    /// Reserved, CUDA context and NCCL: what the process holds on the device.
    pub device_bytes: u64,
}

/// A candidate, simulated and costed.
#[derive(Clone, Debug)]
pub struct Evaluated {
    pub candidate: Candidate,
    pub outcome: Outcome,
    /// It keeps the spec's global batch.
    pub exact: bool,
    /// Its whole step is what the simulation runs: one micro-batch per optimizer step. With
    /// gradient accumulation the micro-batches after the first also hold the gradients of
    /// those before (FSDP2 accumulates its reduce-scattered shards, DDP under `no_sync` full
    /// gradients), which the training loop's simulation does not run: such a candidate's
    /// numbers are its first micro-batch's.
    pub simulated: bool,
    /// What it must keep free to be ranked among the safe ones.
    pub margin_bytes: u64,
    pub time: StepTime,
}

impl Evaluated {
    pub fn numbers(&self) -> Option<&Numbers> {
        match &self.outcome {
            Outcome::Fits(n) => Some(n),
            _ => None,
        }
    }

    /// Free device memory at the peak (of a candidate that fits).
    pub fn headroom_bytes(&self, gpu: &Gpu) -> Option<i128> {
        self.numbers()
            .map(|n| gpu.total_bytes as i128 - n.device_bytes as i128)
    }

    /// It fits with its margin to spare.
    pub fn within_margin(&self, gpu: &Gpu) -> bool {
        self.headroom_bytes(gpu)
            .is_some_and(|h| h >= self.margin_bytes as i128)
    }
}

/// The margin a layout keeps to be ranked first: the estimate's error on reserved bytes,
/// `SAFETY_MARGIN` of the device (every calibration row within 3.8%, p90 2%). NCCL's memory
/// outside the allocator is part of the device total already, measured per layout's
/// communicators (`estimate::nccl_bytes`; tensor-parallel meshes on H100s, bench/nccl-x4).
pub fn margin_bytes(gpu: &Gpu) -> u64 {
    debug_assert!(MARGIN_RULE.contains("3%"));
    (gpu.total_bytes as f64 * SAFETY_MARGIN) as u64
}

/// [`margin_bytes`] in words, for reports.
pub const MARGIN_RULE: &str = "3% of the GPU (the estimate's error on reserved bytes: every \
    calibration row within 3.8%, p90 2%)";

/// [`StepTime`] in words, for reports.
pub const COST_MODEL: &str = "a model, not a measurement: 6 × active parameters FLOPs per token (8 × \
    with recomputation) at an H100's dense bf16 peak, slower for small micro-batches; tensor \
    parallelism's collectives per layer at NVLink bandwidth, never hidden; a pipeline's bubble \
    of (pp - 1) / vpp micro-batch times a step and its sends between stages; context \
    parallelism's ring of keys and values per layer; FSDP/ZeRO gathers and reduce-scatters per \
    micro-batch (inside a pipeline per step), DDP's all-reduce per step and the ring at NVLink or \
    network bandwidth, counted where they exceed the compute they overlap";

/// Dense bf16 tensor-core throughput of an H100 SXM (vendor figure, FLOP/s): the cost
/// model's compute rate on every GPU, since it only compares layouts on one GPU.
const PEAK_FLOPS: f64 = 989e12;
/// NVLink 4 per direction per GPU (bytes/s): within a node.
const NVLINK_BYTES_PER_S: f64 = 450e9;
/// One 400 Gb/s NIC per GPU (bytes/s): between nodes.
const NETWORK_BYTES_PER_S: f64 = 50e9;

/// What the cost model reads of a candidate.
pub struct CostInputs {
    /// Parameters of the whole model.
    params: f64,
    /// Decoder layers on one pipeline rank.
    layers: f64,
    hidden: f64,
    /// Key and value width of one token (`kv_heads × head_dim`).
    kv_width: f64,
    /// Tokens of each sequence on one rank (`seq_len / cp`).
    seq_len: f64,
    micro_batch: f64,
    recompute: bool,
    /// Bytes per element of an FSDP/ZeRO all-gather and of a gradient reduction.
    gather_bytes: f64,
    reduce_bytes: f64,
}

/// Communication of one axis in one step (seconds under the cost model).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Comm {
    /// On the critical path of every micro-batch (tensor parallelism's collectives).
    pub exposed_per_micro_s: f64,
    /// Overlapped with every micro-batch's compute (FSDP's gathers and reduce-scatters).
    pub overlapped_per_micro_s: f64,
    /// Once per optimizer step, overlapped with the last backward (DDP's all-reduce).
    pub per_step_s: f64,
}

/// A candidate's step time under the cost model (seconds of one optimizer step). It is a
/// model for ranking layouts, not a measurement: compute is `6 × active parameters` FLOPs
/// per token (`8 ×` with recomputation, which runs every forward again) at the H100's peak,
/// scaled by the micro-batch's GPU efficiency; communication is ring collectives at NVLink or network
/// bandwidth; what FSDP and DDP can overlap with compute only counts where it exceeds it.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct StepTime {
    pub compute_s: f64,
    /// Tensor parallelism's collectives, never overlapped.
    pub tensor_s: f64,
    /// Expert parallelism's all-to-alls (Megatron's token dispatcher), never overlapped.
    pub expert_s: f64,
    /// Expert tensor parallelism's gathers and reduce-scatters of the dispatched tokens
    /// (Megatron's token dispatcher), never overlapped.
    pub expert_tensor_s: f64,
    /// The pipeline's idle ranks while it fills and drains.
    pub bubble_s: f64,
    /// The pipeline's sends of activations and their gradients between stages.
    pub sends_s: f64,
    /// Data parallelism's communication that compute does not hide.
    pub data_exposed_s: f64,
    /// Seconds per optimizer step.
    pub total_s: f64,
    /// Seconds per token of the global batch: what layouts are ranked by.
    pub per_token_s: f64,
}

/// The cost of `c` for a model with `params` parameters. One rank computes its share of a
/// micro-batch: its pipeline stage's layers, its tensor-parallel slice, its context-parallel
/// chunk of each sequence. A pipeline step of `m` micro-batches over `pp` ranks takes
/// `m + (pp - 1) / vpp` micro-batch times (the bubble is `(pp - 1) / (vpp m + pp - 1)` of it).
pub fn step_time(spec: &RunSpec, arch: &Architecture, c: &Candidate) -> StepTime {
    let p = &c.parallel;
    let storage = match spec.precision {
        Precision::Bf16 => DType::BF16,
        _ => DType::F32,
    };
    let mp = p.mixed_precision.as_ref();
    let gather = mp.map_or(storage, |m| m.param_dtype);
    let reduce = mp.map_or(storage, |m| m.reduce_dtype.unwrap_or(m.param_dtype));
    let (pp, cp) = (p.pipeline.pp, p.tensor.cp);
    let local_tokens = (c.micro_batch * spec.seq_len / cp) as f64;
    let megatron = c
        .megatron
        .as_ref()
        .map(|m| megatron::Cost::of(spec, arch, c, m));
    let params = megatron
        .as_ref()
        .map_or(arch.param_count(spec.head()) as f64, |m| m.params);
    // A token runs through its routed experts alone; the data-parallel traffic moves them all.
    let flops_per_token = if c.recompute { 8.0 } else { 6.0 }
        * arch.active_param_count(spec.head()) as f64
        + megatron
            .as_ref()
            .map_or(0.0, |m| m.recompute_flops_per_token);
    let efficiency = 1.0 + HALF_EFFICIENCY_TOKENS / local_tokens;
    let compute_s =
        flops_per_token * local_tokens / (p.tensor.tp * pp) as f64 / PEAK_FLOPS * efficiency;
    let inputs = CostInputs {
        params,
        layers: arch.layers as f64 / pp as f64,
        hidden: arch.hidden as f64,
        kv_width: (arch.kv_heads * arch.head_dim) as f64,
        seq_len: (spec.seq_len / cp) as f64,
        micro_batch: c.micro_batch as f64,
        recompute: c.recompute,
        gather_bytes: gather.bytes() as f64,
        reduce_bytes: reduce.bytes() as f64,
    };
    let comm = AXES.iter().map(|a| (a.comm)(&inputs, p));
    let tensor_s = tensor_comm(&inputs, p).exposed_per_micro_s;
    let sends_s = pipeline_comm(&inputs, p).exposed_per_micro_s;
    let (mut exposed, mut overlapped, mut per_step) = (0.0, 0.0, 0.0);
    for m in comm {
        exposed += m.exposed_per_micro_s;
        overlapped += m.overlapped_per_micro_s;
        per_step += m.per_step_s;
    }
    let expert_s = megatron.as_ref().map_or(0.0, |m| m.all_to_all_per_micro_s);
    let expert_tensor_s = megatron.as_ref().map_or(0.0, |m| m.gather_per_micro_s);
    exposed += expert_s + expert_tensor_s;
    let micro = (c.pipelined() * c.accumulation) as f64;
    let bubble_s =
        c.accumulation as f64 * (pp - 1) as f64 / p.pipeline.vpp as f64 * (compute_s + exposed);
    // The last backward (two thirds of a micro-batch's compute) hides a per-step reduction.
    let data_exposed_s =
        micro * (overlapped - compute_s).max(0.0) + (per_step - compute_s * 2.0 / 3.0).max(0.0);
    let total_s = micro * (compute_s + exposed) + bubble_s + data_exposed_s;
    StepTime {
        compute_s: micro * compute_s,
        tensor_s: micro * tensor_s,
        expert_s: micro * expert_s,
        expert_tensor_s: micro * expert_tensor_s,
        bubble_s,
        sends_s: micro * sends_s,
        data_exposed_s,
        total_s,
        per_token_s: total_s / (c.global_batch() * spec.seq_len) as f64,
    }
}

/// The bubble's share of a pipeline step of `microbatches` micro-batches over `pp` ranks
/// holding `vpp` stages each: `(pp - 1) / (vpp × microbatches + pp - 1)`.
pub fn bubble_fraction(pp: u64, vpp: u64, microbatches: u64) -> f64 {
    let idle = (pp - 1) as f64 / vpp as f64;
    idle / (microbatches as f64 + idle)
}

/// A pipeline's point-to-point traffic per micro-batch on one rank: each of its `vpp` stages
/// receives its input activations and sends its output's in forward, and the gradients of
/// both in backward (`micro_batch × seq_len × hidden` bf16 elements, on the critical path),
/// between ranks a stage's GPUs apart.
fn pipeline_comm(x: &CostInputs, p: &Parallel) -> Comm {
    let pipeline = &p.pipeline;
    if pipeline.pp == 1 {
        return Comm::default();
    }
    let activation = x.micro_batch * x.seq_len * x.hidden * 2.0;
    let bytes = 2.0 * pipeline.vpp as f64 * activation;
    Comm {
        exposed_per_micro_s: bytes / bandwidth(2, p.world_size / pipeline.pp),
        ..Comm::default()
    }
}

/// Context parallelism's ring per micro-batch: each layer's attention passes every rank's
/// keys and values (`micro_batch × seq_len / cp × kv_width`, bf16) `cp - 1` times around the
/// ring in forward (again when recomputed) and keys, values and their gradients in backward,
/// overlapped with the attention blocks it feeds.
fn context_comm(x: &CostInputs, p: &Parallel) -> Comm {
    let cp = p.tensor.cp;
    if cp == 1 {
        return Comm::default();
    }
    let kv = 2.0 * x.micro_batch * x.seq_len * x.kv_width * 2.0;
    let passes = if x.recompute { 2.0 } else { 1.0 } + 2.0;
    let bytes = x.layers * passes * (cp - 1) as f64 * kv;
    Comm {
        overlapped_per_micro_s: bytes / bandwidth(cp, p.tensor.tp),
        ..Comm::default()
    }
}

/// A ring all-reduce moves `2 (n-1)/n` of the buffer per rank, an all-gather or a
/// reduce-scatter `(n-1)/n`.
pub(super) fn ring(n: u64) -> f64 {
    (n.saturating_sub(1)) as f64 / n.max(1) as f64
}

/// Tensor parallelism's activations collectives per micro-batch, per layer, of
/// `micro_batch × seq_len × hidden` bf16 elements, as torchtitan's plan issues them
/// (`sim/strategy/tp.rs`): without sequence parallelism two all-reduces in forward (the
/// row-parallel outputs) and five in backward (each column-parallel input's gradient: q, k,
/// v, gate, up); with it an all-gather and a reduce-scatter per block each way (the same
/// bytes as an all-reduce). Megatron's column-parallel linears are fused (`linear_qkv`,
/// `linear_fc1`): two all-reduces in backward. Recomputation runs the forward's again.
fn tensor_comm(x: &CostInputs, p: &Parallel) -> Comm {
    let tp = p.tensor.tp;
    if tp == 1 {
        return Comm::default();
    }
    let activation = x.micro_batch * x.seq_len * x.hidden * 2.0;
    let column_parallel = if p.tensor.framework == Framework::Megatron {
        2.0
    } else {
        5.0
    };
    let (forward, backward) = if p.tensor.sequence_parallel {
        (4.0, 4.0)
    } else {
        (2.0 * 2.0, column_parallel * 2.0)
    };
    let passes = if x.recompute { 2.0 * forward } else { forward } + backward;
    let bytes = x.layers * passes * ring(tp) * activation;
    Comm {
        exposed_per_micro_s: bytes / NVLINK_BYTES_PER_S,
        ..Comm::default()
    }
}

/// Bandwidth of a collective over `ranks` ranks `stride` GPUs apart (the tensor-parallel
/// ranks are the inner, adjacent ones): NVLink while they share a node.
pub(super) fn bandwidth(ranks: u64, stride: u64) -> f64 {
    if ranks * stride <= GPUS_PER_NODE {
        NVLINK_BYTES_PER_S
    } else {
        NETWORK_BYTES_PER_S
    }
}

/// Data parallelism's traffic for this rank's `params / (tp × pp)` parameters: FSDP2 and ZeRO-3
/// gather them for forward and again for backward (once when not resharding) and
/// reduce-scatter gradients every micro-batch; HSDP also all-reduces its shard over the
/// replicas once a step; DDP and ZeRO-1/2 reduce gradients once a step (ZeRO-1/2 then
/// gather the updated parameters). Inside a pipeline FSDP2, not resharding after forward,
/// keeps a stage's parameters gathered over the step and reduce-scatters once, after the
/// stage's last backward (torch's schedules turn gradient sync off until then): a gather and
/// a reduction a step.
fn data_comm(x: &CostInputs, p: &Parallel) -> Comm {
    let tp = p.tensor.tp;
    let dp = data_parallel(p);
    let shard = x.params / (tp * p.pipeline.pp) as f64;
    let over = |ranks: u64, stride: u64, bytes: f64| ring(ranks) * bytes / bandwidth(ranks, stride);
    match p.strategy {
        Strategy::NoDataParallel => Comm::default(),
        Strategy::Fsdp if p.pipeline.pp > 1 => Comm {
            per_step_s: over(p.shard_size, tp, shard * (x.gather_bytes + x.reduce_bytes)),
            ..Comm::default()
        },
        Strategy::Fsdp | Strategy::Fsdp1 | Strategy::Zero3 => {
            let s = p.shard_size;
            let gathers = if p.reshard_after_forward || p.strategy == Strategy::Zero3 {
                2.0
            } else {
                1.0
            };
            let replicas = shard_ranks(p) / s;
            Comm {
                overlapped_per_micro_s: over(
                    s,
                    tp,
                    shard * (gathers * x.gather_bytes + x.reduce_bytes),
                ),
                per_step_s: 2.0 * over(replicas, tp * s, shard / s as f64 * x.reduce_bytes),
                ..Comm::default()
            }
        }
        Strategy::Ddp => Comm {
            per_step_s: 2.0 * over(dp, tp, shard * x.reduce_bytes),
            ..Comm::default()
        },
        Strategy::Zero1 | Strategy::Zero2 => Comm {
            per_step_s: over(dp, tp, shard * (x.reduce_bytes + x.gather_bytes)),
            ..Comm::default()
        },
    }
}

/// Estimates of ranks already simulated, by what provably decides them: the rank's spec
/// with the world size left out where the rank does not read it. DDP's rank is a full
/// replica whatever the world (the world enters only NCCL's allowance, the same for every
/// world of two or more); FSDP2 shards over `shard_size` (HSDP's replicas change nothing a
/// rank allocates, `sim/strategy/fsdp.rs`) and NCCL's allowance is HSDP's for any number of
/// replicas. Kept across searches (`fit` over several cluster sizes, the benchmark).
///
/// A rank that fits without the GPU's capacity ever changing what the allocator did
/// (`Estimate::unlimited`) is the same run on every GPU whose constants the simulation reads
/// are the same (the cuBLAS workspaces and multiprocessors of its architecture; the device
/// total only enters a rollout engine's share, and the search lays out training loops alone)
/// and whose capacity is at least as large: its reserved bytes never passed the smaller
/// capacity, so the larger one never acts either. Only what lives outside the allocator, the
/// CUDA context, is the other GPU's.
#[derive(Default)]
pub struct RankMemo {
    outcomes: Mutex<HashMap<String, Outcome>>,
    /// Ranks that fit unlimited, by rank and architecture.
    unlimited: Mutex<HashMap<String, Vec<UnlimitedRun>>>,
}

/// A rank that fit without the capacity acting.
#[derive(Clone, Copy)]
struct UnlimitedRun {
    /// The allocator capacity it ran at.
    capacity: u64,
    numbers: Numbers,
    /// The CUDA context its device bytes count.
    context: u64,
}

impl RankMemo {
    /// What decides a rank's simulation, on any GPU.
    fn rank_key(spec: &RunSpec) -> String {
        let mut spec = spec.clone();
        // Megatron's distributed optimizer pads its buffers to, and shards them over, the
        // data-parallel ranks: the world decides its rank.
        if let Some(p) = spec
            .parallel
            .as_mut()
            .filter(|p| model_parallel(p) == 1 && p.tensor.framework != Framework::Megatron)
        {
            match p.strategy {
                Strategy::Ddp => {
                    p.world_size = 2;
                    p.shard_size = 2;
                }
                Strategy::Fsdp if p.shard_size < p.world_size => {
                    p.world_size = 2 * p.shard_size;
                }
                _ => {}
            }
        }
        format!("{spec:?}")
    }

    /// What decides a rank's simulation on `gpu`.
    fn key(spec: &RunSpec, gpu: &Gpu) -> String {
        format!("{} on {gpu:?}", Self::rank_key(spec))
    }

    /// What decides a rank's simulation on any GPU of `gpu`'s architecture.
    fn architecture_key(spec: &RunSpec, gpu: &Gpu) -> String {
        format!("{} on {:?}", Self::rank_key(spec), gpu.workspaces())
    }

    fn get(&self, key: &str) -> Option<Outcome> {
        self.outcomes.lock().ok()?.get(key).cloned()
    }

    fn put(&self, key: String, outcome: Outcome) {
        if let Ok(mut map) = self.outcomes.lock() {
            map.insert(key, outcome);
        }
    }

    /// `spec`'s rank on `gpu`, from a run on another GPU of its architecture that fitted
    /// unlimited at no more capacity.
    fn served(&self, spec: &RunSpec, gpu: &Gpu) -> Option<Outcome> {
        let map = self.unlimited.lock().ok()?;
        let runs = map.get(&Self::architecture_key(spec, gpu))?;
        let run = runs
            .iter()
            .find(|r| r.capacity <= gpu.allocator_capacity())?;
        Some(Outcome::Fits(Numbers {
            device_bytes: run.numbers.device_bytes - run.context + gpu.cuda_context_bytes,
            ..run.numbers
        }))
    }

    /// Keeps what simulating `spec`'s rank on `gpu` said, and, where it fitted unlimited, for
    /// the other GPUs of its architecture.
    fn record(&self, key: String, spec: &RunSpec, gpu: &Gpu, outcome: Outcome, unlimited: bool) {
        if let (Outcome::Fits(n), true) = (&outcome, unlimited)
            && let Ok(mut map) = self.unlimited.lock()
        {
            map.entry(Self::architecture_key(spec, gpu))
                .or_default()
                .push(UnlimitedRun {
                    capacity: gpu.allocator_capacity(),
                    numbers: *n,
                    context: gpu.cuda_context_bytes,
                });
        }
        self.put(key, outcome);
    }
}

/// Candidates evaluated so far by the search running in this process, and how many it has:
/// what a progress bar shows.
static DONE: AtomicUsize = AtomicUsize::new(0);
static TOTAL: AtomicUsize = AtomicUsize::new(0);

/// `(done, total)` of the layout search under way.
pub fn progress() -> (usize, usize) {
    (DONE.load(Ordering::Relaxed), TOTAL.load(Ordering::Relaxed))
}

/// The answer of the layout search.
#[derive(Clone, Debug)]
pub struct LayoutSearch {
    pub gpus: u64,
    /// Sequences per optimizer step the spec trains with over these GPUs.
    pub global_batch: u64,
    /// Every candidate the axes made.
    pub candidates: usize,
    /// Distinct rank simulations those needed (the others repeat one of them).
    pub simulated: usize,
    /// Candidates the estimator or the spec refuses, with each distinct reason.
    pub refused: usize,
    pub refusals: Vec<String>,
    pub out_of_memory: usize,
    /// The candidates that fit, best first.
    pub ranked: Vec<Evaluated>,
    /// Candidates that fit but recompute what their layout need not: the same layout and
    /// micro-batch keeps its margin, and is faster, with less recomputation
    /// ([`needless_recompute`]). They are not in `ranked`, unless one is the spec's own.
    pub needless_recompute: usize,
    /// When none fits: the layout that needs least, at micro-batch 1 with recomputation,
    /// with its demand (`estimate` without a limit).
    pub closest: Option<(Candidate, Estimate)>,
}

impl LayoutSearch {
    pub fn best(&self) -> Option<&Evaluated> {
        self.ranked.first()
    }
}

/// Whether `setup` gets a layout search, or why not.
pub fn applies(setup: &Setup) -> std::result::Result<(), String> {
    let spec = &setup.spec;
    if setup.gpus < 2 {
        return Err("one GPU".into());
    }
    if spec.mode != Mode::Train {
        return Err("a forward-only run".into());
    }
    if spec.lora.is_some() || spec.quantization.is_some() {
        return Err("adapters (layouts are searched for full fine-tuning)".into());
    }
    if spec.trainer.kind != TrainerKind::Loop {
        return Err(format!(
            "trainer {} (layouts are searched for a training loop of its own, as torchtitan's; \
             leave `trainer` out)",
            spec.trainer.kind.name()
        ));
    }
    spec.architecture(setup.spec_dir, "")
        .map_err(|e| e.to_string())?;
    Ok(())
}

/// The spec's own parallel settings that every layout keeps (FSDP2's mixed precision and
/// units), or plain ones; parameters and optimizer stay on the GPU.
fn template(spec: &RunSpec, world: u64) -> Parallel {
    let own = spec.parallel.clone();
    Parallel {
        world_size: world,
        shard_size: world,
        offload_params: false,
        offload_optimizer: false,
        tensor: TensorParallel::default(),
        pipeline: Default::default(),
        ..own.unwrap_or(Parallel {
            strategy: Strategy::Fsdp,
            world_size: world,
            reshard_after_forward: true,
            shard_size: world,
            offload_params: false,
            offload_optimizer: false,
            mixed_precision: None,
            units: FsdpUnits::Layers,
            fsdp1: Fsdp1Options::default(),
            tensor: TensorParallel::default(),
            pipeline: Default::default(),
        })
    }
}

/// Sequences per optimizer step of the spec over `world` GPUs: its batch on each
/// data-parallel rank of its own layout (a training loop of its own steps after each).
pub fn global_batch(spec: &RunSpec, world: u64) -> u64 {
    let replica = spec.parallel.as_ref().map_or(1, model_parallel);
    let dp = if world.is_multiple_of(replica) {
        world / replica
    } else {
        world
    };
    spec.batch_size * dp
}

/// Every candidate the axes make over `world` GPUs: each layout at each micro-batch that
/// keeps the global batch (`micro_batch × accumulation × dp`; where dp does not divide it,
/// the micro-batch that comes closest, once a step), with and without recomputation. A
/// pipeline runs a data-parallel rank's whole batch in one step: `per_rank / micro_batch`
/// micro-batches, at least one per stage and as many as its schedule and the simulation take.
/// A Megatron-core spec's are [`megatron::candidates`].
pub fn candidates(ctx: &Context, global: u64) -> Vec<Candidate> {
    if megatron::applies(ctx.spec) {
        return megatron::candidates(ctx, global);
    }
    let mut layouts = vec![template(ctx.spec, ctx.world)];
    for axis in AXES {
        layouts = layouts.iter().flat_map(|p| (axis.expand)(ctx, p)).collect();
    }
    let mut out = Vec::new();
    for layout in layouts {
        let pp = layout.pipeline.pp;
        for (micro_batch, microbatches, accumulation) in batches(global, data_parallel(&layout), pp)
        {
            let mut parallel = layout.clone();
            parallel.pipeline.microbatches = microbatches;
            if pp > 1 && !pipeline_runs(ctx, &parallel.pipeline, micro_batch) {
                continue;
            }
            for recompute in [false, true] {
                out.push(Candidate {
                    parallel: parallel.clone(),
                    micro_batch,
                    accumulation,
                    recompute,
                    megatron: None,
                });
            }
        }
    }
    out
}

/// (micro-batch, micro-batches in the pipeline, gradient accumulation) of each way `dp`
/// data-parallel ranks over a pipeline of `pp` keep the `global` batch: each micro-batch that
/// divides a rank's share, all through the pipeline or, without one, accumulated; where `dp`
/// does not divide it, the micro-batch that comes closest, once a step.
pub(super) fn batches(global: u64, dp: u64, pp: u64) -> Vec<(u64, u64, u64)> {
    if !global.is_multiple_of(dp) {
        let closest = (global as f64 / (dp * pp) as f64).round() as u64;
        return vec![(closest.max(1), pp, 1)];
    }
    let per_rank = global / dp;
    (1..=per_rank)
        .filter(|m| per_rank.is_multiple_of(*m))
        .map(|m| match pp {
            1 => (m, 1, per_rank / m),
            _ => (m, per_rank / m, 1),
        })
        .collect()
}

/// Whether a pipeline runs `microbatches` micro-batches of `micro_batch` sequences: one per
/// stage at least, as many as its schedule takes, and within what the estimate simulates.
fn pipeline_runs(ctx: &Context, pipeline: &PipelineParallel, micro_batch: u64) -> bool {
    pipeline.microbatches >= pipeline.pp
        && pipeline.check_microbatches(false).is_ok()
        && pipeline
            .check(ctx.arch.layers, micro_batch * pipeline.microbatches)
            .is_ok()
}

/// Layer-forwards (`limits::MAX_PIPELINE_WORK`'s unit, about 8 µs each) the search simulates
/// of one pipeline candidate at most: every rank's 3 steps × 4 layer-forwards a micro-batch of
/// every layer, 32 micro-batches of a 70B model's 80 layers. A pipeline's candidate costs its
/// micro-batches' worth of ordinary ones; longer pipelines are refused by name (`estimate`
/// simulates them), which keeps thousands of candidates within seconds.
pub const SEARCHED_PIPELINE_WORK: u64 = 1 << 15;

/// Why a candidate over [`SEARCHED_PIPELINE_WORK`] is not simulated.
const PIPELINE_BUDGET: &str = "a pipeline of more micro-batches than the layout search \
    simulates a candidate (3 steps × 4 × layers × micro-batches at most 32,768 layer-forwards); \
    `headroom estimate` simulates it";

/// Whether simulating `c` takes more than the search gives one candidate.
fn over_budget(ctx: &Context, c: &Candidate) -> bool {
    c.parallel.pipeline.pp > 1 && 3 * 4 * ctx.arch.layers * c.pipelined() > SEARCHED_PIPELINE_WORK
}

/// The GPU a candidate's allocator gets: the setup's, less what resident models hold.
fn gpu_for(setup: &Setup) -> Gpu {
    let residents: u64 = setup.residents.iter().map(|r| r.weights_bytes).sum();
    Gpu {
        total_bytes: setup.gpu.total_bytes.saturating_sub(residents),
        ..setup.gpu.clone()
    }
}

/// Simulate one candidate's rank at the GPU's capacity, stopping at an out-of-memory error,
/// and say whether the capacity never acted (`Estimate::unlimited`).
fn simulate(spec: &RunSpec, spec_dir: Option<&Path>, gpu: &Gpu) -> (Outcome, bool) {
    let est = spec
        .clone()
        .rechecked()
        .and_then(|s| estimate::estimate_with_trace(&s, spec_dir, gpu, Limit::GpuUntilOom, false))
        .map(|(est, _)| est);
    let unlimited = est.as_ref().is_ok_and(|e| e.unlimited);
    let outcome = match est {
        Ok(est) => match &est.oom {
            Some(oom) => Outcome::OutOfMemory {
                phase: oom.phase,
                step: oom.step,
            },
            None => Outcome::Fits(Numbers {
                peak_allocated_bytes: est.peak_allocated_bytes,
                peak_reserved_bytes: est.peak_reserved_bytes,
                nccl_bytes: est.nccl_bytes,
                device_bytes: est.device_bytes(),
            }),
        },
        Err(Error::BeyondAnyDevice { .. }) => Outcome::OutOfMemory {
            phase: "forward",
            step: 1,
        },
        Err(e) => Outcome::Refused(e.to_string()),
    };
    (outcome, unlimited)
}

/// Search the layouts of `setup` over its GPUs, with a memo of its own.
pub fn search(setup: &Setup) -> Result<LayoutSearch> {
    search_with(setup, &RankMemo::default())
}

/// Search the layouts of `setup` over its GPUs, reusing the ranks `memo` knows.
pub fn search_with(setup: &Setup, memo: &RankMemo) -> Result<LayoutSearch> {
    applies(setup).map_err(|why| Error::Unsupported {
        what: format!("a layout search of this spec ({why})"),
        supported: "full fine-tuning in a training loop of its own over 2 or more GPUs".into(),
    })?;
    let spec = &setup.spec;
    let (_, arch) = spec.architecture(setup.spec_dir, "")?;
    let world = u64::from(setup.gpus);
    let ctx = Context {
        spec,
        arch: &arch,
        world,
    };
    let global = global_batch(spec, world);
    let all = candidates(&ctx, global);
    let gpu = gpu_for(setup);
    let specs: Vec<RunSpec> = all.iter().map(|c| c.spec(spec)).collect();
    let keys: Vec<String> = specs.iter().map(|s| RankMemo::key(s, &gpu)).collect();
    // The first candidate of each distinct rank runs the simulation.
    let mut first_of: HashMap<&str, usize> = HashMap::new();
    let mut todo = Vec::new();
    for (i, key) in keys.iter().enumerate() {
        if !first_of.contains_key(key.as_str()) {
            first_of.insert(key, i);
            if over_budget(&ctx, &all[i]) {
                memo.put(key.clone(), Outcome::Refused(PIPELINE_BUDGET.into()));
            } else if memo.get(key).is_none() {
                // Or the same run on another GPU of the architecture.
                match memo.served(&specs[i], &gpu) {
                    Some(outcome) => memo.put(key.clone(), outcome),
                    None => todo.push(i),
                }
            }
        }
    }
    DONE.store(0, Ordering::Relaxed);
    TOTAL.store(todo.len(), Ordering::Relaxed);
    let outcomes = on_every_core(
        &todo,
        // A pipeline's rank runs each of its micro-batches, another rank one.
        |&i| all[i].pipelined(),
        |&i| {
            let ran = simulate(&specs[i], setup.spec_dir, &gpu);
            DONE.fetch_add(1, Ordering::Relaxed);
            ran
        },
    );
    for (&i, (outcome, unlimited)) in todo.iter().zip(outcomes) {
        memo.record(keys[i].clone(), &specs[i], &gpu, outcome, unlimited);
    }
    let mut evaluated = Vec::with_capacity(all.len());
    for (candidate, key) in all.into_iter().zip(&keys) {
        let outcome = memo.get(key).expect("simulated above");
        evaluated.push(Evaluated {
            exact: candidate.global_batch() == global,
            simulated: candidate.accumulation == 1,
            margin_bytes: margin_bytes(&setup.gpu),
            time: step_time(spec, &arch, &candidate),
            candidate,
            outcome,
        });
    }
    let candidates = evaluated.len();
    let mut refusals: Vec<String> = Vec::new();
    for e in &evaluated {
        if let Outcome::Refused(why) = &e.outcome
            && !refusals.contains(why)
        {
            refusals.push(why.clone());
        }
    }
    let refused = evaluated
        .iter()
        .filter(|e| matches!(e.outcome, Outcome::Refused(_)))
        .count();
    let out_of_memory = evaluated
        .iter()
        .filter(|e| matches!(e.outcome, Outcome::OutOfMemory { .. }))
        .count();
    let fitting: Vec<Evaluated> = evaluated
        .into_iter()
        .filter(|e| e.numbers().is_some())
        .collect();
    // The spec's own layout stays ranked, for the comparison with it.
    let needless: Vec<bool> = needless_recompute(&setup.gpu, &fitting)
        .into_iter()
        .zip(&fitting)
        .map(|(needless, e)| needless && e.candidate.spec(spec) != *spec)
        .collect();
    let needless_recompute = needless.iter().filter(|&&n| n).count();
    let mut ranked: Vec<Evaluated> = fitting
        .into_iter()
        .zip(needless)
        .filter_map(|(e, needless)| (!needless).then_some(e))
        .collect();
    ranked.sort_by(|a, b| rank_order(&setup.gpu, a, b));
    let closest = if ranked.is_empty() {
        closest(setup, &ctx, global)?
    } else {
        None
    };
    Ok(LayoutSearch {
        gpus: world,
        global_batch: global,
        candidates,
        simulated: todo.len(),
        refused,
        refusals,
        out_of_memory,
        ranked,
        needless_recompute,
        closest,
    })
}

/// Which of `fitting` recompute more than their layout needs: another differs only in
/// recomputation, keeps its margin, and is faster under the cost model (or as fast and
/// smaller). A user turns recomputation on to fit; such a variant buys memory its layout
/// already has at the cost of time, and ranking it would list each layout once per
/// recomputation.
fn needless_recompute(gpu: &Gpu, fitting: &[Evaluated]) -> Vec<bool> {
    let mut variants: HashMap<String, Vec<&Evaluated>> = HashMap::new();
    let keys: Vec<String> = fitting
        .iter()
        .map(|e| format!("{:?}", e.candidate.without_recompute()))
        .collect();
    for (e, key) in fitting.iter().zip(&keys) {
        variants.entry(key.clone()).or_default().push(e);
    }
    let device = |e: &Evaluated| e.numbers().map_or(u64::MAX, |n| n.device_bytes);
    fitting
        .iter()
        .zip(&keys)
        .map(|(e, key)| {
            variants[key].iter().any(|other| {
                other.within_margin(gpu)
                    && other
                        .time
                        .per_token_s
                        .total_cmp(&e.time.per_token_s)
                        .then(device(other).cmp(&device(e)))
                        .is_lt()
            })
        })
        .collect()
}

/// The order a user ranks fitting candidates in: the spec's global batch first, simulated
/// whole before accumulating micro-batches the simulation does not run, then those that keep
/// their margin, then the faster under the cost model, then the smaller.
pub fn rank_order(gpu: &Gpu, a: &Evaluated, b: &Evaluated) -> std::cmp::Ordering {
    let device = |e: &Evaluated| e.numbers().map_or(u64::MAX, |n| n.device_bytes);
    (!a.exact)
        .cmp(&!b.exact)
        .then((!a.simulated).cmp(&!b.simulated))
        .then((!a.within_margin(gpu)).cmp(&!b.within_margin(gpu)))
        .then(a.time.per_token_s.total_cmp(&b.time.per_token_s))
        .then(device(a).cmp(&device(b)))
}

/// When nothing fits: each layout at micro-batch 1 with recomputation (its least memory)
/// estimated for its demand, on every core, and the one that needs least (the first of those
/// that need as little).
///
/// A branch and bound over the demands: once one layout's demand is known, every later one is
/// simulated on a device of that many bytes, where a layout that needs more runs out or makes
/// the allocator act (`Estimate::unlimited` false), and stops early; one that needs no more
/// never meets the capacity, so its numbers are its demand's. The most sharded layouts, the
/// likeliest to need least, go first; the best is estimated again without a limit.
fn closest(setup: &Setup, ctx: &Context, global: u64) -> Result<Option<(Candidate, Estimate)>> {
    let gpu = gpu_for(setup);
    let layouts: Vec<Candidate> = candidates(ctx, global)
        .into_iter()
        .filter(|c| c.recompute && c.micro_batch == 1 && !over_budget(ctx, c))
        .collect();
    let bound = AtomicU64::new(u64::MAX);
    let sharding =
        |c: &Candidate| model_parallel(&c.parallel) * c.megatron.map_or(1, |m| m.expert_parallel);
    let demands = on_every_core(&layouts, sharding, |c| {
        let spec = c.spec(&setup.spec).rechecked().ok()?;
        let known = bound.load(Ordering::Relaxed);
        let (limit, device) = match known {
            u64::MAX => (Limit::None, gpu.clone()),
            _ => (
                Limit::GpuUntilOom,
                Gpu {
                    total_bytes: known,
                    ..gpu.clone()
                },
            ),
        };
        let (est, _) =
            estimate::estimate_with_trace(&spec, setup.spec_dir, &device, limit, false).ok()?;
        if limit != Limit::None && (est.oom.is_some() || !est.unlimited) {
            return None;
        }
        let demand = est.device_bytes();
        bound.fetch_min(demand, Ordering::Relaxed);
        Some(demand)
    });
    let Some(best) = demands
        .iter()
        .enumerate()
        .filter_map(|(i, demand)| demand.map(|d| (d, i)))
        .min()
        .map(|(_, i)| layouts[i].clone())
    else {
        return Ok(None);
    };
    let spec = best.spec(&setup.spec).rechecked()?;
    let (est, _) = estimate::estimate_with_trace(&spec, setup.spec_dir, &gpu, Limit::None, false)?;
    Ok(Some((best, est)))
}

/// Why the best candidate is best, in sentences: its fidelity, its margin, and what the
/// runner-up or the faster layouts that lack the margin give up.
pub fn reasons(setup: &Setup, s: &LayoutSearch) -> Vec<String> {
    let gpu = &setup.gpu;
    let Some(best) = s.best() else {
        return Vec::new();
    };
    let mut out = Vec::new();
    out.push(if best.exact {
        format!(
            "it keeps the spec's global batch of {} sequences (the same optimisation)",
            s.global_batch
        )
    } else {
        format!(
            "no layout that fits keeps the spec's global batch of {} sequences; it trains with {}",
            s.global_batch,
            best.candidate.global_batch()
        )
    });
    if !best.simulated {
        out.push(format!(
            "no layout that fits runs the global batch without accumulation; its {} \
             micro-batches per step are simulated as its first: the gradients later ones \
             accumulate into are not (see `simulated`)",
            best.candidate.accumulation
        ));
    }
    let headroom = best.headroom_bytes(gpu).unwrap_or(0);
    out.push(if best.within_margin(gpu) {
        format!(
            "it leaves {} free, above its margin of {}",
            crate::units::signed_gib(headroom),
            crate::units::gib(best.margin_bytes)
        )
    } else {
        format!(
            "no layout keeps its margin; it leaves {}, under its margin of {}",
            crate::units::signed_gib(headroom),
            crate::units::gib(best.margin_bytes)
        )
    });
    let peers: Vec<&Evaluated> = s
        .ranked
        .iter()
        .filter(|e| {
            (e.exact, e.simulated, e.within_margin(gpu))
                == (best.exact, best.simulated, best.within_margin(gpu))
        })
        .collect();
    if let Some(next) = peers.get(1) {
        out.push(format!(
            "it is the fastest of the {} such layouts under the cost model: {} takes ×{:.2} ({})",
            peers.len(),
            next.candidate.name(),
            next.time.per_token_s / best.time.per_token_s,
            difference(&best.time, &next.time)
        ));
    }
    out.extend(megatron::why_split_experts(s));
    out.extend(megatron::why_eager_nccl(setup, s));
    let own = s
        .ranked
        .iter()
        .position(|e| e.candidate.spec(&setup.spec) == setup.spec);
    if let Some(i) = own.filter(|&i| i > 0) {
        out.push(format!(
            "the spec's own layout is #{} and takes ×{:.2}",
            i + 1,
            s.ranked[i].time.per_token_s / best.time.per_token_s
        ));
    }
    let faster: Vec<&Evaluated> = s
        .ranked
        .iter()
        .filter(|e| (e.exact, e.simulated) == (best.exact, best.simulated))
        .filter(|e| !e.within_margin(gpu))
        .filter(|e| e.time.per_token_s < best.time.per_token_s)
        .collect();
    if let Some(f) = faster.first() {
        out.push(format!(
            "{} faster layout{} fit{} with less than the margin: {} leaves {}",
            faster.len(),
            if faster.len() == 1 { "" } else { "s" },
            if faster.len() == 1 { "s" } else { "" },
            f.candidate.name(),
            crate::units::signed_gib(f.headroom_bytes(gpu).unwrap_or(0))
        ));
    }
    out
}

/// What makes `next` slower than `best`, in the part of the cost model that grows most.
fn difference(best: &StepTime, next: &StepTime) -> String {
    let parts = [
        ("compute", next.compute_s - best.compute_s),
        (
            "tensor-parallel communication",
            next.tensor_s - best.tensor_s,
        ),
        ("expert-parallel all-to-all", next.expert_s - best.expert_s),
        (
            "expert-tensor-parallel gather and reduce-scatter",
            next.expert_tensor_s - best.expert_tensor_s,
        ),
        ("pipeline bubble", next.bubble_s - best.bubble_s),
        ("sends between pipeline stages", next.sends_s - best.sends_s),
        (
            "data-parallel communication compute does not hide",
            next.data_exposed_s - best.data_exposed_s,
        ),
    ];
    let (what, more) = parts
        .iter()
        .copied()
        .max_by(|a, b| a.1.total_cmp(&b.1))
        .expect("seven parts");
    if more <= 0.0 {
        // Ranked after `best` as fast: with more memory (Megatron's optimizer not distributed).
        return if next.per_token_s <= best.per_token_s {
            "as fast under the cost model, with more device memory".into()
        } else {
            "no part of the step costs more; it trains a different batch".into()
        };
    }
    let percent = 100.0 * more / best.total_s;
    match percent {
        p if p >= 1.0 => format!("{p:.0}% more {what}"),
        p if p >= 0.1 => format!("{p:.1}% more {what}"),
        _ => format!("under 0.1% more {what}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_runner_up_slower_by_a_sliver_says_by_how_much() {
        let best = StepTime {
            compute_s: 10.0,
            total_s: 10.0,
            per_token_s: 1.0,
            ..StepTime::default()
        };
        let slower = |compute_s| StepTime {
            compute_s,
            per_token_s: compute_s / 10.0,
            ..best
        };
        assert_eq!(difference(&best, &slower(11.0)), "10% more compute");
        assert_eq!(difference(&best, &slower(10.03)), "0.3% more compute");
        assert_eq!(
            difference(&best, &slower(10.001)),
            "under 0.1% more compute"
        );
    }

    fn evaluated(tp: u64, exact: bool, headroom: u64, per_token_s: f64) -> Evaluated {
        let gpu = crate::gpu::find("h100-80gb").expect("gpu");
        let spec =
            RunSpec::from_value(&serde_json::json!({"model": "llama-3.1-70b"})).expect("spec");
        let parallel = Parallel {
            tensor: TensorParallel {
                tp,
                sequence_parallel: tp > 1,
                ..TensorParallel::default()
            },
            ..template(&spec, 64)
        };
        let device_bytes = gpu.total_bytes - headroom;
        Evaluated {
            margin_bytes: margin_bytes(&gpu),
            candidate: Candidate {
                parallel,
                micro_batch: 1,
                accumulation: 1,
                recompute: false,
                megatron: None,
            },
            outcome: Outcome::Fits(Numbers {
                peak_allocated_bytes: device_bytes / 2,
                peak_reserved_bytes: device_bytes / 2,
                nccl_bytes: 0,
                device_bytes,
            }),
            exact,
            simulated: true,
            time: StepTime {
                per_token_s,
                ..StepTime::default()
            },
        }
    }

    fn context_of(spec: &RunSpec) -> Architecture {
        spec.architecture(None, "").expect("catalog model").1
    }

    fn model(name: &str, seq_len: u64) -> RunSpec {
        RunSpec::from_value(&serde_json::json!({
            "model": name, "precision": "bf16", "batch_size": 1, "seq_len": seq_len,
        }))
        .expect("spec")
    }

    /// Pipeline degrees divide the world and leave every stage a layer; a model whose tied
    /// embedding would sit on two stages, or an MoE model, gets none; each degree comes under
    /// 1F1B and under interleaved 1F1B with two stages a rank.
    #[test]
    fn pipeline_degrees_divide_the_world_and_the_layers() {
        let degrees = |spec: &RunSpec, world: u64| -> Vec<(u64, u64)> {
            let arch = context_of(spec);
            let ctx = Context {
                spec,
                arch: &arch,
                world,
            };
            pipeline_degrees(&ctx, &template(spec, world))
                .iter()
                .map(|p| (p.pipeline.pp, p.pipeline.vpp))
                .collect()
        };
        let llama = model("llama-3.1-70b", 4096);
        assert_eq!(
            degrees(&llama, 12),
            [
                (1, 1),
                (2, 1),
                (2, 2),
                (3, 1),
                (3, 2),
                (4, 1),
                (4, 2),
                (6, 1),
                (6, 2),
                (12, 1),
                (12, 2)
            ]
        );
        // 80 layers: 64 stages of 1F1B, not 128 interleaved ones.
        assert!(degrees(&llama, 64).contains(&(64, 1)));
        assert!(!degrees(&llama, 64).contains(&(64, 2)));
        assert_eq!(degrees(&model("llama-3.2-1b", 4096), 8), [(1, 1)], "tied");
        assert_eq!(degrees(&model("qwen3-30b-a3b", 4096), 8), [(1, 1)], "MoE");
    }

    /// Context-parallel degrees divide the GPUs a stage's tensor-parallel groups leave and
    /// cut the sequence into `2 × cp` chunks; a model the ring does not run gets none.
    #[test]
    fn context_degrees_cut_the_sequence_into_two_chunks_a_rank() {
        let degrees = |spec: &RunSpec, world: u64, tp: u64| -> Vec<u64> {
            let arch = context_of(spec);
            let ctx = Context {
                spec,
                arch: &arch,
                world,
            };
            let p = Parallel {
                tensor: TensorParallel {
                    tp,
                    ..TensorParallel::default()
                },
                ..template(spec, world)
            };
            context_degrees(&ctx, &p)
                .iter()
                .map(|p| p.tensor.cp)
                .collect()
        };
        let llama = model("llama-3.1-8b", 4096);
        assert_eq!(
            degrees(&llama, 16, 1),
            [1, 2, 4],
            "1,024 tokens a rank at least"
        );
        let long = model("llama-3.1-8b", 131072);
        assert_eq!(degrees(&long, 64, 1), [1, 2, 4, 8, 16, 32]);
        assert_eq!(degrees(&long, 16, 4), [1, 2, 4]);
        assert_eq!(
            degrees(&model("llama-3.1-8b", 1536), 16, 1),
            [1],
            "768 tokens a rank"
        );
        assert_eq!(degrees(&model("qwen3-30b-a3b", 4096), 16, 1), [1], "MoE");
    }

    /// The bubble is `(pp - 1) / (vpp m + pp - 1)` of a pipeline step, and the cost model
    /// charges exactly that share of a pipeline alone's step to it.
    #[test]
    fn a_pipeline_step_idles_its_bubble() {
        assert_eq!(bubble_fraction(4, 1, 4), 3.0 / 7.0);
        assert_eq!(bubble_fraction(4, 2, 4), 1.5 / 5.5);
        assert_eq!(bubble_fraction(1, 1, 1), 0.0);
        let spec = model("llama-3.1-70b", 4096);
        let arch = context_of(&spec);
        for (schedule, vpp, microbatches) in [
            (PipelineSchedule::OneFOneB, 1, 8),
            (PipelineSchedule::OneFOneB, 1, 32),
            (PipelineSchedule::Interleaved1F1B, 2, 16),
        ] {
            let c = Candidate {
                parallel: Parallel {
                    strategy: Strategy::NoDataParallel,
                    shard_size: 1,
                    pipeline: PipelineParallel {
                        pp: 8,
                        vpp,
                        microbatches,
                        schedule,
                        layers_per_stage: None,
                    },
                    ..template(&spec, 8)
                },
                micro_batch: 1,
                accumulation: 1,
                recompute: false,
                megatron: None,
            };
            let t = step_time(&spec, &arch, &c);
            assert!(t.bubble_s > 0.0 && t.data_exposed_s == 0.0);
            let share = t.bubble_s / t.total_s;
            assert!(
                (share - bubble_fraction(8, vpp, microbatches)).abs() < 1e-12,
                "{share}"
            );
            assert_eq!(c.global_batch(), microbatches);
        }
    }

    /// A pipeline's candidates run a data-parallel rank's batch in one step, with at least a
    /// micro-batch per stage; every layout they make is one the spec admits: a pipeline alone,
    /// or torchtitan's PP × FSDP2 (× TP) with FSDP2 over each stage's data-parallel ranks, not
    /// resharding after forward, without context or sequence parallelism.
    #[test]
    fn pipeline_candidates_keep_the_batch_and_what_the_spec_admits() {
        let spec = RunSpec {
            batch_size: 4,
            ..model("llama-3.1-70b", 4096)
        };
        let arch = context_of(&spec);
        let ctx = Context {
            spec: &spec,
            arch: &arch,
            world: 8,
        };
        let global = global_batch(&spec, 8);
        let all = candidates(&ctx, global);
        let piped: Vec<&Candidate> = all.iter().filter(|c| c.parallel.pipeline.pp > 1).collect();
        for c in &all {
            assert_eq!(c.global_batch(), global, "{}", c.name());
        }
        let layouts = |strategy, tp| {
            piped
                .iter()
                .filter(|c| c.parallel.strategy == strategy && c.parallel.tensor.tp == tp)
                .count()
        };
        assert!(layouts(Strategy::NoDataParallel, 1) > 0, "a pipeline alone");
        assert!(layouts(Strategy::Fsdp, 1) > 0, "PP × FSDP2");
        assert!(layouts(Strategy::Fsdp, 2) > 0, "PP × FSDP2 × TP");
        for c in piped {
            let p = &c.parallel;
            assert_eq!(c.accumulation, 1, "{}", c.name());
            assert!(p.pipeline.microbatches >= p.pipeline.pp, "{}", c.name());
            assert!(
                !p.tensor.sequence_parallel && p.tensor.cp == 1,
                "{}",
                c.name()
            );
            if p.strategy == Strategy::Fsdp {
                assert!(!p.reshard_after_forward, "{}", c.name());
                assert_eq!(p.shard_size, data_parallel(p), "{}", c.name());
            }
            crate::spec::check_pipeline_layout(
                &p.pipeline,
                p.strategy,
                [p.tensor.tp, p.tensor.cp],
                p.world_size,
            )
            .expect("admitted");
            c.spec(&spec).rechecked().expect("a valid spec");
        }
    }

    #[test]
    fn the_margin_is_the_estimate_error_whatever_the_mesh() {
        let gpu = crate::gpu::find("h100-80gb").expect("gpu");
        let plain = evaluated(1, true, 0, 1.0).margin_bytes;
        let mesh = evaluated(8, true, 0, 1.0).margin_bytes;
        assert_eq!(plain, (gpu.total_bytes as f64 * 0.03) as u64);
        assert_eq!(mesh, plain);
    }

    /// Recomputation that buys memory its layout already has is left out; recomputation that
    /// buys the margin, or another layout's, is not.
    #[test]
    fn recomputation_a_layout_fits_its_margin_without_is_needless() {
        let gpu = crate::gpu::find("h100-80gb").expect("gpu");
        let recomputing = |e: Evaluated| Evaluated {
            candidate: Candidate {
                recompute: true,
                ..e.candidate
            },
            ..e
        };
        // tp 8 keeps its margin without recomputation: recomputing is needless.
        let plain = evaluated(8, true, 10 << 30, 1.0);
        let needless = recomputing(evaluated(8, true, 30 << 30, 1.3));
        // tp 2 fits only under its margin without it: recomputing buys the margin.
        let tight = evaluated(2, true, 225 << 20, 0.9);
        let needed = recomputing(evaluated(2, true, 20 << 30, 1.2));
        // A layout of its own: nothing to compare with.
        let alone = recomputing(evaluated(4, true, 20 << 30, 1.1));
        let all = [plain, needless, tight, needed, alone];
        assert_eq!(
            needless_recompute(&gpu, &all),
            [false, true, false, false, false]
        );
    }

    /// A layout with 0.22 GiB to spare is not ranked first, however fast: every one that keeps
    /// its margin comes before it; and keeping the spec's global batch comes before both.
    #[test]
    fn a_layout_short_of_its_margin_ranks_after_those_that_keep_it() {
        let gpu = crate::gpu::find("h100-80gb").expect("gpu");
        let tight = evaluated(8, true, 225 << 20, 1.0);
        let roomy = evaluated(8, true, 20 << 30, 1.3);
        let roomier = evaluated(1, true, 30 << 30, 1.3);
        let other_batch = evaluated(8, false, 40 << 30, 0.5);
        let accumulating = Evaluated {
            simulated: false,
            ..evaluated(8, true, 35 << 30, 0.9)
        };
        assert!(!tight.within_margin(&gpu) && roomy.within_margin(&gpu));
        let mut all = [&other_batch, &accumulating, &tight, &roomier, &roomy];
        all.sort_by(|a, b| rank_order(&gpu, a, b));
        let order: Vec<(bool, u64)> = all
            .iter()
            .map(|e| (e.exact, e.headroom_bytes(&gpu).expect("fits") as u64))
            .collect();
        assert_eq!(
            order,
            [
                (true, 30 << 30),
                (true, 20 << 30),
                (true, 225 << 20),
                (true, 35 << 30),
                (false, 40 << 30)
            ],
            "equally fast: less device memory first; accumulation not simulated after whole \
             steps"
        );
    }

    /// Every job runs once, and the results come back in the jobs' order whatever thread ran
    /// them.
    #[test]
    fn jobs_run_once_each_and_answer_in_order() {
        let jobs: Vec<u64> = (0..200).map(|j| (j * 37) % 11).collect();
        let started = Mutex::new(Vec::new());
        let results = on_every_core(
            &jobs,
            |&cost| cost,
            |&cost| {
                started.lock().expect("not poisoned").push(cost);
                cost * 2
            },
        );
        assert_eq!(results, jobs.iter().map(|c| c * 2).collect::<Vec<_>>());
        let mut started = started.into_inner().expect("not poisoned");
        let mut all = jobs.clone();
        started.sort_unstable();
        all.sort_unstable();
        assert_eq!(started, all);
    }
}
