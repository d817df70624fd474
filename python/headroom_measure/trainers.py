"""Measure what real trainers allocate: transformers.Trainer and TRL's SFT, DPO, GRPO and reward trainers.

    python -m headroom_measure.trainers run --spec-json '{"trainer": "trl-dpo", "model": "qwen2.5-0.5b", ...}'
        [--id ID] [--catalog FILE] [--snapshot FILE.pickle] [--out ROWS.jsonl]
    python -m headroom_measure.trainers batch SPECS.jsonl --out ROWS.jsonl [--catalog FILE] [--snapshot-dir DIR]
    python -m headroom_measure.trainers check SPECS.jsonl     (parse and validate every line; no torch needed)

A trainer spec is a run spec (spec.py: model, precision, optimizer, batch_size, seq_len, attention, lora,
gradient_checkpointing, allocator) plus a `trainer:` key and that trainer's own keys:

    trainer: hf | trl-sft | trl-dpo | trl-grpo | trl-reward
    max_steps: 3                     (every trainer; optimizer steps measured)
    gradient_accumulation_steps: 1   (every trainer)
    trl-dpo:    seq_len = prompt + completion tokens (chosen and rejected the same length, eos included);
                prompt_len (default seq_len // 4); beta; reference: {precision} loads a separate reference model
                and passes it as `ref_model`; without it full fine-tuning makes TRL load one from the policy's path
                and LoRA disables the adapter for the reference pass; precompute_ref_log_probs: true|false
    trl-grpo:   prompt_len, completion_len (max_completion_length), num_generations, beta (> 0: TRL loads a
                reference from the policy's path, or disables the adapter under LoRA); batch_size is
                per_device_train_batch_size, in completions; seq_len is not used
    trl-reward: seq_len = chosen (and rejected) length, eos included

Protocol (as close to the single-run harness of measure.py as a trainer allows): a fresh process; the model
built from the catalog config with random weights on the GPU, saved with `save_pretrained` together with a
word-level tokenizer (`<pad>` 0, `<eos>` 1, `<unk>` 2, words `w3 ... w{vocab-1}`), then freed and the cache emptied.
`hf` rebuilds the model from config on the GPU (as the harness does) and passes the instance; the TRL trainers
get the path and `model_init_kwargs={"dtype": ...}`, so they load it as they load a hub model. The saved config
has `use_cache=True`, as real checkpoints do. A synthetic dataset of random words gives sequences of the spec's
lengths. `max_steps` optimizer steps, no saving, no logging, `report_to=[]`, dropout as the trainer leaves it.

What is recorded: the allocator's peaks in contiguous segments, each closed by `reset_peak_memory_stats()`:
trainer construction, train start (optimizer creation, DPO's reference precompute), then within each step every
forward of a policy or reference model outside generation (a forward pre-hook and hook; the shapes of its tensor
inputs), generation (HF generate, with the count and shapes of its forwards), the loss and its backward
(`accelerator.backward`), gradient clipping, the optimizer step and the zero_grad. `peak_allocated_bytes` is the
largest peak over the whole run (construction included), `steps_peak_allocated_bytes` over the steps alone.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import spec as specmod
from .measure import config_fields

TRAINERS = ("hf", "trl-sft", "trl-dpo", "trl-grpo", "trl-reward")
TRAINER_PRECISIONS = ("bf16", "amp-bf16", "fp32")
# spec optimizer -> TrainingArguments.optim
OPTIM_NAMES = {
    "adamw": "adamw_torch",
    "adamw-fused": "adamw_torch_fused",
    "adamw-forloop": "adamw_torch",  # foreach is chosen by torch; recorded as given
    "sgd": "sgd",
    "adafactor": "adafactor",
    "adamw-8bit": "adamw_bnb_8bit",
}
COMMON_KEYS = {"trainer", "max_steps", "gradient_accumulation_steps", "max_grad_norm", "use_liger_kernel"}
TRAINER_KEYS = {
    "hf": set(),
    "trl-sft": set(),
    "trl-dpo": {"prompt_len", "beta", "reference", "precompute_ref_log_probs"},
    "trl-grpo": {"prompt_len", "completion_len", "num_generations", "beta"},
    "trl-reward": set(),
}
ALL_TRAINER_KEYS = COMMON_KEYS.union(*TRAINER_KEYS.values())
DEFAULT_GC = {"hf": False, "trl-sft": True, "trl-dpo": True, "trl-grpo": True, "trl-reward": True}
DEFAULT_OPTIMIZER = "adamw-fused"  # TrainingArguments' default (adamw_torch_fused on torch >= 2.8)


@dataclass
class TrainerSpec:
    trainer: str
    base: specmod.Spec
    max_steps: int = 3
    gradient_accumulation_steps: int = 1
    max_grad_norm: float = 1.0
    use_liger_kernel: bool = False
    prompt_len: int | None = None
    completion_len: int | None = None
    num_generations: int | None = None
    beta: float | None = None
    reference_precision: str | None = None
    precompute_ref_log_probs: bool = False
    raw: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        out: dict[str, Any] = {"trainer": self.trainer}
        base = self.base.to_json()
        base.pop("task", None)
        base.pop("mode", None)
        if self.trainer == "trl-grpo":
            base.pop("seq_len", None)
        out.update(base)
        if self.base.model_config is not None:
            out["model_config"] = dict(self.base.model_config)
        out["max_steps"] = self.max_steps
        out["gradient_accumulation_steps"] = self.gradient_accumulation_steps
        if self.max_grad_norm != 1.0:
            out["max_grad_norm"] = self.max_grad_norm
        if self.use_liger_kernel:
            out["use_liger_kernel"] = True
        for key in ("prompt_len", "completion_len", "num_generations", "beta"):
            value = getattr(self, key)
            if value is not None:
                out[key] = value
        if self.trainer == "trl-dpo":
            if self.reference_precision is not None:
                out["reference"] = {"precision": self.reference_precision}
            out["precompute_ref_log_probs"] = self.precompute_ref_log_probs
        return out


def _int(raw: dict, key: str, default: int | None, minimum: int = 1) -> int | None:
    value = raw.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise specmod.SpecError(f"`{key}`: {value!r} is not allowed; use an integer >= {minimum}")
    return value


def parse(raw: dict) -> TrainerSpec:
    """A trainer spec from its mapping; raises SpecError naming the field. Needs no torch."""
    if not isinstance(raw, dict):
        raise specmod.SpecError("a trainer spec is a mapping of keys (trainer, model, precision, ...)")
    trainer = raw.get("trainer")
    if trainer not in TRAINERS:
        raise specmod.SpecError(f"`trainer`: {trainer!r} is not allowed; use one of {', '.join(TRAINERS)}")
    allowed = COMMON_KEYS | TRAINER_KEYS[trainer]
    for key in sorted(set(raw) & ALL_TRAINER_KEYS):
        if key not in allowed:
            raise specmod.SpecError(
                f"`{key}` is not a key of trainer {trainer}; its keys: {', '.join(sorted(allowed - {'trainer'}))}"
            )
    base_raw = {k: v for k, v in raw.items() if k not in ALL_TRAINER_KEYS}
    for key in ("task", "mode", "quantization", "kbit_prepare", "parallel"):
        if key in base_raw:
            raise specmod.SpecError(f"`{key}` is not measured with a trainer spec; leave it out")
    base_raw.setdefault("gradient_checkpointing", DEFAULT_GC[trainer])
    base_raw.setdefault("optimizer", DEFAULT_OPTIMIZER)
    if trainer == "trl-reward":
        base_raw["task"] = "seq-cls"
    base = specmod.parse(base_raw)
    if base.precision not in TRAINER_PRECISIONS:
        raise specmod.SpecError(
            f"`precision`: {base.precision!r} is not measured with trainers; use one of {', '.join(TRAINER_PRECISIONS)}"
        )
    if base.optimizer == "none":
        raise specmod.SpecError("`optimizer`: none is not allowed with a trainer; trainers always step")
    ts = TrainerSpec(
        trainer=trainer,
        base=base,
        max_steps=_int(raw, "max_steps", 3),
        gradient_accumulation_steps=_int(raw, "gradient_accumulation_steps", 1),
        raw=raw,
    )
    norm = raw.get("max_grad_norm", 1.0)
    if isinstance(norm, bool) or not isinstance(norm, (int, float)) or norm < 0:
        raise specmod.SpecError(f"`max_grad_norm`: {norm!r} is not allowed; use a number >= 0 (0: no clipping)")
    ts.max_grad_norm = float(norm)
    liger = raw.get("use_liger_kernel", False)
    if not isinstance(liger, bool):
        raise specmod.SpecError(f"`use_liger_kernel`: {liger!r} is not allowed; use true or false")
    if liger and trainer == "trl-reward":
        raise specmod.SpecError("`use_liger_kernel` is not measured with trl-reward (a reward model has no LM head)")
    ts.use_liger_kernel = liger
    if trainer == "trl-dpo":
        ts.prompt_len = _int(raw, "prompt_len", max(1, base.seq_len // 4))
        if ts.prompt_len >= base.seq_len - 1:
            raise specmod.SpecError(
                f"`prompt_len`: {ts.prompt_len} leaves no completion in seq_len {base.seq_len}; use < seq_len - 1"
            )
        ts.beta = float(raw.get("beta", 0.1))
        ref = raw.get("reference")
        if ref is not None:
            if not isinstance(ref, dict) or set(ref) - {"precision"}:
                raise specmod.SpecError(f"`reference`: {ref!r} is not allowed; use {{precision: bf16|fp32}}")
            prec = ref.get("precision", "bf16" if base.precision == "bf16" else "fp32")
            if prec not in ("bf16", "fp32"):
                raise specmod.SpecError(f"`reference.precision`: {prec!r} is not allowed; use bf16 or fp32")
            ts.reference_precision = prec
        pre = raw.get("precompute_ref_log_probs", False)
        if not isinstance(pre, bool):
            raise specmod.SpecError(f"`precompute_ref_log_probs`: {pre!r} is not allowed; use true or false")
        ts.precompute_ref_log_probs = pre
        if pre and ref is not None:
            raise specmod.SpecError("`precompute_ref_log_probs` with `reference`: choose one")
    if trainer == "trl-grpo":
        for key in ("prompt_len", "completion_len", "num_generations"):
            if key not in raw:
                raise specmod.SpecError(f"`{key}` is required for trainer trl-grpo")
        if "seq_len" in raw:
            raise specmod.SpecError("`seq_len` is not a trl-grpo key; use prompt_len and completion_len")
        ts.prompt_len = _int(raw, "prompt_len", None)
        ts.completion_len = _int(raw, "completion_len", None)
        ts.num_generations = _int(raw, "num_generations", None, minimum=2)
        ts.beta = float(raw.get("beta", 0.0))
        if ts.beta < 0:
            raise specmod.SpecError(f"`beta`: {ts.beta} is not allowed; use a number >= 0")
        gen_batch = base.batch_size * ts.gradient_accumulation_steps
        if gen_batch % ts.num_generations:
            raise specmod.SpecError(
                f"`batch_size`: {base.batch_size} x gradient_accumulation_steps {ts.gradient_accumulation_steps} "
                f"= {gen_batch} completions is not divisible by num_generations {ts.num_generations} (TRL refuses it)"
            )
    return ts


def default_id(ts: TrainerSpec) -> str:
    b = ts.base
    parts = [ts.trainer, b.model, b.precision.replace("-", "_"), f"bs{b.batch_size}"]
    if ts.trainer == "trl-grpo":
        parts.append(f"g{ts.num_generations}-p{ts.prompt_len}-c{ts.completion_len}")
        parts.append(f"beta{ts.beta:g}")
    else:
        parts.append(f"s{b.seq_len}")
    if b.gradient_checkpointing:
        parts.append("gc")
    if b.lora is not None:
        parts.append(f"lora{b.lora.r}")
    if ts.trainer == "trl-dpo":
        if ts.reference_precision:
            parts.append(f"ref-{ts.reference_precision}")
        elif ts.precompute_ref_log_probs:
            parts.append("precompute")
        else:
            parts.append("noref" if b.lora is not None else "autoref")
    if b.optimizer != DEFAULT_OPTIMIZER:
        parts.append(b.optimizer.replace("-", ""))
    if ts.gradient_accumulation_steps != 1:
        parts.append(f"ga{ts.gradient_accumulation_steps}")
    if b.expandable_segments:
        parts.append("expandable")
    return "/".join(parts)


# ----------------------------------------------------------------------------------------------- measuring


class Tracker:
    """Contiguous segments of the run, each with its own allocator peaks."""

    def __init__(self, torch):
        self.torch = torch
        self.step: int | None = None
        self.segments: list[dict] = []
        self.gen_depth = 0
        self.fwd_depth = 0

    def mark(self, name: str, **extra) -> dict:
        s = self.torch.cuda.memory_stats()
        seg = {
            "step": self.step,
            "name": name,
            "peak_allocated": s.get("allocated_bytes.all.peak", 0),
            "peak_reserved": s.get("reserved_bytes.all.peak", 0),
            "allocated": s.get("allocated_bytes.all.current", 0),
            "reserved": s.get("reserved_bytes.all.current", 0),
        }
        seg.update(extra)
        self.segments.append(seg)
        self.torch.cuda.reset_peak_memory_stats()
        return seg


def _shapes(args, kwargs) -> dict:
    out = {}
    for i, a in enumerate(args):
        if hasattr(a, "shape") and hasattr(a, "dtype"):
            out[f"arg{i}"] = [list(a.shape), str(a.dtype).replace("torch.", "")]
    for k, v in kwargs.items():
        if hasattr(v, "shape") and hasattr(v, "dtype"):
            out[k] = [list(v.shape), str(v.dtype).replace("torch.", "")]
        elif isinstance(v, bool) or (k in ("use_cache", "fused_lm_head") and v is not None):
            out[k] = v
    return out


def core_model(model):
    """The transformers model inside peft / accelerate wrappers."""
    m = model
    for _ in range(4):
        if hasattr(m, "get_base_model"):
            m = m.get_base_model()
        elif hasattr(m, "module"):
            m = m.module
        else:
            break
    return m


def _instrument(tracker: Tracker, trainer, torch) -> None:
    models = [("policy", trainer.model)]
    ref = getattr(trainer, "ref_model", None)
    if ref is not None:
        models.append(("reference", ref))
    seen = set()
    gen_info: dict = {}
    for label, m in models:
        core = core_model(m)
        if id(core) in seen:
            continue
        seen.add(id(core))

        def pre(module, args, kwargs, label=label):
            if tracker.gen_depth:
                gen_info["calls"] = gen_info.get("calls", 0) + 1
                sh = _shapes(args, kwargs)
                if gen_info["calls"] == 1:
                    gen_info["first"] = sh
                elif gen_info["calls"] == 2:
                    gen_info["second"] = sh
                gen_info["last"] = sh
                return None
            tracker.fwd_depth += 1
            if tracker.fwd_depth == 1:
                tracker.mark(f"before:{label}")
                tracker._fwd = {
                    "model": label,
                    "grad": torch.is_grad_enabled(),
                    "training": module.training,
                    "inputs": _shapes(args, kwargs),
                }
            return None

        def post(module, args, kwargs, output, label=label):
            if tracker.gen_depth:
                return None
            tracker.fwd_depth -= 1
            if tracker.fwd_depth == 0:
                info = getattr(tracker, "_fwd", {})
                outs = {}
                for k in ("logits", "log_probs", "loss", "entropy"):
                    v = getattr(output, k, None) if not isinstance(output, dict) else output.get(k)
                    if hasattr(v, "shape"):
                        outs[k] = [list(v.shape), str(v.dtype).replace("torch.", "")]
                tracker.mark(f"forward:{label}", forward={**info, "outputs": outs})
            return None

        core.register_forward_pre_hook(pre, with_kwargs=True)
        core.register_forward_hook(post, with_kwargs=True)

        # Generation: wrap `generate` of the core model and of its peft wrapper (whichever TRL calls).
        for obj in {id(core): core, id(m): m}.values():
            if not hasattr(obj, "generate"):
                continue
            orig = obj.generate

            def generate(*args, _orig=orig, **kwargs):
                outer = tracker.gen_depth == 0
                if outer:
                    tracker.mark("before:generate")
                    gen_info.clear()
                tracker.gen_depth += 1
                try:
                    result = _orig(*args, **kwargs)
                finally:
                    tracker.gen_depth -= 1
                if outer:
                    seqs = result if hasattr(result, "shape") else getattr(result, "sequences", None)
                    tracker.mark(
                        "generate",
                        generate={
                            "inputs": _shapes(args, kwargs),
                            "output": list(seqs.shape) if seqs is not None else None,
                            "forward_calls": gen_info.get("calls", 0),
                            "first_forward": gen_info.get("first"),
                            "second_forward": gen_info.get("second"),
                            "last_forward": gen_info.get("last"),
                        },
                    )
                return result

            obj.generate = generate

    acc = trainer.accelerator
    orig_backward = acc.backward

    def backward(loss, **kwargs):
        tracker.mark("loss")
        out = orig_backward(loss, **kwargs)
        tracker.mark("backward")
        return out

    acc.backward = backward


def _callback(tracker: Tracker):
    from transformers import TrainerCallback

    class PeakCallback(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            tracker.mark("train_begin")

        def on_step_begin(self, args, state, control, **kwargs):
            tracker.mark("between_steps")
            tracker.step = state.global_step + 1
            tracker.mark_step_start = len(tracker.segments)

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            tracker.mark("clip_grad")

        def on_optimizer_step(self, args, state, control, **kwargs):
            tracker.mark("optimizer")

        def on_step_end(self, args, state, control, **kwargs):
            tracker.mark("zero_grad")
            tracker.step = None

    return PeakCallback()


def _tokenizer(vocab_size: int, path: str):
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    for i in range(3, vocab_size):
        vocab[f"w{i}"] = i
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    fast.model_max_length = 1 << 20
    fast.save_pretrained(path)
    return fast


def _words(rng: random.Random, n: int, vocab: int) -> str:
    return " ".join(f"w{rng.randrange(3, vocab)}" for _ in range(n))


def _dataset(ts: TrainerSpec, vocab: int, rows: int):
    from datasets import Dataset

    rng = random.Random(0)
    b = ts.base
    if ts.trainer == "hf":
        ids = [[rng.randrange(3, vocab) for _ in range(b.seq_len)] for _ in range(rows)]
        return Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * b.seq_len] * rows, "labels": ids})
    if ts.trainer == "trl-sft":  # eos is appended by the trainer
        return Dataset.from_dict({"text": [_words(rng, b.seq_len - 1, vocab) for _ in range(rows)]})
    if ts.trainer == "trl-reward":  # implicit prompt; eos appended by the trainer
        return Dataset.from_dict(
            {
                "chosen": [_words(rng, b.seq_len - 1, vocab) for _ in range(rows)],
                "rejected": [_words(rng, b.seq_len - 1, vocab) for _ in range(rows)],
            }
        )
    if ts.trainer == "trl-dpo":  # eos is appended to chosen and rejected by the trainer
        comp = b.seq_len - ts.prompt_len - 1
        return Dataset.from_dict(
            {
                "prompt": [_words(rng, ts.prompt_len, vocab) for _ in range(rows)],
                "chosen": [" " + _words(rng, comp, vocab) for _ in range(rows)],
                "rejected": [" " + _words(rng, comp, vocab) for _ in range(rows)],
            }
        )
    if ts.trainer == "trl-grpo":
        return Dataset.from_dict({"prompt": [_words(rng, ts.prompt_len, vocab) for _ in range(rows)]})
    raise ValueError(ts.trainer)


def _random_reward(completions, **kwargs):
    return [random.random() for _ in completions]


def _versions() -> dict:
    out = {}
    for name in ("torch", "transformers", "trl", "peft", "accelerate", "datasets", "tokenizers"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - absent optional library
            out[name] = None
    out["python"] = platform.python_version()
    return out


def _hf_config(ts: TrainerSpec, fields: dict):
    from transformers import AutoConfig

    model_type, fields = config_fields(fields)
    fields["use_cache"] = True
    fields["pad_token_id"] = 0
    fields["eos_token_id"] = 1
    fields["bos_token_id"] = None
    return AutoConfig.for_model(model_type, **fields)


def _lora_config(ts: TrainerSpec):
    from peft import LoraConfig

    lo = ts.base.lora
    extra = {"target_parameters": list(lo.target_parameters)} if lo.target_parameters else {}
    return LoraConfig(
        r=lo.r,
        lora_alpha=lo.alpha,
        target_modules=lo.targets,
        lora_dropout=lo.dropout,
        task_type="SEQ_CLS" if ts.trainer == "trl-reward" else "CAUSAL_LM",
        **extra,
    )


def _common_args(ts: TrainerSpec, outdir: str) -> dict:
    b = ts.base
    return dict(
        output_dir=outdir,
        max_steps=ts.max_steps,
        per_device_train_batch_size=b.batch_size,
        gradient_accumulation_steps=ts.gradient_accumulation_steps,
        gradient_checkpointing=b.gradient_checkpointing,
        bf16=b.precision in ("bf16", "amp-bf16"),
        fp16=False,
        optim=OPTIM_NAMES[b.optimizer],
        max_grad_norm=ts.max_grad_norm,
        use_liger_kernel=ts.use_liger_kernel,
        learning_rate=1e-5,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        seed=0,
    )


def build_trainer(ts: TrainerSpec, fields: dict, ckpt: str, tokenizer, callbacks: list, device: str = "cuda"):
    """The trainer of `ts` over a synthetic dataset. `device`: where `hf` builds its model; "cpu"
    also makes the trainer run there (`use_cpu`), as the tracer needs."""
    import torch

    b = ts.base
    vocab = int(fields["vocab_size"])
    outdir = tempfile.mkdtemp(prefix="headroom-trainer-out-")
    dtype_name = "bfloat16" if b.precision == "bf16" else "float32"
    rows = max(64, 4 * ts.max_steps * b.batch_size * ts.gradient_accumulation_steps)
    data = _dataset(ts, vocab, rows)
    common = _common_args(ts, outdir)
    if device == "cpu":
        common["use_cpu"] = True
    init_kwargs = {"dtype": dtype_name, "attn_implementation": b.attention}
    if b.experts_implementation is not None:
        # `from_pretrained` takes it as a keyword; the config built here carries it too.
        init_kwargs["experts_implementation"] = b.experts_implementation
    peft_config = _lora_config(ts) if b.lora is not None else None
    if ts.trainer == "hf":
        from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

        cfg = _hf_config(ts, fields)
        if b.experts_implementation is not None:
            cfg._experts_implementation = b.experts_implementation
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(
                cfg, dtype=getattr(torch, dtype_name), attn_implementation=b.attention
            )
        if peft_config is not None:
            from peft import get_peft_model

            model = get_peft_model(model, peft_config)
        args = TrainingArguments(**common)
        return Trainer(model=model, args=args, train_dataset=data, processing_class=tokenizer, callbacks=callbacks)
    if ts.trainer == "trl-sft":
        from trl import SFTConfig, SFTTrainer

        args = SFTConfig(**common, max_length=b.seq_len, model_init_kwargs=init_kwargs)
        return SFTTrainer(
            model=ckpt, args=args, train_dataset=data, processing_class=tokenizer, peft_config=peft_config,
            callbacks=callbacks,
        )
    if ts.trainer == "trl-reward":
        from trl import RewardConfig, RewardTrainer

        args = RewardConfig(**common, max_length=b.seq_len, model_init_kwargs=init_kwargs)
        return RewardTrainer(
            model=ckpt, args=args, train_dataset=data, processing_class=tokenizer, peft_config=peft_config,
            callbacks=callbacks,
        )
    if ts.trainer == "trl-dpo":
        from trl import DPOConfig, DPOTrainer

        ref_model = None
        if ts.reference_precision is not None:
            from trl.trainer.utils import create_model_from_path

            ref_model = create_model_from_path(
                ckpt,
                dtype="bfloat16" if ts.reference_precision == "bf16" else "float32",
                attn_implementation=b.attention,
            )
        args = DPOConfig(
            **common,
            max_length=b.seq_len,
            beta=ts.beta,
            precompute_ref_log_probs=ts.precompute_ref_log_probs,
            model_init_kwargs=init_kwargs,
        )
        return DPOTrainer(
            model=ckpt, ref_model=ref_model, args=args, train_dataset=data, processing_class=tokenizer,
            peft_config=peft_config, callbacks=callbacks,
        )
    if ts.trainer == "trl-grpo":
        from trl import GRPOConfig, GRPOTrainer

        args = GRPOConfig(
            **common,
            num_generations=ts.num_generations,
            max_completion_length=ts.completion_len,
            beta=ts.beta,
            use_vllm=False,
            model_init_kwargs=init_kwargs,
        )
        return GRPOTrainer(
            model=ckpt, reward_funcs=_random_reward, args=args, train_dataset=data, processing_class=tokenizer,
            peft_config=peft_config, callbacks=callbacks,
        )
    raise ValueError(ts.trainer)


def measure(ts: TrainerSpec, fields: dict, row_id: str | None = None, snapshot: str | None = None) -> dict:
    import torch

    t0 = time.time()
    torch.zeros(1, device="cuda")
    free, total = torch.cuda.mem_get_info()
    b = ts.base
    vocab = int(fields["vocab_size"])

    # The checkpoint the TRL trainers load, with its tokenizer: random weights built on the GPU, then freed.
    ckpt = tempfile.mkdtemp(prefix="headroom-trainer-ckpt-")
    from transformers import AutoModelForCausalLM

    cfg = _hf_config(ts, fields)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    if ts.trainer != "hf":
        model.save_pretrained(ckpt)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    tokenizer = _tokenizer(vocab, ckpt)
    before = {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved()}

    tracker = Tracker(torch)
    if snapshot:
        torch.cuda.memory._record_memory_history(max_entries=int(os.environ.get("HEADROOM_SNAPSHOT_ENTRIES", 300000)))
    torch.cuda.reset_peak_memory_stats()
    trainer = build_trainer(ts, fields, ckpt, tokenizer, [_callback(tracker)])
    tracker.mark("trainer_init")
    weights_loaded = torch.cuda.memory_allocated()
    _instrument(tracker, trainer, torch)
    trainable = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    ref = getattr(trainer, "ref_model", None)
    trainer.train()
    tracker.mark("train_end")
    if snapshot:
        torch.cuda.memory._dump_snapshot(snapshot)
        torch.cuda.memory._record_memory_history(enabled=None)
    shutil.rmtree(ckpt, ignore_errors=True)
    shutil.rmtree(trainer.args.output_dir, ignore_errors=True)

    segs = tracker.segments
    steps = []
    for n in sorted({s["step"] for s in segs if s["step"] is not None}):
        mine = [s for s in segs if s["step"] == n]
        top = max(mine, key=lambda s: s["peak_allocated"])
        steps.append(
            {
                "step": n,
                "peak_allocated": top["peak_allocated"],
                "peak_segment": top["name"],
                "peak_reserved": max(s["peak_reserved"] for s in mine),
                "end_allocated": mine[-1]["allocated"],
            }
        )
    forwards = [dict(s["forward"], step=s["step"], peak_allocated=s["peak_allocated"]) for s in segs if "forward" in s]
    generations = [dict(s["generate"], step=s["step"], peak_allocated=s["peak_allocated"]) for s in segs if "generate" in s]
    props = torch.cuda.get_device_properties(0)
    run_peak = max(s["peak_allocated"] for s in segs)
    return {
        "id": row_id or default_id(ts),
        "spec": ts.to_json(),
        "measured": {
            "peak_allocated_bytes": run_peak,
            "peak_reserved_bytes": max(s["peak_reserved"] for s in segs),
            "steps_peak_allocated_bytes": max((s["peak_allocated"] for s in steps), default=None),
            "steps_peak_reserved_bytes": max((s["peak_reserved"] for s in steps), default=None),
            "peak_segment": max(segs, key=lambda s: s["peak_allocated"])["name"],
            "params": params,
            "trainable_params": trainable,
            "weights_loaded_bytes": weights_loaded,
            "reference_model": None if ref is None else type(core_model(ref)).__name__,
            "before_trainer": before,
            "steps": steps,
            "forwards": forwards,
            "generations": generations,
            "segments": segs,
        },
        "env": {
            "gpu": props.name,
            "gpu_total_bytes": total,
            **_versions(),
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
            "optim": trainer.args.optim if isinstance(trainer.args.optim, str) else str(trainer.args.optim.value),
            "attn_implementation": getattr(core_model(trainer.model).config, "_attn_implementation", None),
            "model_dtype": str(next(core_model(trainer.model).parameters()).dtype).replace("torch.", ""),
            "wall_s": round(time.time() - t0, 2),
        },
    }


# ----------------------------------------------------------------------------------------------- CLI


def _load_catalog(path: str | None) -> dict:
    candidate = Path(path) if path else Path(__file__).resolve().parents[2] / "crates" / "headroom" / "data" / "models.json"
    if not candidate.is_file():
        if path:
            raise specmod.SpecError(f"--catalog: {path} does not exist")
        return {}
    data = json.loads(candidate.read_text())
    return data.get("models", data)


def resolve(raw: dict, catalog: dict) -> tuple[TrainerSpec, dict]:
    ts = parse(raw)
    return ts, specmod.resolve_model_config(ts.base, catalog)


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def cmd_run(args) -> int:
    try:
        raw = json.loads(args.spec_json) if args.spec_json else json.loads(Path(args.spec).read_text())
        ts, fields = resolve(raw, _load_catalog(args.catalog))
    except (specmod.SpecError, OSError, json.JSONDecodeError) as err:
        return _fail(str(err))
    missing = [n for n in ("torch", "transformers", "datasets") if _missing(n)]
    if ts.trainer.startswith("trl-") and _missing("trl"):
        missing.append("trl")
    if ts.base.lora is not None and _missing("peft"):
        missing.append("peft")
    if missing:
        return _fail(f"{', '.join(missing)} not installed; `pip install torch transformers datasets trl peft` to measure")
    if ts.base.expandable_segments:
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(filter(None, [conf, "expandable_segments:True"]))
    import torch

    if not torch.cuda.is_available():
        return _fail("torch sees no CUDA GPU")
    record = measure(ts, fields, row_id=args.id, snapshot=args.snapshot)
    line = json.dumps(record)
    if args.out:
        with open(args.out, "a") as out:
            out.write(line + "\n")
    print(line, flush=True)
    return 0


def _missing(name: str) -> bool:
    try:
        __import__(name)
    except ImportError:
        return True
    return False


def cmd_check(args) -> int:
    catalog = _load_catalog(args.catalog)
    bad = 0
    for n, line in enumerate(Path(args.specs).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            ts, _ = resolve(item["spec"], catalog)
            print(f"ok   {item.get('id') or default_id(ts)}")
        except (specmod.SpecError, json.JSONDecodeError, KeyError) as err:
            bad += 1
            print(f"BAD  line {n}: {err}")
    return 2 if bad else 0


def cmd_batch(args) -> int:
    """Every line ({id, spec, optional snapshot}) in a fresh process, one after another; a failure is logged
    to OUT.errors and the rest go on."""
    lines = [json.loads(l) for l in Path(args.specs).read_text().splitlines() if l.strip()]
    if args.only:
        lines = [l for l in lines if any(part in l.get("id", "") for part in args.only.split(","))]
    if args.shard:
        k, n = (int(x) for x in args.shard.split("/"))
        lines = lines[k::n]
    started = time.time()
    failed = 0
    for i, line in enumerate(lines, 1):
        cmd = [sys.executable, "-m", "headroom_measure.trainers", "run", "--spec-json", json.dumps(line["spec"])]
        cmd += ["--out", args.out]
        if line.get("id"):
            cmd += ["--id", line["id"]]
        if args.catalog:
            cmd += ["--catalog", args.catalog]
        if args.snapshot_dir and line.get("snapshot"):
            cmd += ["--snapshot", str(Path(args.snapshot_dir) / line["snapshot"])]
        env = dict(os.environ)
        env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
        alloc = (line["spec"].get("allocator") or {}).get("expandable_segments")
        env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True" if alloc else ""
        t0 = time.time()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
            rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
        except subprocess.TimeoutExpired as err:
            rc, stdout, stderr = "timeout", "", (err.stderr or b"").decode(errors="replace") if isinstance(err.stderr, bytes) else (err.stderr or "")
        if rc == 0 and stdout.strip():
            rec = json.loads(stdout.strip().splitlines()[-1])
            m = rec["measured"]
            status = (
                f"ok alloc {m['peak_allocated_bytes'] / 2**30:.2f} GiB reserved {m['peak_reserved_bytes'] / 2**30:.2f} GiB"
                f" (peak in {m['peak_segment']})"
            )
        else:
            failed += 1
            tail = stderr.strip().splitlines()[-1] if stderr.strip() else ""
            status = f"FAILED rc={rc}: {tail}"
            with open(args.out + ".errors", "a") as err:
                err.write(json.dumps({"id": line.get("id"), "rc": rc, "stderr": stderr[-6000:]}) + "\n")
        print(f"[{i}/{len(lines)} {time.time() - started:6.0f}s] {line.get('id')}: {status} ({time.time() - t0:.0f}s)",
              flush=True)
        if args.deadline and time.time() - started > args.deadline:
            print(f"!! deadline of {args.deadline}s reached; {len(lines) - i} specs left unrun", flush=True)
            break
    return 0 if failed == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="headroom_measure.trainers", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="measure one trainer spec in this process")
    run.add_argument("spec", nargs="?", help="a trainer spec, JSON")
    run.add_argument("--spec-json")
    run.add_argument("--catalog")
    run.add_argument("--snapshot", help="write a torch.cuda.memory snapshot of the run here")
    run.add_argument("--out", help="append the row here too")
    run.add_argument("--id")
    batch = sub.add_parser("batch", help="measure every line of SPECS.jsonl, a fresh process each")
    batch.add_argument("specs")
    batch.add_argument("--out", required=True)
    batch.add_argument("--catalog")
    batch.add_argument("--snapshot-dir")
    batch.add_argument("--only", help="comma-separated substrings of ids to run")
    batch.add_argument("--shard", help="K/N: run lines K, K+N, K+2N, ... (0-based), for N batches side by side")
    batch.add_argument("--timeout", type=float, default=300)
    batch.add_argument("--deadline", type=float, default=0, help="stop starting new specs after this many seconds")
    check = sub.add_parser("check", help="parse and validate SPECS.jsonl without torch")
    check.add_argument("specs")
    check.add_argument("--catalog")
    args = parser.parse_args(argv)
    if args.command == "run":
        if not args.spec and not args.spec_json:
            parser.error("run needs SPEC or --spec-json")
        return cmd_run(args)
    if args.command == "check":
        return cmd_check(args)
    return cmd_batch(args)


if __name__ == "__main__":
    sys.exit(main())
