//! Megatron-core 0.19's `MLP` (`transformer/mlp.py`) as the local layer spec builds it: a dense
//! layer's MLP and each of `SequentialMLP`'s experts.

use super::megatron_sp::{SequenceParallel, column_parallel, row_parallel};
use crate::sim::engine::tracer::{Bwd, ParamId, T, Tracer};

/// `MLP.forward` on `x` with this rank's MLP width `f`: `linear_fc1`, `glu` (`chunk`,
/// `silu(x0) * (x1 + offset)`), an expert's `per_token_scale` (`* probs.unsqueeze(-1)`, its
/// routing probabilities, in the router's dtype), `linear_fc2`; a dense layer's under sequence parallelism `sp`.
pub(crate) fn mlp(
    t: &mut Tracer,
    (fc1, fc2): (ParamId, ParamId),
    f: u64,
    h: u64,
    x: T,
    per_token_scale: Option<T>,
    sp: Option<SequenceParallel>,
) -> T {
    let up = column_parallel(t, x, fc1, 2 * f, sp);
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
        // `(x * per_token_scale.unsqueeze(-1)).to(original_dtype)`: fp32 probabilities make
        // the product fp32, cast back as the name is rebound.
        let dtype = t.dtype(gated);
        let scaled = t.mul(gated, scale);
        t.drop(gated);
        gated = t.to(scaled, dtype);
        t.drop(scaled);
    }
    let out = row_parallel(t, gated, fc2, h, sp);
    t.drop(gated);
    out
}
