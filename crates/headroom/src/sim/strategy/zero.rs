//! DeepSpeed ZeRO stages 1 and 2 (`deepspeed/runtime/zero/stage_1_and_2.py`, DeepSpeed 0.18.2,
//! `bf16` enabled, `torch_adam` AdamW, the stage defaults: `reduce_bucket_size` 5e8,
//! `contiguous_gradients`, no `overlap_comm`, no round-robin gradients) as one rank sees it.
//! Ranks differ in which parameters their partition holds, and so in the sizes of
//! `grads_in_partition` and of the gradient-norm temporaries, and in how the caching allocator
//! lays them out (measured: 5.20 vs 5.16 GiB optimizer peak, 13.19 vs 10.87 GiB reserved on the
//! 4-layer model). `step::simulate_steps` simulates the first and the last rank (the only one
//! whose gradient list ends with the flat buffer's padding) and reports the one that needs
//! more; ranks between them hold the same kinds of slices.
//!
//! Every parameter keeps a bf16 copy on every rank (views of one flat buffer); the rank owns a
//! contiguous `1 / world_size` slice of that flat buffer (its partition), for which it keeps
//! the fp32 master weights and the Adam states. What is allocated, in order (checked against
//! both ranks' snapshots of the 4-layer run, bench/distributed/h200x2/zero2-q15-4l-rank*.pickle.gz):
//! - construction (`DeepSpeedZeroOptimizer.__init__`): each trainable parameter is moved to the
//!   host (`param.data = torch.empty(1).to(device)`: a 4-byte placeholder, then the parameter's
//!   storage freed), then `empty_cache()` (the freed segments go back to the driver); the flat
//!   buffer of every parameter, aligned to `2 * world_size` elements, comes back to the GPU
//!   in one allocation and each parameter becomes a view of it (placeholders freed in
//!   parameter order); the partition is cloned (bf16) and cast to the fp32 master (the clone
//!   dies); `initialize_optimizer_states` makes a zero fp32 gradient of the partition and
//!   drops it again (torch's AdamW creates its states lazily, at the first step).
//! - backward: the first gradient hook allocates the IPG bucket (`setup_buckets`: 5e8
//!   elements of the parameters' dtype, 1e9 bytes in bf16). Under stage 2 each gradient, as
//!   `AccumulateGrad` stores it, is copied into the bucket and its own storage freed
//!   (`reduce_independent_p_g_buckets_and_remove_grads`); a gradient that would overflow the
//!   bucket first reduces it (`reduce_ipg_grads`). Stage 1 only allocates the bucket in its
//!   hooks: the gradients stay where autograd put them until backward ends, then
//!   `reduce_gradients` moves them into the bucket the same way, in parameter order.
//! - `reduce_ipg_grads`: `average_tensor` → `allreduce_and_scatter` → `allreduce_bucket`
//!   flattens the bucket's gradient slices into a new tensor (the bucket's elements), all-reduces
//!   it and copies it back; it is freed before the copy-out. Then each gradient of a parameter
//!   in this rank's partition is copied into `grads_in_partition` (allocated at the first such
//!   gradient, of the parameters' dtype, as large as every parameter that touches the partition,
//!   whole: the parameter straddling the partition's start counts in full); under stage 2 the
//!   others are dropped.
//! - end of backward (`independent_gradient_partition_epilogue`): the last bucket is reduced,
//!   the bucket released; `averaged_gradients` keeps views of `grads_in_partition`.
//! - `step()`: `get_grad_norm_direct` takes `g.double()` of each gradient slice in the
//!   partition (8 bytes an element, freed after its norm); the slices are flattened (bf16, the
//!   partition's size) and cast to the fp32 gradient of the master (the flat bf16 dies);
//!   `averaged_gradients` is dropped, freeing `grads_in_partition`; torch's foreach AdamW steps
//!   the one fp32 master tensor (states of the partition's size at step 1, one `_foreach_sqrt`
//!   temporary); the fp32 gradient is dropped; the updated partition is copied into the flat
//!   bf16 buffer and all-gathered in place (nothing allocated).
//!
//! - `offload_optimizer` (`cpu_offload`): the fp32 master, its gradient and AdamW
//!   (DeepSpeedCPUAdam) live on the host, so construction allocates only the flat buffer and
//!   then `temp_grad_buffer_for_gpu_offload` (the largest parameter's elements, bf16, for the
//!   life of the engine; line 537); there is no `grads_in_partition`. Instead each gradient in
//!   the partition leaves the bucket through `copy_grads_in_partition`: its norm from
//!   `g.double()` (8 bytes an element, freed at once), then `g.float()` copied to the host
//!   buffer (freed at once). `step()` runs on the host and copies the updated partition into
//!   the flat buffer: nothing on the GPU.
//!
//! Not modelled: a few tiny
//! allocations (the 128-byte broadcasts of engine construction, the norms' reduction
//! workspaces, the zero padding of the last partition's gradient list).

use crate::dtype::DType;
use crate::sim::engine::component::Component;
use crate::sim::engine::tracer::{ParamId, T, Tracer};
use crate::sim::optim::OptimizerState;
use crate::spec::Strategy;

/// `reduce_bucket_size` (elements).
const REDUCE_BUCKET_ELEMENTS: u64 = 500_000_000;
/// `nccl_start_alignment_factor`: the flat buffer is padded to a multiple of this times the
/// number of ranks.
const ALIGNMENT: u64 = 2;

pub(crate) struct Zero {
    /// Stage 2 partitions gradients (reduces them as they arrive); stage 1 only the optimizer.
    partition_gradients: bool,
    dtype: DType,
    /// The trainable parameters in `model.parameters()` order (the flat buffer's order).
    params: Vec<ParamId>,
    /// Per parameter: whether it touches this rank's partition.
    in_partition: Vec<bool>,
    /// Elements of each parameter inside the partition, in flat order (the gradient slices
    /// `averaged_gradients` holds).
    slices: Vec<u64>,
    /// Elements of the parameters that touch the partition, whole.
    in_partition_numel: u64,
    partition_numel: u64,
    /// Per parameter: its offset in the flat buffer and its elements.
    offsets: Vec<u64>,
    numels: Vec<u64>,
    /// The fp32 master partition (a parameter of its own, what AdamW steps); `None` under
    /// `offload_optimizer` (on the host).
    pub(crate) master: Option<ParamId>,
    /// The IPG bucket while backward runs, the parameters whose gradients it holds and their
    /// elements.
    ipg: Option<T>,
    bucket: Vec<usize>,
    bucket_elements: u64,
    /// A gradient too large for the bucket, reduced on its own.
    extra_large: Option<(usize, T)>,
    /// `grads_in_partition` (from backward to `step()`, held by `averaged_gradients`).
    grads_in_partition: Option<T>,
    /// Per parameter in the partition, the elements of its slice (for the host copy under
    /// `offload_optimizer`); empty without offload.
    offload_slices: Vec<Option<u64>>,
}

impl Zero {
    /// `deepspeed.initialize(model=..., model_parameters=trainable)`: the optimizer's
    /// construction as rank `rank` of `world` does it.
    pub(crate) fn wrap(
        t: &mut Tracer,
        trainable: &[ParamId],
        strategy: Strategy,
        world: u64,
        rank: u64,
        offload_optimizer: bool,
    ) -> Zero {
        let dtype = t.dtype(t.param(trainable[0]));
        let numels: Vec<u64> = trainable.iter().map(|&p| t.numel(t.param(p))).collect();
        let total: u64 = numels.iter().sum();
        let flat_numel = total.div_ceil(ALIGNMENT * world) * ALIGNMENT * world;
        let partition_numel = flat_numel / world;
        let (start, end) = (rank * partition_numel, (rank + 1) * partition_numel);
        // `get_partition_info` and `get_flat_partition`.
        let mut in_partition = Vec::with_capacity(numels.len());
        let mut slices = Vec::new();
        let mut slice_of = Vec::with_capacity(numels.len());
        let mut offset = 0;
        let mut taken = 0;
        for &n in &numels {
            let touches =
                (start <= offset && offset < end) || (offset < start && start < offset + n);
            in_partition.push(touches);
            if touches {
                let skip = start.saturating_sub(offset);
                let slice = (n - skip).min(partition_numel - taken);
                slices.push(slice);
                slice_of.push(Some(slice));
                taken += slice;
            } else {
                slice_of.push(None);
            }
            offset += n;
        }
        let in_partition_numel = numels
            .iter()
            .zip(&in_partition)
            .filter(|&(_, &i)| i)
            .map(|(&n, _)| n)
            .sum();

        // Each parameter to the host: a placeholder first, then its storage is freed.
        let outer = std::mem::replace(&mut t.component, Component::Weights);
        let placeholders: Vec<T> = trainable
            .iter()
            .map(|&p| {
                let placeholder = t.empty(1, DType::F32, "torch.empty(1) placeholder (DeepSpeed)");
                t.offload(p);
                placeholder
            })
            .collect();
        t.mem.allocator.empty_cache();
        let flat = t.empty(flat_numel, dtype, "DeepSpeed flat bf16 parameters");
        for (&p, placeholder) in trainable.iter().zip(placeholders) {
            t.param_into_view(p, flat, "parameter (view of the flat buffer)");
            t.drop(placeholder);
        }
        // The views keep the flat buffer alive.
        t.drop(flat);
        let master = if offload_optimizer {
            // The master, its gradient and the states are the host's; the GPU keeps a
            // staging buffer of the largest parameter for the engine's life.
            let largest = numels.iter().copied().max().unwrap_or(0);
            t.component = Component::Gradients;
            let staging = t.empty(largest, dtype, "temp_grad_buffer_for_gpu_offload");
            t.mark_persistent(staging);
            None
        } else {
            // The fp32 master of the partition: `partition.detach().clone().to(fp32)`.
            let clone =
                (dtype != DType::F32).then(|| t.empty(partition_numel, dtype, "partition clone"));
            let master = t.parameter(partition_numel, DType::F32, true, "fp32 master partition");
            t.recategorize(t.param(master), Component::OptimizerStates);
            if let Some(clone) = clone {
                t.drop(clone);
            }
            // `initialize_optimizer_states`: a zero gradient, set and dropped.
            t.component = Component::Gradients;
            let zeros = t.empty(
                partition_numel,
                DType::F32,
                "initialize_optimizer_states zero grad",
            );
            t.drop(zeros);
            Some(master)
        };
        t.component = outer;
        Zero {
            partition_gradients: strategy == Strategy::Zero2,
            dtype,
            params: trainable.to_vec(),
            in_partition,
            slices,
            in_partition_numel,
            partition_numel,
            offsets: numels
                .iter()
                .scan(0, |offset, &n| {
                    let start = *offset;
                    *offset += n;
                    Some(start)
                })
                .collect(),
            numels,
            master,
            ipg: None,
            bucket: Vec::new(),
            bucket_elements: 0,
            extra_large: None,
            grads_in_partition: None,
            offload_slices: if offload_optimizer {
                slice_of
            } else {
                Vec::new()
            },
        }
    }

    /// Host bytes of the optimizer under `offload_optimizer`: the fp32 master, its gradient
    /// and AdamW's two states (4 bytes an element each).
    pub(crate) fn host_bytes(&self) -> u64 {
        if self.master.is_some() {
            return 0;
        }
        4 * 4 * self.partition_numel
    }

    /// The gradient hook (`grad_handling_hook` → `process_gradients`).
    pub(crate) fn grad_hook(&mut self, t: &mut Tracer, param: ParamId) {
        let Some(index) = self.params.iter().position(|&p| p == param) else {
            return;
        };
        if self.ipg.is_none() {
            // `setup_buckets`.
            let outer = std::mem::replace(&mut t.component, Component::Communication);
            self.ipg = Some(t.empty(REDUCE_BUCKET_ELEMENTS, self.dtype, "DeepSpeed IPG bucket"));
            t.component = outer;
        }
        if self.partition_gradients {
            self.bucket_gradient(t, index);
        }
    }

    /// `reduce_independent_p_g_buckets_and_remove_grads`.
    fn bucket_gradient(&mut self, t: &mut Tracer, index: usize) {
        let p = self.params[index];
        let Some(grad) = t.params[p].grad.take() else {
            return;
        };
        let numel = t.numel(grad);
        if self.bucket_elements + numel > REDUCE_BUCKET_ELEMENTS {
            self.reduce_ipg_grads(t);
        }
        if numel > REDUCE_BUCKET_ELEMENTS {
            self.extra_large = Some((index, grad));
        } else {
            // Copied into the bucket; the gradient becomes a view of it.
            t.drop(grad);
        }
        self.bucket_elements += numel;
        self.bucket.push(index);
    }

    /// `reduce_ipg_grads`: the all-reduce's flat copy, then the partition's gradients out.
    fn reduce_ipg_grads(&mut self, t: &mut Tracer) {
        let outer = std::mem::replace(&mut t.component, Component::Communication);
        for elements in self.flatten_copies() {
            let flat = t.empty(elements, self.dtype, "allreduce_bucket flatten");
            t.drop(flat);
        }
        t.component = Component::Gradients;
        let extra = self.extra_large.take();
        if self.master.is_none() {
            // `copy_grads_in_partition` under `cpu_offload`: the norm, then the fp32 copy out.
            t.component = Component::OptimizerTemporaries;
            for &index in &self.bucket {
                if let Some(slice) = self.offload_slices[index] {
                    let double = t.empty(
                        slice,
                        DType::I64,
                        "g.double() (set_norm_for_param_grad_in_gpu)",
                    );
                    let norm = t.empty(1, DType::I64, "norm (fp64)");
                    t.drop(double);
                    let float = t.empty(slice, DType::F32, "g.float() (copy to the host)");
                    t.drop(float);
                    t.drop(norm);
                }
            }
        }
        for &index in &self.bucket {
            if self.master.is_none() {
                break;
            }
            if self.in_partition[index] && self.grads_in_partition.is_none() {
                self.grads_in_partition =
                    Some(t.empty(self.in_partition_numel, self.dtype, "grads_in_partition"));
            }
        }
        // The extra-large gradient is copied into the partition (in it) or cleared (stage 2
        // outside it): either way its storage goes; stage 1 keeps it outside until the
        // epilogue clears every `.grad`.
        if let Some((index, g)) = extra {
            if self.in_partition[index] || self.partition_gradients {
                t.drop(g);
            } else {
                self.extra_large = Some((index, g));
            }
        }
        self.bucket.clear();
        self.bucket_elements = 0;
        t.component = outer;
    }

    /// The copies `average_tensor` makes of the bucket (`use_multi_rank_bucket_allreduce`):
    /// its gradients cut at partition boundaries, consecutive pieces of one rank merged, then
    /// `allreduce_and_scatter` flattens them in groups that pass `reduce_bucket_size`; one
    /// piece flattens to a view of itself, several are concatenated.
    fn flatten_copies(&self) -> Vec<u64> {
        let partition = self.partition_numel.max(1);
        let mut pieces: Vec<(u64, u64)> = Vec::new();
        for &index in &self.bucket {
            let (mut at, end) = (
                self.offsets[index],
                self.offsets[index] + self.numels[index],
            );
            while at < end {
                let rank = at / partition;
                let piece = end.min((rank + 1) * partition) - at;
                match pieces.last_mut() {
                    Some((last, numel)) if *last == rank => *numel += piece,
                    _ => pieces.push((rank, piece)),
                }
                at += piece;
            }
        }
        let mut copies = Vec::new();
        let (mut count, mut numel) = (0, 0);
        for (_, piece) in pieces {
            count += 1;
            numel += piece;
            if numel > REDUCE_BUCKET_ELEMENTS {
                if count > 1 {
                    copies.push(numel);
                }
                (count, numel) = (0, 0);
            }
        }
        if count > 1 {
            copies.push(numel);
        }
        copies
    }

    /// After `loss.backward()`: stage 1's `reduce_gradients`, then the epilogue of both.
    pub(crate) fn finish_backward(&mut self, t: &mut Tracer) {
        if !self.partition_gradients {
            for index in 0..self.params.len() {
                if t.params[self.params[index]].grad.is_some() {
                    self.bucket_gradient(t, index);
                }
            }
        }
        self.reduce_ipg_grads(t);
        if let Some((_, g)) = self.extra_large.take() {
            t.drop(g);
        }
        if let Some(ipg) = self.ipg.take() {
            t.drop(ipg);
        }
    }

    /// `engine.step()`: the gradient norm, the fp32 gradient, AdamW on the master partition.
    pub(crate) fn step(&mut self, t: &mut Tracer, optimizer: &mut OptimizerState) {
        // Under `offload_optimizer` the step is the host's.
        let Some(master) = self.master else {
            return;
        };
        let outer = std::mem::replace(&mut t.component, Component::OptimizerTemporaries);
        grad_norm_direct(t, &self.slices);
        // `_flatten_dense_tensors` of a single tensor is a view of it; of several, a copy.
        // The last rank's list ends with zeros when the flat buffer's padding falls in it.
        let padded = self.slices.iter().sum::<u64>() < self.partition_numel;
        let pieces = self.slices.len() + usize::from(padded);
        let flat = (pieces > 1).then(|| {
            t.empty(
                self.partition_numel,
                self.dtype,
                "flatten(averaged_gradients)",
            )
        });
        t.component = Component::Gradients;
        let grad32 = t.empty(self.partition_numel, DType::F32, "fp32 gradient partition");
        if let Some(flat) = flat {
            t.drop(flat);
        }
        if let Some(g) = self.grads_in_partition.take() {
            t.drop(g);
        }
        t.component = outer;
        optimizer.step(t, &[master]);
        t.drop(grad32);
    }
}

/// `get_grad_norm_direct` (stages 1-3 alike): per gradient of `sizes` elements an fp64 copy
/// (8-byte elements; I64 has their size), freed once its norm (kept for the sum) exists.
pub(super) fn grad_norm_direct(t: &mut Tracer, sizes: &[u64]) {
    let mut norms = Vec::with_capacity(sizes.len());
    for &n in sizes {
        let double = t.empty(n, DType::I64, "g.double() (get_grad_norm_direct)");
        norms.push(t.empty(1, DType::I64, "vector_norm (fp64)"));
        t.drop(double);
    }
    t.drop_all(&norms);
}
