//! `parallel.ep`: expert parallelism as transformers 5.17 runs it torch-natively,
//! `from_pretrained(..., distributed_config=DistributedConfig(tp_plan="auto",
//! enable_expert_parallel=True))`. It is the tensor-parallel loader with the config's
//! `base_model_ep_plan` in place of its `base_model_tp_plan`, over a one-dimensional mesh of all
//! `world_size` ranks; `maybe_distribute_model` applies one of tensor, FSDP2 or pipeline
//! parallelism, so nothing composes with it.

use serde_json::{Map, Value};

use super::parse::{boolean, positive};
use super::{ExpertsImpl, Mode, Optimizer, RunSpec, Strategy};
use crate::arch::{Architecture, Module, Router};
use crate::error::{Error, Result};

/// The supported layout, named wherever another is refused.
const ALONE: &str = "expert parallelism alone: strategy none with world_size = ep (transformers \
                     5.17's maybe_distribute_model applies one of tensor, FSDP2 or pipeline \
                     parallelism)";

/// `parallel.ep` read and checked against the rest of `parallel` (before the tensor- and
/// pipeline-parallel keys, which it excludes): 1 when absent.
pub(super) fn parse(obj: &Map<String, Value>, strategy: Strategy, world_size: u64) -> Result<u64> {
    let field = |e: Error| e.prefixed("parallel");
    let ep = positive(obj, "ep", 1).map_err(field)?;
    if ep == 1 {
        return Ok(1);
    }
    for key in ["tp", "cp", "pp"] {
        if positive(obj, key, 1).map_err(field)? > 1 {
            return Err(Error::Unsupported {
                what: format!("parallel.ep with parallel.{key}"),
                supported: ALONE.into(),
            });
        }
    }
    if boolean(obj, "sequence_parallel").map_err(field)? {
        return Err(Error::Unsupported {
            what: "parallel.ep with parallel.sequence_parallel".into(),
            supported: ALONE.into(),
        });
    }
    if strategy != Strategy::NoDataParallel {
        return Err(Error::field(
            "parallel.strategy",
            strategy.name(),
            format!("with ep > 1 use none: {ALONE}"),
        ));
    }
    if world_size != ep {
        return Err(Error::field(
            "parallel.world_size",
            world_size,
            format!("it must equal ep ({ep}): {ALONE}"),
        ));
    }
    Ok(ep)
}

/// What the rest of a spec must be under `ep` ranks, before its model is known: training
/// (the plan's hooks are modelled for it), and an optimizer that can step the parameters.
/// Full training steps the experts' `Shard(0)` DTensors beside plain tensors, which AdamW's
/// foreach and fused kernels refuse in torch 2.11 ("got mixed torch.Tensor and DTensor"); the
/// for-loop steps them one at a time. LoRA on the attention or MLP trains plain tensors only.
pub(super) fn check_spec(spec: &RunSpec, ep: u64) -> Result<()> {
    if spec.mode != Mode::Train {
        return Err(Error::field(
            "mode",
            "forward",
            "expert-parallel layouts are modelled for training; leave `mode` out",
        ));
    }
    let steps_experts = spec.lora.is_none();
    if steps_experts && !matches!(spec.optimizer, Optimizer::AdamWForLoop | Optimizer::None) {
        return Err(Error::field(
            "optimizer",
            spec.optimizer.name(),
            format!(
                "with parallel.ep {ep} the experts are DTensors beside plain parameters, which \
                 torch 2.11's foreach and fused optimizers refuse: use adamw-forloop"
            ),
        ));
    }
    Ok(())
}

/// What the model must be: an MoE family whose router the simulator runs under
/// `EpRouterParallel` (softmax top-k routers returning `(logits, scores, indices)`: Qwen2-MoE,
/// Qwen3-MoE, OLMoE, Mixtral), `ep` dividing its experts, an experts path that skips the
/// sentinel, and LoRA off the expert weights.
pub(super) fn check_against(spec: &RunSpec, arch: &Architecture, ep: u64) -> Result<()> {
    let Some(moe) = &arch.moe else {
        return Err(Error::field(
            "parallel.ep",
            ep,
            format!(
                "{} models have no experts to split; leave it out",
                arch.model_type
            ),
        ));
    };
    if !matches!(moe.router, Router::Softmax | Router::SoftmaxFp32) {
        return Err(Error::Unsupported {
            what: format!("parallel.ep with a {} model", arch.model_type),
            supported: "qwen3_moe, qwen2_moe, olmoe and mixtral models (measured: qwen3_moe, \
                        mixtral)"
                .into(),
        });
    }
    if !moe.experts.is_multiple_of(ep) {
        return Err(Error::field(
            "parallel.ep",
            ep,
            format!(
                "a divisor of the model's {} experts (MoEParamShard shards them evenly)",
                moe.experts
            ),
        ));
    }
    if spec.experts == ExpertsImpl::Eager {
        return Err(Error::field(
            "experts_implementation",
            "eager",
            "under parallel.ep the router marks other ranks' experts with the sentinel \
             num_local_experts, which the per-expert loop's one_hot refuses (transformers \
             5.17); use grouped_mm or batched_mm",
        ));
    }
    if let Some(lora) = &spec.lora {
        let built = lora.as_built_for(arch)?;
        let experts = built
            .lora
            .target_parameters
            .iter()
            .any(|m| matches!(m, Module::ExpertsGateUp | Module::ExpertsDown));
        if experts {
            return Err(Error::Unsupported {
                what: "lora on the expert weights with parallel.ep".into(),
                supported: "LoRA on the attention and dense linears: peft's baddbmm(W, B, A) \
                            over a sharded expert weight mixes a DTensor with plain tensors, \
                            which torch 2.11 refuses"
                    .into(),
            });
        }
    }
    Ok(())
}
