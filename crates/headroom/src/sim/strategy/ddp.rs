//! `DistributedDataParallel` (torch 2.11 defaults: `bucket_cap_mb=25`, a first bucket of
//! 1 MiB, `broadcast_buffers=True`, `gradient_as_bucket_view=False`) as one rank sees it.
//!
//! What it allocates, after `nn/parallel/distributed.py` and `c10d/reducer.cpp`:
//! - construction: `_verify_params_across_processes` (`reducer.cpp`) copies the parameter
//!   count to the device and all-gathers it (one output per rank, through ProcessGroupNCCL's
//!   flat buffer of them all), then copies a metadata tensor (two int64 per dimension of every
//!   parameter) to the device, each freed as its local goes; `_sync_module_states`
//!   broadcasts parameters then buffers through `broadcast_coalesced`: tensors grouped in
//!   buckets of at least 250 MiB, each bucket flattened into one new tensor (a lone tensor is
//!   only viewed), at most two buckets in flight; then the `Reducer` allocates its gradient
//!   buffer: the order gradients become ready is not known yet, so the first iteration has one
//!   bucket per dtype holding every trainable parameter (measured: bench/distributed).
//! - every forward broadcasts the buffers again (same bucketing). The second forward rebuilds
//!   the buckets in the order gradients became ready in the first backward (the first up to
//!   1 MiB, the rest up to 25 MiB): `sync_bucket_indices` broadcasts the new assignment from
//!   device copies of two int32 host tensors (every parameter's index and the bucket count;
//!   each bucket's size), freed when it returns; then the old buffer is freed and the new ones
//!   allocated in that order.
//! - backward copies each gradient into its bucket and all-reduces the bucket in place; the
//!   result is copied back into `.grad`: nothing is allocated. So DDP holds a second copy of
//!   the gradients for good.

use crate::dtype::DType;
use crate::sim::engine::component::Component;
use crate::sim::engine::tracer::{ParamId, T, Tracer};

const BROADCAST_BUCKET_BYTES: u64 = 250 << 20;
const FIRST_BUCKET_BYTES: u64 = 1 << 20;
const BUCKET_BYTES: u64 = 25 << 20;

pub(crate) struct Ddp {
    /// The trainable parameters, in `model.parameters()` order.
    params: Vec<ParamId>,
    /// Gradient bucket buffers, in allocation order.
    buckets: Vec<T>,
    /// Buffers broadcast before every forward (rotary frequencies).
    buffers: Vec<(u64, DType)>,
    rebuilt: bool,
    /// The order the first backward readied the gradients in (the buckets are rebuilt by it).
    ready_order: Option<Vec<ParamId>>,
}

/// `compute_bucket_assignment_by_size`: tensors of one dtype in order, a bucket closed once
/// it holds `limits[i]` bytes or more (the last limit repeats); buckets ordered by their first
/// tensor. Returns each bucket's tensor indices.
fn buckets_by_size(tensors: &[(u64, DType)], limits: &[u64]) -> Vec<Vec<usize>> {
    let mut closed: Vec<Vec<usize>> = Vec::new();
    // Per dtype: the open bucket, its bytes, and how many buckets it closed.
    let mut open: Vec<(DType, Vec<usize>, u64, usize)> = Vec::new();
    for (i, &(numel, dtype)) in tensors.iter().enumerate() {
        let slot = match open.iter().position(|o| o.0 == dtype) {
            Some(s) => s,
            None => {
                open.push((dtype, Vec::new(), 0, 0));
                open.len() - 1
            }
        };
        let (_, members, bytes, count) = &mut open[slot];
        members.push(i);
        *bytes += numel * dtype.bytes();
        if *bytes >= limits[(*count).min(limits.len() - 1)] {
            closed.push(std::mem::take(members));
            *bytes = 0;
            *count += 1;
        }
    }
    closed.extend(open.into_iter().map(|o| o.1).filter(|m| !m.is_empty()));
    closed.sort_by_key(|b| b[0]);
    closed
}

/// `verify_params_across_processes` (`reducer.cpp`) under NCCL: the parameter count copied to
/// the device, one `empty_like` of it per rank for the all-gather, which ProcessGroupNCCL runs
/// through a flat buffer of them all (freed when the collective returns), then the sizes and
/// strides of every parameter copied to the device; the locals go in reverse order of
/// construction, the gathered counts in order.
fn verify_params_across_processes(t: &mut Tracer, trainable: &[ParamId], ranks: u64) {
    let outer = std::mem::replace(&mut t.component, Component::Communication);
    let count = t.empty(1, DType::I64, "DDP parameter count");
    let gathered: Vec<T> = (0..ranks)
        .map(|_| t.empty(1, DType::I64, "DDP gathered parameter counts"))
        .collect();
    let flat = t.empty(ranks, DType::I64, "NCCL all-gather flat buffer");
    t.drop(flat);
    let dims: u64 = trainable
        .iter()
        .map(|&p| if t.params[p].matrix.is_some() { 2 } else { 1 })
        .sum();
    let metadata = t.empty(2 * dims, DType::I64, "DDP parameter shape metadata");
    t.drop(metadata);
    for g in gathered {
        t.drop(g);
    }
    t.drop(count);
    t.component = outer;
}

/// `sync_bucket_indices`: the rebuilt assignment broadcast from device copies of its two host
/// tensors, every parameter's index followed by the bucket count, then each bucket's size
/// (int32); both freed when it returns, the sizes first.
fn sync_bucket_indices(t: &mut Tracer, params: usize, buckets: usize) {
    let outer = std::mem::replace(&mut t.component, Component::Communication);
    let indices = t.empty(params as u64 + 1, DType::I32, "DDP rebuilt bucket indices");
    let sizes = t.empty(buckets as u64, DType::I32, "DDP rebuilt bucket sizes");
    t.drop(sizes);
    t.drop(indices);
    t.component = outer;
}

/// `broadcast_coalesced`: each bucket of two or more tensors is flattened into a new tensor
/// (freed when its broadcast finishes); the third bucket waits for the first.
fn broadcast_coalesced(t: &mut Tracer, tensors: &[(u64, DType)]) {
    let outer = std::mem::replace(&mut t.component, Component::Communication);
    let mut in_flight: std::collections::VecDeque<Option<T>> = Default::default();
    for bucket in buckets_by_size(tensors, &[BROADCAST_BUCKET_BYTES]) {
        if in_flight.len() >= 2
            && let Some(Some(flat)) = in_flight.pop_front()
        {
            t.drop(flat);
        }
        let numel = bucket.iter().map(|&i| tensors[i].0).sum();
        let dtype = tensors[bucket[0]].1;
        let flat =
            (bucket.len() > 1).then(|| t.empty(numel, dtype, "broadcast_coalesced flat bucket"));
        in_flight.push_back(flat);
    }
    for flat in in_flight.into_iter().flatten() {
        t.drop(flat);
    }
    t.component = outer;
}

impl Ddp {
    /// `DistributedDataParallel(model)`: `params` are every parameter in `parameters()`
    /// order with whether it trains, `buffers` the module's buffers.
    /// `ranks` is the size of its process group.
    pub(crate) fn wrap(
        t: &mut Tracer,
        params: &[ParamId],
        trainable: &[ParamId],
        buffers: Vec<(u64, DType)>,
        ranks: u64,
    ) -> Ddp {
        verify_params_across_processes(t, trainable, ranks);
        let mut states: Vec<(u64, DType)> = params
            .iter()
            .map(|&p| (t.numel(t.param(p)), t.dtype(t.param(p))))
            .collect();
        states.extend(buffers.iter().copied());
        broadcast_coalesced(t, &states);
        let mut ddp = Ddp {
            params: trainable.to_vec(),
            buckets: Vec::new(),
            buffers,
            rebuilt: false,
            ready_order: None,
        };
        let order = ddp.params.clone();
        let buckets = ddp.assign(t, &order, &[u64::MAX]);
        ddp.allocate(t, &buckets);
        ddp
    }

    /// The gradient buckets of parameters in `order`: (numel, dtype) each.
    fn assign(&self, t: &Tracer, order: &[ParamId], limits: &[u64]) -> Vec<(u64, DType)> {
        let sizes: Vec<(u64, DType)> = order
            .iter()
            .map(|&p| (t.numel(t.param(p)), t.dtype(t.param(p))))
            .collect();
        buckets_by_size(&sizes, limits)
            .into_iter()
            .map(|b| (b.iter().map(|&i| sizes[i].0).sum(), sizes[b[0]].1))
            .collect()
    }

    fn allocate(&mut self, t: &mut Tracer, buckets: &[(u64, DType)]) {
        let outer = std::mem::replace(&mut t.component, Component::Communication);
        for &(numel, dtype) in buckets {
            let b = t.empty(numel, dtype, "DDP gradient bucket");
            self.buckets.push(b);
        }
        t.component = outer;
    }

    /// `_pre_forward`: rebuild the buckets once, in the order the first backward readied the
    /// gradients, then broadcast the buffers. Until that order is known, the tracer notes
    /// the gradients as they become ready.
    pub(crate) fn pre_forward(&mut self, t: &mut Tracer) {
        if t.grad_enabled()
            && !self.rebuilt
            && let Some(order) = self.ready_order.as_deref().filter(|o| !o.is_empty())
        {
            self.rebuilt = true;
            let order: Vec<ParamId> = order
                .iter()
                .copied()
                .filter(|p| self.params.contains(p))
                .collect();
            let buckets = self.assign(t, &order, &[FIRST_BUCKET_BYTES, BUCKET_BYTES]);
            sync_bucket_indices(t, order.len(), buckets.len());
            for b in std::mem::take(&mut self.buckets) {
                t.drop(b);
            }
            self.allocate(t, &buckets);
        }
        let buffers = self.buffers.clone();
        broadcast_coalesced(t, &buffers);
        if self.ready_order.is_none() {
            t.grad_ready = Some(Vec::new());
        }
    }

    /// After a backward: the first one's readiness order is kept.
    pub(crate) fn learn_ready_order(&mut self, t: &mut Tracer) {
        if self.ready_order.is_none() {
            self.ready_order = t.grad_ready.take();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buckets_close_at_their_limit_and_keep_dtypes_apart() {
        let mib = 1 << 20;
        let f32_of = |bytes: u64| (bytes / 4, DType::F32);
        // A 2 MiB tensor fills the 1 MiB first bucket alone; then 25 MiB buckets.
        let tensors = [
            f32_of(2 * mib),
            f32_of(10 * mib),
            f32_of(10 * mib),
            f32_of(10 * mib),
            f32_of(mib),
        ];
        let buckets = buckets_by_size(&tensors, &[FIRST_BUCKET_BYTES, BUCKET_BYTES]);
        assert_eq!(buckets, vec![vec![0], vec![1, 2, 3], vec![4]]);
        // Two dtypes form separate buckets, ordered by their first tensor.
        let mixed = [(10, DType::BF16), (10, DType::F32), (10, DType::BF16)];
        let buckets = buckets_by_size(&mixed, &[BUCKET_BYTES]);
        assert_eq!(buckets, vec![vec![0, 2], vec![1]]);
    }
}
