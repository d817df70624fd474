//! DeepSpeed ZeRO-3's parameter gathers over several ranks (`parameter_offload.py`,
//! `partitioned_param_coordinator.py`, `partition_parameters.py`, DeepSpeed 0.18.2, the
//! stage defaults): every module's forward pre-hook and backward pre-hook fetch its own
//! parameters (`fetch_sub_module`), its forward post-hook and backward post-hook release
//! them (`release_sub_module`). See `zero3` for what each step allocates, in order.

use std::collections::{HashMap, VecDeque};

use super::{ALL_GATHER_COPY_IN_STREAM, ModuleKey};
use crate::dtype::DType;
use crate::sim::engine::component::Component;
use crate::sim::engine::tracer::{ParamId, T, Tracer};

/// `stage3_prefetch_bucket_size` (elements).
const PREFETCH_BUCKET_ELEMENTS: i64 = 50_000_000;
/// `stage3_max_reuse_distance` (elements).
const MAX_REUSE_DISTANCE: u64 = 1_000_000_000;
/// `stage3_max_live_parameters` (elements).
const MAX_LIVE_PARAMETERS: i64 = 1_000_000_000;
/// `stage3_param_persistence_threshold` (elements): smaller parameters stay gathered
/// (`ds_persist`) once the trace is complete.
const PERSISTENCE_THRESHOLD: u64 = 100_000;

#[derive(Clone, Copy, PartialEq, Eq)]
enum Status {
    NotAvailable,
    Inflight,
    Available,
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum TraceMode {
    Invalid,
    Record,
    Complete,
}

/// An all-gather's handle, held by the in-flight registry once per parameter.
struct Handle {
    /// A coalesced gather's flat output (`_all_gather_dtype`); the parameters are `torch.cat`
    /// out of it at the first wait.
    flat: Option<T>,
    params: Vec<usize>,
    complete: bool,
    /// Registry entries still holding it.
    pending: usize,
}

struct ModuleRec {
    /// Its own parameters (indices), in `ds_id` order.
    params: Vec<usize>,
    /// The module whose forward called it.
    parent: Option<u32>,
    /// Whether its input requires grad: only then does its post-backward hook run.
    post_backward: bool,
    /// A ZeRO-3 leaf (`ModuleKey::MoeLeaf`): its parameters are every one beneath it, and
    /// it holds none of its own.
    leaf: bool,
    /// The modules whose forward it called.
    children: Vec<u32>,
}

pub(crate) struct Gathers {
    world: u64,
    dtype: DType,
    /// `offload_param`: the partitions live on the host and come over at each gather.
    pub(crate) offload: bool,
    params: Vec<ParamId>,
    index: HashMap<ParamId, usize>,
    numels: Vec<u64>,
    partitions: Vec<u64>,
    persist: Vec<bool>,
    status: Vec<Status>,
    /// The gathered parameter's storage (a `torch.cat` output, a single gather's buffer, or
    /// a persistent parameter's flat buffer).
    gathered: Vec<Option<T>>,
    registry: Vec<Option<usize>>,
    active: Vec<Vec<u32>>,
    handles: Vec<Handle>,
    modules: Vec<ModuleRec>,
    keys: HashMap<ModuleKey, u32>,
    stack: Vec<u32>,
    /// Inside a leaf module: 1 for the leaf itself, plus the modules entered beneath it,
    /// which have no hooks.
    leaf_depth: u32,
    /// Per parameter, whether a leaf module holds it (its gradient waits for the leaf's
    /// backward hook).
    in_leaf: Vec<bool>,
    entered: Vec<bool>,
    mode: TraceMode,
    order: Vec<u32>,
    /// Per module, once the trace is complete, every parameter beneath it (its own and its
    /// children's, recursively), each once as `iter_params(recurse=True)` yields them.
    subtree: Vec<Vec<usize>>,
    param_order: Vec<(usize, u64)>,
    queue: VecDeque<(usize, u64)>,
    most_recent: Vec<i64>,
    step_id: u64,
    available: i64,
}

impl Gathers {
    pub(crate) fn new(t: &Tracer, params: &[ParamId], world: u64, offload: bool) -> Gathers {
        let numels: Vec<u64> = params.iter().map(|&p| t.numel(t.param(p))).collect();
        let n = params.len();
        Gathers {
            world,
            dtype: t.dtype(t.param(params[0])),
            offload,
            params: params.to_vec(),
            index: params.iter().enumerate().map(|(i, &p)| (p, i)).collect(),
            partitions: numels.iter().map(|n| n.div_ceil(world)).collect(),
            persist: numels.iter().map(|&n| n <= PERSISTENCE_THRESHOLD).collect(),
            numels,
            status: vec![Status::NotAvailable; n],
            gathered: vec![None; n],
            registry: vec![None; n],
            active: vec![Vec::new(); n],
            handles: Vec::new(),
            modules: Vec::new(),
            keys: HashMap::new(),
            stack: Vec::new(),
            leaf_depth: 0,
            in_leaf: vec![false; n],
            entered: Vec::new(),
            mode: TraceMode::Invalid,
            order: Vec::new(),
            subtree: Vec::new(),
            param_order: Vec::new(),
            queue: VecDeque::new(),
            most_recent: vec![i64::MIN; n],
            step_id: 0,
            available: 0,
        }
    }

    /// The module's id, made at its first forward (its parent is the module running then).
    fn module(&mut self, key: ModuleKey, params: &[ParamId], input_grad: bool) -> u32 {
        if let Some(&m) = self.keys.get(&key) {
            return m;
        }
        let mut own: Vec<usize> = params
            .iter()
            .filter_map(|p| self.index.get(p).copied())
            .collect();
        own.sort_unstable();
        own.dedup();
        let leaf = matches!(key, ModuleKey::MoeLeaf(_));
        if leaf {
            for &p in &own {
                self.in_leaf[p] = true;
            }
        }
        let id = self.modules.len() as u32;
        let parent = self.stack.last().copied();
        if let Some(parent) = parent {
            self.modules[parent as usize].children.push(id);
        }
        self.modules.push(ModuleRec {
            params: own,
            parent,
            post_backward: input_grad,
            leaf,
            children: Vec::new(),
        });
        self.keys.insert(key, id);
        id
    }

    /// A module's forward pre-hook (`_pre_forward_module_hook`); the root's first resets the
    /// step (`_start_of_forward_hook`). A recomputation that has every tensor it needs has
    /// stopped: nothing after it runs. The modules beneath a leaf have no hooks
    /// (`_register_deepspeed_module` stops at it).
    pub(crate) fn pre_forward(
        &mut self,
        t: &mut Tracer,
        key: ModuleKey,
        params: &[ParamId],
        input_grad: bool,
    ) {
        if t.recompute_done() {
            return;
        }
        if self.leaf_depth > 0 {
            self.leaf_depth += 1;
            return;
        }
        if key == ModuleKey::Root {
            self.reset_step(t);
        }
        let m = self.module(key, params, input_grad);
        self.stack.push(m);
        t.unit = Some(m);
        self.fetch(t, m);
        if self.modules[m as usize].leaf {
            self.leaf_depth = 1;
        }
    }

    /// A module's forward post-hook: its parameters released.
    pub(crate) fn post_forward(&mut self, t: &mut Tracer) {
        if t.recompute_done() {
            return;
        }
        if self.leaf_depth > 1 {
            self.leaf_depth -= 1;
            return;
        }
        self.leaf_depth = 0;
        let Some(m) = self.stack.pop() else {
            return;
        };
        t.unit = self.stack.last().copied();
        self.release(t, m);
    }

    /// The end of a recomputation (stopped early inside a module whose post-hooks never ran).
    pub(crate) fn recompute_ends(&mut self, t: &mut Tracer) {
        self.stack.clear();
        self.leaf_depth = 0;
        t.unit = None;
    }

    pub(crate) fn backward_begins(&mut self) {
        self.entered = vec![false; self.modules.len()];
    }

    /// The gradient reached module `unit`'s output: its pre-backward hook, after those of the
    /// modules around it that have not run yet.
    pub(crate) fn unit_backward_begins(&mut self, t: &mut Tracer, unit: u32) {
        let mut chain = Vec::new();
        let mut m = Some(unit);
        while let Some(u) = m {
            if self.entered[u as usize] {
                break;
            }
            self.entered[u as usize] = true;
            chain.push(u);
            m = self.modules[u as usize].parent;
        }
        for &u in chain.iter().rev() {
            self.fetch(t, u);
        }
    }

    /// Whether `param`'s gradient waits for its leaf module's backward hook instead of
    /// being reduced as `AccumulateGrad` stores it.
    pub(crate) fn in_leaf(&self, param: ParamId) -> bool {
        self.index.get(&param).is_some_and(|&p| self.in_leaf[p])
    }

    /// The parameters of module `unit` where it is a leaf, in `model.parameters()` order:
    /// those its full backward hook reduces (`reduce_leaf_module_grads`).
    pub(crate) fn leaf_params(&self, unit: u32) -> Vec<ParamId> {
        let m = &self.modules[unit as usize];
        if !m.leaf {
            return Vec::new();
        }
        m.params.iter().map(|&p| self.params[p]).collect()
    }

    /// Module `unit`'s backward has run: its post-backward hook (only where its input
    /// requires grad: never for the embedding).
    pub(crate) fn unit_backward_done(&mut self, t: &mut Tracer, unit: u32) {
        if self.modules[unit as usize].post_backward {
            self.release(t, unit);
        }
    }

    /// `reset_step`: in-flight gathers waited for and released, the trace advanced (the
    /// first forward records it, the second completes it), the prefetch queue refilled.
    fn reset_step(&mut self, t: &mut Tracer) {
        for p in 0..self.params.len() {
            if let Some(h) = self.registry[p].take() {
                self.wait(t, h);
                self.release_param(t, p);
            }
        }
        match self.mode {
            TraceMode::Complete => {}
            TraceMode::Invalid => self.mode = TraceMode::Record,
            TraceMode::Record => {
                self.param_order = self
                    .order
                    .iter()
                    .enumerate()
                    .flat_map(|(step, &m)| {
                        self.modules[m as usize]
                            .params
                            .iter()
                            .map(move |&p| (p, step as u64))
                    })
                    .collect();
                self.subtree = (0..self.modules.len() as u32)
                    .map(|m| self.subtree_of(m))
                    .collect();
                self.mode = TraceMode::Complete;
            }
        }
        self.queue = self.param_order.iter().copied().collect();
        self.most_recent.fill(i64::MIN);
        self.step_id = 0;
        self.available = 0;
    }

    /// `fetch_sub_module`: gather what is not there, wait for it, then (complete trace)
    /// prefetch up to `prefetch_bucket_size` elements of the parameters next in the trace.
    fn fetch(&mut self, t: &mut Tracer, m: u32) {
        if self.mode == TraceMode::Record {
            self.order.push(m);
        }
        let params = self.modules[m as usize].params.clone();
        let missing: Vec<usize> = params
            .iter()
            .copied()
            .filter(|&p| self.status[p] == Status::NotAvailable)
            .collect();
        if !missing.is_empty() {
            self.all_gather(t, &missing);
        }
        for &p in &params {
            if !self.active[p].contains(&m) {
                self.active[p].push(m);
            }
            if let Some(h) = self.registry[p].take() {
                self.wait(t, h);
            }
        }
        if self.mode == TraceMode::Complete {
            let step = self.step_id as i64;
            let due = params
                .iter()
                .filter(|&&p| self.most_recent[p] < step)
                .count();
            let mut discarded: Vec<usize> = Vec::new();
            while discarded.len() < due {
                let Some((p, s)) = self.queue.pop_front() else {
                    break;
                };
                self.most_recent[p] = s as i64;
                if !discarded.contains(&p) {
                    discarded.push(p);
                }
            }
            let limit = (MAX_LIVE_PARAMETERS - self.available).min(PREFETCH_BUCKET_ELEMENTS);
            let mut prefetch: Vec<usize> = Vec::new();
            let mut numel: i64 = 0;
            while numel < limit {
                let Some((p, s)) = self.queue.pop_front() else {
                    break;
                };
                let fetch = self.status[p] == Status::NotAvailable && !prefetch.contains(&p);
                self.most_recent[p] = self.most_recent[p].max(s as i64);
                if fetch {
                    prefetch.push(p);
                    numel += self.numels[p] as i64;
                }
            }
            if !prefetch.is_empty() {
                self.all_gather(t, &prefetch);
            }
        }
        self.step_id += 1;
    }

    /// `__all_gather_params` → `all_gather_coalesced` on the all-gather stream: one
    /// parameter gathers into a buffer it then views; several into one flat buffer.
    fn all_gather(&mut self, t: &mut Tracer, params: &[usize]) {
        let mut params = params.to_vec();
        params.sort_unstable();
        self.available += params.iter().map(|&p| self.numels[p] as i64).sum::<i64>();
        let outer = std::mem::replace(&mut t.component, Component::Communication);
        let stream = std::mem::replace(&mut t.mem.stream, ALL_GATHER_COPY_IN_STREAM);
        let h = self.handles.len();
        let handle = if self.world == 1 {
            // `_no_gather_coalesced`: each parameter becomes `ds_tensor.to(device)`, a copy
            // of its host partition, or the partition itself where it is on the GPU.
            t.component = Component::Weights;
            for &p in &params {
                self.gathered[p] = self.offload.then(|| {
                    t.empty(
                        self.numels[p],
                        self.dtype,
                        "ZeRO-3 parameter copied to the GPU (offload_param)",
                    )
                });
            }
            Handle {
                flat: None,
                params: params.clone(),
                complete: true,
                pending: params.len(),
            }
        } else if let [p] = params[..] {
            t.component = Component::Weights;
            let buffer = t.empty(
                self.partitions[p] * self.world,
                self.dtype,
                "ZeRO-3 all_gather buffer (the parameter views it)",
            );
            // `_dist_allgather_fn(param.ds_tensor.to(device), ...)`.
            if let Some(copy) = self.host_copy(t, p) {
                t.drop(copy);
            }
            self.gathered[p] = Some(buffer);
            Handle {
                flat: None,
                params: vec![p],
                complete: true,
                pending: 1,
            }
        } else {
            let total: u64 = params.iter().map(|&p| self.partitions[p]).sum();
            let flat = t.empty(
                total * self.world,
                self.dtype,
                "ZeRO-3 all_gather_coalesced flat",
            );
            // `torch.cat([p.ds_tensor.to(device) ...], out=...)`: each host partition copied
            // over first (offload_param).
            let copies: Vec<T> = params
                .iter()
                .filter_map(|&p| self.host_copy(t, p))
                .collect();
            t.drop_all(&copies);
            Handle {
                flat: Some(flat),
                params: params.clone(),
                complete: false,
                pending: params.len(),
            }
        };
        for &p in &params {
            self.status[p] = Status::Inflight;
            self.registry[p] = Some(h);
        }
        self.handles.push(handle);
        t.mem.stream = stream;
        t.component = outer;
    }

    /// `ds_tensor.to(device)` of a host partition (`offload_param`).
    fn host_copy(&self, t: &mut Tracer, p: usize) -> Option<T> {
        self.offload.then(|| {
            t.empty(
                self.partitions[p],
                self.dtype,
                "ZeRO-3 partition copied to the GPU",
            )
        })
    }

    /// A registry entry popped and waited on: a coalesced handle's first wait makes every
    /// parameter of it (`torch.cat`, on the all-gather stream); its flat buffer goes with the
    /// last entry.
    fn wait(&mut self, t: &mut Tracer, h: usize) {
        if !self.handles[h].complete {
            let outer = std::mem::replace(&mut t.component, Component::Weights);
            let stream = std::mem::replace(&mut t.mem.stream, ALL_GATHER_COPY_IN_STREAM);
            for i in 0..self.handles[h].params.len() {
                let p = self.handles[h].params[i];
                let whole = t.empty(
                    self.numels[p],
                    self.dtype,
                    "ZeRO-3 gathered parameter (cat)",
                );
                self.gathered[p] = Some(whole);
            }
            t.mem.stream = stream;
            t.component = outer;
            self.handles[h].complete = true;
        }
        for i in 0..self.handles[h].params.len() {
            let p = self.handles[h].params[i];
            if self.status[p] == Status::Inflight {
                self.status[p] = Status::Available;
            }
        }
        self.handles[h].pending -= 1;
        if self.handles[h].pending == 0
            && let Some(flat) = self.handles[h].flat.take()
        {
            t.drop(flat);
        }
    }

    /// Every parameter beneath module `m`, sorted.
    fn subtree_of(&self, m: u32) -> Vec<usize> {
        let rec = &self.modules[m as usize];
        let mut all = rec.params.clone();
        for &c in &rec.children {
            all.extend(self.subtree_of(c));
        }
        all.sort_unstable();
        all.dedup();
        all
    }

    /// `release_sub_module`: while the trace is recorded every parameter of the module goes;
    /// once complete, only those not used again within `max_reuse_distance` elements of the
    /// module order, not prefetched for a later use, and not persistent. The later modules'
    /// parameters are read as `__params_to_release` reads them, with `recurse` set by the
    /// module released: a leaf sees every parameter beneath each later module, any other
    /// module only each later module's own, none of a leaf's.
    fn release(&mut self, t: &mut Tracer, m: u32) {
        let params = self.modules[m as usize].params.clone();
        if params.is_empty() {
            return;
        }
        let mut release: Vec<usize> = params.clone();
        if self.mode == TraceMode::Complete {
            let step = self.step_id as i64;
            release.retain(|&p| !self.persist[p] && self.most_recent[p] <= step);
            let leaf = self.modules[m as usize].leaf;
            let mut traversed = 0;
            for &later in &self.order[(self.step_id as usize).min(self.order.len())..] {
                if traversed >= MAX_REUSE_DISTANCE || release.is_empty() {
                    break;
                }
                let seen: &[usize] = if leaf {
                    &self.subtree[later as usize]
                } else if self.modules[later as usize].leaf {
                    &[]
                } else {
                    &self.modules[later as usize].params
                };
                for &p in seen {
                    release.retain(|&r| r != p);
                    traversed += self.numels[p];
                }
            }
        }
        for &p in &params {
            self.active[p].retain(|&a| a != m);
            if release.contains(&p) {
                self.release_param(t, p);
            }
        }
    }

    /// `__release_param`: the gathered storage freed once no module uses it.
    fn release_param(&mut self, t: &mut Tracer, p: usize) {
        if self.status[p] == Status::Available && self.active[p].is_empty() {
            if let Some(g) = self.gathered[p].take() {
                t.drop(g);
            }
            self.status[p] = Status::NotAvailable;
            self.available -= self.numels[p] as i64;
        }
    }

    /// `step()`'s `_partition_all_parameters`: everything released.
    pub(crate) fn release_all(&mut self, t: &mut Tracer) {
        for p in 0..self.params.len() {
            if let Some(h) = self.registry[p].take() {
                self.wait(t, h);
            }
            self.active[p].clear();
            self.release_param(t, p);
        }
    }

    /// `_post_step`: the persistent parameters gathered (`_allgather_params_coalesced`, on
    /// the default stream): every host partition copied over (`offload_param`), then a flat
    /// buffer per parameter, which it views; on one rank each parameter is the copy of its
    /// host partition (`_no_gather_coalesced`), or its partition itself.
    pub(crate) fn gather_persistent(&mut self, t: &mut Tracer) {
        let outer = std::mem::replace(&mut t.component, Component::Weights);
        let persistent: Vec<usize> = (0..self.params.len())
            .filter(|&p| self.persist[p] && self.status[p] == Status::NotAvailable)
            .collect();
        let copies: Vec<T> = if self.world > 1 {
            persistent
                .iter()
                .filter_map(|&p| self.host_copy(t, p))
                .collect()
        } else {
            Vec::new()
        };
        for &p in &persistent {
            let gathered = if self.world > 1 {
                Some(t.empty(
                    self.partitions[p] * self.world,
                    self.dtype,
                    "ZeRO-3 persistent parameter (gathered at step end)",
                ))
            } else {
                self.host_copy(t, p)
            };
            self.gathered[p] = gathered;
            self.status[p] = Status::Available;
        }
        t.drop_all(&copies);
        t.component = outer;
    }
}
