"""A real transformers Trainer run with headroom's callback: one run per process.

    python3 bench/callback/run_callback.py RUN [--cpu-check]

RUN is `full` (bf16 full fine-tune of Qwen2.5-0.5B, micro-batch 4 x 1024, the Trainer's
default optimizer), `lora` (LoRA r16 on all linear layers, gradient checkpointing, 4 x 2048) or
`oom` (a full fine-tune at 64 x 4096, which runs out of memory: the callback dumps a snapshot
and prints the remedies). The model is built from Qwen2.5-0.5B's config with random weights on
the GPU in bf16; the data is random tokens. The callback builds the spec itself from the model,
the arguments and the first batch (`headroom.integrations.watch`). It prints the estimate, the
per-step comparison, and at the end one JSON line: the spec, the rows and the versions.
`--cpu-check` stops after building the spec and estimating it (no GPU needed).
"""

import argparse
import json
import os
import sys
import tempfile

QWEN25_05B = {
    "model_type": "qwen2",
    "hidden_size": 896,
    "intermediate_size": 4864,
    "num_hidden_layers": 24,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151936,
    "tie_word_embeddings": True,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-06,
    "hidden_act": "silu",
}

RUNS = {
    "full": dict(batch_size=4, seq_len=1024, lora=False, checkpointing=False),
    "lora": dict(batch_size=4, seq_len=2048, lora=True, checkpointing=True),
    "oom": dict(batch_size=64, seq_len=4096, lora=False, checkpointing=False),
}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("run", choices=sorted(RUNS))
    p.add_argument("--cpu-check", action="store_true")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    a = p.parse_args()
    r = RUNS[a.run]

    import torch
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

    import headroom
    from headroom.integrations import watch

    device = "cpu" if a.cpu_check else "cuda"
    fields = dict(QWEN25_05B)
    config = AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    with torch.device("meta" if a.cpu_check else device):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    if r["lora"]:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0))
    n = r["batch_size"] * 8
    data = [
        {"input_ids": ids, "labels": ids.clone()}
        for ids in torch.randint(3, config.vocab_size, (n, r["seq_len"])).unbind(0)
    ]
    args = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="headroom-callback-"),
        per_device_train_batch_size=r["batch_size"],
        gradient_checkpointing=r["checkpointing"],
        bf16=True,
        max_steps=5,
        learning_rate=1e-5,
        report_to=[],
        save_strategy="no",
        logging_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
        use_cpu=a.cpu_check,
        seed=0,
    )
    versions = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "headroom": headroom.__version__,
        "gpu": None if a.cpu_check else torch.cuda.get_device_name(),
        "python": sys.version.split()[0],
    }
    if r["lora"]:
        import peft

        versions["peft"] = peft.__version__
    print(json.dumps({"run": a.run, "versions": versions, "optim": str(getattr(args.optim, "value", args.optim))}))

    if a.cpu_check:
        spec = headroom.spec_from(model, args, seq_len=r["seq_len"])
        est = headroom.estimate(spec, "h100-80gb")
        print(json.dumps({"spec": {k: v for k, v in spec.items() if k != "model_config"}}))
        print(f"estimated peak allocated {est['peak_allocated_bytes']}, fits: {est['gpu']['fits']}")
        return 0

    trainer = Trainer(model=model, args=args, train_dataset=data)
    cb = watch(
        trainer,
        threshold=0.05,
        record_history=a.run == "oom",
        history_max_entries=20_000,
        snapshot_dir=a.out,
        out=lambda text: print(text, flush=True),
    )
    error = None
    try:
        trainer.train()
    except torch.cuda.OutOfMemoryError as e:
        error = str(e).splitlines()[0]
    spec = {k: v for k, v in (cb.watch.spec or {}).items() if k != "model_config"}
    print(json.dumps({"run": a.run, "spec": spec, "rows": cb.rows, "oom": error, "versions": versions}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
