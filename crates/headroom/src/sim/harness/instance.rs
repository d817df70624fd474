//! One model as a process builds and uses it: parameters (loaded 4-bit, sharded by FSDP2 or
//! left on the host), adapters, checkpointing, DDP, the optimizer, and the passes a training
//! step or a pipeline phase runs on it. A single run has one instance; a pipeline several,
//! in one tracer and one caching allocator.

use std::cell::RefCell;
use std::ops::Range;

use crate::arch::{Architecture, Module, Param};
use crate::dtype::DType;
use crate::sim::engine::component::Component;
use crate::sim::engine::tracer::{BackwardHooks, ParamId, T, Tracer};
use crate::sim::model::heads::{lm_head, logprob_forward, train_forward};
use crate::sim::model::release::ReleaseCode;
use crate::sim::model::transformer::{ExpertLora, LoraAdapter, Model};
use crate::sim::model::{AttentionImpl, Batch};
use crate::sim::model::{liger, load, quant, trl};
use crate::sim::optim::OptimizerState;
use crate::sim::strategy::Strategy;
use crate::sim::strategy::cp::{ContextParallel, ShardedBatch};
use crate::sim::strategy::ddp::Ddp;
use crate::sim::strategy::fsdp::Fsdp;
use crate::sim::strategy::fsdp_offload::FsdpOffload;
use crate::sim::strategy::fsdp1::Fsdp1;
use crate::sim::strategy::tp::TensorParallel;
use crate::sim::strategy::zero::Zero;
use crate::sim::strategy::zero3::Zero3;
use crate::spec::{
    self, Attention, BuiltLora, Home, Lora, Mode, Optimizer, Precision, Quantization, RunSpec,
    Task, lora_targets_module,
};

pub(crate) struct Instance {
    pub(crate) spec: RunSpec,
    pub(crate) model: Model,
    pub(crate) batch: Batch,
    autocast: Option<DType>,
    /// The model's parameters, adapters included (not FSDP2's shards).
    pub(crate) params: Range<ParamId>,
    /// What the optimizer steps: the trainable parameters, FSDP2's shards on the device, or
    /// DeepSpeed's fp32 master partition.
    pub(crate) trainable: Vec<ParamId>,
    pub(crate) optimizer: OptimizerState,
    /// `sum(p.numel() for p in model.parameters())` as transformers built it (4-bit weights
    /// count packed bytes), and of the trainable ones after adapters.
    pub(crate) param_count: u64,
    pub(crate) trainable_count: u64,
    /// Allocated bytes once the weights are in place (before adapters and wrapping).
    pub(crate) weights_loaded: u64,
}

impl Instance {
    /// Build the model of `spec` as the harness does: the weights (loaded 4-bit, or created
    /// from the config on the GPU, on the host, or on the meta device and sharded), then
    /// `prepare_model_for_kbit_training`, peft, checkpointing and DDP, as rank `rank` sees
    /// it (where ranks differ: DeepSpeed ZeRO's partitions, context parallelism's ring steps);
    /// `None`: the last rank.
    pub(crate) fn build(
        t: &mut Tracer,
        spec: &RunSpec,
        arch: &Architecture,
        home: Home,
        rank: Option<u64>,
    ) -> Self {
        let head = spec.head();
        let train = spec.mode == Mode::Train;
        // A tensor-parallel rank builds and runs its share of every layer.
        let tensor = spec
            .parallel
            .as_ref()
            .map(|p| p.tensor)
            .filter(|t| t.tp > 1);
        // An expert-parallel rank builds its share of every MoE layer's experts.
        let ep = spec.parallel.as_ref().map_or(1, |p| p.tensor.ep);
        let full_arch = arch;
        let shard;
        let arch = match tensor {
            Some(tensor) => {
                shard = arch.tensor_parallel_shard(
                    tensor.tp,
                    tensor.framework != spec::Framework::Transformers,
                );
                &shard
            }
            None if ep > 1 => {
                shard = arch.expert_parallel_shard(ep);
                &shard
            }
            None => arch,
        };
        let dtensors = tensor.is_some() || ep > 1;
        let trainable = |_: &Param| train;
        let attention = attention_impl(spec, arch);
        let dtype = param_dtype(spec);
        let parallel = spec.parallel.as_ref();
        // Under FSDP2's mixed-precision policy the model computes in `param_dtype`; its shards
        // keep the storage dtype.
        let compute_dtype = parallel
            .and_then(|p| p.mixed_precision)
            .map_or(dtype, |m| m.param_dtype);
        let strategy = parallel.map(|p| p.strategy);
        // FSDP2 with CPU offload on a one-rank group for a no-grad pass (slime's reference):
        // the units come to the GPU one at a time, from host memory.
        let offloaded_unsharded = parallel.is_some_and(|p| {
            p.strategy == spec::Strategy::Fsdp && p.world_size == 1 && p.offload_params && !train
        });
        let loads_saved = spec.trainer.kind.is_trl() && home == Home::Gpu;
        let first = t.params.len();
        let mut model = match spec.quantization {
            // TRL's trainers load every model from the folder the harness saved.
            Some(Quantization::Nf4) if loads_saved => {
                load::from_pretrained(t, arch, head, DType::BF16, attention, &trainable, true)
            }
            Some(Quantization::Nf4) => {
                load::save_random_model(t, arch, head, attention);
                load::from_pretrained(t, arch, head, DType::BF16, attention, &trainable, true)
            }
            None if loads_saved => {
                load::from_pretrained(t, arch, head, dtype, attention, &trainable, false)
            }
            None if home == Home::Cpu || offloaded_unsharded => {
                Model::build_on_meta(t, arch, head, dtype, &trainable, attention)
            }
            None if matches!(
                strategy,
                Some(spec::Strategy::Fsdp | spec::Strategy::Fsdp1 | spec::Strategy::Zero3)
            ) =>
            {
                Model::build_on_meta(t, arch, head, compute_dtype, &trainable, attention)
            }
            None => Model::build(t, arch, head, dtype, &trainable, attention),
        };
        // A DTensor counts its global size.
        let param_count = if dtensors {
            full_arch.parameters(head).iter().map(Param::numel).sum()
        } else {
            (first..t.params.len()).map(|p| t.numel(t.param(p))).sum()
        };
        let transformers = spec.versions.followed(spec::Library::Transformers);
        model.release = ReleaseCode::of(transformers, arch.family);
        model.passes_attention_mask = spec.trainer.kind != spec::TrainerKind::Loop;
        let on_gpu = home == Home::Gpu
            && !offloaded_unsharded
            && !matches!(
                strategy,
                Some(spec::Strategy::Fsdp | spec::Strategy::Fsdp1 | spec::Strategy::Zero3)
            );
        // 4.x's `GPT2Attention` registers a causal `bias` buffer; 5.x does not.
        let transformers_4 = transformers.is_some_and(|v| v.major == 4);
        if transformers_4 && arch.family == crate::arch::Family::Gpt2 && on_gpu {
            Model::gpt2_causal_buffers(t, arch);
        }
        let mut wrapper = Strategy::Local;
        if offloaded_unsharded {
            wrapper = Strategy::FsdpOffload(FsdpOffload::units(arch, head, first));
        } else if let Some(parallel) = parallel.filter(|p| p.strategy == spec::Strategy::Fsdp) {
            wrapper = Strategy::Fsdp(Fsdp::shard(t, arch, head, first, dtype, parallel, &|_| {
                true
            }));
        } else if let Some(parallel) = parallel.filter(|p| p.strategy == spec::Strategy::Fsdp1) {
            wrapper = Strategy::Fsdp1(Fsdp1::wrap(t, arch, head, first, dtype, parallel));
        }
        let model_params = first..first + arch.parameters(head).len();
        let all_model_params: Vec<ParamId> = model_params.clone().collect();
        // ZeRO-3: `from_config` under `deepspeed.zero.Init` (each parameter partitioned as
        // it is made, then gathered for transformers' init); the buffers are made on the GPU.
        let zero3_partitions = parallel
            .filter(|p| p.strategy == spec::Strategy::Zero3)
            .map(|p| {
                let tied_head = (arch.tie_word_embeddings && head == crate::arch::Head::CausalLm)
                    .then(|| {
                        let numel = t.numel(t.param(model.embed));
                        t.parameter_deferred(numel, dtype, false, "untied lm_head (zero.Init)")
                    });
                let made = Zero3::init(t, &all_model_params, p, tied_head);
                t.persistent_buffers(&arch.buffers(), "rotary inv_freq");
                made
            });
        let weights_loaded = t.mem.allocated();
        if spec.kbit_prepare {
            quant::prepare_kbit(t, model_params.clone());
        }
        if let Some(lora) = &spec.lora {
            install_lora(t, &mut model, model_params.clone(), lora, spec.task);
        }
        // Adapters follow the model's parameters; FSDP2's shards are not the model's.
        let params = if matches!(wrapper, Strategy::Fsdp(_) | Strategy::Fsdp1(_)) {
            model_params
        } else {
            first..t.params.len()
        };
        // `apply_liger_kernel` in `Trainer.train()` patches the trained model's modules.
        if spec.trainer.use_liger_kernel && train {
            model.liger = liger::Kernels {
                rope: true,
                layers: true,
                fused_linear_cross_entropy: spec.trainer.kind == spec::TrainerKind::Hf,
            };
        }
        model.checkpointing = spec.gradient_checkpointing && train;
        model.experts_impl = spec.experts;
        model.routing_factor = spec.routing_factor;
        model.inputs_require_grads = model.checkpointing;
        let trainable_ids: Vec<ParamId> = params
            .clone()
            .filter(|&p| t.requires_grad(t.param(p)))
            .collect();
        let trainable_count = if dtensors && train && spec.lora.is_none() {
            param_count
        } else {
            trainable_ids.iter().map(|&p| t.numel(t.param(p))).sum()
        };
        let trainable_ids = match &wrapper {
            Strategy::Fsdp(fsdp) => fsdp.device_shards(),
            Strategy::Fsdp1(fsdp1) => fsdp1.device_params(),
            _ => trainable_ids,
        };
        if strategy == Some(spec::Strategy::Ddp) {
            let all: Vec<ParamId> = params.clone().collect();
            let ranks = parallel.map_or(1, |p| p.world_size / p.pipeline.pp / p.tensor.tp);
            wrapper = Strategy::Ddp(Ddp::wrap(t, &all, &trainable_ids, arch.buffers(), ranks));
        }
        // DeepSpeed ZeRO 1/2: the optimizer steps the rank's fp32 master partition, and the
        // engine turns the harness's `torch.autocast` off (its forward runs in the
        // parameters' dtype).
        let mut autocast = autocast_dtype(spec);
        let trainable_ids = match parallel.filter(|p| {
            matches!(p.strategy, spec::Strategy::Zero1 | spec::Strategy::Zero2)
                && !trainable_ids.is_empty()
        }) {
            Some(parallel) => {
                let world = parallel.world_size;
                let rank = rank.unwrap_or(world - 1).min(world - 1);
                let zero = Zero::wrap(
                    t,
                    &trainable_ids,
                    parallel.strategy,
                    world,
                    rank,
                    parallel.offload_optimizer,
                );
                let master = zero.master;
                wrapper = Strategy::Zero(zero);
                autocast = None;
                master.into_iter().collect()
            }
            None => trainable_ids,
        };
        // DeepSpeed ZeRO-3: its own optimizer wrapper steps fp32 masters of its own.
        let trainable_ids = match (parallel, zero3_partitions) {
            (Some(parallel), Some((partitions, untied_head))) if !trainable_ids.is_empty() => {
                let zero3 = Zero3::wrap(
                    t,
                    &trainable_ids,
                    partitions,
                    untied_head,
                    parallel,
                    spec.optimizer,
                );
                wrapper = Strategy::Zero3(Box::new(zero3));
                autocast = None;
                Vec::new()
            }
            (Some(parallel), Some((partitions, untied_head))) => {
                // Nothing to train: an inference engine over the model's parameters.
                let zero3 =
                    Zero3::inference(t, &all_model_params, partitions, untied_head, parallel);
                wrapper = Strategy::Zero3(Box::new(zero3));
                autocast = None;
                trainable_ids
            }
            _ => trainable_ids,
        };
        if let Some(tensor) = tensor {
            wrapper = Strategy::Tensor(Box::new(TensorParallel {
                tp: tensor.tp,
                sequence: tensor.sequence_parallel,
                sequences: spec.rows(),
                data: wrapper,
                plan: tensor.framework,
            }));
        }
        // A context-parallel rank runs its `seq_len / cp` tokens of every sequence.
        let cp = parallel.map_or(1, |p| p.tensor.cp);
        if let Some(p) = parallel.filter(|_| cp > 1) {
            // torchtitan's mesh (dp_replicate, dp_shard, cp, tp), row-major: a global rank's
            // place in its context-parallel group.
            let global = rank.unwrap_or(p.world_size - 1).min(p.world_size - 1);
            wrapper = Strategy::Context(Box::new(ContextParallel {
                cp,
                rank: global / p.tensor.tp % cp,
                data: wrapper,
            }));
        }
        model.strategy = RefCell::new(wrapper);
        Instance {
            spec: spec.clone(),
            model,
            batch: Batch {
                b: spec.rows(),
                s: spec.seq_len / cp,
            },
            autocast,
            params,
            trainable: trainable_ids,
            optimizer: OptimizerState::new(spec.optimizer),
            param_count,
            trainable_count,
            weights_loaded,
        }
    }

    /// The step's batch as context parallelism shards it, where it does.
    pub(crate) fn shard_batch(&self, t: &mut Tracer, ids: T) -> Option<ShardedBatch> {
        let strategy = self.model.strategy.borrow();
        let cp = strategy.context_parallel()?;
        Some(cp.shard_batch(t, ids, self.spec.rows(), self.spec.seq_len))
    }

    /// The training forward up to the loss (DDP's pre-forward first).
    pub(crate) fn forward_for_loss(&mut self, t: &mut Tracer, ids: T) -> T {
        self.model.strategy.borrow_mut().before_forward(t);
        let outer = t.enter_autocast(self.autocast);
        let loss = train_forward(t, &self.model, &self.spec, ids, self.batch);
        t.exit_autocast(outer);
        loss
    }

    /// TRL's training forward: the backbone, then the fused LM head over `scored` positions.
    pub(crate) fn fused_forward(
        &mut self,
        t: &mut Tracer,
        ids: T,
        scored: u64,
        fields: trl::Fields,
    ) -> trl::FusedOutput {
        self.model.strategy.borrow_mut().before_forward(t);
        let outer = t.enter_autocast(self.autocast);
        let out = trl::fused_forward(t, &self.model, ids, self.batch, scored, fields);
        t.exit_autocast(outer);
        out
    }

    /// RewardTrainer's forward and loss over the chosen and rejected rows.
    pub(crate) fn reward_forward(&mut self, t: &mut Tracer, ids: T) -> T {
        self.model.strategy.borrow_mut().before_forward(t);
        let outer = t.enter_autocast(self.autocast);
        let loss = trl::reward_loss(t, &self.model, ids, self.batch);
        t.exit_autocast(outer);
        loss
    }

    /// `loss.backward()`; the loss is dropped.
    pub(crate) fn backward(&mut self, t: &mut Tracer, loss: T) {
        let mut hooks = ModelHooks {
            model: &self.model,
            batch: self.batch,
            autocast: self.autocast,
            first_region: 0,
        };
        self.model.strategy.borrow_mut().backward_begins();
        t.backward(loss, &mut hooks);
        self.model.strategy.borrow_mut().finish_backward(t);
        t.drop(loss);
    }

    /// `optimizer.step()`: the strategy's own (DeepSpeed's engines), else the optimizer's
    /// over the trainable parameters.
    pub(crate) fn optimizer_step(&mut self, t: &mut Tracer) {
        let stepped = self
            .model
            .strategy
            .borrow_mut()
            .step(t, &mut self.optimizer);
        if !stepped && self.spec.optimizer != Optimizer::None {
            self.optimizer.step(t, &self.trainable);
        }
    }

    /// `optimizer.zero_grad(set_to_none=True)`: gradients are dropped in parameter order.
    pub(crate) fn zero_grad(&self, t: &mut Tracer) {
        for &p in &self.trainable {
            if let Some(g) = t.params[p].grad.take() {
                t.drop(g);
            }
        }
    }

    /// One training step as one phase: forward, backward, `optimizer.step()`, `zero_grad`.
    pub(crate) fn train_step(&mut self, t: &mut Tracer, ids: T) {
        let loss = self.forward_for_loss(t, ids);
        if t.mem.stopped() {
            return;
        }
        self.backward(t, loss);
        self.optimizer_step(t);
        self.zero_grad(t);
    }

    /// The no-grad log-prob pass.
    pub(crate) fn logprob_pass(&mut self, t: &mut Tracer, ids: T) {
        let grad = t.set_grad_enabled(false);
        logprob_forward(t, &self.model, ids, self.batch, self.autocast);
        t.set_grad_enabled(grad);
    }

    /// `model.generate(ids[:, :seq_len - new_tokens], max_new_tokens=new_tokens,
    /// min_new_tokens=new_tokens, do_sample=False, use_cache=True)` without grad: a prefill
    /// whose layers leave their key and value states in the cache and whose head scores the
    /// last position only (`logits_to_keep=1`); then per new token, each layer's cache grows
    /// by one position through `torch.cat` (a new tensor, the old one freed) and the head's
    /// logits are copied to fp32 for the argmax. The token ids and the attention mask grow
    /// the same way.
    pub(crate) fn generate_pass(&mut self, t: &mut Tracer, ids: T, new_tokens: u64) {
        let grad = t.set_grad_enabled(false);
        let outer = t.enter_autocast(self.autocast);
        let (b, prompt) = (self.batch.b, self.batch.s - new_tokens);
        let vocab = self.model.arch.vocab;
        let hidden_width = self.model.arch.hidden;
        let component = std::mem::replace(&mut t.component, Component::Inputs);
        let mut mask = t.empty(b * prompt, DType::I64, "attention_mask (generate)");
        t.component = component;
        self.model.kv_cache = Some(RefCell::new(Vec::new()));
        let hidden = self.model.decoder(t, ids, Batch { b, s: prompt });
        let last = t.view(hidden, b * hidden_width, "hidden_states[:, -1:]");
        let mut logits = lm_head(t, &self.model, last);
        self.model.forward_done(t);
        t.drop_all(&[last, hidden]);
        let cache = self.model.kv_cache.take().expect("set above").into_inner();
        let mut cache: Vec<(T, T)> = cache;
        let mut tokens = None;
        for step in 0..new_tokens {
            let length = prompt + step;
            if step > 0 {
                grow_cache(t, &mut cache, length);
                let h = t.empty(b * hidden_width, self.model.dtype, "decode hidden state");
                t.drop(logits);
                logits = lm_head(t, &self.model, h);
                t.drop(h);
            }
            let scores = t.empty(b * vocab, DType::F32, "next_token_logits (fp32 copy)");
            let next = t.empty(b, DType::I64, "argmax");
            t.drop(scores);
            let component = std::mem::replace(&mut t.component, Component::Inputs);
            let grown = t.empty(
                b * (length + 1),
                DType::I64,
                "input_ids = cat(input_ids, next)",
            );
            if let Some(previous) = tokens.replace(grown) {
                t.drop(previous);
            }
            let grown_mask = t.empty(b * (length + 1), DType::I64, "attention_mask cat");
            t.drop(mask);
            mask = grown_mask;
            t.component = component;
            t.drop(next);
        }
        t.drop(logits);
        for (k, v) in cache {
            t.drop_all(&[k, v]);
        }
        if let Some(tokens) = tokens {
            t.drop(tokens);
        }
        t.drop(mask);
        t.exit_autocast(outer);
        t.set_grad_enabled(grad);
    }

    /// GRPOTrainer's `model.generate` of `new_tokens` completions after prompts of `prompt`
    /// tokens for `rows` rows, with TRL's `GenerationConfig` (`do_sample=True`, temperature 1,
    /// `top_k=0`, `top_p=1`: no logits processor) and no grad. `wrapped`: the model still has
    /// accelerate's autocast wrapper, which upcasts each step's `[rows, vocab]` logits to fp32
    /// (a peft model generates through its base model, without it). Before the prefill:
    /// `position_ids` from the mask's cumsum and the `input_ids` clone. Per decode step: the
    /// cache grows by `torch.cat`; the logits are copied to fp32 (`next_token_logits`), their
    /// softmax taken and `multinomial` draws from it through an exponential buffer; the last
    /// step's `next_token_logits` and probabilities live until this step replaces them.
    pub(crate) fn sample_pass(
        &mut self,
        t: &mut Tracer,
        rows: u64,
        prompt: u64,
        new_tokens: u64,
        wrapped: bool,
    ) {
        let grad = t.set_grad_enabled(false);
        let outer = t.enter_autocast(if wrapped { self.autocast } else { None });
        let checkpointing = std::mem::replace(&mut self.model.checkpointing, false);
        let vocab = self.model.arch.vocab;
        let component = std::mem::replace(&mut t.component, Component::Inputs);
        let ids = t.empty(rows * prompt, DType::I64, "prompt input_ids");
        let mut mask = t.empty(rows * prompt, DType::I64, "prompt attention_mask");
        let special = [
            t.empty(1, DType::I64, "eos_token_id tensor"),
            t.empty(1, DType::I64, "pad_token_id tensor"),
        ];
        let cumsum = t.empty(rows * prompt, DType::I64, "attention_mask.cumsum(-1)");
        let minus = t.empty(rows * prompt, DType::I64, "cumsum - 1");
        t.drop(cumsum);
        let pad = t.empty(rows * prompt, DType::Bool, "attention_mask == 0");
        t.drop(pad);
        let mut positions = minus;
        let unfinished = t.empty(rows, DType::I64, "unfinished_sequences");
        let mut tokens = t.empty(rows * prompt, DType::I64, "input_ids.clone()");
        t.component = component;
        self.model.kv_cache = Some(RefCell::new(Vec::new()));
        let hidden = self.model.decoder(t, tokens, Batch { b: rows, s: prompt });
        let last = t.view(
            hidden,
            rows * self.model.arch.hidden,
            "hidden_states[:, -1:]",
        );
        let mut logits = lm_head(t, &self.model, last);
        self.model.forward_done(t);
        t.drop_all(&[last, hidden]);
        let mut cache: Vec<(T, T)> = self.model.kv_cache.take().expect("set above").into_inner();
        let mut sampled: Option<[T; 2]> = None;
        for step in 0..new_tokens {
            let length = prompt + step;
            if step > 0 {
                grow_cache(t, &mut cache, length);
                let h = t.empty(
                    rows * self.model.arch.hidden,
                    self.model.dtype,
                    "decode hidden state",
                );
                logits = lm_head(t, &self.model, h);
                t.drop(h);
            }
            if wrapped && t.dtype(logits) != DType::F32 {
                let upcast = t.empty(
                    rows * vocab,
                    DType::F32,
                    "outputs.logits.float() (accelerate)",
                );
                t.drop(logits);
                logits = upcast;
            }
            let scores = t.empty(rows * vocab, DType::F32, "next_token_logits (fp32 copy)");
            if let Some([old_scores, old_probs]) = sampled.take() {
                t.drop(old_scores);
                let probs = t.empty(rows * vocab, DType::F32, "softmax(next_token_scores)");
                t.drop(old_probs);
                sampled = Some([scores, probs]);
            } else {
                let probs = t.empty(rows * vocab, DType::F32, "softmax(next_token_scores)");
                sampled = Some([scores, probs]);
            }
            let exponential = t.empty(rows * vocab, DType::F32, "multinomial: exponential buffer");
            t.drop(exponential);
            let next = t.empty(rows, DType::I64, "next_tokens");
            let component = std::mem::replace(&mut t.component, Component::Inputs);
            let grown = t.empty(
                rows * (length + 1),
                DType::I64,
                "input_ids = cat(input_ids, next)",
            );
            t.drop(std::mem::replace(&mut tokens, grown));
            let grown = t.empty(rows * (length + 1), DType::I64, "position_ids cat");
            t.drop(std::mem::replace(&mut positions, grown));
            let grown = t.empty(rows * (length + 1), DType::I64, "attention_mask cat");
            t.drop(std::mem::replace(&mut mask, grown));
            t.component = component;
            t.drop_all(&[next, logits]);
        }
        for (k, v) in cache {
            t.drop_all(&[k, v]);
        }
        if let Some(sampled) = sampled {
            t.drop_all(&sampled);
        }
        t.drop_all(&[tokens, positions, mask, unfinished, ids]);
        t.drop_all(&special);
        self.model.checkpointing = checkpointing;
        t.exit_autocast(outer);
        t.set_grad_enabled(grad);
    }

    /// Parameter bytes of the model (what `model.cpu()` moves).
    pub(crate) fn param_bytes(&self, t: &Tracer) -> u64 {
        self.placed().into_iter().map(|p| t.bytes(t.param(p))).sum()
    }

    /// The parameter tensors that live on a device: the model's, or a sharding wrapper's
    /// shards.
    pub(crate) fn placed(&self) -> Vec<ParamId> {
        self.model
            .strategy
            .borrow()
            .shards()
            .unwrap_or_else(|| self.params.clone().collect())
    }

    /// Parameter bytes on the host: a model moved or built there, FSDP2 CPU offload's shards
    /// (its host copy stays while units visit the GPU).
    pub(crate) fn host_bytes(&self, t: &Tracer) -> u64 {
        let strategy = self.model.strategy.borrow();
        if strategy.streams_from_host() {
            return self.param_bytes(t);
        }
        if let Some(bytes) = strategy.host_bytes(t) {
            return bytes;
        }
        self.params
            .clone()
            .filter(|&p| !t.is_materialized(p))
            .map(|p| t.bytes(t.param(p)))
            .sum()
    }

    /// `model.cpu()`: each parameter's storage is copied out and freed, in parameter order
    /// (optimizer states stay). Returns the bytes moved.
    pub(crate) fn to_cpu(&self, t: &mut Tracer) -> u64 {
        for p in self.placed() {
            t.offload(p);
        }
        self.param_bytes(t)
    }

    /// `model.cuda()`: each parameter is allocated again, in parameter order.
    pub(crate) fn to_gpu(&self, t: &mut Tracer) -> u64 {
        for p in self.placed() {
            t.materialize(p);
        }
        self.param_bytes(t)
    }

    /// Each optimizer state tensor moved to the host (`state[k] = v.to("cpu")`, as verl's
    /// `offload_fsdp_optimizer` and slime's `move_torch_optimizer` do). Returns the bytes moved.
    pub(crate) fn optimizer_to_cpu(&self, t: &mut Tracer) -> u64 {
        let states: Vec<T> = self.optimizer.tensors().collect();
        states.iter().for_each(|&s| t.free_storage(s));
        states.iter().map(|&s| t.bytes(s)).sum()
    }

    /// The optimizer states back on the GPU, in state order.
    pub(crate) fn optimizer_to_gpu(&self, t: &mut Tracer) -> u64 {
        let outer = std::mem::replace(&mut t.component, Component::OptimizerStates);
        let states: Vec<T> = self.optimizer.tensors().collect();
        states.iter().for_each(|&s| t.alloc_storage(s));
        t.component = outer;
        states.iter().map(|&s| t.bytes(s)).sum()
    }

    /// What a pass copies in from host memory: the FSDP2-offloaded units not on the GPU.
    pub(crate) fn streamed_bytes(&self, t: &Tracer) -> u64 {
        self.model.strategy.borrow().streamed_bytes(t)
    }
}

/// One decode forward: each layer's new position joins its cache (`DynamicCache`'s
/// `torch.cat`: a new tensor, then the old one freed).
fn grow_cache(t: &mut Tracer, cache: &mut [(T, T)], length: u64) {
    for (k, v) in cache.iter_mut() {
        for state in [k, v] {
            let per_position = t.numel(*state) / length.max(1);
            let dtype = t.dtype(*state);
            let new = t.empty(per_position, dtype, "key/value states (one token)");
            let grown = t.empty(per_position * (length + 1), dtype, "DynamicCache torch.cat");
            t.drop_all(&[*state, new]);
            *state = grown;
        }
    }
}

/// What the backward engine calls into the model: the recomputation of checkpointed layers,
/// and the strategy's backward hooks.
pub(crate) struct ModelHooks<'a> {
    pub(crate) model: &'a Model,
    pub(crate) batch: Batch,
    pub(crate) autocast: Option<DType>,
    /// The region of the forward's first decoder layer (regions are numbered across the
    /// graphs alive at once: a pipeline's micro-batches).
    pub(crate) first_region: u32,
}

impl BackwardHooks for ModelHooks<'_> {
    fn recompute(&mut self, tracer: &mut Tracer, region: u32) {
        self.model.recompute_layer(
            tracer,
            region,
            (region - self.first_region) as usize,
            self.batch,
            self.autocast,
        );
    }

    fn unit_backward_begins(&mut self, tracer: &mut Tracer, unit: u32) {
        self.model
            .strategy
            .borrow_mut()
            .unit_backward_begins(tracer, unit);
    }

    fn unit_backward_done(&mut self, tracer: &mut Tracer, unit: u32) {
        self.model
            .strategy
            .borrow_mut()
            .unit_backward_done(tracer, unit);
    }

    fn grad_accumulated(&mut self, tracer: &mut Tracer, param: ParamId) {
        self.model
            .strategy
            .borrow_mut()
            .grad_accumulated(tracer, param);
    }
}

/// The attention kernel the spec's `attention` gives `arch`.
pub(crate) fn attention_impl(spec: &RunSpec, arch: &Architecture) -> AttentionImpl {
    match spec.attention_for(arch) {
        Attention::Sdpa => AttentionImpl::Sdpa,
        Attention::Eager => AttentionImpl::Eager,
    }
}

/// The dtype the parameters are stored in.
pub(crate) fn param_dtype(spec: &RunSpec) -> DType {
    match spec.precision {
        Precision::Bf16 => DType::BF16,
        Precision::Fp32 | Precision::AmpBf16 | Precision::AmpFp16 => DType::F32,
    }
}

/// The dtype `torch.autocast` runs the forward in, if any: under FSDP2's mixed-precision
/// policy only where the spec adds it.
pub(crate) fn autocast_dtype(spec: &RunSpec) -> Option<DType> {
    if spec
        .parallel
        .as_ref()
        .is_some_and(|p| p.mixed_precision.is_some())
    {
        return spec.autocast;
    }
    match spec.precision {
        Precision::Fp32 => None,
        Precision::AmpBf16 | Precision::Bf16 => Some(DType::BF16),
        Precision::AmpFp16 => Some(DType::F16),
    }
}

/// `get_peft_model(model, LoraConfig(...))`: freeze the base, create `lora_A`/`lora_B` for each
/// targeted linear (on the GPU, in the base weight's dtype), then cast the adapters to fp32
/// (`autocast_adapter_dtype=True`). For sequence classification the head is a trainable copy
/// (`modules_to_save`).
fn install_lora(
    t: &mut Tracer,
    model: &mut Model,
    params: Range<ParamId>,
    lora: &Lora,
    task: Task,
) {
    for p in params {
        t.set_trainable(p, false);
    }
    let built = lora
        .as_built_for(&model.arch)
        .expect("the spec's LoRA targets were checked against the model");
    let lora = &built.lora;
    let dtype = model.dtype;
    let mut adapters = Vec::new();
    for (module, linear) in model.linears_mut() {
        if !lora_targets_module(lora, module) {
            continue;
        }
        let a = t.parameter(lora.r * linear.in_features, dtype, true, "lora_A");
        t.set_matrix(a, lora.r, linear.in_features);
        let b = t.parameter(linear.out_features * lora.r, dtype, true, "lora_B");
        t.set_matrix(b, linear.out_features, lora.r);
        linear.lora = Some(LoraAdapter {
            a,
            b,
            r: lora.r,
            dropout: lora.dropout > 0.0,
        });
        adapters.extend([a, b]);
    }
    install_expert_lora(t, model, &built, dtype, &mut adapters);
    for p in adapters {
        t.cast_parameter(p, DType::F32);
    }
    if task == Task::SeqCls
        && let Some(score) = model.score.as_mut()
    {
        let n = score.out_features * score.in_features;
        score.weight = t.parameter(n, dtype, true, "score (modules_to_save copy)");
        t.set_matrix(score.weight, score.out_features, score.in_features);
    }
}

/// peft's `target_parameters`: a `ParamWrapper` per targeted 3-D expert weight of each MoE
/// layer (`lora_A` (r·E, in), `lora_B` (out, r·E)), gate_up before down, and on the router's
/// 2-D weight (`lora_A` (r, H), `lora_B` (E, r)).
fn install_expert_lora(
    t: &mut Tracer,
    model: &mut Model,
    built: &BuiltLora,
    dtype: DType,
    adapters: &mut Vec<ParamId>,
) {
    let Some(moe) = model.arch.moe.clone() else {
        return;
    };
    let lora = &built.lora;
    let (h, i, e) = (model.arch.hidden, moe.intermediate, moe.experts);
    for layer in &mut model.layers {
        if lora.target_parameters.contains(&Module::Router) && layer.router.is_some() {
            let a = t.parameter(lora.r * h, dtype, true, "lora_A (router)");
            let b = t.parameter(e * lora.r, dtype, true, "lora_B (router)");
            adapters.extend([a, b]);
        }
        let Some(experts) = layer.experts.as_mut() else {
            continue;
        };
        for module in [Module::ExpertsGateUp, Module::ExpertsDown] {
            if !lora.target_parameters.contains(&module) {
                continue;
            }
            let (inputs, outputs, r) = match module {
                Module::ExpertsGateUp => (h, 2 * i, built.gate_up_rank),
                _ => (i, h, lora.r),
            };
            let a = t.parameter(r * e * inputs, dtype, true, "lora_A (experts)");
            let b = t.parameter(outputs * r * e, dtype, true, "lora_B (experts)");
            adapters.extend([a, b]);
            let adapter = Some(ExpertLora { a, b });
            match module {
                Module::ExpertsGateUp => experts.gate_up_lora = adapter,
                _ => experts.down_lora = adapter,
            }
        }
    }
}
