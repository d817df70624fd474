//! Megatron-core 0.19's `DistributedDataParallel` and mixed-precision optimizer as one rank of
//! the data-parallel group sees them (`distributed/distributed_data_parallel.py`,
//! `distributed/param_and_grad_buffer.py`, `optimizer/distrib_optimizer.py`,
//! `optimizer/optimizer.py`, `optimizer/clip_grads.py`), with Megatron-LM's bf16 defaults
//! (`grad_reduce_in_fp32`, `overlap_grad_reduce` off, `clip_grad` 1.0) and no Transformer
//! Engine or apex (Adam is `torch.optim.AdamW`, foreach; multi-tensor ops are loops).
//!
//! - The bf16 parameters share one `_ParamAndGradBuffer`, laid out in reverse parameter order
//!   ([`BufferLayout`]), one bucket since gradients are reduced after backward. Its fp32
//!   `grad_data` holds every parameter's `main_grad`; a hook on each `AccumulateGrad` adds the
//!   bf16 gradient into it (`main_grad.add_(grad)`) and drops it. With the distributed
//!   optimizer a bf16 `param_data` buffer is allocated before it and every parameter is moved
//!   into it (`param.data = view; copy_; del old`, last parameter first).
//! - The optimizer's fp32 main parameters: `Float16OptimizerWithFloat16Params` makes
//!   `param.detach().clone().float()` of every parameter; `DistributedOptimizer` of this
//!   rank's `numel / dp` elements of the buffer (`shard_model_param.clone().float()`, per
//!   parameter part, in buffer order): each data-parallel rank its own parts, other sizes in
//!   another order. Both step them with `torch.optim.AdamW` over two
//!   parameter groups, the matrices and then the vectors (norms, biases: weight decay 0),
//!   whose states appear at the first step. Their gradients are views of `grad_data`.
//! - `step()`: the gradient norm (`torch.norm` of each main gradient, one element each, kept
//!   until the norm is summed), the clip (`dst.copy_(src * clip_coeff)`: a temporary the size
//!   of each gradient in turn), AdamW, then `model_param.copy_(main_param)` in place.
//! - `optimizer_cpu_offload` (`HybridDeviceOptimizer` under the distributed optimizer, with
//!   `use_precision_aware_optimizer`, as Megatron-LM requires, and its default offload fraction
//!   1.0; `optimizer/cpu_offloading/hybrid_optimizer.py`): `get_megatron_optimizer` builds one
//!   over the model's parameters, which copies each to the host (`param.detach().clone()
//!   .cpu()`: a bf16 clone on the GPU, freed at once), then `DistributedOptimizer` makes no fp32
//!   shards (the precision-aware path) and builds another over its bf16 shard views, copying
//!   each the same way. The fp32 main parameters and AdamW's states live on the host; each
//!   shard's gradient (`decoupled_grad`, a view of `grad_data`) is copied into pinned host
//!   memory, the host's AdamW steps, and each updated fp32 shard is copied back into its bf16
//!   shard (`copy_(non_blocking=True)`, which casts on the GPU: an fp32 copy of the shard
//!   there, freed at once). `overlap_cpu_optimizer_d2h_h2d` makes those copies on each
//!   optimizer's own host-to-device stream, whose blocks the caching allocator keeps apart.
//!
//! - Expert parallelism (`ep > 1`) or expert tensor parallelism (`etp > 1`): the local experts'
//!   parameters (`allreduce` false) get a buffer of their own, made after the dense one and
//!   sharded over the `world / (pp × ep × etp)` expert-data-parallel ranks, and an optimizer of
//!   their own after the dense one's
//!   (`get_megatron_optimizer` chains them: the norm and clip of every gradient, then each
//!   optimizer's step).
//!
//! The reductions (`finish_grad_sync`, the parameter all-gather) work in place in the buffers.

use super::super::engine::component::Component;
use super::super::engine::tracer::{ParamId, T, Tracer};
use crate::dtype::DType;
use crate::sim::optim::OptimizerState;
use crate::spec::Optimizer;

/// `DistributedOptimizer._compute_per_buffer_param_layout` (or, without the distributed
/// optimizer, `_compute_default_per_buffer_param_layout`): parameters from the last to the
/// first, one bucket since gradients are reduced after backward. With the distributed
/// optimizer each starts at a multiple of 64 elements (`pad_param_start`), a shared embedding
/// (a tied weight a pipeline's first and last stage each hold: `shared_embedding`) gets a
/// bucket of its own, and each bucket's end is padded to a multiple of `lcm(dp, 128)`
/// (`pad_bucket_end`) so that it splits evenly over the data-parallel ranks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct BufferLayout {
    /// Elements of the buffer, padding included.
    pub(crate) numel: u64,
    /// Each parameter's first element, in parameter order.
    pub(crate) starts: Vec<u64>,
    numels: Vec<u64>,
    /// Each bucket's first and end element, in buffer order.
    buckets: Vec<(u64, u64)>,
}

impl BufferLayout {
    /// The layout of parameters of `numels` elements; `shared_embedding`, the index of the one
    /// marked `shared_embedding`.
    pub(crate) fn new(
        numels: &[u64],
        dp: u64,
        distributed_optimizer: bool,
        shared_embedding: Option<usize>,
    ) -> Self {
        let pad_end = |end: u64| {
            if distributed_optimizer {
                end.next_multiple_of(lcm(dp, 128))
            } else {
                end
            }
        };
        let mut starts = vec![0; numels.len()];
        let mut buckets = Vec::new();
        let (mut next, mut bucket_start, mut in_bucket) = (0u64, 0, false);
        for (i, &numel) in numels.iter().enumerate().rev() {
            let apart = distributed_optimizer && shared_embedding == Some(i);
            if distributed_optimizer {
                next = next.next_multiple_of(64);
            }
            if apart && in_bucket {
                let end = pad_end(next);
                buckets.push((bucket_start, end));
                (bucket_start, next) = (end, end);
            }
            starts[i] = next;
            next += numel;
            in_bucket = true;
            if apart {
                let end = pad_end(next);
                buckets.push((bucket_start, end));
                (bucket_start, next, in_bucket) = (end, end, false);
            }
        }
        if in_bucket || buckets.is_empty() {
            buckets.push((bucket_start, pad_end(next)));
        }
        BufferLayout {
            numel: buckets.last().map_or(0, |&(_, end)| end),
            starts,
            numels: numels.to_vec(),
            buckets,
        }
    }

    /// The parts of parameters inside rank `rank`'s `1/dp` of each bucket, bucket by bucket,
    /// in buffer order (last parameter first): (parameter index, elements).
    pub(crate) fn shard_parts(&self, dp: u64, rank: u64) -> Vec<(usize, u64)> {
        let mut parts = Vec::new();
        for &(first, end) in &self.buckets {
            let size = (end - first) / dp;
            let (lo, hi) = (first + rank * size, first + (rank + 1) * size);
            parts.extend((0..self.starts.len()).rev().filter_map(|i| {
                let (start, end) = (self.starts[i], self.starts[i] + self.numels[i]);
                let overlap = end.min(hi).saturating_sub(start.max(lo));
                (overlap > 0).then_some((i, overlap))
            }));
        }
        parts
    }
}

fn lcm(a: u64, b: u64) -> u64 {
    let gcd = |mut a: u64, mut b: u64| {
        while b != 0 {
            (a, b) = (b, a % b);
        }
        a
    };
    a / gcd(a, b) * b
}

/// One model chunk's parameters (`named_parameters()` order), which are vectors (1-D), which
/// are local experts', and which one is a tied embedding held on two stages.
pub(crate) struct ChunkParams<'a> {
    pub(crate) params: &'a [ParamId],
    pub(crate) vectors: &'a [bool],
    pub(crate) experts: &'a [bool],
    pub(crate) shared_embedding: Option<usize>,
}

/// One main parameter: the fp32 copy on the GPU that AdamW steps, or (offloaded) a bf16
/// shard whose fp32 copy and states live on the host.
struct MainParam {
    numel: u64,
    on_gpu: Option<ParamId>,
    vector: bool,
}

/// One buffer's optimizer: its main parameters and AdamW's two parameter groups (the matrices,
/// then the vectors), on the GPU unless offloaded to the host.
struct Part {
    main: Vec<MainParam>,
    placement: Placement,
}

enum Placement {
    Gpu([OptimizerState; 2]),
    /// `HybridDeviceOptimizer`: the stream its updated shards are copied back to the GPU on.
    Host {
        h2d_stream: u32,
    },
}

/// The first `HybridDeviceOptimizer`'s host-to-device stream under
/// `overlap_cpu_optimizer_d2h_h2d`; each later one (the experts') the next.
const FIRST_H2D_STREAM: u32 = 1;

/// The wrapper and its optimizers (the dense parameters', then the experts'); the buffers live
/// as long as the process.
pub(crate) struct MegatronDdp {
    parts: Vec<Part>,
}

/// A data-parallel group's size and this rank's place in it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DataParallelRank {
    pub(crate) size: u64,
    pub(crate) rank: u64,
}

/// The groups the buffers are reduced over: the dense parameters' data-parallel group, and
/// the experts' expert-data-parallel one where they are reduced apart.
#[derive(Clone, Copy, Debug)]
pub(crate) struct ReduceGroups {
    pub(crate) dense: DataParallelRank,
    pub(crate) experts: Option<DataParallelRank>,
}

impl MegatronDdp {
    /// `DistributedDataParallel(config, ddp_config, module)` over each model chunk's parameters
    /// in turn (one chunk, or one per virtual pipeline stage, each with its own buffers), then
    /// `get_megatron_optimizer` over all chunks: its main parameters, as this rank of the
    /// data-parallel group builds them, and of the expert-data-parallel one where the experts
    /// are reduced apart.
    pub(crate) fn wrap(
        t: &mut Tracer,
        chunks: &[ChunkParams],
        groups: ReduceGroups,
        optimizer: MegatronOptimizer,
    ) -> Self {
        let distributed_optimizer = optimizer.distributed;
        // `group_params_for_buffers`: experts apart when their `allreduce` is false.
        let groups: Vec<(Option<bool>, DataParallelRank)> = match groups.experts {
            Some(experts) => vec![(Some(false), groups.dense), (Some(true), experts)],
            None => vec![(None, groups.dense)],
        };
        let mut laid_out: Vec<Vec<(Vec<usize>, BufferLayout)>> = vec![Vec::new(); groups.len()];
        for chunk in chunks {
            for (g, &(expert, dp)) in groups.iter().enumerate() {
                let members: Vec<usize> = (0..chunk.params.len())
                    .filter(|&i| expert.is_none_or(|e| chunk.experts[i] == e))
                    .collect();
                let picked: Vec<ParamId> = members.iter().map(|&i| chunk.params[i]).collect();
                let shared = chunk
                    .shared_embedding
                    .and_then(|s| members.iter().position(|&i| i == s));
                let layout = Self::buffer(t, &picked, dp.size, distributed_optimizer, shared);
                laid_out[g].push((members, layout));
            }
        }
        // One optimizer per group, over every chunk's buffer of it.
        let parts = groups
            .iter()
            .zip(laid_out)
            .enumerate()
            .map(|(index, (&(_, dp), per_chunk))| {
                let buffers: Vec<(Vec<u64>, Vec<bool>, BufferLayout)> = per_chunk
                    .into_iter()
                    .zip(chunks)
                    .map(|((members, layout), chunk)| {
                        let vectors = members.iter().map(|&i| chunk.vectors[i]).collect();
                        let numels = members
                            .iter()
                            .map(|&i| t.numel(t.param(chunk.params[i])))
                            .collect();
                        (numels, vectors, layout)
                    })
                    .collect();
                Part::new(t, &buffers, dp, optimizer, FIRST_H2D_STREAM + index as u32)
            })
            .collect();
        MegatronDdp { parts }
    }

    /// A later model chunk's wrapper under the virtual pipeline: its hook drops each bf16
    /// gradient once added into its buffer; the first chunk's wrapper holds the one optimizer.
    pub(crate) fn gradient_hooks_only() -> Self {
        MegatronDdp { parts: Vec::new() }
    }

    /// One `_ParamAndGradBuffer` over `params`: its bf16 `param_data` (distributed optimizer),
    /// its fp32 `grad_data`, and the parameters moved into the first.
    fn buffer(
        t: &mut Tracer,
        params: &[ParamId],
        dp: u64,
        distributed_optimizer: bool,
        shared_embedding: Option<usize>,
    ) -> BufferLayout {
        let numels: Vec<u64> = params.iter().map(|&p| t.numel(t.param(p))).collect();
        let layout = BufferLayout::new(&numels, dp, distributed_optimizer, shared_embedding);
        let param_data = distributed_optimizer.then(|| {
            let data = t.empty_as(
                layout.numel,
                DType::BF16,
                Component::Weights,
                "param_data (bf16 parameter buffer)",
            );
            t.mark_persistent(data);
            data
        });
        let grad_data = t.empty_as(
            layout.numel,
            DType::F32,
            Component::Gradients,
            "grad_data (fp32 main_grad buffer)",
        );
        t.mark_persistent(grad_data);
        if let Some(data) = param_data {
            for &p in params.iter().rev() {
                t.param_into_view(p, data, "parameter in param_data");
            }
        }
        layout
    }
}

/// The optimizer `get_megatron_optimizer` builds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct MegatronOptimizer {
    /// `DistributedOptimizer`: the main parameters sharded over the data-parallel ranks.
    pub(crate) distributed: bool,
    /// `HybridDeviceOptimizer` with the whole optimizer on the host (the distributed optimizer
    /// only).
    pub(crate) cpu_offload: bool,
    /// `overlap_cpu_optimizer_d2h_h2d`: the offloaded optimizer's copies on side streams.
    pub(crate) overlap_copies: bool,
}

impl Part {
    /// A mixed-precision optimizer's main parameters over its buffers (`numels` and `vectors`
    /// of each buffer's parameters, in order, and its layout; one buffer per model chunk): all
    /// of them, or this data-parallel rank's shard of each, group by group, chunk by chunk;
    /// fp32 copies on the GPU, or, offloaded, the host copies of the model's parameters and
    /// then of the shards.
    fn new(
        t: &mut Tracer,
        buffers: &[(Vec<u64>, Vec<bool>, BufferLayout)],
        dp: DataParallelRank,
        optimizer: MegatronOptimizer,
        side_stream: u32,
    ) -> Self {
        // `_get_param_groups`: the default group (matrices) sorts before the wd_mult 0 one.
        let outer = std::mem::replace(&mut t.component, Component::OptimizerStates);
        if optimizer.cpu_offload {
            // The first HybridDeviceOptimizer, over the model's parameters.
            for vector in [false, true] {
                for (numels, vectors, _) in buffers {
                    for (&numel, _) in numels.iter().zip(vectors).filter(|&(_, &v)| v == vector) {
                        let clone = t.empty(numel, DType::BF16, "param.detach().clone() (to host)");
                        t.drop(clone);
                    }
                }
            }
        }
        let mut main = Vec::new();
        let mut add = |t: &mut Tracer, numel: u64, vector: bool| {
            let on_gpu = if optimizer.cpu_offload {
                let clone = t.empty(numel, DType::BF16, "shard.detach().clone() (to host)");
                t.drop(clone);
                None
            } else {
                let clone = t.empty(numel, DType::BF16, "shard_model_param.clone()");
                let p = t.parameter(numel, DType::F32, true, "fp32 main parameter");
                t.recategorize(t.param(p), Component::OptimizerStates);
                t.drop(clone);
                Some(p)
            };
            main.push(MainParam {
                numel,
                on_gpu,
                vector,
            });
        };
        for vector in [false, true] {
            for (numels, vectors, layout) in buffers {
                if optimizer.distributed {
                    for (i, numel) in layout.shard_parts(dp.size, dp.rank) {
                        if vectors[i] == vector {
                            add(t, numel, vector);
                        }
                    }
                } else {
                    for (i, &numel) in numels.iter().enumerate() {
                        if vectors[i] == vector {
                            add(t, numel, vector);
                        }
                    }
                }
            }
        }
        t.component = outer;
        let placement = if optimizer.cpu_offload {
            Placement::Host {
                h2d_stream: if optimizer.overlap_copies {
                    side_stream
                } else {
                    0
                },
            }
        } else {
            Placement::Gpu([
                OptimizerState::new(Optimizer::AdamW),
                OptimizerState::new(Optimizer::AdamW),
            ])
        };
        Part { main, placement }
    }
}

impl MegatronDdp {
    /// Host bytes of the offloaded optimizers (`None` where none is): each shard's fp32 main
    /// parameter, AdamW's two fp32 states and its pinned fp32 gradient, 4 bytes an element
    /// each. The first `HybridDeviceOptimizer`'s copies of the model's parameters, kept until
    /// Python's cycle collector frees it, are not counted.
    pub(crate) fn host_bytes(&self) -> Option<u64> {
        let offloaded: Vec<u64> = self
            .parts
            .iter()
            .filter(|p| matches!(p.placement, Placement::Host { .. }))
            .map(|p| p.main.iter().map(|m| m.numel).sum())
            .collect();
        (!offloaded.is_empty()).then(|| 4 * 4 * offloaded.iter().sum::<u64>())
    }

    /// The hook on `param`'s `AccumulateGrad`: `param.main_grad.add_(param.grad.data);
    /// param.grad = None`.
    pub(crate) fn grad_accumulated(&mut self, t: &mut Tracer, param: ParamId) {
        if let Some(grad) = t.params[param].grad.take() {
            t.drop(grad);
        }
    }

    /// `optimizer.step()`: the norm and clip of the main gradients, AdamW per group, the copy
    /// back into the model's parameters (in place).
    pub(crate) fn step(&mut self, t: &mut Tracer) {
        let outer = std::mem::replace(&mut t.component, Component::OptimizerTemporaries);
        // `local_multi_tensor_l2_norm`: `[torch.norm(g) for g in grads]`, then their norm.
        let main: Vec<&MainParam> = self.parts.iter().flat_map(|p| &p.main).collect();
        let norms: Vec<T> = main
            .iter()
            .map(|_| t.empty(1, DType::F32, "torch.norm(main_grad)"))
            .collect();
        let total = t.empty(1, DType::F32, "l2 norm (device)");
        let squared = t.empty(1, DType::F32, "grad_norm ** 2");
        t.drop(total);
        for norm in norms.into_iter().rev() {
            t.drop(norm);
        }
        t.drop(squared);
        // `clip_grad_by_total_norm_fp32` with a float coefficient below 1.
        let overflow = t.empty(1, DType::I32, "dummy_overflow_buf");
        for m in &main {
            let scaled = t.empty(m.numel, DType::F32, "main_grad * clip_coeff");
            t.drop(scaled);
        }
        t.drop(overflow);
        t.component = outer;
        for part in &mut self.parts {
            match &mut part.placement {
                Placement::Gpu(optimizers) => {
                    for (group, vector) in [false, true].into_iter().enumerate() {
                        let params: Vec<ParamId> = part
                            .main
                            .iter()
                            .filter(|m| m.vector == vector)
                            .filter_map(|m| m.on_gpu)
                            .collect();
                        if !params.is_empty() {
                            optimizers[group].step(t, &params);
                        }
                    }
                }
                Placement::Host { h2d_stream } => {
                    let outer =
                        std::mem::replace(&mut t.component, Component::OptimizerTemporaries);
                    t.mem.stream = *h2d_stream;
                    for m in &part.main {
                        let cast = t.empty(
                            m.numel,
                            DType::F32,
                            "fp32 shard from the host (cast on the GPU)",
                        );
                        t.drop(cast);
                    }
                    t.mem.stream = 0;
                    t.component = outer;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Without the distributed optimizer the buffer is the parameters back to back, last
    /// first; with it each parameter starts on 64 elements and the end splits over dp.
    #[test]
    fn the_buffer_lays_parameters_out_last_first_with_megatrons_padding() {
        let numels = [100, 7, 300];
        let plain = BufferLayout::new(&numels, 4, false, None);
        assert_eq!(plain.starts, vec![307, 300, 0]);
        assert_eq!(plain.numel, 407);
        let sharded = BufferLayout::new(&numels, 4, true, None);
        // 300 at 0, 7 at 320 (300 rounded up to 64), 100 at 384 (327 rounded up); 484 ends
        // on lcm(4, 128) = 128: 512.
        assert_eq!(sharded.starts, vec![384, 320, 0]);
        assert_eq!(sharded.numel, 512);
        let odd = BufferLayout::new(&numels, 3, true, None);
        assert_eq!(odd.numel, 768, "lcm(3, 128) = 384");
    }

    /// Rank r owns `numel / dp` elements; the parts of the parameters in it add up to them
    /// less the padding inside, and every rank's parts cover every parameter once.
    #[test]
    fn shards_split_the_buffer_evenly_and_cover_every_parameter() {
        let numels = [1000, 64, 4096, 10, 333];
        let dp = 8;
        let layout = BufferLayout::new(&numels, dp, true, None);
        assert_eq!(layout.numel % dp, 0);
        let mut covered = [0u64; 5];
        for rank in 0..dp {
            let parts = layout.shard_parts(dp, rank);
            let held: u64 = parts.iter().map(|&(_, n)| n).sum();
            assert!(held <= layout.numel / dp);
            for (i, n) in parts {
                covered[i] += n;
            }
        }
        assert_eq!(covered.to_vec(), numels.to_vec());
        // Rank 0 starts with the last parameter (the buffer's first).
        assert_eq!(layout.shard_parts(dp, 0)[0].0, 4);
    }

    /// A shared embedding gets a bucket of its own under the distributed optimizer: the
    /// buckets before and after it end on `lcm(dp, 128)`, and every rank holds `1/dp` of it.
    #[test]
    fn a_shared_embedding_is_a_bucket_of_its_own() {
        // The first stage: the embedding (index 0) is the buffer's last parameter.
        let numels = [1000, 300, 7];
        let first = BufferLayout::new(&numels, 2, true, Some(0));
        // 7 at 0, 300 at 64; that bucket ends at 364, padded to 384; the embedding at 384,
        // ending at 1384, padded to 1408.
        assert_eq!(first.starts, vec![384, 64, 0]);
        assert_eq!(first.buckets, vec![(0, 384), (384, 1408)]);
        assert_eq!(first.numel, 1408);
        // Each rank holds half of its bucket: 512 elements, the padding in the second half.
        let embedding = |rank| -> u64 {
            first
                .shard_parts(2, rank)
                .iter()
                .filter(|&&(i, _)| i == 0)
                .map(|&(_, n)| n)
                .sum()
        };
        assert_eq!([embedding(0), embedding(1)], [512, 488]);
        // The last stage: its copy (the last parameter) is the buffer's first.
        let last = BufferLayout::new(&[7, 300, 1000], 2, true, Some(2));
        assert_eq!(last.starts, vec![1344, 1024, 0]);
        assert_eq!(last.buckets, vec![(0, 1024), (1024, 1408)]);
        // Without the distributed optimizer the buffer is one bucket, unpadded.
        let plain = BufferLayout::new(&numels, 2, false, Some(0));
        assert_eq!(plain.buckets, vec![(0, 1307)]);
    }

    #[test]
    fn lcm_of_data_parallel_sizes_and_128() {
        assert_eq!(lcm(8, 128), 128);
        assert_eq!(lcm(3, 128), 384);
        assert_eq!(lcm(256, 128), 256);
        assert_eq!(lcm(1, 128), 128);
    }
}
