"""The run spec: the same contract `headroom estimate` reads (see README, "Run spec").

Parsing and validation need no torch, so they are tested in CI on machines without a GPU.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TASKS = ("causal-lm", "seq-cls")
MODES = ("train", "forward")
PRECISIONS = ("fp32", "amp-bf16", "amp-fp16", "bf16")
OPTIMIZERS = ("adamw", "adamw-fused", "adamw-forloop", "sgd", "adafactor", "adamw-8bit", "none")
ATTENTIONS = ("sdpa", "eager")
# transformers 5.17's experts paths (`config._experts_implementation`; None = its default, grouped_mm)
EXPERTS_IMPLEMENTATIONS = ("grouped_mm", "eager", "batched_mm")
ROUTING_KEYS = ("max_tokens_per_expert_factor",)
# Model types whose experts module carries `@use_experts_implementation` in transformers 5.17; a
# config with an expert count (EXPERT_COUNT_FIELDS) counts as mixture-of-experts too.
MOE_MODEL_TYPES = ("qwen2_moe", "qwen3_moe", "mixtral", "olmoe", "deepseek_v2", "deepseek_v3", "gpt_oss")
EXPERT_COUNT_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts")
# Model types transformers builds with eager attention only: asking for sdpa raises there.
EAGER_ONLY_MODEL_TYPES = {
    "gpt_oss": "gpt_oss runs eager attention only (transformers 5.17: GptOssPreTrainedModel._supports_sdpa "
    "is False, and attn_implementation='sdpa' raises)",
}
QUANTIZATIONS = ("nf4",)
# none: no data-parallel wrapper (tensor parallelism alone, world_size = tp)
STRATEGIES = ("ddp", "fsdp", "fsdp1", "zero1", "zero2", "zero3", "none")
PARALLEL_KEYS = (
    "strategy", "world_size", "reshard_after_forward", "shard_size", "offload_params", "offload_optimizer",
    "mixed_precision", "units", "use_orig_params", "backward_prefetch", "tp", "sequence_parallel", "framework", "cp",
    "pp", "vpp", "microbatches", "schedule", "layers_per_stage", "ep",
)
# pp > 1: torch.distributed.pipelining's schedules the harness drives (pp.py)
PP_SCHEDULES = ("1f1b", "interleaved-1f1b", "gpipe")
# whose parallelisation the harness applies: torchtitan's plan (dist.py `_parallelize_tp`, tp > 1) or
# Megatron-core's GPTModel with its own DDP and optimizer (megatron.py, strategy ddp)
FRAMEWORKS = ("torchtitan", "megatron", "transformers")
# fsdp: which modules fully_shard makes units of (dist.py `_fully_shard_units`)
FSDP_UNITS = ("layers", "layers-keep-root", "layers-embedding", "accelerate")
MIXED_PRECISION_KEYS = ("param_dtype", "reduce_dtype", "output_dtype", "cast_forward_inputs")
# fsdp1: the fields of FSDP1's MixedPrecision that the harness sets
FSDP1_MIXED_PRECISION_KEYS = ("param_dtype", "reduce_dtype", "buffer_dtype", "cast_forward_inputs")
MP_DTYPES = ("bf16", "fp32")
# fsdp1: BackwardPrefetch.BACKWARD_PRE, BACKWARD_POST, or None
BACKWARD_PREFETCH = ("pre", "post", "none")

KNOWN_KEYS = {
    "model", "model_config", "task", "mode", "precision", "optimizer", "batch_size", "seq_len",
    "gradient_checkpointing", "attention", "lora", "quantization", "kbit_prepare", "allocator",
    "parallel", "autocast", "experts_implementation", "routing", "megatron",
}
LORA_KEYS = ("r", "alpha", "targets", "dropout", "target_parameters")


class SpecError(ValueError):
    """A run spec that cannot be measured; the message names the field, the value and what is allowed."""


@dataclass
class Lora:
    r: int
    alpha: float
    targets: Any  # "all-linear" or a list of module names ([] with target_parameters)
    dropout: float
    # peft's LoraConfig(target_parameters=...): names of nn.Parameters (e.g. the fused 3-D expert
    # stacks "mlp.experts.gate_up_proj"), wrapped by lora.ParamWrapper; None = none
    target_parameters: list[str] | None = None


@dataclass
class Parallel:
    """How the model is spread over `world_size` GPUs (one process each); see dist.py."""

    strategy: str
    world_size: int
    reshard_after_forward: bool = True  # fsdp, fsdp1: False = shard-grad-op
    shard_size: int = 0  # fsdp, fsdp1: HSDP group size; world_size = plain full sharding
    offload_params: bool = False  # fsdp: CPUOffloadPolicy; fsdp1: CPUOffload; zero3: offload_param to cpu
    offload_optimizer: bool = False  # zero1-3: offload_optimizer to cpu
    # fsdp: FSDP2's MixedPrecisionPolicy {param_dtype, reduce_dtype, output_dtype, cast_forward_inputs};
    # fsdp1: FSDP1's MixedPrecision {param_dtype, reduce_dtype, buffer_dtype, cast_forward_inputs}
    mixed_precision: dict | None = None
    units: str = "layers"
    use_orig_params: bool = True  # fsdp1 (what `accelerate launch` passes)
    backward_prefetch: str = "pre"  # fsdp1: torch's default BACKWARD_PRE
    # tensor parallelism on the inner mesh dimension (world_size = dp x tp); strategy fsdp shards
    # over dp, strategy none is tp alone
    tp: int = 1
    sequence_parallel: bool = False
    framework: str = "torchtitan"
    # pipeline parallelism on the outermost mesh dimension (world_size = pp x dp x tp); see pp.py
    pp: int = 1
    vpp: int = 1
    microbatches: int = 1
    schedule: str = "1f1b"
    layers_per_stage: list[int] | None = None
    # context parallelism (torchtitan's ring attention over SDPA): world_size = dp x cp x tp, FSDP2
    # shards over dp x cp
    cp: int = 1
    # expert parallelism as transformers applies `base_model_ep_plan` (dist.py `_build_transformers_plan`): alone, with
    # strategy none and world_size = ep
    ep: int = 1

    def to_json(self) -> dict:
        out = {
            "strategy": self.strategy,
            "world_size": self.world_size,
            "reshard_after_forward": self.reshard_after_forward,
            "shard_size": self.shard_size,
            "offload_params": self.offload_params,
            "offload_optimizer": self.offload_optimizer,
        }
        if self.mixed_precision is not None:
            out["mixed_precision"] = dict(self.mixed_precision)
        if self.units != "layers":
            out["units"] = self.units
        if self.strategy == "fsdp1":
            out["use_orig_params"] = self.use_orig_params
            out["backward_prefetch"] = self.backward_prefetch
        if self.tp > 1 or self.framework != "torchtitan":
            out["tp"] = self.tp
            out["sequence_parallel"] = self.sequence_parallel
            out["framework"] = self.framework
        if self.pp > 1:
            out.update(pp=self.pp, vpp=self.vpp, microbatches=self.microbatches, schedule=self.schedule)
            if self.layers_per_stage is not None:
                out["layers_per_stage"] = list(self.layers_per_stage)
        if self.cp > 1:
            out["cp"] = self.cp
            out["framework"] = self.framework
        if self.ep > 1:
            out["ep"] = self.ep
        return out


@dataclass
class Spec:
    model: str
    task: str = "causal-lm"
    mode: str = "train"
    precision: str = "amp-bf16"
    optimizer: str = "adamw"
    batch_size: int = 1
    seq_len: int = 512
    gradient_checkpointing: bool = False
    attention: str = "sdpa"
    lora: Lora | None = None
    quantization: str | None = None
    kbit_prepare: bool = False
    expandable_segments: bool = False
    model_config: dict | None = None
    parallel: Parallel | None = None
    autocast: str | None = None  # "bf16": torch.autocast on top of the mixed-precision policy
    # set on the HF config before the build (measure._hf_config); None = transformers' default (grouped_mm)
    experts_implementation: str | None = None
    # {max_tokens_per_expert_factor}: recorded only; the harness does not control routing
    routing: dict | None = None
    raw: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        """The spec as the calibration rows store it (the keys the user gave, normalised)."""
        out: dict[str, Any] = {
            "model": self.model,
            "task": self.task,
            "mode": self.mode,
            "precision": self.precision,
            "optimizer": self.optimizer,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "gradient_checkpointing": self.gradient_checkpointing,
            "attention": self.attention,
        }
        if self.lora is not None:
            out["lora"] = {
                "r": self.lora.r,
                "alpha": self.lora.alpha,
                "targets": self.lora.targets,
                "dropout": self.lora.dropout,
            }
            if self.lora.target_parameters is not None:
                out["lora"]["target_parameters"] = list(self.lora.target_parameters)
        if self.quantization:
            out["quantization"] = self.quantization
            out["kbit_prepare"] = self.kbit_prepare
        if self.expandable_segments:
            out["allocator"] = {"expandable_segments": True}
        if self.parallel is not None:
            out["parallel"] = self.parallel.to_json()
        if self.autocast:
            out["autocast"] = self.autocast
        if self.experts_implementation is not None:
            out["experts_implementation"] = self.experts_implementation
        if self.routing is not None:
            out["routing"] = dict(self.routing)
        return out


def _choice(raw: dict, key: str, allowed: tuple, default: str) -> str:
    value = raw.get(key, default)
    if value not in allowed:
        raise SpecError(f"`{key}`: {value!r} is not allowed; use one of {', '.join(allowed)}")
    return value


def _positive_int(raw: dict, key: str, default: int) -> int:
    value = raw.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise SpecError(f"`{key}`: {value!r} is not allowed; use an integer >= 1")
    return value


def _bool(raw: dict, key: str, default: bool) -> bool:
    value = raw.get(key, default)
    if not isinstance(value, bool):
        raise SpecError(f"`{key}`: {value!r} is not allowed; use true or false")
    return value


def parse(raw: dict, *, forward_parallel: bool = False) -> Spec:
    """A run spec from its mapping. `forward_parallel`: a `parallel` block may go with mode
    forward (a pipeline instance that only scores or generates); a single run trains."""
    if not isinstance(raw, dict):
        raise SpecError("a run spec is a mapping of keys (model, precision, ...)")
    unknown = sorted(set(raw) - KNOWN_KEYS)
    if unknown:
        raise SpecError(f"`{unknown[0]}` is not a run-spec key; known keys: {', '.join(sorted(KNOWN_KEYS))}")
    model = raw.get("model")
    if not isinstance(model, str) or not model:
        raise SpecError("`model`: a catalog name or a path to an HF config.json is required")
    spec = Spec(
        model=model,
        task=_choice(raw, "task", TASKS, "causal-lm"),
        mode=_choice(raw, "mode", MODES, "train"),
        precision=_choice(raw, "precision", PRECISIONS, "amp-bf16"),
        optimizer=_choice(raw, "optimizer", OPTIMIZERS, "adamw"),
        batch_size=_positive_int(raw, "batch_size", 1),
        seq_len=_positive_int(raw, "seq_len", 512),
        gradient_checkpointing=_bool(raw, "gradient_checkpointing", False),
        attention=_choice(raw, "attention", ATTENTIONS, "sdpa"),
        model_config=raw.get("model_config"),
        raw=raw,
    )
    if spec.mode == "forward" and "optimizer" not in raw:
        spec.optimizer = "none"
    lora = raw.get("lora")
    if lora is not None:
        spec.lora = _lora(lora)
    if raw.get("experts_implementation") is not None:
        spec.experts_implementation = _choice(raw, "experts_implementation", EXPERTS_IMPLEMENTATIONS, "grouped_mm")
    if raw.get("routing") is not None:
        spec.routing = _routing(raw["routing"])
    quant = raw.get("quantization")
    if quant is not None:
        if quant not in QUANTIZATIONS:
            raise SpecError(f"`quantization`: {quant!r} is not allowed; use one of {', '.join(QUANTIZATIONS)}")
        spec.quantization = quant
        spec.kbit_prepare = _bool(raw, "kbit_prepare", False)
    elif "kbit_prepare" in raw:
        raise SpecError("`kbit_prepare` needs `quantization: nf4`")
    alloc = raw.get("allocator") or {}
    if not isinstance(alloc, dict) or set(alloc) - {"expandable_segments"}:
        raise SpecError(f"`allocator`: {alloc!r} is not allowed; use {{expandable_segments: true|false}}")
    spec.expandable_segments = _bool(alloc, "expandable_segments", False)
    if raw.get("parallel") is not None:
        spec.parallel = _parallel(raw["parallel"], spec, forward_parallel)
    autocast = raw.get("autocast")
    if autocast not in (None, "none"):
        if autocast != "bf16":
            raise SpecError(f"`autocast`: {autocast!r} is not allowed; use bf16 or none")
        if spec.parallel is None or spec.parallel.mixed_precision is None:
            raise SpecError("`autocast`: it adds autocast on top of parallel.mixed_precision; without one use "
                            "precision: amp-bf16")
        spec.autocast = autocast
    return spec


def _lora(lora: Any) -> Lora:
    """`lora`: {r, alpha, targets, dropout, target_parameters}. With target_parameters, `targets`
    defaults to [] (no module) and may be []; peft 0.21's ParamWrapper refuses lora_dropout != 0."""
    if not isinstance(lora, dict):
        raise SpecError(f"`lora`: use a mapping {{{', '.join(LORA_KEYS)}}}")
    unknown = sorted(set(lora) - set(LORA_KEYS))
    if unknown:
        raise SpecError(f"`lora.{unknown[0]}` is not a lora key; known keys: {', '.join(LORA_KEYS)}")
    params = lora.get("target_parameters")
    if params is not None and not (
        isinstance(params, list) and params and all(isinstance(t, str) and t for t in params)
    ):
        raise SpecError(
            f"`lora.target_parameters`: {params!r} is not allowed; use a list of parameter names, "
            "e.g. [mlp.experts.gate_up_proj, mlp.experts.down_proj]"
        )
    targets = lora.get("targets", "all-linear" if params is None else [])
    if targets != "all-linear" and not (
        isinstance(targets, list) and (targets or params is not None) and all(isinstance(t, str) for t in targets)
    ):
        raise SpecError(
            f"`lora.targets`: {targets!r} is not allowed; use all-linear or a list of module names "
            "([] only with lora.target_parameters)"
        )
    dropout = lora.get("dropout", 0.0)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0 <= dropout < 1:
        raise SpecError(f"`lora.dropout`: {dropout!r} is not allowed; use a number >= 0 and < 1")
    if params is not None and dropout != 0:
        raise SpecError(
            f"`lora.dropout`: {dropout!r} is not allowed with lora.target_parameters; use 0 "
            "(peft 0.21's lora.ParamWrapper refuses lora_dropout != 0)"
        )
    return Lora(
        r=_positive_int(lora, "r", 8),
        alpha=float(lora.get("alpha", 8)),
        targets=targets,
        dropout=float(dropout),
        target_parameters=list(params) if params is not None else None,
    )


def _routing(raw: Any) -> dict:
    """`routing`: {max_tokens_per_expert_factor: a number >= 1.0}. Recorded only: the harness
    builds random weights and cannot steer the router."""
    if not isinstance(raw, dict) or set(raw) != set(ROUTING_KEYS):
        raise SpecError(
            f"`routing`: {raw!r} is not allowed; use a mapping {{max_tokens_per_expert_factor: a number >= 1.0}}"
        )
    factor = raw["max_tokens_per_expert_factor"]
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not factor >= 1.0:
        raise SpecError(
            f"`routing.max_tokens_per_expert_factor`: {factor!r} is not allowed; use a number >= 1.0"
        )
    return {"max_tokens_per_expert_factor": float(factor)}


def _parallel(raw: Any, spec: Spec, forward_ok: bool = False) -> Parallel:
    """`parallel`: {strategy, world_size, reshard_after_forward, shard_size, offload_params,
    offload_optimizer, mixed_precision, units, use_orig_params, backward_prefetch}; each option
    only where its strategy has it."""
    if not isinstance(raw, dict):
        raise SpecError(f"`parallel`: {raw!r} is not allowed; use a mapping {{{', '.join(PARALLEL_KEYS)}}}")
    unknown = sorted(set(raw) - set(PARALLEL_KEYS))
    if unknown:
        raise SpecError(f"`parallel.{unknown[0]}` is not a parallel key; known keys: {', '.join(PARALLEL_KEYS)}")
    if "strategy" not in raw:
        raise SpecError(f"`parallel.strategy` is required; use one of {', '.join(STRATEGIES)}")
    strategy = raw["strategy"]
    if strategy not in STRATEGIES:
        raise SpecError(f"`parallel.strategy`: {strategy!r} is not allowed; use one of {', '.join(STRATEGIES)}")
    if "world_size" not in raw:
        raise SpecError("`parallel.world_size` is required; use an integer >= 1 (the number of GPUs)")
    world = raw["world_size"]
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise SpecError(f"`parallel.world_size`: {world!r} is not allowed; use an integer >= 1")

    # Every key may be given (to_json writes them all), but one that its strategy does not have
    # must hold its default.
    def flag(key: str, default: bool, strategies: tuple) -> bool:
        value = raw.get(key, default)
        if not isinstance(value, bool):
            raise SpecError(f"`parallel.{key}`: {value!r} is not allowed; use true or false")
        if value != default and strategy not in strategies:
            raise SpecError(
                f"`parallel.{key}`: {value!r} applies only to strategy {' / '.join(strategies)}, not {strategy}; "
                f"leave it out or {str(default).lower()}"
            )
        return value

    fsdps = ("fsdp", "fsdp1")
    out = Parallel(strategy=strategy, world_size=world)
    out.reshard_after_forward = flag("reshard_after_forward", True, fsdps)
    out.offload_params = flag("offload_params", False, (*fsdps, "zero3"))
    out.offload_optimizer = flag("offload_optimizer", False, ("zero1", "zero2", "zero3"))
    out.use_orig_params = flag("use_orig_params", True, ("fsdp1",))
    prefetch = raw.get("backward_prefetch", "pre")
    if prefetch not in BACKWARD_PREFETCH:
        raise SpecError(
            f"`parallel.backward_prefetch`: {prefetch!r} is not allowed; use one of {', '.join(BACKWARD_PREFETCH)}"
        )
    if prefetch != "pre" and strategy != "fsdp1":
        raise SpecError(
            f"`parallel.backward_prefetch`: {prefetch!r} applies only to strategy fsdp1, not {strategy}; "
            "leave it out or pre"
        )
    out.backward_prefetch = prefetch
    shard = raw.get("shard_size", world)
    if isinstance(shard, bool) or not isinstance(shard, int) or shard < 1 or world % shard:
        raise SpecError(
            f"`parallel.shard_size`: {shard!r} is not allowed; use an integer >= 1 that divides world_size ({world})"
        )
    # Under tensor or pipeline parallelism the data-parallel group is world_size / (tp x pp) (to_json
    # writes it).
    model_parallel = 1
    for key in ("tp", "pp"):
        degree = raw.get(key, 1)
        if type(degree) is int and degree >= 1 and world % (model_parallel * degree) == 0:
            model_parallel *= degree
    dp = world // model_parallel
    if shard not in (world, dp) and strategy not in fsdps:
        raise SpecError(
            f"`parallel.shard_size`: {shard!r} applies only to strategy fsdp / fsdp1, not {strategy}; "
            f"leave it out or world_size ({world})"
        )
    if strategy == "fsdp1" and shard == 1 < world:
        raise SpecError(
            f"`parallel.shard_size`: 1 is not allowed with strategy fsdp1 and world_size {world}: FSDP1 turns a "
            "shard group of one GPU into NO_SHARD, which all-reduces within that group alone (the replicas never "
            "sync); use an integer >= 2 that divides world_size, or strategy ddp"
        )
    out.shard_size = shard
    mp = raw.get("mixed_precision")
    if mp is not None:
        if strategy not in fsdps:
            raise SpecError(f"`parallel.mixed_precision` applies only to strategy fsdp / fsdp1, not {strategy}")
        # FSDP2's MixedPrecisionPolicy casts the root's outputs (output_dtype) and by default the
        # inputs of every unit; FSDP1's MixedPrecision casts buffers (buffer_dtype) and by default
        # only the root's inputs (cast_forward_inputs false).
        keys, other, cast_inputs = MIXED_PRECISION_KEYS, "buffer_dtype", True
        if strategy == "fsdp1":
            keys, other, cast_inputs = FSDP1_MIXED_PRECISION_KEYS, "output_dtype", False
        if isinstance(mp, dict) and other in mp:
            raise SpecError(
                f"`parallel.mixed_precision.{other}`: {mp[other]!r} does not apply to strategy {strategy}; "
                f"leave it out (the policy's keys there: {', '.join(keys)})"
            )
        if not isinstance(mp, dict) or set(mp) - set(keys):
            raise SpecError(
                f"`parallel.mixed_precision`: {mp!r} is not allowed; use a mapping of {', '.join(keys)}"
            )
        policy = {
            "param_dtype": mp.get("param_dtype", "bf16"),
            "reduce_dtype": mp.get("reduce_dtype"),
            keys[2]: mp.get(keys[2]),  # output_dtype (fsdp) or buffer_dtype (fsdp1)
            "cast_forward_inputs": mp.get("cast_forward_inputs", cast_inputs),
        }
        for key in keys[:3]:
            value = policy[key]
            if value is not None and value not in MP_DTYPES:
                raise SpecError(f"`parallel.mixed_precision.{key}`: {value!r} is not allowed; use bf16 or fp32")
        if not isinstance(policy["cast_forward_inputs"], bool):
            raise SpecError("`parallel.mixed_precision.cast_forward_inputs`: use true or false")
        if spec.precision not in ("fp32", "bf16"):
            raise SpecError(
                f"`precision`: {spec.precision!r} is not measured with a mixed-precision policy; use fp32 or "
                "bf16 (the parameters' storage; `autocast: bf16` adds autocast)"
            )
        out.mixed_precision = policy
    units = raw.get("units", "layers")
    if units != "layers":
        if strategy == "fsdp1":
            raise SpecError(
                f"`parallel.units`: {units!r} does not apply to strategy fsdp1 (transformer_auto_wrap_policy "
                "over the decoder layers, then the root); leave it out or layers"
            )
        if strategy != "fsdp":
            raise SpecError(f"`parallel.units` applies only to strategy fsdp, not {strategy}")
        if units not in FSDP_UNITS:
            raise SpecError(f"`parallel.units`: {units!r} is not allowed; use one of {', '.join(FSDP_UNITS)}")
    out.units = units
    _pipeline_parallel(raw, out)
    _expert_parallel(raw, out, spec)
    _tensor_parallel(raw, out, spec)
    _context_parallel(raw, out, spec)
    if spec.mode != "train" and not forward_ok:
        raise SpecError(f"`parallel`: mode {spec.mode!r} is not allowed; sharded runs are measured in mode train")
    if spec.quantization or (spec.lora is not None and out.ep == 1):
        raise SpecError("`parallel`: not measured with `quantization` or `lora`; leave those out")
    if strategy.startswith("zero") and spec.precision not in ("bf16", "fp32"):
        raise SpecError(
            f"`precision`: {spec.precision!r} is not allowed with strategy {strategy}; use bf16 or fp32 "
            "(DeepSpeed keeps fp32 master weights itself)"
        )
    if strategy in ("zero1", "zero2") and spec.mode != "train":
        raise SpecError(
            f"`parallel.strategy`: {strategy!r} is not allowed with mode {spec.mode!r}; a forward-only model "
            "under ZeRO-1/2 is a plain copy on every GPU: leave parallel out, or use zero3 (an inference "
            "engine that partitions the parameters)"
        )
    if strategy.startswith("zero") and spec.mode == "train" and spec.optimizer != "adamw":
        raise SpecError(f"`optimizer`: {spec.optimizer!r} is not allowed with strategy {strategy}; use adamw")
    return out


def _transformers_tensor_parallel(out: Parallel, spec, tp: int, sp: bool) -> None:
    """transformers' own tensor parallelism (`DistributedConfig(tp_size=tp)`: the config's
    `base_model_tp_plan`): alone over every rank, as `maybe_distribute_model` applies it."""
    if tp < 2 or out.strategy != "none" or out.world_size != tp:
        raise SpecError(
            f"`parallel.framework`: 'transformers' needs strategy none and world_size == tp >= 2, not "
            f"{out.strategy}, {out.world_size} and {tp} (transformers 5.17 applies one of tensor, FSDP2 or "
            "pipeline parallelism)"
        )
    if sp:
        raise SpecError(
            "`parallel.sequence_parallel`: true is not allowed with framework transformers; the models' "
            "base_model_tp_plan has no sequence-parallel entries: leave it out"
        )
    if out.pp > 1:
        raise SpecError("`parallel.framework`: 'transformers' is tensor parallelism alone; leave pp out")
    if spec.optimizer not in ("adamw-forloop", "none"):
        raise SpecError(
            f"`optimizer`: {spec.optimizer!r} is not allowed with framework transformers; use adamw-forloop (the "
            "plan leaves the embedding and the norms plain tensors beside DTensors, which torch 2.11's foreach "
            "and fused AdamW refuse; transformers' Trainer steps them one at a time too)"
        )


def _tensor_parallel(raw: dict, out: Parallel, spec) -> None:
    """`tp`, `sequence_parallel`, `framework`: the tensor-parallel mesh dimension, composed with
    strategy fsdp (FSDP2 over the data-parallel dimension) or alone (strategy none)."""
    tp = raw.get("tp", 1)
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1 or out.world_size % tp:
        raise SpecError(
            f"`parallel.tp`: {tp!r} is not allowed; use an integer >= 1 that divides world_size ({out.world_size})"
        )
    sp = raw.get("sequence_parallel", False)
    if not isinstance(sp, bool):
        raise SpecError(f"`parallel.sequence_parallel`: {sp!r} is not allowed; use true or false")
    framework = raw.get("framework", "torchtitan")
    if framework not in FRAMEWORKS:
        raise SpecError(f"`parallel.framework`: {framework!r} is not allowed; use one of {', '.join(FRAMEWORKS)}")
    if framework == "transformers":
        _transformers_tensor_parallel(out, spec, tp, sp)
    if framework == "megatron" and out.strategy != "ddp":
        raise SpecError(
            f"`parallel.strategy`: {out.strategy!r} is not allowed with framework megatron; use ddp (Megatron's "
            "DistributedDataParallel over world_size / tp ranks; megatron.distributed_optimizer shards its optimizer)"
        )
    if framework == "megatron" and raw.get("shard_size") not in (
        None, out.world_size // (tp * out.pp), out.world_size // tp, out.world_size
    ):
        raise SpecError("`parallel.shard_size`: it applies to fsdp; leave it out with framework megatron")
    if tp > 1 and framework != "megatron" and out.strategy not in ("fsdp", "none"):
        raise SpecError(
            f"`parallel.tp`: {tp} is not measured with strategy {out.strategy}; use fsdp (FSDP2 over the "
            "data-parallel dimension) or none (tensor parallelism alone)"
        )
    if tp == 1 and sp:
        raise SpecError(
            "`parallel.sequence_parallel`: true is not allowed; it shards the sequence over the tensor-parallel "
            "ranks: set tp >= 2 or leave it out"
        )
    if out.strategy == "none" and tp * out.pp * out.ep != out.world_size:
        raise SpecError(
            f"`parallel.strategy`: 'none' (tensor parallelism alone) needs world_size == tp, not "
            f"{out.world_size} and {tp}; use fsdp to shard over the data-parallel dimension"
        )
    if framework != "transformers" and out.strategy == "none" and tp > 1 and not sp:
        raise SpecError(
            "`parallel.sequence_parallel`: false is not allowed with strategy none: the norms stay plain "
            "tensors beside DTensors and AdamW's foreach step refuses the mix (torch 2.11); set it true or use fsdp"
        )
    if tp > 1 and framework != "megatron" and out.shard_size not in (out.world_size, out.world_size // tp):
        raise SpecError(
            f"`parallel.shard_size`: {out.shard_size!r} is not allowed with tp > 1: FSDP2 shards over the "
            f"data-parallel dimension (world_size / tp = {out.world_size // tp}); leave it out"
        )
    if tp > 1 and out.offload_params:
        raise SpecError("`parallel.offload_params`: CPU offload is not measured with tp > 1; leave it out")
    out.tp, out.sequence_parallel, out.framework = tp, sp, framework
    if tp > 1 or framework == "megatron":
        out.shard_size = out.world_size // (tp * out.pp)


def _expert_parallel(raw: dict, out: Parallel, spec: "Spec") -> None:
    """`ep`: transformers' expert parallelism, alone (strategy none, world_size = ep); full training steps
    the experts' DTensors beside plain tensors, which only the for-loop AdamW accepts (torch 2.11)."""
    ep = raw.get("ep", 1)
    if isinstance(ep, bool) or not isinstance(ep, int) or ep < 1:
        raise SpecError(f"`parallel.ep`: {ep!r} is not allowed; use an integer >= 1")
    if ep == 1:
        return
    if out.strategy != "none" or out.world_size != ep or out.pp > 1 or raw.get("tp", 1) != 1 or raw.get("cp", 1) != 1:
        raise SpecError(
            f"`parallel.ep`: {ep} is measured alone: strategy none, world_size = ep, without tp, cp or pp"
        )
    if spec.mode != "train":
        raise SpecError(f"`parallel.ep`: mode {spec.mode!r} is not allowed; it is measured in mode train")
    if spec.lora is None and spec.optimizer != "adamw-forloop":
        raise SpecError(
            f"`optimizer`: {spec.optimizer!r} is not allowed with parallel.ep; use adamw-forloop (the foreach "
            "and fused steps refuse the experts' DTensors beside plain tensors)"
        )
    if spec.lora is not None and spec.lora.target_parameters:
        raise SpecError("`lora.target_parameters`: not allowed with parallel.ep (peft's baddbmm refuses the DTensor)")
    out.ep = ep


def _pipeline_parallel(raw: dict, out: Parallel) -> None:
    """`pp`, `vpp`, `microbatches`, `schedule`, `layers_per_stage`: the pipeline mesh dimension (pp.py),
    measured with strategy none (no data-parallel wrapper) or fsdp (FSDP2 over world_size / pp)."""

    def positive(key: str, default: int) -> int:
        value = raw.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise SpecError(f"`parallel.{key}`: {value!r} is not allowed; use an integer >= 1")
        return value

    pp = positive("pp", 1)
    if pp == 1:
        for key in ("vpp", "microbatches", "schedule", "layers_per_stage"):
            if key in raw:
                raise SpecError(f"`parallel.{key}` applies to pipeline parallelism; set pp >= 2 or leave it out")
        return
    if out.world_size % pp:
        raise SpecError(f"`parallel.pp`: {pp} must divide world_size ({out.world_size})")
    megatron = raw.get("framework") == "megatron"
    if megatron and raw.get("schedule", "1f1b") not in ("1f1b", "interleaved-1f1b"):
        raise SpecError("`parallel.schedule`: framework megatron is measured with its 1f1b and interleaved-1f1b schedules")
    if not megatron and out.strategy not in ("none", "fsdp"):
        raise SpecError(
            f"`parallel.pp`: {pp} is measured with strategy none (world_size = pp) or fsdp (FSDP2 over "
            f"world_size / pp), not {out.strategy}"
        )
    if raw.get("cp", 1) != 1 or (raw.get("sequence_parallel", False) and not megatron):
        raise SpecError(
            "`parallel.cp`/`parallel.sequence_parallel`: not measured inside a pipeline (sequence parallelism: with "
            "framework megatron only); leave them out with pp >= 2"
        )
    if not megatron and out.strategy == "none" and out.world_size != pp:
        raise SpecError(f"`parallel.world_size`: {out.world_size} must equal pp ({pp}) with strategy none")
    schedule = raw.get("schedule", "1f1b")
    if schedule not in PP_SCHEDULES:
        raise SpecError(f"`parallel.schedule`: {schedule!r} is not allowed; use one of {', '.join(PP_SCHEDULES)}")
    out.pp, out.schedule = pp, schedule
    out.shard_size = out.world_size // pp  # FSDP2 shards over the data-parallel dimension (1: none)
    out.vpp = positive("vpp", 2 if schedule == "interleaved-1f1b" else 1)
    out.microbatches = positive("microbatches", pp)
    if schedule == "1f1b" and out.microbatches < pp and not megatron:
        raise SpecError(f"`parallel.microbatches`: {out.microbatches} is not allowed; Schedule1F1B needs at least pp ({pp})")
    if (schedule == "interleaved-1f1b") != (out.vpp > 1):
        raise SpecError(f"`parallel.vpp`: {out.vpp} is not allowed with schedule {schedule}; interleaved-1f1b takes 2 or more, the others 1")
    split = raw.get("layers_per_stage")
    if megatron and out.vpp > 1 and split is not None:
        raise SpecError("`parallel.layers_per_stage`: not measured with framework megatron and vpp > 1; leave it out "
                        "(the layers split evenly over the pp x vpp model chunks)")
    if split is not None and (
        not isinstance(split, list)
        or len(split) != pp * out.vpp
        or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in split)
    ):
        raise SpecError(f"`parallel.layers_per_stage`: {split!r} is not allowed; use {pp * out.vpp} positive layer counts")
    out.layers_per_stage = split


def _context_parallel(raw: dict, out: Parallel, spec) -> None:
    """`cp`: the context-parallel mesh dimension (dist.py `_build_torchtitan`), between the data-
    and tensor-parallel ones; FSDP2 shards over dp x cp as torchtitan's `dp_shard_cp` mesh does."""
    cp = raw.get("cp", 1)
    tp = out.tp
    if isinstance(cp, bool) or not isinstance(cp, int) or cp < 1 or out.world_size % (cp * tp):
        raise SpecError(
            f"`parallel.cp`: {cp!r} is not allowed; use an integer >= 1 with cp x tp dividing world_size "
            f"({out.world_size})"
        )
    if cp == 1:
        return
    if out.strategy != "fsdp":
        raise SpecError(
            f"`parallel.cp`: {cp} is not measured with strategy {out.strategy}; use fsdp (FSDP2 over dp x cp)"
        )
    if out.offload_params:
        raise SpecError("`parallel.offload_params`: CPU offload is not measured with cp > 1; leave it out")
    if spec.seq_len % (2 * cp) or (out.sequence_parallel and (spec.seq_len // cp) % tp):
        raise SpecError(
            f"`seq_len`: {spec.seq_len} is not allowed with cp {cp}; the load balancer cuts it into 2 x cp "
            "chunks (and sequence parallelism each rank's share into tp)"
        )
    if spec.attention != "sdpa":
        raise SpecError(f"`attention`: {spec.attention!r} is not allowed with cp > 1; ring attention replaces sdpa")
    out.cp = cp
    out.shard_size = out.world_size // tp


def load_raw(path: str | Path):
    """The mapping a YAML or JSON spec file holds, unchecked."""
    text = Path(path).read_text()
    if str(path).endswith(".json"):
        return json.loads(text)
    import yaml

    return yaml.safe_load(text)


def load(path: str | Path) -> Spec:
    """Read a run spec from a YAML or JSON file."""
    return parse(load_raw(path))


def resolve_model_config(spec: Spec, catalog: dict | None) -> dict:
    """The HF config fields of the spec's model: inline, a catalog name, or a config.json path;
    checked against the spec where the model type decides (`check_model_fields`)."""
    fields = _model_config(spec, catalog)
    check_model_fields(spec, fields)
    return fields


def is_moe(fields: dict) -> bool:
    """Whether the config is a mixture-of-experts one: a known MoE model type or an expert count."""
    if fields.get("model_type") in MOE_MODEL_TYPES:
        return True
    return any(isinstance(fields.get(k), int) and fields[k] > 0 for k in EXPERT_COUNT_FIELDS)


def check_model_fields(spec: Spec, fields: dict) -> None:
    """What only the model type can refuse: sdpa on an eager-only model (the spec's default
    attention is sdpa, so it must say eager), and the MoE keys on a dense model. A config without
    `model_type` is let through (transformers decides)."""
    model_type = fields.get("model_type")
    if not isinstance(model_type, str):
        return
    if spec.attention == "sdpa" and model_type in EAGER_ONLY_MODEL_TYPES:
        given = "`attention`: 'sdpa'" if "attention" in spec.raw else "`attention`: 'sdpa' (the default)"
        raise SpecError(
            f"{given} is not allowed for model_type {model_type}: {EAGER_ONLY_MODEL_TYPES[model_type]}; "
            "use attention: eager"
        )
    if not is_moe(fields):
        for key in ("experts_implementation", "routing"):
            if getattr(spec, key) is not None:
                raise SpecError(
                    f"`{key}`: {spec.raw.get(key)!r} applies only to mixture-of-experts models "
                    f"({', '.join(MOE_MODEL_TYPES)}, or a config with {' / '.join(EXPERT_COUNT_FIELDS)}); "
                    f"model_type {model_type} has no experts: leave it out"
                )


def _model_config(spec: Spec, catalog: dict | None) -> dict:
    if spec.model_config is not None:
        return dict(spec.model_config)
    if catalog and spec.model in catalog:
        return dict(catalog[spec.model])
    path = Path(spec.model)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return json.loads(path.read_text())
    known = ", ".join(sorted(catalog)) if catalog else "(no catalog given)"
    raise SpecError(f"`model`: {spec.model!r} is neither a catalog name nor a config.json path; catalog: {known}")
