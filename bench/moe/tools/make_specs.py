"""Writes bench/moe/specs.jsonl (the MoE measurement batch) from the catalog entries in
crates/headroom/data/models.json, and prints a rough fit estimate per run (H100 80 GB).

    python3 bench/moe/tools/make_specs.py   (torch + transformers 5.17, CPU)
"""
import json
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM

REPO = Path(__file__).resolve().parents[3]
CAT = json.loads((REPO / "crates/headroom/data/models.json").read_text())["models"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLA_ATTN = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]


def cfg(name, layers=None, **over):
    c = json.loads(json.dumps(CAT[name]))
    if layers is not None:
        c["num_hidden_layers"] = layers
        if "layer_types" in c:
            c["layer_types"] = c["layer_types"][:layers]
    c.update(over)
    return c


RUNS = []


def add(rid, model, *, layers=None, over=None, **spec):
    s = {"model": model}
    if layers is not None or over:
        s["model_config"] = cfg(model, layers, **(over or {}))
    s.update(spec)
    RUNS.append({"id": rid, "spec": s})


Q30 = "qwen3-30b-a3b"
base = dict(precision="bf16", optimizer="adamw", batch_size=1, seq_len=2048)
add("moe/qwen3-30b-a3b/L4/adamw/b1s2048", Q30, layers=4, attention="sdpa", **base)
add("moe/qwen3-30b-a3b/L4/adamw/b1s2048/eager", Q30, layers=4, attention="eager", **base)
add("moe/qwen3-30b-a3b/L4/adamw/b2s4096/gc", Q30, layers=4, precision="bf16", optimizer="adamw",
    batch_size=2, seq_len=4096, gradient_checkpointing=True)
add("moe/qwen3-30b-a3b/L24/lora-attn/b2s2048/gc", Q30, layers=24, precision="bf16", batch_size=2, seq_len=2048,
    gradient_checkpointing=True, lora={"r": 16, "alpha": 32, "targets": ATTN, "dropout": 0.0})
add("moe/qwen3-30b-a3b/L4/lora-experts/b1s2048", Q30, layers=4, precision="bf16", batch_size=1, seq_len=2048,
    lora={"r": 8, "alpha": 16, "targets": [], "target_parameters": EXPERTS, "dropout": 0.0})
add("moe/qwen3-30b-a3b/L4/adamw/b1s2048/aux", Q30, layers=4, over={"output_router_logits": True}, **base)
add("moe/qwen3-30b-a3b/L4/adamw/b1s2048/experts-eager", Q30, layers=4, experts_implementation="eager", **base)
add("moe/qwen3-30b-a3b/L2/adamw/b1s128/experts-batched_mm", Q30, layers=2, experts_implementation="batched_mm",
    precision="bf16", optimizer="adamw", batch_size=1, seq_len=128)
add("moe/qwen3-30b-a3b/L2/amp-bf16/adamw/b1s2048", Q30, layers=2, precision="amp-bf16", optimizer="adamw",
    batch_size=1, seq_len=2048)
add("moe/qwen3-30b-a3b/L48/forward/b1s1024", Q30, precision="bf16", mode="forward", batch_size=1, seq_len=1024)
add("moe/qwen3-235b-a22b/L2/adamw/b1s1024", "qwen3-235b-a22b", layers=2, precision="bf16", optimizer="adamw",
    batch_size=1, seq_len=1024)
add("moe/qwen2-57b-a14b/L2/adamw/b1s1024", "qwen2-57b-a14b", layers=2, precision="bf16", optimizer="adamw",
    batch_size=1, seq_len=1024)
add("moe/mixtral-8x7b/L2/adamw/b2s2048", "mixtral-8x7b", layers=2, precision="bf16", optimizer="adamw",
    batch_size=2, seq_len=2048, attention="sdpa")
add("moe/mixtral-8x7b/L2/adamw/b2s2048/eager", "mixtral-8x7b", layers=2, precision="bf16", optimizer="adamw",
    batch_size=2, seq_len=2048, attention="eager")
add("moe/mixtral-8x22b/L1/adamw/b2s2048", "mixtral-8x22b", layers=1, precision="bf16", optimizer="adamw",
    batch_size=2, seq_len=2048)
add("moe/olmoe-1b-7b/L16/lora-attn/b2s2048", "olmoe-1b-7b", precision="bf16", batch_size=2, seq_len=2048,
    lora={"r": 16, "alpha": 32, "targets": ATTN, "dropout": 0.05})
# full AdamW on all 6.92 B parameters: 8 bytes each (bf16 weights, grads, 2 states) = 55 GB; the
# foreach AdamW's sqrt temporary would add 2 bytes each (69 GB at the step), the fused one none.
add("moe/olmoe-1b-7b/L16/adamw-fused/b1s2048/gc", "olmoe-1b-7b", precision="bf16", optimizer="adamw-fused", batch_size=1,
    seq_len=2048, gradient_checkpointing=True)
add("moe/olmoe-1b-7b/L16/forward/b4s2048", "olmoe-1b-7b", precision="bf16", mode="forward", batch_size=4,
    seq_len=2048)
add("moe/deepseek-v2-lite/L3/adamw/b2s2048", "deepseek-v2-lite", layers=3, precision="bf16", optimizer="adamw",
    batch_size=2, seq_len=2048, attention="sdpa")
add("moe/deepseek-v2-lite/L3/adamw/b2s2048/eager", "deepseek-v2-lite", layers=3, precision="bf16",
    optimizer="adamw", batch_size=2, seq_len=2048, attention="eager")
add("moe/deepseek-v2-lite/L27/lora-all-linear/b2s2048/gc", "deepseek-v2-lite", precision="bf16", batch_size=2,
    seq_len=2048, gradient_checkpointing=True, lora={"r": 16, "alpha": 32, "targets": "all-linear", "dropout": 0.0})
add("moe/deepseek-v3/L2-dense1/lora-attn/b1s2048", "deepseek-v3", layers=2, over={"first_k_dense_replace": 1},
    precision="bf16", batch_size=1, seq_len=2048, lora={"r": 16, "alpha": 32, "targets": MLA_ATTN, "dropout": 0.0})
add("moe/deepseek-v3/L2-dense1/forward/b1s4096", "deepseek-v3", layers=2, over={"first_k_dense_replace": 1},
    precision="bf16", mode="forward", batch_size=1, seq_len=4096)
add("moe/gpt-oss-20b/L4/adamw/b1s2048", "gpt-oss-20b", layers=4, precision="bf16", optimizer="adamw",
    batch_size=1, seq_len=2048, attention="eager")
add("moe/gpt-oss-20b/L24/lora-experts/b1s2048/gc", "gpt-oss-20b", precision="bf16", batch_size=1, seq_len=2048,
    gradient_checkpointing=True, attention="eager",
    lora={"r": 8, "alpha": 16, "targets": [], "target_parameters": EXPERTS, "dropout": 0.0})
add("moe/gpt-oss-120b/L2/forward/b1s4096", "gpt-oss-120b", layers=2, precision="bf16", mode="forward",
    batch_size=1, seq_len=4096, attention="eager")
add("dense/gemma-3-1b/L26/adamw/b2s2048", "gemma-3-1b", precision="bf16", optimizer="adamw", batch_size=2,
    seq_len=2048)
add("dense/olmo-2-1124-7b/L32/lora-all-linear/b1s2048", "olmo-2-1124-7b", precision="bf16", batch_size=1,
    seq_len=2048, lora={"r": 16, "alpha": 32, "targets": "all-linear", "dropout": 0.05})
add("dense/glm-4-9b-0414/L4/adamw/b1s2048", "glm-4-9b-0414", layers=4, precision="bf16", optimizer="adamw",
    batch_size=1, seq_len=2048)


def count(fields):
    f = dict(fields)
    mt = f.pop("model_type")
    c = AutoConfig.for_model(mt, **f)
    with torch.device("meta"):
        m = AutoModelForCausalLM.from_config(c)
    return sum(p.numel() for p in m.parameters())


if __name__ == "__main__":
    out = REPO / "bench/moe/specs.jsonl"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in RUNS))
    print(len(RUNS), "runs written to", out)
    for r in RUNS:
        s = r["spec"]
        fields = s.get("model_config") or CAT[s["model"]]
        n = count(fields)
        print(f"{r['id']:60s} params {n / 1e9:7.3f} B")
