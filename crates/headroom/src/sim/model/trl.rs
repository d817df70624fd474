//! TRL 1.16's training forwards: the fused LM head `add_fused_lm_head` patches onto the model
//! (`trl/trainer/utils.py`, `_fused_forward`) with its `_ChunkedLogProbFunction`
//! (`trl/kernels/chunked_logprob.py`), which scores only the tokens whose label is not -100,
//! tile by tile, and never builds `[batch, seq, vocab]` logits; and the losses each trainer
//! computes from it. Sizes follow the CUDA path (Triton present: only valid positions are
//! gathered and scored).

use super::Batch;
use super::heads::sequence_classification;
use super::transformer::Model;
use crate::dtype::DType;
use crate::sim::engine::component::Component;
use crate::sim::engine::tracer::{Bwd, ChunkedLogProb, T, Tracer};

/// What `_fused_forward` returns that the trainers use, each `[rows, seq - 1]` after
/// `masked_scatter` into zeros (the scored positions filled in).
pub(crate) struct FusedOutput {
    /// Per-token log-probs; differentiable.
    pub log_probs: T,
    /// Per-token entropy, when asked for.
    pub entropy: Option<T>,
    /// Whether the label is the arg-max, when asked for (SFT's token accuracy).
    pub is_top1: Option<T>,
    /// The mean logit of each scored position, when asked for (DPO's logits metrics).
    pub mean_logits: Option<T>,
    /// `labels != -100`, `[rows, seq - 1]` bool.
    pub mask: T,
    /// The fused forward's own loss and the clamped token count it divides by.
    loss: [T; 2],
}

impl FusedOutput {
    /// Drop everything the caller did not take.
    pub(crate) fn release(self, t: &mut Tracer) {
        let list: Vec<T> = [
            Some(self.log_probs),
            self.entropy,
            self.mean_logits,
            self.is_top1,
            Some(self.mask),
        ]
        .into_iter()
        .flatten()
        .chain(self.loss)
        .collect();
        t.drop_all(&list);
    }
}

/// Which per-token fields the kernel computes besides the log-probs (`outputs=`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Fields {
    pub entropy: bool,
    pub mean_logits: bool,
    pub is_top1: bool,
}

impl Fields {
    /// `outputs=("log_probs",)`, the default (a separate reference model's head).
    pub(crate) const LOG_PROBS: Fields = Fields {
        entropy: false,
        mean_logits: false,
        is_top1: false,
    };
    /// SFTTrainer's head: entropy and token accuracy for its metrics.
    pub(crate) const SFT: Fields = Fields {
        entropy: true,
        mean_logits: false,
        is_top1: true,
    };
    /// GRPOTrainer's policy head (also its reference pass when the adapters are disabled).
    pub(crate) const GRPO: Fields = Fields {
        entropy: true,
        mean_logits: false,
        is_top1: false,
    };
    /// DPOTrainer's policy head (also its reference pass when the adapters are disabled).
    pub(crate) const DPO: Fields = Fields {
        entropy: true,
        mean_logits: true,
        is_top1: true,
    };
}

/// `model(**inputs, labels=labels, fused_lm_head=True)`: the backbone, then the head over
/// the `scored` valid next-token positions of `batch`. The backbone's output is freed when
/// the forward returns (the gather saves only the mask).
pub(crate) fn fused_forward(
    t: &mut Tracer,
    model: &Model,
    ids: T,
    batch: Batch,
    scored: u64,
    fields: Fields,
) -> FusedOutput {
    let hidden = model.decoder(t, ids, batch);
    let out = fused_head(t, model, hidden, batch, scored, fields);
    model.forward_done(t);
    t.drop(hidden);
    out
}

/// The head of `_fused_forward` over the backbone's `hidden` states.
fn fused_head(
    t: &mut Tracer,
    model: &Model,
    hidden: T,
    batch: Batch,
    scored: u64,
    fields: Fields,
) -> FusedOutput {
    let outer = std::mem::replace(&mut t.component, Component::LogitsAndLoss);
    let a = &model.arch;
    let positions = batch.b * (batch.s - 1);
    let n = scored;
    let hidden_dtype = t.dtype(hidden);
    // hidden_states[:, :-1] (a view); mask = labels[:, 1:] != -100.
    let shifted = t.slice(hidden, positions * a.hidden);
    let mask = t.empty(positions, DType::Bool, "mask = labels != -100");
    // hidden_states[mask] and labels[mask]: a nonzero each, then the gathers.
    let index = t.nonzero(n);
    let gathered = t.empty(n * a.hidden, hidden_dtype, "hidden_states[mask]");
    t.record(
        Bwd::MaskedIndex { selected: n },
        &[Some(shifted)],
        &[gathered],
        &[mask],
    );
    t.drop(index);
    let index = t.nonzero(n);
    let targets = t.empty(n, DType::I64, "labels[mask]");
    t.drop(index);

    // _ChunkedLogProbFunction.forward: seven fp32 accumulators and the logits tile, then the
    // tiles (casts to the compute dtype where the hidden states or weight differ).
    let weight = match model.lm_head {
        Some(head) => head.weight,
        None => model.embed,
    };
    let weight_dtype = t.dtype(t.param(weight));
    let compute = t.autocast_dtype().unwrap_or(hidden_dtype);
    let head = ChunkedLogProb {
        tokens: n,
        hidden: a.hidden,
        vocab: a.vocab,
        compute,
        hidden_dtype,
        weight_dtype,
    };
    let accumulators: Vec<T> = (0..7)
        .map(|_| t.empty(n, DType::F32, "chunked log-prob: accumulator"))
        .collect();
    let tile = t.empty(head.tile_numel(), compute, "chunked log-prob: mm_buf");
    t.ensure_cublas_workspace();
    let mut hidden_chunk: Option<T> = None;
    let mut start = 0;
    while start < n {
        let rows = (n - start).min(ChunkedLogProb::TOKEN_TILE);
        if hidden_dtype != compute {
            let chunk = t.empty(rows * a.hidden, compute, "hidden[t0:t1].to(compute)");
            if let Some(old) = hidden_chunk.replace(chunk) {
                t.drop(old);
            }
        }
        if weight_dtype != compute {
            let mut column = 0;
            while column < a.vocab {
                let width = (a.vocab - column).min(ChunkedLogProb::VOCAB_TILE);
                let chunk = t.empty(width * a.hidden, compute, "weight[s:e].to(compute)");
                t.drop(chunk);
                column += width;
            }
        }
        start += rows;
    }
    // log_z = running_max + log(sum_exp); logprobs = target_logit - log_z.
    let log = t.empty(n, DType::F32, "log(sum_exp)");
    let log_z = t.empty(n, DType::F32, "log_z");
    t.drop(log);
    let log_probs = t.empty(n, DType::F32, "logprobs");
    let entropy = fields.entropy.then(|| {
        let ratio = t.empty(n, DType::F32, "x_sum_exp / sum_exp");
        let entropy = t.empty(n, DType::F32, "entropy");
        t.drop(ratio);
        entropy
    });
    let mean_logits = fields
        .mean_logits
        .then(|| t.empty(n, DType::F32, "mean_logits"));
    let is_top1 = fields.is_top1.then(|| {
        let above = t.empty(n, DType::Bool, "target_logit >= running_max");
        let beyond = t.empty(n, DType::Bool, "target_logit > max_before_target");
        let top1 = t.empty(n, DType::Bool, "is_top1");
        t.drop_all(&[above, beyond]);
        top1
    });
    let saved = [gathered, targets, log_z, entropy.unwrap_or(log_z)];
    let outputs: Vec<T> = std::iter::once(log_probs).chain(entropy).collect();
    t.record(
        Bwd::ChunkedLogProb(head),
        &[Some(gathered), Some(t.param(weight))],
        &outputs,
        &saved,
    );
    if let Some(chunk) = hidden_chunk {
        t.drop(chunk);
    }
    t.drop_all(&accumulators);
    t.drop(tile);
    t.drop_all(&[gathered, targets, log_z]);

    // x.new_zeros(mask.shape).masked_scatter(mask, x) for each output.
    let scatter = |t: &mut Tracer, x: T| {
        let dtype = t.dtype(x);
        let zeros = t.empty(positions, dtype, "x.new_zeros(mask.shape)");
        let out = t.empty(positions, dtype, "masked_scatter(mask, x)");
        let prefix = t.empty(positions, DType::I64, "masked_scatter: prefix sum");
        let scratch = t.empty(1279, DType::U8, "masked_scatter: cub scan scratch");
        t.drop_all(&[scratch, prefix, zeros]);
        t.record(
            Bwd::MaskedScatter { selected: n },
            &[Some(x)],
            &[out],
            &[mask],
        );
        t.drop(x);
        out
    };
    let log_probs = scatter(t, log_probs);
    let entropy = entropy.map(|e| scatter(t, e));
    let mean_logits = mean_logits.map(|x| scatter(t, x));
    let is_top1 = is_top1.map(|x| scatter(t, x));

    // loss = -log_probs.sum() / mask.sum().clamp(min=1)
    let sum = t.empty(1, DType::F32, "log_probs.sum()");
    t.record(Bwd::Sum, &[Some(log_probs)], &[sum], &[]);
    let neg = t.neg(sum);
    t.drop(sum);
    let count = count_true(t, positions);
    let clamped = t.empty(1, DType::I64, "mask.sum().clamp(min=1)");
    t.drop(count);
    let loss = t.empty(1, DType::F32, "fused loss");
    t.record(Bwd::MulScalar, &[Some(neg)], &[loss], &[clamped]);
    t.drop(neg);
    t.drop(shifted);
    t.component = outer;
    FusedOutput {
        log_probs,
        entropy,
        is_top1,
        mean_logits,
        mask,
        loss: [loss, clamped],
    }
}

/// `x.sum()` of `numel` booleans (or integers) to an int64 scalar: the cast to int64 is a
/// temporary.
pub(crate) fn count_true(t: &mut Tracer, numel: u64) -> T {
    let cast = t.empty(numel, DType::I64, "sum: cast to int64");
    let sum = t.empty(1, DType::I64, "x.sum()");
    t.drop(cast);
    sum
}

/// SFTTrainer's `compute_loss` with `loss_type="nll"`: `-log_probs`, summed over the batch's
/// tokens and divided by `num_items_in_batch` (the Trainer's device scalar), times the number
/// of processes; then its metrics (token count, entropy, token accuracy) from the kernel's
/// extra fields. Returns the loss.
pub(crate) fn sft_loss(t: &mut Tracer, fused: FusedOutput, num_items: T) -> T {
    let outer = std::mem::replace(&mut t.component, Component::LogitsAndLoss);
    let per_token = t.neg(fused.log_probs);
    let sum = t.empty(1, DType::F32, "per_token_loss.sum()");
    t.record(Bwd::Sum, &[Some(per_token)], &[sum], &[]);
    let clamped = t.empty(1, t.dtype(num_items), "num_items.clamp(min=1)");
    let divided = t.empty(1, DType::F32, "loss / num_items");
    t.record(Bwd::MulScalar, &[Some(sum)], &[divided], &[clamped]);
    t.drop_all(&[sum, clamped]);
    let loss = t.mul_scalar(divided);
    t.drop(divided);
    // Metrics: label_mask.sum(), entropy.sum(), is_top1.sum() (two int64 casts of the mask's
    // size), each reduced again and read with `.item()`.
    let positions = t.numel(fused.mask);
    for _ in 0..2 {
        let count = count_true(t, positions);
        t.drop(count);
    }
    t.drop(per_token);
    fused.release(t);
    t.component = outer;
    loss
}

/// RewardTrainer's forward and loss: the sequence-classification model over the chosen rows
/// then the rejected ones, its pooled scores copied to fp32 (accelerate's
/// `convert_to_fp32`), then `-logsigmoid(chosen - rejected).mean()`.
pub(crate) fn reward_loss(t: &mut Tracer, model: &Model, ids: T, batch: Batch) -> T {
    let hidden = model.decoder(t, ids, batch);
    let pooled = sequence_classification(t, model, hidden, batch);
    model.forward_done(t);
    t.drop(hidden);
    let outer = std::mem::replace(&mut t.component, Component::LogitsAndLoss);
    let scores = t.to(pooled, DType::F32);
    t.drop(pooled);
    let pairs = batch.b / 2;
    let chosen = t.slice(scores, pairs);
    let rejected = t.slice(scores, pairs);
    let margin = t.empty(pairs, DType::F32, "chosen - rejected");
    t.record(Bwd::Add, &[Some(chosen), Some(rejected)], &[margin], &[]);
    t.drop_all(&[chosen, rejected]);
    let loss = neg_logsigmoid_mean(t, margin);
    t.drop_all(&[margin, scores]);
    t.component = outer;
    loss
}

/// `-F.logsigmoid(x).mean()` of a `[pairs]` tensor (`log_sigmoid_forward` makes a buffer
/// beside its output; both it and `x` are saved).
fn neg_logsigmoid_mean(t: &mut Tracer, x: T) -> T {
    let pairs = t.numel(x);
    let buffer = t.empty(pairs, DType::F32, "log_sigmoid_forward buffer");
    let logsigmoid = t.empty(pairs, DType::F32, "logsigmoid(x)");
    t.record(Bwd::Mul, &[Some(x)], &[logsigmoid], &[x, buffer]);
    t.drop(buffer);
    let neg = t.neg(logsigmoid);
    t.drop(logsigmoid);
    let mean = t.mean_all(neg);
    t.drop(neg);
    mean
}

/// DPOTrainer's labels: `input_ids.masked_fill(completion_mask == 0, -100)`, `[rows, seq]`
/// int64, kept until `_compute_loss` returns.
pub(crate) fn dpo_labels(t: &mut Tracer, batch: Batch) -> T {
    let outer = std::mem::replace(&mut t.component, Component::Inputs);
    let prompt = t.empty(batch.n(), DType::Bool, "completion_mask == 0");
    let labels = t.empty(batch.n(), DType::I64, "labels");
    t.drop(prompt);
    t.component = outer;
    labels
}

/// `per_token_logps[:, -seq_len:].sum(1)`: one log-prob per row.
pub(crate) fn sequence_logps(t: &mut Tracer, per_token: T, rows: u64) -> T {
    let outer = std::mem::replace(&mut t.component, Component::LogitsAndLoss);
    let window = t.slice(per_token, t.numel(per_token));
    let sums = t.empty(rows, DType::F32, "per_token_logps.sum(1)");
    t.record(Bwd::Sum, &[Some(window)], &[sums], &[]);
    t.drop(window);
    t.component = outer;
    sums
}

/// DPOTrainer's `_compute_loss` with the default sigmoid loss, from the policy's sequence
/// log-probs (`[rows]`, chosen rows first) and the reference's chosen and rejected halves, then its metrics from
/// the policy head's extra fields: entropy over the completion, the mean logits of chosen and
/// rejected tokens (a boolean index each) and the token accuracy. `scored` tokens, half of
/// them chosen. Returns the loss.
pub(crate) fn dpo_loss(
    t: &mut Tracer,
    policy: &FusedOutput,
    logps: T,
    [ref_chosen, ref_rejected]: [T; 2],
    scored: u64,
) -> T {
    let outer = std::mem::replace(&mut t.component, Component::LogitsAndLoss);
    let pairs = t.numel(logps) / 2;
    let (chosen, rejected) = (t.slice(logps, pairs), t.slice(logps, pairs));
    let chosen_ratio = t.add(chosen, ref_chosen);
    let rejected_ratio = t.add(rejected, ref_rejected);
    t.drop_all(&[chosen, rejected]);
    let delta = t.add(chosen_ratio, rejected_ratio);
    let scaled = t.mul_scalar(delta);
    let mean = neg_logsigmoid_mean(t, scaled);
    t.drop_all(&[scaled, delta]);
    let loss = t.mul_scalar(mean);
    t.drop(mean);
    // Metrics: entropy over the completion, the logits means of each half (a boolean index
    // over `mean_logits`), the token accuracy; scalars read with `.item()`.
    let positions = t.numel(policy.mask);
    let masked = t.empty(positions, DType::F32, "per_token_entropy * mask");
    t.drop(masked);
    for _ in 0..2 {
        let half_mask = t.empty(positions / 2, DType::Bool, "chosen_mask.bool()");
        let index = t.nonzero(scored / 2);
        let values = t.empty(scored / 2, DType::F32, "mean_logits[mask]");
        t.drop_all(&[values, index, half_mask]);
    }
    let correct = t.empty(positions / 2, DType::Bool, "is_top1 & mask");
    let count = count_true(t, positions / 2);
    t.drop_all(&[count, correct]);
    for tensor in [chosen_ratio, rejected_ratio] {
        t.drop(tensor);
    }
    t.component = outer;
    loss
}

/// `outputs.log_probs[:, -completion:]` of a fused forward, then `torch.cat` over the chunks
/// (one here): a `[rows, completion]` fp32 copy.
pub(crate) fn completion_logps(t: &mut Tracer, per_token: T, rows: u64, completion: u64) -> T {
    let outer = std::mem::replace(&mut t.component, Component::LogitsAndLoss);
    let window = t.slice(per_token, rows * completion);
    let copy = t.contiguous_copy(window);
    t.drop(window);
    t.component = outer;
    copy
}

/// GRPOTrainer's `_compute_loss` with the default `dapo` loss at token level: the importance
/// ratio against the detached log-probs (`exp`), its clipped twin, both times the advantages,
/// their minimum, negated, masked and summed over the tokens; with `beta > 0` the k3 estimate
/// of the KL to the reference's log-probs joins it. Then its metrics (masked entropy, the
/// three clip masks as floats). Every tensor is `[rows, completion]`.
pub(crate) fn grpo_loss(
    t: &mut Tracer,
    logps: T,
    entropies: T,
    reference: Option<T>,
    rows: u64,
) -> T {
    let outer = std::mem::replace(&mut t.component, Component::LogitsAndLoss);
    let numel = t.numel(logps);
    let f32 = |t: &mut Tracer, label: &'static str| t.empty(numel, DType::F32, label);
    let log_ratio = t.mul_scalar(logps);
    let coef_1 = f32(t, "coef_1 = exp(log_ratio)");
    t.record(Bwd::Mul, &[Some(log_ratio)], &[coef_1], &[coef_1]);
    let coef_2 = f32(t, "coef_2 = clamp(coef_1)");
    t.record(Bwd::Mul, &[Some(coef_1)], &[coef_2], &[coef_1]);
    let advantages = t.empty(rows, DType::F32, "advantages.unsqueeze(1)");
    let loss_1 = t.mul(coef_1, advantages);
    let loss_2 = t.mul(coef_2, advantages);
    let minimum = f32(t, "min(per_token_loss1, per_token_loss2)");
    t.record(
        Bwd::Mul,
        &[Some(loss_1), Some(loss_2)],
        &[minimum],
        &[loss_1, loss_2],
    );
    let mut per_token = t.neg(minimum);
    t.drop_all(&[minimum, advantages]);
    if let Some(reference) = reference {
        let delta = t.add(reference, logps);
        let exp = f32(t, "exp(ref - logps)");
        t.record(Bwd::Mul, &[Some(delta)], &[exp], &[exp]);
        let kl_a = t.add(exp, delta);
        let kl = t.add_scalar(kl_a);
        let weighted = t.mul(kl, coef_1);
        let scaled = t.mul_scalar(weighted);
        let total = t.add(per_token, scaled);
        t.drop_all(&[delta, exp, kl_a, kl, weighted, scaled, per_token]);
        per_token = total;
    }
    let masked = t.mul_scalar(per_token);
    let sum = t.empty(1, DType::F32, "(per_token_loss * mask).sum()");
    t.record(Bwd::Sum, &[Some(masked)], &[sum], &[]);
    let loss = t.mul_scalar(sum);
    t.drop_all(&[sum, masked, per_token, loss_1, loss_2]);
    // Metrics: the masked entropy, the clip masks and their means.
    let entropy = f32(t, "entropies * mask");
    t.drop(entropy);
    for _ in 0..3 {
        let clipped = t.empty(numel, DType::Bool, "clip mask");
        let float = f32(t, "clip mask.float()");
        t.drop_all(&[float, clipped]);
    }
    t.drop_all(&[coef_2, coef_1, log_ratio, entropies]);
    t.component = outer;
    loss
}
