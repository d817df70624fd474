//! `optimizer.step()` and `zero_grad(set_to_none=True)`: the states created at the first step
//! and the temporaries of each implementation (`torch/optim/adam.py`, `sgd.py`,
//! `_adafactor.py`, `bitsandbytes/optim`).

use super::engine::component::Component;
use super::engine::tracer::{ParamId, T, Tracer};
use crate::dtype::DType;
use crate::spec::Optimizer;

/// Optimizer state across steps.
pub(crate) struct OptimizerState {
    kind: Optimizer,
    /// Per trainable parameter, its state tensors (created at the first step).
    states: Vec<Vec<T>>,
}

impl OptimizerState {
    pub(crate) fn new(kind: Optimizer) -> Self {
        OptimizerState {
            kind,
            states: Vec::new(),
        }
    }

    /// Every state tensor, in order (for comparing states between steps).
    pub(crate) fn tensors(&self) -> impl Iterator<Item = T> + '_ {
        self.states.iter().flatten().copied()
    }

    /// One `optimizer.step()` over `params` (the trainable ones, in `model.parameters()` order).
    pub(crate) fn step(&mut self, t: &mut Tracer, params: &[ParamId]) {
        match self.kind {
            Optimizer::None => {}
            Optimizer::AdamW => self.adam_foreach(t, params),
            Optimizer::AdamWFused => self.adam_fused(t, params),
            Optimizer::AdamWForLoop => self.adam_forloop(t, params),
            Optimizer::Sgd => self.sgd_foreach(t, params),
            Optimizer::Adafactor => self.adafactor(t, params),
            Optimizer::AdamW8bit => self.adamw_8bit(t, params),
        }
    }

    fn init_states(
        &mut self,
        t: &mut Tracer,
        params: &[ParamId],
        per_param: &dyn Fn(&mut Tracer, T) -> Vec<T>,
    ) {
        if !self.states.is_empty() {
            return;
        }
        let outer = std::mem::replace(&mut t.component, Component::OptimizerStates);
        for &p in params {
            let tensor = t.param(p);
            let state = per_param(t, tensor);
            self.states.push(state);
        }
        t.component = outer;
    }

    /// `_multi_tensor_adam`: states `exp_avg`, `exp_avg_sq` (`zeros_like(p)`), then per
    /// (device, dtype) group one `_foreach_sqrt(exp_avg_sqs)` the size of the group's params,
    /// alive until the function returns.
    fn adam_foreach(&mut self, t: &mut Tracer, params: &[ParamId]) {
        self.init_states(t, params, &|t, p| {
            let (n, d) = (t.numel(p), t.dtype(p));
            vec![t.empty(n, d, "exp_avg"), t.empty(n, d, "exp_avg_sq")]
        });
        let outer = std::mem::replace(&mut t.component, Component::OptimizerTemporaries);
        let mut lists: Vec<Vec<T>> = Vec::new();
        for group in dtype_groups(t, params) {
            let sqrt: Vec<T> = group
                .iter()
                .map(|&i| {
                    let s = self.states[i][1];
                    t.empty(t.numel(s), t.dtype(s), "_foreach_sqrt(exp_avg_sq)")
                })
                .collect();
            // `exp_avg_sq_sqrt` is reassigned per group: the previous list dies after the new one exists.
            if let Some(previous) = lists.pop() {
                free_list(t, previous);
            }
            lists.push(sqrt);
        }
        for list in lists {
            free_list(t, list);
        }
        t.component = outer;
    }

    /// `_fused_adamw_`: states plus a device `step` scalar per parameter; no temporaries.
    fn adam_fused(&mut self, t: &mut Tracer, params: &[ParamId]) {
        self.init_states(t, params, &|t, p| {
            let (n, d) = (t.numel(p), t.dtype(p));
            vec![
                t.empty(1, DType::F32, "step (device)"),
                t.empty(n, d, "exp_avg"),
                t.empty(n, d, "exp_avg_sq"),
            ]
        });
    }

    /// `_single_tensor_adam`: per parameter, `denom = (exp_avg_sq.sqrt() / bc2_sqrt).add_(eps)`.
    fn adam_forloop(&mut self, t: &mut Tracer, params: &[ParamId]) {
        self.init_states(t, params, &|t, p| {
            let (n, d) = (t.numel(p), t.dtype(p));
            vec![t.empty(n, d, "exp_avg"), t.empty(n, d, "exp_avg_sq")]
        });
        let outer = std::mem::replace(&mut t.component, Component::OptimizerTemporaries);
        let mut denom: Option<T> = None;
        for i in 0..params.len() {
            let s = self.states[i][1];
            let sqrt = t.empty(t.numel(s), t.dtype(s), "exp_avg_sq.sqrt()");
            let div = t.empty(t.numel(s), t.dtype(s), "denom");
            t.drop(sqrt);
            if let Some(old) = denom.replace(div) {
                t.drop(old);
            }
        }
        if let Some(old) = denom {
            t.drop(old);
        }
        t.component = outer;
    }

    /// `_multi_tensor_sgd` with momentum: the first step clones each gradient into its
    /// momentum buffer.
    fn sgd_foreach(&mut self, t: &mut Tracer, params: &[ParamId]) {
        self.init_states(t, params, &|t, p| {
            vec![t.empty(t.numel(p), t.dtype(p), "momentum_buffer")]
        });
    }
}

impl OptimizerState {
    /// `_single_tensor_adafactor` (torch's Adafactor does not default to foreach): factored
    /// second moments (`row_var`, `col_var`) for matrices, a full `variance` for vectors; per
    /// parameter a full-size `var_estimate` that lives until the next parameter's replaces it.
    fn adafactor(&mut self, t: &mut Tracer, params: &[ParamId]) {
        let first = self.states.is_empty();
        let outer = std::mem::replace(&mut t.component, Component::OptimizerTemporaries);
        // Locals of the loop that survive into the next iteration.
        let (mut row_mean, mut col_mean, mut squared, mut update): (
            Option<T>,
            Option<T>,
            Option<T>,
            Option<T>,
        ) = (None, None, None, None);
        let replace = |t: &mut Tracer, slot: &mut Option<T>, new: T| {
            if let Some(old) = slot.replace(new) {
                t.drop(old);
            }
        };
        for (i, &p) in params.iter().enumerate() {
            let tensor = t.param(p);
            let grad = t.params[p]
                .grad
                .expect("a trainable parameter has a gradient at step()");
            let dtype = t.dtype(grad);
            if first {
                t.component = Component::OptimizerStates;
                let state = match t.params[p].matrix {
                    Some((rows, cols)) => vec![
                        t.empty(rows, dtype, "row_var"),
                        t.empty(cols, dtype, "col_var"),
                    ],
                    None => vec![t.empty(t.numel(tensor), dtype, "variance")],
                };
                self.states.push(state);
                t.component = Component::OptimizerTemporaries;
            }
            debug_assert!(i < self.states.len());
            let norm = t.empty(1, DType::F32, "param.norm(2)");
            t.drop(norm);
            let estimate = match t.params[p].matrix {
                Some((rows, cols)) => {
                    let r = t.empty(rows, dtype, "row_mean");
                    replace(t, &mut row_mean, r);
                    let c = t.empty(cols, dtype, "col_mean");
                    replace(t, &mut col_mean, c);
                    let estimate = t.empty(rows * cols, dtype, "var_estimate = row_var @ col_var");
                    let mean = t.empty(1, dtype, "row_var.mean()");
                    t.drop(mean);
                    estimate
                }
                None => {
                    let sq = t.empty(t.numel(tensor), dtype, "grad * grad");
                    replace(t, &mut squared, sq);
                    t.empty(t.numel(tensor), dtype, "var_estimate = variance.clone()")
                }
            };
            replace(t, &mut update, estimate);
            let norm = t.empty(1, DType::F32, "update.norm(2)");
            t.drop(norm);
        }
        for slot in [update, row_mean, col_mean, squared].into_iter().flatten() {
            t.drop(slot);
        }
        t.component = outer;
    }

    /// `bitsandbytes.optim.AdamW8bit`: per parameter, created at its first update, uint8
    /// `state1`/`state2` with fp32 block-wise `absmax1`/`absmax2` (blocks of 256) for tensors of
    /// 4096 elements or more (`min_8bit_size`), fp32 states below; the two 256-entry quantile
    /// maps are moved to the GPU once. The update kernels work in place.
    fn adamw_8bit(&mut self, t: &mut Tracer, params: &[ParamId]) {
        if !self.states.is_empty() {
            return;
        }
        let outer = std::mem::replace(&mut t.component, Component::OptimizerStates);
        let mut qmaps = false;
        for &p in params {
            let n = t.numel(t.param(p));
            let state = if n < 4096 {
                vec![
                    t.empty(n, DType::F32, "state1 (fp32)"),
                    t.empty(n, DType::F32, "state2 (fp32)"),
                ]
            } else {
                if !qmaps {
                    qmaps = true;
                    for label in ["qmap dynamic", "qmap udynamic"] {
                        let q = t.empty(256, DType::F32, label);
                        t.mark_persistent(q);
                    }
                }
                let blocks = n.div_ceil(256);
                vec![
                    t.empty(n, DType::U8, "state1 (uint8)"),
                    t.empty(n, DType::U8, "state2 (uint8)"),
                    t.empty(blocks, DType::F32, "absmax1"),
                    t.empty(blocks, DType::F32, "absmax2"),
                ]
            };
            self.states.push(state);
        }
        t.component = outer;
    }
}

/// `torch.nn.utils.clip_grad_norm_(params, max_norm)` with foreach (every gradient on the
/// GPU), as `Trainer` calls it before each step: per (device, dtype) group one `_foreach_norm`
/// (`foreach_tensor_norm_cuda`: a zeroed fp32 buffer of `ntensors × max_chunks` partial sums,
/// `kChunkSize` 65,536 elements, freed when the call returns, and one 0-dim result per
/// gradient), `torch.stack` of the norms, `vector_norm` of the stack, the clip coefficient
/// and its clamp, then `_foreach_mul_` in place. Returns the total norm, which the trainer
/// keeps for logging until the next step.
pub(crate) fn clip_grad_norm(t: &mut Tracer, params: &[ParamId]) -> Option<T> {
    const CHUNK: u64 = 65_536;
    let grads: Vec<T> = params.iter().filter_map(|&p| t.params[p].grad).collect();
    if grads.is_empty() {
        return None;
    }
    let outer = std::mem::replace(&mut t.component, Component::OptimizerTemporaries);
    let mut groups: Vec<(DType, Vec<T>)> = Vec::new();
    for &g in &grads {
        let d = t.dtype(g);
        match groups.iter_mut().find(|(gd, _)| *gd == d) {
            Some((_, list)) => list.push(g),
            None => groups.push((d, vec![g])),
        }
    }
    let mut norms: Vec<T> = Vec::new();
    for (dtype, group) in &groups {
        let chunks = group
            .iter()
            .map(|&g| t.numel(g).div_ceil(CHUNK))
            .max()
            .unwrap_or(0);
        let partial = t.empty(
            group.len() as u64 * chunks,
            dtype.opmath(),
            "_foreach_norm: output_per_tensor",
        );
        for _ in group {
            norms.push(t.empty(1, *dtype, "_foreach_norm: per-tensor norm"));
        }
        t.drop(partial);
    }
    let first = t.dtype(norms[0]);
    let stacked = t.empty(norms.len() as u64, first, "torch.stack(norms)");
    let total = t.empty(1, first, "total_norm (vector_norm)");
    t.drop(stacked);
    let coef = t.empty(1, first, "clip_coef = max_norm / (total_norm + 1e-6)");
    let clamped = t.empty(1, first, "clip_coef_clamped");
    t.drop_all(&[coef, clamped]);
    free_list(t, norms);
    t.component = outer;
    Some(total)
}

/// Trainable parameters grouped by dtype, as `_group_tensors_by_device_and_dtype` does
/// (groups in order of first appearance). Returns indices into `params`.
fn dtype_groups(t: &Tracer, params: &[ParamId]) -> Vec<Vec<usize>> {
    let mut groups: Vec<(DType, Vec<usize>)> = Vec::new();
    for (i, &p) in params.iter().enumerate() {
        let d = t.dtype(t.param(p));
        match groups.iter_mut().find(|(gd, _)| *gd == d) {
            Some((_, g)) => g.push(i),
            None => groups.push((d, vec![i])),
        }
    }
    groups.into_iter().map(|(_, g)| g).collect()
}

/// A Python list of tensors is freed last element first.
fn free_list(t: &mut Tracer, list: Vec<T>) {
    for x in list.into_iter().rev() {
        t.drop(x);
    }
}
