//! FSDP1 (`torch.distributed.fsdp.FullyShardedDataParallel`, torch 2.11) as rank 0 sees it,
//! wrapped with a transformer auto-wrap policy: one flat parameter per decoder layer and one
//! for the root (embedding, final norm, head), built from a meta model whose `param_init_fn`
//! materialises each module on the GPU, as accelerate's `fsdp_version: 1` and older verl run.
//!
//! After `_flat_param.py` and `_runtime_utils.py`:
//! - construction, unit by unit (layers first): each module's parameters are allocated in the
//!   storage dtype, `torch.cat` into the flat parameter, rank 0's chunk cloned as its shard,
//!   then the flat storage freed and the per-parameter ones (without `use_orig_params`, only
//!   once the root is wrapped); under CPU offload the shard moves to the host. With `use_orig_params` each parameter starts at a multiple of 16 bytes of the
//!   compute dtype and the flat parameter is padded to a multiple of the shard group.
//! - lazy init at the first forward, root first: `_mp_shard`, `_full_param_padded` and (with
//!   a mixed-precision policy) `_full_prec_full_param_padded` are each allocated and freed.
//! - unshard: with a policy, the shard is cast into `_mp_shard` on the pre-unshard stream;
//!   `_full_param_padded` (the whole unit, compute dtype) is allocated on the unshard stream,
//!   the all-gather writes into it, the parameters are views of it, and `_mp_shard` is freed.
//! - forward: the root unshards before the first layer and is never resharded after its
//!   forward; layers reshard after theirs under `FULL_SHARD`, keep their parameters until
//!   backward under `SHARD_GRAD_OP`.
//! - backward: a unit's pre-backward hook unshards it and, with `BACKWARD_PRE`, the unit whose
//!   forward finished before it. Its post-backward hook (on the flat parameter's
//!   `AccumulateGrad`) finds the views' gradients concatenated into one flat gradient on the
//!   unshard stream (their views' stream), frees the unit's parameters (then `BACKWARD_POST`
//!   prefetches), and on the post-backward stream casts the flat gradient to the reduce dtype,
//!   reduce-scatters into a shard-sized output and casts that to the storage dtype: the shard's
//!   gradient. Everything else is freed when the hook returns. A tied embedding's two
//!   gradients are summed out of place on the unshard stream.
//! - optimizer: the flat shards, or with `use_orig_params` each parameter's slice of rank 0's
//!   shard; `zero_grad` then frees nothing, the next root pre-forward drops the flat gradients.

use super::{REDUCE_SCATTER_STREAM, Unit};
use crate::arch::{Architecture, Head};
use crate::dtype::DType;
use crate::sim::engine::component::Component;
use crate::sim::engine::tracer::{ParamId, T, Tracer};
use crate::spec::{BackwardPrefetch, Parallel};

/// FSDP1's unshard stream: `_full_param_padded`, and the flat gradients its views produce.
const UNSHARD_STREAM: u32 = 1;
/// FSDP1's post-backward stream: reduce-scatter buffers and the sharded gradients.
const POST_BACKWARD_STREAM: u32 = REDUCE_SCATTER_STREAM;
/// FSDP1's pre-unshard stream: the low-precision copy of a shard before its all-gather.
const PRE_UNSHARD_STREAM: u32 = 3;
/// HSDP's all-reduce stream: the replicas' reduction and what follows it.
const ALL_REDUCE_STREAM: u32 = 4;

struct FlatUnit {
    /// The original parameters: views of `padded` (registered without storage of their own).
    params: Vec<ParamId>,
    /// The flat parameter's numel, padding included (`_unpadded_unsharded_size`).
    numel: u64,
    /// Rank 0's shard of it.
    shard: ParamId,
    shard_numel: u64,
    /// `_full_param_padded`: shard numel × ranks, in the compute dtype; storage only while
    /// unsharded.
    padded: T,
    /// With `use_orig_params`: each parameter's slice of the shard (those that have one).
    slices: Vec<ParamId>,
    /// With `use_orig_params`: the shard's gradient, which the slices' gradients view, until
    /// the next root pre-forward.
    flat_grad: Option<T>,
    /// Under CPU offload: the shard's gradient on the GPU, until the final callback.
    offloaded_grad: Option<T>,
    unsharded: bool,
    backward_started: bool,
    backward_done: bool,
}

pub(crate) struct Fsdp1 {
    /// Ranks that shard one copy.
    ranks: u64,
    /// The flat parameters' storage dtype.
    dtype: DType,
    /// `MixedPrecision.param_dtype` where it differs from the storage.
    low: Option<DType>,
    /// What gradients are reduced in.
    reduce_dtype: DType,
    free_after_forward: bool,
    offload: bool,
    use_orig_params: bool,
    hybrid: bool,
    prefetch: BackwardPrefetch,
    /// Decoder layers in order, then the root.
    units: Vec<FlatUnit>,
    lazy_init_done: bool,
    post_forward_order: Vec<usize>,
}

impl Fsdp1 {
    /// `FullyShardedDataParallel(model, auto_wrap_policy=transformer_auto_wrap_policy, ...)` on
    /// a model whose parameters were registered without storage from `first` on, in
    /// `arch.parameters(head)` order and the compute dtype.
    pub(crate) fn wrap(
        t: &mut Tracer,
        arch: &Architecture,
        head: Head,
        first: ParamId,
        dtype: DType,
        parallel: &Parallel,
    ) -> Fsdp1 {
        let ranks = parallel.shard_size;
        let mp = parallel.mixed_precision;
        let compute = mp.map_or(dtype, |m| m.param_dtype);
        let low = (compute != dtype).then_some(compute);
        let use_orig_params = parallel.fsdp1.use_orig_params;
        let layers = arch.layers as usize;
        let mut members: Vec<Vec<ParamId>> = vec![Vec::new(); layers + 1];
        for (i, p) in arch.parameters(head).iter().enumerate() {
            members[p.layer.map_or(layers, |l| l as usize)].push(first + i);
        }
        let tied = arch.tie_word_embeddings && head == Head::CausalLm;
        let outer = std::mem::replace(&mut t.component, Component::Weights);
        let mut meta_buffers = Vec::new();
        // Without `use_orig_params` the modules keep their materialised parameters until the
        // root's wrapping returns (measured: every unit's, on top of the root's flat copy).
        let mut originals = Vec::new();
        let mut units = Vec::with_capacity(layers + 1);
        for (u, params) in members.into_iter().enumerate() {
            let root = u == layers;
            // `param_init_fn`: each module's parameters on the GPU (the root's rotary buffers
            // too; a tied head is made and re-tied to the embedding).
            let mut made: Vec<T> = params
                .iter()
                .map(|&p| {
                    let numel = t.numel(t.param(p));
                    t.empty(numel, dtype, "parameter (param_init_fn to_empty)")
                })
                .collect();
            if root {
                meta_buffers = arch
                    .buffers()
                    .into_iter()
                    .map(|(n, d)| t.empty(n, d, "rotary inv_freq (param_init_fn)"))
                    .collect();
                if tied {
                    let numel = t.numel(t.param(params[0]));
                    let again = t.empty(numel, dtype, "tied lm_head (to_empty, re-tied)");
                    t.drop(again);
                }
            }
            let align = if use_orig_params {
                16 / compute.bytes()
            } else {
                1
            };
            let sizes: Vec<u64> = params.iter().map(|&p| t.numel(t.param(p))).collect();
            let (numel, starts) = flat_layout(&sizes, align, ranks, use_orig_params);
            let shard_numel = numel.div_ceil(ranks);
            let flat = t.empty(numel, dtype, "flat parameter (torch.cat)");
            let shard = t.parameter(shard_numel, dtype, !use_orig_params, "FSDP1 flat shard");
            t.drop(flat);
            if use_orig_params {
                t.drop_all(&made);
            } else {
                originals.append(&mut made);
            }
            if parallel.offload_params {
                t.offload(shard);
            }
            let padded = t.storageless(shard_numel * ranks, compute, "FSDP1 _full_param_padded");
            for &p in &params {
                t.param_into_view(p, padded, "parameter (view of _full_param_padded)");
            }
            if tied && root {
                t.params[params[0]].grad_sum_stream = Some(UNSHARD_STREAM);
            }
            // Rank 0's chunk: the parameters (or their heads) in [0, shard numel).
            let slices = if use_orig_params {
                let shard_tensor = t.param(shard);
                sizes
                    .iter()
                    .zip(&starts)
                    .filter_map(|(&n, &start)| {
                        let inside = (start + n).min(shard_numel).saturating_sub(start);
                        (inside > 0).then(|| {
                            let slice = t.parameter_deferred(inside, dtype, true, "shard slice");
                            t.param_into_view(slice, shard_tensor, "parameter (shard slice)");
                            slice
                        })
                    })
                    .collect()
            } else {
                Vec::new()
            };
            units.push(FlatUnit {
                params,
                numel,
                shard,
                shard_numel,
                padded,
                slices,
                flat_grad: None,
                offloaded_grad: None,
                unsharded: false,
                backward_started: false,
                backward_done: false,
            });
        }
        t.drop_all(&originals);
        // The harness then builds the rotary module again on the GPU.
        t.persistent_buffers(&arch.buffers(), "rotary inv_freq");
        t.drop_all(&meta_buffers);
        t.component = outer;
        Fsdp1 {
            ranks,
            dtype,
            low,
            reduce_dtype: mp.and_then(|m| m.reduce_dtype).unwrap_or(compute),
            free_after_forward: parallel.reshard_after_forward,
            offload: parallel.offload_params,
            use_orig_params,
            hybrid: parallel.shard_size < parallel.world_size,
            prefetch: parallel.fsdp1.backward_prefetch,
            units,
            lazy_init_done: false,
            post_forward_order: Vec::new(),
        }
    }

    fn root(&self) -> usize {
        self.units.len() - 1
    }

    /// What the optimizer steps on the GPU: the flat shards, or their parameters' slices;
    /// nothing under CPU offload.
    pub(crate) fn device_params(&self) -> Vec<ParamId> {
        if self.offload {
            return Vec::new();
        }
        if self.use_orig_params {
            return self.units.iter().flat_map(|u| u.slices.clone()).collect();
        }
        self.units.iter().map(|u| u.shard).collect()
    }

    /// The flat shards: what `model.cpu()` and `model.cuda()` move.
    pub(crate) fn shards(&self) -> Vec<ParamId> {
        self.units.iter().map(|u| u.shard).collect()
    }

    /// Bytes on the host: shards not on the device (and under CPU offload each one's pinned
    /// `_cpu_grad`).
    pub(crate) fn host_bytes(&self, t: &Tracer) -> u64 {
        let away: u64 = self
            .units
            .iter()
            .filter(|u| !t.is_materialized(u.shard))
            .map(|u| u.shard_numel * self.dtype.bytes())
            .sum();
        if self.offload { 2 * away } else { away }
    }

    /// `_lazy_init` at the first forward: each handle's buffers are made and freed, root
    /// first.
    fn lazy_init(&mut self, t: &mut Tracer) {
        self.lazy_init_done = true;
        let outer = std::mem::replace(&mut t.component, Component::Communication);
        let root = self.root();
        for u in std::iter::once(root).chain(0..root) {
            let (s, np) = (
                self.units[u].shard_numel,
                self.units[u].shard_numel * self.ranks,
            );
            if let Some(low) = self.low {
                let mp_shard = t.empty(s, low, "FSDP1 _mp_shard (lazy init)");
                t.drop(mp_shard);
            }
            let padded = t.empty(
                np,
                self.low.unwrap_or(self.dtype),
                "FSDP1 _full_param_padded (lazy init)",
            );
            t.drop(padded);
            if self.low.is_some() {
                let full = t.empty(
                    np,
                    self.dtype,
                    "FSDP1 _full_prec_full_param_padded (lazy init)",
                );
                t.drop(full);
            }
        }
        t.component = outer;
    }

    /// `pre_unshard` on the pre-unshard stream: the shard copied to the device under offload
    /// and cast to the compute dtype under a policy; what the all-gather reads.
    fn pre_unshard(&self, t: &mut Tracer, u: usize) -> Vec<T> {
        let s = self.units[u].shard_numel;
        let stream = std::mem::replace(&mut t.mem.stream, PRE_UNSHARD_STREAM);
        let mut held = Vec::new();
        if let Some(low) = self.low {
            held.push(t.empty(s, low, "FSDP1 _mp_shard"));
            if self.offload {
                let copy = t.empty(s, self.dtype, "FSDP1 shard copied to the device");
                t.drop(copy);
            }
        } else if self.offload {
            held.push(t.empty(s, self.dtype, "FSDP1 shard copied to the device"));
        }
        t.mem.stream = stream;
        held
    }

    fn unshard(&mut self, t: &mut Tracer, u: usize) {
        if self.units[u].unsharded {
            return;
        }
        let outer = std::mem::replace(&mut t.component, Component::Communication);
        let held = self.pre_unshard(t, u);
        t.component = Component::Weights;
        let stream = std::mem::replace(&mut t.mem.stream, UNSHARD_STREAM);
        t.alloc_storage(self.units[u].padded);
        t.mem.stream = stream;
        t.drop_all(&held);
        t.component = outer;
        self.units[u].unsharded = true;
    }

    fn reshard(&mut self, t: &mut Tracer, u: usize) {
        if self.units[u].unsharded {
            t.free_storage(self.units[u].padded);
            self.units[u].unsharded = false;
        }
    }

    /// `_reset_flat_param_grad_info_if_needed`: the flat gradients `zero_grad` left.
    fn reset_flat_grads(&mut self, t: &mut Tracer) {
        for unit in &mut self.units {
            if let Some(g) = unit.flat_grad.take() {
                t.drop(g);
            }
        }
    }

    /// A unit's forward pre-hook; the embedding and the head are the root's.
    pub(crate) fn unit_pre_forward(&mut self, t: &mut Tracer, unit: Unit) {
        let u = match unit {
            Unit::Layer(layer) => layer,
            Unit::Root => {
                if !self.lazy_init_done {
                    self.lazy_init(t);
                }
                self.reset_flat_grads(t);
                self.root()
            }
            Unit::Embedding | Unit::Head => return,
        };
        self.unshard(t, u);
        t.unit = Some(u as u32);
    }

    /// A unit's forward post-hook: a layer reshards under `FULL_SHARD`; the root never does.
    pub(crate) fn unit_post_forward(&mut self, t: &mut Tracer, unit: Unit) {
        let u = match unit {
            Unit::Layer(layer) => layer,
            Unit::Root => self.root(),
            Unit::Embedding | Unit::Head => return,
        };
        if u != self.root() && self.free_after_forward {
            self.reshard(t, u);
        }
        self.post_forward_order.push(u);
        t.unit = (u != self.root()).then_some(self.root() as u32);
    }

    /// The unit whose forward finished before `u`'s: what a backward prefetch gathers.
    fn before(&self, u: usize) -> Option<usize> {
        let index = self.post_forward_order.iter().rposition(|&x| x == u)?;
        index.checked_sub(1).map(|i| self.post_forward_order[i])
    }

    /// The pre-backward hook: unshard, then with `BACKWARD_PRE` the unit before.
    pub(crate) fn pre_backward(&mut self, t: &mut Tracer, unit: u32) {
        let u = unit as usize;
        if self.units[u].backward_started {
            return;
        }
        self.units[u].backward_started = true;
        if u == self.root() {
            self.reset_flat_grads(t);
            if self.offload {
                // The pre-unshard is not skipped under offload, though the root is gathered.
                let held = self.pre_unshard(t, u);
                t.drop_all(&held);
            }
        }
        self.unshard(t, u);
        if self.prefetch == BackwardPrefetch::Pre
            && let Some(target) = self.before(u)
        {
            self.unshard(t, target);
        }
    }

    /// The post-backward hook, once the unit's parameters all have gradients.
    pub(crate) fn post_backward(&mut self, t: &mut Tracer, unit: u32) {
        let u = unit as usize;
        self.units[u].backward_done = true;
        let grads: Vec<T> = self.units[u]
            .params
            .clone()
            .into_iter()
            .filter_map(|p| t.params[p].grad.take())
            .collect();
        let outer = std::mem::replace(&mut t.component, Component::Gradients);
        let compute = self.low.unwrap_or(self.dtype);
        let (n, s) = (self.units[u].numel, self.units[u].shard_numel);
        let flat = (!grads.is_empty()).then(|| {
            t.mem.stream = UNSHARD_STREAM;
            let flat = t.empty(
                n,
                compute,
                "FSDP1 flat gradient (cat of the views' gradients)",
            );
            t.mem.stream = 0;
            t.drop_all(&grads);
            flat
        });
        self.reshard(t, u);
        if self.prefetch == BackwardPrefetch::Post
            && let Some(target) = self.before(u)
        {
            self.unshard(t, target);
            t.component = Component::Gradients;
        }
        let Some(flat) = flat else {
            t.component = outer;
            return;
        };
        t.mem.stream = POST_BACKWARD_STREAM;
        let mut temporaries = Vec::new();
        if compute != self.reduce_dtype {
            temporaries.push(t.empty(n, self.reduce_dtype, "FSDP1 gradient.to(reduce_dtype)"));
        }
        if !self.use_orig_params && n % self.ranks != 0 {
            temporaries.push(t.empty(s * self.ranks, self.reduce_dtype, "FSDP1 padded gradient"));
        }
        let output = t.empty(s, self.reduce_dtype, "FSDP1 reduce-scatter output");
        if self.hybrid {
            t.mem.stream = ALL_REDUCE_STREAM;
        }
        let grad = if self.reduce_dtype == self.dtype {
            output
        } else {
            let cast = t.empty(
                s,
                self.dtype,
                "FSDP1 sharded gradient (to the storage dtype)",
            );
            t.drop(output);
            cast
        };
        t.mem.stream = 0;
        t.drop_all(&temporaries);
        t.drop(flat);
        let unit = &mut self.units[u];
        if self.offload {
            unit.offloaded_grad = Some(grad);
        } else if self.use_orig_params {
            for &slice in &unit.slices {
                let numel = t.numel(t.param(slice));
                let view = t.view(grad, numel, "parameter slice's gradient");
                t.params[slice].grad = Some(view);
            }
            unit.flat_grad = Some(grad);
        } else {
            t.params[unit.shard].grad = Some(grad);
        }
        t.component = outer;
    }

    /// `_post_backward_final_callback`: units whose hook did not run get it, and under offload
    /// the GPU gradients go (the optimizer steps the host's).
    pub(crate) fn finish_backward(&mut self, t: &mut Tracer) {
        for u in 0..self.units.len() {
            if self.units[u].backward_started && !self.units[u].backward_done {
                self.post_backward(t, u as u32);
            }
            self.reshard(t, u);
            let unit = &mut self.units[u];
            unit.backward_started = false;
            unit.backward_done = false;
            if let Some(g) = unit.offloaded_grad.take() {
                t.drop(g);
            }
        }
        self.post_forward_order.clear();
    }
}

/// The flat parameter of parameters of `sizes`: its numel and where each starts. With
/// `use_orig_params` each starts at a multiple of `align` elements and the whole is padded to a
/// multiple of `ranks`.
fn flat_layout(sizes: &[u64], align: u64, ranks: u64, use_orig_params: bool) -> (u64, Vec<u64>) {
    let mut starts = Vec::with_capacity(sizes.len());
    let mut at = 0u64;
    for &n in sizes {
        at = at.next_multiple_of(align);
        starts.push(at);
        at += n;
    }
    if use_orig_params {
        at = at.next_multiple_of(ranks);
    }
    (at, starts)
}

#[cfg(test)]
mod tests {
    use super::flat_layout;

    #[test]
    fn orig_params_are_aligned_and_the_whole_padded_to_the_ranks() {
        // 16 bytes of bf16: 8 elements.
        assert_eq!(flat_layout(&[3, 5, 8], 8, 6, true), (24, vec![0, 8, 16]));
        assert_eq!(flat_layout(&[3, 5, 8], 1, 6, false), (16, vec![0, 3, 8]));
    }
}
