//! DeepSpeed ZeRO stage 3 (`deepspeed/runtime/zero/stage3.py`, `partition_parameters.py`,
//! DeepSpeed 0.18.2, `bf16` enabled, `torch_adam` AdamW or DeepSpeedCPUAdam under
//! `offload_optimizer`, the stage defaults: `reduce_bucket_size` 5e8, `contiguous_gradients`,
//! `reduce_scatter`, `sub_group_size` 1e9) as one rank sees it. Each parameter's partition is
//! `ceil(numel / world)` elements, equal on every rank. On a one-rank world the partition is
//! the whole parameter and `all_gather_coalesced` hands each parameter its partition's storage
//! (`_no_gather_coalesced`): the per-module gathers of forward and backward allocate nothing,
//! and forward and backward are those of the plain bf16 model. Over several ranks the
//! gathers are `zero3_gather`'s (below). What is allocated, in order (checked against
//! bench/distributed/h200x1/zero3-q15-4l-nogc-w1-rank0.pickle.gz, which has stack frames, and
//! the two ranks' `h200x2/zero3-q15-4l-rank{0,1}.pickle.gz`):
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
//! - several ranks (`zero3_gather`, after `parameter_offload.py` and
//!   `partitioned_param_coordinator.py`): every module (the model class, the decoder stack,
//!   the embedding, rotary embedding, each layer, norm, attention, projection, MLP and
//!   activation, the head) fetches its own parameters in its forward pre-hook and its
//!   backward pre-hook, and releases them in its forward and backward post-hooks (none for
//!   the embedding, whose input needs no grad: it stays gathered until `step()`). A fetch of
//!   one parameter allocates `partition * world` elements on the all-gather stream, which the
//!   parameter views; of several, one flat buffer of their partitions times the world, then
//!   at the first wait each parameter's `torch.cat` (whole size, same stream), the flat buffer
//!   freed once every parameter of it has been waited for. A release frees the gathered
//!   storage. Step 1 records the module order and releases everything after use; from step 2
//!   the trace is complete: each fetch (parameterless modules' too) prefetches the next
//!   parameters of the trace up to `stage3_prefetch_bucket_size` (5e7 elements) of missing
//!   ones, capped by `stage3_max_live_parameters` (1e9) less what is gathered, and a release
//!   keeps what the trace uses again within `stage3_max_reuse_distance` (1e9 elements) or
//!   what was prefetched for a later use, and the persistent parameters (at most 1e5
//!   elements: norms, biases). Checkpoint recomputation runs the layer's hooks again until
//!   PyTorch stops it early. `step()` releases everything first and gathers the persistent
//!   parameters again at its end (a flat buffer each, default stream). The gradients are
//!   whole-size; the IPG bucket and `reduce_scatter_coalesced` are as above.
//!
//! - MoE leaf modules (checked against the trace of
//!   `moe-dist/qwen3-30b-a3b/L8/zero3/bf16/bs2/s2048/gc/w8`, bench/trace/zero): DeepSpeed
//!   0.18.2 flags Mixtral's, Qwen2-MoE's and Qwen3-MoE's sparse MoE blocks as leaves
//!   (`leaf_module_config.py`), on one rank too. A leaf's hooks fetch and release every
//!   parameter beneath it (in `ds_id` order: the experts before the router, so a prefetch
//!   bucket stops at the experts); the modules beneath it have no hooks. Its parameters have
//!   no gradient hooks: its full backward hook reduces them all once its input's gradient
//!   is made, before its post-backward release. `__params_to_release` reads the later
//!   modules with the released module's `recurse`: a linear's release sees no parameter of
//!   a later MoE block, so under the 1e9-element reuse distance the attention weights the
//!   forward gathers stay gathered until their backward.
//!
//! - `offload_param` (checked against `h200x1/zero3-offload-params-q15-4l-nogc-w1-rank0.pickle.gz`,
//!   with frames): `zero.Init` makes each partition on the host (the whole parameter is still
//!   made and freed on the GPU), engine construction keeps them there (no flat buffer, no
//!   `empty_cache`), and every gather copies host partitions over: on one rank each fetched
//!   parameter becomes `ds_tensor.to(device)`, a whole-size copy on the all-gather stream
//!   (`_no_gather_coalesced`), freed at its release, and `_post_step` copies the persistent
//!   parameters over on the default stream; over several ranks each partition is copied in
//!   before its all-gather and freed after it.
//!
//! - an inference engine (`mode: forward`: `deepspeed.initialize(model=...)` without an
//!   optimizer, as OpenRLHF and TRL build a reference model): `zero.Init` and the init's
//!   gathers as above, then `DeepSpeedZeRoOffload` alone: the untied head's partition
//!   collected, the partitions left as made (no flat buffer, bucket or gradient hooks), and
//!   the module hooks and their gathers (or host copies) in every forward; the engine runs
//!   without the outer autocast.
//!
//! - `offload_param` without `offload_optimizer` (checked against
//!   `h200x1-param-offload/zero3-offload-params-only-q15-4l-nogc-w1-rank0.pickle.gz`, with frames): the fp32 master
//!   of each sub-group is `partition.to(device).clone().float()`, so the host partitions are
//!   first copied over (freed once cloned).
//!
//! Not modelled: the few tiny allocations of the barriers and norm reductions.

use std::ops::Range;

use super::zero3_gather::Gathers;
use crate::dtype::DType;
use crate::sim::engine::component::Component;
use crate::sim::engine::tracer::{ParamId, T, Tracer};
use crate::sim::optim::OptimizerState;
use crate::spec::{Optimizer, Parallel};

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
    /// The per-module gathers (on one rank without `offload_param` a gather only hands each
    /// parameter its partition, but the hooks still run: a leaf module's gradients wait for
    /// its backward).
    pub(crate) gathers: Gathers,
}

impl Zero3 {
    /// `from_config` under `deepspeed.zero.Init` on a model registered without storage from
    /// `first` on (`count` parameters, `model.parameters()` order), then transformers' weight
    /// initialisation; `tied_lm_head`: the head's own parameter, made before the tie. Returns
    /// the partitions (each parameter's `ds_tensor`) and the untied head's.
    pub(crate) fn init(
        t: &mut Tracer,
        params: &[ParamId],
        parallel: &Parallel,
        tied_lm_head: Option<ParamId>,
    ) -> (Vec<T>, Option<T>) {
        let world = parallel.world_size;
        let outer = std::mem::replace(&mut t.component, Component::Weights);
        // Under `offload_param` the partition is made on the host.
        let partition = |t: &mut Tracer, p: ParamId| {
            let (numel, dtype) = (t.numel(t.param(p)), t.dtype(t.param(p)));
            let whole = t.empty(numel, dtype, "zero.Init: parameter made whole");
            let part = (!parallel.offload_params).then(|| {
                t.empty(
                    numel.div_ceil(world),
                    dtype,
                    "zero.Init: partition (ds_tensor)",
                )
            });
            t.drop(whole);
            part
        };
        let partitions: Vec<T> = params.iter().filter_map(|&p| partition(t, p)).collect();
        let head = tied_lm_head.and_then(|p| partition(t, p));
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
        parallel: &Parallel,
        optimizer: Optimizer,
    ) -> Zero3 {
        let (world, offload_optimizer) = (parallel.world_size, parallel.offload_optimizer);
        let offload_params = parallel.offload_params;
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
        // `defragment`: every partition to the host, the cache emptied, one flat buffer back
        // (under `offload_param` the partitions stay on the host, flattened there).
        if !offload_params {
            t.drop_all(&partitions);
            t.mem.allocator.empty_cache();
            let flat = t.empty(parts.iter().sum(), dtype, "DeepSpeed flat bf16 partitions");
            for &p in trainable {
                t.param_into_view(p, flat, "parameter (its partition in the flat buffer)");
            }
            t.drop(flat);
        }
        // `_create_fp32_partitions`, then `initialize_optimizer_states`.
        let mut masters = Vec::new();
        if !offload_optimizer {
            for g in &sub_groups {
                let n = group_numel(g);
                // `.to(self.device)` copies a host partition over first (under `offload_param`).
                let copy =
                    offload_params.then(|| t.empty(n, dtype, "sub-group partition .to(device)"));
                let clone = t.empty(n, dtype, "sub-group partition .clone()");
                if let Some(copy) = copy {
                    t.drop(copy);
                }
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
            gathers: Gathers::new(t, trainable, world, offload_params),
        }
    }

    /// `deepspeed.initialize(model=...)` without an optimizer (an inference engine, as
    /// OpenRLHF and TRL build a reference model): `DeepSpeedZeRoOffload` alone. Its first
    /// `see_memory_usage` collects the untied head's partition; the partitions stay as
    /// `zero.Init` made them (no defragmentation), and only the parameter hooks run.
    pub(crate) fn inference(
        t: &mut Tracer,
        params: &[ParamId],
        partitions: Vec<T>,
        untied_head: Option<T>,
        parallel: &Parallel,
    ) -> Zero3 {
        if let Some(head) = untied_head {
            t.drop(head);
        }
        for part in partitions {
            t.mark_persistent(part);
        }
        let world = parallel.world_size;
        let numels: Vec<u64> = params.iter().map(|&p| t.numel(t.param(p))).collect();
        Zero3 {
            world,
            dtype: t.dtype(t.param(params[0])),
            offload_optimizer: false,
            params: Vec::new(),
            partitions: numels.iter().map(|n| n.div_ceil(world)).collect(),
            numels,
            sub_groups: Vec::new(),
            masters: Vec::new(),
            optimizers: Vec::new(),
            bucket: Vec::new(),
            bucket_elements: 0,
            gathers: Gathers::new(t, params, world, parallel.offload_params),
        }
    }

    /// Host bytes under `offload_optimizer`: per partition element the fp32 master, its fp32
    /// gradient, the two Adam states and the bf16 gradient partition; under `offload_param`
    /// the bf16 partitions too.
    pub(crate) fn host_bytes(&self) -> u64 {
        let partitions = self.partitions.iter().sum::<u64>();
        let params = if self.gathers.offload {
            self.dtype.bytes() * partitions
        } else {
            0
        };
        if !self.offload_optimizer {
            return params;
        }
        params + (4 * 4 + self.dtype.bytes()) * partitions
    }

    /// The gradient hook (`reduce_partition_and_remove_grads`); a leaf module's parameters
    /// have none (their gradients wait for [`Self::unit_backward_done`]).
    pub(crate) fn grad_hook(&mut self, t: &mut Tracer, param: ParamId) {
        if self.gathers.in_leaf(param) {
            return;
        }
        self.reduce_ready(t, param);
    }

    /// Module `unit`'s backward has run: a leaf's full backward hook
    /// (`reduce_leaf_module_grads`: each parameter's gradient, zeros where it has none, into
    /// the bucket), then its post-backward hook.
    pub(crate) fn unit_backward_done(&mut self, t: &mut Tracer, unit: u32) {
        for param in self.gathers.leaf_params(unit) {
            if t.params[param].grad.is_none() {
                let p = t.param(param);
                let outer = std::mem::replace(&mut t.component, Component::Gradients);
                let zeros = t.empty(t.numel(p), t.dtype(p), "torch.zeros_like(param) (leaf)");
                t.component = outer;
                t.params[param].grad = Some(zeros);
            }
            self.reduce_ready(t, param);
        }
        self.gathers.unit_backward_done(t, unit);
    }

    /// `reduce_independent_p_g_buckets_and_remove_grads`: the bucket reduced first where the
    /// gradient would overflow it, then the gradient copied in.
    fn reduce_ready(&mut self, t: &mut Tracer, param: ParamId) {
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
        self.gathers.release_all(t);
        self.step_sub_groups(t);
        self.gathers.gather_persistent(t);
    }

    fn step_sub_groups(&mut self, t: &mut Tracer) {
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
