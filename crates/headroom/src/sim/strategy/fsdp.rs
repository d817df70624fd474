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
//! - units ([`FsdpUnits`]): besides the decoder layers, frameworks make the input embedding a
//!   unit (verl, accelerate) and `[final norm, head]` one kept gathered from its forward to
//!   its backward (accelerate); a group's pre-forward hook runs when its first module does
//!   (the tied embedding, long before the head), its post-forward hook after its last.
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
//! - inside a pipeline (`torch.distributed.pipelining`, `stage.py`): each stage is a root of its
//!   own; before every micro-batch's backward the stage turns gradient sync off
//!   (`set_requires_gradient_sync(False)` with `set_reshard_after_backward(False)`), so a
//!   post-backward hook neither reshards nor reduces: the unsharded gradients accumulate over the
//!   micro-batches (upcast once to `reduce_dtype` into `unsharded_accumulated_grad` where the
//!   policy reduces in another dtype) and the parameters stay unsharded from their first
//!   backward on. `perform_reduce_grad`, after the stage's last backward, turns sync back on and
//!   runs every unit's post-backward hook (reshard, then reduce-scatter) and the root's final
//!   callback ([`Fsdp::reduce_grad`]). The multi-stage schedules unshard a stage explicitly
//!   before it computes (`unshard(async_op=True)`: the all-gather on the default stream, the
//!   copy-out when the schedule waits for it; [`Fsdp::unshard_async`]).
//!
//! Shards are padded to a multiple of the shard group in dim 0; unsharded storages are
//! simulated at the parameter's own size (equal for the even shapes of the catalog models).

use super::{ALL_GATHER_COPY_IN_STREAM, REDUCE_SCATTER_STREAM, Unit};
use crate::arch::{Architecture, Head, Module, Param};
use crate::dtype::DType;
use crate::sim::engine::component::Component;
use crate::sim::engine::tracer::{ParamId, T, Tracer};
use crate::spec::{FsdpUnits, Parallel};

struct ShardedUnit {
    /// The unsharded parameters the model computes with (registered without storage).
    params: Vec<ParamId>,
    /// Their local shards, in the same order: what the optimizer steps.
    shards: Vec<ParamId>,
    unsharded: bool,
    /// Whether its post-forward hook frees the unsharded parameters.
    reshard_after_forward: bool,
    /// Where this backward is with it.
    backward: UnitBackward,
    /// Per parameter: the gradient accumulated in `reduce_dtype` while gradient sync is off.
    accumulated: Vec<Option<T>>,
    /// Its places in `post_forward_order` (`_post_forward_indices`), the last popped by each
    /// backward prefetch.
    post_forward_indices: Vec<usize>,
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
    offload: bool,
    /// The shards' dtype (the parameters' storage).
    dtype: DType,
    /// `MixedPrecisionPolicy`: what the shards are cast to before the all-gather (the
    /// unsharded parameters' dtype), and what gradients are reduced in; `None`: the storage's.
    param_dtype: Option<DType>,
    reduce_dtype: Option<DType>,
    /// Decoder layers in order, the embedding's and the head's units where the layout has
    /// them, then the root.
    units: Vec<ShardedUnit>,
    /// How many of the units are decoder layers.
    layers: usize,
    embedding: Option<usize>,
    head: Option<usize>,
    /// The head's unit holds the tied input embedding too.
    head_holds_embedding: bool,
    /// The last forward all-gather output, kept until the next copy-out.
    all_gather_state: Option<T>,
    /// Backward prefetches (`_all_gather_result`, one a unit): each unit and its all-gather
    /// output, waiting for its copy-out; a mistargeted one waits until the unit's next
    /// unshard, or the end of the last backward.
    prefetched: Vec<(usize, T)>,
    /// The last `reduce_scatter_input`, freed by the next reduce-scatter.
    reduce_scatter_state: Option<T>,
    /// Units in the order their forward finished (`comm_ctx.post_forward_order`), kept over
    /// the backwards of a pipeline's micro-batches until the last.
    post_forward_order: Vec<usize>,
    /// `requires_gradient_sync` (with `reshard_after_backward`, which pipelining sets alike):
    /// false, a post-backward hook keeps the unit unsharded and its gradients unreduced.
    gradient_sync: bool,
    /// Explicit `unshard(async_op=True)` all-gathers waiting for their copy-out, in call order.
    pending: Vec<(usize, T)>,
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
        owned: &dyn Fn(&Param) -> bool,
    ) -> Fsdp {
        let ranks = parallel.shard_size;
        let layers = arch.layers as usize;
        let tied = arch.tie_word_embeddings && head == Head::CausalLm;
        let layout = parallel.units;
        let mut next = layers;
        let mut extra = |own: bool| {
            own.then(|| {
                next += 1;
                next - 1
            })
        };
        let embedding_unit =
            extra(matches!(layout, FsdpUnits::LayersEmbedding | FsdpUnits::Accelerate) && !tied);
        let head_unit = extra(layout == FsdpUnits::Accelerate);
        let root = next;
        let mut units: Vec<ShardedUnit> = (0..=root)
            .map(|u| ShardedUnit {
                params: Vec::new(),
                shards: Vec::new(),
                unsharded: false,
                reshard_after_forward: if Some(u) == head_unit {
                    false
                } else if u == root {
                    parallel.reshard_after_forward && layout != FsdpUnits::LayersKeepRoot
                } else {
                    parallel.reshard_after_forward
                },
                backward: UnitBackward::NotReached,
                accumulated: Vec::new(),
                post_forward_indices: Vec::new(),
            })
            .collect();
        for (i, p) in arch.parameters(head).iter().enumerate() {
            if !owned(p) {
                continue;
            }
            let unit = match (p.layer, p.module) {
                (Some(l), _) => l as usize,
                (None, Module::Embed) => embedding_unit
                    .or(head_unit.filter(|_| tied))
                    .unwrap_or(root),
                (None, Module::FinalNorm) => head_unit.unwrap_or(root),
                (None, Module::LmHead) => head_unit.unwrap_or(root),
                _ => root,
            };
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
            units[unit].accumulated.push(None);
        }
        // `to_empty` reaches the meta buffers after the parameters, and the tied `lm_head`
        // last: its shard is made again and dropped (the tie holds the embedding's).
        let meta_buffers: Vec<T> = arch
            .buffers()
            .into_iter()
            .map(|(n, d)| t.empty_as(n, d, Component::Weights, "rotary inv_freq (meta, to_empty)"))
            .collect();
        if tied && !parallel.offload_params {
            let embed_unit = head_unit.unwrap_or(root);
            let embed = units[embed_unit].shards[0];
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
            layers,
            offload: parallel.offload_params,
            dtype,
            param_dtype: mp.map(|m| m.param_dtype).filter(|&d| d != dtype),
            reduce_dtype: mp.and_then(|m| m.reduce_dtype),
            units,
            embedding: embedding_unit,
            head: head_unit,
            head_holds_embedding: tied && head_unit.is_some(),
            all_gather_state: None,
            prefetched: Vec::new(),
            reduce_scatter_state: None,
            post_forward_order: Vec::new(),
            gradient_sync: true,
            pending: Vec::new(),
        }
    }

    /// Between steps: every unit sharded, out of backward, with nothing accumulated or
    /// recorded, and no all-gather or reduce-scatter buffer held. The fields that change
    /// over a step then have these values alone, so two states at rest are the same state.
    pub(crate) fn at_rest(&self) -> bool {
        self.units.iter().all(|u| {
            !u.unsharded
                && u.backward == UnitBackward::NotReached
                && u.accumulated.iter().all(Option::is_none)
                && u.post_forward_indices.is_empty()
        }) && self.all_gather_state.is_none()
            && self.prefetched.is_empty()
            && self.reduce_scatter_state.is_none()
            && self.post_forward_order.is_empty()
            && self.gradient_sync
            && self.pending.is_empty()
    }

    /// The root's unit id (the units before it are the decoder layers).
    pub(crate) fn root(&self) -> u32 {
        (self.units.len() - 1) as u32
    }

    /// The unit whose hooks a part of the model runs; `None`: the root's, already running.
    fn unit_of(&self, unit: Unit) -> Option<u32> {
        match unit {
            Unit::Layer(layer) => Some(layer as u32),
            Unit::Root => Some(self.root()),
            Unit::Embedding => self.embedding.or(self.tied_in_head()).map(|u| u as u32),
            Unit::Head => self.head.map(|u| u as u32),
        }
    }

    /// The head's unit when it also holds the tied embedding.
    fn tied_in_head(&self) -> Option<usize> {
        self.head.filter(|_| self.head_holds_embedding)
    }

    /// The forward pre-hook of the unit that runs `unit`.
    pub(crate) fn unit_pre_forward(&mut self, t: &mut Tracer, unit: Unit) {
        if let Some(u) = self.unit_of(unit) {
            self.pre_forward(t, u);
        }
    }

    /// The forward post-hook of the unit that runs `unit`; a group's waits for its last
    /// module (the tied embedding runs first of `[norm, embedding, head]`).
    pub(crate) fn unit_post_forward(&mut self, t: &mut Tracer, unit: Unit) {
        match self.unit_of(unit) {
            Some(u) if unit == Unit::Embedding && self.head == Some(u as usize) => {
                t.unit = Some(self.root());
            }
            Some(u) => self.post_forward(t, u),
            None => {}
        }
    }

    /// The shards the optimizer steps (none on the device under CPU offload), in parameter
    /// order.
    pub(crate) fn device_shards(&self) -> Vec<ParamId> {
        if self.offload {
            return Vec::new();
        }
        self.shards()
    }

    /// Every shard, in parameter order: what `model.cpu()` and `model.cuda()` move.
    pub(crate) fn shards(&self) -> Vec<ParamId> {
        let mut all: Vec<ParamId> = self.units.iter().flat_map(|u| u.shards.clone()).collect();
        all.sort_unstable();
        all
    }

    /// Shard bytes held on the host (CPU offload, or the model moved there).
    pub(crate) fn host_bytes(&self, t: &Tracer) -> u64 {
        self.shards()
            .into_iter()
            .filter(|&s| !t.is_materialized(s))
            .map(|s| t.bytes(t.param(s)))
            .sum()
    }

    fn shard_numel(&self, t: &Tracer, unit: usize) -> u64 {
        self.units[unit]
            .shards
            .iter()
            .map(|&s| t.numel(t.param(s)))
            .sum()
    }

    /// `foreach_all_gather`, on `stream` (the copy-in stream; an explicit asynchronous unshard's
    /// is the current one): the all-gather inputs, then the output
    /// buffer in the unsharded dtype; the inputs go when it returns. Under CPU offload each
    /// shard is copied to the GPU (and cast to `param_dtype`, the copy freed); under a
    /// mixed-precision policy alone the shards are cast together into one flat buffer.
    fn all_gather(&self, t: &mut Tracer, unit: usize, stream: u32) -> T {
        let outer = std::mem::replace(&mut t.component, Component::Communication);
        t.mem.stream = stream;
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
        if self.units[unit].params.is_empty() {
            self.units[unit].unsharded = true;
            return;
        }
        let output = match self.prefetched.iter().position(|p| p.0 == unit) {
            Some(at) => self.prefetched.remove(at).1,
            None => self.all_gather(t, unit, ALL_GATHER_COPY_IN_STREAM),
        };
        self.copy_out(t, unit);
        // The previous forward all-gather output goes once this copy-out is queued.
        if forward && let Some(previous) = self.all_gather_state.take() {
            t.drop(previous);
        }
        if forward && self.ranks > 1 {
            self.all_gather_state = Some(output);
        } else {
            t.drop(output);
        }
    }

    /// `foreach_all_gather_copy_out`: each parameter's unsharded storage, in parameter order.
    fn copy_out(&mut self, t: &mut Tracer, unit: usize) {
        let outer = std::mem::replace(&mut t.component, Component::Weights);
        for &p in &self.units[unit].params {
            t.materialize(p);
        }
        t.component = outer;
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
    fn pre_forward(&mut self, t: &mut Tracer, unit: u32) {
        self.unshard(t, unit as usize, true);
        t.unit = Some(unit);
    }

    /// A unit's post-forward hook: resharded under full shard.
    fn post_forward(&mut self, t: &mut Tracer, unit: u32) {
        let u = unit as usize;
        if self.units[u].reshard_after_forward {
            self.reshard(t, u);
        }
        if unit == self.root()
            && let Some(output) = self.all_gather_state.take()
        {
            t.drop(output);
        }
        // A unit without parameters has no parameter group to record its place.
        if !self.units[u].params.is_empty() {
            self.units[u]
                .post_forward_indices
                .push(self.post_forward_order.len());
            self.post_forward_order.push(u);
        }
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
        // `_backward_prefetch`: the unit whose forward finished just before this one's last.
        let Some(index) = self.units[u].post_forward_indices.pop() else {
            return;
        };
        if let Some(&target) = index.checked_sub(1).map(|i| &self.post_forward_order[i])
            && !self.units[target].unsharded
            && !self.prefetched.iter().any(|p| p.0 == target)
        {
            let output = self.all_gather(t, target, ALL_GATHER_COPY_IN_STREAM);
            self.prefetched.push((target, output));
        }
    }

    /// The pre-backward hooks on a pipeline stage's output when it is the last decoder layer's
    /// (every stage but the last): they run as its gradient arrives, before any of the stage's
    /// backward, the layer's (registered first) then the root's, which gathers the root's
    /// parameters for the whole backward where its forward resharded them.
    pub(crate) fn stage_output_pre_backward(&mut self, t: &mut Tracer) {
        self.pre_backward(t, (self.layers - 1) as u32);
        self.pre_backward(t, self.root());
    }

    /// Every node of a unit has run: its post-backward hook, unless it waits for the root's
    /// final callback.
    pub(crate) fn unit_backward_done(&mut self, t: &mut Tracer, unit: u32) {
        if !self.hooked_at_end(unit as usize) {
            self.post_backward(t, unit);
        }
    }

    /// Whether a unit's post-backward hook waits for the root's final callback: FSDP2 hooks
    /// it on the unit's forward inputs that require grad (`RegisterPostBackwardFunction`),
    /// and the root, the embedding and a group the tied embedding starts take token ids.
    fn hooked_at_end(&self, u: usize) -> bool {
        u == self.units.len() - 1 || Some(u) == self.embedding || Some(u) == self.tied_in_head()
    }

    /// The post-backward hook: reshard and reduce-scatter the unit's gradients.
    fn post_backward(&mut self, t: &mut Tracer, unit: u32) {
        let u = unit as usize;
        self.units[u].backward = UnitBackward::Done;
        // `accumulate_unsharded_grad_if_needed`: `accumulated += grad`, in place.
        for (i, &p) in self.units[u].params.iter().enumerate() {
            if self.units[u].accumulated[i].is_some()
                && let Some(g) = t.params[p].grad.take()
            {
                t.drop(g);
            }
        }
        if !self.gradient_sync {
            self.upcast_unsharded_grads(t, u);
            return;
        }
        let grads: Vec<(usize, T)> = (0..self.units[u].params.len())
            .filter_map(|i| {
                let p = self.units[u].params[i];
                let g = self.units[u].accumulated[i].take();
                g.or_else(|| t.params[p].grad.take()).map(|g| (i, g))
            })
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
        // `foreach_reduce` frees the gradients once copied in, but over several ranks the
        // loop variable of its per-gradient loop keeps the last one until it returns.
        let kept = (self.ranks > 1).then(|| grads.last().expect("a unit with gradients").1);
        for &(_, g) in &grads {
            if Some(g) != kept {
                t.drop(g);
            }
        }
        t.component = Component::Gradients;
        t.mem.stream = REDUCE_SCATTER_STREAM;
        let output = t.empty(
            shard_numel,
            reduce_dtype,
            "FSDP2 reduce-scatter output (sharded grads)",
        );
        t.mem.stream = 0;
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
        if let Some(g) = kept {
            t.drop(g);
        }
        self.reduce_scatter_state = Some(input);
    }

    /// `to_accumulated_grad_if_needed`, gradient sync off: a gradient computed in another
    /// dtype than `reduce_dtype` moves into an upcast copy that later ones accumulate into.
    fn upcast_unsharded_grads(&mut self, t: &mut Tracer, u: usize) {
        let Some(reduce_dtype) = self.reduce_dtype else {
            return;
        };
        for i in 0..self.units[u].params.len() {
            let p = self.units[u].params[i];
            let Some(g) = t.params[p].grad.filter(|&g| t.dtype(g) != reduce_dtype) else {
                continue;
            };
            t.params[p].grad = None;
            let outer = std::mem::replace(&mut t.component, Component::Gradients);
            let upcast = t.empty(
                t.numel(g),
                reduce_dtype,
                "FSDP2 unsharded_accumulated_grad (grad.to(reduce_dtype))",
            );
            t.component = outer;
            t.drop(g);
            self.units[u].accumulated[i] = Some(upcast);
        }
    }

    /// Units in `_state_ctx.all_states` order: the root, then the others as `model.modules()`
    /// meets them (the embedding, or the group the tied embedding starts, before the layers).
    fn all_states(&self) -> Vec<usize> {
        let root = self.units.len() - 1;
        let firsts = [Some(root), self.embedding, self.tied_in_head()];
        firsts
            .into_iter()
            .flatten()
            .chain((0..root).filter(|&u| !firsts.contains(&Some(u))))
            .collect()
    }

    /// `set_requires_gradient_sync` with `set_reshard_after_backward` and
    /// `set_is_last_backward`, as pipelining sets them together around a micro-batch's backward.
    pub(crate) fn set_gradient_sync(&mut self, sync: bool) {
        self.gradient_sync = sync;
    }

    /// `_PipelineStageBase.perform_reduce_grad` after a stage's last backward: gradient sync on,
    /// every unit's post-backward hook (reshard, reduce-scatter), then the root's final
    /// callback of a last backward.
    pub(crate) fn reduce_grad(&mut self, t: &mut Tracer) {
        self.gradient_sync = true;
        for u in self.all_states() {
            self.post_backward(t, u as u32);
        }
        self.finish_backward(t);
    }

    /// The schedule's UNSHARD of a stage: `unshard(async_op=True)` on each unit in
    /// `modules()` order, the all-gathers on the default stream, waiting for
    /// [`Fsdp::wait_unshard`].
    pub(crate) fn unshard_async(&mut self, t: &mut Tracer) {
        for u in self.all_states() {
            let unit = &self.units[u];
            if unit.params.is_empty() || unit.unsharded || self.pending.iter().any(|p| p.0 == u) {
                continue;
            }
            let output = self.all_gather(t, u, 0);
            self.pending.push((u, output));
        }
    }

    /// `_assert_unsharded`: each pending unshard's `wait()`, outside forward and backward: the
    /// copy-out, then the all-gather output freed.
    pub(crate) fn wait_unshard(&mut self, t: &mut Tracer) {
        for (u, output) in std::mem::take(&mut self.pending) {
            self.copy_out(t, u);
            t.drop(output);
        }
    }

    /// The schedule's RESHARD of a stage: `reshard()` on each unit.
    pub(crate) fn reshard_all(&mut self, t: &mut Tracer) {
        for u in 0..self.units.len() {
            self.reshard(t, u);
        }
    }

    /// The root's final callback: units whose post-backward hook did not run get it now; after
    /// a last backward (gradient sync on) the last `reduce_scatter_input` is freed and the next
    /// backward starts afresh.
    pub(crate) fn finish_backward(&mut self, t: &mut Tracer) {
        for u in self.all_states() {
            if self.units[u].backward == UnitBackward::Running {
                self.post_backward(t, u as u32);
            }
            self.units[u].backward = UnitBackward::NotReached;
        }
        if !self.gradient_sync {
            return;
        }
        if let Some(input) = self.reduce_scatter_state.take() {
            t.drop(input);
        }
        for (_, output) in std::mem::take(&mut self.prefetched) {
            t.drop(output);
        }
        self.post_forward_order.clear();
        for unit in &mut self.units {
            unit.post_forward_indices.clear();
        }
    }
}
