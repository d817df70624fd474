//! FSDP2 with `CPUOffloadPolicy` on a one-rank group, for a no-grad pass (slime's reference
//! model).

use super::Unit;
use crate::arch::{Architecture, Head};
use crate::sim::engine::component::Component;
use crate::sim::engine::tracer::{ParamId, T, Tracer};

/// `fully_shard(layer, offload_policy=CPUOffloadPolicy())` for each decoder layer, then for the
/// root, on one GPU (torch 2.11 `_fully_shard`). A unit's parameters live on the CPU; its
/// pre-forward hook unshards them: each shard is copied to the GPU (`.to(device)`), copied into
/// one `all_gather_output` buffer, the copies freed, then each parameter gets its unsharded
/// storage (`alloc_all_gather_outputs`) and the buffer is freed. Its post-forward hook frees
/// the storages again, except the root's: the root does not reshard after forward, so the
/// embedding stays on the GPU from the first pass.
///
/// FSDP2 runs the copy-in on its own stream during forward, which would pool those blocks
/// apart; the measured run (bench/pipelines, seed001-fsdp2-offload) reserves what one shared
/// pool gives (within 0.1% on every phase; a separate pool gives +0.87 GiB), so they are
/// simulated on the default stream. Why is not established.
#[derive(Clone, Debug)]
pub(crate) struct FsdpOffload {
    root: Vec<ParamId>,
    layers: Vec<Vec<ParamId>>,
}

impl FsdpOffload {
    /// The units of a model whose parameters were registered from `first` on, in
    /// `arch.parameters(head)` order.
    pub(crate) fn units(arch: &Architecture, head: Head, first: ParamId) -> Self {
        let mut units = FsdpOffload {
            root: Vec::new(),
            layers: vec![Vec::new(); arch.layers as usize],
        };
        for (i, p) in arch.parameters(head).iter().enumerate() {
            match p.layer {
                Some(layer) => units.layers[layer as usize].push(first + i),
                None => units.root.push(first + i),
            }
        }
        units
    }

    /// Parameter bytes of the units that are not on the GPU now (what a pass copies in).
    pub(crate) fn streamed_bytes(&self, t: &Tracer) -> u64 {
        self.layers
            .iter()
            .chain([&self.root])
            .flatten()
            .filter(|&&p| !t.is_materialized(p))
            .map(|&p| t.bytes(t.param(p)))
            .sum()
    }

    /// A unit's parameters; the embedding and the head belong to the root here.
    fn params(&self, unit: Unit) -> &[ParamId] {
        match unit {
            Unit::Layer(layer) => &self.layers[layer],
            Unit::Embedding | Unit::Head | Unit::Root => &self.root,
        }
    }

    /// A unit's pre-forward hook: its parameters are copied in and gathered.
    pub(crate) fn unshard(&self, t: &mut Tracer, unit: Unit) {
        let params = self.params(unit);
        if params.iter().all(|&p| t.is_materialized(p)) {
            return;
        }
        let outer = std::mem::replace(&mut t.component, Component::Weights);
        let copies: Vec<T> = params
            .iter()
            .map(|&p| {
                let w = t.param(p);
                let (numel, dtype) = (t.numel(w), t.dtype(w));
                t.empty(numel, dtype, "FSDP2 shard copied to the GPU")
            })
            .collect();
        let numel = params.iter().map(|&p| t.numel(t.param(p))).sum();
        let dtype = t.dtype(t.param(params[0]));
        let output = t.empty(numel, dtype, "FSDP2 all_gather_output");
        t.drop_all(&copies);
        for &p in params {
            t.materialize(p);
        }
        t.drop(output);
        t.component = outer;
    }

    /// A unit's post-forward hook: a decoder layer's parameters are freed again; the root
    /// keeps its own.
    pub(crate) fn reshard(&self, t: &mut Tracer, unit: Unit) {
        if !matches!(unit, Unit::Layer(_)) {
            return;
        }
        for &p in self.params(unit) {
            t.offload(p);
        }
    }
}
