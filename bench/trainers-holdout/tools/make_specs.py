"""Writes bench/trainers-holdout/specs.jsonl: trainer runs the model of issue 14 was not built from.

Larger models than bench/trainers (qwen2.5-1.5b, qwen3-1.7b, llama-3.2-3b, qwen2.5-3b), gradient accumulation for
every trainer, other batch and length shapes, GRPO with a longer completion and accumulation, and liger-kernel
0.8.5's `use_liger_kernel` with Trainer, SFT, DPO and GRPO. The line carrying "snapshot" is recorded with
torch.cuda.memory history: a LoRA SFT run with gradient checkpointing, where the estimate holds one [rows, seq,
hidden] tensor more than bench/trainers measured.
"""
import json
from pathlib import Path

LORA = {"r": 16, "alpha": 32, "targets": "all-linear", "dropout": 0.0}
rows = []


def add(id_, snapshot=None, **spec):
    line = {"id": id_, "spec": spec}
    if snapshot:
        line["snapshot"] = snapshot
    rows.append(line)


add("hf/q15/bf16/bs4/s2048/gc/ga4", trainer="hf", model="qwen2.5-1.5b", precision="bf16", batch_size=4,
    seq_len=2048, gradient_checkpointing=True, gradient_accumulation_steps=4)
add("hf/l3b/bf16/bs2/s2048/gc/lora16", trainer="hf", model="llama-3.2-3b", precision="bf16", batch_size=2,
    seq_len=2048, gradient_checkpointing=True, lora=LORA)
add("hf/q05/bf16/bs4/s1024/liger", trainer="hf", model="qwen2.5-0.5b", precision="bf16", batch_size=4,
    seq_len=1024, use_liger_kernel=True)
add("sft/q3-17/bf16/bs4/s2048/gc", trainer="trl-sft", model="qwen3-1.7b", precision="bf16", batch_size=4,
    seq_len=2048)
add("sft/q15/bf16/bs8/s1024/gc/ga2", trainer="trl-sft", model="qwen2.5-1.5b", precision="bf16", batch_size=8,
    seq_len=1024, gradient_accumulation_steps=2)
add("sft/l3b/bf16/bs4/s2048/gc/lora16", trainer="trl-sft", model="llama-3.2-3b", precision="bf16", batch_size=4,
    seq_len=2048, lora=LORA)
add("sft/llama1b/bf16/bs2/s2048/gc/lora16", trainer="trl-sft", model="llama-3.2-1b", precision="bf16",
    batch_size=2, seq_len=2048, lora=LORA, snapshot="sft-llama1b-bf16-bs2-s2048-gc-lora16.pickle")
add("sft/q05/bf16/bs8/s1024/gc/liger", trainer="trl-sft", model="qwen2.5-0.5b", precision="bf16", batch_size=8,
    seq_len=1024, use_liger_kernel=True)
add("sft/q3-17/bf16/bs2/s4096/gc/noclip", trainer="trl-sft", model="qwen3-1.7b", precision="bf16", batch_size=2,
    seq_len=4096, max_grad_norm=0)
add("dpo/q15/bf16/bs2/s2048/gc/autoref", trainer="trl-dpo", model="qwen2.5-1.5b", precision="bf16", batch_size=2,
    seq_len=2048, prompt_len=512)
add("dpo/q3-17/bf16/bs4/s1024/gc/lora16/noref/ga2", trainer="trl-dpo", model="qwen3-1.7b", precision="bf16",
    batch_size=4, seq_len=1024, lora=LORA, gradient_accumulation_steps=2)
add("dpo/q3b/bf16/bs2/s1024/gc/lora16/precompute", trainer="trl-dpo", model="qwen2.5-3b", precision="bf16",
    batch_size=2, seq_len=1024, lora=LORA, precompute_ref_log_probs=True)
add("dpo/q05/bf16/bs4/s1024/gc/autoref/liger", trainer="trl-dpo", model="qwen2.5-0.5b", precision="bf16",
    batch_size=4, seq_len=1024, use_liger_kernel=True)
add("grpo/q15/bf16/bs8/g8/p256/c512/beta0.04", trainer="trl-grpo", model="qwen2.5-1.5b", precision="bf16",
    batch_size=8, prompt_len=256, completion_len=512, num_generations=8, beta=0.04)
add("grpo/q3-17/bf16/bs4/g8/p512/c256/beta0/ga2", trainer="trl-grpo", model="qwen3-1.7b", precision="bf16",
    batch_size=4, prompt_len=512, completion_len=256, num_generations=8, beta=0.0, gradient_accumulation_steps=2)
add("grpo/llama1b/bf16/bs8/g4/p128/c384/beta0.04/lora16", trainer="trl-grpo", model="llama-3.2-1b",
    precision="bf16", batch_size=8, prompt_len=128, completion_len=384, num_generations=4, beta=0.04, lora=LORA)
add("grpo/q05/bf16/bs8/g8/p256/c256/beta0/liger", trainer="trl-grpo", model="qwen2.5-0.5b", precision="bf16",
    batch_size=8, prompt_len=256, completion_len=256, num_generations=8, beta=0.0, use_liger_kernel=True)
add("reward/q15/bf16/bs4/s2048/gc/lora16", trainer="trl-reward", model="qwen2.5-1.5b", precision="bf16",
    batch_size=4, seq_len=2048, lora=LORA)
add("reward/q3-17/bf16/bs8/s1024/gc/ga2", trainer="trl-reward", model="qwen3-1.7b", precision="bf16",
    batch_size=8, seq_len=1024, gradient_accumulation_steps=2)
add("sft/q3b/amp_bf16/bs2/s1024/gc", trainer="trl-sft", model="qwen2.5-3b", precision="amp-bf16", batch_size=2,
    seq_len=1024)

out = Path(__file__).resolve().parents[1] / "specs.jsonl"
out.write_text("".join(json.dumps(r) + "\n" for r in rows))
print(f"{out}: {len(rows)} specs")
