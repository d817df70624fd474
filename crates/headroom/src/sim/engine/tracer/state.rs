//! The tracer's state as the step memo (`sim::memo`) compares it: a canonical walk of every
//! live tensor, written as words or compared with an earlier walk's, and the gradients a
//! recorded pass stored.

use smallvec::SmallVec;

use super::{ParamId, T, TensorRec, Tracer};
use crate::sim::engine::memory::Allocation;

/// The simulated process between steps, as far as it steers what later steps do: every live
/// tensor reachable from the roots (parameters and their gradients, persistent buffers, the
/// autocast cache, and the caller's roots), renamed in the order a walk from the roots meets
/// them, so that two states compare equal when they differ only in tensor ids. Blocks appear
/// by address. Autograd's sequence counter is left out: only the order of sequence numbers
/// within one graph matters, and every graph numbers its nodes from the counter upward.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct TracerState {
    /// The state written as a sequence of words by `write_state`: equal sequences are equal
    /// states, field by field (each field's presence is told by earlier words).
    words: Vec<u64>,
}

/// Where `write_state` puts its words: a vector, or a comparison with earlier words.
trait StateSink {
    fn word(&mut self, w: u64);
}

impl StateSink for Vec<u64> {
    #[inline]
    fn word(&mut self, w: u64) {
        self.push(w);
    }
}

/// Compares words with an earlier state's as they come.
struct Compare<'a> {
    earlier: &'a [u64],
    at: usize,
    equal: bool,
}

impl StateSink for Compare<'_> {
    #[inline]
    fn word(&mut self, w: u64) {
        self.equal &= self.earlier.get(self.at) == Some(&w);
        self.at += 1;
    }
}

/// Names tensors without writing them: those a state counts as live but leaves out.
struct Discard;

impl StateSink for Discard {
    #[inline]
    fn word(&mut self, _: u64) {}
}

const NO_WORD: u64 = u64::MAX;

/// What part of the process a [`TracerState`] covers.
#[derive(Clone, Copy)]
pub(crate) enum Scope<'a> {
    /// All of it: what a whole step reads, and what it must leave as it found.
    Step,
    /// What a training pass (forward and backward) reads. Left out, only counted among the
    /// live tensors: the gradients (a pass stores them and reads none, as every pass starts
    /// after `zero_grad(set_to_none=True)`), the persistent tensors from the `persistent`th
    /// on, `aside` (the optimizer's states: model code never reads them), the live bytes per
    /// component (the device's books, not the tracer's) and the cuBLAS workspace flags (the
    /// caller compares those).
    Pass { persistent: usize, aside: &'a [T] },
}

/// The gradients a training pass stored, to be stored again by a pass made from its requests
/// (see `sim::memo`): each a plain tensor of its own, or a view of a plain tensor that only
/// gradients view (FSDP2's sharded gradients, views of the reduce-scatter output).
pub(crate) struct StoredGrads {
    /// The tensors that own the gradients' storage, each with the `Malloc` of the recorded
    /// requests that allocated it.
    owners: Vec<(TensorRec, u32)>,
    grads: Vec<StoredGrad>,
}

/// One stored gradient: its parameter, its owner (an index of `owners`), and its own record
/// where it is a view of the owner (`None`: it is the owner).
struct StoredGrad {
    param: ParamId,
    owner: usize,
    view: Option<TensorRec>,
}

impl StoredGrads {
    /// The `Malloc`s of the recorded requests whose allocations hold the gradients.
    pub(crate) fn mallocs(&self) -> impl Iterator<Item = u32> + '_ {
        self.owners.iter().map(|&(_, malloc)| malloc)
    }
}

impl Tracer {
    /// The state between steps (see [`TracerState`]); `roots` are the tensors the caller
    /// holds (optimizer states, inputs), in a fixed order.
    pub(crate) fn state(&mut self, scope: Scope, roots: &[T]) -> TracerState {
        let mut words = Vec::with_capacity(8 * (self.tensors.len() - self.free_tensors.len()));
        self.write_state(scope, roots, &mut words);
        TracerState { words }
    }

    /// Whether the state now is `earlier` (compared as it is written, nothing kept).
    pub(crate) fn state_is(&mut self, scope: Scope, roots: &[T], earlier: &TracerState) -> bool {
        let mut compare = Compare {
            earlier: &earlier.words,
            at: 0,
            equal: true,
        };
        self.write_state(scope, roots, &mut compare);
        compare.equal && compare.at == earlier.words.len()
    }

    fn write_state(&mut self, scope: Scope, roots: &[T], out: &mut impl StateSink) {
        const UNSEEN: u32 = u32::MAX;
        let mut canonical = std::mem::take(&mut self.canonical);
        canonical.clear();
        canonical.resize(self.tensors.len(), UNSEEN);
        let mut next_id = 0u32;
        let mut chain: SmallVec<[T; 4]> = SmallVec::new();
        let pass = match scope {
            Scope::Step => None,
            Scope::Pass { persistent, aside } => Some((persistent, aside)),
        };
        // Returns how many tensors it named.
        let mut visit = |t: Option<T>, out: &mut dyn StateSink| {
            let Some(t) = t else {
                out.word(NO_WORD);
                return 0;
            };
            // A tensor's base is named before it.
            chain.clear();
            let mut next = Some(t);
            while let Some(x) = next {
                if canonical[x.0 as usize] != UNSEEN {
                    break;
                }
                chain.push(x);
                next = self.tensors[x.0 as usize].base;
            }
            for &x in chain.iter().rev() {
                let rec = &self.tensors[x.0 as usize];
                canonical[x.0 as usize] = next_id;
                next_id += 1;
                let alloc = rec.allocation.map(|a| self.mem.signature(&a));
                out.word(rec.numel);
                out.word(
                    rec.dtype as u64
                        | (alloc.map_or(0xff, |a| a.3 as u64) << 8)
                        | (u64::from(rec.requires_grad) << 16)
                        | (u64::from(rec.grad_fn.is_some()) << 17)
                        | (u64::from(rec.view_of_temporary) << 18)
                        | (u64::from(rec.refs) << 32),
                );
                if let Some((ptr, requested, block_size, _)) = alloc {
                    out.word(ptr);
                    out.word(requested);
                    out.word(block_size);
                }
                out.word(rec.param.map_or(NO_WORD, |p| p as u64));
                out.word(
                    rec.base
                        .map_or(NO_WORD, |b| u64::from(canonical[b.0 as usize])),
                );
                // Labels compare by address: equal addresses are equal labels, and unequal
                // ones only make equal states look different (no repeat, no error).
                out.word(rec.label.as_ptr() as u64);
                out.word(rec.label.len() as u64);
            }
            out.word(u64::from(canonical[t.0 as usize]));
            chain.len() as u64
        };
        for p in &self.params {
            visit(Some(p.tensor), out);
            if pass.is_none() {
                visit(p.grad, out);
            }
            let (rows, cols) = p.matrix.unwrap_or((NO_WORD, NO_WORD));
            out.word(rows);
            out.word(cols);
            out.word(u64::from(p.node.is_none()));
        }
        out.word(NO_WORD);
        let (persistent, aside) = pass.unwrap_or((self.persistent.len(), &[]));
        // Fewer than when the state was taken (a model was deleted): not that state.
        out.word(u64::from(persistent > self.persistent.len()));
        let persistent = persistent.min(self.persistent.len());
        for &t in &self.persistent[..persistent] {
            visit(Some(t), out);
        }
        out.word(NO_WORD);
        for &(w, c) in &self.autocast_cache {
            visit(Some(w), out);
            visit(Some(c), out);
        }
        out.word(NO_WORD);
        for &t in roots {
            visit(Some(t), out);
        }
        out.word(NO_WORD);
        for graph in self.kept_graphs.iter().filter(|g| g.holders > 0) {
            out.word(u64::from(graph.holders));
            for &t in &graph.tensors {
                visit(Some(t), out);
            }
            out.word(NO_WORD);
        }
        out.word(NO_WORD);
        let mut live = (self.tensors.len() - self.free_tensors.len()) as u64;
        if pass.is_some() {
            let left_out = self.params.iter().map(|p| p.grad);
            let left_out = left_out.chain(self.persistent[persistent..].iter().map(|&t| Some(t)));
            for t in left_out.chain(aside.iter().map(|&t| Some(t))) {
                live -= visit(t, &mut Discard);
            }
        }
        out.word(live);
        if pass.is_none() {
            for bytes in self.mem.live() {
                out.word(bytes);
            }
        }
        let workspaces = if pass.is_some() {
            0
        } else {
            (u64::from(self.cublas_workspace[0]) << 24)
                | (u64::from(self.cublas_workspace[1]) << 25)
                | (u64::from(self.cublaslt_workspace[0]) << 26)
                | (u64::from(self.cublaslt_workspace[1]) << 27)
        };
        out.word(
            u64::from(self.grad_enabled)
                | (u64::from(self.region.is_none()) << 1)
                | (u64::from(self.recompute.is_none()) << 2)
                | (u64::from(self.dtensor) << 3)
                | ((self.component as u64) << 8)
                | (self.autocast.map_or(0xff, |d| d as u64) << 16)
                | workspaces
                | ((self.thread as u64) << 32),
        );
        // The FSDP unit whose forward hooks last ran: what the next ops are recorded under.
        out.word(self.unit.map_or(NO_WORD, u64::from));
        out.word(u64::from(
            self.nodes.is_empty()
                && self.regions.is_empty()
                && self.activation_leaves.is_empty()
                && self.with_grad_fn.is_empty(),
        ));
        self.canonical = canonical;
    }

    /// The gradients stored so far, each owner with the `Malloc` of the requests being
    /// recorded that allocated it; `None` unless every gradient has one reference and no
    /// `grad_fn`, and is a plain tensor allocated by a recorded request or a view of one that
    /// nothing but gradients holds.
    pub(crate) fn stored_grads(&self) -> Option<StoredGrads> {
        let plain =
            |rec: &TensorRec| rec.base.is_none() && rec.grad_fn.is_none() && rec.param.is_none();
        let mut owner_ids: Vec<T> = Vec::new();
        // How many references each owner must have: those of the gradients alone.
        let mut holders: Vec<u32> = Vec::new();
        let mut stored = StoredGrads {
            owners: Vec::new(),
            grads: Vec::new(),
        };
        for (param, p) in self.params.iter().enumerate() {
            let Some(g) = p.grad else { continue };
            let rec = self.rec(g);
            if rec.refs != 1 || rec.grad_fn.is_some() || rec.param.is_some() {
                return None;
            }
            let (owner, view) = match rec.base {
                None => (g, None),
                Some(base) => (base, Some(rec.clone())),
            };
            let index = match owner_ids.iter().position(|&o| o == owner) {
                Some(index) => index,
                None => {
                    let owner_rec = self.rec(owner);
                    if !plain(owner_rec) {
                        return None;
                    }
                    let malloc = self.mem.recorded_malloc(owner_rec.allocation.as_ref()?)?;
                    owner_ids.push(owner);
                    holders.push(0);
                    stored.owners.push((owner_rec.clone(), malloc));
                    owner_ids.len() - 1
                }
            };
            holders[index] += 1;
            stored.grads.push(StoredGrad {
                param,
                owner: index,
                view,
            });
        }
        let held_by_grads_alone = owner_ids
            .iter()
            .zip(&holders)
            .all(|(&o, &n)| self.rec(o).refs == n);
        held_by_grads_alone.then_some(stored)
    }

    /// Stores `grads` again, on `allocations` (by the index of the `Malloc` that made each
    /// owner, as a replay of the recorded requests returns them).
    pub(crate) fn restore_grads(&mut self, grads: &StoredGrads, allocations: &[Allocation]) {
        let owners: Vec<T> = grads
            .owners
            .iter()
            .map(|(rec, malloc)| {
                self.new_tensor(TensorRec {
                    allocation: Some(allocations[*malloc as usize]),
                    ..rec.clone()
                })
            })
            .collect();
        for g in &grads.grads {
            let t = match &g.view {
                None => owners[g.owner],
                Some(rec) => self.new_tensor(TensorRec {
                    base: Some(owners[g.owner]),
                    ..rec.clone()
                }),
            };
            self.store_param_grad(g.param, t);
        }
    }
}
