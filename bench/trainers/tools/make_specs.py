"""Writes bench/trainers/specs.jsonl: the first measured corpus of real trainers (issue 14).

Small models (qwen2.5-0.5b, qwen3-0.6b, llama-3.2-1b) so each run takes seconds; every trainer, LoRA and
full, DPO with and without a separate reference, GRPO with beta 0 and beta > 0. Lines carrying "snapshot"
are also recorded with torch.cuda.memory history (batch --snapshot-dir).
"""
import json
import sys
from pathlib import Path

LORA = {"r": 16, "alpha": 32, "targets": "all-linear", "dropout": 0.0}
rows = []


def add(id_, snapshot=None, **spec):
    line = {"id": id_, "spec": spec}
    if snapshot:
        line["snapshot"] = snapshot
    rows.append(line)


# transformers.Trainer (defaults: adamw_torch_fused, max_grad_norm 1.0, no checkpointing)
add("hf/q05/bf16/bs4/s1024", trainer="hf", model="qwen2.5-0.5b", precision="bf16", batch_size=4, seq_len=1024)
add("hf/q05/amp_bf16/bs4/s1024", trainer="hf", model="qwen2.5-0.5b", precision="amp-bf16", batch_size=4, seq_len=1024)
add("hf/q05/bf16/bs4/s1024/adamw", trainer="hf", model="qwen2.5-0.5b", precision="bf16", optimizer="adamw",
    batch_size=4, seq_len=1024)
add("hf/llama1b/bf16/bs2/s2048/gc", trainer="hf", model="llama-3.2-1b", precision="bf16", batch_size=2, seq_len=2048,
    gradient_checkpointing=True)
add("hf/q3-06/bf16/bs4/s1024/lora16", trainer="hf", model="qwen3-0.6b", precision="bf16", batch_size=4, seq_len=1024,
    lora=LORA)
# SFT (TRL default: gradient checkpointing on)
add("sft/q05/bf16/bs4/s1024/gc", trainer="trl-sft", model="qwen2.5-0.5b", precision="bf16", batch_size=4,
    seq_len=1024, snapshot="sft-q05-bf16-bs4-s1024-gc.pickle")
add("sft/q05/bf16/bs4/s1024/nogc", trainer="trl-sft", model="qwen2.5-0.5b", precision="bf16", batch_size=4,
    seq_len=1024, gradient_checkpointing=False)
add("sft/q3-06/amp_bf16/bs2/s2048/gc", trainer="trl-sft", model="qwen3-0.6b", precision="amp-bf16", batch_size=2,
    seq_len=2048)
add("sft/llama1b/bf16/bs2/s2048/gc/lora16", trainer="trl-sft", model="llama-3.2-1b", precision="bf16", batch_size=2,
    seq_len=2048, lora=LORA)
# DPO: batch_size preference pairs -> 2 x batch_size rows
add("dpo/q05/bf16/bs2/s1024/gc/autoref", trainer="trl-dpo", model="qwen2.5-0.5b", precision="bf16", batch_size=2,
    seq_len=1024, snapshot="dpo-q05-bf16-bs2-s1024-gc-autoref.pickle")
add("dpo/q05/bf16/bs2/s1024/nogc/autoref", trainer="trl-dpo", model="qwen2.5-0.5b", precision="bf16", batch_size=2,
    seq_len=1024, gradient_checkpointing=False)
add("dpo/q05/bf16/bs2/s1024/gc/lora16/noref", trainer="trl-dpo", model="qwen2.5-0.5b", precision="bf16",
    batch_size=2, seq_len=1024, lora=LORA)
add("dpo/q05/bf16/bs2/s1024/gc/lora16/ref_bf16", trainer="trl-dpo", model="qwen2.5-0.5b", precision="bf16",
    batch_size=2, seq_len=1024, lora=LORA, reference={"precision": "bf16"})
add("dpo/q3-06/amp_bf16/bs2/s1024/gc/autoref", trainer="trl-dpo", model="qwen3-0.6b", precision="amp-bf16",
    batch_size=2, seq_len=1024)
add("dpo/q05/bf16/bs2/s1024/gc/precompute", trainer="trl-dpo", model="qwen2.5-0.5b", precision="bf16", batch_size=2,
    seq_len=1024, precompute_ref_log_probs=True)
add("dpo/llama1b/bf16/bs4/s2048/gc/lora16/noref", trainer="trl-dpo", model="llama-3.2-1b", precision="bf16",
    batch_size=4, seq_len=2048, prompt_len=512, lora=LORA)
# Reward model (sequence classification; chosen and rejected concatenated)
add("reward/q05/bf16/bs4/s1024/gc", trainer="trl-reward", model="qwen2.5-0.5b", precision="bf16", batch_size=4,
    seq_len=1024)
add("reward/q05/bf16/bs4/s1024/nogc", trainer="trl-reward", model="qwen2.5-0.5b", precision="bf16", batch_size=4,
    seq_len=1024, gradient_checkpointing=False)
add("reward/q3-06/bf16/bs4/s1024/gc/lora16", trainer="trl-reward", model="qwen3-0.6b", precision="bf16",
    batch_size=4, seq_len=1024, lora=LORA)
# GRPO: batch_size completions, num_generations per prompt; HF generate
add("grpo/q05/bf16/bs8/g8/p256/c256/beta0", trainer="trl-grpo", model="qwen2.5-0.5b", precision="bf16",
    batch_size=8, num_generations=8, prompt_len=256, completion_len=256, beta=0.0,
    snapshot="grpo-q05-bf16-bs8-g8-p256-c256-beta0.pickle")
add("grpo/q05/bf16/bs8/g8/p256/c256/beta0.04", trainer="trl-grpo", model="qwen2.5-0.5b", precision="bf16",
    batch_size=8, num_generations=8, prompt_len=256, completion_len=256, beta=0.04)
add("grpo/q05/bf16/bs8/g4/p256/c256/beta0/nogc", trainer="trl-grpo", model="qwen2.5-0.5b", precision="bf16",
    batch_size=8, num_generations=4, prompt_len=256, completion_len=256, beta=0.0, gradient_checkpointing=False)
add("grpo/q05/bf16/bs8/g8/p256/c256/beta0.04/lora16", trainer="trl-grpo", model="qwen2.5-0.5b", precision="bf16",
    batch_size=8, num_generations=8, prompt_len=256, completion_len=256, beta=0.04, lora=LORA)
add("grpo/q3-06/bf16/bs4/g4/p512/c256/beta0", trainer="trl-grpo", model="qwen3-0.6b", precision="bf16",
    batch_size=4, num_generations=4, prompt_len=512, completion_len=256, beta=0.0)
add("grpo/q3-06/amp_bf16/bs4/g4/p512/c256/beta0.04", trainer="trl-grpo", model="qwen3-0.6b", precision="amp-bf16",
    batch_size=4, num_generations=4, prompt_len=512, completion_len=256, beta=0.04)
add("grpo/llama1b/bf16/bs8/g8/p128/c512/beta0.04/lora16", trainer="trl-grpo", model="llama-3.2-1b",
    precision="bf16", batch_size=8, num_generations=8, prompt_len=128, completion_len=512, beta=0.04, lora=LORA)
# the second half of the matrix, larger shapes
add("sft/q05/bf16/bs8/s2048/gc", trainer="trl-sft", model="qwen2.5-0.5b", precision="bf16", batch_size=8,
    seq_len=2048)
add("dpo/llama1b/bf16/bs2/s2048/gc/autoref", trainer="trl-dpo", model="llama-3.2-1b", precision="bf16",
    batch_size=2, seq_len=2048, prompt_len=512)
add("hf/q05/bf16/bs8/s2048/gc/ga2", trainer="hf", model="qwen2.5-0.5b", precision="bf16", batch_size=8,
    seq_len=2048, gradient_checkpointing=True, gradient_accumulation_steps=2)
add("reward/llama1b/bf16/bs4/s2048/gc", trainer="trl-reward", model="llama-3.2-1b", precision="bf16",
    batch_size=4, seq_len=2048)

# device call 2: the one spec call 1 left unrun, and more of each trainer
CALL2_FROM = len(rows)
add("sft/llama1b/bf16/bs2/s2048/nogc/lora16", trainer="trl-sft", model="llama-3.2-1b", precision="bf16",
    batch_size=2, seq_len=2048, lora=LORA, gradient_checkpointing=False)
add("sft/q05/bf16/bs4/s1024/gc/expandable", trainer="trl-sft", model="qwen2.5-0.5b", precision="bf16",
    batch_size=4, seq_len=1024, allocator={"expandable_segments": True})
add("dpo/q3-06/amp_bf16/bs2/s1024/gc/lora16/ref_fp32", trainer="trl-dpo", model="qwen3-0.6b", precision="amp-bf16",
    batch_size=2, seq_len=1024, lora=LORA, reference={"precision": "fp32"})
add("dpo/q05/bf16/bs8/s512/gc/autoref", trainer="trl-dpo", model="qwen2.5-0.5b", precision="bf16", batch_size=8,
    seq_len=512, prompt_len=128)
add("reward/q3-06/amp_bf16/bs2/s2048/gc", trainer="trl-reward", model="qwen3-0.6b", precision="amp-bf16",
    batch_size=2, seq_len=2048)
add("grpo/q05/bf16/bs8/g8/p256/c256/beta0.04/nogc", trainer="trl-grpo", model="qwen2.5-0.5b", precision="bf16",
    batch_size=8, num_generations=8, prompt_len=256, completion_len=256, beta=0.04, gradient_checkpointing=False)
add("grpo/q3-06/bf16/bs16/g8/p128/c384/beta0", trainer="trl-grpo", model="qwen3-0.6b", precision="bf16",
    batch_size=16, num_generations=8, prompt_len=128, completion_len=384, beta=0.0)
add("hf/llama1b/amp_bf16/bs2/s1024", trainer="hf", model="llama-3.2-1b", precision="amp-bf16", batch_size=2,
    seq_len=1024)
add("hf/q05/fp32/bs2/s1024/gc", trainer="hf", model="qwen2.5-0.5b", precision="fp32", batch_size=2, seq_len=1024,
    gradient_checkpointing=True)

out = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[1] / "specs.jsonl")
out.write_text("".join(json.dumps(r) + "\n" for r in rows))
call2 = [r for r in rows if r["id"] == "hf/q05/bf16/bs8/s2048/gc/ga2"] + rows[CALL2_FROM:]
(out.parent / "tools" / "specs-call2.jsonl").write_text("".join(json.dumps(r) + "\n" for r in call2))
print(f"{len(rows)} specs -> {out}; {len(call2)} also in tools/specs-call2.jsonl")
