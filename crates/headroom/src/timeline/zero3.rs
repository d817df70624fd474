//! DeepSpeed ZeRO stage 3 (`deepspeed/runtime/zero/stage3.py`, `partition_parameters.py`,
//! DeepSpeed 0.18.2, `bf16` enabled, `torch_adam` AdamW or DeepSpeedCPUAdam under
//! `offload_optimizer`, the stage defaults: `reduce_bucket_size` 5e8, `contiguous_gradients`,
//! `reduce_scatter`, `sub_group_size` 1e9) as one rank of a one-rank world sees it: the
//! partition of every parameter is the whole parameter, and `all_gather_coalesced` of a
//! one-partition world hands each parameter its partition's storage (`_no_gather_coalesced`):
//! the per-module gathers of forward and backward allocate nothing, so forward and backward
//! are those of the plain bf16 model. What is allocated, in order (checked against
//! bench/distributed/zero3-q15-4l-nogc-w1-rank0.pickle.gz, which has stack frames):
//! - `from_config` under `zero.Init`: as each module is made, each of its parameters is
//!   allocated whole, its partition (`ceil(numel / world)` elements) allocated and the whole
//!   freed (`_partition_param`); the tied `lm_head` gets its own parameter and partition.
//! - transformers' `_init_weights` gathers each parameter again (`GatheredParameters` →
//!   `_allgather_params`): a flat buffer of `partition * world` elements, the whole
//!   parameter, the flat buffer freed, the whole freed when the context exits.
//! - engine construction: the untied `lm_head` partition dies with `tie_weights`' old
//!   parameter (at the first `see_memory_usage`'s `gc.collect()`); `defragment` moves every
//!   partition to the host, `empty_cache()`s and brings them back as one flat buffer (the
//!   parameters' partitions become views); per sub-group (`sub_group_size` elements of
//!   partitions, in parameter order) the fp32 master, `.clone()` (a bf16 copy, freed) then
//!   `.float()`; `initialize_optimizer_states` a zero fp32 gradient of the largest
//!   sub-group, freed; the IPG bucket (`reduce_bucket_size` elements, kept for the engine's
//!   life); `grad_partitions_flat_buffer` (every partition, bf16); then
//!   `create_reduce_and_remove_grad_hooks` gathers each parameter once more, as the init did.
//! - backward: `AccumulateGrad`'s hook copies each gradient into the IPG bucket and frees it
//!   (`__add_grad_to_ipg_bucket`); a gradient that would overflow the bucket first reduces it.
//!   `__reduce_and_partition_ipg_grads` → `reduce_scatter_coalesced` concatenates the bucket's
//!   gradients, each padded to a multiple of the world, on the reduce stream (freed when the
//!   reduction returns) and copies this rank's slices into the gradient partitions. The
//!   epilogue reduces what is left.
//! - `step()`: `get_grad_norm_direct` takes `g.double()` of every gradient partition (8
//!   bytes an element, freed after its norm); per sub-group `_prepare_fp32_grad_for_sub_group`
//!   flattens its gradient partitions (bf16) and casts them to the fp32 gradient of its
//!   master (the flat copy dies), torch's foreach AdamW steps the master (its states created
//!   at the first step), and `_release_sub_group` drops the fp32 gradient.
//! - `offload_optimizer`: the fp32 masters, their gradients, `grad_partitions_flat_buffer`
//!   and DeepSpeedCPUAdam's states are on the host (`self.device` is the CPU), so nothing of
//!   construction after the flat buffer but the IPG bucket is on the GPU; each reduced
//!   gradient partition is copied to the host buffer, back to the GPU (`grad_buffer.to(...)`,
//!   on the reduce stream, freed at the next parameter), its norm taken from `.double()`
//!   chunks of at most 2.5e8 elements and its `.float()` copied into the host fp32 gradient;
//!   `step()` runs on the host.
//!
//! Not modelled: more than one rank (the gathers, their prefetching and the reuse-distance
//! release policy of `PartitionedParameterCoordinator`) and `offload_param`; both are refused
//! by `estimate`. The few tiny allocations of the barriers and norm reductions.

use std::ops::Range;

use super::component::Component;
use super::optim::OptimizerState;
use super::tracer::{ParamId, T, Tracer};
use crate::dtype::DType;
use crate::spec::Optimizer;

/// `reduce_bucket_size` (elements).
const REDUCE_BUCKET_ELEMENTS: u64 = 500_000_000;
/// `sub_group_size` (elements of partitions).
const SUB_GROUP_ELEMENTS: u64 = 1_000_000_000;
/// `_constant_buffered_norm2`'s chunk (elements).
const NORM_CHUNK_ELEMENTS: u64 = 250_000_000;
/// The stream `__reduce_and_partition_ipg_grads` runs on (`reduce_and_partition_stream`).
const REDUCE_STREAM: u32 = 2;

pub(crate) struct Zero3 {
    world: u64,
    dtype: DType,
    offload_optimizer: bool,
    /// The trainable parameters in `model.parameters()` order.
    params: Vec<ParamId>,
    /// Per parameter, its whole and partition elements.
    numels: Vec<u64>,
    partitions: Vec<u64>,
    /// Sub-groups: ranges of `params`.
    sub_groups: Vec<Range<usize>>,
    /// Per sub-group, the fp32 master on the GPU (none under `offload_optimizer`) and the
    /// optimizer stepping it (torch's optimizer state is per parameter).
    masters: Vec<ParamId>,
    optimizers: Vec<OptimizerState>,
    /// The parameters whose gradients the IPG bucket holds, and their elements.
    bucket: Vec<usize>,
    bucket_elements: u64,
}

impl Zero3 {
    /// `from_config` under `deepspeed.zero.Init` on a model registered without storage from
    /// `first` on (`count` parameters, `model.parameters()` order), then transformers' weight
    /// initialisation; `tied_lm_head`: the head's own parameter, made before the tie. Returns
    /// the partitions (each parameter's `ds_tensor`) and the untied head's.
    pub(crate) fn init(
        t: &mut Tracer,
        params: &[ParamId],
        world: u64,
        tied_lm_head: Option<ParamId>,
    ) -> (Vec<T>, Option<T>) {
        let outer = std::mem::replace(&mut t.component, Component::Weights);
        let partition = |t: &mut Tracer, p: ParamId| {
            let (numel, dtype) = (t.numel(t.param(p)), t.dtype(t.param(p)));
            let whole = t.empty(numel, dtype, "zero.Init: parameter made whole");
            let part = t.empty(
                numel.div_ceil(world),
                dtype,
                "zero.Init: partition (ds_tensor)",
            );
            t.drop(whole);
            part
        };
        let partitions: Vec<T> = params.iter().map(|&p| partition(t, p)).collect();
        let head = tied_lm_head.map(|p| partition(t, p));
        // `_init_weights` under `GatheredParameters`, in module order (the head last).
        for &p in params.iter().chain(&tied_lm_head) {
            let (numel, dtype) = (t.numel(t.param(p)), t.dtype(t.param(p)));
            gather_whole(t, numel, dtype, world, "GatheredParameters (init)");
        }
        t.component = outer;
        (partitions, head)
    }

    /// `deepspeed.initialize(model=..., model_parameters=trainable)`: the stage-3 optimizer's
    /// construction, from the partitions `init` made.
    pub(crate) fn wrap(
        t: &mut Tracer,
        trainable: &[ParamId],
        partitions: Vec<T>,
        untied_head: Option<T>,
        world: u64,
        optimizer: Optimizer,
        offload_optimizer: bool,
    ) -> Zero3 {
        let dtype = t.dtype(t.param(trainable[0]));
        let numels: Vec<u64> = trainable.iter().map(|&p| t.numel(t.param(p))).collect();
        let parts: Vec<u64> = numels.iter().map(|n| n.div_ceil(world)).collect();
        // `_create_fp16_sub_groups`: parameters join a sub-group until its partitions reach
        // `sub_group_size` elements.
        let mut sub_groups = Vec::new();
        let (mut start, mut size) = (0, 0);
        for (i, &n) in parts.iter().enumerate() {
            size += n;
            if size >= SUB_GROUP_ELEMENTS || i + 1 == parts.len() {
                sub_groups.push(start..i + 1);
                (start, size) = (i + 1, 0);
            }
        }
        let group_numel = |g: &Range<usize>| parts[g.clone()].iter().sum::<u64>();
        let outer = std::mem::replace(&mut t.component, Component::Weights);
        if let Some(head) = untied_head {
            t.drop(head);
        }
        // `defragment`: every partition to the host, the cache emptied, one flat buffer back.
        t.drop_all(&partitions);
        t.mem.allocator.empty_cache();
        let flat = t.empty(parts.iter().sum(), dtype, "DeepSpeed flat bf16 partitions");
        for &p in trainable {
            t.param_into_view(p, flat, "parameter (its partition in the flat buffer)");
        }
        t.drop(flat);
        // `_create_fp32_partitions`, then `initialize_optimizer_states`.
        let mut masters = Vec::new();
        if !offload_optimizer {
            for g in &sub_groups {
                let n = group_numel(g);
                let clone = t.empty(n, dtype, "sub-group partition .clone()");
                let master = t.parameter(n, DType::F32, true, "fp32 master (sub-group)");
                t.recategorize(t.param(master), Component::OptimizerStates);
                t.drop(clone);
                masters.push(master);
            }
            t.component = Component::Gradients;
            let largest = sub_groups.iter().map(group_numel).max().unwrap_or(0);
            let zeros = t.empty(largest, DType::F32, "initialize_optimizer_states gradient");
            t.drop(zeros);
        }
        // The IPG bucket and (on the GPU unless offloaded) the gradient partitions.
        t.component = Component::Communication;
        let bucket = t.empty(
            REDUCE_BUCKET_ELEMENTS,
            dtype,
            "DeepSpeed IPG bucket (stage 3)",
        );
        t.mark_persistent(bucket);
        if !offload_optimizer {
            t.component = Component::Gradients;
            let grads = t.empty(parts.iter().sum(), dtype, "grad_partitions_flat_buffer");
            t.mark_persistent(grads);
        }
        // `create_reduce_and_remove_grad_hooks`: each parameter gathered, then partitioned.
        t.component = Component::Weights;
        for (&n, &p) in numels.iter().zip(trainable) {
            let dtype = t.dtype(t.param(p));
            gather_whole(t, n, dtype, world, "all_gather (grad hooks)");
        }
        t.component = outer;
        Zero3 {
            world,
            dtype,
            offload_optimizer,
            params: trainable.to_vec(),
            numels,
            partitions: parts,
            optimizers: masters
                .iter()
                .map(|_| OptimizerState::new(optimizer))
                .collect(),
            sub_groups,
            masters,
            bucket: Vec::new(),
            bucket_elements: 0,
        }
    }

    /// Host bytes under `offload_optimizer`: per partition element the fp32 master, its fp32
    /// gradient, the two Adam states and the bf16 gradient partition.
    pub(crate) fn host_bytes(&self) -> u64 {
        if !self.offload_optimizer {
            return 0;
        }
        (4 * 4 + self.dtype.bytes()) * self.partitions.iter().sum::<u64>()
    }

    /// The gradient hook (`reduce_partition_and_remove_grads` →
    /// `reduce_independent_p_g_buckets_and_remove_grads`).
    pub(crate) fn grad_hook(&mut self, t: &mut Tracer, param: ParamId) {
        let Some(index) = self.params.iter().position(|&p| p == param) else {
            return;
        };
        let numel = self.numels[index];
        if self.bucket_elements + numel > REDUCE_BUCKET_ELEMENTS && self.bucket_elements > 0 {
            self.reduce_and_partition(t);
        }
        // Copied into the bucket; the gradient becomes a view of it.
        if let Some(grad) = t.params[param].grad.take() {
            t.drop(grad);
        }
        self.bucket.push(index);
        self.bucket_elements += numel;
    }

    /// `__reduce_and_partition_ipg_grads` → `__avg_scatter_grads` → `partition_grads`.
    fn reduce_and_partition(&mut self, t: &mut Tracer) {
        if self.bucket.is_empty() {
            return;
        }
        let outer = std::mem::replace(&mut t.component, Component::Communication);
        t.mem.stream = REDUCE_STREAM;
        self.bucket.sort_unstable();
        // `reduce_scatter_coalesced`: one tensor divisible by the world is reduced in place.
        let single =
            self.bucket.len() == 1 && self.numels[self.bucket[0]].is_multiple_of(self.world);
        let flat = (!single).then(|| {
            let padded = self
                .bucket
                .iter()
                .map(|&i| self.partitions[i] * self.world)
                .sum();
            t.empty(padded, self.dtype, "reduce_scatter_coalesced flat")
        });
        if self.offload_optimizer {
            // Each partition back from the host buffer, its norm, its fp32 copy.
            t.component = Component::OptimizerTemporaries;
            let mut previous: Option<T> = None;
            for &i in &self.bucket {
                let n = self.partitions[i];
                if let Some(p) = previous.take() {
                    t.drop(p);
                }
                let copy = t.empty(n, self.dtype, "grad_buffer.to(device)");
                let mut norm = None;
                for chunk in chunks(n, NORM_CHUNK_ELEMENTS) {
                    let double = t.empty(chunk, DType::I64, "_constant_buffered_norm2 .double()");
                    let part = t.empty(1, DType::I64, "norm (fp64)");
                    t.drop(double);
                    if let Some(total) = norm.replace(part) {
                        t.drop(total);
                    }
                }
                let float = t.empty(n, DType::F32, "grad_buffer.float() (to the host)");
                t.drop(float);
                if let Some(norm) = norm {
                    t.drop(norm);
                }
                previous = Some(copy);
            }
            if let Some(p) = previous {
                t.drop(p);
            }
        }
        if let Some(flat) = flat {
            t.drop(flat);
        }
        t.mem.stream = 0;
        t.component = outer;
        self.bucket.clear();
        self.bucket_elements = 0;
    }

    /// `engine.backward`'s epilogue: the last bucket reduced.
    pub(crate) fn finish_backward(&mut self, t: &mut Tracer) {
        self.reduce_and_partition(t);
    }

    /// `engine.step()`: the gradient norm, then per sub-group the fp32 gradient and AdamW.
    pub(crate) fn step(&mut self, t: &mut Tracer) {
        if self.offload_optimizer {
            // The norms were taken in backward; the step is the host's.
            return;
        }
        let outer = std::mem::replace(&mut t.component, Component::OptimizerTemporaries);
        super::zero::grad_norm_direct(t, &self.partitions);
        for (g, group) in self.sub_groups.iter().enumerate() {
            let n = self.partitions[group.clone()].iter().sum();
            t.component = Component::OptimizerTemporaries;
            let flat = t.empty(n, self.dtype, "flatten(averaged_gradients)");
            t.component = Component::Gradients;
            let grad32 = t.empty(n, DType::F32, "fp32 gradient (sub-group)");
            t.drop(flat);
            t.component = outer;
            self.optimizers[g].step(t, &[self.masters[g]]);
            t.drop(grad32);
        }
        t.component = outer;
    }
}

/// `_allgather_params` of one parameter of `numel` elements: the flat buffer of every rank's
/// partition, the whole parameter copied out of it, the flat buffer freed, then the whole
/// freed as the parameter is partitioned again.
fn gather_whole(t: &mut Tracer, numel: u64, dtype: DType, world: u64, label: &'static str) {
    let flat = t.empty(
        numel.div_ceil(world) * world,
        dtype,
        "_allgather_params flat",
    );
    let whole = t.empty(numel, dtype, label);
    t.drop(flat);
    t.drop(whole);
}

/// `tensor.split(chunk)`: the sizes of the pieces of `n` elements.
fn chunks(n: u64, chunk: u64) -> impl Iterator<Item = u64> {
    (0..n.div_ceil(chunk)).map(move |i| chunk.min(n - i * chunk))
}
