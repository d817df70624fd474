//! Megatron-core 0.19's `MLP` (`transformer/mlp.py`) as the local layer spec builds it: a dense
//! layer's MLP and each of `SequentialMLP`'s experts.

use crate::sim::engine::tracer::{Bwd, ParamId, T, Tracer};

/// `MLP.forward` on `x` with this rank's MLP width `f`: `linear_fc1`, `glu` (`chunk`,
/// `silu(x0) * (x1 + offset)`), an expert's `per_token_scale` (`* probs.unsqueeze(-1)`, its
/// routing probabilities), `linear_fc2`.
pub(crate) fn mlp(
    t: &mut Tracer,
    fc1: ParamId,
    fc2: ParamId,
    f: u64,
    h: u64,
    x: T,
    per_token_scale: Option<T>,
) -> T {
    let up = t.linear(x, fc1, None, 2 * f, false);
    let half = t.numel(up) / 2;
    let halves = [
        t.view(up, half, "x[0] (chunk)"),
        t.view(up, half, "x[1] (chunk)"),
    ];
    t.record(Bwd::Split, &[Some(up)], &halves, &[]);
    t.drop(up);
    let act = t.silu(halves[0]);
    // `x_linear + config.glu_linear_offset`: a new tensor even for an offset of 0.
    let linear = t.add_scalar(halves[1]);
    let mut gated = t.mul(act, linear);
    t.drop_all(&[linear, act, halves[0], halves[1]]);
    if let Some(scale) = per_token_scale {
        let scaled = t.mul(gated, scale);
        t.drop(gated);
        gated = scaled;
    }
    let out = t.linear(gated, fc2, None, h, false);
    t.drop(gated);
    out
}
