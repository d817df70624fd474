//! How a model's parameters, gradients and optimizer states are spread over ranks: one
//! [`Strategy`] per model, whose hooks the model code and the backward engine call at the
//! points where PyTorch and DeepSpeed run theirs. Each strategy is a translation of one
//! library's wrapper as rank 0 (or the rank that needs most) sees it:
//! - [`ddp`]: `DistributedDataParallel` (gradient buckets, buffer broadcasts);
//! - [`fsdp`]: FSDP2's `fully_shard` over several ranks, CPU offload included;
//! - [`fsdp1`]: FSDP1's `FullyShardedDataParallel` (flat parameters per unit);
//! - [`fsdp_offload`]: FSDP2 with `CPUOffloadPolicy` on one rank, for a no-grad pass;
//! - [`zero`]: DeepSpeed ZeRO stages 1 and 2;
//! - [`zero3`] and [`zero3_gather`]: DeepSpeed ZeRO stage 3 and its per-module gathers;
//! - [`tp`]: tensor parallelism (with or without sequence parallelism) wrapping the strategy
//!   of the data-parallel mesh dimension, whose hooks it passes on;
//! - [`cp`]: context parallelism (the sequence sharded, ring attention) wrapping the strategy
//!   of the other mesh dimensions likewise;
//! - [`pp`]: pipeline schedules, the order a rank runs its stages' forwards and backwards (the
//!   harness's `stages` runs a pipeline rank in that order);
//! - [`megatron`]: Megatron-core's `DistributedDataParallel` (one fp32 gradient buffer) and its
//!   mixed-precision or distributed optimizer, under Megatron's own tensor-parallel layers;
//! - [`megatron_pp`] and [`megatron_interleaved`]: Megatron's 1F1B and interleaved 1F1B
//!   schedules as the steps a pipeline rank takes (the harness's `megatron_stages` runs them).
//!
//! Expert parallelism takes its place here as a further variant with the same
//! hooks.

pub(crate) mod cp;
pub(crate) mod ddp;
pub(crate) mod fsdp;
pub(crate) mod fsdp1;
pub(crate) mod fsdp_offload;
pub(crate) mod megatron;
pub(crate) mod megatron_interleaved;
pub(crate) mod megatron_pp;
pub(crate) mod pp;
pub(crate) mod tp;
pub(crate) mod zero;
pub(crate) mod zero3;
pub(crate) mod zero3_gather;

use super::engine::tracer::{ParamId, Tracer};
use crate::sim::optim::OptimizerState;
use cp::ContextParallel;
use ddp::Ddp;
use fsdp::Fsdp;
use fsdp_offload::FsdpOffload;
use fsdp1::Fsdp1;
use megatron::MegatronDdp;
use tp::TensorParallel;
use zero::Zero;
use zero3::Zero3;

/// The CUDA stream FSDP2 copies parameters into its all-gather buffer on (and DeepSpeed's
/// gathers run on).
pub(crate) const ALL_GATHER_COPY_IN_STREAM: u32 = 1;
/// The CUDA stream FSDP2 reduce-scatters gradients on.
pub(crate) const REDUCE_SCATTER_STREAM: u32 = 2;

/// The parallel strategy wrapping one model.
pub(crate) enum Strategy {
    /// The process holds the whole model and steps it alone.
    Local,
    Ddp(Ddp),
    FsdpOffload(FsdpOffload),
    Fsdp(Fsdp),
    Fsdp1(Fsdp1),
    Zero(Zero),
    Zero3(Box<Zero3>),
    /// Tensor parallelism over the strategy of the data-parallel dimension.
    Tensor(Box<TensorParallel>),
    /// Context parallelism over the strategy of the other dimensions.
    Context(Box<ContextParallel>),
    /// Megatron-core's DDP and optimizer.
    Megatron(Box<MegatronDdp>),
}

/// A part of the model FSDP2 may wrap as a unit of its own: a decoder layer, the input
/// embedding, the final norm with the head, or the root (the rest of the model).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Unit {
    Layer(usize),
    Embedding,
    Head,
    Root,
}

/// A module as per-module hooks (DeepSpeed ZeRO-3's) see it. Modules with parameters of
/// their own are named by their first parameter (the tied `lm_head` apart: it shares the
/// embedding's).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub(crate) enum ModuleKey {
    Params(ParamId),
    LmHead,
    /// The model class (`Qwen2ForCausalLM`): its pre-hook also starts the step's trace.
    Root,
    /// The decoder stack (`Qwen2Model`).
    Model,
    Rotary,
    Layer(usize),
    Attention(usize),
    Mlp(usize),
    /// A sparse MoE block DeepSpeed makes a ZeRO-3 leaf (`z3_leaf_module`): its hooks fetch
    /// and release every parameter beneath it, the modules beneath it have none, and its
    /// parameters' gradients are reduced by its full backward hook.
    MoeLeaf(usize),
    Activation(usize),
}

impl Strategy {
    /// The tensor-parallel layout, where there is one.
    pub(crate) fn tensor_parallel(&self) -> Option<&TensorParallel> {
        match self {
            Strategy::Tensor(tensor) => Some(tensor),
            Strategy::Context(context) => context.data.tensor_parallel(),
            _ => None,
        }
    }

    /// The context-parallel layout, where there is one.
    pub(crate) fn context_parallel(&self) -> Option<&ContextParallel> {
        match self {
            Strategy::Context(context) => Some(context),
            Strategy::Tensor(tensor) => tensor.data.context_parallel(),
            _ => None,
        }
    }

    /// FSDP2's state, under the mesh-dimension layouts wrapping it.
    pub(crate) fn fsdp_mut(&mut self) -> Option<&mut Fsdp> {
        match self {
            Strategy::Fsdp(fsdp) => Some(fsdp),
            other => other.wrapped_mut()?.fsdp_mut(),
        }
    }

    /// Whether the strategy is in the one state it returns to between steps, fixed by its
    /// configuration alone: what the step memo (`sim::memo`) needs to know of the state it
    /// does not compare, so that two steps that start at rest start in the same strategy
    /// state. Tensor and context parallelism keep nothing between calls; FSDP2 at rest holds
    /// no buffer and no unit unsharded ([`Fsdp::at_rest`]). The others keep what the memo
    /// does not see (DDP's buckets, ZeRO's partitions): never at rest for it.
    pub(crate) fn at_rest(&self) -> bool {
        match self {
            Strategy::Local => true,
            Strategy::Fsdp(fsdp) => fsdp.at_rest(),
            Strategy::Tensor(_) | Strategy::Context(_) => {
                self.wrapped().is_some_and(Strategy::at_rest)
            }
            _ => false,
        }
    }

    /// The strategy a mesh-dimension layout (tensor, context parallelism) wraps, whose hooks
    /// it passes on.
    fn wrapped(&self) -> Option<&Strategy> {
        match self {
            Strategy::Tensor(tensor) => Some(&tensor.data),
            Strategy::Context(context) => Some(&context.data),
            _ => None,
        }
    }

    fn wrapped_mut(&mut self) -> Option<&mut Strategy> {
        match self {
            Strategy::Tensor(tensor) => Some(&mut tensor.data),
            Strategy::Context(context) => Some(&mut context.data),
            _ => None,
        }
    }

    /// Before the model is called: DDP rebuilds its buckets once and broadcasts buffers.
    pub(crate) fn before_forward(&mut self, t: &mut Tracer) {
        if let Some(data) = self.wrapped_mut() {
            return data.before_forward(t);
        }
        if let Strategy::Ddp(ddp) = self {
            ddp.pre_forward(t);
        }
    }

    /// An FSDP2 unit's forward pre-hook: its parameters are brought to the GPU.
    pub(crate) fn unit_pre_forward(&mut self, t: &mut Tracer, unit: Unit) {
        if let Some(data) = self.wrapped_mut() {
            return data.unit_pre_forward(t, unit);
        }
        match self {
            Strategy::FsdpOffload(offload) => offload.unshard(t, unit),
            Strategy::Fsdp(fsdp) => fsdp.unit_pre_forward(t, unit),
            Strategy::Fsdp1(fsdp1) => fsdp1.unit_pre_forward(t, unit),
            _ => {}
        }
    }

    /// An FSDP2 unit's forward post-hook.
    pub(crate) fn unit_post_forward(&mut self, t: &mut Tracer, unit: Unit) {
        if let Some(data) = self.wrapped_mut() {
            return data.unit_post_forward(t, unit);
        }
        match self {
            Strategy::FsdpOffload(offload) => offload.reshard(t, unit),
            Strategy::Fsdp(fsdp) => fsdp.unit_post_forward(t, unit),
            Strategy::Fsdp1(fsdp1) => fsdp1.unit_post_forward(t, unit),
            _ => {}
        }
    }

    /// A module's forward pre-hook; `input_grad`: whether its input requires grad (then its
    /// post-backward hook runs).
    pub(crate) fn module_pre_forward(
        &mut self,
        t: &mut Tracer,
        module: ModuleKey,
        params: &[ParamId],
        input_grad: bool,
    ) {
        if let Some(data) = self.wrapped_mut() {
            return data.module_pre_forward(t, module, params, input_grad);
        }
        if let Strategy::Zero3(zero3) = self {
            zero3.gathers.pre_forward(t, module, params, input_grad);
        }
    }

    /// The forward post-hook of the innermost running module.
    pub(crate) fn module_post_forward(&mut self, t: &mut Tracer) {
        if let Some(data) = self.wrapped_mut() {
            return data.module_post_forward(t);
        }
        if let Strategy::Zero3(zero3) = self {
            zero3.gathers.post_forward(t);
        }
    }

    /// A checkpointed region's recomputation has run.
    pub(crate) fn recompute_ends(&mut self, t: &mut Tracer) {
        if let Some(data) = self.wrapped_mut() {
            return data.recompute_ends(t);
        }
        if let Strategy::Zero3(zero3) = self {
            zero3.gathers.recompute_ends(t);
        }
    }

    /// `loss.backward()` starts.
    pub(crate) fn backward_begins(&mut self) {
        if let Some(data) = self.wrapped_mut() {
            return data.backward_begins();
        }
        if let Strategy::Zero3(zero3) = self {
            zero3.gathers.backward_begins();
        }
    }

    /// A gradient reached unit `unit` (see [`BackwardHooks`](super::engine::tracer::BackwardHooks)).
    pub(crate) fn unit_backward_begins(&mut self, t: &mut Tracer, unit: u32) {
        if let Some(data) = self.wrapped_mut() {
            return data.unit_backward_begins(t, unit);
        }
        match self {
            Strategy::Fsdp(fsdp) => fsdp.pre_backward(t, unit),
            Strategy::Fsdp1(fsdp1) => fsdp1.pre_backward(t, unit),
            Strategy::Zero3(zero3) => zero3.gathers.unit_backward_begins(t, unit),
            _ => {}
        }
    }

    /// Every node of unit `unit` that this backward runs has run.
    pub(crate) fn unit_backward_done(&mut self, t: &mut Tracer, unit: u32) {
        if let Some(data) = self.wrapped_mut() {
            return data.unit_backward_done(t, unit);
        }
        match self {
            Strategy::Fsdp(fsdp) => fsdp.unit_backward_done(t, unit),
            Strategy::Fsdp1(fsdp1) => fsdp1.post_backward(t, unit),
            Strategy::Zero3(zero3) => zero3.unit_backward_done(t, unit),
            _ => {}
        }
    }

    /// `AccumulateGrad` stored `param`'s gradient.
    pub(crate) fn grad_accumulated(&mut self, t: &mut Tracer, param: ParamId) {
        if let Some(data) = self.wrapped_mut() {
            return data.grad_accumulated(t, param);
        }
        match self {
            Strategy::Zero(zero) => zero.grad_hook(t, param),
            Strategy::Zero3(zero3) => zero3.grad_hook(t, param),
            Strategy::Megatron(megatron) => megatron.grad_accumulated(t, param),
            _ => {}
        }
    }

    /// The backward engine has finished: FSDP2's final callback, DeepSpeed's backward
    /// epilogue, DDP learning the order the gradients became ready in.
    pub(crate) fn finish_backward(&mut self, t: &mut Tracer) {
        if let Some(data) = self.wrapped_mut() {
            return data.finish_backward(t);
        }
        match self {
            Strategy::Ddp(ddp) => ddp.learn_ready_order(t),
            Strategy::Fsdp(fsdp) => fsdp.finish_backward(t),
            Strategy::Fsdp1(fsdp1) => fsdp1.finish_backward(t),
            Strategy::Zero(zero) => zero.finish_backward(t),
            Strategy::Zero3(zero3) => zero3.finish_backward(t),
            _ => {}
        }
    }

    /// `optimizer.step()` where the strategy wraps the optimizer (DeepSpeed's engines);
    /// false where the plain optimizer steps the trainable parameters.
    pub(crate) fn step(&mut self, t: &mut Tracer, optimizer: &mut OptimizerState) -> bool {
        if let Some(data) = self.wrapped_mut() {
            return data.step(t, optimizer);
        }
        match self {
            Strategy::Zero(zero) => zero.step(t, optimizer),
            Strategy::Zero3(zero3) => zero3.step(t),
            Strategy::Megatron(megatron) => megatron.step(t),
            _ => return false,
        }
        true
    }

    /// Bytes the strategy keeps on the host, where it decides them (CPU offload of shards,
    /// DeepSpeed's `offload_optimizer`); `None` where the model's own placement does.
    pub(crate) fn host_bytes(&self, t: &Tracer) -> Option<u64> {
        if let Some(data) = self.wrapped() {
            return data.host_bytes(t);
        }
        match self {
            Strategy::Fsdp(fsdp) => Some(fsdp.host_bytes(t)),
            Strategy::Fsdp1(fsdp1) => Some(fsdp1.host_bytes(t)),
            Strategy::Zero(zero) => Some(zero.host_bytes()),
            Strategy::Zero3(zero3) => Some(zero3.host_bytes()),
            Strategy::Megatron(megatron) => megatron.host_bytes(),
            _ => None,
        }
    }

    /// The tensors `model.cpu()` moves where the strategy holds the model's parameters as
    /// shards of its own; `None`: the model's parameters.
    pub(crate) fn shards(&self) -> Option<Vec<ParamId>> {
        if let Some(data) = self.wrapped() {
            return data.shards();
        }
        match self {
            Strategy::Fsdp(fsdp) => Some(fsdp.shards()),
            Strategy::Fsdp1(fsdp1) => Some(fsdp1.shards()),
            _ => None,
        }
    }

    /// Whether the parameters come to the GPU unit by unit from host memory during a pass
    /// (then the model is never moved in whole).
    pub(crate) fn streams_from_host(&self) -> bool {
        if let Some(data) = self.wrapped() {
            return data.streams_from_host();
        }
        matches!(self, Strategy::FsdpOffload(_))
    }

    /// Parameter bytes a pass copies in from host memory.
    pub(crate) fn streamed_bytes(&self, t: &Tracer) -> u64 {
        if let Some(data) = self.wrapped() {
            return data.streamed_bytes(t);
        }
        match self {
            Strategy::FsdpOffload(offload) => offload.streamed_bytes(t),
            _ => 0,
        }
    }
}
