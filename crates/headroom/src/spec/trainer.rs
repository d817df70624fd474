//! The trainer a run spec names (`trainer:`): the measuring harness's own loop, transformers'
//! `Trainer`, or one of TRL 1.16's trainers, with the keys each trainer has. A run spec keeps
//! its meaning (`batch_size` is `per_device_train_batch_size`, `seq_len` the padded length of a
//! row); what each trainer adds is read here and checked against what that trainer accepts.

use serde_json::{Map, Value};

use super::parse::{boolean, positive};
use crate::error::{Error, Result};
use crate::limits;

/// Which training loop runs the step.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TrainerKind {
    /// `headroom measure`'s loop: forward, `loss.backward()`, `optimizer.step()`,
    /// `zero_grad(set_to_none=True)`, no clipping.
    Loop,
    /// `transformers.Trainer`.
    Hf,
    /// TRL's `SFTTrainer`.
    TrlSft,
    /// TRL's `DPOTrainer`.
    TrlDpo,
    /// TRL's `GRPOTrainer` with HF generate (`use_vllm=False`).
    TrlGrpo,
    /// TRL's `RewardTrainer`.
    TrlReward,
}

impl TrainerKind {
    pub const ALL: [(&'static str, TrainerKind); 6] = [
        ("loop", TrainerKind::Loop),
        ("hf", TrainerKind::Hf),
        ("trl-sft", TrainerKind::TrlSft),
        ("trl-dpo", TrainerKind::TrlDpo),
        ("trl-grpo", TrainerKind::TrlGrpo),
        ("trl-reward", TrainerKind::TrlReward),
    ];

    pub fn name(self) -> &'static str {
        Self::ALL
            .iter()
            .find(|(_, k)| *k == self)
            .map(|(n, _)| *n)
            .expect("every kind is listed")
    }

    /// One of TRL's trainers: the model is loaded from its path, and the training forward
    /// goes through TRL's fused LM head (reward models excepted).
    pub fn is_trl(self) -> bool {
        matches!(
            self,
            TrainerKind::TrlSft
                | TrainerKind::TrlDpo
                | TrainerKind::TrlGrpo
                | TrainerKind::TrlReward
        )
    }

    /// Whether `gradient_checkpointing` is on when the spec does not say: TRL's configs turn
    /// it on, `TrainingArguments` and the loop leave it off.
    pub fn checkpointing_default(self) -> bool {
        self.is_trl()
    }

    /// The keys this trainer reads besides the run spec's own.
    fn keys(self) -> Vec<&'static str> {
        const COMMON: &[&str] = &[
            "max_steps",
            "gradient_accumulation_steps",
            "max_grad_norm",
            "use_liger_kernel",
        ];
        let own: &[&str] = match self {
            TrainerKind::Loop => return Vec::new(),
            TrainerKind::Hf | TrainerKind::TrlSft | TrainerKind::TrlReward => &[],
            TrainerKind::TrlDpo => &[
                "prompt_len",
                "beta",
                "reference",
                "precompute_ref_log_probs",
            ],
            TrainerKind::TrlGrpo => &[
                "prompt_len",
                "completion_len",
                "num_generations",
                "beta",
                "use_vllm",
                "vllm_mode",
                "vllm_gpu_memory_utilization",
                "vllm_enable_sleep_mode",
                "vllm_importance_sampling_correction",
            ],
        };
        COMMON.iter().chain(own).copied().collect()
    }
}

/// The keys any trainer reads; a run spec accepts them at its top level.
pub(crate) const TRAINER_KEYS: &[&str] = &[
    "trainer",
    "max_steps",
    "gradient_accumulation_steps",
    "max_grad_norm",
    "use_liger_kernel",
    "prompt_len",
    "completion_len",
    "num_generations",
    "beta",
    "reference",
    "precompute_ref_log_probs",
    "use_vllm",
    "vllm_mode",
    "vllm_gpu_memory_utilization",
    "vllm_enable_sleep_mode",
    "vllm_importance_sampling_correction",
];

/// DPO's own settings (`DPOConfig`, and the reference model handed to `DPOTrainer`).
#[derive(Clone, Debug, PartialEq)]
pub struct DpoSpec {
    /// Prompt tokens of each row; the chosen and rejected completions fill the rest of
    /// `seq_len`. Their labels are -100, so the LM head scores only the completion.
    pub prompt_len: u64,
    pub beta: f64,
    /// The dtype of a separate reference model passed as `ref_model`; `None`: TRL loads one
    /// from the policy's path (full fine-tuning) or disables the adapters (LoRA).
    pub reference: Option<ReferencePrecision>,
    /// `precompute_ref_log_probs=True`: the reference log-probs are computed once before
    /// training and the reference model is not kept.
    pub precompute_ref_log_probs: bool,
}

/// The dtype a separate reference model is loaded in.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReferencePrecision {
    Bf16,
    Fp32,
}

/// GRPO's own settings (`GRPOConfig`).
#[derive(Clone, Debug, PartialEq)]
pub struct GrpoSpec {
    pub prompt_len: u64,
    /// `max_completion_length`: every completion is generated to this length.
    pub completion_len: u64,
    /// Completions per prompt.
    pub num_generations: u64,
    /// The KL coefficient: above 0 a reference model is loaded from the policy's path (or the
    /// adapters are disabled for the reference pass under LoRA).
    pub beta: f64,
    /// `use_vllm=True`: vLLM generates instead of HF generate; `None`: HF generate.
    pub vllm: Option<Vllm>,
}

/// GRPO's vLLM settings (`GRPOConfig`'s `vllm_*`).
#[derive(Clone, Debug, PartialEq)]
pub struct Vllm {
    /// `vllm_mode="colocate"`: the engine shares this GPU, holding `gpu_memory_utilization` of
    /// it (weights and KV cache), outside PyTorch's allocator; `None`: `"server"`, on other GPUs.
    pub colocate: Option<Colocated>,
    /// `vllm_importance_sampling_correction`: the policy scores the completions again (no
    /// grad) to correct for vLLM's sampling distribution.
    pub importance_sampling: bool,
}

/// A vLLM engine on the training GPU.
#[derive(Clone, Debug, PartialEq)]
pub struct Colocated {
    pub gpu_memory_utilization: f64,
    /// `vllm_enable_sleep_mode`: the engine sleeps (level 2: weights and KV cache released)
    /// outside generation.
    pub sleep: bool,
}

/// The trainer and its settings.
#[derive(Clone, Debug, PartialEq)]
pub struct TrainerSpec {
    pub kind: TrainerKind,
    /// Micro-batches whose gradients add up before each optimizer step.
    pub gradient_accumulation_steps: u64,
    /// `max_grad_norm`: gradients are clipped to this norm before the step; 0 turns clipping
    /// off (the loop never clips).
    pub max_grad_norm: f64,
    /// Liger's fused linear cross-entropy replaces the LM head and the loss.
    pub use_liger_kernel: bool,
    pub dpo: Option<DpoSpec>,
    pub grpo: Option<GrpoSpec>,
}

impl Default for TrainerSpec {
    fn default() -> Self {
        TrainerSpec {
            kind: TrainerKind::Loop,
            gradient_accumulation_steps: 1,
            max_grad_norm: 0.0,
            use_liger_kernel: false,
            dpo: None,
            grpo: None,
        }
    }
}

impl TrainerSpec {
    /// Read the trainer keys of a run spec's mapping. `seq_len` is the spec's (DPO's default
    /// prompt is a quarter of it).
    /// `policy_precision`: the run spec's `precision`, the default of a reference model's
    /// (bf16 when the policy's weights are bf16, else fp32).
    pub(crate) fn from_spec(
        obj: &Map<String, Value>,
        seq_len: u64,
        policy_bf16: bool,
    ) -> Result<TrainerSpec> {
        let policy_precision = if policy_bf16 {
            ReferencePrecision::Bf16
        } else {
            ReferencePrecision::Fp32
        };
        let kind = match obj.get("trainer") {
            None | Some(Value::Null) => TrainerKind::Loop,
            Some(value) => {
                let allowed = || {
                    let names: Vec<&str> = TrainerKind::ALL.iter().map(|(n, _)| *n).collect();
                    format!("use one of {}", names.join(", "))
                };
                let name = value
                    .as_str()
                    .ok_or_else(|| Error::field("trainer", value, allowed()))?;
                TrainerKind::ALL
                    .iter()
                    .find(|(n, _)| *n == name)
                    .map(|(_, k)| *k)
                    .ok_or_else(|| Error::field("trainer", format!("{name:?}"), allowed()))?
            }
        };
        let own = kind.keys();
        if let Some(key) = TRAINER_KEYS
            .iter()
            .skip(1)
            .find(|k| obj.contains_key(**k) && !own.contains(k))
        {
            let allowed = if own.is_empty() {
                "set `trainer:` to a trainer that has it (hf, trl-sft, trl-dpo, trl-grpo, \
                 trl-reward)"
                    .to_string()
            } else {
                format!("its keys: {}", own.join(", "))
            };
            return Err(Error::field(
                *key,
                "this key",
                format!("trainer {} has no such setting; {allowed}", kind.name()),
            ));
        }
        if kind == TrainerKind::Loop {
            return Ok(TrainerSpec::default());
        }
        positive(obj, "max_steps", 3)?;
        let gradient_accumulation_steps = positive(obj, "gradient_accumulation_steps", 1)?;
        limits::within(
            "gradient_accumulation_steps",
            gradient_accumulation_steps,
            limits::MAX_ACCUMULATION_STEPS,
            "micro-batches after the second repeat it; real runs accumulate at most a few hundred",
        )?;
        let max_grad_norm = number(
            obj,
            "max_grad_norm",
            1.0,
            "use a number >= 0 (0: no clipping)",
        )?;
        let use_liger_kernel = boolean(obj, "use_liger_kernel")?;
        let beta = |default: f64| number(obj, "beta", default, "use a number >= 0");
        let dpo = if kind == TrainerKind::TrlDpo {
            let prompt_len = positive(obj, "prompt_len", (seq_len / 4).max(1))?;
            if prompt_len.saturating_add(1) >= seq_len {
                return Err(Error::field(
                    "prompt_len",
                    prompt_len,
                    format!(
                        "the prompt must leave room for a completion in seq_len ({seq_len}); \
                         use prompt_len < seq_len - 1"
                    ),
                ));
            }
            let reference = parse_reference(obj.get("reference"), policy_precision)?;
            let precompute_ref_log_probs = boolean(obj, "precompute_ref_log_probs")?;
            if precompute_ref_log_probs && reference.is_some() {
                return Err(Error::field(
                    "precompute_ref_log_probs",
                    true,
                    "with a separate `reference` model, choose one: the precomputed log-probs \
                     replace the reference model",
                ));
            }
            Some(DpoSpec {
                prompt_len,
                beta: beta(0.1)?,
                reference,
                precompute_ref_log_probs,
            })
        } else {
            None
        };
        let grpo = if kind == TrainerKind::TrlGrpo {
            if !obj.contains_key("prompt_len") {
                return Err(Error::field(
                    "prompt_len",
                    "missing",
                    "trl-grpo needs the prompt length in tokens (the longest prompt of a batch)",
                ));
            }
            let prompt_len = positive(obj, "prompt_len", 1)?;
            let completion_len = positive(obj, "completion_len", 256)?;
            limits::within(
                "completion_len",
                completion_len,
                limits::MAX_NEW_TOKENS,
                "each generated token is a decode step the estimate simulates",
            )?;
            let num_generations = positive(obj, "num_generations", 8)?;
            if num_generations < 2 {
                return Err(Error::field(
                    "num_generations",
                    num_generations,
                    "GRPO needs at least 2 completions per prompt to compute advantages",
                ));
            }
            Some(GrpoSpec {
                prompt_len,
                completion_len,
                num_generations,
                beta: beta(0.0)?,
                vllm: parse_vllm(obj)?,
            })
        } else {
            None
        };
        Ok(TrainerSpec {
            kind,
            gradient_accumulation_steps,
            max_grad_norm,
            use_liger_kernel,
            dpo,
            grpo,
        })
    }

    /// Whether a reference model is loaded beside the policy (DPO without precomputed
    /// log-probs and GRPO with `beta > 0`), as opposed to none or the policy with its adapters
    /// disabled; `lora`: the policy has adapters.
    pub fn loads_reference(&self, lora: bool) -> bool {
        match (&self.dpo, &self.grpo) {
            (Some(dpo), _) if dpo.reference.is_some() => true,
            (Some(_), _) => !lora,
            (_, Some(grpo)) => grpo.beta > 0.0 && !lora,
            _ => false,
        }
    }
}

/// GRPO's `use_vllm` and the `vllm_*` keys, refused without it.
fn parse_vllm(obj: &Map<String, Value>) -> Result<Option<Vllm>> {
    if !boolean(obj, "use_vllm")? {
        if let Some(key) = TRAINER_KEYS
            .iter()
            .find(|k| k.starts_with("vllm_") && obj.contains_key(**k))
        {
            return Err(Error::field(
                *key,
                &obj[*key],
                "it applies with use_vllm: true (GRPO generates with HF generate otherwise)",
            ));
        }
        return Ok(None);
    }
    let colocate = match obj.get("vllm_mode") {
        None => true,
        Some(Value::String(m)) if m == "colocate" => true,
        Some(Value::String(m)) if m == "server" => false,
        Some(v) => return Err(Error::field("vllm_mode", v, "use colocate or server")),
    };
    let utilization = number(
        obj,
        "vllm_gpu_memory_utilization",
        0.3,
        "use a number in (0, 1]",
    )?;
    if !(utilization > 0.0 && utilization <= 1.0) {
        return Err(Error::field(
            "vllm_gpu_memory_utilization",
            utilization,
            "use a number in (0, 1]: the share of the GPU's memory the engine takes",
        ));
    }
    let sleep = boolean(obj, "vllm_enable_sleep_mode")?;
    if !colocate
        && let Some(key) = ["vllm_gpu_memory_utilization", "vllm_enable_sleep_mode"]
            .into_iter()
            .find(|k| obj.contains_key(*k))
    {
        return Err(Error::field(
            key,
            &obj[key],
            "it applies to vllm_mode: colocate (a vLLM server runs on other GPUs)",
        ));
    }
    let importance_sampling = match obj.get("vllm_importance_sampling_correction") {
        None => true,
        Some(_) => boolean(obj, "vllm_importance_sampling_correction")?,
    };
    Ok(Some(Vllm {
        colocate: colocate.then_some(Colocated {
            gpu_memory_utilization: utilization,
            sleep,
        }),
        importance_sampling,
    }))
}

/// A number >= 0, or `default` when `key` is absent.
fn number(obj: &Map<String, Value>, key: &str, default: f64, allowed: &str) -> Result<f64> {
    match obj.get(key) {
        None => Ok(default),
        Some(v) => v
            .as_f64()
            .filter(|x| x.is_finite() && *x >= 0.0)
            .ok_or_else(|| Error::field(key, v, allowed)),
    }
}

fn parse_reference(
    value: Option<&Value>,
    default: ReferencePrecision,
) -> Result<Option<ReferencePrecision>> {
    let obj = match value {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::Object(obj)) => obj,
        Some(v) => {
            return Err(Error::field(
                "reference",
                v,
                "use a mapping {precision: bf16 | fp32} for a separate reference model",
            ));
        }
    };
    if let Some(key) = obj.keys().find(|k| k.as_str() != "precision") {
        return Err(Error::field(
            format!("reference.{key}"),
            "this key",
            "a reference model has one key, precision (bf16 or fp32)",
        ));
    }
    match obj.get("precision") {
        None => Ok(Some(default)),
        Some(Value::String(s)) if s == "bf16" => Ok(Some(ReferencePrecision::Bf16)),
        Some(Value::String(s)) if s == "fp32" => Ok(Some(ReferencePrecision::Fp32)),
        Some(other) => Err(Error::field(
            "reference.precision",
            other,
            "use bf16 or fp32",
        )),
    }
}
