"""Run real training (or forward) steps of a run spec on a GPU and record their peak memory.

The protocol is the one of the calibration rows (bench/shared/calibration/README.md): a fresh process,
the model built from its config with random weights directly on the GPU, three steps, and the
peak of each phase read from the caching allocator's counters.
"""

from __future__ import annotations

import gc
import os
import platform
import shutil
import tempfile
import time

from .spec import Spec

STEPS = 3
_KEPT: list = []  # HEADROOM_KEEP_OUTPUT=1: the model output lives until after backward


def _versions() -> dict:
    import torch
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__}
    for name in ("peft", "bitsandbytes"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - a missing optional library is reported as absent
            out[name] = None
    out["python"] = platform.python_version()
    return out


def config_fields(fields: dict) -> tuple[str, dict]:
    """The model type and the fields of a saved `config.json` that `AutoConfig.for_model`
    takes: the metadata transformers writes beside them is dropped."""
    fields = dict(fields)
    model_type = fields.pop("model_type")
    for key in ("architectures", "torch_dtype", "dtype", "transformers_version", "_name_or_path"):
        fields.pop(key, None)
    return model_type, fields


def _hf_config(spec: Spec, fields: dict):
    from transformers import AutoConfig

    model_type, fields = config_fields(fields)
    fields["use_cache"] = False
    if spec.task == "seq-cls":
        fields["num_labels"] = 1
        fields["pad_token_id"] = 0
    cfg = AutoConfig.for_model(model_type, **fields)
    if spec.experts_implementation is not None:
        # The property setter (configuration_utils.py) sets it on every sub-config too; the model's
        # __init__ checks it, and each `@use_experts_implementation` forward reads it at every call.
        # Set on the config (not passed to from_config) so that dist.py and pipeline.py, which
        # build from this config, get it too.
        cfg._experts_implementation = spec.experts_implementation
    return cfg


def _experts_kwargs(spec: Spec) -> dict:
    """`from_pretrained` reads the saved config.json, which does not keep `_experts_implementation`."""
    if spec.experts_implementation is None:
        return {}
    return {"experts_implementation": spec.experts_implementation}


def experts_implementation_in_use(model) -> str | None:
    """The experts path transformers resolved (None for a model without `@use_experts_implementation`)."""
    core = getattr(model, "get_base_model", lambda: model)()
    can_set = getattr(core, "_can_set_experts_implementation", None)
    if can_set is None or not can_set():
        return None
    return core.config._experts_implementation


def lora_targets_in_use(model) -> dict | None:
    """What peft made of the LoRA config: on transformers 5, peft 0.21 rewrites the targets of the
    MoE families whose experts were fused (`convert_peft_config_for_transformers`): `all-linear`
    and the names gate_proj / up_proj / down_proj / gate become `target_parameters` on the expert
    stacks and the router, with rank and alpha doubled on gate_up_proj."""
    cfg = getattr(model, "peft_config", {}).get("default")
    if cfg is None:
        return None

    def names(value):
        return sorted(value) if isinstance(value, (set, list, tuple)) else value

    return {
        "target_modules": names(cfg.target_modules),
        "target_parameters": names(cfg.target_parameters),
        "rank_pattern": dict(cfg.rank_pattern or {}),
        "alpha_pattern": dict(cfg.alpha_pattern or {}),
    }


def dtype_kwarg(dtype) -> dict:
    """The keyword that sets the dtype of `from_config` / `from_pretrained`: `dtype` from
    transformers 4.56 on, `torch_dtype` before (older releases pass an unknown `dtype` on to the
    model's `__init__`, which refuses it)."""
    import transformers

    major, minor = (int(x) for x in transformers.__version__.split(".")[:2])
    return {"dtype": dtype} if (major, minor) >= (4, 56) else {"torch_dtype": dtype}


def _auto_class(spec: Spec):
    import transformers

    if spec.task == "seq-cls":
        return transformers.AutoModelForSequenceClassification
    return transformers.AutoModelForCausalLM


def _build(spec: Spec, cfg, device: str = "cuda"):
    """The model as the spec builds it, on `device` (the tracer builds on its fake device)."""
    import torch

    cls = _auto_class(spec)
    if spec.quantization == "nf4":
        from transformers import BitsAndBytesConfig

        with torch.device("cuda"):
            model = cls.from_config(cfg, **dtype_kwarg(torch.bfloat16), attn_implementation=spec.attention)
        tmp = tempfile.mkdtemp(prefix="headroom-ckpt-")
        model.save_pretrained(tmp)
        del model
        gc.collect()
        torch.cuda.empty_cache()
        bnb = BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        )
        model = cls.from_pretrained(
            tmp,
            quantization_config=bnb,
            **dtype_kwarg(torch.bfloat16),
            device_map={"": 0},
            attn_implementation=spec.attention,
            **_experts_kwargs(spec),
        )
        shutil.rmtree(tmp, ignore_errors=True)
        return model
    dtype = torch.bfloat16 if spec.precision == "bf16" else torch.float32
    with torch.device(device):
        return cls.from_config(cfg, **dtype_kwarg(dtype), attn_implementation=spec.attention)


def _prepare(spec: Spec, model):
    """What follows the build in the single-run harness, in its order: peft's
    `prepare_model_for_kbit_training` (kbit_prepare), `get_peft_model` (lora), then gradient
    checkpointing (`gradient_checkpointing_enable(use_reentrant=False)`,
    `enable_input_require_grads()`). Returns the model (peft wraps it)."""
    if spec.quantization and spec.kbit_prepare:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=spec.gradient_checkpointing
        )
    if spec.lora is not None:
        from peft import LoraConfig, get_peft_model

        extra = {}
        if spec.lora.target_parameters is not None:
            # nn.Parameters, such as the fused 3-D expert stacks, that target_modules cannot reach
            # (peft's lora.ParamWrapper); `targets` may then be [] (no module at all)
            extra["target_parameters"] = list(spec.lora.target_parameters)
        lcfg = LoraConfig(
            r=spec.lora.r,
            lora_alpha=spec.lora.alpha,
            target_modules=spec.lora.targets,
            lora_dropout=spec.lora.dropout,
            task_type="SEQ_CLS" if spec.task == "seq-cls" else "CAUSAL_LM",
            **extra,
        )
        model = get_peft_model(model, lcfg)
    if spec.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    return model


def _optimizer(spec: Spec, params):
    import torch

    lr = 1e-5
    name = spec.optimizer
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr)
    if name == "adamw-fused":
        return torch.optim.AdamW(params, lr=lr, fused=True)
    if name == "adamw-forloop":
        return torch.optim.AdamW(params, lr=lr, foreach=False)
    if name == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    if name == "adafactor":
        return torch.optim.Adafactor(params, lr=lr)
    if name == "adamw-8bit":
        import bitsandbytes

        return bitsandbytes.optim.AdamW8bit(params, lr=lr)
    return None


def _process_gpu_bytes() -> int | None:
    """GPU memory NVML attributes to this process, or None where NVML cannot tell."""
    try:
        import pynvml

        pynvml.nvmlInit()
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid():
                return int(proc.usedGpuMemory)
    except Exception:  # noqa: BLE001 - NVML is optional; the caller falls back
        return None
    return None


def _stats():
    import torch

    s = torch.cuda.memory_stats()
    return s.get("allocated_bytes.all.peak", 0), s.get("reserved_bytes.all.peak", 0)


def measure(
    spec: Spec, fields: dict, snapshot: str | None = None, row_id: str | None = None, stacks: str = "python"
) -> dict:
    """Measure the spec's peak memory; returns one calibration-format record."""
    if spec.expandable_segments:
        # Must be set before CUDA initialises; the CLI sets it, this guards direct callers.
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        if "expandable_segments:True" not in conf:
            raise RuntimeError("set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True before starting Python")
    import torch

    t0 = time.time()
    torch.zeros(1, device="cuda")
    free, total = torch.cuda.mem_get_info()
    context_nvml = _process_gpu_bytes()
    # Alone on the GPU, total - free is this process's context; beside other measuring
    # processes (batch --jobs > 1) it is not, so it is left out (NVML's per-process figure is
    # kept for reference).
    context = None if os.environ.get("HEADROOM_SHARED_GPU") == "1" else total - free
    if snapshot:
        torch.cuda.memory._record_memory_history(max_entries=10_000_000, stacks=stacks)

    cfg = _hf_config(spec, fields)
    model = _build(spec, cfg)
    weights_loaded = torch.cuda.memory_allocated()
    params = sum(p.numel() for p in model.parameters())
    experts_impl = experts_implementation_in_use(model)

    model = _prepare(spec, model)
    lora_resolved = lora_targets_in_use(model) if spec.lora is not None else None

    # `params` counts the base model as transformers built it (before adapters); LoRA and
    # modules_to_save copies show only in `trainable_params`.
    trainable = [p for p in model.parameters() if p.requires_grad]
    trainable_params = sum(p.numel() for p in trainable)
    train = spec.mode == "train"
    optimizer = _optimizer(spec, trainable) if train else None
    scaler = torch.amp.GradScaler("cuda") if train and spec.precision == "amp-fp16" else None
    autocast_dtype = {"amp-bf16": torch.bfloat16, "bf16": torch.bfloat16, "amp-fp16": torch.float16}.get(
        spec.precision
    )
    if train:
        model.train()
    else:
        model.eval()

    vocab = fields.get("vocab_size")
    ids = torch.randint(0, vocab, (spec.batch_size, spec.seq_len), device="cuda")
    steps = []
    peak_reserved = 0

    def autocast():
        if autocast_dtype is None:
            return torch.autocast("cuda", enabled=False)
        return torch.autocast("cuda", dtype=autocast_dtype)

    def phase_end(rec: dict, key: str):
        nonlocal peak_reserved
        allocated_peak, reserved_peak = _stats()
        rec[key] = allocated_peak
        rec["peak_reserved"] = max(rec.get("peak_reserved", 0), reserved_peak)
        peak_reserved = max(peak_reserved, reserved_peak)

    for _ in range(STEPS):
        rec = {}
        rec["start_allocated"] = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        if train:
            loss = _train_forward(spec, model, ids, autocast)
            phase_end(rec, "fwd_peak")
            torch.cuda.reset_peak_memory_stats()
            (scaler.scale(loss) if scaler else loss).backward()
            del loss
            phase_end(rec, "bwd_peak")
            _KEPT.clear()
            if optimizer is not None:
                torch.cuda.reset_peak_memory_stats()
                if scaler:
                    scaler.step(optimizer)
                    scaler.update()
                else:
                    optimizer.step()
                phase_end(rec, "opt_peak")
                optimizer.zero_grad(set_to_none=True)
            else:
                model.zero_grad(set_to_none=True)
        else:
            with torch.no_grad():
                _logprob_forward(model, ids, autocast)
            phase_end(rec, "fwd_peak")
        torch.cuda.synchronize()
        rec["end_allocated"] = torch.cuda.memory_allocated()
        steps.append(rec)

    if snapshot:
        torch.cuda.memory._dump_snapshot(snapshot)
        torch.cuda.memory._record_memory_history(enabled=None)

    props = torch.cuda.get_device_properties(0)
    return make_record(
        row_id or default_id(spec),
        spec,
        steps,
        peak_reserved=peak_reserved,
        context=context,
        context_nvml=context_nvml,
        params=params,
        trainable_params=trainable_params,
        weights_loaded=weights_loaded,
        env={
            "gpu": props.name,
            "gpu_total_bytes": total,
            **_versions(),
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
            "wall_s": round(time.time() - t0, 2),
            # MoE models only: the path transformers resolved (grouped_mm when the spec gave none)
            **({"experts_implementation": experts_impl} if experts_impl is not None else {}),
            **({"lora_resolved": lora_resolved} if lora_resolved is not None else {}),
        },
    )


def make_record(
    row_id: str,
    spec: Spec,
    steps: list[dict],
    *,
    peak_reserved: int,
    context: int | None,
    context_nvml: int | None,
    params: int,
    trainable_params: int,
    weights_loaded: int,
    env: dict,
) -> dict:
    """One calibration-format record (the format `headroom validate` reads): the largest phase
    peak over the steps is `peak_allocated_bytes`."""
    phase_peaks = [v for rec in steps for k, v in rec.items() if k.endswith("_peak")]
    if not phase_peaks:
        raise ValueError("no phase was measured")
    spec_json = spec.to_json()
    if spec.model_config is not None:
        # An inline config is the model: the row must carry it (as dist.py's records do).
        spec_json["model_config"] = dict(spec.model_config)
    return {
        "id": row_id,
        "spec": spec_json,
        "measured": {
            "peak_allocated_bytes": max(phase_peaks),
            "peak_reserved_bytes": peak_reserved,
            "cuda_context_bytes": context,
            "cuda_context_nvml_bytes": context_nvml,
            "params": params,
            "trainable_params": trainable_params,
            "weights_loaded_bytes": weights_loaded,
            "steps": steps,
        },
        "env": env,
    }


def _train_forward(spec: Spec, model, ids, autocast):
    """Forward under autocast; returns the loss. The output object is dropped here, as a
    training loop that keeps only the loss does, so the logits live only as autograd keeps them."""
    with autocast():
        if spec.task == "seq-cls":
            out = model(input_ids=ids)
            loss = out.logits.float().pow(2).mean()
        else:
            out = model(input_ids=ids, labels=ids)
            loss = out.loss
    if os.environ.get("HEADROOM_KEEP_OUTPUT") == "1":
        _KEPT.append(out)
    return loss


def _logprob_forward(model, ids, autocast):
    """The no-grad reference log-prob pass of RL frameworks."""
    import torch

    with autocast():
        logits = model(input_ids=ids).logits
    lp = torch.log_softmax(logits.float(), -1)
    return torch.gather(lp[:, :-1], 2, ids[:, 1:, None])


def default_id(spec: Spec) -> str:
    parts = [spec.model.replace("/", "_")]
    if spec.quantization:
        parts.append(spec.quantization)
    else:
        parts.append(spec.precision.replace("-", "_"))
    parts.append("forward_nograd" if spec.mode == "forward" else spec.optimizer.replace("-", ""))
    parts += [f"bs{spec.batch_size}", f"s{spec.seq_len}", spec.attention]
    if spec.task == "seq-cls":
        parts.append("seqcls")
    if spec.gradient_checkpointing:
        parts.append("gc")
    if spec.lora is not None:
        parts.append(f"lora{spec.lora.r}")
        if spec.lora.target_parameters:
            parts.append("loraparams")
    if spec.experts_implementation is not None:
        parts.append(f"experts_{spec.experts_implementation}")
    if spec.kbit_prepare:
        parts.append("kbitprep")
    if spec.expandable_segments:
        parts.append("expandable")
    return "/".join(parts)
