//! The run spec: the contract between users (and the measuring harness) and the estimator.
//! YAML or JSON; see README "Run spec" for the keys. Every value is checked here, so the
//! estimator only ever sees runs it can model; a bad one names the field, the value and what
//! is allowed.

use std::path::Path;

use serde_json::Value;

use super::expert_parallel;
use super::megatron::{Megatron, Recompute, RecomputeMethod, parse_megatron};
use super::parse::{
    RUN_SPEC_KEY, boolean, choice, parse_document, positive, read_document, unknown_key,
};
use super::pipeline_parallel::{self, PipelineParallel};
use super::tp_plan;
use super::trainer::{TRAINER_KEYS, TrainerKind, TrainerSpec};
use super::versions::Versions;
use crate::arch::{Architecture, Head, Module};
use crate::catalog::{self, ResolvedModel};
use crate::dtype::DType;
use crate::error::{Error, Result, SHOWN_CHARS, shown};
use crate::limits;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Task {
    CausalLm,
    SeqCls,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Mode {
    Train,
    /// The no-grad reference log-prob pass of RL frameworks.
    Forward,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Precision {
    Fp32,
    /// fp32 parameters, forward under `torch.autocast(bfloat16)`.
    AmpBf16,
    /// fp32 parameters, forward under `torch.autocast(float16)`, with a GradScaler.
    AmpFp16,
    /// Parameters in bf16 (forward under bf16 autocast, which changes little).
    Bf16,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Optimizer {
    /// `torch.optim.AdamW`, foreach implementation (the CUDA default).
    AdamW,
    AdamWFused,
    AdamWForLoop,
    /// `torch.optim.SGD(momentum=0.9)`.
    Sgd,
    /// `torch.optim.Adafactor`.
    Adafactor,
    /// `bitsandbytes.optim.AdamW8bit`.
    AdamW8bit,
    None,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Attention {
    Sdpa,
    Eager,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Quantization {
    /// bitsandbytes 4-bit NF4 with double quantization, bf16 compute.
    Nf4,
}

#[derive(Clone, Debug, PartialEq)]
pub enum LoraTargets {
    /// peft's `all-linear`: every linear layer but the output head.
    AllLinear,
    Modules(Vec<String>),
}

/// `config._experts_implementation`: which function runs the experts.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ExpertsImpl {
    /// `torch._grouped_mm` over tokens sorted by expert (transformers' default).
    #[default]
    GroupedMm,
    /// `bmm` over each (token, expert) pair with the expert's weights gathered per pair.
    BatchedMm,
    /// The class's own loop over the experts that received tokens.
    Eager,
}

impl ExpertsImpl {
    pub const NAMES: &'static str = "grouped_mm, batched_mm, eager";

    pub fn parse(name: &str) -> Option<ExpertsImpl> {
        match name {
            "grouped_mm" => Some(ExpertsImpl::GroupedMm),
            "batched_mm" => Some(ExpertsImpl::BatchedMm),
            "eager" => Some(ExpertsImpl::Eager),
            _ => None,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            ExpertsImpl::GroupedMm => "grouped_mm",
            ExpertsImpl::BatchedMm => "batched_mm",
            ExpertsImpl::Eager => "eager",
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Lora {
    pub r: u64,
    pub alpha: f64,
    pub targets: LoraTargets,
    pub dropout: f64,
    /// peft's `target_parameters`: the fused expert weights it wraps (`ExpertsGateUp`,
    /// `ExpertsDown`), and the router (`Router`) after peft's conversion.
    pub target_parameters: Vec<Module>,
}

/// What peft 0.21 calls the modules its transformers-v5 conversion
/// (`_convert_peft_config_moe`) moves from `target_modules` to `target_parameters` for the
/// families whose experts transformers 5 fused: the v4 names of the experts' projections and
/// the router.
struct V4ExpertNames {
    gate_up: [&'static str; 2],
    down: &'static str,
    router: &'static str,
}

fn v4_expert_names(family: crate::arch::Family) -> Option<V4ExpertNames> {
    use crate::arch::Family;
    match family {
        // `_MODEL_TO_CONVERSION_PATTERN` maps these to the qwen2_moe pattern; qwen2_moe itself
        // and gpt_oss are not in it, so peft leaves their configs alone.
        Family::Qwen3Moe | Family::Olmoe | Family::DeepseekV2 | Family::DeepseekV3 => {
            Some(V4ExpertNames {
                gate_up: ["gate_proj", "up_proj"],
                down: "down_proj",
                router: "gate",
            })
        }
        Family::Mixtral => Some(V4ExpertNames {
            gate_up: ["w1", "w3"],
            down: "w2",
            router: "gate",
        }),
        _ => None,
    }
}

impl Lora {
    /// The adapter as peft 0.21 builds it on `arch` under transformers 5: for MoE families
    /// whose experts were fused, names of the old per-expert projections and the router move
    /// from the modules to the parameters (both halves of gate_up or neither), `all-linear`
    /// included; the fused gate_up then gets twice the rank (`rank_pattern`).
    pub fn as_built_for(&self, arch: &Architecture) -> Result<BuiltLora> {
        let Some(names) = v4_expert_names(arch.family) else {
            return Ok(BuiltLora {
                lora: self.clone(),
                gate_up_rank: self.r,
            });
        };
        let mut modules: Vec<String> = match &self.targets {
            LoraTargets::AllLinear => {
                let mut all: Vec<String> = arch
                    .parameters(Head::CausalLm)
                    .iter()
                    .filter(|p| p.module.is_linear() && p.module != Module::LmHead)
                    .map(|p| p.module.hf_name().to_string())
                    .collect();
                all.extend(names.gate_up.iter().map(|n| n.to_string()));
                all.extend([names.down.to_string(), names.router.to_string()]);
                all.sort();
                all.dedup();
                all
            }
            LoraTargets::Modules(list) => list.clone(),
        };
        let mut parameters = self.target_parameters.clone();
        let mut add = |m: Module| {
            if !parameters.contains(&m) {
                parameters.push(m);
            }
        };
        let halves = names
            .gate_up
            .iter()
            .filter(|n| modules.iter().any(|m| m == *n))
            .count();
        if halves == 1 {
            return Err(Error::field(
                "lora.targets",
                format!("{:?}", modules),
                format!(
                    "peft fuses {} and {} into gate_up_proj on {}: target both or neither",
                    names.gate_up[0], names.gate_up[1], arch.model_type
                ),
            ));
        }
        if halves == 2 {
            add(Module::ExpertsGateUp);
        }
        if modules.iter().any(|m| m == names.down) {
            add(Module::ExpertsDown);
        }
        if modules.iter().any(|m| m == names.router) {
            add(Module::Router);
        }
        let moved = [names.gate_up[0], names.gate_up[1], names.down, names.router];
        modules.retain(|m| !moved.contains(&m.as_str()));
        Ok(BuiltLora {
            lora: Lora {
                targets: LoraTargets::Modules(modules),
                target_parameters: parameters,
                ..self.clone()
            },
            gate_up_rank: if halves == 2 { 2 * self.r } else { self.r },
        })
    }
}

/// A LoRA config as peft applies it to one model.
#[derive(Clone, Debug, PartialEq)]
pub struct BuiltLora {
    pub lora: Lora,
    /// The rank of the fused experts' gate_up adapter (doubled when peft fused two targets).
    pub gate_up_rank: u64,
}

/// How training is spread over GPUs; each rank runs the same step on its own micro-batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Strategy {
    /// `DistributedDataParallel`: a full replica per rank, gradients all-reduced in buckets.
    Ddp,
    /// FSDP2 `fully_shard` on every decoder layer, then on the root.
    Fsdp,
    /// FSDP1 `FullyShardedDataParallel` with a transformer auto-wrap policy: a flat parameter
    /// per decoder layer and one for the root (accelerate's `fsdp_version: 1`, older verl).
    Fsdp1,
    /// DeepSpeed ZeRO stage 1, 2 or 3.
    Zero1,
    Zero2,
    Zero3,
    /// No data-parallel wrapper: each rank holds its tensor-parallel shard whole
    /// (`world_size = tp`).
    NoDataParallel,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Parallel {
    pub strategy: Strategy,
    pub world_size: u64,
    /// FSDP: free a layer's gathered parameters after its forward and gather them again for
    /// its backward (full shard), or keep them until then (shard grad op).
    pub reshard_after_forward: bool,
    /// FSDP: the ranks that shard one copy of the model (HSDP replicates over
    /// `world_size / shard_size` such groups); `world_size` for plain FSDP.
    pub shard_size: u64,
    /// FSDP `CPUOffloadPolicy` (parameters, gradients and the optimizer step on the host);
    /// ZeRO-3 `offload_param`.
    pub offload_params: bool,
    /// ZeRO `offload_optimizer`: optimizer states and step on the host.
    pub offload_optimizer: bool,
    /// FSDP2's `MixedPrecisionPolicy`; `None`: parameters, gradients and reductions in the
    /// parameters' dtype.
    pub mixed_precision: Option<MixedPrecision>,
    /// FSDP2: which modules `fully_shard` makes units of.
    pub units: FsdpUnits,
    /// FSDP1's own settings.
    pub fsdp1: Fsdp1Options,
    /// Tensor parallelism on the inner mesh dimension (`world_size = dp × tp`); the
    /// strategy then spreads the data-parallel dimension.
    pub tensor: TensorParallel,
    /// Pipeline parallelism on the outer mesh dimension (`world_size = pp × dp × tp`).
    pub pipeline: PipelineParallel,
}

/// Tensor parallelism as a framework's plan applies it to each decoder layer.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TensorParallel {
    /// Ranks that split each layer's heads and MLP width; 1: none.
    pub tp: u64,
    /// Sequence parallelism: norms and the residual stream sharded on the sequence between
    /// the blocks (all-gather before each block, reduce-scatter after it).
    pub sequence_parallel: bool,
    pub framework: Framework,
    /// Context parallelism on the mesh dimension between the data- and tensor-parallel ones
    /// (`world_size = dp × cp × tp`): each rank holds `seq_len / cp` of every sequence and
    /// attention runs as a ring; FSDP2 shards over `dp × cp`. 1: none.
    pub cp: u64,
    /// Expert parallelism as transformers applies `base_model_ep_plan` (`spec::expert_parallel`):
    /// each of `world_size = ep` ranks holds `experts / ep` of every MoE layer. 1: none.
    pub ep: u64,
}

impl Default for TensorParallel {
    fn default() -> Self {
        TensorParallel {
            tp: 1,
            sequence_parallel: false,
            framework: Framework::Torchtitan,
            cp: 1,
            ep: 1,
        }
    }
}

/// Whose parallelisation plan a layout follows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Framework {
    /// torchtitan's Llama plan: DTensor `parallelize_module` (q/k/v, gate/up column-parallel,
    /// o/down row-parallel, the embedding row-parallel, the head column-parallel with
    /// `loss_parallel`), then FSDP2 over the data-parallel mesh dimension.
    Torchtitan,
    /// Megatron-core's GPTModel (local layer spec) with its own tensor-parallel layers,
    /// `DistributedDataParallel` over `world_size / tp` ranks and its optimizer
    /// (`spec::megatron`).
    Megatron,
    /// transformers' own plan (`from_pretrained(..., distributed_config=
    /// DistributedConfig(tp_size=tp))`: the config's `base_model_tp_plan`, the head's
    /// `colwise_gather_output`), alone over every rank (`spec::tp_plan`).
    Transformers,
}

/// `FullyShardedDataParallel`'s settings that change memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Fsdp1Options {
    /// The original parameters as views of the flat one (the optimizer steps them, each
    /// aligned in the flat parameter); false: the optimizer steps the flat shards.
    pub use_orig_params: bool,
    pub backward_prefetch: BackwardPrefetch,
}

impl Default for Fsdp1Options {
    fn default() -> Self {
        Fsdp1Options {
            use_orig_params: true,
            backward_prefetch: BackwardPrefetch::Pre,
        }
    }
}

/// When FSDP1 gathers the next unit in backward.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackwardPrefetch {
    /// `BACKWARD_PRE`: in a unit's pre-backward hook (torch's default).
    Pre,
    /// `BACKWARD_POST`: in its post-backward hook, once its own parameters are freed.
    Post,
    /// None: each unit is gathered when its backward starts (accelerate's default).
    None,
}

/// The `fully_shard` calls a training framework makes on a decoder-only model; each unit is
/// gathered and freed on its own.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FsdpUnits {
    /// Each decoder layer, then `fully_shard(model, reshard_after_forward=R)`: the root holds
    /// the embedding, the final norm and the head, and reshards as the layers do.
    #[default]
    Layers,
    /// Each decoder layer, then `fully_shard(model)`: FSDP2 keeps the root gathered from its
    /// forward to its backward (slime).
    LayersKeepRoot,
    /// Each decoder layer, the input embedding when it is not tied to the head, then the
    /// root with `reshard_after_forward=R` (verl).
    LayersEmbedding,
    /// accelerate 1.15's `fsdp2_prepare_model`: each decoder layer, the untied input
    /// embedding, `[final norm, head]` (the tied embedding too) kept gathered from forward to
    /// backward, then a root without parameters.
    Accelerate,
}

impl FsdpUnits {
    pub fn name(self) -> &'static str {
        match self {
            FsdpUnits::Layers => "layers",
            FsdpUnits::LayersKeepRoot => "layers-keep-root",
            FsdpUnits::LayersEmbedding => "layers-embedding",
            FsdpUnits::Accelerate => "accelerate",
        }
    }
}

/// FSDP2's `MixedPrecisionPolicy` over parameters stored in the spec's `precision` (fp32
/// masters): the unsharded parameters (and so the forward and backward) in `param_dtype`,
/// gradients reduced in `reduce_dtype` (`None`: `param_dtype`), the root's outputs cast to
/// `output_dtype`, floating inputs cast to `param_dtype`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MixedPrecision {
    pub param_dtype: DType,
    pub reduce_dtype: Option<DType>,
    pub output_dtype: Option<DType>,
    pub cast_forward_inputs: bool,
}

impl Parallel {
    /// Whether ranks hold different amounts: DeepSpeed ZeRO cuts its flat buffer into
    /// partitions at different parameters, and context parallelism's ring runs different steps
    /// on each rank (bench/nccl-x2), so estimates simulate the last rank and
    /// [`Parallel::other_ranks`] and report the one that needs most. FSDP2 and DDP ranks are
    /// alike (measured to the byte).
    pub fn ranks_differ(&self) -> bool {
        matches!(self.strategy, Strategy::Zero1 | Strategy::Zero2) && self.world_size > 1
            || self.pipeline.pp > 1
            || self.tensor.cp > 1
    }

    /// The ranks an estimate simulates besides the last, where ranks differ outside pipelines:
    /// rank 0; and, with a ring of 3 or more, its second rank (global rank `tp`), which runs
    /// both kinds of ring step and so may need more than either end (`engine::ring_attention`).
    pub fn other_ranks(&self) -> Vec<u64> {
        let mut ranks = vec![0];
        if self.tensor.cp > 2 {
            ranks.push(self.tensor.tp);
        }
        ranks
    }
}

impl Strategy {
    /// DeepSpeed's ZeRO stages (its engine, optimizer wrapper and process groups).
    pub fn is_deepspeed(self) -> bool {
        matches!(self, Strategy::Zero1 | Strategy::Zero2 | Strategy::Zero3)
    }

    pub fn name(self) -> &'static str {
        match self {
            Strategy::Ddp => "ddp",
            Strategy::Fsdp => "fsdp",
            Strategy::Fsdp1 => "fsdp1",
            Strategy::Zero1 => "zero1",
            Strategy::Zero2 => "zero2",
            Strategy::Zero3 => "zero3",
            Strategy::NoDataParallel => "none",
        }
    }
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct AllocatorSpec {
    pub expandable_segments: bool,
}

#[derive(Clone, Debug, PartialEq)]
pub struct RunSpec {
    pub model: String,
    pub task: Task,
    pub mode: Mode,
    pub precision: Precision,
    pub optimizer: Optimizer,
    pub batch_size: u64,
    pub seq_len: u64,
    pub gradient_checkpointing: bool,
    pub attention: Attention,
    pub lora: Option<Lora>,
    pub quantization: Option<Quantization>,
    pub kbit_prepare: bool,
    pub allocator: AllocatorSpec,
    /// Data parallelism over several GPUs; `None`: one GPU.
    pub parallel: Option<Parallel>,
    /// `torch.autocast(dtype)` around the forward on top of FSDP2's mixed-precision policy
    /// (verl does so); `None`: the policy alone. Without a policy `precision` says it.
    pub autocast: Option<DType>,
    /// An HF config given inline (`model_config:`), used instead of looking `model` up; `model`
    /// then only names it.
    pub model_config: Option<Value>,
    /// The library versions the run uses, as given (`versions:`).
    pub versions: Versions,
    /// The training loop that runs the step (`trainer:` and that trainer's keys).
    pub trainer: TrainerSpec,
    /// Which function runs an MoE model's experts (`experts_implementation`).
    pub experts: ExpertsImpl,
    /// The busiest expert's tokens over an even share (`routing.max_tokens_per_expert_factor`).
    pub routing_factor: f64,
    /// Megatron-core's settings (`megatron:`), with `parallel.framework: megatron`.
    pub megatron: Option<Megatron>,
}

const KEYS: &[&str] = &[
    "model",
    "task",
    "mode",
    "precision",
    "optimizer",
    "batch_size",
    "seq_len",
    "gradient_checkpointing",
    "attention",
    "lora",
    "quantization",
    "kbit_prepare",
    "allocator",
    "parallel",
    "autocast",
    "model_config",
    "versions",
    "experts_implementation",
    "routing",
    "megatron",
];

const PARALLEL_KEYS: &[&str] = &[
    "strategy",
    "world_size",
    "reshard_after_forward",
    "shard_size",
    "offload_params",
    "offload_optimizer",
    "mixed_precision",
    "units",
    "use_orig_params",
    "backward_prefetch",
    "tp",
    "sequence_parallel",
    "framework",
    "pp",
    "vpp",
    "microbatches",
    "schedule",
    "layers_per_stage",
    "cp",
    "ep",
];

impl RunSpec {
    /// Read and check a spec file (YAML or JSON: YAML parses both).
    /// Read the run spec at `path`; a pipeline is refused by name, for the commands that
    /// take one model.
    pub fn from_file(path: &Path) -> Result<Self> {
        let doc = read_document(path)?;
        if super::is_pipeline(&doc) {
            let key = if doc.get("instances").is_some() {
                "instances"
            } else {
                "policy"
            };
            return Err(Error::field(
                key,
                "a pipeline",
                "this command takes a run spec (one model); `headroom estimate` takes pipelines",
            ));
        }
        Self::from_value(&doc)
    }

    /// Parse spec text; `path` names it in errors.
    pub fn from_str_at(text: &str, path: &Path) -> Result<Self> {
        Self::from_value(&parse_document(text, path)?)
    }

    /// Check a spec given as a JSON value (as the calibration rows store it).
    pub fn from_value(value: &Value) -> Result<Self> {
        let mut value = value.clone();
        if let Some(obj) = value.as_object_mut() {
            super::parallel_keys::fold(obj)?;
        }
        let value = &value;
        let obj = value.as_object().ok_or_else(|| {
            Error::field(
                "spec",
                value,
                "a run spec is a mapping of keys (model, precision, ...)",
            )
        })?;
        let known: Vec<&str> = KEYS.iter().chain(TRAINER_KEYS).copied().collect();
        unknown_key(obj, "", &known, RUN_SPEC_KEY)?;
        let model = match obj.get("model") {
            Some(Value::String(s)) if !s.is_empty() => s.clone(),
            Some(v) => {
                return Err(Error::field(
                    "model",
                    v,
                    "use a catalog name or a path to an HF config.json",
                ));
            }
            None => {
                return Err(Error::field(
                    "model",
                    "missing",
                    "set a catalog name (`headroom models`) or a path to an HF config.json",
                ));
            }
        };
        let mode = choice(
            obj,
            "mode",
            &[("train", Mode::Train), ("forward", Mode::Forward)],
            Mode::Train,
        )?;
        let seq_len = positive(obj, "seq_len", 2048)?;
        let precision = choice(
            obj,
            "precision",
            &[
                ("fp32", Precision::Fp32),
                ("amp-bf16", Precision::AmpBf16),
                ("amp-fp16", Precision::AmpFp16),
                ("bf16", Precision::Bf16),
            ],
            Precision::Bf16,
        )?;
        let trainer = TrainerSpec::from_spec(obj, seq_len, precision == Precision::Bf16)?;
        let default_optimizer = if mode == Mode::Forward {
            Optimizer::None
        } else if trainer.kind == TrainerKind::Loop {
            Optimizer::AdamW
        } else {
            // `TrainingArguments.optim` on torch >= 2.8.
            Optimizer::AdamWFused
        };
        let optimizer = choice(
            obj,
            "optimizer",
            &[
                ("adamw", Optimizer::AdamW),
                ("adamw-fused", Optimizer::AdamWFused),
                ("adamw-forloop", Optimizer::AdamWForLoop),
                ("sgd", Optimizer::Sgd),
                ("adafactor", Optimizer::Adafactor),
                ("adamw-8bit", Optimizer::AdamW8bit),
                ("none", Optimizer::None),
            ],
            default_optimizer,
        )?;
        let default_task = if trainer.kind == TrainerKind::TrlReward {
            Task::SeqCls
        } else {
            Task::CausalLm
        };
        let gradient_checkpointing = match obj.get("gradient_checkpointing") {
            None => trainer.kind.checkpointing_default(),
            Some(_) => boolean(obj, "gradient_checkpointing")?,
        };
        let seq_len = match &trainer.grpo {
            Some(grpo) => {
                if obj.contains_key("seq_len") {
                    return Err(Error::field(
                        "seq_len",
                        seq_len,
                        "a trl-grpo row is prompt_len + completion_len tokens; set those instead",
                    ));
                }
                grpo.prompt_len.saturating_add(grpo.completion_len)
            }
            None => seq_len,
        };
        let spec = RunSpec {
            model,
            task: choice(
                obj,
                "task",
                &[("causal-lm", Task::CausalLm), ("seq-cls", Task::SeqCls)],
                default_task,
            )?,
            mode,
            precision,
            optimizer,
            batch_size: positive(obj, "batch_size", 1)?,
            seq_len,
            gradient_checkpointing,
            attention: choice(
                obj,
                "attention",
                &[("sdpa", Attention::Sdpa), ("eager", Attention::Eager)],
                Attention::Sdpa,
            )?,
            lora: obj.get("lora").map(parse_lora).transpose()?,
            experts: match obj.get("experts_implementation") {
                None | Some(Value::Null) => ExpertsImpl::default(),
                Some(v) => v.as_str().and_then(ExpertsImpl::parse).ok_or_else(|| {
                    Error::field(
                        "experts_implementation",
                        v,
                        format!("use one of {}", ExpertsImpl::NAMES),
                    )
                })?,
            },
            routing_factor: parse_routing(obj.get("routing"))?,
            quantization: match obj.get("quantization") {
                None | Some(Value::Null) => None,
                Some(Value::String(s)) if s == "nf4" => Some(Quantization::Nf4),
                Some(v) => {
                    return Err(Error::field("quantization", v, "use nf4 (or leave it out)"));
                }
            },
            kbit_prepare: boolean(obj, "kbit_prepare")?,
            allocator: match obj.get("allocator") {
                None | Some(Value::Null) => AllocatorSpec::default(),
                Some(Value::Object(a)) => {
                    unknown_key(a, "allocator.", &["expandable_segments"], RUN_SPEC_KEY)?;
                    AllocatorSpec {
                        expandable_segments: boolean(a, "expandable_segments").map_err(|_| {
                            Error::field(
                                "allocator.expandable_segments",
                                &a["expandable_segments"],
                                "use true or false",
                            )
                        })?,
                    }
                }
                Some(v) => {
                    return Err(Error::field(
                        "allocator",
                        v,
                        "use a mapping {expandable_segments: true|false}",
                    ));
                }
            },
            parallel: match obj.get("parallel") {
                None | Some(Value::Null) => None,
                Some(v) => Some(parse_parallel(v)?),
            },
            autocast: match obj.get("autocast") {
                None | Some(Value::Null) => None,
                Some(Value::String(s)) if s == "bf16" => Some(DType::BF16),
                Some(Value::String(s)) if s == "none" => None,
                Some(v) => return Err(Error::field("autocast", v, "use bf16 or none")),
            },
            model_config: match obj.get("model_config") {
                None | Some(Value::Null) => None,
                Some(v @ Value::Object(_)) => Some(v.clone()),
                Some(v) => {
                    return Err(Error::field(
                        "model_config",
                        v,
                        "use a mapping of HF config fields (model_type, hidden_size, ...)",
                    ));
                }
            },
            versions: Versions::from_value(obj.get("versions"))?,
            trainer,
            megatron: match obj.get("megatron") {
                None | Some(Value::Null) => None,
                Some(v) => Some(parse_megatron(v)?),
            },
        };
        spec.check_sizes()?;
        spec.check_combinations()?;
        Ok(spec)
    }

    /// The spec's combinations and sizes checked again, after a change made outside the parser
    /// (a launch config's data parallelism).
    pub fn rechecked(mut self) -> Result<Self> {
        self.parallel = self.parallel.map(Parallel::checked).transpose()?;
        self.check_sizes()?;
        self.check_combinations()?;
        Ok(self)
    }

    /// Tokens per micro-batch within [`limits::MAX_TOKENS`], so that the sizes the simulator
    /// multiplies out stay representable.
    fn check_sizes(&self) -> Result<()> {
        limits::within(
            "seq_len",
            self.seq_len,
            limits::MAX_POSITIONS,
            "the longest real contexts are 10M tokens",
        )?;
        let rows_per_item = self.rows().div_ceil(self.batch_size.max(1)).max(1);
        let tokens = self.rows().saturating_mul(self.seq_len);
        if tokens > limits::MAX_TOKENS {
            return Err(Error::field(
                "batch_size",
                self.batch_size,
                format!(
                    "a micro-batch of {} rows × seq_len is {tokens} tokens, more than the {} it \
                     may have; use at most {} of {}",
                    self.rows(),
                    limits::MAX_TOKENS,
                    limits::MAX_TOKENS / self.seq_len / rows_per_item,
                    self.seq_len
                ),
            ));
        }
        Ok(())
    }

    /// Rows the model sees in one training forward: DPO and reward trainers concatenate each
    /// pair's chosen and rejected sequences, so `batch_size` pairs are twice as many rows.
    pub fn rows(&self) -> u64 {
        match self.trainer.kind {
            TrainerKind::TrlDpo | TrainerKind::TrlReward => self.batch_size.saturating_mul(2),
            _ => self.batch_size,
        }
    }

    /// What the simulator models, whoever built the spec (the spec reader's checks are
    /// stricter; `fit` builds specs beyond them, QLoRA under DDP): adapters (LoRA, 4-bit
    /// weights) on one GPU or under DDP, not under a sharding strategy; LoRA (off the experts)
    /// under expert parallelism, whose adapters are plain tensors.
    pub(crate) fn check_simulated(&self) -> Result<()> {
        match &self.parallel {
            Some(p)
                if p.strategy != Strategy::Ddp
                    && !(p.tensor.ep > 1 && self.quantization.is_none())
                    && (self.lora.is_some() || self.quantization.is_some()) =>
            {
                Err(Error::Unsupported {
                    what: format!("adapters with parallel.strategy {}", p.strategy.name()),
                    supported: "LoRA and QLoRA alone or with ddp, LoRA with parallel.ep".into(),
                })
            }
            _ => Ok(()),
        }
    }

    fn check_combinations(&self) -> Result<()> {
        self.check_trainer()?;
        self.check_megatron()?;
        if self.kbit_prepare && self.quantization.is_none() {
            return Err(Error::field(
                "kbit_prepare",
                true,
                "it needs `quantization: nf4`",
            ));
        }
        if self.quantization.is_some() && self.mode == Mode::Train && self.lora.is_none() {
            return Err(Error::field(
                "quantization",
                "nf4 without lora",
                "4-bit weights cannot be trained directly; add a `lora:` section (QLoRA) or use `mode: forward`",
            ));
        }
        if self.quantization.is_some() && self.precision != Precision::Bf16 {
            return Err(Error::field(
                "precision",
                self.precision.name(),
                "with quantization: nf4 the non-quantized weights are bf16; use precision: bf16",
            ));
        }
        let policy = self
            .parallel
            .as_ref()
            .is_some_and(|p| p.mixed_precision.is_some());
        if policy && !matches!(self.precision, Precision::Fp32 | Precision::Bf16) {
            return Err(Error::field(
                "precision",
                self.precision.name(),
                "with parallel.mixed_precision it names the parameters' storage: use fp32 (fp32 \
                 masters) or bf16; the policy's param_dtype is what the forward computes in, \
                 and `autocast: bf16` adds autocast",
            ));
        }
        if self.autocast.is_some() && !policy {
            return Err(Error::field(
                "autocast",
                "bf16",
                "it adds autocast on top of parallel.mixed_precision; without a policy use \
                 precision: amp-bf16",
            ));
        }
        // Training without an optimizer is allowed: forward and backward without a step (a
        // gradient-accumulation micro-step).
        if let Some(parallel) = &self.parallel {
            if self.quantization.is_some() {
                return Err(Error::Unsupported {
                    what: "quantization with `parallel`".into(),
                    supported: "4-bit QLoRA on one GPU".into(),
                });
            }
            if matches!(
                parallel.strategy,
                Strategy::Ddp | Strategy::Zero1 | Strategy::Zero2
            ) && self.mode == Mode::Forward
            {
                return Err(Error::field(
                    "parallel.strategy",
                    parallel.strategy.name(),
                    "it only changes training: a forward-only model is a plain copy on every GPU; \
                     leave `parallel` out (zero3 and fsdp shard a forward-only model)",
                ));
            }
            if parallel.pipeline.pp > 1
                && (self.mode == Mode::Forward || self.task != Task::CausalLm)
            {
                return Err(Error::Unsupported {
                    what: format!(
                        "parallel.pp with {}",
                        if self.mode == Mode::Forward {
                            "mode forward"
                        } else {
                            "task seq-cls"
                        }
                    ),
                    supported: "pipeline-parallel training of a causal LM (the last stage's loss)"
                        .into(),
                });
            }
            let tensor = parallel.tensor;
            if tensor.tp > 1 && self.mode == Mode::Forward {
                return Err(Error::field(
                    "mode",
                    "forward",
                    "tensor-parallel layouts are modelled for training; leave `mode` out",
                ));
            }
            if tensor.cp > 1 && self.mode == Mode::Forward {
                return Err(Error::field(
                    "mode",
                    "forward",
                    "context-parallel layouts are modelled for training; leave `mode` out",
                ));
            }
            if tensor.cp > 1 && !self.seq_len.is_multiple_of(2 * tensor.cp) {
                return Err(Error::field(
                    "seq_len",
                    self.seq_len,
                    format!(
                        "context parallelism's load balancer cuts each sequence into 2 × cp = {} \
                         chunks: use a multiple of it",
                        2 * tensor.cp
                    ),
                ));
            }
            let local = self.seq_len / tensor.cp;
            if tensor.sequence_parallel && !local.is_multiple_of(tensor.tp) {
                return Err(Error::field(
                    "seq_len",
                    self.seq_len,
                    format!(
                        "sequence parallelism shards each rank's {local} tokens (seq_len / cp) over \
                         tp = {}: use a multiple of cp × tp",
                        tensor.tp
                    ),
                ));
            }
            if tensor.ep > 1 {
                expert_parallel::check_spec(self, tensor.ep)?;
            } else if tensor.framework == Framework::Transformers {
                tp_plan::check_spec(self, tensor.tp)?;
            } else if parallel.strategy != Strategy::Ddp && self.lora.is_some() {
                return Err(Error::Unsupported {
                    what: format!("LoRA with parallel.strategy {}", parallel.strategy.name()),
                    supported: "LoRA alone or with ddp".into(),
                });
            }
        }
        if self.mode == Mode::Forward && self.optimizer != Optimizer::None {
            return Err(Error::field(
                "optimizer",
                self.optimizer.name(),
                "a `mode: forward` pass has no optimizer; use optimizer: none or leave it out",
            ));
        }
        self.check_release()?;
        let tp = self.parallel.as_ref().map_or(1, |p| p.tensor.tp);
        let followed = self.versions.followed(super::Library::Transformers);
        if tp > 1
            && matches!(
                followed,
                Some(super::TRANSFORMERS_4_46 | super::TRANSFORMERS_4_48)
            )
        {
            return Err(Error::Unsupported {
                what: format!("transformers 4.46-4.48 with parallel.tp {tp}"),
                supported: "4.46-4.48 without tensor parallelism (their loss copies the shifted \
                            fp32 logits, which is not modelled over a vocabulary-parallel head), \
                            or tensor parallelism with transformers 4.49 and later"
                    .into(),
            });
        }
        Ok(())
    }

    /// What exists in the transformers release the spec gives: `experts_implementation` and
    /// peft's `target_parameters` on fused experts from transformers 5 on; TRL 1.16's
    /// trainers from 4.56.2 on (its `transformers>=4.56.2`).
    fn check_release(&self) -> Result<()> {
        let Some(given) = self.versions.given(super::Library::Transformers) else {
            return Ok(());
        };
        if given.major >= 5 {
            return Ok(());
        }
        if self.experts != ExpertsImpl::default() {
            return Err(Error::field(
                "experts_implementation",
                self.experts.name(),
                format!(
                    "transformers {given} has no experts implementations (they come with \
                     transformers 5); leave it out"
                ),
            ));
        }
        if self
            .lora
            .as_ref()
            .is_some_and(|l| !l.target_parameters.is_empty())
        {
            return Err(Error::field(
                "lora.target_parameters",
                "a non-empty list",
                format!(
                    "transformers {given} keeps each expert's projections as nn.Linear modules \
                     (the fused 3-D expert weights come with transformers 5); target them in \
                     lora.targets"
                ),
            ));
        }
        let trl_needs = super::TRANSFORMERS_4_56;
        let release = (given.major, given.minor);
        let before = release < (4, 56) || release == (4, 56) && given.patch.is_some_and(|p| p < 2);
        if self.trainer.kind.is_trl() && before {
            return Err(Error::field(
                "versions.transformers",
                given,
                format!(
                    "trainer {} follows TRL 1.16, which requires transformers {trl_needs} or \
                     later; use trainer hf with this release",
                    self.trainer.kind.name()
                ),
            ));
        }
        Ok(())
    }

    /// What a Megatron run is modelled for: training a causal LM in bf16 with Adam, Megatron's
    /// own DDP (strategy ddp) over `world_size / (tp × pp)` ranks, no HF checkpointing,
    /// LoRA or quantization; sequence parallelism with its norms torch's marked
    /// `sequence_parallel`, as the harness builds them.
    fn check_megatron(&self) -> Result<()> {
        let framework = self.parallel.as_ref().map(|p| p.tensor.framework);
        let Some(parallel) = self
            .parallel
            .as_ref()
            .filter(|_| framework == Some(Framework::Megatron))
        else {
            if self.megatron.is_some() {
                return Err(Error::field(
                    "megatron",
                    "this key",
                    "it applies to parallel.framework megatron; leave it out or set that",
                ));
            }
            return Ok(());
        };
        if parallel.strategy != Strategy::Ddp {
            return Err(Error::field(
                "parallel.strategy",
                parallel.strategy.name(),
                "with framework megatron use ddp (Megatron's DistributedDataParallel over \
                 world_size / tp ranks; megatron.distributed_optimizer shards the optimizer)",
            ));
        }
        if parallel.tensor.cp > 1 {
            return Err(Error::Unsupported {
                what: "parallel.cp with framework megatron".into(),
                supported: "context parallelism as torchtitan applies it (framework torchtitan, \
                            strategy fsdp)"
                    .into(),
            });
        }
        let refused = |what: &str| Error::Unsupported {
            what: format!("{what} with framework megatron"),
            supported: "training a causal LM (mode train) in precision bf16 with optimizer adamw, \
                        without lora, quantization or trainer"
                .into(),
        };
        if self.task != Task::CausalLm {
            return Err(refused("task seq-cls"));
        }
        if self.mode != Mode::Train {
            return Err(refused("mode forward"));
        }
        if self.precision != Precision::Bf16 {
            return Err(refused(&format!("precision {}", self.precision.name())));
        }
        if self.optimizer != Optimizer::AdamW {
            return Err(refused(&format!("optimizer {}", self.optimizer.name())));
        }
        if self.lora.is_some() {
            return Err(refused("lora"));
        }
        if self.quantization.is_some() {
            return Err(refused("quantization"));
        }
        if self.trainer.kind != TrainerKind::Loop {
            return Err(refused("trainer"));
        }
        if self.gradient_checkpointing {
            return Err(Error::field(
                "gradient_checkpointing",
                true,
                "it is HF's checkpointing; with framework megatron use \
                 megatron.recompute_granularity (full or selective)",
            ));
        }
        if self.allocator.expandable_segments {
            return Err(Error::Unsupported {
                what: "allocator.expandable_segments with framework megatron".into(),
                supported: "the default caching allocator (the measured rows use it)".into(),
            });
        }
        Ok(())
    }

    /// What Megatron's GPTModel with the local layer spec needs of the model: a dense Llama-style
    /// decoder (RMSNorm, SwiGLU, rotary) or Qwen3-MoE or Mixtral, and heads, query groups,
    /// MLP width and vocabulary that divide over the tensor-parallel ranks (query groups at
    /// least `tp`: fewer are all-gathered, which is not modelled).
    fn check_megatron_against(&self, arch: &Architecture) -> Result<()> {
        use crate::arch::Family;
        // A run without a `megatron:` block takes Megatron's defaults.
        let Some(parallel) = self
            .parallel
            .as_ref()
            .filter(|p| p.tensor.framework == Framework::Megatron)
        else {
            return Ok(());
        };
        let megatron = self.megatron.unwrap_or_default();
        if !matches!(
            arch.family,
            Family::Llama | Family::Qwen2 | Family::Qwen3 | Family::Qwen3Moe | Family::Mixtral
        ) || arch.mla.is_some()
        {
            return Err(Error::Unsupported {
                what: format!("framework megatron with a {} model", arch.model_type),
                supported: "Megatron's GPTModel as dense Llama, Mistral, Qwen2 and Qwen3 models, \
                            Qwen3-MoE and Mixtral"
                    .into(),
            });
        }
        super::megatron::check_moe(self, &megatron, arch)?;
        // Megatron-LM pads the vocabulary to a multiple of tp (`make_vocab_size_divisible_by`).
        let padded = Architecture {
            vocab: megatron.padded_vocab(arch.vocab, parallel.tensor.tp),
            ..arch.clone()
        };
        check_tp_divides(&padded, parallel.tensor.tp)?;
        super::megatron_pipeline::check(&parallel.pipeline, arch.layers)?;
        if megatron.overlap_p2p_comm == Some(true) && parallel.pipeline.vpp == 1 {
            return Err(Error::field(
                "megatron.overlap_p2p_comm",
                true,
                "it applies to the interleaved schedule (parallel.vpp >= 2): megatron-core's \
                 other schedules refuse it and Megatron-LM turns it off without one; leave it \
                 out or set false",
            ));
        }
        if let Recompute::Full {
            method: RecomputeMethod::Block,
            layers,
        } = megatron.recompute
            && layers > arch.layers
        {
            return Err(Error::field(
                "megatron.recompute_num_layers",
                layers,
                format!("use at most num_hidden_layers ({})", arch.layers),
            ));
        }
        Ok(())
    }

    /// What the named trainer accepts, as TRL and transformers check it.
    fn check_trainer(&self) -> Result<()> {
        let kind = self.trainer.kind;
        if kind == TrainerKind::Loop {
            return Ok(());
        }
        let name = kind.name();
        if self.mode == Mode::Forward {
            return Err(Error::field(
                "mode",
                "forward",
                format!(
                    "trainer {name} trains; leave `mode` out, or drop `trainer` for a forward pass"
                ),
            ));
        }
        if self.precision == Precision::AmpFp16 {
            return Err(Error::Unsupported {
                what: format!("precision amp-fp16 with trainer {name}"),
                supported:
                    "bf16 (bf16 weights, bf16=True), amp-bf16 (fp32 weights, bf16=True) and \
                            fp32 with a trainer; amp-fp16 with trainer: loop"
                        .into(),
            });
        }
        if let Some(parallel) = self
            .parallel
            .as_ref()
            .filter(|p| p.strategy != Strategy::Ddp)
        {
            return Err(Error::Unsupported {
                what: format!(
                    "parallel.strategy {} with trainer {name}",
                    parallel.strategy.name()
                ),
                supported: "trainers on one GPU or under ddp; sharded estimates with trainer: loop"
                    .into(),
            });
        }
        match kind {
            TrainerKind::TrlReward if self.task != Task::SeqCls => {
                return Err(Error::field(
                    "task",
                    "causal-lm",
                    "trl-reward trains a sequence-classification model; leave `task` out or use seq-cls",
                ));
            }
            TrainerKind::Hf | TrainerKind::TrlReward => {}
            _ if self.task == Task::SeqCls => {
                return Err(Error::field(
                    "task",
                    "seq-cls",
                    format!(
                        "{name} trains a causal language model; use trainer: trl-reward for a reward model"
                    ),
                ));
            }
            _ => {}
        }
        if let Some(grpo) = &self.trainer.grpo {
            let generated = self
                .batch_size
                .saturating_mul(self.trainer.gradient_accumulation_steps)
                .saturating_mul(self.seq_len);
            if generated > limits::MAX_TOKENS {
                return Err(Error::field(
                    "gradient_accumulation_steps",
                    self.trainer.gradient_accumulation_steps,
                    format!(
                        "GRPO generates batch_size × gradient_accumulation_steps completions of \
                         prompt_len + completion_len tokens at once: {generated} tokens, more than \
                         the {} a batch may have",
                        limits::MAX_TOKENS
                    ),
                ));
            }
            // `generation_batch_size = per_device_train_batch_size * num_processes *
            // steps_per_generation` must hold whole groups of completions.
            let processes = self.parallel.as_ref().map_or(1, |p| p.world_size);
            let generation_batch = self
                .batch_size
                .saturating_mul(self.trainer.gradient_accumulation_steps)
                .saturating_mul(processes);
            if !generation_batch.is_multiple_of(grpo.num_generations) {
                return Err(Error::field(
                    "num_generations",
                    grpo.num_generations,
                    format!(
                        "TRL needs the generation batch (batch_size × gradient_accumulation_steps \
                         × processes = {generation_batch}) to be a multiple of num_generations"
                    ),
                ));
            }
        }
        if self.trainer.use_liger_kernel && kind == TrainerKind::TrlReward {
            return Err(Error::field(
                "use_liger_kernel",
                true,
                "liger's fused linear cross-entropy replaces an LM head; a reward model has none",
            ));
        }
        Ok(())
    }

    /// The model's config, resolved against the catalog or the file system (relative paths
    /// are taken from `spec_dir`, the folder of the spec file).
    pub fn resolve_model(&self, spec_dir: Option<&Path>) -> Result<ResolvedModel> {
        match &self.model_config {
            Some(config) => Ok(ResolvedModel {
                name: self.model.clone(),
                config: config.clone(),
            }),
            None => catalog::resolve(&self.model, spec_dir),
        }
    }

    /// The model's architecture, resolved as [`RunSpec::resolve_model`] does and checked
    /// against the spec. A bad field is named where it is written, the spec's under `at`
    /// (`instances[0]` in a pipeline, empty for a run spec): `model_config.num_hidden_layers`
    /// inline, `path/config.json: num_hidden_layers` in a config file.
    pub fn architecture(
        &self,
        spec_dir: Option<&Path>,
        at: &str,
    ) -> Result<(ResolvedModel, Architecture)> {
        let in_spec = |e: Error| if at.is_empty() { e } else { e.prefixed(at) };
        let model = self.resolve_model(spec_dir).map_err(in_spec)?;
        let arch = Architecture::from_hf_config(&model.config).map_err(|e| {
            if self.model_config.is_some() {
                in_spec(e.prefixed("model_config"))
            } else {
                e.in_file(&model.name)
            }
        })?;
        self.check_against(&arch).map_err(in_spec)?;
        Ok((model, arch))
    }

    /// Bounds on what the experts path makes the simulator do: the per-expert loop's calls,
    /// and `batched_mm`'s per-pair copies of the expert weights, which must be countable.
    fn check_experts_work(&self, arch: &Architecture, moe: &crate::arch::Moe) -> Result<()> {
        let pairs = self
            .batch_size
            .saturating_mul(self.seq_len)
            .saturating_mul(moe.top_k);
        match self.experts {
            ExpertsImpl::Eager => {
                let routed = (0..arch.layers).filter(|&l| moe.routes(l)).count() as u64;
                let calls = routed.saturating_mul(moe.experts.min(pairs));
                if calls > limits::MAX_EXPERT_LOOP_CALLS {
                    return Err(Error::field(
                        "experts_implementation",
                        "eager",
                        format!(
                            "{routed} routed layers × {} experts is {calls} expert calls a \
                             forward, more than the estimate simulates ({}); use grouped_mm",
                            moe.experts,
                            limits::MAX_EXPERT_LOOP_CALLS
                        ),
                    ));
                }
            }
            ExpertsImpl::BatchedMm => {
                let gathered = (2 * moe.intermediate)
                    .checked_mul(arch.hidden)
                    .and_then(|w| w.checked_mul(pairs))
                    .and_then(|n| n.checked_mul(4));
                if gathered.is_none() {
                    return Err(Error::field(
                        "experts_implementation",
                        "batched_mm",
                        format!(
                            "it copies an expert's weights for each of {pairs} (token, expert) \
                             pairs, beyond any device; use grouped_mm or fewer tokens"
                        ),
                    ));
                }
            }
            ExpertsImpl::GroupedMm => {}
        }
        Ok(())
    }

    /// The attention transformers runs: what the spec names, eager for models without SDPA
    /// (gpt-oss).
    pub fn attention_for(&self, arch: &Architecture) -> Attention {
        if arch.family == crate::arch::Family::GptOss {
            Attention::Eager
        } else {
            self.attention
        }
    }

    pub fn head(&self) -> Head {
        match self.task {
            Task::CausalLm => Head::CausalLm,
            Task::SeqCls => Head::SequenceClassification { labels: 1 },
        }
    }

    /// Checks that need the architecture: liger's kernels for the families it patches as
    /// modelled, LoRA targets that exist and ranks that fit.
    pub fn check_against(&self, arch: &Architecture) -> Result<()> {
        use crate::arch::Family;
        self.check_megatron_against(arch)?;
        if let Some(tensor) = self
            .parallel
            .as_ref()
            .map(|p| p.tensor)
            .filter(|t| t.tp > 1 && t.framework != Framework::Megatron)
        {
            check_tensor_parallel(tensor, arch)?;
        }
        if let Some(pipeline) = self
            .parallel
            .as_ref()
            .map(|p| &p.pipeline)
            .filter(|p| p.pp > 1)
        {
            let megatron = self
                .parallel
                .as_ref()
                .is_some_and(|p| p.tensor.framework == Framework::Megatron);
            check_pipeline_parallel(pipeline, arch, self.batch_size, megatron)?;
        }
        if self.parallel.as_ref().is_some_and(|p| p.tensor.cp > 1) {
            check_context_parallel(self, arch)?;
        }
        if let Some(ep) = self
            .parallel
            .as_ref()
            .map(|p| p.tensor.ep)
            .filter(|&ep| ep > 1)
        {
            expert_parallel::check_against(self, arch, ep)?;
        }
        if self.trainer.use_liger_kernel
            && !matches!(arch.family, Family::Llama | Family::Qwen2 | Family::Qwen3)
        {
            return Err(Error::Unsupported {
                what: format!("use_liger_kernel with a {:?} model", arch.family),
                supported: "liger's kernels on Llama, Mistral, Qwen2 and Qwen3 models".into(),
            });
        }
        if let Some(grpo) = &self.trainer.grpo {
            // Each generated token is a decode step through every layer's cache, in each of
            // the three simulated steps.
            let work = arch
                .layers
                .saturating_mul(1 + grpo.completion_len / 12)
                .saturating_mul(3);
            if work > limits::MAX_PIPELINE_WORK {
                return Err(Error::field(
                    "completion_len",
                    grpo.completion_len,
                    format!(
                        "3 steps × {} layers × (1 + {} / 12) decode steps is {work}, more \
                         generation than the estimate simulates ({}); use a shorter completion",
                        arch.layers,
                        grpo.completion_len,
                        limits::MAX_PIPELINE_WORK
                    ),
                ));
            }
        }
        if self.task == Task::SeqCls && arch.family == Family::Olmoe {
            return Err(Error::Unsupported {
                what: "task seq-cls with an olmoe model".into(),
                supported: "causal-lm (transformers 5.17 has no OlmoeForSequenceClassification)"
                    .into(),
            });
        }
        if let Some(moe) = &arch.moe {
            self.check_experts_work(arch, moe)?;
        }
        if arch.moe.is_none() {
            if self.experts != ExpertsImpl::default() {
                return Err(Error::field(
                    "experts_implementation",
                    self.experts.name(),
                    format!("{} models have no experts; leave it out", arch.model_type),
                ));
            }
            if self.routing_factor != 1.0 {
                return Err(Error::field(
                    "routing",
                    self.routing_factor,
                    format!("{} models have no experts; leave it out", arch.model_type),
                ));
            }
        }
        let Some(lora) = &self.lora else {
            return Ok(());
        };
        let built = lora.as_built_for(arch)?;
        let lora = &built.lora;
        if !lora.target_parameters.is_empty() && arch.moe.is_none() {
            return Err(Error::field(
                "lora.target_parameters",
                "[...]",
                format!(
                    "{} has no fused expert weights; use lora.targets",
                    shown(&self.model, SHOWN_CHARS)
                ),
            ));
        }
        let params = arch.parameters(self.head());
        let linears: Vec<_> = params
            .iter()
            .filter(|p| p.module.is_linear() && !p.is_bias)
            .collect();
        if let LoraTargets::Modules(names) = &lora.targets {
            for name in names {
                if !linears.iter().any(|p| p.module.hf_name() == name) {
                    let mut known: Vec<&str> = linears.iter().map(|p| p.module.hf_name()).collect();
                    known.dedup();
                    known.sort();
                    known.dedup();
                    return Err(Error::field(
                        "lora.targets",
                        format!("{name:?}"),
                        format!(
                            "{} has no such linear layer; its linear layers: {}",
                            shown(&self.model, SHOWN_CHARS),
                            known.join(", ")
                        ),
                    ));
                }
            }
        }
        // PEFT takes a rank above a layer's side (a gate of one output, all-linear in
        // Qwen2-MoE, gets B of [1, r]); one above every targeted layer's sides is a mistake.
        let largest = linears
            .iter()
            .filter(|p| lora_targets_module(lora, p.module))
            .map(|p| p.rows.max(p.cols))
            .max();
        if let Some(max_dim) = largest
            && lora.r > max_dim
        {
            return Err(Error::field(
                "lora.r",
                lora.r,
                format!(
                    "no targeted layer has a side above {max_dim}, so a larger rank adds \
                     nothing; use r <= {max_dim}"
                ),
            ));
        }
        Ok(())
    }
}

/// Whether a LoRA config adapts this module (peft semantics: `all-linear` is every linear
/// layer except the output head).
pub fn lora_targets_module(lora: &Lora, module: Module) -> bool {
    if !module.is_linear() {
        return false;
    }
    match &lora.targets {
        LoraTargets::AllLinear => !matches!(module, Module::LmHead | Module::Score),
        LoraTargets::Modules(names) => names.iter().any(|n| n == module.hf_name()),
    }
}

fn parse_parallel(value: &Value) -> Result<Parallel> {
    let obj = value.as_object().ok_or_else(|| {
        Error::field(
            "parallel",
            value,
            "use a mapping {strategy, world_size, ...}",
        )
    })?;
    unknown_key(obj, "parallel.", PARALLEL_KEYS, RUN_SPEC_KEY)?;
    let field = |e: Error| e.prefixed("parallel");
    let strategy = match obj.get("strategy") {
        None => {
            return Err(Error::field(
                "parallel.strategy",
                "missing",
                "use one of ddp, fsdp, fsdp1, zero1, zero2, zero3, none",
            ));
        }
        Some(_) => choice(
            obj,
            "strategy",
            &[
                ("ddp", Strategy::Ddp),
                ("fsdp", Strategy::Fsdp),
                ("fsdp1", Strategy::Fsdp1),
                ("zero1", Strategy::Zero1),
                ("zero2", Strategy::Zero2),
                ("zero3", Strategy::Zero3),
                ("none", Strategy::NoDataParallel),
            ],
            Strategy::Ddp,
        )
        .map_err(field)?,
    };
    let world_size = positive(obj, "world_size", 1).map_err(field)?;
    let ep = expert_parallel::parse(obj, strategy, world_size)?;
    let pipeline = pipeline_parallel::parse(obj, world_size)?;
    // Megatron's pipeline composes with its own DDP and tensor parallelism (`megatron_pipeline`).
    if obj.get("framework").and_then(Value::as_str) != Some("megatron") {
        check_pipeline_layout(
            &pipeline,
            strategy,
            [
                positive(obj, "tp", 1).map_err(field)?,
                positive(obj, "cp", 1).map_err(field)?,
            ],
            world_size,
        )?;
    }
    let tensor = if ep > 1 {
        TensorParallel {
            ep,
            ..TensorParallel::default()
        }
    } else {
        parse_tensor_parallel(obj, strategy, world_size / pipeline.pp)?
    };
    let dp = world_size / pipeline.pp / tensor.tp;
    // The harness writes every key; a key that does not apply is accepted at its default.
    let set = |key: &str| {
        obj.get(key).is_some_and(|v| match key {
            "reshard_after_forward" => v != &Value::Bool(true),
            "shard_size" => v.as_u64() != Some(dp),
            "units" => v.as_str() != Some("layers"),
            "use_orig_params" => v != &Value::Bool(true),
            "backward_prefetch" => v.as_str() != Some("pre"),
            _ => v != &Value::Bool(false) && !v.is_null(),
        })
    };
    let only_for = |key: &str, ok: bool, allowed: &str| -> Result<()> {
        if set(key) && !ok {
            return Err(Error::field(
                format!("parallel.{key}"),
                &obj[key],
                format!("{allowed}; leave it out for {}", strategy.name()),
            ));
        }
        Ok(())
    };
    let fsdp = strategy == Strategy::Fsdp;
    let fsdp1 = strategy == Strategy::Fsdp1;
    only_for(
        "reshard_after_forward",
        fsdp || fsdp1,
        "it applies to fsdp and fsdp1",
    )?;
    only_for(
        "shard_size",
        fsdp || fsdp1,
        "it applies to fsdp and fsdp1 (HSDP)",
    )?;
    only_for(
        "offload_params",
        fsdp || fsdp1 || strategy == Strategy::Zero3,
        "it applies to fsdp, fsdp1 and zero3",
    )?;
    only_for("use_orig_params", fsdp1, "it applies to fsdp1 only")?;
    only_for("backward_prefetch", fsdp1, "it applies to fsdp1 only")?;
    only_for(
        "offload_optimizer",
        strategy.is_deepspeed(),
        "it applies to zero1, zero2 and zero3",
    )?;
    let reshard_after_forward = match obj.get("reshard_after_forward") {
        None | Some(Value::Null) => true,
        Some(v) => v.as_bool().ok_or_else(|| {
            Error::field("parallel.reshard_after_forward", v, "use true or false")
        })?,
    };
    if (tensor.tp > 1 || tensor.cp > 1) && set("shard_size") {
        return Err(Error::field(
            "parallel.shard_size",
            &obj["shard_size"],
            format!(
                "FSDP2 shards over the data-parallel dimensions (world_size / tp = {dp}) with tp \
                 or cp > 1; leave it out"
            ),
        ));
    }
    let shard_size = positive(obj, "shard_size", dp).map_err(field)?;
    only_for("units", fsdp, "it applies to fsdp only")?;
    let units = match obj.get("units") {
        None | Some(Value::Null) => FsdpUnits::Layers,
        Some(_) => choice(
            obj,
            "units",
            &[
                ("layers", FsdpUnits::Layers),
                ("layers-keep-root", FsdpUnits::LayersKeepRoot),
                ("layers-embedding", FsdpUnits::LayersEmbedding),
                ("accelerate", FsdpUnits::Accelerate),
            ],
            FsdpUnits::Layers,
        )
        .map_err(field)?,
    };
    let mixed_precision = match obj.get("mixed_precision") {
        None | Some(Value::Null) => None,
        Some(_) if !fsdp && !fsdp1 => {
            return Err(Error::field(
                "parallel.mixed_precision",
                "this key",
                format!(
                    "FSDP2's MixedPrecisionPolicy and FSDP1's MixedPrecision apply to fsdp and \
                     fsdp1; leave it out for {}",
                    strategy.name()
                ),
            ));
        }
        Some(v) => Some(parse_mixed_precision(v, strategy)?),
    };
    let fsdp1_options = Fsdp1Options {
        use_orig_params: match obj.get("use_orig_params") {
            None | Some(Value::Null) => true,
            Some(v) => v
                .as_bool()
                .ok_or_else(|| Error::field("parallel.use_orig_params", v, "use true or false"))?,
        },
        backward_prefetch: match obj.get("backward_prefetch") {
            None | Some(Value::Null) => BackwardPrefetch::Pre,
            Some(_) => choice(
                obj,
                "backward_prefetch",
                &[
                    ("pre", BackwardPrefetch::Pre),
                    ("post", BackwardPrefetch::Post),
                    ("none", BackwardPrefetch::None),
                ],
                BackwardPrefetch::Pre,
            )
            .map_err(field)?,
        },
    };
    Parallel {
        strategy,
        world_size,
        reshard_after_forward,
        shard_size,
        offload_params: boolean(obj, "offload_params").map_err(field)?,
        offload_optimizer: boolean(obj, "offload_optimizer").map_err(field)?,
        mixed_precision,
        units,
        fsdp1: fsdp1_options,
        tensor,
        pipeline,
    }
    .checked()
}

/// `key` splits the model where a tied input embedding and output head would need one
/// weight in two places.
fn refuse_tied_embeddings(arch: &Architecture, key: &str) -> Result<()> {
    if arch.tie_word_embeddings {
        return Err(Error::Unsupported {
            what: format!("{key} with tied word embeddings ({})", arch.model_type),
            supported: "models with an output head of their own (tie_word_embeddings false)".into(),
        });
    }
    Ok(())
}

/// What a tensor-parallel layout needs of the model: a Llama-style decoder (torchtitan's and
/// transformers' plans name its modules) whose heads, MLP width and vocabulary divide over the
/// group, and an output head of its own (a tied one would be distributed twice; transformers
/// would make the embedding the head's vocabulary-sharded DTensor).
pub(crate) fn check_tensor_parallel(tensor: TensorParallel, arch: &Architecture) -> Result<()> {
    let tp = tensor.tp;
    if !torchtitan_plan_applies(arch) {
        return Err(Error::Unsupported {
            what: format!("parallel.tp with a {} model", arch.model_type),
            supported: "tensor parallelism of dense Llama, Mistral, Qwen2 and Qwen3 models".into(),
        });
    }
    refuse_tied_embeddings(arch, "parallel.tp")?;
    check_tp_divides(arch, tp)
}

/// Tensor parallelism splits the heads, the key/value heads, the MLP width and the
/// vocabulary over `tp` ranks: each must divide evenly.
fn check_tp_divides(arch: &Architecture, tp: u64) -> Result<()> {
    for (what, value) in [
        ("num_attention_heads", arch.heads),
        ("num_key_value_heads", arch.kv_heads),
        ("intermediate_size", arch.intermediate),
        ("vocab_size", arch.vocab),
    ] {
        if !value.is_multiple_of(tp) {
            return Err(Error::field(
                "parallel.tp",
                tp,
                format!("it must divide the model's {what} ({value})"),
            ));
        }
    }
    Ok(())
}

/// What a pipeline split needs of the model: a dense decoder (or, under Megatron, the MoE
/// models its `MoELayer` is modelled for: `megatron::check_moe`) whose input embedding and
/// output head are modules of their own (a tied pair would sit on the first and the last
/// stage; Megatron gives the last stage a copy of its own and sums their gradients), and
/// layers for every stage.
pub(crate) fn check_pipeline_parallel(
    pipeline: &PipelineParallel,
    arch: &Architecture,
    batch_size: u64,
    megatron: bool,
) -> Result<()> {
    if (arch.moe.is_some() && !megatron) || arch.mla.is_some() {
        return Err(Error::Unsupported {
            what: format!("parallel.pp with a {} model", arch.model_type),
            supported: "pipeline parallelism of dense decoders, and of Qwen3-MoE under \
                        framework megatron"
                .into(),
        });
    }
    if !megatron {
        refuse_tied_embeddings(arch, "parallel.pp")?;
    }
    pipeline.check(arch.layers, batch_size)
}

/// What pipeline parallelism is modelled with: alone, or with FSDP2 over the data-parallel
/// ranks within each stage (torchtitan's PP × FSDP2), and tensor parallelism under it (without
/// sequence parallelism: `check_sharded_stages`). Context parallelism within the stages is not
/// modelled.
pub(crate) fn check_pipeline_layout(
    pipeline: &PipelineParallel,
    strategy: Strategy,
    [tp, cp]: [u64; 2],
    world_size: u64,
) -> Result<()> {
    if pipeline.pp == 1 {
        return Ok(());
    }
    const SUPPORTED: &str = "pipeline parallelism alone (strategy none, world_size = pp) or with \
                             FSDP2 over the data-parallel ranks of each stage (strategy fsdp, \
                             world_size = pp × dp × tp)";
    if !matches!(strategy, Strategy::NoDataParallel | Strategy::Fsdp) {
        return Err(Error::Unsupported {
            what: format!("parallel.pp with parallel.strategy {}", strategy.name()),
            supported: SUPPORTED.into(),
        });
    }
    if cp > 1 {
        return Err(Error::Unsupported {
            what: format!("parallel.pp with parallel.cp {cp}"),
            supported: format!("{SUPPORTED}, cp 1"),
        });
    }
    if strategy == Strategy::Fsdp {
        return Ok(());
    }
    if tp > 1 {
        return Err(Error::Unsupported {
            what: format!("parallel.pp with parallel.tp {tp} and strategy none"),
            supported: format!("{SUPPORTED}; tensor parallelism inside a pipeline under fsdp"),
        });
    }
    if world_size != pipeline.pp {
        return Err(Error::field(
            "parallel.world_size",
            world_size,
            format!(
                "strategy none with pipeline parallelism alone: world_size must equal pp ({})",
                pipeline.pp
            ),
        ));
    }
    Ok(())
}

/// Whether torchtitan's Llama plans name the model's modules: a dense Llama-style decoder.
fn torchtitan_plan_applies(arch: &Architecture) -> bool {
    use crate::arch::Family;
    matches!(arch.family, Family::Llama | Family::Qwen2 | Family::Qwen3)
        && arch.moe.is_none()
        && arch.mla.is_none()
}

/// What a context-parallel layout needs of the model and the run: a dense Llama-style decoder
/// whose attention is SDPA's causal flash kernel on every layer (the ring replaces it; a mask,
/// a sliding window or the eager kernel is not what `context_parallel` dispatches).
pub(crate) fn check_context_parallel(spec: &RunSpec, arch: &Architecture) -> Result<()> {
    if !torchtitan_plan_applies(arch) {
        return Err(Error::Unsupported {
            what: format!("parallel.cp with a {} model", arch.model_type),
            supported: "context parallelism of dense Llama, Mistral, Qwen2 and Qwen3 models".into(),
        });
    }
    if spec.attention_for(arch) != Attention::Sdpa {
        return Err(Error::Unsupported {
            what: "parallel.cp with eager attention".into(),
            supported: "context parallelism's ring over SDPA (attention: sdpa)".into(),
        });
    }
    if arch.sliding_window.is_some() {
        return Err(Error::Unsupported {
            what: format!("parallel.cp with a sliding window ({})", arch.model_type),
            supported: "causal attention over the whole sequence".into(),
        });
    }
    let policy = spec.parallel.as_ref().and_then(|p| p.mixed_precision);
    if spec.precision == Precision::Fp32 && !policy.is_some_and(|m| m.param_dtype.is_half()) {
        return Err(Error::Unsupported {
            what: format!("parallel.cp with precision {}", spec.precision.name()),
            supported: "bf16 or fp16 compute: the ring runs the flash kernel".into(),
        });
    }
    Ok(())
}

/// `tp`, `sequence_parallel`, `framework` and `cp`: tensor parallelism composed with FSDP2
/// over the data-parallel dimension (strategy fsdp) or alone (strategy none, `world_size =
/// tp`), and context parallelism between them (strategy fsdp); within each of the pipeline's
/// stages (`world_size` here: the ranks of one).
fn parse_tensor_parallel(
    obj: &serde_json::Map<String, Value>,
    strategy: Strategy,
    world_size: u64,
) -> Result<TensorParallel> {
    let field = |e: Error| e.prefixed("parallel");
    let tp = positive(obj, "tp", 1).map_err(field)?;
    if !world_size.is_multiple_of(tp) {
        return Err(Error::field(
            "parallel.tp",
            tp,
            format!("it must divide world_size ({world_size}): world_size = dp × tp"),
        ));
    }
    let sequence_parallel = boolean(obj, "sequence_parallel").map_err(field)?;
    let framework = match obj.get("framework") {
        None | Some(Value::Null) => Framework::Torchtitan,
        Some(_) => choice(
            obj,
            "framework",
            &[
                ("torchtitan", Framework::Torchtitan),
                ("megatron", Framework::Megatron),
                ("transformers", Framework::Transformers),
            ],
            Framework::Torchtitan,
        )
        .map_err(field)?,
    };
    if tp == 1 && sequence_parallel {
        return Err(Error::field(
            "parallel.sequence_parallel",
            true,
            "it shards the sequence over the tensor-parallel ranks; set tp >= 2 or leave it out",
        ));
    }
    if framework == Framework::Megatron {
        // Megatron's own DDP spreads the data-parallel dimension (`spec::megatron` checks it);
        // `check_megatron` refuses its context parallelism.
        return Ok(TensorParallel {
            tp,
            sequence_parallel,
            framework,
            cp: positive(obj, "cp", 1).map_err(field)?,
            ep: 1,
        });
    }
    if framework == Framework::Transformers {
        tp_plan::parse(obj, strategy, world_size, tp, sequence_parallel)?;
        return Ok(TensorParallel {
            tp,
            sequence_parallel,
            framework,
            cp: 1,
            ep: 1,
        });
    }
    if tp > 1 && !matches!(strategy, Strategy::Fsdp | Strategy::NoDataParallel) {
        return Err(Error::field(
            "parallel.strategy",
            strategy.name(),
            "with tp > 1 use fsdp (FSDP2 over the data-parallel dimension, as torchtitan) or \
             none (tensor parallelism alone)",
        ));
    }
    if strategy == Strategy::NoDataParallel && tp != world_size {
        return Err(Error::field(
            "parallel.world_size",
            world_size,
            format!(
                "strategy none is tensor parallelism alone: world_size must equal tp ({tp}); use \
                 strategy fsdp to shard over a data-parallel dimension"
            ),
        ));
    }
    if strategy == Strategy::NoDataParallel && tp > 1 && !sequence_parallel {
        // Without sequence parallelism the norms stay plain tensors beside the DTensor
        // shards, and AdamW's foreach step over both raises in torch 2.11 (measured).
        return Err(Error::field(
            "parallel.sequence_parallel",
            false,
            "strategy none without sequence parallelism leaves the norms plain tensors beside \
             DTensors, which AdamW's foreach step refuses (torch 2.11); set it true, or use \
             strategy fsdp",
        ));
    }
    let cp = positive(obj, "cp", 1).map_err(field)?;
    if !world_size.is_multiple_of(cp * tp) {
        return Err(Error::field(
            "parallel.cp",
            cp,
            format!("cp × tp must divide world_size ({world_size}): world_size = dp × cp × tp"),
        ));
    }
    if cp > 1 && strategy != Strategy::Fsdp {
        return Err(Error::field(
            "parallel.strategy",
            strategy.name(),
            "with cp > 1 use fsdp: torchtitan shards the parameters over dp × cp (its \
             dp_shard_cp mesh)",
        ));
    }
    if cp > 1 && boolean(obj, "offload_params").map_err(field)? {
        return Err(Error::Unsupported {
            what: "parallel.offload_params with cp > 1".into(),
            supported: "context parallelism with the parameters on the GPU".into(),
        });
    }
    Ok(TensorParallel {
        tp,
        sequence_parallel,
        framework,
        cp,
        ep: 1,
    })
}

impl Parallel {
    /// The layout checked: ranks within bounds, a shard group that divides them, and FSDP1's
    /// groups of one refused (both where a spec is parsed and where a launch config makes one).
    /// FSDP2 inside a pipeline as it is modelled: each stage sharded over all `world_size /
    /// (pp × tp)` data-parallel ranks, on the GPU, with torchtitan's units; tensor parallelism
    /// under it with torchtitan's plan, without sequence parallelism (the stage boundary would
    /// send sequence shards).
    fn check_sharded_stages(&self) -> Result<()> {
        let dp = self.world_size / self.pipeline.pp / self.tensor.tp;
        if self.tensor.sequence_parallel {
            return Err(Error::field(
                "parallel.sequence_parallel",
                true,
                "inside a pipeline tensor parallelism is modelled without it (the stages send \
                 whole hidden states); leave it out with pp >= 2",
            ));
        }
        if self.tensor.framework != Framework::Torchtitan {
            return Err(Error::Unsupported {
                what: "parallel.pp with parallel.strategy fsdp and framework megatron".into(),
                supported: "torchtitan's PP × FSDP2 (framework torchtitan)".into(),
            });
        }
        if self.shard_size != dp {
            return Err(Error::field(
                "parallel.shard_size",
                self.shard_size,
                format!(
                    "inside a pipeline FSDP2 shards each stage over world_size / (pp × tp) \
                     ({dp}) ranks; HSDP is not modelled there: leave it out"
                ),
            ));
        }
        if self.offload_params {
            return Err(Error::field(
                "parallel.offload_params",
                true,
                "CPU offload inside a pipeline is not modelled; leave it out with pp >= 2",
            ));
        }
        if !matches!(self.units, FsdpUnits::Layers | FsdpUnits::Accelerate) {
            return Err(Error::field(
                "parallel.units",
                self.units.name(),
                "inside a pipeline use layers (each decoder layer, then the stage) or \
                 accelerate (torchtitan's apply_fsdp: also the embedding and [norm, output])",
            ));
        }
        Ok(())
    }

    pub(crate) fn checked(self) -> Result<Self> {
        let (world_size, shard_size) = (self.world_size, self.shard_size);
        if !(1..=65536).contains(&world_size) {
            return Err(Error::field(
                "parallel.world_size",
                world_size,
                "use an integer from 1 to 65536",
            ));
        }
        if shard_size == 0 || world_size % shard_size != 0 {
            return Err(Error::field(
                "parallel.shard_size",
                shard_size,
                format!("it must divide world_size ({world_size})"),
            ));
        }
        if self.strategy == Strategy::Fsdp1 && world_size == 1 {
            return Err(Error::field(
                "parallel.world_size",
                1,
                "FSDP1 over one rank is NO_SHARD, which is not modelled; use 2 or more, or \
                 strategy fsdp (FSDP2) for one GPU",
            ));
        }
        if self.pipeline.pp > 1 && self.strategy == Strategy::Fsdp {
            self.check_sharded_stages()?;
        }
        if self.strategy == Strategy::Fsdp1 && shard_size == 1 {
            return Err(Error::field(
                "parallel.shard_size",
                1,
                "FSDP1 makes a shard group of one NO_SHARD, whose replicas never reduce their \
                 gradients; use shard_size >= 2, or strategy ddp",
            ));
        }
        Ok(self)
    }
}

/// `parallel.mixed_precision: {param_dtype, reduce_dtype, output_dtype, cast_forward_inputs}`,
/// as `MixedPrecisionPolicy` defaults them (param_dtype bf16 when the mapping omits it).
fn parse_mixed_precision(value: &Value, strategy: Strategy) -> Result<MixedPrecision> {
    let obj = value.as_object().ok_or_else(|| {
        Error::field(
            "parallel.mixed_precision",
            value,
            "use a mapping {param_dtype, reduce_dtype, output_dtype, cast_forward_inputs}",
        )
    })?;
    // FSDP1's `MixedPrecision` casts buffers, FSDP2's policy casts the root's outputs.
    let keys: &[&str] = if strategy == Strategy::Fsdp1 {
        &[
            "param_dtype",
            "reduce_dtype",
            "buffer_dtype",
            "cast_forward_inputs",
        ]
    } else {
        &[
            "param_dtype",
            "reduce_dtype",
            "output_dtype",
            "cast_forward_inputs",
        ]
    };
    unknown_key(obj, "parallel.mixed_precision.", keys, RUN_SPEC_KEY)?;
    let dtype = |key: &str| -> Result<Option<DType>> {
        match obj.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) if s == "bf16" => Ok(Some(DType::BF16)),
            Some(Value::String(s)) if s == "fp32" => Ok(Some(DType::F32)),
            Some(v) => Err(Error::field(
                format!("parallel.mixed_precision.{key}"),
                v,
                "use bf16 or fp32 (or leave it out)",
            )),
        }
    };
    dtype("buffer_dtype")?;
    Ok(MixedPrecision {
        param_dtype: dtype("param_dtype")?.unwrap_or(DType::BF16),
        reduce_dtype: dtype("reduce_dtype")?,
        output_dtype: dtype("output_dtype")?,
        cast_forward_inputs: match obj.get("cast_forward_inputs") {
            None => strategy != Strategy::Fsdp1,
            Some(v) => v.as_bool().ok_or_else(|| {
                Error::field(
                    "parallel.mixed_precision.cast_forward_inputs",
                    v,
                    "use true or false",
                )
            })?,
        },
    })
}

/// `routing: {max_tokens_per_expert_factor: F}`: how much more than an even share of the
/// (token, expert) pairs the busiest expert receives (1 = even).
fn parse_routing(value: Option<&Value>) -> Result<f64> {
    let obj = match value {
        None | Some(Value::Null) => return Ok(1.0),
        Some(Value::Object(obj)) => obj,
        Some(v) => {
            return Err(Error::field(
                "routing",
                v,
                "use a mapping {max_tokens_per_expert_factor: F}",
            ));
        }
    };
    unknown_key(
        obj,
        "routing.",
        &["max_tokens_per_expert_factor"],
        RUN_SPEC_KEY,
    )?;
    match obj.get("max_tokens_per_expert_factor") {
        None => Ok(1.0),
        Some(v) => v
            .as_f64()
            .filter(|f| (1.0..=4096.0).contains(f))
            .ok_or_else(|| {
                Error::field(
                    "routing.max_tokens_per_expert_factor",
                    v,
                    "use a number from 1 (even routing) to the number of experts",
                )
            }),
    }
}

/// The expert parameters peft's `target_parameters` can name, by the suffix it matches.
const EXPERT_PARAMETERS: &[(&str, Module)] = &[
    ("experts.gate_up_proj", Module::ExpertsGateUp),
    ("experts.down_proj", Module::ExpertsDown),
];

fn parse_lora(value: &Value) -> Result<Lora> {
    let obj = value.as_object().ok_or_else(|| {
        Error::field(
            "lora",
            value,
            "use a mapping {r, alpha, targets, dropout, target_parameters}",
        )
    })?;
    unknown_key(
        obj,
        "lora.",
        &["r", "alpha", "targets", "dropout", "target_parameters"],
        RUN_SPEC_KEY,
    )?;
    let target_parameters = match obj.get("target_parameters") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(items)) if !items.is_empty() => {
            let mut out = Vec::new();
            for item in items {
                let module = item.as_str().and_then(|name| {
                    EXPERT_PARAMETERS
                        .iter()
                        .find(|(suffix, _)| name.ends_with(suffix))
                        .map(|&(_, m)| m)
                });
                match module {
                    Some(m) if !out.contains(&m) => out.push(m),
                    Some(_) => {}
                    None => {
                        return Err(Error::field(
                            "lora.target_parameters",
                            item,
                            "name fused expert weights: mlp.experts.gate_up_proj, \
                             mlp.experts.down_proj",
                        ));
                    }
                }
            }
            out
        }
        Some(v) => {
            return Err(Error::field(
                "lora.target_parameters",
                v,
                "use a list such as [mlp.experts.gate_up_proj, mlp.experts.down_proj]",
            ));
        }
    };
    let r = positive(obj, "r", 8)
        .map_err(|_| Error::field("lora.r", &obj["r"], "use an integer >= 1"))?;
    let number = |key: &str, default: f64, ok: fn(f64) -> bool, allowed: &str| -> Result<f64> {
        match obj.get(key) {
            None => Ok(default),
            Some(v) => v
                .as_f64()
                .filter(|x| ok(*x))
                .ok_or_else(|| Error::field(format!("lora.{key}"), v, allowed)),
        }
    };
    let alpha = number("alpha", 8.0, |x| x > 0.0, "use a number > 0")?;
    let dropout = number(
        "dropout",
        0.0,
        |x| (0.0..1.0).contains(&x),
        "use a number in [0, 1)",
    )?;
    if !target_parameters.is_empty() && dropout > 0.0 {
        return Err(Error::field(
            "lora.dropout",
            dropout,
            "peft wraps target_parameters only without dropout; use 0",
        ));
    }
    let targets = match obj.get("targets") {
        None if !target_parameters.is_empty() => LoraTargets::Modules(Vec::new()),
        None => LoraTargets::AllLinear,
        Some(Value::Array(items)) if items.is_empty() && !target_parameters.is_empty() => {
            LoraTargets::Modules(Vec::new())
        }
        Some(Value::String(s)) if s == "all-linear" => LoraTargets::AllLinear,
        Some(Value::Array(items)) if !items.is_empty() && items.iter().all(Value::is_string) => {
            LoraTargets::Modules(
                items
                    .iter()
                    .filter_map(|v| v.as_str().map(str::to_string))
                    .collect(),
            )
        }
        Some(v) => {
            return Err(Error::field(
                "lora.targets",
                v,
                "use all-linear or a list of module names",
            ));
        }
    };
    Ok(Lora {
        r,
        alpha,
        targets,
        dropout,
        target_parameters,
    })
}

impl RunSpec {
    /// The GPUs the run spans: `parallel.world_size`, or 1.
    pub fn world_size(&self) -> u32 {
        self.parallel
            .as_ref()
            .map_or(1, |p| u32::try_from(p.world_size).unwrap_or(u32::MAX))
    }
}

impl Precision {
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::AmpBf16 => "amp-bf16",
            Precision::AmpFp16 => "amp-fp16",
            Precision::Bf16 => "bf16",
        }
    }
}

impl Optimizer {
    pub fn name(self) -> &'static str {
        match self {
            Optimizer::AdamW => "adamw",
            Optimizer::AdamWFused => "adamw-fused",
            Optimizer::AdamWForLoop => "adamw-forloop",
            Optimizer::Sgd => "sgd",
            Optimizer::Adafactor => "adafactor",
            Optimizer::AdamW8bit => "adamw-8bit",
            Optimizer::None => "none",
        }
    }
}
