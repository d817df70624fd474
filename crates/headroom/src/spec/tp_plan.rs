//! `parallel.framework: transformers`: tensor parallelism as transformers 5.17 applies its own
//! plan, `from_pretrained(..., distributed_config=DistributedConfig(tp_size=tp))`. The config's
//! `base_model_tp_plan` makes q/k/v and gate/up `colwise`, o/down `rowwise` (DTensor
//! parameters and forward hooks, `transformers/distributed/tensor_parallel.py`); the head is
//! `colwise_gather_output` (its logits all-gathered whole before the loss); the embedding and
//! the norms stay plain tensors. `maybe_distribute_model` applies one of tensor, FSDP2 or
//! pipeline parallelism, over a one-dimensional mesh of every rank, so nothing composes
//! with it.

use serde_json::{Map, Value};

use super::parse::positive;
use super::{Mode, Optimizer, RunSpec, Strategy};
use crate::error::{Error, Result};

/// The supported layout, named wherever another is refused.
const ALONE: &str = "framework transformers is tensor parallelism alone: strategy none with \
                     world_size = tp >= 2 (transformers 5.17's maybe_distribute_model applies \
                     one of tensor, FSDP2 or pipeline parallelism)";

/// The layout keys checked for `framework: transformers` (the tensor-parallel reader has
/// read `tp` and `sequence_parallel`).
pub(super) fn parse(
    obj: &Map<String, Value>,
    strategy: Strategy,
    world_size: u64,
    tp: u64,
    sequence_parallel: bool,
) -> Result<()> {
    let field = |e: Error| e.prefixed("parallel");
    if strategy != Strategy::NoDataParallel {
        return Err(Error::field(
            "parallel.strategy",
            strategy.name(),
            format!("use none: {ALONE}"),
        ));
    }
    if tp < 2 || world_size != tp {
        return Err(Error::field("parallel.tp", tp, ALONE));
    }
    if sequence_parallel {
        return Err(Error::field(
            "parallel.sequence_parallel",
            true,
            "the models' base_model_tp_plan has no sequence-parallel entries; leave it out",
        ));
    }
    for key in ["cp", "pp", "ep"] {
        if positive(obj, key, 1).map_err(field)? > 1 {
            return Err(Error::Unsupported {
                what: format!("parallel.{key} with framework transformers"),
                supported: ALONE.into(),
            });
        }
    }
    Ok(())
}

/// What the rest of the spec must be: full training (the plan's hooks are modelled for it)
/// with an optimizer that can step DTensor shards beside the plain embedding and norms.
/// AdamW's foreach and fused kernels refuse that mix in torch 2.11 ("got mixed torch.Tensor
/// and DTensor"); transformers' Trainer then steps them one at a time, as `adamw-forloop`.
pub(super) fn check_spec(spec: &RunSpec, tp: u64) -> Result<()> {
    if spec.mode != Mode::Train {
        return Err(Error::field(
            "mode",
            "forward",
            "framework transformers is modelled for training; leave `mode` out",
        ));
    }
    if spec.lora.is_some() {
        return Err(Error::Unsupported {
            what: "lora with framework transformers".into(),
            supported: "full training under transformers' tensor-parallel plan".into(),
        });
    }
    if !matches!(spec.optimizer, Optimizer::AdamWForLoop | Optimizer::None) {
        return Err(Error::field(
            "optimizer",
            spec.optimizer.name(),
            format!(
                "with parallel.tp {tp} under framework transformers the projections are DTensors \
                 beside the plain embedding and norms, which torch 2.11's foreach and fused \
                 optimizers refuse: use adamw-forloop (transformers' Trainer switches to it)"
            ),
        ));
    }
    Ok(())
}
