"""spec_from reads the objects a script has (duck-typed, or transformers' and peft's own) into
a spec whose estimate is that of the same run written by hand."""

import importlib.util
import json
from types import SimpleNamespace

import pytest

import headroom
from conftest import REPO

CATALOG = json.loads((REPO / "crates/headroom/data/models.json").read_text())["models"]
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
HAS_TORCH = importlib.util.find_spec("torch") is not None


def peaks(spec) -> tuple:
    est = headroom.estimate(spec)
    return est["params"], est["peak_allocated_bytes"], est["peak_reserved_bytes"], est["phases"]


def by_hand(**keys) -> dict:
    return {"model": "qwen2.5-0.5b", **keys}


def test_importing_headroom_imports_no_training_library():
    import subprocess
    import sys

    code = "import sys, headroom, headroom.integrations; print(sorted(m for m in ('torch', 'transformers', 'peft', 'trl', 'accelerate', 'lightning') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_duck_typed_config_and_arguments():
    config = dict(CATALOG["qwen2.5-0.5b"], dtype="bfloat16")
    args = SimpleNamespace(
        per_device_train_batch_size=4,
        gradient_checkpointing=True,
        gradient_accumulation_steps=1,
        max_grad_norm=1.0,
        bf16=True,
        fp16=False,
        optim="adamw_torch_fused",
    )
    spec = headroom.spec_from(config, args, seq_len=1024)
    assert spec["trainer"] == "hf"
    assert spec["precision"] == "bf16"
    assert spec["optimizer"] == "adamw-fused"
    expected = by_hand(
        trainer="hf", precision="bf16", optimizer="adamw-fused", batch_size=4, seq_len=1024,
        gradient_checkpointing=True, max_grad_norm=1.0,
    )
    assert peaks(spec) == peaks(expected)


def test_fp32_weights_with_bf16_are_autocast():
    args = SimpleNamespace(per_device_train_batch_size=2, bf16=True, fp16=False, optim="adamw_torch")
    spec = headroom.spec_from(dict(CATALOG["qwen2.5-0.5b"], dtype="float32"), args, seq_len=512)
    assert spec["precision"] == "amp-bf16"
    assert spec["optimizer"] == "adamw"


def test_duck_typed_lora_and_deepspeed():
    lora = SimpleNamespace(peft_type="LORA", r=16, lora_alpha=32, lora_dropout=0.05, target_modules={"q_proj", "v_proj"})
    ds = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    acc = {"distributed_type": "DEEPSPEED", "num_processes": 4}
    spec = headroom.spec_from("qwen2.5-0.5b", peft_config=lora, deepspeed_config=ds, accelerate_config=acc,
                              seq_len=256, batch_size=2, precision="bf16")
    assert spec["lora"] == {"r": 16, "alpha": 32, "dropout": 0.05, "targets": ["q_proj", "v_proj"]}
    assert spec["parallel"] == {"strategy": "zero2", "offload_optimizer": True, "world_size": 4}


def test_an_accelerate_fsdp2_config_file(tmp_path):
    path = tmp_path / "fsdp.yaml"
    path.write_text("distributed_type: FSDP\nnum_processes: 8\nfsdp_config:\n  fsdp_version: 2\n")
    spec = headroom.spec_from("qwen2.5-0.5b", accelerate_config=path)
    assert spec["parallel"] == {"strategy": "fsdp", "world_size": 8}


def test_a_trl_config_by_its_class_name():
    DPOConfig = type("DPOConfig", (), {})
    args = DPOConfig()
    args.__dict__.update(per_device_train_batch_size=2, max_length=1024, max_prompt_length=256, beta=0.1,
                         bf16=True, optim="adamw_torch", gradient_checkpointing=True)
    spec = headroom.spec_from(dict(CATALOG["qwen2.5-0.5b"], dtype="bfloat16"), args)
    assert (spec["trainer"], spec["seq_len"], spec["prompt_len"]) == ("trl-dpo", 1024, 256)
    headroom.estimate(spec)


def test_what_is_not_modelled_is_a_spec_error():
    with pytest.raises(headroom.SpecError) as e:
        headroom.spec_from("qwen2.5-0.5b", SimpleNamespace(optim="lion_32bit"))
    assert e.value.field == "args.optim"
    with pytest.raises(headroom.SpecError) as e:
        headroom.spec_from(object())
    assert e.value.field == "model"


@pytest.mark.skipif(not HAS_TRANSFORMERS, reason="transformers is not installed")
def test_a_real_transformers_config():
    from transformers import AutoConfig

    fields = dict(CATALOG["qwen2.5-0.5b"])
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    spec = headroom.spec_from(config, seq_len=1024, batch_size=2, precision="bf16")
    assert spec["model_config"]["model_type"] == "qwen2"
    assert peaks(spec) == peaks(by_hand(seq_len=1024, batch_size=2, precision="bf16"))


@pytest.mark.skipif(not (HAS_TRANSFORMERS and HAS_TORCH), reason="TrainingArguments and peft need torch")
def test_real_training_arguments_and_lora_config(tmp_path):
    from peft import LoraConfig
    from transformers import AutoConfig, TrainingArguments

    fields = dict(CATALOG["qwen2.5-0.5b"])
    config = AutoConfig.for_model(fields.pop("model_type"), dtype="bfloat16", **fields)
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, bf16=True,
                             gradient_checkpointing=True, optim="adamw_torch", report_to=[], use_cpu=True)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0)
    spec = headroom.spec_from(config, args, peft_config=lora, seq_len=1024)
    expected = by_hand(trainer="hf", precision="bf16", optimizer="adamw", batch_size=4, seq_len=1024,
                       gradient_checkpointing=True, max_grad_norm=1.0,
                       lora={"r": 16, "alpha": 32, "targets": "all-linear", "dropout": 0.0})
    assert peaks(spec) == peaks(expected)
