//! Attention: the masks transformers builds (`masking_utils`), the SDPA backend PyTorch picks
//! for the inputs (`sdp_utils.cpp`), and what each backend allocates and saves.

use super::{AttentionImpl, Batch};
use crate::arch::{Architecture, Family};
use crate::dtype::DType;
use crate::sim::engine::component::Component;
use crate::sim::engine::tracer::{Bwd, Ring, T, Tracer};

/// The kernel behind `F.scaled_dot_product_attention`, in PyTorch 2.11's order of preference
/// on Hopper: flash (half precision, no mask), cuDNN (half precision with a mask), memory
/// efficient (fp32 without grouped-query attention), math (everything else).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Kernel {
    Flash,
    Cudnn,
    Efficient,
    Math,
}

fn select_kernel(dtype: DType, head_dim: u64, masked: bool, enable_gqa: bool) -> Kernel {
    let half = dtype.is_half();
    if half && !masked && head_dim <= 256 && head_dim.is_multiple_of(8) {
        Kernel::Flash
    } else if half && masked && head_dim <= 256 {
        Kernel::Cudnn
    } else if !enable_gqa && head_dim.is_multiple_of(4) {
        Kernel::Efficient
    } else {
        Kernel::Math
    }
}

/// The masks of one forward (`create_causal_mask` / `create_sliding_window_causal_mask`).
pub(crate) struct Masks {
    /// For layers of full attention; `None` when SDPA can use `is_causal` instead.
    full: Option<T>,
    /// For sliding-window layers.
    sliding: Option<T>,
}

impl Masks {
    /// Build the masks `Qwen2Model.forward` and siblings pass to their layers; `packed_4_57`:
    /// transformers 4.53-4.57's path without an `attention_mask` (see
    /// `ReleaseCode::materialises_causal_mask`), where the packed-sequence mask joins the mask
    /// function and SDPA gets a (b, 1, s, s) mask even where `is_causal` would do.
    pub(crate) fn create(
        t: &mut Tracer,
        a: &Architecture,
        batch: Batch,
        attention: AttentionImpl,
        dtype: DType,
        packed_4_57: bool,
    ) -> Masks {
        let outer = std::mem::replace(&mut t.component, Component::Activations);
        let window = a.sliding_window.filter(|_| a.family != Family::Gpt2);
        // Mistral and Phi-3 use one sliding-window mask for every layer; Gemma 2 and 3 and
        // gpt-oss mix sliding and full layers.
        let needs_full = window.is_none() || a.sliding_pattern.is_some();
        let needs_sliding = window.is_some();
        let build = |t: &mut Tracer, sliding: bool, packed: Option<T>| -> Option<T> {
            match (attention, packed) {
                (AttentionImpl::Sdpa, Some(_)) => Some(vmap_mask(t, batch, sliding)),
                (AttentionImpl::Sdpa, None) => {
                    // `_ignore_causal_mask_sdpa`: no mask while SDPA's `is_causal` can do it.
                    let needed = sliding && window.is_some_and(|w| batch.s >= w);
                    needed.then(|| bool_mask(t, batch, true))
                }
                (AttentionImpl::Eager, packed) => {
                    let b = match packed {
                        Some(_) => vmap_mask(t, batch, sliding),
                        None => bool_mask(t, batch, sliding),
                    };
                    // `torch.where(mask, 0, min_dtype)` on the mask expanded to the batch.
                    let scalars = [
                        t.empty(1, dtype, "where: 0"),
                        t.empty(1, dtype, "where: min"),
                    ];
                    let float = t.empty(
                        batch.b * batch.s * batch.s,
                        dtype,
                        "eager attention mask (b, 1, s, s)",
                    );
                    t.drop_all(&[scalars[0], scalars[1], b]);
                    Some(float)
                }
            }
        };
        let create = |t: &mut Tracer, needed: bool, sliding: bool| {
            needed.then(|| {
                if packed_4_57 {
                    // The mask function holds the packed-sequence mask until
                    // `create_causal_mask` returns.
                    let packed = packed_sequence_mask_4_57(t, batch);
                    let mask = build(t, sliding, Some(packed));
                    t.drop(packed);
                    mask
                } else {
                    find_packed_sequence_indices(t, batch);
                    build(t, sliding, None)
                }
            })
        };
        let full = create(t, needs_full, false).flatten();
        let sliding = create(t, needs_sliding, true).flatten();
        t.component = outer;
        Masks { full, sliding }
    }

    /// The mask of decoder layer `layer`.
    pub(crate) fn for_layer(&self, a: &Architecture, layer: usize) -> Option<T> {
        match a.sliding_pattern {
            // `layer_types`: sliding and full layers mixed.
            Some(_) if a.is_sliding(layer as u64) => self.sliding,
            Some(_) => self.full,
            None => self.sliding.or(self.full),
        }
    }

    pub(crate) fn release(self, t: &mut Tracer) {
        for m in [self.full, self.sliding].into_iter().flatten() {
            t.drop(m);
        }
    }
}

/// `masking_utils.find_packed_sequence_indices` on `position_ids` expanded to the batch: small
/// temporaries of every mask creation (they scale with b * s); 5.x returns `None` for unpacked
/// rows (`packed_sequence_mask[:, -1] == 0` throughout).
fn find_packed_sequence_indices(t: &mut Tracer, batch: Batch) {
    let outer = std::mem::replace(&mut t.component, Component::Inputs);
    let (first, diff, cumsum) = packed_sequence_cumsum(t, batch);
    let last = t.empty(batch.b, DType::Bool, "packed_sequence_mask[:, -1] == 0");
    let all = t.empty(1, DType::Bool, ".all()");
    t.drop_all(&[last, all, first, diff, cumsum]);
    t.component = outer;
}

/// transformers 4.57's `find_packed_sequence_indices`, whose result it always returns.
fn packed_sequence_mask_4_57(t: &mut Tracer, batch: Batch) -> T {
    let outer = std::mem::replace(&mut t.component, Component::Inputs);
    let (first, diff, cumsum) = packed_sequence_cumsum(t, batch);
    t.drop_all(&[first, diff]);
    t.component = outer;
    cumsum
}

/// `first_dummy_value = position_ids[:, :1] - 1`, `position_diff = torch.diff(position_ids,
/// prepend=first_dummy_value)` and `(position_diff != 1).cumsum(-1)`, which allocates its int64
/// output before the int64 copy of its boolean input: the two locals and the cumsum.
fn packed_sequence_cumsum(t: &mut Tracer, batch: Batch) -> (T, T, T) {
    let (b, n) = (batch.b, batch.n());
    let first = t.empty(b, DType::I64, "position_ids[:, :1] - 1");
    let prepended = t.empty(
        b * (batch.s + 1),
        DType::I64,
        "diff: cat(prepend, position_ids)",
    );
    let diff = t.empty(n, DType::I64, "position_diff");
    t.drop(prepended);
    let ne = t.empty(n, DType::Bool, "position_diff != 1");
    let cumsum = t.empty(n, DType::I64, "packed_sequence_mask");
    let as_long = t.empty(n, DType::I64, "cumsum input (int64)");
    t.drop_all(&[as_long, ne]);
    (first, diff, cumsum)
}

/// `sdpa_mask`: index aranges, then the (s, s) boolean pattern (a causal one, or the
/// sliding-window one built from `and_mask` of two predicates), broadcast to the batch.
fn bool_mask(t: &mut Tracer, batch: Batch, sliding: bool) -> T {
    let s = batch.s;
    let batch_arange = t.empty(batch.b, DType::I64, "mask: batch arange");
    let head_arange = t.empty(1, DType::I64, "mask: head arange");
    let mut aranges = Vec::new();
    for _ in 0..2 {
        let raw = t.empty(s, DType::I64, "mask: arange");
        let shifted = t.empty(s, DType::I64, "mask: arange + offset");
        t.drop(raw);
        aranges.push(shifted);
    }
    let mask = if sliding {
        sliding_causal(t, s, 1)
    } else {
        t.empty(s * s, DType::Bool, "causal: kv_idx <= q_idx")
    };
    t.drop_all(&[batch_arange, head_arange, aranges[0], aranges[1]]);
    mask
}

/// `and_masks(sliding_window_overlay(window), causal_mask_function)` over (query, key):
/// `and_mask`'s starting `new_ones` (`ones` bools), `q_idx - window`, the two predicates and
/// the two `&`s, each (query, key) result freed once the next exists.
fn sliding_causal(t: &mut Tracer, s: u64, ones: u64) -> T {
    let start = t.empty(ones, DType::Bool, "and_mask: new_ones");
    let shifted = t.empty(s, DType::I64, "sliding: q_idx - window");
    let window = t.empty(s * s, DType::Bool, "sliding: kv_idx > q_idx - window");
    t.drop(shifted);
    let first = t.empty(s * s, DType::Bool, "and_mask: &");
    t.drop_all(&[window, start]);
    let causal = t.empty(s * s, DType::Bool, "causal: kv_idx <= q_idx");
    let both = t.empty(s * s, DType::Bool, "and_mask: &");
    t.drop_all(&[causal, first]);
    both
}

/// transformers 4.57's `sdpa_mask_recent_torch` without the causal skip: `_vmap_for_bhqkv`
/// evaluates `and_masks(causal or sliding-causal, packed-sequence)` nested four vmaps deep
/// (key innermost), so every intermediate is as large as the index dimensions it depends on:
/// `and_mask`'s `q_idx.new_ones(())` one bool per query, the causal and sliding predicates one
/// per (query, key), the packed-sequence test one per (batch, query, key).
fn vmap_mask(t: &mut Tracer, batch: Batch, sliding: bool) -> T {
    let (b, s) = (batch.b, batch.s);
    let kv_arange = t.empty(s, DType::I64, "mask: kv arange");
    let batch_arange = t.empty(b, DType::I64, "mask: batch arange");
    let head_arange = t.empty(1, DType::I64, "mask: head arange");
    let ones = t.empty(s, DType::Bool, "and_mask: q_idx.new_ones(())");
    let pattern = if sliding {
        // `sliding_window_causal_mask_function`: itself an `and_masks`, whose `new_ones` is
        // batched over the queries too.
        sliding_causal(t, s, s)
    } else {
        t.empty(s * s, DType::Bool, "causal: kv_idx <= q_idx")
    };
    let pattern_and = t.empty(s * s, DType::Bool, "and_mask: &");
    t.drop_all(&[pattern, ones]);
    // `packed_sequence_mask[batch_idx, q_idx] == packed_sequence_mask[batch_idx, kv_idx]`:
    // each indexing broadcasts its two index tensors to (b, s) before gathering (b, s) values.
    let gather = |t: &mut Tracer| {
        let rows = t.empty(b * s, DType::I64, "index: batch_idx broadcast");
        let cols = t.empty(b * s, DType::I64, "index: position broadcast");
        let values = t.empty(b * s, DType::I64, "packed_sequence_mask[batch_idx, idx]");
        t.drop_all(&[cols, rows]);
        values
    };
    let (of_query, of_key) = (gather(t), gather(t));
    let same = t.empty(b * s * s, DType::Bool, "packed: same sequence");
    t.drop_all(&[of_query, of_key]);
    let mask = t.empty(b * s * s, DType::Bool, "causal mask (b, 1, s, s)");
    t.drop_all(&[same, pattern_and, kv_arange, batch_arange, head_arange]);
    mask
}

/// The shapes attention runs on: query heads, key/value heads, the query/key and value head
/// widths (they differ in MLA).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Heads {
    pub heads: u64,
    pub kv_heads: u64,
    pub qk_dim: u64,
    pub v_dim: u64,
    /// The query is a contiguous head-major tensor (MLA concatenates it): fused kernels then
    /// write their output head-major too, and `.transpose(1, 2).contiguous()` copies it.
    pub head_major_query: bool,
    /// transformers before 4.54: keys and values go through `repeat_kv` whatever the mask
    /// (no `enable_gqa`).
    pub repeated_inputs: bool,
    /// transformers 4.48 to 4.55's `sdpa_attention_forward`: query, key and value go through
    /// `.contiguous()`; the query's copy is head-major, so is a fused kernel's output.
    pub contiguous_inputs: bool,
}

impl Heads {
    pub(crate) fn of(a: &Architecture) -> Heads {
        match a.mla {
            Some(mla) => Heads {
                heads: a.heads,
                kv_heads: a.heads,
                qk_dim: mla.qk_head_dim(),
                v_dim: mla.v_head_dim,
                head_major_query: true,
                repeated_inputs: false,
                contiguous_inputs: false,
            },
            None => Heads {
                heads: a.heads,
                kv_heads: a.kv_heads,
                qk_dim: a.head_dim,
                v_dim: a.head_dim,
                head_major_query: false,
                repeated_inputs: false,
                contiguous_inputs: false,
            },
        }
    }

    /// Elements of the attention output, (b, s, heads * v_dim).
    fn out_numel(&self, batch: Batch) -> u64 {
        batch.n() * self.heads * self.v_dim
    }
}

/// The query of a fused attention kernel, (batch, heads, seq, head_dim): what its backward
/// sizes its own buffers by. Shared with `headroom::trace`, whose `attention_backward` events
/// carry these four numbers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct QueryShape {
    pub batch: u64,
    pub heads: u64,
    pub seq: u64,
    pub head_dim: u64,
}

/// What the memory-efficient backward allocates beside the gradients, in bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct EfficientBackward {
    /// Key blocks of 128 head-dim columns in fp32, and 4 KiB.
    pub workspace: u64,
    /// An fp32 accumulator the size of q.
    pub accumulator: u64,
    /// `delta` (and the contiguous log-sum-exp, of the same size): fp32 per padded row.
    pub delta: u64,
}

impl QueryShape {
    fn of(hd: Heads, batch: Batch) -> Self {
        QueryShape {
            batch: batch.b,
            heads: hd.heads,
            seq: batch.s,
            head_dim: hd.qk_dim,
        }
    }

    fn numel(&self) -> u64 {
        self.batch * self.heads * self.seq * self.head_dim
    }

    /// The one workspace of the flash and cuDNN backward over as many key rows as query rows.
    pub(crate) fn fused_backward_workspace(&self, gqa: bool, dtype_bytes: u64) -> u64 {
        self.fused_backward_workspace_over(self.seq, gqa, dtype_bytes)
    }

    /// The one workspace of the flash and cuDNN backward against `key_rows` key rows (a ring
    /// attention step attends part of its queries to a whole chunk): `softmax_d` (fp32 per query
    /// row, rows rounded to 128), an fp32 `dq_accum` (head dim rounded to 32) and 256 bytes;
    /// under grouped-query attention also dk and dv expanded to the query's heads
    /// (`key_rows` each), in the inputs' dtype of `dtype_bytes`.
    pub(crate) fn fused_backward_workspace_over(
        &self,
        key_rows: u64,
        gqa: bool,
        dtype_bytes: u64,
    ) -> u64 {
        let round = |x: u64, m: u64| x.div_ceil(m) * m;
        let (b, h) = (self.batch, self.heads);
        let (s_round, d_round) = (round(self.seq, 128), round(self.head_dim, 32));
        let mut workspace = b * h * s_round * 4 + b * s_round * h * d_round * 4 + 256;
        if gqa {
            workspace += 2 * b * key_rows * h * self.head_dim * dtype_bytes;
        }
        workspace
    }

    /// Elements of the memory-efficient kernel's log-sum-exp: rows padded to 32.
    pub(crate) fn efficient_lse_numel(&self) -> u64 {
        self.batch * self.heads * self.seq.div_ceil(32) * 32
    }

    pub(crate) fn efficient_backward(&self) -> EfficientBackward {
        EfficientBackward {
            workspace: self.batch * self.heads * self.seq * self.head_dim.div_ceil(128) * 128 * 4
                + 4096,
            accumulator: self.numel() * 4,
            delta: self.efficient_lse_numel() * 4,
        }
    }
}

/// `repeat_kv`: `x[:, :, None].expand(...).reshape(...)`, whose backward sums the groups back.
/// The reshape copies, except with one key/value head (multi-query attention): the size-1 head
/// dimension and the stride-0 group dimension merge into one stride-0 dimension, a view.
fn repeat_kv(t: &mut Tracer, x: T, groups: u64, kv_heads: u64) -> T {
    if groups == 1 {
        return t.share(x);
    }
    let numel = t.numel(x) * groups;
    let out = if kv_heads == 1 {
        t.view(x, numel, "repeat_kv (a view of the one head)")
    } else {
        t.empty(numel, t.dtype(x), "repeat_kv")
    };
    t.record(Bwd::Reduce, &[Some(x)], &[out], &[]);
    out
}

/// The math kernel's `repeat_interleave` of keys and values over the query groups: a copy.
fn repeat_interleave(t: &mut Tracer, x: T, groups: u64) -> T {
    let out = t.empty(t.numel(x) * groups, t.dtype(x), "repeat_interleave");
    t.record(Bwd::Reduce, &[Some(x)], &[out], &[]);
    out
}

/// The attention of one layer: q (b, heads, s, qk), k (b, kv_heads, s, qk) and v
/// (b, kv_heads, s, v) after rotary embeddings. Returns the output as (b, s, heads * v),
/// ready for `o_proj`. `sinks`: gpt-oss's per-head sink logits.
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention(
    t: &mut Tracer,
    a: &Architecture,
    hd: Heads,
    implementation: AttentionImpl,
    q: T,
    k: T,
    v: T,
    mask: Option<T>,
    batch: Batch,
    dropout: bool,
    sinks: Option<T>,
) -> T {
    match (implementation, sinks) {
        (AttentionImpl::Eager, Some(sinks)) => eager_with_sinks(t, hd, q, k, v, mask, batch, sinks),
        (AttentionImpl::Sdpa, _) => sdpa(t, hd, q, k, v, mask, batch, dropout),
        (AttentionImpl::Eager, None) => eager(t, a, hd, q, k, v, mask, batch, dropout),
    }
}

/// `sdpa_attention_forward`: grouped-query attention goes to SDPA with `enable_gqa` unless a
/// mask is given (then `repeat_kv` in Python); autocast casts fp32 operands (value, key, query:
/// C++ argument order); the output's `.transpose(1, 2).contiguous()` copies what the kernel
/// returns head-major.
#[allow(clippy::too_many_arguments)]
fn sdpa(
    t: &mut Tracer,
    hd: Heads,
    q: T,
    k: T,
    v: T,
    mask: Option<T>,
    batch: Batch,
    dropout: bool,
) -> T {
    let groups = hd.heads / hd.kv_heads;
    let enable_gqa = !hd.repeated_inputs && groups > 1 && mask.is_none() && hd.qk_dim <= 256;
    let (k, v) = if enable_gqa {
        (t.share(k), t.share(v))
    } else {
        (
            repeat_kv(t, k, groups, hd.kv_heads),
            repeat_kv(t, v, groups, hd.kv_heads),
        )
    };
    let (q, k, v) = if hd.contiguous_inputs {
        // `repeat_kv`'s copy is contiguous already; the rotated query, and keys and values
        // left as views (one group, or one head), are copied.
        let copied = |t: &mut Tracer, x: T, already: bool| {
            let out = if already {
                t.share(x)
            } else {
                t.contiguous_copy(x)
            };
            t.drop(x);
            out
        };
        let q = t.share(q);
        let q = copied(t, q, hd.head_major_query);
        let repeated = groups > 1 && hd.kv_heads > 1;
        (q, copied(t, k, repeated), copied(t, v, repeated))
    } else {
        (t.share(q), k, v)
    };
    let head_major = hd.head_major_query || hd.contiguous_inputs;
    let v_c = t.autocast_input(v);
    let k_c = t.autocast_input(k);
    let q_c = t.autocast_input(q);
    t.drop_all(&[q, k, v]);
    let dtype = t.dtype(q_c);
    // `convert_boolean_attn_mask`: a boolean mask becomes an additive one, (b, 1, s, s).
    let bias = mask.map(|_| {
        let zero = t.empty(1, dtype, "mask: 0");
        let ninf = t.empty(1, dtype, "mask: -inf");
        let bias = t.empty(
            batch.b * batch.s * batch.s,
            dtype,
            "additive attention mask",
        );
        t.drop_all(&[zero, ninf]);
        bias
    });
    let kernel = select_kernel(dtype, hd.qk_dim, mask.is_some(), enable_gqa);
    let out = match kernel {
        Kernel::Flash | Kernel::Cudnn => {
            let out = fused(t, hd, kernel, q_c, k_c, v_c, bias, batch, enable_gqa);
            if head_major {
                let copy = t.contiguous_copy(out);
                t.drop(out);
                copy
            } else {
                out
            }
        }
        Kernel::Efficient => efficient(t, hd, q_c, k_c, v_c, bias, batch, dropout),
        Kernel::Math => {
            let out = math(t, hd, q_c, k_c, v_c, bias, batch, enable_gqa);
            // `attn_output.transpose(1, 2).contiguous()`
            let copy = t.contiguous_copy(out);
            t.drop(out);
            copy
        }
    };
    if let Some(bias) = bias {
        t.drop(bias);
    }
    t.drop_all(&[q_c, k_c, v_c]);
    out
}

/// `sdpa_attention_forward` under context parallelism over `cp` ranks, on rank `rank`: SDPA's
/// flash kernel with `enable_gqa` as [`sdpa`] picks it, run as torch's ring
/// (`Tracer::ring_attention`) on this rank's `batch.s` rows; the output comes back head-major
/// where a partial step's `torch.cat` made it so, and `.transpose(1, 2).contiguous()` copies
/// it; the last rank runs only full steps, and its output is already sequence-major. The flash
/// backward's workspace is sized by the query rows of each step (all of them at step 0 and in a
/// full step, the second half in a partial one) and, under grouped-query attention, by the key
/// rows (half the chunk in a full step).
#[allow(clippy::too_many_arguments)]
pub(crate) fn ring(
    t: &mut Tracer,
    hd: Heads,
    q: T,
    k: T,
    v: T,
    batch: Batch,
    cp: u64,
    rank: u64,
) -> T {
    let dtype = t.dtype(q);
    let gqa = hd.heads != hd.kv_heads;
    let workspace = |rows: u64, key_rows: u64| {
        let shape = QueryShape {
            seq: rows,
            ..QueryShape::of(hd, batch)
        };
        shape.fused_backward_workspace_over(key_rows, gqa, dtype.bytes())
    };
    let ring = Ring {
        cp,
        rank,
        batch: batch.b,
        heads: hd.heads,
        kv_heads: hd.kv_heads,
        seq: batch.s,
        head_dim: hd.qk_dim,
        workspace_full: workspace(batch.s, batch.s),
        workspace_partial: workspace(batch.s / 2, batch.s),
        workspace_half_keys: workspace(batch.s, batch.s / 2),
    };
    let out = t.ring_attention(ring, q, k, v);
    if ring.only_full_steps() {
        // The merger's output kept the flash kernel's sequence-major layout through every
        // full step's elementwise merge: the transpose is contiguous already, a view.
        return out;
    }
    let copy = t.contiguous_copy(out);
    t.drop(out);
    copy
}

/// Flash attention and cuDNN attention: output in the query's layout, fp32 log-sum-exp per
/// row, a philox seed and offset. Backward: dq, dk, dv and one workspace (`softmax_d` and an
/// fp32 `dq_accum`, plus head-expanded dk/dv under GQA).
#[allow(clippy::too_many_arguments)]
fn fused(
    t: &mut Tracer,
    hd: Heads,
    kernel: Kernel,
    q: T,
    k: T,
    v: T,
    bias: Option<T>,
    batch: Batch,
    gqa: bool,
) -> T {
    let dtype = t.dtype(q);
    let seeds = [
        t.empty(1, DType::I64, "philox seed"),
        t.empty(1, DType::I64, "philox offset"),
    ];
    let out = t.empty(hd.out_numel(batch), dtype, "attention output");
    let lse = t.empty(
        batch.b * hd.heads * batch.s,
        DType::F32,
        "attention logsumexp",
    );
    let scratch = t.empty(256, DType::U8, "attention forward scratch");
    t.drop(scratch);
    let workspace = QueryShape::of(hd, batch).fused_backward_workspace(gqa, dtype.bytes());
    // Saved in the order the backward nodes release them.
    let mut saved = Vec::with_capacity(8);
    if kernel == Kernel::Cudnn {
        saved.extend(bias);
    }
    saved.extend([k, q, v, lse, out, seeds[0], seeds[1]]);
    let op = match kernel {
        Kernel::Cudnn => Bwd::SdpaCudnn { workspace },
        _ => Bwd::SdpaFlash { workspace },
    };
    t.record(op, &[Some(q), Some(k), Some(v)], &[out, lse], &saved);
    t.drop_all(&[lse, seeds[0], seeds[1]]);
    out
}

/// The memory-efficient (cutlass) kernel: output, log-sum-exp padded to 32 rows. Backward
/// allocates dq, dk, dv, an fp32 accumulator the size of q, `delta`, and a workspace of key
/// blocks of 128 head-dim columns.
#[allow(clippy::too_many_arguments)]
fn efficient(
    t: &mut Tracer,
    hd: Heads,
    q: T,
    k: T,
    v: T,
    bias: Option<T>,
    batch: Batch,
    _dropout: bool,
) -> T {
    let shape = QueryShape::of(hd, batch);
    debug_assert_eq!(t.numel(q), shape.numel(), "q is (b, heads, s, qk_dim)");
    let out = t.empty(hd.out_numel(batch), t.dtype(q), "attention output");
    let lse = t.empty(
        shape.efficient_lse_numel(),
        DType::F32,
        "attention logsumexp",
    );
    let EfficientBackward {
        workspace,
        accumulator,
        delta,
    } = shape.efficient_backward();
    let mut saved = Vec::with_capacity(6);
    saved.extend(bias);
    saved.extend([q, k, v, lse, out]);
    t.record(
        Bwd::SdpaEfficient {
            workspace,
            accumulator,
            delta,
        },
        &[Some(q), Some(k), Some(v)],
        &[out, lse],
        &saved,
    );
    t.drop(lse);
    out
}

/// `_scaled_dot_product_attention_math`: composite ops, each recorded by autograd.
#[allow(clippy::too_many_arguments)]
fn math(
    t: &mut Tracer,
    hd: Heads,
    q: T,
    k: T,
    v: T,
    bias: Option<T>,
    batch: Batch,
    gqa: bool,
) -> T {
    let groups = hd.heads / hd.kv_heads;
    let q_scaled = t.mul_scalar(q);
    // is_causal: `ones(L, S).tril()` made additive with `where`.
    let causal = bias.is_none().then(|| {
        let ones = t.empty(batch.s * batch.s, DType::Bool, "math: ones(L, S)");
        let tril = t.empty(batch.s * batch.s, DType::Bool, "math: tril");
        t.drop(ones);
        let zero = t.empty(1, t.dtype(q), "math: 0");
        let ninf = t.empty(1, t.dtype(q), "math: -inf");
        let mask = t.empty(batch.s * batch.s, t.dtype(q), "math: causal mask");
        t.drop_all(&[zero, ninf, tril]);
        mask
    });
    let (k_exp, v_exp) = if gqa {
        (
            repeat_interleave(t, k, groups),
            repeat_interleave(t, v, groups),
        )
    } else {
        (t.share(k), t.share(v))
    };
    // `key.transpose(-2, -1) * scaling_factor`, made contiguous by matmul's reshape.
    let k_scaled = t.mul_scalar(k_exp);
    let k_copy = t.contiguous_copy(k_scaled);
    let scores_numel = batch.b * hd.heads * batch.s * batch.s;
    let scores = t.bmm(q_scaled, k_copy, scores_numel);
    t.drop_all(&[k_copy, q_scaled]);
    // `_safe_softmax`: softmax, then rows that were all -inf set to 0 (small temporaries).
    let probs = t.empty(scores_numel, t.dtype(scores), "math: softmax");
    t.record(Bwd::Softmax, &[Some(scores)], &[probs], &[probs]);
    let all_masked = t.empty(scores_numel, DType::Bool, "safe_softmax: == -inf");
    let rows = t.empty(
        batch.b * hd.heads * batch.s,
        DType::Bool,
        "safe_softmax: all()",
    );
    let zero = t.empty(1, t.dtype(scores), "safe_softmax: 0");
    t.drop_all(&[zero, rows, all_masked, scores]);
    let out = t.bmm(probs, v_exp, hd.out_numel(batch));
    t.drop_all(&[probs, k_scaled, k_exp, v_exp]);
    if let Some(mask) = causal {
        t.drop(mask);
    }
    out
}

/// The scaled scores of eager attention, with the repeated keys and values the rest uses.
struct Scores {
    logits: T,
    k_rep: T,
    v_rep: T,
}

/// `repeat_kv` of keys and values, then `matmul(q, k.transpose) * scaling`. matmul copies an
/// operand whose batch dimensions do not fold into one stride: the rotated query of the usual
/// `(b, s, heads, d)` layout; MLA's concatenated query and fresh keys are contiguous.
fn scaled_scores(t: &mut Tracer, hd: Heads, q: T, k: T, v: T, batch: Batch) -> Scores {
    let groups = hd.heads / hd.kv_heads;
    let k_rep = repeat_kv(t, k, groups, hd.kv_heads);
    let v_rep = repeat_kv(t, v, groups, hd.kv_heads);
    let operand = if hd.head_major_query {
        t.share(k_rep)
    } else {
        t.contiguous_copy(k_rep)
    };
    // matmul copies an operand it cannot reshape to (b * heads, ., .) as a view: a query that is
    // still a projection's `.transpose(1, 2)` view (no rotary embedding: GPT-2). A rotated query
    // is laid out token-major too, but its copy and the transposed keys' (head-major after
    // `repeat_kv`) trade places at equal size: the keys' copy above stands for it.
    let query = if !hd.head_major_query && t.is_view(q) {
        t.contiguous_copy(q)
    } else {
        t.share(q)
    };
    let scores = t.bmm(query, operand, batch.b * hd.heads * batch.s * batch.s);
    t.drop_all(&[query, operand]);
    let logits = t.mul_scalar(scores);
    t.drop(scores);
    Scores {
        logits,
        k_rep,
        v_rep,
    }
}

/// `eager_attention_forward`: `repeat_kv`, scores (matmul copies the transposed keys), scale,
/// soft-cap, additive mask, fp32 softmax cast back, dropout, matmul, transpose-contiguous.
#[allow(clippy::too_many_arguments)]
fn eager(
    t: &mut Tracer,
    a: &Architecture,
    hd: Heads,
    q: T,
    k: T,
    v: T,
    mask: Option<T>,
    batch: Batch,
    dropout: bool,
) -> T {
    let Scores {
        mut logits,
        k_rep,
        v_rep,
    } = scaled_scores(t, hd, q, k, v, batch);
    if a.attn_logit_softcapping.is_some() {
        let div = t.mul_scalar(logits);
        t.drop(logits);
        let th = t.tanh(div);
        t.drop(div);
        logits = t.mul_scalar(th);
        t.drop(th);
    }
    if let Some(mask) = mask {
        let masked = t.add(logits, mask);
        t.drop(logits);
        logits = masked;
    }
    // `attn_weights = softmax(attn_weights, dtype=float32).to(query.dtype)`: the name lets go
    // of the scores once the cast exists.
    let probs32 = t.softmax_f32(logits);
    let mut probs = t.to(probs32, t.dtype(q));
    t.drop_all(&[probs32, logits]);
    if dropout {
        let dropped = t.dropout(probs);
        t.drop(probs);
        probs = dropped;
    }
    // matmul reshapes the values to (b * heads, s, v) and copies what is not laid out
    // head-major: a projection's `.transpose(1, 2)` view (one query per key head, where
    // `repeat_kv` returns it as it is), multi-query attention's stride-0 head dimension,
    // MLA's strided slice of the expanded latent. Only `repeat_kv`'s copy is head-major.
    let repeated_copy = hd.heads > hd.kv_heads && hd.kv_heads > 1;
    let values = if hd.head_major_query || !repeated_copy {
        t.contiguous_copy(v_rep)
    } else {
        t.share(v_rep)
    };
    let out_bhsd = t.bmm(probs, values, hd.out_numel(batch));
    t.drop_all(&[probs, values]);
    let out = t.contiguous_copy(out_bhsd);
    t.drop_all(&[out_bhsd, k_rep, v_rep]);
    out
}

/// gpt-oss's `eager_attention_forward`: the scores gain a sink column per head
/// (`cat([scores, sinks])`, (b, h, s, s + 1)), the row maximum is subtracted, and the softmax
/// runs in the scores' dtype; the sink column is sliced off before the product with v.
#[allow(clippy::too_many_arguments)]
fn eager_with_sinks(
    t: &mut Tracer,
    hd: Heads,
    q: T,
    k: T,
    v: T,
    mask: Option<T>,
    batch: Batch,
    sinks: T,
) -> T {
    let rows = batch.b * hd.heads * batch.s;
    let Scores {
        mut logits,
        k_rep,
        v_rep,
    } = scaled_scores(t, hd, q, k, v, batch);
    if let Some(mask) = mask {
        let masked = t.add(logits, mask);
        t.drop(logits);
        logits = masked;
    }
    // sinks.reshape(1, -1, 1, 1).expand(b, -1, s, -1)
    let sink_column = t.view(sinks, rows, "sinks.expand(b, h, s, 1)");
    t.record(Bwd::Reduce, &[Some(sinks)], &[sink_column], &[]);
    let combined = t.cat2(logits, sink_column);
    t.drop_all(&[logits, sink_column]);
    let (max_values, max_indices) = t.max_last(combined, rows);
    let shifted = t.add(combined, max_values);
    t.drop_all(&[combined, max_values, max_indices]);
    let probs = t.softmax(shifted);
    t.drop(shifted);
    let scores = t.slice(probs, rows * batch.s);
    t.drop(probs);
    let out_bhsd = t.bmm(scores, v_rep, hd.out_numel(batch));
    t.drop(scores);
    let out = t.contiguous_copy(out_bhsd);
    t.drop_all(&[out_bhsd, k_rep, v_rep]);
    out
}
