"""`spec_from`: a run spec from the objects a training script already has.

Every object is read by its attributes (duck-typed), so nothing here imports transformers, peft,
TRL, accelerate or DeepSpeed; their own classes, a plain namespace with the same attributes, or
(for configs) a dict all work. What the objects do not say (the sequence length of a plain
`TrainingArguments`) is given as a keyword, and anything may be overridden the same way.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from typing import Any, Optional

from ._api import SpecError

# TrainingArguments.optim -> the spec's optimizer.
_OPTIMIZERS = {
    "adamw_torch": "adamw",
    "adamw_hf": "adamw",
    "adamw_torch_fused": "adamw-fused",
    "adamw_torch_foreach": "adamw",
    "sgd": "sgd",
    "adafactor": "adafactor",
    "adamw_bnb_8bit": "adamw-8bit",
    "adamw_8bit": "adamw-8bit",
    "paged_adamw_8bit": "adamw-8bit",
}

# A TRL config's class name -> the spec's trainer.
_TRL_TRAINERS = {
    "SFTConfig": "trl-sft",
    "DPOConfig": "trl-dpo",
    "GRPOConfig": "trl-grpo",
    "RewardConfig": "trl-reward",
}


def _get(obj: Any, key: str, default: Any = None) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(key, default)
    return getattr(obj, key, default)


def _value(x: Any) -> Any:
    """An enum's value (TrainingArguments keeps `optim` as an enum), else the thing itself."""
    return getattr(x, "value", x)


def _json_safe(x: Any) -> Any:
    return json.loads(json.dumps(x, default=str))


def _dtype_name(dtype: Any) -> Optional[str]:
    if dtype is None:
        return None
    return str(dtype).replace("torch.", "")


def _model_part(model: Any) -> tuple[dict, Optional[str], Any]:
    """(spec keys, the weights' dtype, a peft config found on the model) of a model, a config,
    a config dict, or a name."""
    if isinstance(model, (str, os.PathLike)):
        return {"model": os.fspath(model)}, None, None
    peft = None
    peft_configs = _get(model, "peft_config")
    if isinstance(peft_configs, Mapping) and peft_configs:
        peft = next(iter(peft_configs.values()))
    config = _get(model, "config")
    dtype = None
    if config is not None and not isinstance(model, Mapping):
        dtype = _dtype_name(_get(model, "dtype"))
    else:
        config = model
    if _get(config, "model_type") is None:
        raise SpecError(
            f"model: a {type(model).__name__} has no model_type; give a transformers model, its config, "
            "a config dict, or a model name",
            field="model",
            value=type(model).__name__,
            allowed="a transformers model or config (with model_type), a config dict, or a model name",
        )
    fields = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    fields = _json_safe(fields)
    dtype = dtype or _dtype_name(fields.get("dtype") or fields.get("torch_dtype"))
    name = _get(config, "name_or_path") or fields.get("_name_or_path") or fields["model_type"]
    spec: dict = {"model": name, "model_config": fields}
    quant = fields.get("quantization_config") or {}
    if quant.get("load_in_4bit") or quant.get("bnb_4bit_quant_type") == "nf4":
        spec["quantization"] = "nf4"
    if fields.get("architectures") and any(a.endswith("ForSequenceClassification") for a in fields["architectures"]):
        if _get(model, "score") is not None:
            spec["task"] = "seq-cls"
    return spec, dtype, peft


def _precision(args: Any, dtype: Optional[str]) -> str:
    bf16 = bool(_get(args, "bf16", False)) if args is not None else False
    fp16 = bool(_get(args, "fp16", False)) if args is not None else False
    if dtype == "bfloat16":
        return "bf16"
    if dtype == "float16":
        return "amp-fp16" if fp16 else "fp32"
    if bf16:
        return "amp-bf16"
    if fp16:
        return "amp-fp16"
    return "fp32"


def _args_part(args: Any) -> dict:
    """Keys of a `TrainingArguments` or a TRL config."""
    spec: dict = {}
    kind = _TRL_TRAINERS.get(type(args).__name__, "hf")
    spec["trainer"] = kind
    spec["batch_size"] = int(_get(args, "per_device_train_batch_size", 8))
    spec["gradient_checkpointing"] = bool(_get(args, "gradient_checkpointing", False))
    accumulation = _get(args, "gradient_accumulation_steps", 1)
    if accumulation and accumulation != 1:
        spec["gradient_accumulation_steps"] = int(accumulation)
    norm = _get(args, "max_grad_norm")
    if norm is not None:
        spec["max_grad_norm"] = float(norm)
    if _get(args, "use_liger_kernel", False):
        spec["use_liger_kernel"] = True
    optim = _value(_get(args, "optim"))
    if optim is not None:
        if str(optim) not in _OPTIMIZERS:
            raise SpecError(
                f"args.optim: {optim!r} is not modelled; modelled: {', '.join(sorted(_OPTIMIZERS))}",
                field="args.optim",
                value=str(optim),
                allowed=", ".join(sorted(_OPTIMIZERS)),
            )
        spec["optimizer"] = _OPTIMIZERS[str(optim)]
    max_length = _get(args, "max_length")
    if kind in ("trl-sft", "trl-dpo", "trl-reward") and max_length:
        spec["seq_len"] = int(max_length)
    if kind == "trl-dpo":
        prompt = _get(args, "max_prompt_length")
        if prompt:
            spec["prompt_len"] = int(prompt)
        beta = _get(args, "beta")
        if beta is not None:
            spec["beta"] = float(beta)
        if _get(args, "precompute_ref_log_probs", False):
            spec["precompute_ref_log_probs"] = True
    if kind == "trl-grpo":
        for key, spec_key in (
            ("max_prompt_length", "prompt_len"),
            ("max_completion_length", "completion_len"),
            ("num_generations", "num_generations"),
        ):
            if _get(args, key):
                spec[spec_key] = int(_get(args, key))
        beta = _get(args, "beta")
        if beta is not None:
            spec["beta"] = float(beta)
    if kind == "trl-reward":
        spec["task"] = "seq-cls"
    return spec


def _lora_part(peft: Any) -> dict:
    peft_type = _value(_get(peft, "peft_type"))
    if peft_type is not None and str(peft_type).upper() != "LORA":
        raise SpecError(
            f"peft_config: {peft_type} is not modelled; LoRA is",
            field="peft_config.peft_type",
            value=str(peft_type),
            allowed="LORA",
        )
    targets = _get(peft, "target_modules")
    if isinstance(targets, (set, frozenset, tuple)):
        targets = sorted(targets)
    lora: dict = {
        "r": int(_get(peft, "r", 8)),
        "alpha": _get(peft, "lora_alpha", 8),
        "dropout": float(_get(peft, "lora_dropout", 0.0) or 0.0),
    }
    if targets is not None:
        lora["targets"] = targets
    params = _get(peft, "target_parameters")
    if params:
        lora["target_parameters"] = list(params)
    return lora


def _read_config(config: Any, what: str) -> Mapping:
    """A config given as a mapping, an object with the same attributes, or a file (YAML/JSON)."""
    if isinstance(config, (str, os.PathLike)):
        path = os.fspath(config)
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise SpecError(f"{what}: {path}: {e}", field=what, value=path, allowed="a readable YAML or JSON file") from None
        try:
            import yaml

            return yaml.safe_load(text) or {}
        except ImportError:
            return json.loads(text)
    if isinstance(config, Mapping):
        return config
    return {k: v for k, v in vars(config).items() if not k.startswith("_")}


def _deepspeed_part(ds: Mapping) -> dict:
    zero = ds.get("zero_optimization") or {}
    stage = int(zero.get("stage", 0) or 0)
    if stage == 0:
        return {}
    parallel: dict = {"strategy": f"zero{stage}"}
    offload = zero.get("offload_optimizer") or {}
    if offload.get("device") in ("cpu", "nvme"):
        parallel["offload_optimizer"] = True
    if stage == 3 and (zero.get("offload_param") or {}).get("device") in ("cpu", "nvme"):
        parallel["offload_params"] = True
    return parallel


def _accelerate_part(acc: Mapping) -> dict:
    kind = str(_value(acc.get("distributed_type", "NO"))).upper().replace("DISTRIBUTEDTYPE.", "")
    procs = int(acc.get("num_processes", 1) or 1) * int(acc.get("num_machines", 1) or 1)
    parallel: dict = {}
    if kind == "MULTI_GPU" and procs > 1:
        parallel["strategy"] = "ddp"
    elif kind == "FSDP":
        fsdp = acc.get("fsdp_config") or {}
        parallel["strategy"] = "fsdp" if str(fsdp.get("fsdp_version", 1)) == "2" else "fsdp1"
        if fsdp.get("fsdp_offload_params"):
            parallel["offload_params"] = True
    elif kind == "DEEPSPEED":
        ds = acc.get("deepspeed_config") or {}
        stage = ds.get("zero_stage")
        if stage:
            parallel["strategy"] = f"zero{int(stage)}"
            if ds.get("offload_optimizer_device") in ("cpu", "nvme"):
                parallel["offload_optimizer"] = True
            if int(stage) == 3 and ds.get("offload_param_device") in ("cpu", "nvme"):
                parallel["offload_params"] = True
    if procs > 1:
        parallel["world_size"] = procs
    return parallel


def spec_from(
    model: Any = None,
    args: Any = None,
    *,
    peft_config: Any = None,
    accelerate_config: Any = None,
    deepspeed_config: Any = None,
    **overrides: Any,
) -> dict:
    """A run spec (a dict, as `headroom.estimate` takes) from what the script already has.

    - `model`: a transformers model (a peft model too: its LoRA config is read), its config,
      a config dict, or a model name (a catalog name, hub id or config path).
    - `args`: `TrainingArguments` (trainer `hf`) or a TRL config (`SFTConfig`, `DPOConfig`,
      `GRPOConfig`, `RewardConfig`): micro-batch, checkpointing, precision (`bf16`/`fp16` with
      the model's dtype), optimizer (`optim`), accumulation, clipping, TRL's lengths.
    - `peft_config`: a peft `LoraConfig` (or its attributes as a dict).
    - `accelerate_config`, `deepspeed_config`: a dict, an object, or a YAML/JSON file path;
      DDP, FSDP, DeepSpeed ZeRO stages and their offload become `parallel`.
    - `overrides`: spec keys set last (`seq_len=2048`, `batch_size=...`, `versions=...`).

    A plain `TrainingArguments` does not say the sequence length: pass `seq_len=`.
    """
    spec: dict = {}
    dtype = None
    found_peft = None
    if model is not None:
        part, dtype, found_peft = _model_part(model)
        spec.update(part)
    if args is not None:
        spec.update(_args_part(args))
        spec["precision"] = _precision(args, dtype)
    elif dtype is not None:
        spec["precision"] = "bf16" if dtype == "bfloat16" else "fp32"
    peft = peft_config if peft_config is not None else found_peft
    if peft is not None:
        spec["lora"] = _lora_part(peft)
    parallel: dict = {}
    if accelerate_config is not None:
        parallel.update(_accelerate_part(_read_config(accelerate_config, "accelerate_config")))
    if deepspeed_config is not None:
        # The DeepSpeed JSON says the stage and offload; the accelerate config, the ranks.
        parallel.update(_deepspeed_part(_read_config(deepspeed_config, "deepspeed_config")))
    if "strategy" in parallel:
        spec["parallel"] = parallel
    spec.update(overrides)
    return spec
