//! A run under a real trainer, as `python -m headroom_measure.trainers` measures it
//! (bench/trainers/README.md): transformers' `Trainer`, or TRL 1.16's SFT, DPO, GRPO and
//! reward trainers with their defaults. The harness builds a random model from the config on
//! the GPU, saves it, frees it and empties the cache; `Trainer` gets a model built again from
//! the config, TRL's trainers the folder, which they load with `from_pretrained` (their
//! reference models too). Each optimizer step runs `gradient_accumulation_steps`
//! micro-batches (a GRPO micro-batch first generates its completions and scores them with the
//! reference), then clips the gradients to `max_grad_norm`, steps and zeroes them.

use super::instance::Instance;
use super::simulation::{Options, STEPS, Simulation};
use crate::arch::Architecture;
use crate::dtype::DType;
use crate::sim::engine::component::Component;
use crate::sim::engine::memory::PhasePeak;
use crate::sim::engine::tracer::{T, Tracer};
use crate::sim::model::load;
use crate::sim::model::trl::{self, Fields};
use crate::sim::model::{AttentionImpl, Batch};
use crate::sim::optim;
use crate::spec::{
    Attention, Home, Mode, Optimizer, Precision, ReferencePrecision, RunSpec, TrainerKind,
};

/// Micro-batches of one step that are simulated: from the third on, each starts where the
/// second did (the gradients exist), so it repeats it.
const SIMULATED_MICRO_BATCHES: u64 = 3;

/// Simulate the trainer's run of `spec` in the fresh process `t`.
pub(crate) fn simulate(
    spec: &RunSpec,
    arch: &Architecture,
    mut t: Tracer,
    options: &Options,
) -> Simulation {
    let kind = spec.trainer.kind;
    // The harness's leftover of building, saving and freeing the random model.
    let zero = t.empty_as(1, DType::F32, Component::Inputs, "torch.zeros(1)");
    t.drop(zero);
    if kind.is_trl() {
        load::save_random_model(&mut t, arch, spec.head(), attention(spec, arch));
    }
    let mut policy = Instance::build(&mut t, spec, arch, Home::Gpu, None);
    let mut reference = reference_model(&mut t, spec, arch);
    let mut engine = spec
        .trainer
        .grpo
        .as_ref()
        .and_then(|g| g.vllm.as_ref())
        .and_then(|v| v.colocate.as_ref())
        .map(|c| Engine::create(&mut t, c, options));
    let batch = Batch {
        b: spec.rows(),
        s: spec.seq_len,
    };
    if spec
        .trainer
        .dpo
        .as_ref()
        .is_some_and(|d| d.precompute_ref_log_probs)
    {
        precompute_ref_log_probs(&mut t, spec, &mut policy, reference.as_mut(), batch);
    }
    let mut phases = vec![t.mem.phase_peak()];
    // `Trainer.train()` starts with `accelerator.free_memory()`: `empty_cache()`.
    t.mem.allocator.empty_cache();
    let micro_batches = spec
        .trainer
        .gradient_accumulation_steps
        .min(SIMULATED_MICRO_BATCHES);
    // What the trainer keeps across steps: the last loss (`tr_loss_step`, until the next
    // training step returns) and the last gradient norm (until the next clip).
    let mut last_loss: Option<T> = None;
    let mut grad_norm: Option<T> = None;
    let mut inputs: Vec<T> = Vec::new();
    let mut buffered: Vec<T> = Vec::new();
    'steps: for step in 1..=STEPS {
        for micro in 0..micro_batches {
            // The next batch arrives before the last one is released.
            let next = load_batch(&mut t, spec, batch);
            t.drop_all(&std::mem::replace(&mut inputs, next));
            t.mem.begin_measured_phase("forward", step);
            let mut pass = Pass {
                t: &mut t,
                spec,
                policy: &mut policy,
                reference: reference.as_mut(),
                inputs: &inputs,
                batch,
                step,
                first_micro_batch: micro == 0,
                buffered: &mut buffered,
                engine: engine.as_mut(),
                phases: &mut phases,
            };
            let loss = pass.loss();
            phases.push(t.mem.phase_peak());
            if t.mem.stopped() {
                break 'steps;
            }
            // accelerate's `loss / gradient_accumulation_steps`, then `loss.backward()`.
            let scaled = t.mul_scalar(loss);
            t.mem.begin_measured_phase("backward", step);
            policy.backward(&mut t, scaled);
            phases.push(t.mem.phase_peak());
            if let Some(previous) = last_loss.replace(loss) {
                t.drop(previous);
            }
            if t.mem.stopped() {
                break 'steps;
            }
        }
        t.mem.begin_measured_phase("optimizer", step);
        if spec.trainer.max_grad_norm > 0.0 {
            let norm = optim::clip_grad_norm(&mut t, &policy.trainable);
            if let Some(previous) = std::mem::replace(&mut grad_norm, norm) {
                t.drop(previous);
            }
        }
        policy.optimizer_step(&mut t);
        policy.zero_grad(&mut t);
        phases.push(t.mem.phase_peak());
        if t.mem.stopped() {
            break;
        }
    }
    t.drop_all(&inputs);
    t.drop_all(&buffered);
    for kept in [last_loss, grad_norm].into_iter().flatten() {
        t.drop(kept);
    }
    let mut simulation = Simulation::of_run(t, &policy, phases);
    if let Some(engine) = engine {
        simulation.engine_bytes = engine.beyond(simulation.peak_reserved);
    }
    simulation
}

/// A vLLM engine colocated with GRPO's training (`vllm_mode="colocate"`): its share of the
/// device (`gpu_memory_utilization` of the total: weights and KV cache) lives outside PyTorch's
/// allocator, which gets what is left while the engine is awake. With sleep mode it sleeps at
/// level 2 (both released) outside generation and wakes after `empty_cache()`.
struct Engine {
    share: u64,
    sleeps: bool,
    awake: bool,
    /// What the allocator may hold with the engine asleep (`None`: no limit).
    capacity: Option<u64>,
    /// The most the device held with the engine awake: the allocator's reserve then, plus the
    /// share.
    awake_peak: u64,
}

impl Engine {
    /// `LLM(..., gpu_memory_utilization=u, enable_sleep_mode=s)` in the trainer's `__init__`,
    /// then `sleep(level=2)` with sleep mode.
    fn create(t: &mut Tracer, colocated: &crate::spec::Colocated, options: &Options) -> Engine {
        let share = (colocated.gpu_memory_utilization * options.device_total as f64) as u64;
        let mut engine = Engine {
            share,
            sleeps: colocated.sleep,
            awake: false,
            capacity: options.capacity,
            awake_peak: 0,
        };
        engine.wake(t);
        engine.sleep(t);
        engine
    }

    fn wake(&mut self, t: &mut Tracer) {
        if self.awake {
            return;
        }
        if self.sleeps {
            t.mem.allocator.empty_cache();
        }
        self.awake = true;
        if let Some(capacity) = self.capacity {
            t.mem
                .outside_allocation(self.share, capacity, "vLLM engine (weights + KV cache)");
            if !t.mem.stopped() {
                t.mem
                    .allocator
                    .set_capacity(Some(capacity.saturating_sub(self.share)));
            }
        }
        let reserved = t.mem.allocator.stats().reserved_bytes.all.current as u64;
        self.awake_peak = self.awake_peak.max(reserved + self.share);
    }

    fn sleep(&mut self, t: &mut Tracer) {
        if self.sleeps && self.awake {
            self.awake = false;
            if self.capacity.is_some() && !t.mem.stopped() {
                t.mem.allocator.set_capacity(self.capacity);
            }
        }
    }

    /// What the engine adds to the allocator's peak reserve `peak_reserved`.
    fn beyond(&self, peak_reserved: u64) -> u64 {
        if self.awake {
            self.share
                .max(self.awake_peak.saturating_sub(peak_reserved))
        } else {
            self.awake_peak.saturating_sub(peak_reserved)
        }
    }
}

/// One micro-batch's way to its loss, trainer by trainer.
struct Pass<'a> {
    t: &'a mut Tracer,
    spec: &'a RunSpec,
    policy: &'a mut Instance,
    reference: Option<&'a mut Instance>,
    inputs: &'a [T],
    batch: Batch,
    step: u32,
    /// The first micro-batch of the step (GRPO generates for every micro-batch of the step
    /// there).
    first_micro_batch: bool,
    /// GRPO's `_buffered_inputs`: the completions and what was computed for them, kept until
    /// the next generation has replaced them.
    buffered: &'a mut Vec<T>,
    /// GRPO's colocated vLLM engine.
    engine: Option<&'a mut Engine>,
    phases: &'a mut Vec<PhasePeak>,
}

impl Pass<'_> {
    fn loss(&mut self) -> T {
        let kind = self.spec.trainer.kind;
        if kind == TrainerKind::TrlGrpo {
            return self.grpo_loss();
        }
        let t = &mut *self.t;
        let ids = self.inputs[0];
        match kind {
            TrainerKind::Loop | TrainerKind::Hf => self.policy.forward_for_loss(t, ids),
            TrainerKind::TrlSft => {
                let scored = self.batch.b * (self.batch.s - 1);
                let fused = self.policy.fused_forward(t, ids, scored, Fields::SFT);
                let num_items = *self.inputs.last().expect("SFT's batch counts its items");
                trl::sft_loss(t, fused, num_items)
            }
            TrainerKind::TrlReward => self.policy.reward_forward(t, ids),
            TrainerKind::TrlDpo => self.dpo_loss(),
            TrainerKind::TrlGrpo => unreachable!("handled above"),
        }
    }

    /// DPOTrainer: the policy's forward over chosen and rejected rows, the reference's
    /// (a separate model, the policy with its adapters disabled, or log-probs precomputed
    /// into the batch), then the sigmoid loss.
    fn dpo_loss(&mut self) -> T {
        let dpo = self.spec.trainer.dpo.as_ref().expect("a DPO spec");
        let t = &mut *self.t;
        let ids = self.inputs[0];
        let rows = self.batch.b;
        let scored = rows * (self.batch.s - dpo.prompt_len);
        let labels = trl::dpo_labels(t, self.batch);
        let policy = self.policy.fused_forward(t, ids, scored, Fields::DPO);
        let logps = trl::sequence_logps(t, policy.log_probs, rows);
        self.phases.push(t.mem.phase_peak());
        t.mem.begin_measured_phase("reference", self.step);
        let (reference, ref_logps) = if dpo.precompute_ref_log_probs {
            let n = self.inputs.len();
            (None, [self.inputs[n - 2], self.inputs[n - 1]])
        } else {
            let grad = t.set_grad_enabled(false);
            let out = match self.reference.as_deref_mut() {
                Some(reference) => reference.fused_forward(t, ids, scored, Fields::LOG_PROBS),
                None => {
                    self.policy.model.adapters_disabled = true;
                    let out = self.policy.fused_forward(t, ids, scored, Fields::DPO);
                    self.policy.model.adapters_disabled = false;
                    out
                }
            };
            t.set_grad_enabled(grad);
            let ref_logps = trl::sequence_logps(t, out.log_probs, rows);
            let halves = [t.view(ref_logps, rows / 2, "ref_logps.chunk(2)"); 2];
            let halves = [halves[0], t.view(ref_logps, rows / 2, "ref_logps.chunk(2)")];
            t.drop(ref_logps);
            (Some(out), halves)
        };
        let loss = trl::dpo_loss(t, &policy, logps, ref_logps, scored);
        if let Some(reference) = reference {
            reference.release(t);
            t.drop_all(&ref_logps);
        }
        t.drop(logps);
        policy.release(t);
        t.drop(labels);
        loss
    }
}

impl Pass<'_> {
    /// GRPOTrainer: at the first micro-batch of a step, `generate` for all the step's
    /// completions, then (with `beta > 0`) the reference's log-probs in chunks of
    /// `per_device_train_batch_size` rows, all kept in `_buffered_inputs`; then the policy's
    /// forward over prompt and completion, and the clipped loss.
    fn grpo_loss(&mut self) -> T {
        let grpo = self.spec.trainer.grpo.as_ref().expect("a GRPO spec");
        let (rows, prompt, completion) = (self.batch.b, grpo.prompt_len, grpo.completion_len);
        let lora = self.spec.lora.is_some();
        let scored = rows * completion;
        if self.first_micro_batch {
            let t = &mut *self.t;
            let generation_rows = rows * self.spec.trainer.gradient_accumulation_steps;
            t.mem.begin_measured_phase("generate", self.step);
            let sampling_logps = match &grpo.vllm {
                None => {
                    self.policy
                        .sample_pass(t, generation_rows, prompt, completion, !lora);
                    None
                }
                Some(vllm) => {
                    if let Some(engine) = self.engine.as_deref_mut() {
                        // `sync_weights`: the engine wakes, the policy's weights are loaded
                        // into it (a LoRA policy merged for it, then unmerged), it generates.
                        engine.wake(t);
                        if lora {
                            merge_adapters(t, self.policy);
                        }
                        engine.sleep(t);
                    }
                    // vLLM's log-probs of the sampled tokens, for the importance sampling.
                    vllm.importance_sampling.then(|| {
                        t.empty_as(
                            generation_rows * completion,
                            DType::F32,
                            Component::Inputs,
                            "sampling_per_token_logps (vLLM)",
                        )
                    })
                }
            };
            self.phases.push(t.mem.phase_peak());
            t.mem.begin_measured_phase("reference", self.step);
            let outer = std::mem::replace(&mut t.component, Component::Inputs);
            let full = generation_rows * (prompt + completion);
            let joined = [
                t.empty(full, DType::I64, "prompt_completion_ids"),
                t.empty(full, DType::I64, "attention_mask (prompt + completion)"),
            ];
            let mut next: Vec<T> = [
                (generation_rows * prompt, "prompt_ids"),
                (generation_rows * prompt, "prompt_mask"),
                (generation_rows * completion, "completion_ids"),
                (generation_rows * completion, "completion_mask"),
            ]
            .into_iter()
            .map(|(numel, label)| t.empty(numel, DType::I64, label))
            .collect();
            next.push(t.empty(generation_rows, DType::F32, "advantages"));
            next.push(t.empty(1, DType::I64, "num_items_in_batch"));
            next.extend(sampling_logps);
            t.component = outer;
            // The policy scores its own completions again (no grad) when vLLM sampled them,
            // then the reference scores them for the KL term.
            if sampling_logps.is_some() {
                next.push(self.score(joined[0], Scorer::Policy, "old_per_token_logps"));
            }
            if grpo.beta > 0.0 {
                next.push(self.score(joined[0], Scorer::Reference, "ref_per_token_logps"));
            }
            let t = &mut *self.t;
            t.drop_all(&joined);
            t.drop_all(&std::mem::replace(self.buffered, next));
            self.phases.push(t.mem.phase_peak());
            t.mem.begin_measured_phase("forward", self.step);
        }
        let t = &mut *self.t;
        let reference = (grpo.beta > 0.0).then(|| self.buffered[self.buffered.len() - 1]);
        let outer = std::mem::replace(&mut t.component, Component::Inputs);
        let full = rows * (prompt + completion);
        let ids = t.empty(
            full,
            DType::I64,
            "input_ids = cat(prompt_ids, completion_ids)",
        );
        let mask = t.empty(
            full,
            DType::I64,
            "attention_mask = cat(prompt_mask, completion_mask)",
        );
        let padding = t.empty(full, DType::Bool, "attention_mask == 0");
        let labels = t.empty(full, DType::I64, "labels");
        t.drop(padding);
        t.component = outer;
        let fused = self.policy.fused_forward(t, ids, scored, Fields::GRPO);
        let logps = trl::completion_logps(t, fused.log_probs, rows, completion);
        let entropy = fused.entropy.expect("GRPO's head computes the entropy");
        let entropies = trl::completion_logps(t, entropy, rows, completion);
        let loss = trl::grpo_loss(t, logps, entropies, reference, rows);
        t.drop(logps);
        fused.release(t);
        t.drop_all(&[labels, mask, ids]);
        loss
    }
}

/// peft's `merge_adapter()` then `unmerge_adapter()` around TRL's weight sync to vLLM: per
/// LoRA linear, `(B @ A) * scaling` in the adapters' fp32, cast to the base weight's dtype and
/// added in place, then the same to take it out.
fn merge_adapters(t: &mut Tracer, policy: &mut Instance) {
    let base = policy.model.dtype;
    let shapes: Vec<(u64, u64)> = policy
        .model
        .linears_mut()
        .into_iter()
        .filter(|(_, l)| l.lora.is_some())
        .map(|(_, l)| (l.out_features, l.in_features))
        .collect();
    let outer = std::mem::replace(&mut t.component, Component::LoraQuantExtras);
    for _ in 0..2 {
        for &(rows, cols) in &shapes {
            let product = t.empty(rows * cols, DType::F32, "lora_B @ lora_A");
            let scaled = t.empty(rows * cols, DType::F32, "delta * scaling");
            t.drop(product);
            let cast = t.empty(rows * cols, base, "delta.to(weight.dtype)");
            t.drop_all(&[scaled, cast]);
        }
    }
    t.component = outer;
}

/// Who scores GRPO's completions without grad.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Scorer {
    /// The policy (`old_per_token_logps`).
    Policy,
    /// The reference model, or the policy with its adapters disabled.
    Reference,
}

impl Pass<'_> {
    /// `_get_per_token_logps_and_entropies` under `no_grad` over the step's completions
    /// `ids`, in chunks of `per_device_train_batch_size` rows, each chunk's
    /// `log_probs[:, -completion:]` kept until the `torch.cat` of them all (`label`), which
    /// is returned.
    fn score(&mut self, ids: T, scorer: Scorer, label: &'static str) -> T {
        let grpo = self.spec.trainer.grpo.as_ref().expect("a GRPO spec");
        let (rows, completion) = (self.batch.b, grpo.completion_len);
        let chunks = self.spec.trainer.gradient_accumulation_steps;
        let t = &mut *self.t;
        let grad = t.set_grad_enabled(false);
        let mut parts = Vec::new();
        for _ in 0..chunks.min(SIMULATED_MICRO_BATCHES) {
            let scored = rows * completion;
            let out = match (scorer, self.reference.as_deref_mut()) {
                (Scorer::Reference, Some(reference)) => {
                    reference.fused_forward(t, ids, scored, Fields::LOG_PROBS)
                }
                (Scorer::Reference, None) => {
                    self.policy.model.adapters_disabled = true;
                    let out = self.policy.fused_forward(t, ids, scored, Fields::GRPO);
                    self.policy.model.adapters_disabled = false;
                    out
                }
                (Scorer::Policy, _) => self.policy.fused_forward(t, ids, scored, Fields::GRPO),
            };
            parts.push(trl::completion_logps(t, out.log_probs, rows, completion));
            out.release(t);
        }
        t.set_grad_enabled(grad);
        let all = t.empty(chunks * rows * completion, DType::F32, label);
        t.drop_all(&parts);
        all
    }
}

/// The reference model a trainer loads beside the policy: DPO's `ref_model` (given, or
/// loaded from the policy's path for full fine-tuning) and GRPO's with `beta > 0`, each from
/// the saved folder in its dtype, its parameters left requiring grad (so that autocast caches
/// the casts of fp32 weights for the length of a forward).
fn reference_model(t: &mut Tracer, spec: &RunSpec, arch: &Architecture) -> Option<Instance> {
    let trainer = &spec.trainer;
    if !trainer.loads_reference(spec.lora.is_some())
        || trainer
            .dpo
            .as_ref()
            .is_some_and(|d| d.precompute_ref_log_probs && d.reference.is_none())
    {
        return None;
    }
    let weights_fp32 = match trainer.dpo.as_ref().and_then(|d| d.reference) {
        Some(precision) => precision == ReferencePrecision::Fp32,
        None => spec.precision != Precision::Bf16,
    };
    let autocast = spec.precision != Precision::Fp32;
    let precision = match (weights_fp32, autocast) {
        (true, true) => Precision::AmpBf16,
        (true, false) => Precision::Fp32,
        (false, _) => Precision::Bf16,
    };
    // accelerate prepares a reference for evaluation: never wrapped in DDP.
    let reference_spec = RunSpec {
        parallel: None,
        mode: Mode::Forward,
        optimizer: Optimizer::None,
        precision,
        lora: None,
        quantization: None,
        kbit_prepare: false,
        gradient_checkpointing: false,
        ..spec.clone()
    };
    let mut reference = Instance::build(t, &reference_spec, arch, Home::Gpu, None);
    // liger's RoPE is patched module-wide, so the reference (built before `train()` patches
    // the policy's modules) rotates in place too.
    reference.model.liger.rope = spec.trainer.use_liger_kernel;
    for p in reference.params.clone() {
        t.set_trainable(p, true);
    }
    Some(reference)
}

/// `precompute_ref_log_probs=True`: in `DPOTrainer.__init__`, one no-grad forward per batch
/// under `accelerator.autocast()` (the policy, its adapters disabled, unless a reference is
/// given), the sums moved to the host. Every batch leaves the device as it found it but for
/// the cuBLAS workspaces its first matmul creates; one is simulated.
fn precompute_ref_log_probs(
    t: &mut Tracer,
    spec: &RunSpec,
    policy: &mut Instance,
    reference: Option<&mut Instance>,
    batch: Batch,
) {
    let dpo = spec.trainer.dpo.as_ref().expect("a DPO spec");
    let inputs = load_batch(t, spec, batch);
    let labels = trl::dpo_labels(t, batch);
    let scored = batch.b * (batch.s - dpo.prompt_len);
    let grad = t.set_grad_enabled(false);
    let out = match reference {
        Some(reference) => reference.fused_forward(t, inputs[0], scored, Fields::LOG_PROBS),
        None => {
            policy.model.adapters_disabled = spec.lora.is_some();
            let out = policy.fused_forward(t, inputs[0], scored, Fields::DPO);
            policy.model.adapters_disabled = false;
            out
        }
    };
    t.set_grad_enabled(grad);
    let logps = trl::sequence_logps(t, out.log_probs, batch.b);
    t.drop(logps);
    out.release(t);
    t.drop(labels);
    t.drop_all(&inputs);
}

fn attention(spec: &RunSpec, arch: &Architecture) -> AttentionImpl {
    match spec.attention_for(arch) {
        Attention::Sdpa => AttentionImpl::Sdpa,
        Attention::Eager => AttentionImpl::Eager,
    }
}

/// The collator's batch, moved to the GPU: `[rows, seq]` int64 tensors (`input_ids` first),
/// then what each trainer adds: the causal-LM trainers' `num_items_in_batch`, DPO's
/// precomputed reference log-probs.
fn load_batch(t: &mut Tracer, spec: &RunSpec, batch: Batch) -> Vec<T> {
    let outer = std::mem::replace(&mut t.component, Component::Inputs);
    let n = batch.n();
    let names: &[&'static str] = match spec.trainer.kind {
        // GRPO's batches are prompts as text; its tensors are made when it generates.
        TrainerKind::TrlGrpo => &[],
        TrainerKind::TrlReward => &["input_ids", "attention_mask"],
        TrainerKind::TrlDpo => &["input_ids", "attention_mask", "completion_mask"],
        _ => &["input_ids", "attention_mask", "labels"],
    };
    let mut inputs: Vec<T> = names
        .iter()
        .map(|name| t.empty(n, DType::I64, name))
        .collect();
    t.component = outer;
    match spec.trainer.kind {
        TrainerKind::TrlReward | TrainerKind::TrlGrpo => {}
        TrainerKind::TrlDpo => {
            if spec
                .trainer
                .dpo
                .as_ref()
                .is_some_and(|d| d.precompute_ref_log_probs)
            {
                let pairs = batch.b / 2;
                for name in ["ref_chosen_logps", "ref_rejected_logps"] {
                    inputs.push(t.empty_as(pairs, DType::F32, Component::Inputs, name));
                }
            }
        }
        _ => inputs.push(num_items_in_batch(t, batch)),
    }
    inputs
}

/// `Trainer._get_num_items_in_batch`: `(labels[..., 1:] != -100).sum()` kept on the device
/// as an int64 scalar.
fn num_items_in_batch(t: &mut Tracer, batch: Batch) -> T {
    let outer = std::mem::replace(&mut t.component, Component::Inputs);
    let positions = batch.b * (batch.s - 1);
    let valid = t.empty(positions, DType::Bool, "labels[..., 1:].ne(-100)");
    let sum = trl::count_true(t, positions);
    t.drop(valid);
    let items = t.empty(1, DType::I64, "num_items_in_batch");
    t.drop(sum);
    t.component = outer;
    items
}
