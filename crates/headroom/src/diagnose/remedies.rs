//! Remedies for a run that does not fit: each single change to the spec, with the memory it
//! saves (simulated by the estimator where the spec can express it, computed from the
//! breakdown where it cannot) and what it costs, ranked so that the first remedy that fits is
//! the cheapest one.

use crate::error::Result;
use crate::plan::{self, Adapter, Evaluation, Knobs, Setup, Sharding};
use crate::sim::Component;
use crate::spec::{Mode, Optimizer, TrainerKind};
use crate::units::gib;

/// Where a remedy's number comes from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Basis {
    /// The estimator simulated the changed spec.
    Simulated,
    /// Computed from the breakdown at the peak and the per-phase peaks (see `plan`).
    Computed,
}

impl Basis {
    pub fn key(self) -> &'static str {
        match self {
            Basis::Simulated => "simulated",
            Basis::Computed => "computed from the breakdown",
        }
    }
}

#[derive(Clone, Debug)]
pub struct Remedy {
    /// Stable machine name.
    pub key: &'static str,
    pub title: String,
    /// What to change, in the user's tools.
    pub how: String,
    /// What it costs: compute, speed, or what is trained.
    pub cost: String,
    pub basis: Basis,
    pub evaluation: Evaluation,
    /// Device bytes saved against the spec (negative: it needs more).
    pub saving_bytes: i128,
    /// It changes the data the model sees (shorter sequences), not only how it is trained.
    pub changes_data: bool,
}

impl Remedy {
    /// Fitting first; among them, changes to the data last, then by `plan::score` (step
    /// time priced by fidelity); the rest by the memory they save.
    fn rank_key(&self) -> (bool, bool, i64, i128) {
        let score = if self.evaluation.fits {
            (plan::score(&self.evaluation) * 1000.0).round() as i64
        } else {
            0
        };
        (
            !self.evaluation.fits,
            self.changes_data,
            score,
            -self.saving_bytes,
        )
    }
}

/// Every remedy that applies to `setup`, ranked: those that fit first (exact ones before
/// approximate ones, faster before slower), then the rest by the memory they save.
pub fn remedies(setup: &Setup) -> Result<Vec<Remedy>> {
    let (est, base) = plan::baseline(setup)?;
    let k0 = Knobs::of(&setup.spec);
    let train = setup.spec.mode == Mode::Train;
    let component = |c: Component| -> u64 {
        est.breakdown
            .iter()
            .find(|(x, _)| *x == c)
            .map_or(0, |&(_, b)| b)
    };
    let mut out = Vec::new();
    let mut push = |key: &'static str,
                    title: String,
                    how: String,
                    cost: String,
                    k: Knobs,
                    changes_data: bool|
     -> Result<()> {
        // The spec as it is is no remedy; a sharding or offload computed off an already
        // sharded run would take shares off shares.
        let resharded = (k.sharding, k.cpu_offload) != (k0.sharding, k0.cpu_offload);
        if k == k0
            || (resharded && k0.sharding != Sharding::None && !plan::simulates_parallel(setup, &k))
        {
            return Ok(());
        }
        // A change the estimator does not model for this run (sharding a trainer's run) is
        // no remedy it can vouch for.
        let evaluation = match plan::evaluate(setup, &k) {
            Err(crate::error::Error::Unsupported { .. }) => return Ok(()),
            other => other?,
        };
        let basis = if k.has_computed() {
            Basis::Computed
        } else {
            Basis::Simulated
        };
        out.push(Remedy {
            key,
            title,
            how,
            cost,
            basis,
            saving_bytes: base.device_bytes as i128 - evaluation.device_bytes as i128,
            evaluation,
            changes_data,
        });
        Ok(())
    };

    let adam = matches!(k0.optimizer, Optimizer::AdamW | Optimizer::AdamWForLoop);
    if train && adam {
        push(
            "adamw-fused",
            "Fused AdamW".into(),
            "torch.optim.AdamW(..., fused=True); in HF/TRL `optim=\"adamw_torch_fused\"`".into(),
            "none: one kernel updates all parameters without the foreach path's \
             parameter-sized temporaries; usually a little faster"
                .into(),
            Knobs {
                optimizer: Optimizer::AdamWFused,
                ..k0.clone()
            },
            false,
        )?;
    }
    if train && (adam || k0.optimizer == Optimizer::AdamWFused) {
        push(
            "adamw-8bit",
            "8-bit AdamW".into(),
            "bitsandbytes.optim.AdamW8bit; in HF/TRL `optim=\"adamw_bnb_8bit\"`".into(),
            "optimizer states kept block-wise quantized to 8 bits (Dettmers et al. 2022 report \
             32-bit Adam quality); step speed about the same"
                .into(),
            Knobs {
                optimizer: Optimizer::AdamW8bit,
                ..k0.clone()
            },
            false,
        )?;
    }
    let trainer = setup.spec.trainer.kind;
    if train && !k0.gradient_checkpointing {
        let how = if trainer == TrainerKind::Loop {
            "model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={\"use_reentrant\": False}); \
             spec `gradient_checkpointing: true`"
        } else {
            "gradient_checkpointing=True in the trainer's config (TRL's configs turn it on by \
             default); spec `gradient_checkpointing: true`"
        };
        push(
            "gradient-checkpointing",
            "Gradient checkpointing".into(),
            how.into(),
            "each layer's forward runs again during backward: about 1/3 more compute per step"
                .into(),
            Knobs {
                gradient_checkpointing: true,
                ..k0.clone()
            },
            false,
        )?;
    }
    if train && k0.adapter == Adapter::Full {
        let mut cost = "trains low-rank adapters (r=16, all linear layers) instead of every \
                        weight: no gradients or optimizer states for the base, a faster step; \
                        results can differ from full fine-tuning"
            .to_string();
        if setup
            .residents
            .iter()
            .any(|r| r.name.starts_with(&est.model))
        {
            cost += ". With peft, TRL uses the adapter-disabled model as the reference \
                     (ref_model=None), so the resident copy of the same model can go too \
                     (see the resident remedy)";
        }
        push(
            "lora",
            "LoRA".into(),
            "peft.LoraConfig(r=16, lora_alpha=32, target_modules=\"all-linear\"); spec \
             `lora: {r: 16, alpha: 32}`"
                .into(),
            cost,
            Knobs {
                adapter: Adapter::Lora,
                ..k0.clone()
            },
            false,
        )?;
    }
    if train && k0.adapter < Adapter::Qlora {
        // peft's prepare_model_for_kbit_training turns checkpointing on unless told not to.
        push(
            "qlora",
            "QLoRA (4-bit NF4 base + LoRA, checkpointing)".into(),
            "BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=\"nf4\", \
             bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=torch.bfloat16), \
             prepare_model_for_kbit_training (gradient checkpointing on, its default), LoRA r=16"
                .into(),
            "base weights quantized to 4 bits and dequantized in every matmul (about 30% slower \
             than 16-bit LoRA) and the forward recomputed in backward; adapters only are trained"
                .into(),
            Knobs {
                adapter: Adapter::Qlora,
                gradient_checkpointing: true,
                ..k0.clone()
            },
            false,
        )?;
    }
    if k0.micro_batch > 1 {
        let mut chosen = None;
        let mut mb = k0.micro_batch;
        while mb > 1 {
            mb = mb.div_ceil(2);
            let k = Knobs {
                micro_batch: mb,
                accumulation: k0.micro_batch.div_ceil(mb),
                ..k0.clone()
            };
            let fits = plan::evaluate(setup, &k)?.fits;
            chosen = Some(k);
            if fits {
                break;
            }
        }
        if let Some(k) = chosen {
            let changed = plan::spec_for(setup, &k);
            let mb = changed.batch_size;
            let acc = if trainer == TrainerKind::Loop {
                k.accumulation
            } else {
                changed.trainer.gradient_accumulation_steps
            };
            let unit = match trainer {
                TrainerKind::TrlDpo | TrainerKind::TrlReward => " preference pairs",
                TrainerKind::TrlGrpo => " completions",
                _ => "",
            };
            push(
                "micro-batch",
                format!("Micro-batch {mb}{unit} with {acc} accumulation steps"),
                format!(
                    "per_device_train_batch_size={mb}, gradient_accumulation_steps={acc} (same \
                     tokens per optimizer step)"
                ),
                "smaller GEMMs use the GPU less well: slower per token, more so for short \
                 sequences"
                    .into(),
                k,
                false,
            )?;
        }
    }
    // Shortening the data is a remedy only for a run that does not fit as it is.
    if k0.seq_len > 1 && !base.fits {
        // The longest shorter sequence that fits; half when none does (to show the trend).
        let shorter = plan::max_seq_len(setup, k0.seq_len - 1)?
            .unwrap_or(k0.seq_len / 2)
            .max(1);
        let how = match &setup.spec.trainer.grpo {
            Some(grpo) => format!(
                "max_completion_length={} (completions of at most that many tokens after \
                 prompts of {})",
                shorter.saturating_sub(grpo.prompt_len).max(1),
                grpo.prompt_len
            ),
            None => format!("max_length={shorter} (truncate, or split long examples)"),
        };
        push(
            "shorter-sequences",
            format!("Sequences of {shorter} tokens"),
            how,
            "the model no longer sees tokens past the limit: changes the data, not only the \
             memory"
                .into(),
            Knobs {
                seq_len: shorter,
                ..k0.clone()
            },
            true,
        )?;
    }
    if !k0.expandable_segments {
        push(
            "expandable-segments",
            "Expandable segments".into(),
            "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (set before the first CUDA call)"
                .into(),
            "none measurable: segments grow in place, so freed memory is reused whatever the \
             tensor sizes"
                .into(),
            Knobs {
                expandable_segments: true,
                ..k0.clone()
            },
            false,
        )?;
    }
    let logits = component(Component::LogitsAndLoss);
    if logits > 0 && trainer == TrainerKind::Hf && !k0.fused_loss {
        push(
            "fused-loss",
            "Liger kernels and fused linear cross-entropy".into(),
            "use_liger_kernel=True in TrainingArguments (pip install liger-kernel)".into(),
            format!(
                "about the same speed; the {} of logits and loss at the peak become one chunk, \
                 and liger's RMSNorm, SwiGLU and RoPE keep fewer activations",
                gib(logits)
            ),
            Knobs {
                fused_loss: true,
                ..k0.clone()
            },
            false,
        )?;
    }
    if let Some(dpo) = &setup.spec.trainer.dpo
        && !dpo.precompute_ref_log_probs
        && setup
            .spec
            .trainer
            .loads_reference(setup.spec.lora.is_some())
    {
        push(
            "precompute-ref-log-probs",
            "Precompute the reference log-probs".into(),
            "precompute_ref_log_probs=True in DPOConfig (no reference model on the GPU during \
             training)"
                .into(),
            "one no-grad forward over the dataset before training; the reference model is not \
             kept"
                .into(),
            Knobs {
                precompute_ref_log_probs: true,
                ..k0.clone()
            },
            false,
        )?;
    }
    if logits > 0 && trainer == TrainerKind::Loop {
        push(
            "fused-loss",
            "Fused linear + cross-entropy loss".into(),
            "Liger Kernel's fused linear cross-entropy (`use_liger_kernel=True` in HF/TRL) or \
             Apple's cut-cross-entropy"
                .into(),
            format!(
                "about the same speed; the {} of logits, their fp32 copy and log-probabilities \
                 at the peak become one chunk",
                gib(logits)
            ),
            Knobs {
                fused_loss: true,
                ..k0.clone()
            },
            false,
        )?;
    }
    if train && setup.gpus > 1 {
        for (key, sharding, how, cost) in [
            (
                "zero-1",
                Sharding::Zero1,
                "DeepSpeed zero_optimization.stage: 1",
                "same communication as DDP",
            ),
            (
                "zero-2",
                Sharding::Zero2,
                "DeepSpeed zero_optimization.stage: 2, or FSDP SHARD_GRAD_OP",
                "same communication as DDP",
            ),
            (
                "zero-3",
                Sharding::Zero3,
                "DeepSpeed zero_optimization.stage: 3, or FSDP FULL_SHARD",
                "1.5× DDP's communication (weights gathered in forward and backward)",
            ),
        ] {
            push(
                key,
                format!("{} over {} GPUs", key.to_uppercase(), setup.gpus),
                how.into(),
                cost.into(),
                Knobs {
                    sharding,
                    ..k0.clone()
                },
                false,
            )?;
        }
    }
    if train && k0.optimizer != Optimizer::None {
        let host = est.trainable_params * 12;
        push(
            "cpu-offload",
            "Optimizer on the CPU".into(),
            "DeepSpeed zero_optimization.offload_optimizer.device: cpu (ZeRO-Offload), or FSDP \
             CPUOffload"
                .into(),
            format!(
                "Adam runs on the CPU and states cross PCIe every step (often 1.5× the step time \
                 or worse); needs about {} of host RAM for fp32 master weights and moments",
                gib(host)
            ),
            Knobs {
                cpu_offload: true,
                ..k0.clone()
            },
            false,
        )?;
    }
    if !setup.residents.is_empty() {
        let names: Vec<&str> = setup.residents.iter().map(|r| r.name.as_str()).collect();
        push(
            "residents-off-gpu",
            format!("Move {} off this GPU", names.join(", ")),
            "a DPO reference: precompute its log-probs once (TRL `precompute_ref_log_probs=True`); \
             a model queried during rollouts: serve it from another GPU or an inference server \
             (vLLM); otherwise keep it on the CPU"
                .into(),
            "precomputing costs one forward pass over the data before training; another GPU \
             costs that GPU; a CPU forward is much slower"
                .into(),
            Knobs {
                residents_off_gpu: true,
                ..k0.clone()
            },
            false,
        )?;
    }
    out.sort_by_key(Remedy::rank_key);
    Ok(out)
}
