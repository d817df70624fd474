//! FSDP2 (`torch.distributed.fsdp.fully_shard`, torch 2.11) as one rank sees it: every
//! decoder layer is a unit, then the root (embedding, final norm, head). Each parameter lives
//! as its local shard; a unit's full parameters exist only between its unshard and its
//! reshard, and its gradients leave backward reduce-scattered into one flat shard.
//!
//! What each hook allocates, after `_fsdp_param_group.py` and `_fsdp_collectives.py`
//! (without a `MixedPrecisionPolicy` a shard is its own all-gather input; with one, see
//! `all_gather` and `post_backward`):
//! - unshard: `all_gather_output` (the unit's shards of every rank, flat) on the all-gather
//!   copy-in stream; then, on the default stream, each parameter's unsharded storage
//!   (`alloc_all_gather_outputs`, in parameter order) for the copy-out. In forward the output
//!   is kept until the next unit's copy-out (`comm_ctx.all_gather_state`, to overlap the next
//!   all-gather) and the last one until the root's post-forward; in backward it is freed at
//!   once.
//! - forward: the root unshards first; each unit unshards in its pre-forward hook and, with
//!   `reshard_after_forward`, frees its unsharded storages in its post-forward hook. The root
//!   reshards too: `fully_shard(model, reshard_after_forward=...)` given explicitly, as
//!   training scripts do, overrides FSDP2's keep-the-root default, so backward gathers the
//!   root again first. Under checkpointing the recomputation runs no hook.
//! - backward: a unit's pre-backward hook unshards it (a no-op when still unsharded) and
//!   prefetches the all-gather of the unit that finished its forward before it; its
//!   post-backward hook takes the unsharded gradients, reshards, frees the previous unit's
//!   `reduce_scatter_input`, allocates its own (default stream, the unit's full gradient size),
//!   copies the gradients in and frees them, then allocates the reduce-scatter output on the
//!   reduce-scatter stream: the sharded gradients are views of it, so it lives until
//!   `zero_grad` drops the last of them. The last `reduce_scatter_input` is freed at the end of
//!   backward. HSDP all-reduces that output in place.
//! - `CPUOffloadPolicy`: shards, sharded gradients and the optimizer step stay on the host;
//!   an unshard first copies each shard to the device (copy-in stream).
//!
//! Shards are padded to a multiple of the shard group in dim 0; unsharded storages are
//! simulated at the parameter's own size (equal for the even shapes of the catalog models).

use super::{ALL_GATHER_COPY_IN_STREAM, REDUCE_SCATTER_STREAM, Unit};
use crate::arch::{Architecture, Head};
use crate::dtype::DType;
use crate::sim::engine::component::Component;
use crate::sim::engine::tracer::{ParamId, T, Tracer};
use crate::spec::Parallel;

struct ShardedUnit {
    /// The unsharded parameters the model computes with (registered without storage).
    params: Vec<ParamId>,
    /// Their local shards, in the same order: what the optimizer steps.
    shards: Vec<ParamId>,
    unsharded: bool,
    /// Where this backward is with it.
    backward: UnitBackward,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum UnitBackward {
    NotReached,
    Running,
    Done,
}

pub(crate) struct Fsdp {
    /// Ranks that shard one copy (the shard group).
    ranks: u64,
    reshard_after_forward: bool,
    offload: bool,
    /// The shards' dtype (the parameters' storage).
    dtype: DType,
    /// `MixedPrecisionPolicy`: what the shards are cast to before the all-gather (the
    /// unsharded parameters' dtype), and what gradients are reduced in; `None`: the storage's.
    param_dtype: Option<DType>,
    reduce_dtype: Option<DType>,
    /// Decoder layers in order, then the root.
    units: Vec<ShardedUnit>,
    /// The last forward all-gather output, kept until the next copy-out.
    all_gather_state: Option<T>,
    /// A backward prefetch: the unit and its all-gather output, waiting for its copy-out.
    prefetched: Option<(usize, T)>,
    /// The last `reduce_scatter_input`, freed by the next reduce-scatter.
    reduce_scatter_state: Option<T>,
    /// Units in the order their forward finished (`comm_ctx.post_forward_order`).
    post_forward_order: Vec<usize>,
}

impl Fsdp {
    /// `fully_shard` each decoder layer, then the root, on a model whose parameters were
    /// registered without storage (built on the meta device) from `first` on, in
    /// `arch.parameters(head)` order; then `to_empty(device="cuda")`: each parameter's local
    /// shard is allocated, in that order.
    pub(crate) fn shard(
        t: &mut Tracer,
        arch: &Architecture,
        head: Head,
        first: ParamId,
        dtype: DType,
        parallel: &Parallel,
    ) -> Fsdp {
        let ranks = parallel.shard_size;
        let layers = arch.layers as usize;
        let mut units: Vec<ShardedUnit> = (0..=layers)
            .map(|_| ShardedUnit {
                params: Vec::new(),
                shards: Vec::new(),
                unsharded: false,
                backward: UnitBackward::NotReached,
            })
            .collect();
        for (i, p) in arch.parameters(head).iter().enumerate() {
            let unit = p.layer.map_or(layers, |l| l as usize);
            let rows = p.rows.div_ceil(ranks);
            let shard = if parallel.offload_params {
                // On the host: a handle without device storage.
                t.parameter_deferred(rows * p.cols, dtype, false, "FSDP2 shard (host)")
            } else {
                t.parameter(rows * p.cols, dtype, false, "FSDP2 sharded parameter")
            };
            if p.cols > 1 {
                t.set_matrix(shard, rows, p.cols);
            }
            units[unit].params.push(first + i);
            units[unit].shards.push(shard);
        }
        // `to_empty` reaches the meta buffers after the parameters, and the tied `lm_head`
        // last: its shard is made again and dropped (the tie holds the embedding's).
        let meta_buffers: Vec<T> = arch
            .buffers()
            .into_iter()
            .map(|(n, d)| t.empty_as(n, d, Component::Weights, "rotary inv_freq (meta, to_empty)"))
            .collect();
        if arch.tie_word_embeddings && head == Head::CausalLm && !parallel.offload_params {
            let embed = units[layers].shards[0];
            let numel = t.numel(t.param(embed));
            let copy = t.empty_as(
                numel,
                dtype,
                Component::Weights,
                "tied lm_head shard (to_empty)",
            );
            t.drop(copy);
        }
        // The harness then builds the rotary module again on the GPU.
        t.persistent_buffers(&arch.buffers(), "rotary inv_freq");
        t.drop_all(&meta_buffers);
        let mp = parallel.mixed_precision;
        Fsdp {
            ranks,
            reshard_after_forward: parallel.reshard_after_forward,
            offload: parallel.offload_params,
            dtype,
            param_dtype: mp.map(|m| m.param_dtype).filter(|&d| d != dtype),
            reduce_dtype: mp.and_then(|m| m.reduce_dtype),
            units,
            all_gather_state: None,
            prefetched: None,
            reduce_scatter_state: None,
            post_forward_order: Vec::new(),
        }
    }

    /// The root's unit id (the units before it are the decoder layers).
    pub(crate) fn root(&self) -> u32 {
        (self.units.len() - 1) as u32
    }

    /// The id of a unit, as nodes recorded in its forward carry it.
    pub(crate) fn unit_index(&self, unit: Unit) -> u32 {
        match unit {
            Unit::Layer(layer) => layer as u32,
            Unit::Root => self.root(),
        }
    }

    /// The shards the optimizer steps (none on the device under CPU offload), in parameter
    /// order.
    pub(crate) fn device_shards(&self) -> Vec<ParamId> {
        if self.offload {
            return Vec::new();
        }
        let mut all: Vec<ParamId> = self.units.iter().flat_map(|u| u.shards.clone()).collect();
        all.sort_unstable();
        all
    }

    /// Shard bytes held on the host (CPU offload).
    pub(crate) fn host_bytes(&self, t: &Tracer) -> u64 {
        if !self.offload {
            return 0;
        }
        self.units
            .iter()
            .flat_map(|u| &u.shards)
            .map(|&s| t.bytes(t.param(s)))
            .sum()
    }

    fn shard_numel(&self, t: &Tracer, unit: usize) -> u64 {
        self.units[unit]
            .shards
            .iter()
            .map(|&s| t.numel(t.param(s)))
            .sum()
    }

    /// `foreach_all_gather`, on the copy-in stream: the all-gather inputs, then the output
    /// buffer in the unsharded dtype; the inputs go when it returns. Under CPU offload each
    /// shard is copied to the GPU (and cast to `param_dtype`, the copy freed); under a
    /// mixed-precision policy alone the shards are cast together into one flat buffer.
    fn all_gather(&self, t: &mut Tracer, unit: usize) -> T {
        let outer = std::mem::replace(&mut t.component, Component::Communication);
        t.mem.stream = ALL_GATHER_COPY_IN_STREAM;
        let mut inputs: Vec<T> = Vec::new();
        if self.offload {
            for &s in &self.units[unit].shards {
                let n = t.numel(t.param(s));
                let copy = t.empty(n, self.dtype, "FSDP2 shard copied to the GPU");
                match self.param_dtype {
                    Some(low) => {
                        inputs.push(t.empty(n, low, "FSDP2 shard.to(param_dtype)"));
                        t.drop(copy);
                    }
                    None => inputs.push(copy),
                }
            }
        } else if let Some(low) = self.param_dtype {
            let n = self.shard_numel(t, unit);
            inputs.push(t.empty(
                n,
                low,
                "FSDP2 all-gather input (shards cast to param_dtype)",
            ));
        }
        let numel = self.shard_numel(t, unit) * self.ranks;
        let dtype = self.param_dtype.unwrap_or(self.dtype);
        let output = t.empty(numel, dtype, "FSDP2 all_gather_output");
        t.drop_all(&inputs);
        t.mem.stream = 0;
        t.component = outer;
        output
    }

    /// `unshard` then `wait_for_unshard`.
    fn unshard(&mut self, t: &mut Tracer, unit: usize, forward: bool) {
        if self.units[unit].unsharded {
            return;
        }
        let output = match self.prefetched.take() {
            Some((u, output)) if u == unit => output,
            other => {
                self.prefetched = other;
                self.all_gather(t, unit)
            }
        };
        let outer = std::mem::replace(&mut t.component, Component::Weights);
        for &p in &self.units[unit].params {
            t.materialize(p);
        }
        t.component = outer;
        // The previous forward all-gather output goes once this copy-out is queued.
        if forward && let Some(previous) = self.all_gather_state.take() {
            t.drop(previous);
        }
        if forward && self.ranks > 1 {
            self.all_gather_state = Some(output);
        } else {
            t.drop(output);
        }
        self.units[unit].unsharded = true;
    }

    fn reshard(&mut self, t: &mut Tracer, unit: usize) {
        if !self.units[unit].unsharded {
            return;
        }
        for &p in &self.units[unit].params {
            t.offload(p);
        }
        self.units[unit].unsharded = false;
    }

    /// A unit's pre-forward hook; nodes recorded from here on belong to it.
    pub(crate) fn pre_forward(&mut self, t: &mut Tracer, unit: u32) {
        self.unshard(t, unit as usize, true);
        t.unit = Some(unit);
    }

    /// A unit's post-forward hook: resharded under full shard.
    pub(crate) fn post_forward(&mut self, t: &mut Tracer, unit: u32) {
        let u = unit as usize;
        if self.reshard_after_forward {
            self.reshard(t, u);
        }
        if unit == self.root()
            && let Some(output) = self.all_gather_state.take()
        {
            t.drop(output);
        }
        self.post_forward_order.push(u);
        t.unit = (unit != self.root()).then(|| self.root());
    }

    /// The pre-backward hook: unshard, then prefetch the unit whose forward finished before.
    pub(crate) fn pre_backward(&mut self, t: &mut Tracer, unit: u32) {
        let u = unit as usize;
        if self.units[u].backward != UnitBackward::NotReached {
            return;
        }
        self.units[u].backward = UnitBackward::Running;
        self.unshard(t, u, false);
        let Some(index) = self.post_forward_order.iter().rposition(|&x| x == u) else {
            return;
        };
        self.post_forward_order.truncate(index);
        if let Some(&target) = self.post_forward_order.last()
            && !self.units[target].unsharded
            && self.prefetched.is_none()
        {
            let output = self.all_gather(t, target);
            self.prefetched = Some((target, output));
        }
    }

    /// The post-backward hook: reshard and reduce-scatter the unit's gradients.
    pub(crate) fn post_backward(&mut self, t: &mut Tracer, unit: u32) {
        let u = unit as usize;
        self.units[u].backward = UnitBackward::Done;
        let grads: Vec<(usize, T)> = self.units[u]
            .params
            .iter()
            .enumerate()
            .filter_map(|(i, &p)| t.params[p].grad.take().map(|g| (i, g)))
            .collect();
        self.reshard(t, u);
        if grads.is_empty() {
            return;
        }
        if let Some(previous) = self.reduce_scatter_state.take() {
            t.drop(previous);
        }
        // Gradients are reduced in `reduce_dtype` (the gradients' own without one): the copy
        // into the reduce-scatter input casts them.
        let reduce_dtype = self.reduce_dtype.unwrap_or(t.dtype(grads[0].1));
        let shard_numel = self.shard_numel(t, u);
        let outer = std::mem::replace(&mut t.component, Component::Communication);
        let input = t.empty(
            shard_numel * self.ranks,
            reduce_dtype,
            "FSDP2 reduce_scatter_input",
        );
        // `foreach_reduce` frees the gradients once copied in, but its loop variable keeps
        // the last one until the reduce-scatter output exists.
        let (_, last) = *grads.last().expect("a unit with gradients");
        for &(_, g) in &grads[..grads.len() - 1] {
            t.drop(g);
        }
        t.component = Component::Gradients;
        t.mem.stream = REDUCE_SCATTER_STREAM;
        let output = t.empty(
            shard_numel,
            reduce_dtype,
            "FSDP2 reduce-scatter output (sharded grads)",
        );
        t.mem.stream = 0;
        t.drop(last);
        // Reduced in another dtype than the shards', the output is cast to theirs
        // (`_to_dtype_if_needed`, on the reduce-scatter stream) and freed.
        let output = if reduce_dtype == self.dtype || self.offload {
            output
        } else {
            t.mem.stream = REDUCE_SCATTER_STREAM;
            let cast = t.empty(shard_numel, self.dtype, "reduce output.to(orig_dtype)");
            t.mem.stream = 0;
            t.drop(output);
            cast
        };
        if !self.offload {
            // The sharded gradients are views of the output.
            for &(i, _) in &grads {
                let shard = self.units[u].shards[i];
                let numel = t.numel(t.param(shard));
                let view = t.view(output, numel, "sharded grad");
                t.params[shard].grad = Some(view);
            }
        }
        t.component = outer;
        t.drop(output);
        self.reduce_scatter_state = Some(input);
    }

    /// The root's final callback: units whose post-backward hook did not run get it now, the
    /// last `reduce_scatter_input` is freed, and the next backward starts afresh.
    pub(crate) fn finish_backward(&mut self, t: &mut Tracer) {
        for u in 0..self.units.len() {
            if self.units[u].backward == UnitBackward::Running {
                self.post_backward(t, u as u32);
            }
            self.units[u].backward = UnitBackward::NotReached;
        }
        if let Some(input) = self.reduce_scatter_state.take() {
            t.drop(input);
        }
        if let Some((_, output)) = self.prefetched.take() {
            t.drop(output);
        }
        self.post_forward_order.clear();
    }
}
