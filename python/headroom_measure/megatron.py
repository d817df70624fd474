"""Per-rank peak memory of Megatron-core training (`parallel.framework: megatron`), one rank of a world
under torch's fake process group on one GPU, or every rank of a real world under torchrun and NCCL.

    HEADROOM_FAKE_WORLD=W HEADROOM_FAKE_RANK=R WORLD_SIZE=W RANK=0 LOCAL_RANK=0 \
        python -m headroom_measure dist --spec-json SPEC --out F
    torchrun --nproc-per-node W -m headroom_measure dist --spec-json SPEC --out F

The record has dist.py's shape (`measured.ranks`: `load`, three `steps` of `fwd_peak`, `bwd_peak`,
`opt_peak`, `peak_reserved`; one rank under the fake group, every rank under NCCL), so bench/fsdp2-mp/tools/run.sh
drives it. Both worlds build and step the same way; a real one differs only where dist.py's protocol does: each
rank on GPU `LOCAL_RANK` after `init_process_group("nccl", device_id=...)` (eager communicator), and each phase
read after `synchronize(); barrier(); synchronize()`, so collectives still in flight land in the phase that issued
them (the fake group's collectives launch nothing: it synchronizes only). How a run is built, in this order, as
Megatron-LM's `pretrain` builds it (megatron/training/training.py `get_model`, `setup_model_and_optimizer`):

1. `init_process_group("fake", rank=R, world_size=W)` (R: HEADROOM_FAKE_RANK, default 0) (or NCCL's, with `device_id` when `megatron.eager_nccl_init`),
   `torch.cuda.set_device`, `torch.zeros(1)`;
   `parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)` (pp, cp and ep 1: the data-parallel
   size is `W / tp`); `model_parallel_cuda_manual_seed(1234)`.
2. `TransformerConfig` from the HF config: real widths, `num_hidden_layers` layers, RMSNorm, SwiGLU
   (`gated_linear_unit`, `silu`), no linear biases but Qwen2's qkv bias, Qwen3's q/k norms, `bf16`,
   `params_dtype=bf16`, `sequence_parallel`, dropouts 0, and no fused kernel Megatron would need TE or apex for
   (`gradient_accumulation_fusion`, `bias_dropout_fusion`, `masked_softmax_fusion`, `apply_rope_fusion`,
   `persist_layer_norm`, `cross_entropy_loss_fusion` all off); `recompute_granularity`, `recompute_method`,
   `recompute_num_layers` from the spec's `megatron` block.
3. `GPTModel(config, get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=...), vocab_size,
   max_sequence_length=seq_len, position_embedding_type="rope", rotary_base=rope_theta,
   share_embeddings_and_output_weights=tie_word_embeddings)`: the local (non-Transformer-Engine) layer spec,
   whose core attention is Megatron's `DotProductAttention` (baddbmm, softmax in fp32, bmm). The weights are
   created on the GPU and initialised in place, as Megatron does (`use_cpu_initialization=False`).
   With `parallel.sequence_parallel` the local spec's `WrappedTorchNorm` (which asserts `not sequence_parallel`) is
   replaced everywhere, the final and q/k norms too, by [`SequenceParallelTorchNorm`]: the same `torch.nn.RMSNorm`,
   its weight marked `sequence_parallel` as apex's `FusedLayerNorm` marks its own, so `finalize_model_grads` sums
   its gradient over the tensor-parallel ranks (a correct Megatron sequence-parallel step, not Transformer Engine's).
4. `model.cuda()` (the local spec's `torch.nn.RMSNorm` weights are made on the host), `Float16Module(config,
   model)` (bf16), then `DistributedDataParallel(config, DistributedDataParallelConfig(
   grad_reduce_in_fp32=True, overlap_grad_reduce=False, use_distributed_optimizer=D), module)`, as
   `get_model` does with `--bf16` (which turns on `accumulate_allreduce_grads_in_fp32`).
5. `get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-5, weight_decay=0.01, bf16=True,
   params_dtype=bf16, use_distributed_optimizer=D, clip_grad=1.0), [ddp_model])`: without TE or apex its
   Adam is `torch.optim.AdamW`; fp32 main parameters in `Float16OptimizerWithFloat16Params` or, sharded over
   the data-parallel ranks, in `DistributedOptimizer`. With `megatron.optimizer_cpu_offload` (the distributed
   optimizer only), as Megatron-LM's `--optimizer-cpu-offload` runs it: `use_precision_aware_optimizer=True` (which
   Megatron-LM requires with it), `optimizer_offload_fraction` (Megatron-LM's default 1.0) and
   `overlap_cpu_optimizer_d2h_h2d` from the spec: a `HybridDeviceOptimizer` (host AdamW over pinned fp32 copies).

An MoE model (`qwen3_moe`, `mixtral`) gets `get_gpt_layer_local_spec(num_experts=E, moe_grouped_gemm=False)`: every layer's MLP
is an `MoELayer` (`TopKRouter`, `MoEAlltoAllTokenDispatcher`, `SequentialMLP` over the E / ep local experts),
`TransformerConfig(num_moe_experts, moe_router_topk, moe_ffn_hidden_size, moe_token_dispatcher_type="alltoall",
moe_router_pre_softmax=not norm_topk_prob, expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)`, the spec's
`moe_router_dtype`, `moe_aux_loss_coeff`, `moe_router_load_balancing_type` and `moe_layer_recompute`, and Megatron's
other MoE defaults (no z-loss, no capacity factor), and
`initialize_model_parallel(expert_model_parallel_size=ep, expert_tensor_parallel_size=etp)`. Routing is data-dependent, so the harness makes it the
balanced routing headroom assumes, in place and without changing what Megatron allocates ([`balanced_routing`]):
- `topk_routing_with_score_function` runs as it is; its boolean `routing_map` is then overwritten in place
  (`copy_` under `no_grad`) with a fixed map sending token i to experts (i*k + j) mod E, j < k, made once per shape
  before the first step (an input-sized persistent tensor). Every expert receives exactly tokens * k / E tokens.
- Under the fake process group the all-gather of the token counts (`gather_from_sequence_parallel_region` in the
  dispatcher's `preprocess`) returns uninitialised memory; its output is filled in place with this rank's counts
  repeated, as a world of identical ranks would gather them (under NCCL every rank's counts are these already). The all-to-alls of tokens then move tokens * k rows
  each way (their contents are left as the fake group leaves them: losses are meaningless).

A step is what `forward_backward_no_pipelining` does with one micro-batch: `ddp_model.zero_grad_buffer()` and
`optimizer.zero_grad()`; forward `ddp_model(input_ids, position_ids, None, labels=input_ids)` (per-token losses)
and `loss = sum(losses.view(-1).float() * loss_mask) / tokens` (pretrain_gpt's `loss_func`), the fwd phase;
`torch.autograd.backward(loss)` and `finalize_model_grads([ddp_model])` (the gradient buffers' reductions), the
bwd phase; `optimizer.step()`, the opt phase.
"""

from __future__ import annotations

import math
import os
import sys
import time

from .measure import STEPS, _versions
from .spec import Spec, SpecError

RECOMPUTE_GRANULARITIES = (None, "full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
MEGATRON_KEYS = (
    "distributed_optimizer", "recompute_granularity", "recompute_method", "recompute_num_layers",
    "pipeline_model_parallel_size", "context_parallel_size", "expert_model_parallel_size",
    "expert_tensor_parallel_size", "overlap_p2p_comm", "eager_nccl_init", "recompute_modules", "moe_layer_recompute",
    "moe_router_dtype", "moe_aux_loss_coeff", "moe_router_load_balancing_type", "make_vocab_size_divisible_by",
    "optimizer_cpu_offload", "optimizer_offload_fraction", "overlap_cpu_optimizer_d2h_h2d",
)
RECOMPUTE_MODULES = ("core_attn", "mlp", "moe")
# TransformerConfig's router settings, passed as given
ROUTER_KEYS = ("moe_router_dtype", "moe_aux_loss_coeff", "moe_router_load_balancing_type")
# initialize_model_parallel's other sizes: measured at 1 only
UNMEASURED_SIZES = ("pipeline_model_parallel_size", "context_parallel_size")
MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "mixtral")


def moe_fields(fields: dict):
    """An MoE model's `(num_experts, top_k, expert width)` in its HF config's names (Qwen3-MoE's, Mixtral's); None
    for a dense model."""
    model_type = fields.get("model_type")
    if model_type == "qwen3_moe":
        return fields["num_experts"], fields["num_experts_per_tok"], fields["moe_intermediate_size"]
    if model_type == "mixtral":
        return fields["num_local_experts"], fields["num_experts_per_tok"], fields["intermediate_size"]
    return None


def megatron_options(spec: Spec) -> dict:
    """The spec's `megatron` block, checked: `distributed_optimizer` (bool), `recompute_granularity` (None, full
    or selective), `recompute_method` (uniform or block; full only), `recompute_num_layers`, `overlap_p2p_comm` (bool;
    unset, the pipeline harness takes Megatron-LM's default)."""
    raw = spec.raw.get("megatron") or {}
    if not isinstance(raw, dict):
        raise SpecError(f"`megatron`: {raw!r} is not allowed; use a mapping {{{', '.join(MEGATRON_KEYS)}}}")
    unknown = sorted(set(raw) - set(MEGATRON_KEYS))
    if unknown:
        raise SpecError(f"`megatron.{unknown[0]}` is not a megatron key; known keys: {', '.join(MEGATRON_KEYS)}")
    for key in UNMEASURED_SIZES:
        if raw.get(key, 1) != 1:
            raise SpecError(f"`megatron.{key}`: {raw[key]!r} is not measured; use 1 (tensor and data parallelism only)")
    ep = raw.get("expert_model_parallel_size", 1)
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise SpecError(f"`megatron.expert_model_parallel_size`: {ep!r} is not allowed; use an integer >= 1")
    # Megatron-LM's default: the tensor-parallel size.
    etp = raw.get("expert_tensor_parallel_size", spec.parallel.tp if spec.parallel else 1)
    if isinstance(etp, bool) or not isinstance(etp, int) or etp < 1:
        raise SpecError(f"`megatron.expert_tensor_parallel_size`: {etp!r} is not allowed; use an integer >= 1")
    out = {
        "expert_model_parallel_size": ep,
        "expert_tensor_parallel_size": etp,
        "distributed_optimizer": raw.get("distributed_optimizer", False),
        "recompute_granularity": raw.get("recompute_granularity"),
        "recompute_method": raw.get("recompute_method"),
        "recompute_num_layers": raw.get("recompute_num_layers"),
        "overlap_p2p_comm": raw.get("overlap_p2p_comm"),
        "eager_nccl_init": raw.get("eager_nccl_init", False),
        "recompute_modules": raw.get("recompute_modules"),
        # Unset (None): Megatron's defaults (no MoE-layer recompute, the router in bf16, `aux_loss` balancing with a
        # coefficient of 0).
        "moe_layer_recompute": raw.get("moe_layer_recompute"),
        "moe_router_dtype": raw.get("moe_router_dtype"),
        "moe_aux_loss_coeff": raw.get("moe_aux_loss_coeff"),
        "moe_router_load_balancing_type": raw.get("moe_router_load_balancing_type"),
        # Megatron-LM's --make-vocab-size-divisible-by; unset, megatron-core's GPTModel takes the vocabulary as given
        "make_vocab_size_divisible_by": raw.get("make_vocab_size_divisible_by"),
        # Megatron-LM's --optimizer-cpu-offload (which it requires with --use-precision-aware-optimizer), its
        # --optimizer-offload-fraction (default 1.0) and --overlap-cpu-optimizer-d2h-h2d
        "optimizer_cpu_offload": raw.get("optimizer_cpu_offload", False),
        "optimizer_offload_fraction": raw.get("optimizer_offload_fraction", 1.0),
        "overlap_cpu_optimizer_d2h_h2d": raw.get("overlap_cpu_optimizer_d2h_h2d", False),
    }
    for key in ("optimizer_cpu_offload", "overlap_cpu_optimizer_d2h_h2d"):
        if not isinstance(out[key], bool):
            raise SpecError(f"`megatron.{key}`: {out[key]!r} is not allowed; use true or false")
    fraction = out["optimizer_offload_fraction"]
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) or not 0 <= fraction <= 1:
        raise SpecError(f"`megatron.optimizer_offload_fraction`: {fraction!r} is not allowed; use a number in [0, 1]")
    if out["optimizer_cpu_offload"] and out["distributed_optimizer"] is not True:
        raise SpecError(
            "`megatron.optimizer_cpu_offload`: true needs distributed_optimizer true (Megatron-LM runs it with "
            "--use-precision-aware-optimizer, which needs the distributed optimizer)"
        )
    multiple = out["make_vocab_size_divisible_by"]
    if multiple is not None and (isinstance(multiple, bool) or not isinstance(multiple, int) or multiple < 1):
        raise SpecError(f"`megatron.make_vocab_size_divisible_by`: {multiple!r} is not allowed; use an integer >= 1")
    modules = out["recompute_modules"]
    if modules is not None and (not isinstance(modules, list) or not set(modules) <= set(RECOMPUTE_MODULES)):
        raise SpecError(f"`megatron.recompute_modules`: {modules!r} is not measured; use a list of {', '.join(RECOMPUTE_MODULES)}")
    if modules is not None and out["recompute_granularity"] != "selective":
        raise SpecError("`megatron.recompute_modules`: it applies to recompute_granularity selective; leave it out")
    if out["moe_layer_recompute"] not in (None, True, False):
        raise SpecError(f"`megatron.moe_layer_recompute`: {out['moe_layer_recompute']!r} is not allowed; use true or false")
    if out["moe_router_dtype"] not in (None, "fp32"):
        raise SpecError(f"`megatron.moe_router_dtype`: {out['moe_router_dtype']!r} is not measured; use fp32 or leave it out")
    coeff = out["moe_aux_loss_coeff"]
    if coeff is not None and (isinstance(coeff, bool) or not isinstance(coeff, (int, float)) or coeff < 0):
        raise SpecError(f"`megatron.moe_aux_loss_coeff`: {coeff!r} is not allowed; use a number >= 0")
    if out["moe_router_load_balancing_type"] not in (None, "aux_loss", "none"):
        raise SpecError(
            f"`megatron.moe_router_load_balancing_type`: {out['moe_router_load_balancing_type']!r} is not measured; "
            "use aux_loss or none"
        )
    if not isinstance(out["eager_nccl_init"], bool):
        raise SpecError(f"`megatron.eager_nccl_init`: {out['eager_nccl_init']!r} is not allowed; use true or false")
    if out["overlap_p2p_comm"] not in (None, True, False):
        raise SpecError(f"`megatron.overlap_p2p_comm`: {out['overlap_p2p_comm']!r} is not allowed; use true or false")
    if out["overlap_p2p_comm"] and spec.parallel.vpp == 1:
        raise SpecError("`megatron.overlap_p2p_comm`: true applies to the interleaved schedule (parallel.vpp > 1)")
    if not isinstance(out["distributed_optimizer"], bool):
        raise SpecError(f"`megatron.distributed_optimizer`: {out['distributed_optimizer']!r} is not allowed; use true or false")
    if out["recompute_granularity"] not in RECOMPUTE_GRANULARITIES:
        raise SpecError(
            f"`megatron.recompute_granularity`: {out['recompute_granularity']!r} is not allowed; use full or selective"
        )
    if out["recompute_granularity"] == "full":
        out["recompute_method"] = out["recompute_method"] or "uniform"
        out["recompute_num_layers"] = out["recompute_num_layers"] or 1
        if out["recompute_method"] not in RECOMPUTE_METHODS:
            raise SpecError(
                f"`megatron.recompute_method`: {out['recompute_method']!r} is not allowed; use uniform or block"
            )
        n = out["recompute_num_layers"]
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise SpecError(f"`megatron.recompute_num_layers`: {n!r} is not allowed; use an integer >= 1")
    elif out["recompute_method"] is not None or out["recompute_num_layers"] is not None:
        raise SpecError("`megatron.recompute_method`: it applies to recompute_granularity full; leave it out")
    if spec.gradient_checkpointing:
        raise SpecError(
            "`gradient_checkpointing`: true is HF's checkpointing; with framework megatron use "
            "megatron.recompute_granularity"
        )
    if spec.precision != "bf16" or spec.optimizer != "adamw" or spec.task != "causal-lm" or spec.mode != "train":
        raise SpecError(
            "framework megatron is measured for training a causal LM with precision bf16 and optimizer adamw "
            f"(got task {spec.task}, mode {spec.mode}, precision {spec.precision}, optimizer {spec.optimizer})"
        )
    if spec.lora is not None or spec.quantization is not None:
        raise SpecError("`lora`/`quantization`: not measured with framework megatron; leave them out")
    return out


def padded_vocab(vocab: int, options: dict, tp: int) -> int:
    """Megatron-LM's `_vocab_size_with_padding`: the vocabulary rounded up to a multiple of
    `make_vocab_size_divisible_by` x tp (as given where the option is unset)."""
    multiple = (options.get("make_vocab_size_divisible_by") or 1) * tp
    return -(-vocab // multiple) * multiple


def transformer_config(spec: Spec, fields: dict, options: dict):
    """Megatron's `TransformerConfig` for the HF config `fields` (see the module docstring)."""
    import torch
    import torch.nn.functional as F
    from megatron.core.transformer.transformer_config import TransformerConfig

    model_type = fields.get("model_type")
    if model_type not in MODEL_TYPES:
        raise SpecError(f"`model_config.model_type`: {model_type!r} is not measured with framework megatron; use one of {', '.join(MODEL_TYPES)}")
    par = spec.parallel
    heads = fields["num_attention_heads"]
    head_dim = fields.get("head_dim") or fields["hidden_size"] // heads
    moe = {}
    if (experts_fields := moe_fields(fields)) is not None:
        if fields.get("decoder_sparse_step", 1) != 1 or fields.get("mlp_only_layers"):
            raise SpecError("`model_config.decoder_sparse_step`/`mlp_only_layers`: measured with every layer MoE")
        experts, top_k, width = experts_fields
        moe = dict(
            num_moe_experts=experts,
            moe_router_topk=top_k,
            moe_ffn_hidden_size=width,
            moe_token_dispatcher_type="alltoall",
            moe_grouped_gemm=False,
            # Mixtral renormalises its top k always: a softmax over the k logits.
            moe_router_pre_softmax=model_type == "qwen3_moe" and not fields.get("norm_topk_prob", True),
            expert_model_parallel_size=options["expert_model_parallel_size"],
            expert_tensor_parallel_size=options["expert_tensor_parallel_size"],
            **{key: options[key] for key in ROUTER_KEYS if options[key] is not None},
        )
    return TransformerConfig(
        **moe,
        num_layers=fields["num_hidden_layers"],
        hidden_size=fields["hidden_size"],
        ffn_hidden_size=fields["intermediate_size"],
        num_attention_heads=heads,
        num_query_groups=fields.get("num_key_value_heads") or heads,
        kv_channels=head_dim,
        normalization="RMSNorm",
        layernorm_epsilon=fields.get("rms_norm_eps", 1e-6),
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=model_type == "qwen2",
        qk_layernorm=model_type in ("qwen3", "qwen3_moe"),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bf16=True,
        params_dtype=torch.bfloat16,
        pipeline_dtype=torch.bfloat16,
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=par.pp,
        virtual_pipeline_model_parallel_size=par.vpp if par.vpp > 1 else None,
        # An uneven split (`layers_per_stage`): the first and last stage's counts, the rest even.
        num_layers_in_first_pipeline_stage=par.layers_per_stage[0] if par.layers_per_stage else None,
        num_layers_in_last_pipeline_stage=par.layers_per_stage[-1] if par.layers_per_stage else None,
        sequence_parallel=par.sequence_parallel,
        gradient_accumulation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        persist_layer_norm=False,
        cross_entropy_loss_fusion=False,
        recompute_granularity=options["recompute_granularity"],
        recompute_method=options["recompute_method"],
        recompute_num_layers=options["recompute_num_layers"],
        recompute_modules=options["recompute_modules"],
        moe_layer_recompute=bool(options["moe_layer_recompute"]),
    )


class SequenceParallelTorchNorm:
    """The local spec's norm with sequence parallelism: `torch.nn.RMSNorm` as `WrappedTorchNorm` builds it, its
    weight marked `sequence_parallel` as apex's `FusedLayerNorm` marks its own (`fusions/fused_layer_norm.py`), so
    `finalize_model_grads` sums its gradient over the tensor-parallel ranks, whose rows of the sequence differ.
    `WrappedTorchNorm` asserts `not config.sequence_parallel` because it leaves the mark out."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, **_unused):
        import torch

        if config.normalization != "RMSNorm":
            raise SpecError(f"normalization {config.normalization!r}: the harness builds RMSNorm only")
        norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
        setattr(norm.weight, "sequence_parallel", config.sequence_parallel)
        return norm


def sequence_parallel_block(config, layer_spec, vp_stage=None):
    """The block `GPTModel` builds from `layer_spec` (`_get_block_submodules`: this stage's layers, the final
    norm), with every norm, the q/k norms too, a [`SequenceParallelTorchNorm`]."""
    import copy

    from megatron.core.transformer.identity_op import IdentityOp
    from megatron.core.transformer.transformer_block import TransformerBlockSubmodules, get_num_layers_to_build

    layer_spec = copy.deepcopy(layer_spec)
    layer = layer_spec.submodules
    layer.input_layernorm = layer.pre_mlp_layernorm = SequenceParallelTorchNorm
    attention = layer.self_attention.submodules
    for name in ("q_layernorm", "k_layernorm"):
        if getattr(attention, name) is not IdentityOp:
            setattr(attention, name, SequenceParallelTorchNorm)
    layers = get_num_layers_to_build(config, vp_stage=vp_stage)
    return TransformerBlockSubmodules(layer_specs=[layer_spec] * layers, layer_norm=SequenceParallelTorchNorm)


def build(spec: Spec, fields: dict, options: dict, pre_process: bool = True, post_process: bool = True):
    """The model (a pipeline stage: the embedding with `pre_process`, the output layer and loss with
    `post_process`), wrapped as Megatron-LM's `get_model` wraps it, and its optimizer."""
    chunks, optimizer = build_chunks(spec, fields, options, [(None, pre_process, post_process)])
    return chunks[0], optimizer


def build_chunks(spec: Spec, fields: dict, options: dict, parts: list):
    """The model chunks `parts` ((vp_stage, pre_process, post_process) each) as Megatron-LM's `get_model` builds a
    virtual pipeline: every chunk's `GPTModel`, then each `model.cuda()`, each `Float16Module`, each its own
    `DistributedDataParallel` (gradient buffer), then one optimizer over all chunks."""
    import torch
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer.module import Float16Module

    config = transformer_config(spec, fields, options)
    layer_spec = get_gpt_layer_local_spec(
        num_experts=config.num_moe_experts, moe_grouped_gemm=False, normalization="RMSNorm",
        qk_layernorm=config.qk_layernorm,
    )
    models = [
        GPTModel(
            config,
            sequence_parallel_block(config, layer_spec, vp_stage) if config.sequence_parallel else layer_spec,
            vocab_size=padded_vocab(fields["vocab_size"], options, spec.parallel.tp),
            max_sequence_length=spec.seq_len,
            position_embedding_type="rope",
            rotary_base=int(fields.get("rope_theta", 10000)),
            share_embeddings_and_output_weights=bool(fields.get("tie_word_embeddings", False)),
            pre_process=pre_process,
            post_process=post_process,
            **({} if vp_stage is None else {"vp_stage": vp_stage}),
        )
        for vp_stage, pre_process, post_process in parts
    ]
    # Megatron-LM's get_model: to the GPU (the torch norms are made on the host), then bf16.
    for model in models:
        model.cuda(torch.cuda.current_device())
    models = [Float16Module(config, model) for model in models]
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=options["distributed_optimizer"],
    )
    chunks = [DistributedDataParallel(config=config, ddp_config=ddp_config, module=model) for model in models]
    optimizer = get_megatron_optimizer(
        OptimizerConfig(
            optimizer="adam",
            lr=1e-5,
            weight_decay=0.01,
            bf16=True,
            params_dtype=torch.bfloat16,
            use_distributed_optimizer=options["distributed_optimizer"],
            clip_grad=1.0,
            **(
                dict(
                    optimizer_cpu_offload=True,
                    use_precision_aware_optimizer=True,
                    optimizer_offload_fraction=float(options["optimizer_offload_fraction"]),
                    overlap_cpu_optimizer_d2h_h2d=options["overlap_cpu_optimizer_d2h_h2d"],
                )
                if options["optimizer_cpu_offload"]
                else {}
            ),
        ),
        chunks,
        use_gloo_process_groups=False,
    )
    return chunks, optimizer


def initialize(spec: Spec, options: dict):
    """`initialize_model_parallel` for the spec's sizes (no gloo groups: they serve checkpointing only, and the
    fake backend cannot make them), then `model_parallel_cuda_manual_seed(1234)`."""
    from megatron.core import parallel_state
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=spec.parallel.tp,
        expert_model_parallel_size=options["expert_model_parallel_size"],
        expert_tensor_parallel_size=options["expert_tensor_parallel_size"],
        create_gloo_process_groups=False,
    )
    model_parallel_cuda_manual_seed(1234)


def inputs(spec: Spec, fields: dict, device) -> tuple:
    """The step's batch, made once: `input_ids` (also the labels), `position_ids` and the loss mask."""
    import torch

    torch.manual_seed(1234)
    ids = torch.randint(0, fields["vocab_size"], (spec.batch_size, spec.seq_len), device=device)
    position_ids = torch.arange(spec.seq_len, device=device).unsqueeze(0).expand_as(ids)
    loss_mask = torch.ones(spec.batch_size * spec.seq_len, device=device)
    return ids, position_ids, loss_mask


def train_step(ddp_model, optimizer, batch: tuple, mark) -> float:
    """One `forward_backward_no_pipelining` step with one micro-batch (the module docstring), `mark(part)` called
    as each part begins (`forward`, `backward`, `optimizer`) and when the step ends (`end`). Returns the loss."""
    import torch
    from megatron.core.distributed import finalize_model_grads

    ids, position_ids, loss_mask = batch
    ddp_model.zero_grad_buffer()
    optimizer.zero_grad()
    mark("forward")
    output = ddp_model(ids, position_ids, None, labels=ids)
    loss = torch.sum(output.view(-1).float() * loss_mask) / loss_mask.sum()
    del output
    mark("backward")
    value = float(loss.detach())
    torch.autograd.backward(loss)
    del loss
    finalize_model_grads([ddp_model])
    mark("optimizer")
    optimizer.step()
    mark("end")
    return value


def routed_tokens(spec: Spec, sequences: int) -> int:
    """Tokens a rank's router sees in `sequences` sequences: with sequence parallelism the MoE layer takes this
    rank's `1/tp` of them (`MoELayer` runs on the sequence-parallel shard)."""
    tokens = sequences * spec.seq_len
    par = spec.parallel
    return tokens // par.tp if par is not None and par.sequence_parallel else tokens


def balanced_routing(tokens: int, experts: int, topk: int):
    """Make routing the balanced routing headroom assumes (see the module docstring): the router's `routing_map`
    overwritten in place with token i sent to experts (i*k + j) mod E, and the token counts' all-gather filled as a
    world of identical ranks would. Returns the fixed map (persistent, made here, before the first step)."""
    import torch
    from megatron.core.transformer.moe import router, token_dispatcher

    rows = torch.arange(tokens, device="cuda").unsqueeze(1) * topk + torch.arange(topk, device="cuda")
    fixed = torch.zeros(tokens, experts, dtype=torch.bool, device="cuda")
    fixed.scatter_(1, rows % experts, True)
    del rows
    assert int(fixed.sum(dim=0).min()) == int(fixed.sum(dim=0).max()) == tokens * topk // experts
    real_topk = router.topk_routing_with_score_function

    def topk_balanced(logits, *args, **kwargs):
        probs, routing_map = real_topk(logits, *args, **kwargs)
        with torch.no_grad():
            routing_map.copy_(fixed)
        return probs, routing_map

    real_gather = token_dispatcher.gather_from_sequence_parallel_region

    def gather_identical(input_, *args, **kwargs):
        out = real_gather(input_, *args, **kwargs)
        if out is not input_ and not input_.is_floating_point():
            with torch.no_grad():
                out.view(-1, input_.numel()).copy_(input_.view(1, -1))
        return out

    router.topk_routing_with_score_function = topk_balanced
    token_dispatcher.gather_from_sequence_parallel_region = gather_identical
    return fixed



def spec_and_env(spec: Spec, options: dict, fields: dict, device, total: int, world: int, rank: int, t0: float,
                 **extra) -> tuple[dict, dict]:
    """A Megatron row's `spec` (the model's config inline, the `megatron:` options set) and `env` (GPU, versions,
    the layer spec, how routing was fixed, the fake world and rank, `extra` keys, the wall time since `t0`)."""
    import megatron.core
    import torch

    spec_json = spec.to_json()
    if spec.model_config is not None:
        spec_json["model_config"] = dict(spec.model_config)
    spec_json["megatron"] = {k: v for k, v in options.items() if v is not None}
    env = {
        "gpu": torch.cuda.get_device_properties(device).name,
        "gpu_total_bytes": total,
        **_versions(),
        "megatron_core": megatron.core.__version__,
        "layer_spec": "get_gpt_layer_local_spec (no Transformer Engine, no apex)"
        + (", torch RMSNorm marked sequence_parallel" if spec.parallel.sequence_parallel else ""),
        "routing": "balanced (harness-fixed routing_map; token counts gathered as identical ranks)"
        if moe_fields(fields) is not None else None,
        **extra,
        "world_size": world,
        **({"launcher": f"fake process group (one process, rank {rank})", "process_group": "fake"} if fake_group() else {
            "launcher": "torchrun",
            "process_group": "nccl",
            "nccl": ".".join(map(str, torch.cuda.nccl.version())),
            "nccl_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(("NCCL_", "TORCH_SYMM", "NVSHMEM"))},
        }),
        "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        "wall_s": round(time.time() - t0, 2),
    }
    return spec_json, env


def fake_group() -> bool:
    """Whether this process plays one rank of a fake world (HEADROOM_FAKE_WORLD) rather than being one of
    torchrun's ranks under NCCL."""
    return bool(os.environ.get("HEADROOM_FAKE_WORLD"))


def sync():
    """Waits for this rank's work and, in a real world, every rank's (dist.py's `synchronize(); barrier();
    synchronize()`): a collective's kernels count in the phase that launched them."""
    import torch
    import torch.distributed as dist

    torch.cuda.synchronize()
    if not fake_group():
        dist.barrier(device_ids=[torch.cuda.current_device()])
        torch.cuda.synchronize()


def load_record() -> dict:
    """The allocator's counters once the model and optimizer are built: the load phase's record."""
    import torch

    sync()
    s = torch.cuda.memory_stats()
    return {
        "peak_allocated": s.get("allocated_bytes.all.peak", 0),
        "peak_reserved": s.get("reserved_bytes.all.peak", 0),
        "end_allocated": torch.cuda.memory_allocated(),
        "end_reserved": torch.cuda.memory_reserved(),
    }


def phase_end(rec: dict, key: str):
    """Ends a measured phase: its allocated peak under `key`, the reserved peak so far, counters reset."""
    import torch

    sync()
    s = torch.cuda.memory_stats()
    rec[key] = s.get("allocated_bytes.all.peak", 0)
    rec["peak_reserved"] = max(rec.get("peak_reserved", 0), s.get("reserved_bytes.all.peak", 0))
    torch.cuda.reset_peak_memory_stats()


def start_rank(world: int, rank: int, snapshot: str | None, stacks: str, eager: bool):
    """Rank `rank` of a fake world of `world` on GPU 0 or, without HEADROOM_FAKE_WORLD, torchrun's rank on GPU
    `LOCAL_RANK` under NCCL: `init_process_group` (bound to the device when `eager`, so that every group's
    communicator is made at once; else each at its first collective, as Megatron-LM now), `torch.zeros(1)` (the CUDA context, measured as what
    `mem_get_info` no longer reports free), then the allocator's history if asked (a real world's rank 0, or every
    rank when the path holds `{rank}`). Returns the device, the context's bytes, the rank and its snapshot path."""
    import torch
    import torch.distributed as dist

    if fake_group():
        from torch.testing._internal.distributed.fake_pg import FakeStore

        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
        dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device if eager else None)
        rank = dist.get_rank()
        if dist.get_world_size() != world:
            raise RuntimeError(f"parallel.world_size is {world} but torchrun started {dist.get_world_size()} processes")
        if snapshot and "{rank}" in snapshot:
            snapshot = snapshot.replace("{rank}", str(rank))
        elif rank != 0:
            snapshot = None
    torch.zeros(1, device=device)
    free, total = torch.cuda.mem_get_info()
    if snapshot:
        if stacks == "none":
            torch.cuda.memory._record_memory_history(max_entries=1_000_000, context=None)
        else:
            torch.cuda.memory._record_memory_history(max_entries=1_000_000, stacks=stacks)
    return device, total - free, rank, snapshot


def every_rank(mine: dict) -> list:
    """Every rank's record in rank order: this one's alone under the fake group (it moves no data)."""
    import torch.distributed as dist

    if fake_group():
        return [mine]
    ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, mine)
    return ranks


def finish(record: dict) -> dict | None:
    """Ends the run: the record on rank 0 (None on a real world's other ranks), the groups destroyed."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    rank = dist.get_rank()
    if not fake_group():
        dist.barrier()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()
    return record if rank == 0 or fake_group() else None


def measure_megatron(spec: Spec, fields: dict, row_id: str | None = None, snapshot: str | None = None,
                     stacks: str = "python") -> dict:
    """Rank HEADROOM_FAKE_RANK (default 0) of a fake world of `parallel.world_size`, or every rank of a real one:
    build, then three steps; the record (dist.py's shape) on rank 0, or on the fake world's one process."""
    import torch

    t0 = time.time()
    options = megatron_options(spec)
    par = spec.parallel
    world = par.world_size
    fake_rank = int(os.environ.get("HEADROOM_FAKE_RANK", "0"))
    device, context, rank, snapshot = start_rank(world, fake_rank, snapshot, stacks, options["eager_nccl_init"])
    initialize(spec, options)
    ddp_model, optimizer = build(spec, fields, options)
    ddp_model.train()
    load = load_record()
    # The global count: a tensor-parallel weight is 1/tp of its layer on every rank, an expert's 1/etp of its
    # expert and 1/ep of the experts (its `allreduce` is False with ep or etp > 1); norms are replicated.
    ep, etp = options["expert_model_parallel_size"], options["expert_tensor_parallel_size"]

    def global_numel(p):
        if not getattr(p, "allreduce", True):
            return p.numel() * ep * (etp if getattr(p, "tensor_model_parallel", False) else 1)
        return p.numel() * (par.tp if getattr(p, "tensor_model_parallel", False) else 1)

    params = sum(global_numel(p) for p in ddp_model.parameters())

    batch = inputs(spec, fields, device)
    if (experts_fields := moe_fields(fields)) is not None:
        experts, top_k, _ = experts_fields
        fixed_routing = balanced_routing(  # noqa: F841 (kept alive: the router copies it every layer)
            routed_tokens(spec, spec.batch_size), experts, top_k
        )
    steps, losses = [], []
    peak_reserved = load["peak_reserved"]
    for step in range(STEPS):
        rec = {}

        def mark(part, rec=rec):
            if part == "forward":
                rec["start_allocated"] = torch.cuda.memory_allocated()
                torch.cuda.reset_peak_memory_stats()
            else:
                phase_end(rec, {"backward": "fwd_peak", "optimizer": "bwd_peak", "end": "opt_peak"}[part])

        value = train_step(ddp_model, optimizer, batch, mark)
        losses.append(round(value, 4) if math.isfinite(value) else None)
        rec["end_allocated"] = torch.cuda.memory_allocated()
        peak_reserved = max(peak_reserved, rec["peak_reserved"])
        steps.append(rec)
        print(f"[rank {rank} {time.time() - t0:6.1f}s] step {step + 1}: {rec}", file=sys.stderr, flush=True)
    if snapshot:
        torch.cuda.memory._dump_snapshot(snapshot)
        torch.cuda.memory._record_memory_history(enabled=None)
    free, total = torch.cuda.mem_get_info()
    phase_peaks = [load["peak_allocated"]] + [v for r in steps for k, v in r.items() if k.endswith("_peak")]
    mine = {
        "rank": rank,
        "local_rank": device.index,
        "load": load,
        "steps": steps,
        "peak_allocated_bytes": max(phase_peaks),
        "peak_reserved_bytes": peak_reserved,
        "cuda_context_bytes": context,
        "device_used_end_bytes": total - free,
        "losses": losses,
    }
    ranks = every_rank(mine)
    spec_json, env = spec_and_env(spec, options, fields, device, total, world, rank, t0)
    return finish({
        "id": row_id or f"megatron/{spec.model}/w{world}-tp{par.tp}",
        "spec": spec_json,
        "measured": {
            "peak_allocated_bytes": max(r["peak_allocated_bytes"] for r in ranks),
            "peak_reserved_bytes": max(r["peak_reserved_bytes"] for r in ranks),
            "ranks": ranks,
            "params": params,
            "trainable_params": params,
        },
        "env": env,
    })
