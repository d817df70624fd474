//! Planning a configuration that fits: the largest micro-batch and the longest sequence a GPU
//! holds, and a search over the memory knobs of a training run for the configurations that
//! fit, as a Pareto front of device memory against estimated slowdown.
//!
//! Knobs the run spec can express (optimizer, checkpointing, LoRA/QLoRA, micro-batch,
//! `expandable_segments`, over several GPUs DDP, FSDP2 full sharding and DeepSpeed ZeRO-1/2 of
//! a full fine-tune, and DeepSpeed's `offload_optimizer` of a bf16 full fine-tune, ZeRO-Offload
//! on one GPU included) are simulated by the estimator. Knobs it cannot express yet (other CPU
//! offload, a fused loss, moving a resident model off the GPU, sharding with adapters, ZeRO-1/2
//! of fp32 parameters) are
//! *computed* from the estimate's breakdown at the peak and its per-phase peaks: each removes
//! a known share of known components, and the new peak is the largest phase peak after the
//! removal, where a component only counts as removed from a phase it is certain to be live
//! in. Computed numbers say so wherever they are shown.

pub mod layout;

use std::path::Path;

use serde::Serialize;

use crate::arch::{Architecture, Module};
use crate::error::{Error, Result};
use crate::estimate::{self, Estimate};
use crate::gpu::Gpu;
use crate::sim::{Component, PhasePeak};
use crate::spec::{
    Fsdp1Options, FsdpUnits, Lora, LoraTargets, Mode, Optimizer, Parallel, Precision, Quantization,
    RunSpec, Strategy, TensorParallel, TrainerKind,
};

/// Tokens per micro-batch at which a GPU is half as efficient as when saturated, in the
/// throughput model `time per token ∝ 1 + T0 / tokens` used to cost smaller micro-batches
/// (GEMMs of a few hundred rows already run near peak on current GPUs).
pub(crate) const HALF_EFFICIENCY_TOKENS: f64 = 128.0;

/// A model that stays on the GPU during training without being trained (DPO's reference,
/// an RL user or reward model): its loaded weights add to every phase. Its fields are an
/// entry of `fit --json`'s `residents`.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Resident {
    pub name: String,
    pub weights_bytes: u64,
}

impl Resident {
    /// Estimate a `mode: forward` spec and keep its loaded weights.
    pub fn from_spec(spec: &RunSpec, spec_dir: Option<&Path>, gpu: &Gpu) -> Result<Self> {
        if spec.mode != Mode::Forward {
            return Err(Error::field(
                "mode",
                "train",
                "a resident model is only run forward; use `mode: forward` in its spec",
            ));
        }
        let est = estimate::estimate(spec, spec_dir, gpu)?;
        Ok(Resident {
            name: format!("{} ({})", est.model, spec.precision.name()),
            weights_bytes: est.weights_loaded_bytes,
        })
    }
}

/// Everything fixed about a planning question.
#[derive(Clone, Debug)]
pub struct Setup<'a> {
    pub spec: RunSpec,
    pub spec_dir: Option<&'a Path>,
    pub gpu: Gpu,
    /// Data-parallel ranks, one GPU each. With more than one, the baseline is DDP.
    pub gpus: u32,
    pub residents: Vec<Resident>,
    /// How the run is launched, which decides the words a change of sharding is said in.
    pub launcher: Launcher,
}

/// What starts the training processes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum Launcher {
    /// `torchrun` (or `python`) running a script that wraps the model itself.
    #[default]
    Script,
    /// `accelerate launch` with a config file: changes are said in its keys.
    Accelerate,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Adapter {
    Full,
    /// peft LoRA, r=16, all linear layers.
    Lora,
    /// LoRA on 4-bit NF4 base weights (bitsandbytes), bf16 compute.
    Qlora,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Sharding {
    /// Each rank holds everything (DDP when there are several ranks).
    None,
    /// ZeRO-1: optimizer states sharded.
    Zero1,
    /// ZeRO-2 / FSDP `SHARD_GRAD_OP`: optimizer states and gradients sharded.
    Zero2,
    /// ZeRO-3 / FSDP `FULL_SHARD`: weights too, gathered a layer at a time.
    Zero3,
}

impl Adapter {
    /// Stable machine name (`fit --json`'s `knobs.adapter`).
    pub fn key(self) -> &'static str {
        match self {
            Adapter::Full => "full",
            Adapter::Lora => "lora",
            Adapter::Qlora => "qlora",
        }
    }
}

impl Sharding {
    /// Stable machine name (`fit --json`'s `knobs.sharding`).
    pub fn key(self) -> &'static str {
        match self {
            Sharding::None => "none",
            Sharding::Zero1 => "zero1",
            Sharding::Zero2 => "zero2",
            Sharding::Zero3 => "zero3",
        }
    }
}

/// How far a configuration departs from the training the spec describes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Fidelity {
    /// The same math (up to floating-point reordering).
    Exact,
    /// 8-bit optimizer states.
    QuantizedOptimizer,
    /// Low-rank adapters instead of full fine-tuning.
    Adapters,
    /// Adapters on a 4-bit base model.
    QuantizedBase,
}

impl Fidelity {
    pub fn key(self) -> &'static str {
        match self {
            Fidelity::Exact => "exact",
            Fidelity::QuantizedOptimizer => "8-bit optimizer states",
            Fidelity::Adapters => "adapters only",
            Fidelity::QuantizedBase => "adapters on a 4-bit base",
        }
    }
}

/// One point of the search space.
#[derive(Clone, Debug, PartialEq)]
pub struct Knobs {
    pub optimizer: Optimizer,
    pub gradient_checkpointing: bool,
    pub adapter: Adapter,
    pub expandable_segments: bool,
    pub micro_batch: u64,
    /// Gradient-accumulation steps: micro_batch × accumulation is the spec's batch.
    pub accumulation: u64,
    pub seq_len: u64,
    pub sharding: Sharding,
    /// Optimizer states and step on the CPU (DeepSpeed `offload_optimizer`, FSDP `CPUOffload`).
    pub cpu_offload: bool,
    /// A fused linear + cross-entropy loss (Liger's FLCE, Apple's CCE) that never holds the
    /// full logits: simulated as `use_liger_kernel` under transformers' `Trainer`, always on
    /// under TRL's trainers (their fused LM head), computed for the measuring loop.
    pub fused_loss: bool,
    /// DPO's reference log-probs computed once before training (`precompute_ref_log_probs`).
    pub precompute_ref_log_probs: bool,
    /// The trainer the spec names (fixed across a search): it decides which knobs are
    /// simulated and how they are said.
    pub trainer: TrainerKind,
    /// Resident models moved off the GPU (reference log-probs precomputed, or on the CPU).
    pub residents_off_gpu: bool,
    /// The spec trains bf16 parameters (DeepSpeed's `bf16` mode, which ZeRO-1/2 simulate).
    pub bf16_params: bool,
}

impl Knobs {
    /// The knobs a spec already sets.
    pub fn of(spec: &RunSpec) -> Self {
        let (sharding, cpu_offload) = spec
            .parallel
            .as_ref()
            .map_or((Sharding::None, false), sharding_of);
        Knobs {
            optimizer: spec.optimizer,
            gradient_checkpointing: spec.gradient_checkpointing,
            adapter: adapter_of(spec),
            expandable_segments: spec.allocator.expandable_segments,
            micro_batch: spec.batch_size,
            accumulation: 1,
            seq_len: spec.seq_len,
            sharding,
            cpu_offload,
            fused_loss: spec.trainer.kind.is_trl() || spec.trainer.use_liger_kernel,
            precompute_ref_log_probs: spec
                .trainer
                .dpo
                .as_ref()
                .is_some_and(|d| d.precompute_ref_log_probs),
            trainer: spec.trainer.kind,
            residents_off_gpu: false,
            bf16_params: spec.precision == Precision::Bf16 && spec.quantization.is_none(),
        }
    }

    /// Whether any knob is computed rather than simulated.
    pub fn has_computed(&self) -> bool {
        ((self.sharding != Sharding::None || self.cpu_offload) && !self.sharding_simulated())
            || self.computed_fused_loss()
            || self.residents_off_gpu
    }

    /// The fused loss taken from the breakdown: only the measuring loop cannot run one.
    fn computed_fused_loss(&self) -> bool {
        self.fused_loss && self.trainer == TrainerKind::Loop
    }

    /// Whether DeepSpeed runs this as the estimator models it: a full fine-tune of bf16
    /// parameters with torch's AdamW (DeepSpeedCPUAdam under `offload_optimizer`).
    fn deepspeed_modelled(&self) -> bool {
        self.adapter == Adapter::Full && self.bf16_params && self.optimizer == Optimizer::AdamW
    }

    /// The sharding and offload of a full fine-tune are simulated where the estimator models
    /// them: ZeRO-3 as FSDP2 full sharding with the optimizer on the GPU, ZeRO-1/2/3 with the
    /// optimizer on the CPU and ZeRO-1/2 as DeepSpeed runs them (`offload_optimizer`; on one
    /// GPU, ZeRO-Offload: ZeRO-2 over a world of one). The others are computed.
    fn sharding_simulated(&self) -> bool {
        match self.sharding {
            Sharding::None => self.cpu_offload && self.deepspeed_modelled(),
            Sharding::Zero1 | Sharding::Zero2 => self.deepspeed_modelled(),
            Sharding::Zero3 if self.cpu_offload => self.deepspeed_modelled(),
            Sharding::Zero3 => self.adapter == Adapter::Full,
        }
    }
}

/// Whether the estimator runs `k`'s data parallelism (or ZeRO-Offload) as a simulation of its
/// own, rather than computing it from an unsharded run's breakdown.
pub fn simulates_parallel(setup: &Setup, k: &Knobs) -> bool {
    parallel_for(&spec_for(setup, k), k, setup.gpus).is_some()
}

/// The sharding and CPU offload a spec's own data parallelism amounts to.
fn sharding_of(p: &Parallel) -> (Sharding, bool) {
    match p.strategy {
        Strategy::Ddp | Strategy::NoDataParallel => (Sharding::None, false),
        Strategy::Fsdp | Strategy::Fsdp1 => (Sharding::Zero3, p.offload_params),
        Strategy::Zero1 => (Sharding::Zero1, p.offload_optimizer),
        Strategy::Zero2 => (Sharding::Zero2, p.offload_optimizer),
        Strategy::Zero3 => (Sharding::Zero3, p.offload_optimizer || p.offload_params),
    }
}

/// The spec's own parallel settings over `gpus` ranks (an HSDP shard group kept where it
/// still divides them; with pipeline, tensor or context parallelism, FSDP over the data- and
/// context-parallel ranks left).
fn rescaled(p: &Parallel, gpus: u32) -> Parallel {
    let world_size = u64::from(gpus.max(1));
    let plain = p.tensor.tp == 1 && p.tensor.cp == 1 && p.pipeline.pp == 1;
    let hsdp = plain && p.shard_size < p.world_size && world_size % p.shard_size == 0;
    Parallel {
        world_size,
        shard_size: if hsdp {
            p.shard_size
        } else {
            (world_size / (p.tensor.tp * p.pipeline.pp)).max(1)
        },
        ..p.clone()
    }
}

/// The data parallelism (or ZeRO-Offload) the simulated run has over `gpus` ranks: the spec's
/// own where `k` keeps its sharding and offload; otherwise DDP when
/// nothing is sharded or offloaded, DeepSpeed ZeRO-1/2 (with `offload_optimizer` for the
/// optimizer on the CPU; ZeRO-2 of one rank when nothing is sharded), FSDP2 full shard for
/// ZeRO-3 with the optimizer on the GPU and DeepSpeed ZeRO-3 with it on the CPU (see
/// `Knobs::sharding_simulated`).
fn parallel_for(spec: &RunSpec, k: &Knobs, gpus: u32) -> Option<Parallel> {
    let own = spec.parallel.as_ref();
    if let Some(p) = own.filter(|p| sharding_of(p) == (k.sharding, k.cpu_offload)) {
        return Some(rescaled(p, gpus));
    }
    if spec.mode != Mode::Train {
        return None;
    }
    let strategy = match k.sharding {
        _ if k.sharding != Sharding::None && gpus <= 1 => return None,
        Sharding::None if !k.cpu_offload && gpus > 1 => Strategy::Ddp,
        _ if !k.sharding_simulated() => return None,
        // ZeRO-Offload: what DeepSpeed offers to move AdamW off the GPU without sharding.
        Sharding::None if gpus <= 1 => Strategy::Zero2,
        Sharding::None => return None,
        Sharding::Zero1 => Strategy::Zero1,
        Sharding::Zero2 => Strategy::Zero2,
        Sharding::Zero3 if k.cpu_offload => Strategy::Zero3,
        Sharding::Zero3 => Strategy::Fsdp,
    };
    // The same strategy as the spec's keeps its other settings (FSDP's mixed precision,
    // resharding and shard group).
    if let Some(p) = own.filter(|p| p.strategy == strategy) {
        return Some(Parallel {
            offload_params: false,
            offload_optimizer: k.cpu_offload,
            ..rescaled(p, gpus)
        });
    }
    Some(Parallel {
        strategy,
        world_size: u64::from(gpus.max(1)),
        reshard_after_forward: true,
        shard_size: u64::from(gpus.max(1)),
        offload_params: false,
        offload_optimizer: k.cpu_offload,
        mixed_precision: None,
        units: FsdpUnits::Layers,
        tensor: TensorParallel::default(),
        pipeline: Default::default(),
        fsdp1: Fsdp1Options::default(),
    })
}

fn adapter_of(spec: &RunSpec) -> Adapter {
    match (&spec.lora, spec.quantization) {
        (_, Some(Quantization::Nf4)) => Adapter::Qlora,
        (Some(_), None) => Adapter::Lora,
        (None, None) => Adapter::Full,
    }
}

/// The LoRA a remedy proposes: peft's usual recipe.
pub fn default_lora() -> Lora {
    Lora {
        r: 16,
        alpha: 32.0,
        targets: LoraTargets::AllLinear,
        dropout: 0.05,
        target_parameters: Vec::new(),
    }
}

/// The LoRA a remedy proposes for `spec`'s model: peft's usual recipe, except on an MoE model
/// whose experts peft would wrap (`all-linear` reaches the fused stacks there, rebuilding
/// each as a full `W + BA` every forward and keeping it for backward): the attention
/// projections only, the experts frozen.
pub fn remedy_lora(spec: &RunSpec, spec_dir: Option<&Path>) -> Lora {
    let lora = default_lora();
    let Ok((_, arch)) = spec.architecture(spec_dir, "") else {
        return lora;
    };
    if arch.moe.is_none() {
        return lora;
    }
    let attention = [
        Module::Q,
        Module::K,
        Module::V,
        Module::QA,
        Module::QB,
        Module::KvA,
        Module::KvB,
        Module::O,
    ];
    let mut names: Vec<String> = Vec::new();
    for p in arch.parameters(spec.head()) {
        if attention.contains(&p.module) && !names.iter().any(|n| n == p.module.hf_name()) {
            names.push(p.module.hf_name().to_string());
        }
    }
    Lora {
        targets: LoraTargets::Modules(names),
        ..lora
    }
}

/// How a remedy's LoRA is said: `all-linear`, or the modules it adapts.
fn lora_targets_words(setup: &Setup) -> String {
    match remedy_lora(&setup.spec, setup.spec_dir).targets {
        LoraTargets::AllLinear => "\"all-linear\"".to_string(),
        LoraTargets::Modules(names) => format!("{names:?}"),
    }
}

/// The spec the simulated knobs describe.
pub fn spec_for(setup: &Setup, k: &Knobs) -> RunSpec {
    let base = &setup.spec;
    let mut spec = base.clone();
    spec.optimizer = k.optimizer;
    spec.gradient_checkpointing = k.gradient_checkpointing;
    spec.allocator.expandable_segments = k.expandable_segments;
    spec.batch_size = k.micro_batch;
    spec.seq_len = k.seq_len;
    let trainer = &mut spec.trainer;
    if trainer.kind != TrainerKind::Loop {
        trainer.gradient_accumulation_steps = base
            .trainer
            .gradient_accumulation_steps
            .saturating_mul(k.accumulation);
        trainer.use_liger_kernel =
            k.fused_loss && trainer.kind == TrainerKind::Hf || base.trainer.use_liger_kernel;
    }
    if let Some(dpo) = trainer.dpo.as_mut() {
        // The prompt keeps its length while the sequence leaves room for a completion.
        dpo.prompt_len = dpo.prompt_len.min(k.seq_len.saturating_sub(2)).max(1);
        if k.precompute_ref_log_probs {
            dpo.precompute_ref_log_probs = true;
            dpo.reference = None;
        }
    }
    if let Some(grpo) = trainer.grpo.as_mut() {
        // A GRPO row is its prompt and its completion: the length changes the completion.
        grpo.completion_len = k.seq_len.saturating_sub(grpo.prompt_len).max(1);
        spec.seq_len = grpo.prompt_len + grpo.completion_len;
    }
    if k.adapter != adapter_of(base) {
        match k.adapter {
            Adapter::Full => {
                spec.lora = None;
                spec.quantization = None;
                spec.kbit_prepare = false;
            }
            Adapter::Lora => {
                spec.lora = Some(
                    base.lora
                        .clone()
                        .unwrap_or_else(|| remedy_lora(base, setup.spec_dir)),
                );
                spec.quantization = None;
                spec.kbit_prepare = false;
            }
            Adapter::Qlora => {
                spec.lora = Some(
                    base.lora
                        .clone()
                        .unwrap_or_else(|| remedy_lora(base, setup.spec_dir)),
                );
                spec.quantization = Some(Quantization::Nf4);
                spec.kbit_prepare = true;
                spec.precision = Precision::Bf16;
            }
        }
    }
    spec
}

/// A configuration, evaluated.
#[derive(Clone, Debug, PartialEq)]
pub struct Evaluation {
    pub knobs: Knobs,
    pub peak_allocated_bytes: u64,
    pub peak_reserved_bytes: u64,
    /// What the process holds on the device: reserved, CUDA context, NCCL.
    pub device_bytes: u64,
    pub fits: bool,
    /// Estimated step time (per optimizer step, same tokens) relative to the spec's.
    pub slowdown: f64,
    pub fidelity: Fidelity,
    /// Part of the memory is computed from the breakdown, not simulated.
    pub computed: bool,
}

impl Evaluation {
    /// Free device memory left (negative: short by that much).
    pub fn headroom_bytes(&self, gpu: &Gpu) -> i128 {
        gpu.total_bytes as i128 - self.device_bytes as i128
    }
}

/// What NCCL (DeepSpeed's groups, on one rank too) holds on each rank of `k` over the setup's
/// GPUs (measured per strategy; a computed sharding is charged DDP's single communicator).
pub fn nccl_bytes(setup: &Setup, k: &Knobs) -> u64 {
    let spec = spec_for(setup, k);
    let ddp = Parallel {
        strategy: Strategy::Ddp,
        world_size: u64::from(setup.gpus),
        reshard_after_forward: true,
        shard_size: u64::from(setup.gpus),
        offload_params: false,
        offload_optimizer: false,
        mixed_precision: None,
        units: FsdpUnits::Layers,
        tensor: TensorParallel::default(),
        pipeline: Default::default(),
        fsdp1: Fsdp1Options::default(),
    };
    match parallel_for(&spec, k, setup.gpus) {
        Some(p) => estimate::nccl_bytes(Some(&p)),
        None if setup.gpus > 1 => estimate::nccl_bytes(Some(&ddp)),
        None => 0,
    }
}

/// Estimates made by [`simulate`] in this process, for a progress display.
static ESTIMATES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// How many configurations this process has estimated so far (`fit` makes dozens to
/// hundreds): what a progress display counts.
pub fn estimates_made() -> u64 {
    ESTIMATES.load(std::sync::atomic::Ordering::Relaxed)
}

/// Estimate the simulated part of `k` on the setup's GPU. Resident models and NCCL hold part
/// of the device outside the simulated run, so its allocator gets what they leave (the
/// estimator takes NCCL off itself when the run it simulates is data parallel).
pub fn simulate(setup: &Setup, k: &Knobs) -> Result<Estimate> {
    let mut spec = spec_for(setup, k);
    let parallel = parallel_for(&spec, k, setup.gpus);
    let mut outside = if parallel.is_none() {
        nccl_bytes(setup, k)
    } else {
        0
    };
    if !k.residents_off_gpu {
        outside += setup.residents.iter().map(|r| r.weights_bytes).sum::<u64>();
    }
    let gpu = Gpu {
        total_bytes: setup.gpu.total_bytes.saturating_sub(outside),
        ..setup.gpu.clone()
    };
    if parallel.is_some() {
        // Over other ranks, or another strategy, than the spec's, a layout may not hold
        // (FSDP1 over one rank, autocast meant for a policy the strategy lacks): no answer.
        spec.parallel = parallel;
        spec = spec.rechecked().map_err(|e| Error::Unsupported {
            what: format!("this configuration over {} GPUs ({e})", setup.gpus),
            supported: "the layouts a spec can say".into(),
        })?;
    }
    ESTIMATES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let mut est = estimate::estimate(&spec, setup.spec_dir, &gpu)?;
    est.gpu = setup.gpu.clone();
    Ok(est)
}

/// Evaluate `k` whose simulated part was estimated as `est`.
pub fn evaluate_with(setup: &Setup, k: &Knobs, est: &Estimate) -> Evaluation {
    let base = Knobs::of(&setup.spec);
    let (allocated, reserved, removed) = computed_peaks(setup, k, est);
    let ranks = u64::from(setup.gpus.max(1));
    let device_bytes = reserved + est.cuda_context_bytes + nccl_bytes(setup, k);
    Evaluation {
        knobs: k.clone(),
        peak_allocated_bytes: allocated,
        peak_reserved_bytes: reserved,
        device_bytes,
        // A simulated configuration fits when the simulation at the GPU's capacity did not run
        // out (the allocator frees its cache and retries first, as PyTorch does); one with
        // memory computed away from the simulated run is judged by its computed bytes.
        fits: device_bytes <= setup.gpu.total_bytes && (removed || est.oom.is_none()),
        slowdown: cost_factor(k) / cost_factor(&base),
        fidelity: fidelity(&base, k),
        computed: k.has_computed()
            || (ranks > 1 && parallel_for(&setup.spec, k, setup.gpus).is_none())
            || !setup.residents.is_empty(),
    }
}

/// Simulate and evaluate `k`.
pub fn evaluate(setup: &Setup, k: &Knobs) -> Result<Evaluation> {
    Ok(evaluate_with(setup, k, &simulate(setup, k)?))
}

/// An estimate of a configuration the search made up, `None` when the estimator does not
/// model it (LoRA beside the spec's own FSDP, a fused AdamW under its ZeRO) or no device
/// could hold it: such a configuration is no answer, and the others still are.
fn candidate(estimate: Result<Estimate>) -> Result<Option<Estimate>> {
    match estimate {
        Ok(est) => Ok(Some(est)),
        Err(Error::Unsupported { .. } | Error::BeyondAnyDevice { .. }) => Ok(None),
        Err(e) => Err(e),
    }
}

/// Whether `k` fits; one that no device could hold does not.
fn fits(setup: &Setup, k: &Knobs) -> Result<bool> {
    Ok(candidate(simulate(setup, k))?.is_some_and(|est| evaluate_with(setup, k, &est).fits))
}

/// Whether the spec lays the model out over several GPUs a replica (pipeline, tensor or
/// context parallelism): the knob search changes data parallelism alone, and would drop it.
fn model_parallel(spec: &RunSpec) -> bool {
    spec.parallel
        .as_ref()
        .is_some_and(|p| p.tensor.tp > 1 || p.tensor.cp > 1 || p.pipeline.pp > 1)
}

/// Whether Megatron-core lays the model out (its own DDP and optimizer, not the strategies
/// the planner searches).
fn megatron(p: &Parallel) -> bool {
    p.tensor.framework == crate::spec::Framework::Megatron
}

/// The spec as given, with its residents and ranks.
pub fn baseline(setup: &Setup) -> Result<(Estimate, Evaluation)> {
    // Remedies change data parallelism, offload and the step; they would drop a tensor- or
    // pipeline-parallel layout rather than search it (`fit`'s layout search covers tensor
    // parallelism).
    if let Some(p) = setup
        .spec
        .parallel
        .as_ref()
        .filter(|p| p.tensor.tp > 1 || p.tensor.cp > 1 || p.pipeline.pp > 1 || megatron(p))
    {
        let (what, supported) = if megatron(p) {
            (
                "remedies of a Megatron-core spec (parallel.framework megatron)",
                "`headroom estimate` of a Megatron-core layout; remedies search data parallelism \
                 as PyTorch and DeepSpeed apply it",
            )
        } else {
            (
                "remedies of a pipeline-, tensor- or context-parallel spec (parallel.pp, tp or \
                 cp > 1)",
                "`headroom estimate` of such a layout, and `fit`, whose layout search covers \
                 pipeline, tensor and context parallelism; remedies search data parallelism",
            )
        };
        return Err(Error::Unsupported {
            what: what.into(),
            supported: supported.into(),
        });
    }
    as_given(setup)
}

/// The spec as given, with its residents and ranks, whatever its pipeline-, data-, context-
/// and tensor-parallel layout.
fn as_given(setup: &Setup) -> Result<(Estimate, Evaluation)> {
    if setup
        .spec
        .parallel
        .as_ref()
        .is_some_and(|p| p.tensor.ep > 1)
    {
        return Err(Error::Unsupported {
            what: "fit and remedies of an expert-parallel spec (parallel.ep)".into(),
            supported: "`headroom estimate` of such a layout; the searches change data, \
                        pipeline, tensor and context parallelism and would drop it"
                .into(),
        });
    }
    if setup
        .spec
        .parallel
        .as_ref()
        .is_some_and(|p| p.tensor.framework == crate::spec::Framework::Transformers)
    {
        return Err(Error::Unsupported {
            what: "fit and remedies of transformers' own tensor parallelism (parallel.framework \
                   transformers)"
                .into(),
            supported: "`headroom estimate` of such a layout (tp = world_size, its one layout); \
                        `fit` searches torchtitan's and Megatron-core's layouts"
                .into(),
        });
    }
    if let Some(p) = setup.spec.parallel.as_ref() {
        let replica = p.pipeline.pp * p.tensor.cp * p.tensor.tp;
        if !u64::from(setup.gpus).is_multiple_of(replica) {
            return Err(Error::field(
                "--gpus",
                setup.gpus,
                format!(
                    "the spec's parallel.pp × cp × tp ({replica}) must divide it: the GPUs are \
                     pp × dp × cp × tp; use a multiple of {replica}"
                ),
            ));
        }
    }
    let k = Knobs::of(&setup.spec);
    let est = simulate(setup, &k)?;
    let eval = evaluate_with(setup, &k, &est);
    Ok((est, eval))
}

/// Which components at the peak a phase is certain to hold too.
fn live_in(c: Component, phase: &PhasePeak, is_peak: bool) -> bool {
    match c {
        Component::Weights => true,
        // States appear during step 1's optimizer step and stay.
        Component::OptimizerStates => is_peak || phase.step >= 2,
        // `zero_grad(set_to_none=True)` drops gradients before each forward; a backward peak
        // may come before most of them exist.
        Component::Gradients => is_peak || phase.phase == "optimizer",
        Component::OptimizerTemporaries => is_peak || phase.phase == "optimizer",
        Component::LogitsAndLoss => is_peak || matches!(phase.phase, "forward" | "backward"),
        _ => is_peak,
    }
}

/// Peak allocated and reserved once the computed knobs are applied to `est`.
/// Peak allocated and reserved bytes of `k`, and whether any were computed away from the
/// simulated run.
fn computed_peaks(setup: &Setup, k: &Knobs, est: &Estimate) -> (u64, u64, bool) {
    let ranks = f64::from(setup.gpus.max(1));
    let simulated = parallel_for(&setup.spec, k, setup.gpus).is_some();
    let shard = if simulated { 0.0 } else { 1.0 - 1.0 / ranks };
    let offloaded = k.cpu_offload && !simulated;
    let mut removed = [0.0f64; Component::COUNT];
    let frac = |c: Component| -> f64 {
        match c {
            Component::OptimizerStates | Component::OptimizerTemporaries => {
                if offloaded {
                    1.0
                } else if k.sharding >= Sharding::Zero1 {
                    shard
                } else {
                    0.0
                }
            }
            Component::Gradients => {
                if offloaded && k.sharding >= Sharding::Zero2 {
                    1.0
                } else if k.sharding >= Sharding::Zero2 {
                    shard
                } else {
                    0.0
                }
            }
            Component::Weights if k.sharding == Sharding::Zero3 && !simulated => shard,
            Component::LogitsAndLoss if k.computed_fused_loss() => 1.0,
            _ => 0.0,
        }
    };
    for &(c, bytes) in &est.breakdown {
        removed[c.index()] = frac(c) * bytes as f64;
    }
    let mut added = 0u64;
    if k.sharding == Sharding::Zero3 && setup.gpus > 1 && !simulated {
        added += zero3_gather_bytes(est);
    }
    if k.computed_fused_loss() {
        added += fused_loss_chunk_bytes(est, k);
    }
    if setup.gpus > 1
        && k.sharding == Sharding::None
        && setup.spec.mode == Mode::Train
        && !simulated
    {
        added += ddp_bucket_bytes(est, &spec_for(setup, k));
    }
    if !k.residents_off_gpu {
        added += setup.residents.iter().map(|r| r.weights_bytes).sum::<u64>();
    }
    let any_removed = removed.iter().any(|&r| r > 0.0);
    if !any_removed {
        // Loading is a phase of its own (step 0) and can peak above the steps (a 4-bit load
        // holds bf16 copies while it quantizes): the device must hold it too.
        let (load_allocated, load_reserved) = est
            .phases
            .iter()
            .filter(|p| p.step == 0)
            .fold((0, 0), |(a, r), p| {
                (a.max(p.peak_allocated), r.max(p.peak_reserved))
            });
        return (
            est.peak_allocated_bytes.max(load_allocated) + added,
            est.peak_reserved_bytes.max(load_reserved) + added,
            false,
        );
    }
    let peak_key = (est.peak_step, est.peak_phase);
    let allocated = est
        .phases
        .iter()
        .map(|p| {
            let is_peak = (p.step, p.phase) == peak_key;
            let cut: f64 = Component::ALL
                .iter()
                .filter(|&&c| live_in(c, p, is_peak))
                .map(|&c| removed[c.index()])
                .sum();
            (p.peak_allocated as f64 - cut).max(0.0) as u64
        })
        .max()
        .unwrap_or(est.peak_allocated_bytes);
    let gap = est
        .peak_reserved_bytes
        .saturating_sub(est.peak_allocated_bytes);
    (allocated + added, allocated + gap + added, true)
}

/// ZeRO-3 gathers one module's full weights at a time and prefetches the next: two of the
/// largest gathered unit (a decoder layer or the embedding) live at once.
fn zero3_gather_bytes(est: &Estimate) -> u64 {
    let a: &Architecture = &est.arch;
    if est.params == 0 {
        return 0;
    }
    let bytes_per_param = est.weights_loaded_bytes as f64 / est.params as f64;
    let per_layer = est.params.saturating_sub(a.vocab * a.hidden * 2) / a.layers.max(1);
    let largest = per_layer.max(a.vocab * a.hidden);
    (2.0 * largest as f64 * bytes_per_param) as u64
}

/// A fused linear + cross-entropy keeps one chunk of fp32 logits: Liger splits the
/// batch × sequence rows into chunks of about rows / ceil(vocab / hidden), a power of two.
fn fused_loss_chunk_bytes(est: &Estimate, k: &Knobs) -> u64 {
    let a = &est.arch;
    let rows = k.micro_batch * k.seq_len;
    let split = a.vocab.div_ceil(a.hidden.max(1)).max(1);
    let chunk = rows
        .div_ceil(split)
        .next_power_of_two()
        .min(rows.next_power_of_two());
    chunk * a.vocab * 4
}

/// DDP's reducer keeps flat buckets as large as all gradients (without
/// `gradient_as_bucket_view=True`).
fn ddp_bucket_bytes(est: &Estimate, spec: &RunSpec) -> u64 {
    let bytes = if spec.precision == Precision::Bf16 && spec.lora.is_none() {
        2
    } else {
        4
    };
    est.trainable_params * bytes
}

/// Relative time of an optimizer step (the spec's batch, in micro-batches): rough factors.
/// Checkpointing recomputes each layer's forward (forward ≈ 1/3 of forward + backward);
/// LoRA skips the weight-gradient GEMMs of frozen layers; QLoRA dequantizes 4-bit weights in
/// every GEMM; ZeRO-3 moves 1.5× DDP's bytes; CPU offload runs Adam on the CPU and streams
/// states over PCIe; shorter sequences process fewer tokens.
pub fn cost_factor(k: &Knobs) -> f64 {
    let mut f = k.seq_len as f64;
    if k.gradient_checkpointing {
        f *= 4.0 / 3.0;
    }
    f *= match k.adapter {
        Adapter::Full => 1.0,
        Adapter::Lora => 0.8,
        Adapter::Qlora => 1.05,
    };
    let tokens = (k.micro_batch * k.seq_len) as f64;
    f *= 1.0 + HALF_EFFICIENCY_TOKENS / tokens;
    if k.sharding == Sharding::Zero3 {
        f *= 1.15;
    }
    if k.cpu_offload {
        f *= 1.5;
    }
    f
}

/// One number to rank configurations by: step time, with a price on departing from the
/// spec's training (8-bit states +10%, adapters +35%, a 4-bit base +50%), so that a free
/// exact change beats a slower one and both beat changing what is trained.
pub fn score(e: &Evaluation) -> f64 {
    let penalty = match e.fidelity {
        Fidelity::Exact => 0.0,
        Fidelity::QuantizedOptimizer => 0.10,
        Fidelity::Adapters => 0.35,
        Fidelity::QuantizedBase => 0.50,
    };
    e.slowdown * (1.0 + penalty)
}

/// Headroom a recommendation keeps: the estimate's reserved bytes are within 3.8% of the
/// measured ones on every calibration row (p90 2%), so a plan with less is a coin toss.
pub const SAFETY_MARGIN: f64 = 0.03;

/// The fitting configuration to recommend: the best score, then the fewest changes, then the
/// least memory, among those that keep `SAFETY_MARGIN` of the GPU free (any that fits when
/// none does).
pub fn cheapest_fit<'e>(setup: &Setup, evals: &'e [Evaluation]) -> Option<&'e Evaluation> {
    let key = |e: &&Evaluation| {
        (
            (score(e) * 1000.0).round() as i64,
            describe(setup, &e.knobs).len(),
            e.device_bytes,
        )
    };
    let safe = (setup.gpu.total_bytes as f64 * (1.0 - SAFETY_MARGIN)) as u64;
    evals
        .iter()
        .filter(|e| e.device_bytes <= safe)
        .min_by_key(key)
        .or_else(|| evals.iter().filter(|e| e.fits).min_by_key(key))
}

fn fidelity(base: &Knobs, k: &Knobs) -> Fidelity {
    let mut f = Fidelity::Exact;
    if k.optimizer == Optimizer::AdamW8bit && base.optimizer != Optimizer::AdamW8bit {
        f = f.max(Fidelity::QuantizedOptimizer);
    }
    if k.adapter > base.adapter {
        f = f.max(match k.adapter {
            Adapter::Qlora => Fidelity::QuantizedBase,
            _ => Fidelity::Adapters,
        });
    }
    f
}

/// The changes from the spec that `k` makes, in words (a trainer's in its own settings).
pub fn describe(setup: &Setup, k: &Knobs) -> Vec<String> {
    let base = Knobs::of(&setup.spec);
    if k.trainer != TrainerKind::Loop {
        return describe_trainer(setup, &base, k);
    }
    let mut out = Vec::new();
    if k.optimizer != base.optimizer {
        out.push(k.optimizer.name().to_string());
    }
    if k.gradient_checkpointing != base.gradient_checkpointing {
        out.push(match setup.launcher {
            Launcher::Accelerate if fsdp_launch(setup, k) => format!(
                "fsdp_activation_checkpointing: {}",
                k.gradient_checkpointing
            ),
            _ if k.gradient_checkpointing => "gradient checkpointing".to_string(),
            _ => "no gradient checkpointing".to_string(),
        });
    }
    if k.adapter != base.adapter {
        let experts_frozen = match remedy_lora(&setup.spec, setup.spec_dir).targets {
            LoraTargets::Modules(_) => " on attention, experts frozen",
            LoraTargets::AllLinear => "",
        };
        out.push(match k.adapter {
            Adapter::Full => "full fine-tuning".to_string(),
            Adapter::Lora => format!("LoRA r=16{experts_frozen}"),
            Adapter::Qlora => format!("QLoRA (nf4 + LoRA r=16{experts_frozen})"),
        });
    }
    if k.micro_batch != base.micro_batch {
        out.push(format!(
            "micro-batch {} × {} accumulation",
            k.micro_batch, k.accumulation
        ));
    }
    if k.seq_len != base.seq_len {
        out.push(format!("seq_len {}", k.seq_len));
    }
    if k.expandable_segments != base.expandable_segments {
        out.push("expandable_segments".to_string());
    }
    out.extend(describe_sharding(setup, &base, k));
    if k.fused_loss {
        out.push("fused linear cross-entropy".to_string());
    }
    if k.residents_off_gpu {
        out.push("resident models off the GPU".to_string());
    }
    out
}

/// The changes `k` makes to a trainer's run, in the settings of `TrainingArguments` and TRL's
/// configs.
fn describe_trainer(setup: &Setup, base: &Knobs, k: &Knobs) -> Vec<String> {
    let spec = spec_for(setup, k);
    let mut out = Vec::new();
    if k.optimizer != base.optimizer {
        out.push(format!("optim=\"{}\"", optim_name(k.optimizer)));
    }
    if k.gradient_checkpointing != base.gradient_checkpointing {
        out.push(format!(
            "gradient_checkpointing={}",
            python_bool(k.gradient_checkpointing)
        ));
    }
    if k.adapter != base.adapter {
        out.push(match k.adapter {
            Adapter::Full => "no peft_config (full fine-tuning)".to_string(),
            Adapter::Lora => format!(
                "peft_config=LoraConfig(r=16, target_modules={})",
                lora_targets_words(setup)
            ),
            Adapter::Qlora => "4-bit NF4 base (BitsAndBytesConfig) + LoRA r=16".to_string(),
        });
    }
    if k.micro_batch != base.micro_batch {
        out.push(format!(
            "per_device_train_batch_size={}, gradient_accumulation_steps={}",
            spec.batch_size, spec.trainer.gradient_accumulation_steps
        ));
    }
    if k.seq_len != base.seq_len {
        out.push(match &spec.trainer.grpo {
            Some(grpo) => format!("max_completion_length={}", grpo.completion_len),
            None => format!("max_length={}", spec.seq_len),
        });
    }
    if k.expandable_segments != base.expandable_segments {
        out.push("PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True".to_string());
    }
    if k.fused_loss != base.fused_loss {
        out.push("use_liger_kernel=True".to_string());
    }
    if k.precompute_ref_log_probs != base.precompute_ref_log_probs {
        out.push("precompute_ref_log_probs=True".to_string());
    }
    out.extend(describe_sharding(setup, base, k));
    out
}

/// Whether `k` runs under FSDP.
fn fsdp_launch(setup: &Setup, k: &Knobs) -> bool {
    parallel_for(&spec_for(setup, k), k, setup.gpus).is_some_and(|p| p.strategy == Strategy::Fsdp)
}

/// A change of sharding or CPU offload from the spec's, in words: an accelerate config's
/// keys when it launches the run.
fn describe_sharding(setup: &Setup, base: &Knobs, k: &Knobs) -> Vec<String> {
    if setup.launcher == Launcher::Accelerate {
        return describe_accelerate_sharding(setup, base, k);
    }
    let mut out = Vec::new();
    if k.sharding != base.sharding {
        let gpus = setup.gpus;
        out.push(match k.sharding {
            Sharding::None => format!("DDP over {gpus} GPUs (no sharding)"),
            Sharding::Zero1 => format!("ZeRO-1 over {gpus} GPUs"),
            Sharding::Zero2 => format!("ZeRO-2 over {gpus} GPUs"),
            Sharding::Zero3 => format!("ZeRO-3/FSDP over {gpus} GPUs"),
        });
    }
    if k.cpu_offload != base.cpu_offload {
        out.push(match parallel_for(&setup.spec, k, setup.gpus) {
            _ if !k.cpu_offload => "optimizer on the GPU".to_string(),
            Some(p) if p.strategy == Strategy::Fsdp => "FSDP2 CPUOffloadPolicy".to_string(),
            Some(p) if p.world_size == 1 => "optimizer on CPU (DeepSpeed ZeRO-Offload)".to_string(),
            Some(_) => "optimizer on CPU (DeepSpeed offload_optimizer)".to_string(),
            None => "optimizer on CPU".to_string(),
        });
    }
    out
}

/// A change of sharding or CPU offload as the accelerate config that launches it says it.
fn describe_accelerate_sharding(setup: &Setup, base: &Knobs, k: &Knobs) -> Vec<String> {
    if (k.sharding, k.cpu_offload) == (base.sharding, base.cpu_offload) {
        return Vec::new();
    }
    let parallel = parallel_for(&spec_for(setup, k), k, setup.gpus);
    let zero = |stage: u8, offload: bool| {
        format!(
            "distributed_type: DEEPSPEED (zero_stage: {stage}{})",
            if offload {
                ", offload_optimizer_device: cpu"
            } else {
                ""
            }
        )
    };
    vec![
        match parallel.map(|p| (p.strategy, p.offload_params, p.offload_optimizer)) {
            Some((Strategy::Ddp, ..)) => "distributed_type: MULTI_GPU".to_string(),
            Some((Strategy::NoDataParallel, ..)) => "tensor parallelism alone".to_string(),
            Some((Strategy::Fsdp, offload, _)) => {
                format!("distributed_type: FSDP (fsdp_version: 2, fsdp_offload_params: {offload})")
            }
            Some((Strategy::Fsdp1, offload, _)) => {
                format!("distributed_type: FSDP (fsdp_version: 1, fsdp_offload_params: {offload})")
            }
            Some((Strategy::Zero1, _, offload)) => zero(1, offload),
            Some((Strategy::Zero2, _, offload)) => zero(2, offload),
            Some((Strategy::Zero3, _, offload)) => zero(3, offload),
            None => match k.sharding {
                Sharding::None => "distributed_type: MULTI_GPU (computed)".to_string(),
                Sharding::Zero1 => format!("{} (computed)", zero(1, k.cpu_offload)),
                Sharding::Zero2 => format!("{} (computed)", zero(2, k.cpu_offload)),
                Sharding::Zero3 => format!("{} (computed)", zero(3, k.cpu_offload)),
            },
        },
    ]
}

/// `TrainingArguments.optim` for an optimizer.
pub fn optim_name(optimizer: Optimizer) -> &'static str {
    match optimizer {
        Optimizer::AdamW | Optimizer::AdamWForLoop => "adamw_torch",
        Optimizer::AdamWFused => "adamw_torch_fused",
        Optimizer::AdamW8bit => "adamw_bnb_8bit",
        Optimizer::Adafactor => "adafactor",
        Optimizer::Sgd => "sgd",
        Optimizer::None => "none",
    }
}

fn python_bool(on: bool) -> &'static str {
    if on { "True" } else { "False" }
}

/// `fits(n)` is true for n = lo; find the largest n ≤ cap with fits(n) and !fits(n + 1)
/// (or cap): doubling, then bisection.
fn largest_fitting(lo: u64, cap: u64, mut fits: impl FnMut(u64) -> Result<bool>) -> Result<u64> {
    let mut good = lo;
    let mut bad = None;
    let mut probe = lo;
    while bad.is_none() {
        let next = probe.saturating_mul(2).min(cap);
        if next == probe {
            return Ok(good);
        }
        if fits(next)? {
            good = next;
            probe = next;
        } else {
            bad = Some(next);
        }
    }
    let mut bad = bad.unwrap_or(cap + 1);
    while bad - good > 1 {
        let mid = good + (bad - good) / 2;
        if fits(mid)? {
            good = mid;
        } else {
            bad = mid;
        }
    }
    Ok(good)
}

/// Largest micro-batch that fits, everything else as the spec says; `None` if 1 does not.
pub fn max_micro_batch(setup: &Setup) -> Result<Option<u64>> {
    let base = Knobs::of(&setup.spec);
    // A pipeline splits the batch into its micro-batches: batches come in multiples of them.
    let unit = setup
        .spec
        .parallel
        .as_ref()
        .map_or(1, |p| p.pipeline.microbatches);
    let fits = |n: u64| {
        let k = Knobs {
            micro_batch: n * unit,
            ..base.clone()
        };
        fits(setup, &k)
    };
    if !fits(1)? {
        return Ok(None);
    }
    Ok(Some(largest_fitting(1, (1 << 16) / unit, fits)? * unit))
}

/// Longest sequence (up to the model's positions) that fits at the spec's micro-batch;
/// `None` if 1 token does not.
pub fn max_seq_len(setup: &Setup, max_positions: u64) -> Result<Option<u64>> {
    let base = Knobs::of(&setup.spec);
    // Context parallelism cuts the sequence into 2 × cp chunks, and sequence parallelism
    // shards each rank's over the tensor-parallel ranks: lengths come in multiples of both.
    let unit = setup.spec.parallel.as_ref().map_or(1, |p| {
        let t = p.tensor;
        let chunks = if t.cp > 1 { 2 * t.cp } else { 1 };
        let shards = if t.sequence_parallel { t.cp * t.tp } else { 1 };
        least_common_multiple(chunks, shards)
    });
    let fits = |n: u64| {
        let k = Knobs {
            seq_len: n * unit,
            ..base.clone()
        };
        fits(setup, &k)
    };
    if !fits(1)? {
        return Ok(None);
    }
    Ok(Some(
        largest_fitting(1, (max_positions / unit).max(1), fits)? * unit,
    ))
}

fn least_common_multiple(a: u64, b: u64) -> u64 {
    let (mut x, mut y) = (a, b);
    while y != 0 {
        (x, y) = (y, x % y);
    }
    a / x * b
}

/// Every configuration of the search space, evaluated (the spec's own first).
pub fn search(setup: &Setup) -> Result<Vec<Evaluation>> {
    let base = Knobs::of(&setup.spec);
    let train = setup.spec.mode == Mode::Train;
    let mut optimizers = vec![base.optimizer];
    if train
        && matches!(
            base.optimizer,
            Optimizer::AdamW | Optimizer::AdamWForLoop | Optimizer::AdamWFused
        )
    {
        optimizers.extend([Optimizer::AdamWFused, Optimizer::AdamW8bit]);
    }
    optimizers.dedup();
    let checkpointing: &[bool] = if train { &[false, true] } else { &[false] };
    let adapters: Vec<Adapter> = if train {
        [Adapter::Full, Adapter::Lora, Adapter::Qlora]
            .into_iter()
            .filter(|&a| a >= base.adapter)
            .collect()
    } else {
        vec![base.adapter]
    };
    let mut batches = vec![base.micro_batch];
    let mut b = base.micro_batch;
    while b > 1 {
        b = b.div_ceil(2);
        batches.push(b);
    }
    let shardings: &[Sharding] = if setup.gpus > 1 && train {
        &[
            Sharding::None,
            Sharding::Zero1,
            Sharding::Zero2,
            Sharding::Zero3,
        ]
    } else {
        &[Sharding::None]
    };
    let offloads: &[bool] = if train && base.optimizer != Optimizer::None {
        &[false, true]
    } else {
        &[false]
    };
    let expandables: &[bool] = if base.expandable_segments {
        &[true]
    } else {
        &[false, true]
    };
    let residents_off: &[bool] = if setup.residents.is_empty() {
        &[false]
    } else {
        &[false, true]
    };

    let mut out = vec![baseline(setup)?.1];
    for &optimizer in &optimizers {
        for &gradient_checkpointing in checkpointing {
            for &adapter in &adapters {
                for &expandable_segments in expandables {
                    for &micro_batch in &batches {
                        let sim = Knobs {
                            optimizer,
                            gradient_checkpointing,
                            adapter,
                            expandable_segments,
                            micro_batch,
                            accumulation: base.micro_batch.div_ceil(micro_batch),
                            ..base.clone()
                        };
                        let Some(plain) = candidate(simulate(setup, &sim))? else {
                            continue;
                        };
                        let plain_parallel = parallel_for(&setup.spec, &sim, setup.gpus);
                        let plain_sharded = plain_parallel
                            .as_ref()
                            .is_some_and(|p| p.strategy != Strategy::Ddp);
                        for &sharding in shardings {
                            for &cpu_offload in offloads {
                                let sharded = Knobs {
                                    sharding,
                                    cpu_offload,
                                    ..sim.clone()
                                };
                                // A sharding or offload the estimator models is a run of its
                                // own; the computed ones start from the plain run.
                                let own = match parallel_for(&setup.spec, &sharded, setup.gpus)
                                    .filter(|p| Some(p) != plain_parallel.as_ref())
                                {
                                    Some(_) => match candidate(simulate(setup, &sharded))? {
                                        Some(est) => Some(est),
                                        None => continue,
                                    },
                                    // Computed shares come off an unsharded run only.
                                    None if plain_sharded
                                        && (sharding, cpu_offload)
                                            != (sim.sharding, sim.cpu_offload) =>
                                    {
                                        continue;
                                    }
                                    None => None,
                                };
                                let est = own.as_ref().unwrap_or(&plain);
                                // TRL's trainers always run their fused head; `Trainer`
                                // runs liger's (a run of its own), the loop a computed one.
                                let fused_losses: &[bool] = match base.trainer {
                                    t if t.is_trl() => &[true],
                                    TrainerKind::Hf => &[base.fused_loss],
                                    _ => &[false, true],
                                };
                                for &fused_loss in fused_losses {
                                    for &residents_off_gpu in residents_off {
                                        let k = Knobs {
                                            fused_loss,
                                            residents_off_gpu,
                                            ..sharded.clone()
                                        };
                                        if k != base {
                                            out.push(evaluate_with(setup, &k, est));
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    out.dedup_by(|a, b| a.knobs == b.knobs);
    Ok(out)
}

/// The configurations that fit and that no other fitting one beats at once on device memory,
/// step time, fidelity and the number of changes (memory counts as better only by more than
/// 1% or 256 MiB, the estimate's own error); best `score` first.
pub fn pareto(setup: &Setup, evals: &[Evaluation]) -> Vec<Evaluation> {
    let fitting: Vec<(&Evaluation, usize)> = evals
        .iter()
        .filter(|e| e.fits)
        .map(|e| (e, describe(setup, &e.knobs).len()))
        .collect();
    let margin = |e: &Evaluation| (e.device_bytes / 100).max(256 << 20);
    let dominates = |(o, oc): (&Evaluation, usize), (e, ec): (&Evaluation, usize)| {
        let no_worse = o.device_bytes <= e.device_bytes + margin(e)
            && o.slowdown <= e.slowdown + 1e-9
            && o.fidelity <= e.fidelity
            && oc <= ec;
        let better = o.device_bytes + margin(e) < e.device_bytes
            || o.slowdown < e.slowdown - 1e-9
            || o.fidelity < e.fidelity
            || oc < ec;
        no_worse && better
    };
    let mut front: Vec<(&Evaluation, usize)> = fitting
        .iter()
        .copied()
        .filter(|&e| !fitting.iter().any(|&o| dominates(o, e)))
        .collect();
    front.sort_by(|a, b| {
        score(a.0)
            .total_cmp(&score(b.0))
            .then(a.1.cmp(&b.1))
            .then(a.0.device_bytes.cmp(&b.0.device_bytes))
    });
    front.into_iter().map(|(e, _)| e.clone()).collect()
}

/// The answer of `headroom fit`.
#[derive(Clone, Debug)]
pub struct FitReport {
    pub baseline: Evaluation,
    pub estimate: Estimate,
    pub max_micro_batch: Option<u64>,
    pub max_seq_len: Option<u64>,
    /// The model's position limit, the cap of the sequence search.
    pub max_positions: u64,
    pub evaluated: usize,
    pub front: Vec<Evaluation>,
    /// The search of the knobs above ran: it keeps data parallelism, so a tensor-parallel
    /// spec leaves it to the layout search.
    pub knobs_searched: bool,
    pub layouts: Layouts,
}

/// The layout search of a `fit`, or why there is none.
#[derive(Clone, Debug)]
pub enum Layouts {
    Searched(Box<layout::LayoutSearch>),
    NotSearched(String),
}

/// Answer `headroom fit` for `setup`.
pub fn fit(setup: &Setup) -> Result<FitReport> {
    let (estimate, baseline) = as_given(setup)?;
    let max_positions = estimate.arch.max_positions;
    // The knobs are PyTorch's and DeepSpeed's; a Megatron-core spec's are its layout's.
    let knobs_searched =
        !model_parallel(&setup.spec) && !setup.spec.parallel.as_ref().is_some_and(megatron);
    let all = if knobs_searched {
        search(setup)?
    } else {
        Vec::new()
    };
    let layouts = match layout::applies(setup) {
        Ok(()) => Layouts::Searched(Box::new(layout::search(setup)?)),
        Err(why) => Layouts::NotSearched(why),
    };
    Ok(FitReport {
        knobs_searched,
        layouts,
        max_micro_batch: max_micro_batch(setup)?,
        max_seq_len: max_seq_len(setup, max_positions)?,
        max_positions,
        evaluated: all.len(),
        front: pareto(setup, &all),
        baseline,
        estimate,
    })
}
