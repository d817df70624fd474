"""Per-rank peak memory of data-parallel and sharded training: one process per GPU, under torchrun.

    torchrun --nproc-per-node N -m headroom_measure dist SPEC --out FILE.jsonl [--id ID] [--snapshot FILE]

(--snapshot NAME-rank{rank}.pickle: every rank writes its own.)

N must equal the spec's `parallel.world_size`. Rank 0 appends one JSON line to FILE.jsonl:
`{"id", "spec" (with `parallel`), "measured": {"peak_allocated_bytes", "peak_reserved_bytes",
"ranks": [...], "params", "trainable_params"}, "env"}`.

The protocol is the single-GPU one (measure.py, bench/shared/calibration/README.md) run on every rank at
once: a fresh process per rank, random weights, three steps of forward (HF loss with
`labels=input_ids`, under `torch.autocast` for amp-* and bf16 exactly as measure.py),
`backward()`, `optimizer.step()`, `zero_grad(set_to_none=True)`. Every phase ends with
`torch.cuda.synchronize(); dist.barrier(device_ids=[local_rank]); torch.cuda.synchronize()`, and
only then are its peaks read (`allocated_bytes.all.peak`, `reserved_bytes.all.peak` of
`torch.cuda.memory_stats()`), then `torch.cuda.reset_peak_memory_stats()` starts the next phase;
so collectives still in flight on side streams (FSDP's reduce-scatter, DDP's all-reduce) land in
the phase that issued them. Per rank and step: `start_allocated`, `fwd_peak`, `bwd_peak`,
`opt_peak`, `peak_reserved`, `end_allocated`. The `load` phase is everything from process start
(the counters are never reset before it) through building, wrapping, weight initialisation and
optimizer construction: its `peak_allocated`, `peak_reserved`, `end_allocated`, `end_reserved`.
`cuda_context_bytes` is total - free (`mem_get_info`) after `init_process_group` (eager NCCL init
through `device_id`) and `torch.zeros(1)`; `device_used_end_bytes` the same reading after step 3
(context, NCCL buffers, cuBLAS workspaces and the allocator's reserve); `host_rss_peak_bytes` is
the process's VmHWM (CPU offload shows there).

Exactly how each strategy is built, in this order (the estimator's simulator copies it):

* Every strategy: `dist.init_process_group("nccl", device_id=torch.device("cuda", LOCAL_RANK))`
  after `torch.cuda.set_device(LOCAL_RANK)`; then `torch.zeros(1, device="cuda")`; then (with --snapshot: rank 0,
  or every rank when the path holds `{rank}`) `torch.cuda.memory._record_memory_history(
  max_entries=1_000_000, stacks="python")` (`--stacks all`: C++ frames too; `--stacks none`:
  `context=None`, the events without stack traces). The HF config is the one measure.py builds (`use_cache=False`). The token
  ids (`torch.randint(0, vocab, (batch_size, seq_len))`, a different seed per rank) are made
  after the model and the optimizer.

* `fsdp` (FSDP2, `torch.distributed.fsdp.fully_shard`):
  1. `with torch.device("meta"): model = cls.from_config(cfg, dtype=fp32 for fp32/amp-*, bf16 for
     bf16, attn_implementation=...)`.
  2. gradient checkpointing, if asked, as measure.py:
     `model.gradient_checkpointing_enable({"use_reentrant": False}); model.enable_input_require_grads()`.
  3. mesh: `init_device_mesh("cuda", (world_size,))`, or for HSDP (shard_size < world_size)
     `init_device_mesh("cuda", (world_size // shard_size, shard_size), mesh_dim_names=("replicate", "shard"))`.
  4. `fully_shard(layer, mesh=mesh, reshard_after_forward=R, offload_policy=O)` for each layer of
     `model.model.layers` in order, then `fully_shard(model, mesh=mesh, reshard_after_forward=R,
     offload_policy=O)` for the root (embeddings, final norm, lm_head; a tied lm_head is the
     embedding's parameter, held once). R is `parallel.reshard_after_forward`, passed explicitly
     to the root too, so the root's own "keep the root unsharded after forward" default is off:
     with R true the root's parameters are freed after forward and gathered again in backward.
     O is `CPUOffloadPolicy()` (pin_memory=True) when `offload_params`, else FSDP's default
     `OffloadPolicy()`. No MixedPrecisionPolicy: parameters, gradients and reductions are in the
     parameters' dtype.
  5. `model.to_empty(device="cuda")` (`"cpu"` under offload_params): each rank allocates its shard.
  6. `with torch.no_grad(): torch.nn.init.normal_(p, std=0.02)` for every parameter (DTensors:
     each rank fills its shard).
  7. The rotary embedding's non-persistent buffers (`inv_freq`, `original_inv_freq`) are garbage
     after `to_empty`, so `model.model.rotary_emb` is rebuilt: `with torch.device("cuda"):
     type(old)(config=model.config)` (on the GPU also under offload, where the inputs are).
  8. `torch.optim.AdamW(params, lr=1e-5)` (foreach) over the sharded parameters (measure.py's
     `_optimizer` for other optimizer names). Under offload the optimizer steps on the CPU.
  The wrapped HF module is called directly (`model(input_ids=ids, labels=ids)`).

* `fsdp1` (FSDP1, `torch.distributed.fsdp.FullyShardedDataParallel`, as accelerate 1.15's
  `Accelerator.prepare_model` wraps an HF model with `fsdp_version: 1` and transformer wrapping):
  1.-2. the model on the meta device and gradient checkpointing, as for `fsdp`.
  3. `FullyShardedDataParallel(model, auto_wrap_policy=partial(transformer_auto_wrap_policy,
     transformer_layer_cls={type(model.model.layers[0])}), sharding_strategy=S,
     cpu_offload=CPUOffload(offload_params=O), mixed_precision=M, backward_prefetch=B,
     forward_prefetch=False, limit_all_gathers=True, use_orig_params=U, device_id=<the GPU>,
     param_init_fn=<to_empty(device=<the GPU>, recurse=False), retied>, sync_module_states=False,
     device_mesh=<HSDP only>)`: one unit (one flat parameter) per decoder layer, then the root
     holding the rest (embeddings, final norm, lm_head; a tied lm_head held once: the init
     function reties it, as accelerate's `ensure_weights_retied` does). Each unit is materialised
     on the GPU, flattened and sharded, and under offload its shard then moves to the host.
     S: FULL_SHARD (reshard_after_forward) or SHARD_GRAD_OP; with shard_size < world_size
     HYBRID_SHARD or _HYBRID_SHARD_ZERO2 over `init_device_mesh("cuda", (world_size // shard_size,
     shard_size), mesh_dim_names=("replicate", "shard"))`. world_size 1 runs as NO_SHARD (FSDP1
     switches; the spec refuses shard_size 1 in a larger world). M: None, or `MixedPrecision(param_dtype, reduce_dtype, buffer_dtype,
     cast_forward_inputs)` from `parallel.mixed_precision`. B: `parallel.backward_prefetch`
     (pre: BACKWARD_PRE, torch's default; post: BACKWARD_POST; none: None, accelerate's default).
     U: `parallel.use_orig_params` (default true, as `accelerate launch` passes).
  4. `normal_(p, std=0.02)` under no_grad for every `p` of `model.parameters()` (the flat shards,
     or with use_orig_params the original parameters as views into them).
  5. the rotary embedding rebuilt on the GPU, as for `fsdp` (a policy's buffer_dtype casts it at
     the first forward).
  6. the optimizer as for `fsdp`, over `model.parameters()` (one flat shard per unit, or the
     original parameters' views: states sized to this rank's part of each).
  Autocast as for `fsdp`: `autocast: bf16` on top of a policy, the precision's own without one.

* `tp > 1` (tensor parallelism, torchtitan's Llama plan on an HF decoder; strategy `fsdp` or `none`):
  1.-2. the model on the meta device and gradient checkpointing, as for `fsdp`.
  3. mesh: `init_device_mesh("cuda", (world_size // tp, tp), mesh_dim_names=("dp", "tp"))`.
  4. `parallelize_module` on `mesh["tp"]` (`_parallelize_tp`): `embed_tokens` `RowwiseParallel(input_layouts=
     Replicate(), output_layouts=S)`, `lm_head` `ColwiseParallel(input_layouts=S, output_layouts=Shard(-1),
     use_local_output=False)`; per decoder layer q/k/v and gate/up `ColwiseParallel()`, o/down
     `RowwiseParallel(output_layouts=S)`. S is `Replicate()`, or with `sequence_parallel` `Shard(1)`, and then
     the norms are `SequenceParallel()`, `self_attn` and `mlp` get `PrepareModuleInput` from `Shard(1)` to
     `Replicate()`, and the embedding, o_proj and down_proj keep `use_local_output=False` (HF takes the
     positions from the embedding output's shape: it must be the global one).
  5. strategy `fsdp`: `fully_shard` each layer then the root over `mesh["dp"]` as for `fsdp` (its
     `mixed_precision` and `units`); strategy `none`: nothing more.
  6. `model.to_empty(device="cuda")`, then `normal_(std=0.02)` of each parameter's local shard, the rotary
     module rebuilt on the GPU; the optimizer as for `fsdp` over the DTensor parameters.
  Forward and backward run under `loss_parallel()` (the cross-entropy over the vocabulary shards).

* `cp > 1` (context parallelism as torchtitan applies it; strategy `fsdp`, with or without `tp`):
  the mesh is `(world_size // (cp * tp), cp, tp)` named `("dp", "cp", "tp")`; the tensor-parallel plan
  as above on `mesh["tp"]` when `tp > 1`; `fully_shard` over `mesh["dp", "cp"]._flatten("dp_cp")`
  (torchtitan's `dp_shard_cp`). Each step's forward and backward run inside torchtitan's
  `create_context_parallel_ctx`: `set_rotate_method("allgather")` and `context_parallel(mesh["cp"],
  buffers=[inputs], buffer_seq_dims=[1], no_restore_buffers={inputs})` on `inputs = ids.clone()` (the step's
  fresh batch, sharded in place with the head-tail load balancer); labels are the inputs.

* `ep > 1` (transformers' expert parallelism, strategy none, world_size = ep; `_build_transformers_plan`):
  1. `with torch.device("meta"): model = cls.from_config(cfg, ...)` as for `fsdp`.
  2. `init_device_mesh("cuda", (ep,))` (transformers' `initialize_tensor_parallelism`), then
     `maybe_distribute_model(model, DistributedConfig(tp_size=ep, tp_plan="auto",
     enable_expert_parallel=True), mesh)`, what `from_pretrained` calls before loading weights: the
     config's `base_model_ep_plan` through `apply_tensor_parallelism` (expert weights `Shard(0)`
     DTensors of `num_experts / ep` experts, the router's `EpRouterParallel` and the experts'
     `MoeExpertsParallel` hooks; everything else plain tensors).
  3. `to_empty`, `normal_(std=0.02)` of each local shard, the rotary module rebuilt on the GPU.
  4. peft and gradient checkpointing as measure.py's `_prepare` (LoRA only off the experts).
  5. the optimizer as for `fsdp` (full training needs `adamw-forloop`: foreach and fused AdamW refuse
     the mix of DTensors and plain tensors).

* `framework: transformers` (transformers' own tensor parallelism, strategy none, world_size = tp;
  `_build_transformers_plan`): as `ep > 1` with `DistributedConfig(tp_size=tp, tp_plan="auto")`: the
  config's `base_model_tp_plan` (q/k/v and gate/up `colwise`, o/down `rowwise`) and the head's
  `colwise_gather_output`; the embedding and the norms stay plain tensors, so the optimizer is
  `adamw-forloop`, and the loss runs on the gathered logits (no `loss_parallel`).

* `ddp`: `with torch.device("cuda"): model = cls.from_config(cfg, dtype=...)` as measure.py;
  gradient checkpointing as above; `DistributedDataParallel(model, device_ids=[local_rank])` with
  its defaults (bucket_cap_mb 25, gradient_as_bucket_view False, broadcast of rank 0's
  parameters and buffers at construction); `torch.optim.AdamW(ddp.parameters(), lr=1e-5)`.

* `zero1` / `zero2` / `zero3` (DeepSpeed): the DeepSpeed config is
  `{"train_micro_batch_size_per_gpu": batch_size, "gradient_accumulation_steps": 1,
  "steps_per_print": 10**9, "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "torch_adam": true}},
  "zero_optimization": {"stage": 1|2|3}, "bf16": {"enabled": true}}` (no `bf16` key for fp32).
  `offload_optimizer` adds `"offload_optimizer": {"device": "cpu", "pin_memory": true}` to
  zero_optimization and sets `torch_adam` false (DeepSpeedCPUAdam, a JIT-built op);
  `offload_params` (zero3) adds `"offload_param": {"device": "cpu", "pin_memory": true}`.
  A `mode: forward` instance of a pipeline (zero3 only) is an inference engine, as OpenRLHF and
  TRL make for a reference or reward model: the same config without `optimizer`, and
  `deepspeed.initialize(model=model, config=config)` without parameters.
  Stages 1 and 2 build the model as ddp does (`with torch.device("cuda")`, bf16 params for bf16);
  stage 3 first creates `transformers.integrations.HfDeepSpeedConfig(config)` (kept alive), so
  that `cls.from_config` builds the model under `deepspeed.zero.Init` (each parameter partitioned
  as its module is made). Gradient checkpointing as above, then
  `engine, *_ = deepspeed.initialize(model=model, model_parameters=trainable, config=config)`.
  A step is `loss = forward(engine)`, `engine.backward(loss)` (the bwd phase), `engine.step()`
  (the opt phase; it zeroes the gradients). The forward is wrapped in the same `torch.autocast`
  as the others, but DeepSpeed turns it off inside its engine (it warns so): with bf16 params the
  zero runs compute in plain bf16.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time

from .measure import STEPS, _hf_config, _optimizer, _train_forward, _versions, default_id
from .spec import Spec

SNAPSHOT_ENTRIES = 1_000_000


def _env_int(name: str, default: int) -> int:
    return int(os.environ.get(name, default))


def _host_rss_peak() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def ds_config(spec: Spec) -> dict:
    """The DeepSpeed config of a zero1/2/3 spec (see the module docstring)."""
    par = spec.parallel
    offload_opt = par.offload_optimizer
    zero: dict = {"stage": int(par.strategy[-1])}
    if offload_opt:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if par.offload_params:
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    cfg = {
        "train_micro_batch_size_per_gpu": spec.batch_size,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "torch_adam": not offload_opt}},
        "zero_optimization": zero,
    }
    if spec.mode != "train":  # an inference engine (OpenRLHF's and TRL's eval config): no optimizer
        del cfg["optimizer"]
    if spec.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def _enable_gc(spec: Spec, model) -> None:
    if spec.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()


def _build_fsdp(spec: Spec, cfg, cls, dtype, device):
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy

    par = spec.parallel
    with torch.device("meta"):
        model = cls.from_config(cfg, dtype=dtype, attn_implementation=spec.attention)
    _enable_gc(spec, model)
    if par.shard_size < par.world_size:
        mesh = init_device_mesh(
            device.type,
            (par.world_size // par.shard_size, par.shard_size),
            mesh_dim_names=("replicate", "shard"),
        )
    else:
        mesh = init_device_mesh(device.type, (par.world_size,))
    offload = CPUOffloadPolicy() if par.offload_params else OffloadPolicy()
    _fully_shard_units(model, par.units, _fully_shard_kwargs(torch, par, mesh, offload))
    model.to_empty(device="cpu" if par.offload_params else device)
    _initialize(model, device)
    return model


def _parallelize_tp(model, tp_mesh, sequence_parallel: bool) -> None:
    """torchtitan's Llama plan (`parallelize_llama`'s `apply_tp`) on an HF decoder: see the module
    docstring. HF computes the positions from the embedding output's global shape, so under
    sequence parallelism the residual stream stays a DTensor sharded on the sequence (the
    embedding, o_proj and down_proj keep `use_local_output=False`)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    seq = Shard(1) if sequence_parallel else Replicate()
    root_plan = {
        "model.embed_tokens": RowwiseParallel(
            input_layouts=Replicate(), output_layouts=seq, use_local_output=not sequence_parallel
        ),
        "lm_head": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
    }
    if sequence_parallel:
        root_plan["model.norm"] = SequenceParallel()
    parallelize_module(model, tp_mesh, root_plan)
    for layer in model.model.layers:
        plan = {
            "self_attn.q_proj": ColwiseParallel(),
            "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(),
            "self_attn.o_proj": RowwiseParallel(output_layouts=seq, use_local_output=not sequence_parallel),
            "mlp.gate_proj": ColwiseParallel(),
            "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel(output_layouts=seq, use_local_output=not sequence_parallel),
        }
        if sequence_parallel:
            plan.update({
                "input_layernorm": SequenceParallel(),
                "self_attn": PrepareModuleInput(
                    input_kwarg_layouts={"hidden_states": Shard(1)},
                    desired_input_kwarg_layouts={"hidden_states": Replicate()},
                ),
                "post_attention_layernorm": SequenceParallel(),
                "mlp": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            })
        parallelize_module(layer, tp_mesh, plan)


def _build_torchtitan(spec: Spec, cfg, cls, dtype, device):
    """torchtitan's layouts (`parallel.tp`, `parallel.cp`): tensor parallelism on the `tp` mesh
    dimension, then FSDP2 over the data-parallel dimensions (`dp`, flattened with `cp` as
    torchtitan's `dp_shard_cp`; strategy fsdp) or nothing more (strategy none). Returns the model and
    the `cp` mesh the steps run `context_parallel` on (None without context parallelism)."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import OffloadPolicy

    par = spec.parallel
    dp = par.world_size // (par.tp * par.cp)
    with torch.device("meta"):
        model = cls.from_config(cfg, dtype=dtype, attn_implementation=spec.attention)
    _enable_gc(spec, model)
    if par.cp > 1:
        mesh = init_device_mesh(device.type, (dp, par.cp, par.tp), mesh_dim_names=("dp", "cp", "tp"))
        shard_mesh = mesh["dp", "cp"]._flatten("dp_cp")
    else:
        mesh = init_device_mesh(device.type, (dp, par.tp), mesh_dim_names=("dp", "tp"))
        shard_mesh = mesh["dp"]
    if par.tp > 1:
        _parallelize_tp(model, mesh["tp"], par.sequence_parallel)
    if par.strategy == "fsdp":
        _fully_shard_units(model, par.units, _fully_shard_kwargs(torch, par, shard_mesh, OffloadPolicy()))
    model.to_empty(device=device)
    _initialize(model, device)
    return model, (mesh["cp"] if par.cp > 1 else None)


def _build_transformers_plan(spec: Spec, cfg, cls, dtype, device):
    """transformers' own distribution as `from_pretrained(..., distributed_config=DistributedConfig(...))`
    applies it, on the meta model the other builders start from: `initialize_tensor_parallelism`'s mesh over
    all ranks, then `maybe_distribute_model` with `DistributedConfig(tp_size=world, tp_plan="auto")` and,
    for `parallel.ep`, `enable_expert_parallel=True`. Expert parallelism follows the config's
    `base_model_ep_plan` (the experts `Shard(0)`, the router's and the experts' forward hooks); tensor
    parallelism (`parallel.framework: transformers`) its `base_model_tp_plan` and the head's
    `colwise_gather_output` (the projections' `Shard(0)`/`Shard(1)` DTensors and their forward hooks; the
    embedding and the norms stay plain tensors). Then the weights, peft and checkpointing as the single-run
    harness. Returns the model and its counts: `params` of the base model (before adapters, as measure.py
    counts it), `trainable_params` after them."""
    import torch
    from torch.distributed.device_mesh import init_device_mesh
    from transformers.distributed.configuration_utils import DistributedConfig

    from .measure import _prepare

    par = spec.parallel
    experts = par.ep > 1
    size = par.ep if experts else par.tp
    with torch.device("meta"):
        model = cls.from_config(cfg, dtype=dtype, attn_implementation=spec.attention)
    mesh = init_device_mesh(device.type, (size,))
    config = DistributedConfig(tp_size=size, tp_plan="auto", enable_expert_parallel=experts)
    model = type(model).maybe_distribute_model(model, config, mesh)
    model.to_empty(device=device)
    _initialize(model, device)
    params = _count_params(model, par.world_size)
    model = _prepare(spec, model)
    return model, (params, _count_params(model, par.world_size, trainable_only=True))


def _context_parallel(cp_mesh, inputs):
    """torchtitan's `create_context_parallel_ctx` around one step's forward and backward: the
    all-gather rotation of the ring (torchtitan's default `context_parallel_rotate_method`), the
    batch sharded in place on the sequence with the head-tail load balancer and not restored.
    HF derives the rotary positions from the shard's length (torchtitan shards `freqs_cis`
    instead: the same bytes); passing the load-balanced positions would make transformers read
    them as packed sequences and build a mask, which the ring refuses."""
    from torch.distributed.tensor.experimental import context_parallel
    from torch.distributed.tensor.experimental._attention import set_rotate_method

    set_rotate_method("allgather")
    return context_parallel(cp_mesh, buffers=[inputs], buffer_seq_dims=[1], no_restore_buffers={inputs})


def _initialize(model, device) -> None:
    """Random weights in every parameter a rank holds (the shards, or views into them), and the
    rotary module built again on the device (its `inv_freq` is computed, not initialised)."""
    import torch

    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        for p in model.parameters():
            # A DTensor's local shard, filled in place (DTensor's own random ops would need its
            # RNG tracker, which the fake process group cannot seed).
            torch.nn.init.normal_(p.to_local() if isinstance(p, DTensor) else p, std=0.02)
    old = model.model.rotary_emb
    with torch.device(device):
        model.model.rotary_emb = type(old)(config=model.config)


def _build_fsdp1(spec: Spec, cfg, cls, dtype, device):
    """FSDP1 as accelerate 1.15 wraps an HF model; see the module docstring. Returns the wrapped
    model and the model's (params, trainable_params), counted on the meta model: afterwards
    `parameters()` holds this rank's flat shards or views into them."""
    import functools

    import torch
    from torch.distributed.fsdp import (
        BackwardPrefetch,
        CPUOffload,
        FullyShardedDataParallel,
        MixedPrecision,
        ShardingStrategy,
    )
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    par = spec.parallel
    with torch.device("meta"):
        model = cls.from_config(cfg, dtype=dtype, attn_implementation=spec.attention)
    _enable_gc(spec, model)
    world = par.world_size
    counts = (_count_params(model, world), _count_params(model, world, trainable_only=True))
    mesh = None
    if par.shard_size < world:  # HYBRID_SHARD*: shard within `shard`, all-reduce across `replicate`
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(
            device.type, (world // par.shard_size, par.shard_size), mesh_dim_names=("replicate", "shard")
        )
        strategy = ShardingStrategy.HYBRID_SHARD if par.reshard_after_forward else ShardingStrategy._HYBRID_SHARD_ZERO2
    else:
        strategy = ShardingStrategy.FULL_SHARD if par.reshard_after_forward else ShardingStrategy.SHARD_GRAD_OP
    mixed = None
    if par.mixed_precision is not None:
        names = {"bf16": torch.bfloat16, "fp32": torch.float32, None: None}
        mp = par.mixed_precision
        mixed = MixedPrecision(
            param_dtype=names[mp["param_dtype"]],
            reduce_dtype=names[mp["reduce_dtype"]],
            buffer_dtype=names[mp["buffer_dtype"]],
            cast_forward_inputs=mp["cast_forward_inputs"],
        )
    prefetch = {"pre": BackwardPrefetch.BACKWARD_PRE, "post": BackwardPrefetch.BACKWARD_POST, "none": None}
    layer_cls = type(model.model.layers[0])
    model = FullyShardedDataParallel(
        model,
        auto_wrap_policy=functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={layer_cls}),
        sharding_strategy=strategy,
        cpu_offload=CPUOffload(offload_params=par.offload_params),
        mixed_precision=mixed,
        backward_prefetch=prefetch[par.backward_prefetch],
        forward_prefetch=False,
        limit_all_gathers=True,
        use_orig_params=par.use_orig_params,
        # Each unit is materialised on the device, flattened, sharded (then moved to the host under
        # offload), as accelerate's `device_id` moves a CPU-loaded unit to the GPU first.
        device_id=device,
        param_init_fn=_materialize_tied(device),
        sync_module_states=False,
        device_mesh=mesh,
    )
    # parameters(): the FlatParameters (this rank's shards) with use_orig_params false, else the
    # original parameters as views into them (empty where a parameter lies outside the shard);
    # either way every parameter element of the shard is drawn (FSDP zero-fills the padding).
    _initialize(model, device)
    return model, counts


def _materialize_tied(device):
    """FSDP1's `param_init_fn`: `module.to_empty(device=device, recurse=False)` for each module it
    materialises. That gives each module a new Parameter, so a tied lm_head would become a second
    copy of the embedding in the root's flat parameter; a parameter met again is set to the one
    made the first time, as accelerate's `ensure_weights_retied` does."""
    made: dict = {}  # id(meta parameter) -> (meta parameter, materialised one)

    def init(module):
        old = dict(module.named_parameters(recurse=False))
        module.to_empty(device=device, recurse=False)
        for name, p in old.items():
            if id(p) in made:
                setattr(module, name, made[id(p)][1])
            else:
                made[id(p)] = (p, getattr(module, name))

    return init


def _fully_shard_kwargs(torch, par, mesh, offload_policy) -> dict:
    """`fully_shard`'s keywords for `parallel`: the mesh, resharding, the offload policy and the
    `MixedPrecisionPolicy` the spec's `mixed_precision` names."""
    kwargs = {"mesh": mesh, "reshard_after_forward": par.reshard_after_forward, "offload_policy": offload_policy}
    if par.mixed_precision is not None:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        names = {"bf16": torch.bfloat16, "fp32": torch.float32, None: None}
        mp = par.mixed_precision
        kwargs["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=names[mp["param_dtype"]],
            reduce_dtype=names[mp["reduce_dtype"]],
            output_dtype=names[mp["output_dtype"]],
            cast_forward_inputs=mp["cast_forward_inputs"],
        )
    return kwargs


def _fully_shard_units(model, units: str, kwargs: dict) -> None:
    """`fully_shard` the modules a framework makes units of (`parallel.units`):
    - layers: each decoder layer, then the root with the spec's reshard_after_forward;
    - layers-keep-root: each decoder layer, then the root without it (FSDP2 keeps the root
      gathered; slime);
    - layers-embedding: each decoder layer, the input embedding when untied, the root (verl);
    - accelerate: as accelerate 1.15's `fsdp2_prepare_model` does: each decoder layer, the
      untied input embedding, `[final norm, (tied embedding,) lm_head]` with
      reshard_after_forward=False, then the root without the flag."""
    from torch.distributed.fsdp import fully_shard

    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    tied = model.get_output_embeddings() is not None and (
        model.get_output_embeddings().weight is model.get_input_embeddings().weight
    )
    if units in ("layers-embedding", "accelerate") and not tied:
        fully_shard(model.get_input_embeddings(), **kwargs)
    root_kwargs = dict(kwargs)
    if units == "accelerate":
        group = [model.model.norm]
        if tied:
            group.append(model.get_input_embeddings())
        if model.get_output_embeddings() is not None:
            group.append(model.get_output_embeddings())
        fully_shard(group, **{**kwargs, "reshard_after_forward": False})
    if units in ("layers-keep-root", "accelerate"):
        del root_kwargs["reshard_after_forward"]
    fully_shard(model, **root_kwargs)


def _build_ddp(spec: Spec, cfg, cls, dtype, device, local_rank):
    import torch
    from torch.nn.parallel import DistributedDataParallel

    with torch.device(device):
        model = cls.from_config(cfg, dtype=dtype, attn_implementation=spec.attention)
    _enable_gc(spec, model)
    ids = [local_rank] if device.type == "cuda" else None
    return DistributedDataParallel(model, device_ids=ids)


def _build_zero(spec: Spec, cfg, cls, dtype, device):
    """A DeepSpeed engine. DeepSpeed's `see_memory_usage(..., force=True)` resets the peak
    counters on rank 0 in the middle of construction, which cut the load phase's peak there
    (rank 1's was the true one); while building, that reset does nothing."""
    import torch

    reset = torch.cuda.reset_peak_memory_stats
    torch.cuda.reset_peak_memory_stats = lambda device=None: None
    try:
        return _initialize_zero(spec, cfg, cls, dtype, device)
    finally:
        torch.cuda.reset_peak_memory_stats = reset


def _initialize_zero(spec: Spec, cfg, cls, dtype, device):
    import deepspeed
    import torch

    config = ds_config(spec)
    keep = None
    if spec.parallel.strategy == "zero3":
        from transformers.integrations import HfDeepSpeedConfig

        keep = HfDeepSpeedConfig(config)  # noqa: F841 - must stay alive while the model is built
        model = cls.from_config(cfg, dtype=dtype, attn_implementation=spec.attention)
    else:
        with torch.device(device):
            model = cls.from_config(cfg, dtype=dtype, attn_implementation=spec.attention)
    _enable_gc(spec, model)
    if spec.mode == "train":
        trainable = [p for p in model.parameters() if p.requires_grad]
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=trainable, config=config)
    else:
        engine, _, _, _ = deepspeed.initialize(model=model, config=config)
    engine._headroom_keep = keep
    return engine


def measure_dist(
    spec: Spec, fields: dict, row_id: str | None = None, snapshot: str | None = None, stacks: str = "python"
) -> dict | None:
    """Measure on every rank; returns the record on rank 0 (None on the others)."""
    import torch
    import torch.distributed as dist

    t0 = time.time()
    par = spec.parallel
    on_cpu = os.environ.get("HEADROOM_DIST_CPU") == "1"  # a smoke test without GPUs (gloo, no counters)
    local_rank = _env_int("LOCAL_RANK", 0)
    fake_world = _env_int("HEADROOM_FAKE_WORLD", 0)
    # The rank a fake world's one process plays (a pipeline's stages differ: its last rank too).
    fake_rank = _env_int("HEADROOM_FAKE_RANK", 0)
    if on_cpu and fake_world:  # rank 0 of a fake world on the CPU: the harness's own tests
        from torch.testing._internal.distributed.fake_pg import FakeStore

        device = torch.device("cpu")
        dist.init_process_group("fake", rank=fake_rank, world_size=fake_world, store=FakeStore())
    elif on_cpu:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    elif fake_world:
        # Rank 0 of a world of `fake_world` on one GPU: torch's fake process group makes every
        # collective a no-op while FSDP allocates its buffers at their full size.
        from torch.testing._internal.distributed.fake_pg import FakeStore

        torch.cuda.set_device(0)
        device = torch.device("cuda", 0)
        dist.init_process_group("fake", rank=fake_rank, world_size=fake_world, store=FakeStore())
    else:
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != par.world_size:
        raise RuntimeError(f"parallel.world_size is {par.world_size} but torchrun started {world} processes")
    cuda = not on_cpu
    context = None
    if cuda:
        torch.zeros(1, device=device)
        free, total = torch.cuda.mem_get_info()
        context = total - free
    # Rank 0 only, or every rank when the path holds `{rank}`.
    if snapshot and "{rank}" in snapshot:
        snapshot = snapshot.replace("{rank}", str(rank))
    elif rank != 0 and not fake_world:
        snapshot = None
    snap = bool(snapshot) and cuda
    if snap:
        if stacks == "none":  # events (sizes, streams, order) without stack traces
            torch.cuda.memory._record_memory_history(max_entries=SNAPSHOT_ENTRIES, context=None)
        else:
            torch.cuda.memory._record_memory_history(max_entries=SNAPSHOT_ENTRIES, stacks=stacks)

    def sync():
        if cuda:
            torch.cuda.synchronize()
        dist.barrier(device_ids=[local_rank]) if cuda and not fake_world else dist.barrier()
        if cuda:
            torch.cuda.synchronize()

    def stats() -> tuple[int, int]:
        if not cuda:
            return 0, 0
        s = torch.cuda.memory_stats()
        return s.get("allocated_bytes.all.peak", 0), s.get("reserved_bytes.all.peak", 0)

    def allocated() -> int:
        return torch.cuda.memory_allocated() if cuda else 0

    def reset():
        if cuda:
            torch.cuda.reset_peak_memory_stats()

    # ---- load: build, wrap, initialise, optimizer
    cfg = _hf_config(spec, fields)
    import transformers

    cls = transformers.AutoModelForSequenceClassification if spec.task == "seq-cls" else transformers.AutoModelForCausalLM
    dtype = torch.bfloat16 if spec.precision == "bf16" else torch.float32
    engine = None
    counts = None
    pipeline_step = None
    cp_mesh = None
    if par.pp > 1:
        from . import pp

        chunks, pipeline_step, counts = pp.build(spec, cfg, cls, dtype, device, rank)
        model = torch.nn.ModuleList(chunks)
    elif par.framework == "transformers" or par.ep > 1:
        model, counts = _build_transformers_plan(spec, cfg, cls, dtype, device)
    elif par.tp > 1 or par.cp > 1:
        model, cp_mesh = _build_torchtitan(spec, cfg, cls, dtype, device)
        hf_model = model
    elif par.strategy == "fsdp":
        model = _build_fsdp(spec, cfg, cls, dtype, device)
        hf_model = model
    elif par.strategy == "fsdp1":
        model, counts = _build_fsdp1(spec, cfg, cls, dtype, device)
    elif par.strategy == "ddp":
        model = _build_ddp(spec, cfg, cls, dtype, device, local_rank)
        hf_model = model.module
    else:
        engine = _build_zero(spec, cfg, cls, dtype, device)
        model = engine
        hf_model = engine.module
    if counts is None:
        counts = (_count_params(hf_model, world), _count_params(hf_model, world, trainable_only=True))
    params, trainable_params = counts
    optimizer = None
    if engine is None:
        optimizer = _optimizer(spec, [p for p in model.parameters() if p.requires_grad])
    model.train()
    sync()
    peak_alloc, peak_res = stats()
    load = {
        "peak_allocated": peak_alloc,
        "peak_reserved": peak_res,
        "end_allocated": allocated(),
        "end_reserved": torch.cuda.memory_reserved() if cuda else 0,
    }

    torch.manual_seed(1234 + rank)
    ids = torch.randint(0, fields["vocab_size"], (spec.batch_size, spec.seq_len), device=device)
    autocast_dtype = {"amp-bf16": torch.bfloat16, "bf16": torch.bfloat16, "amp-fp16": torch.float16}.get(
        spec.precision
    )
    if par.mixed_precision is not None:  # the policy casts; autocast only where the spec adds it
        autocast_dtype = torch.bfloat16 if spec.autocast == "bf16" else None

    def autocast():
        if autocast_dtype is None or not cuda:
            return torch.autocast("cuda", enabled=False)
        return torch.autocast("cuda", dtype=autocast_dtype)

    steps = []
    losses = []
    peak_reserved = load["peak_reserved"]

    def phase_end(rec: dict, key: str):
        nonlocal peak_reserved
        sync()
        a, r = stats()
        rec[key] = a
        rec["peak_reserved"] = max(rec.get("peak_reserved", 0), r)
        peak_reserved = max(peak_reserved, r)
        reset()

    def loss_context():
        """torchtitan's `loss_parallel()` around forward and backward: the cross-entropy runs on
        the vocabulary shards the column-parallel head leaves (transformers' plan gathers the
        logits whole instead)."""
        if par.tp == 1 or par.framework == "transformers":
            return contextlib.nullcontext()
        from torch.distributed.tensor.parallel import loss_parallel

        return loss_parallel()

    for step in range(STEPS):
        rec = {"start_allocated": allocated()}
        reset()
        if pipeline_step is not None:
            # `schedule.step`: every micro-batch's forward and backward, in the schedule's order.
            with autocast(), loss_context():
                stage_losses = pipeline_step(ids)
            phase_end(rec, "step_peak")
            value = float(sum(float(v.detach()) for v in stage_losses) / len(stage_losses)) if stage_losses else None
            losses.append(round(value, 4) if value is not None and math.isfinite(value) else None)
            del stage_losses
            optimizer.step()
            phase_end(rec, "opt_peak")
            optimizer.zero_grad(set_to_none=True)
            sync()
            rec["end_allocated"] = allocated()
            steps.append(rec)
            print(f"[rank {rank} {time.time() - t0:6.1f}s] step {step + 1}: {json.dumps(rec)}", file=sys.stderr, flush=True)
            continue
        with contextlib.ExitStack() as step_context:
            inputs = ids
            if cp_mesh is not None:
                # The step's batch, which `context_parallel` shards in place (torchtitan's data
                # loader hands each step a fresh one).
                inputs = ids.clone()
                step_context.enter_context(_context_parallel(cp_mesh, inputs))
            with loss_context():
                loss = _train_forward(spec, model, inputs, autocast)
            phase_end(rec, "fwd_peak")
            value = float(loss.detach())
            # A sanity check (random weights: about ln(vocab)); under the fake process group a
            # tensor-parallel loss reduces nothing and may not be finite (written as null).
            losses.append(round(value, 4) if math.isfinite(value) else None)
            if engine is not None:
                engine.backward(loss)
            else:
                with loss_context():
                    loss.backward()
            del loss
            phase_end(rec, "bwd_peak")
        del inputs
        if engine is not None:
            engine.step()
        else:
            optimizer.step()
        phase_end(rec, "opt_peak")
        if engine is None:
            optimizer.zero_grad(set_to_none=True)
        sync()
        rec["end_allocated"] = allocated()
        steps.append(rec)
        print(f"[rank {rank} {time.time() - t0:6.1f}s] step {step + 1}: {json.dumps(rec)}", file=sys.stderr, flush=True)

    if snap:
        torch.cuda.memory._dump_snapshot(snapshot)
        torch.cuda.memory._record_memory_history(enabled=None)

    used_end = None
    if cuda:
        free, total = torch.cuda.mem_get_info()
        used_end = total - free
    phase_peaks = [load["peak_allocated"]] + [v for r in steps for k, v in r.items() if k.endswith("_peak")]
    mine = {
        "rank": rank,
        "local_rank": local_rank,
        "load": load,
        "steps": steps,
        "peak_allocated_bytes": max(phase_peaks),
        "peak_reserved_bytes": peak_reserved,
        "cuda_context_bytes": context,
        "device_used_end_bytes": used_end,
        "host_rss_peak_bytes": _host_rss_peak(),
        "losses": losses,
    }
    ranks: list = [None] * world
    if fake_world:
        ranks = [mine]  # only rank 0 exists; the fake group moves no data
    else:
        dist.all_gather_object(ranks, mine)
    record = None
    if rank == 0 or fake_world:
        spec_json = spec.to_json()
        if spec.model_config is not None:
            spec_json["model_config"] = dict(spec.model_config)
        env = {
            "gpu": torch.cuda.get_device_properties(device).name if cuda else "cpu",
            "gpu_total_bytes": torch.cuda.mem_get_info()[1] if cuda else None,
            **_versions(),
            "world_size": world,
            "launcher": f"fake process group (one process, rank {rank})" if fake_world else "torchrun",
            "process_group": "fake" if fake_world else ("gloo" if on_cpu else "nccl"),
            "nccl": ".".join(map(str, torch.cuda.nccl.version())) if cuda else None,
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
            "nccl_env": {k: v for k, v in sorted(os.environ.items()) if k.startswith(("NCCL_", "TORCH_SYMM", "NVSHMEM"))},
            "wall_s": round(time.time() - t0, 2),
        }
        if engine is not None:
            import deepspeed

            env["deepspeed"] = deepspeed.__version__
            env["deepspeed_config"] = ds_config(spec)
        record = {
            "id": row_id or default_id(spec) + f"/{par.strategy}-w{world}" + ("-fake" if fake_world else ""),
            "spec": spec_json,
            "measured": {
                "peak_allocated_bytes": max(r["peak_allocated_bytes"] for r in ranks),
                "peak_reserved_bytes": max(r["peak_reserved_bytes"] for r in ranks),
                "ranks": ranks,
                "params": params,
                "trainable_params": trainable_params,
            },
            "env": env,
        }
    dist.barrier()
    dist.destroy_process_group()
    return record


def _count_params(model, world: int, trainable_only: bool = False) -> int:
    """The model's full parameter count (not this rank's shard): DTensors by their global shape,
    DeepSpeed zero3 partitions by `ds_numel`. Tied parameters count once."""
    seen = set()
    total = 0
    for p in model.parameters():
        if id(p) in seen or (trainable_only and not p.requires_grad):
            continue
        seen.add(id(p))
        if hasattr(p, "ds_numel"):
            total += p.ds_numel
        else:
            total += p.numel()  # a DTensor's numel() is its global size
    return total
