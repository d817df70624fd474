//! The output heads and what the harness computes from them: the causal-LM loss
//! (`ForCausalLMLoss`), the sequence-classification pooling, and the no-grad log-prob pass.

use super::Batch;
use super::transformer::Model;
use crate::dtype::DType;
use crate::sim::engine::component::Component;
use crate::sim::engine::tracer::{Bwd, T, Tracer};
use crate::sim::strategy::{ModuleKey, Unit};
use crate::spec::{RunSpec, Task};

/// The harness's training forward: `model(input_ids=ids, labels=ids).loss` (causal LM) or
/// `model(input_ids=ids).logits.float().pow(2).mean()` (sequence classification). The
/// output object is dropped when the function returns; only the loss survives.
pub(crate) fn train_forward(
    t: &mut Tracer,
    model: &Model,
    spec: &RunSpec,
    ids: T,
    batch: Batch,
) -> T {
    let hidden = model.decoder(t, ids, batch);
    match spec.task {
        Task::CausalLm if model.liger.fused_linear_cross_entropy => {
            let weight = model.lm_head.map_or(model.embed, |head| head.weight);
            let shape = [model.arch.vocab, model.arch.hidden];
            let loss = super::liger::fused_linear_cross_entropy(t, weight, shape, hidden, batch);
            model.forward_done(t);
            t.drop(hidden);
            loss
        }
        Task::CausalLm => {
            let (mut loss, logits) = causal_lm_loss(t, model, hidden, batch);
            // `loss += router_aux_loss_coef * load_balancing_loss_func(router_logits, ...)`
            if let Some(aux) = model.load_balancing_loss(t, batch.n()) {
                let scaled = t.mul_scalar(aux);
                let total = t.add(loss, scaled);
                t.drop_all(&[aux, scaled, loss]);
                loss = total;
            }
            model.forward_done(t);
            t.drop(hidden);
            t.drop(logits);
            loss
        }
        Task::SeqCls => {
            let pooled = sequence_classification(t, model, hidden, batch);
            model.forward_done(t);
            t.drop(hidden);
            let outer = t.component;
            let f = t.to(pooled, DType::F32);
            let sq = t.pow2(f);
            let loss = t.mean_all(sq);
            t.drop_all(&[sq, f, pooled]);
            t.component = outer;
            loss
        }
    }
}

/// `lm_head` then `ForCausalLMLoss`: fp32 logits, shifted labels, cross entropy.
fn causal_lm_loss(t: &mut Tracer, model: &Model, hidden: T, batch: Batch) -> (T, T) {
    let outer = std::mem::replace(&mut t.component, Component::LogitsAndLoss);
    let logits = lm_head(t, model, hidden);
    t.component = outer;
    (for_causal_lm_loss(t, model, logits, batch), logits)
}

/// `ForCausalLMLoss(logits, labels)`: fp32 logits, shifted labels, cross entropy.
pub(crate) fn for_causal_lm_loss(t: &mut Tracer, model: &Model, logits: T, batch: Batch) -> T {
    if model.release.shifts_logits {
        return shifted_logits_loss(t, model, logits, batch);
    }
    let outer = std::mem::replace(&mut t.component, Component::LogitsAndLoss);
    let logits32 = t.to(logits, DType::F32);
    t.component = Component::Inputs;
    let padded = t.empty(
        batch.b * (batch.s + 1),
        DType::I64,
        "labels = pad(labels, (0, 1))",
    );
    let shift = t.empty(batch.n(), DType::I64, "shift_labels.contiguous()");
    t.component = Component::LogitsAndLoss;
    let strategy = model.strategy.borrow();
    let (log_probs, loss) = match strategy.tensor_parallel().filter(|tp| tp.loss_parallel()) {
        // `loss_parallel`: the cross-entropy over this rank's vocabulary shard.
        Some(tp) => {
            let log_probs = tp.log_softmax(t, logits32, batch.n());
            (log_probs, tp.nll_loss(t, log_probs, shift))
        }
        None => {
            let log_probs = t.log_softmax(logits32);
            (log_probs, t.nll_loss(log_probs, shift))
        }
    };
    drop(strategy);
    t.drop(log_probs);
    t.drop_all(&[logits32, padded, shift]);
    t.component = outer;
    loss
}

/// transformers 4.46-4.48's loss, which shifts the logits rather than the labels:
/// `ForCausalLMLoss` upcasts them, then copies `logits[..., :-1, :].contiguous()` (an fp32
/// copy beside the upcast one; backward scatters its gradient into zeros of the full size).
/// GPT-2's own loss (4.46-4.47) makes the same copy without the upcast, and
/// `CrossEntropyLoss` runs on the activation dtype.
fn shifted_logits_loss(t: &mut Tracer, model: &Model, logits: T, batch: Batch) -> T {
    let outer = std::mem::replace(&mut t.component, Component::LogitsAndLoss);
    let rows = batch.b * (batch.s - 1);
    let upcast = !model.release.gpt2_own_loss;
    let source = if upcast {
        t.to(logits, DType::F32)
    } else {
        t.share(logits)
    };
    let sliced = t.slice(source, rows * model.arch.vocab);
    let shifted = t.contiguous_copy(sliced);
    t.drop(sliced);
    t.component = Component::Inputs;
    let labels = t.empty(rows, DType::I64, "labels[..., 1:].contiguous()");
    t.component = Component::LogitsAndLoss;
    // `cross_entropy_loss` calls `log_softmax(x, dtype=x.dtype)`, which autocast runs as
    // it is; autocast casts `nll_loss`'s input to fp32.
    let log_probs = t.log_softmax(shifted);
    let nll_input = match t.autocast_dtype() {
        Some(_) => t.to(log_probs, DType::F32),
        None => t.share(log_probs),
    };
    let loss = t.nll_loss(nll_input, labels);
    t.drop(nll_input);
    // The function's locals (the upcast logits, their shifted copy) live until it returns.
    t.drop_all(&[log_probs, labels, shifted, source]);
    t.component = outer;
    loss
}

/// The output head (tied or not), with Gemma-2's final soft-capping.
pub(crate) fn lm_head(t: &mut Tracer, model: &Model, hidden: T) -> T {
    let a = &model.arch;
    let (weight, bias) = match model.lm_head {
        Some(head) => (head.weight, head.bias),
        None => (model.embed, None),
    };
    let params: Vec<_> = std::iter::once(weight).chain(bias).collect();
    model.module_pre_forward(t, ModuleKey::LmHead, &params, true);
    let block = model.block_input(t, hidden);
    let input = model.linear_input(t, block);
    let mut logits = t.linear(input, weight, bias, a.vocab, false);
    t.drop_all(&[input, block]);
    if let Some(tp) = model.strategy.borrow().tensor_parallel() {
        logits = tp.head_output(t, logits);
    }
    model.module_post_forward(t);
    model.unit_post_forward(t, Unit::Head);
    if a.final_logit_softcapping.is_some() {
        let div = t.mul_scalar(logits);
        t.drop(logits);
        let th = t.tanh(div);
        t.drop(div);
        logits = t.mul_scalar(th);
        t.drop(th);
    }
    logits
}

/// `GenericForSequenceClassification.forward`: score every position, pick each sequence's
/// last non-pad token.
pub(crate) fn sequence_classification(t: &mut Tracer, model: &Model, hidden: T, batch: Batch) -> T {
    let score = model
        .score
        .expect("a sequence-classification model has a score head");
    let logits = t.linear(hidden, score.weight, score.bias, score.out_features, false);
    let outer = std::mem::replace(&mut t.component, Component::Inputs);
    let mask = t.empty(batch.n(), DType::Bool, "input_ids != pad_token_id");
    let mask32 = t.empty(batch.n(), DType::I32, "non_pad_mask");
    t.drop(mask);
    let indices = t.empty(batch.s, DType::I32, "token_indices");
    let prod = t.empty(batch.n(), DType::I32, "token_indices * non_pad_mask");
    let last = t.empty(batch.b, DType::I64, "last_non_pad_token");
    t.drop(prod);
    let rows = t.empty(batch.b, DType::I64, "arange(batch_size)");
    t.component = outer;
    let pooled = t.empty(
        batch.b * score.out_features,
        t.dtype(logits),
        "pooled_logits",
    );
    t.record(Bwd::Slice, &[Some(logits)], &[pooled], &[rows, last]);
    t.drop_all(&[rows, last, indices, mask32, logits]);
    pooled
}

/// The no-grad reference log-prob pass: `logits = model(ids).logits` under the autocast
/// `autocast`, then outside it `log_softmax(logits.float(), -1)` gathered at the next tokens.
/// Leaving autocast clears its weight-cast cache before the fp32 logits exist.
pub(crate) fn logprob_forward(
    t: &mut Tracer,
    model: &Model,
    ids: T,
    batch: Batch,
    autocast: Option<DType>,
) {
    let outer_autocast = t.enter_autocast(autocast);
    let hidden = model.decoder(t, ids, batch);
    let outer = std::mem::replace(&mut t.component, Component::LogitsAndLoss);
    let logits = lm_head(t, model, hidden);
    model.forward_done(t);
    t.drop(hidden);
    t.exit_autocast(outer_autocast);
    let logits32 = t.to(logits, DType::F32);
    let log_probs = t.log_softmax(logits32);
    t.drop(logits32);
    let gathered = t.empty(
        batch.b * (batch.s - 1),
        DType::F32,
        "gather(log_probs, next tokens)",
    );
    t.drop_all(&[gathered, log_probs, logits]);
    t.component = outer;
}
