"""Writes bench/megatron-moe/specs.jsonl: Megatron-core MoE rows (local layer spec, MoEAlltoAllTokenDispatcher,
SequentialMLP, balanced routing) as rank 0 of a fake world, tp 1 (Megatron's MoELayer needs sequence parallelism
with tp > 1, which the local spec refuses)."""
import json
from pathlib import Path

MODELS = {
    "q30": ("qwen3-30b-a3b", {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
            "moe_intermediate_size": 768, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
            "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
            "mlp_only_layers": [], "vocab_size": 151936, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
            "tie_word_embeddings": False}),
    "q235": ("qwen3-235b-a22b", {"model_type": "qwen3_moe", "hidden_size": 4096, "intermediate_size": 12288,
             "moe_intermediate_size": 1536, "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
             "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
             "mlp_only_layers": [], "vocab_size": 151936, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
             "tie_word_embeddings": False}),
}
# (model, layers, batch, seq, world, ep, distributed optimizer, recompute (granularity, method, layers), snapshot)
ROWS = [
    ("q30", 2, 1, 4096, 8, 1, True, None, True),
    ("q235", 1, 1, 2048, 16, 8, False, ("full", "uniform", 1), False),
    ("q30", 2, 1, 4096, 4, 4, False, None, True),
    ("q235", 1, 1, 4096, 64, 8, True, None, True),
    ("q30", 4, 1, 2048, 16, 2, True, ("selective", None, None), False),
    ("q30", 2, 2, 2048, 8, 8, True, ("full", "uniform", 1), True),
    ("q30", 4, 1, 4096, 64, 8, False, ("full", "block", 2), False),
    ("q235", 2, 1, 2048, 32, 16, True, ("selective", None, None), False),
    ("q30", 2, 1, 2048, 32, 4, True, ("selective", None, None), False),
    ("q30", 2, 1, 2048, 2, 2, False, None, False),
]


def row(key, layers, b, s, world, ep, dist_opt, recompute, snapshot):
    model, config = MODELS[key]
    mega = {"distributed_optimizer": dist_opt, "expert_model_parallel_size": ep}
    tag = "do" if dist_opt else "nodo"
    rc = "norc"
    if recompute:
        gran, method, n = recompute
        mega["recompute_granularity"] = gran
        rc = gran
        if method:
            mega["recompute_method"], mega["recompute_num_layers"] = method, n
            rc = f"full-{method}{n}"
    rid = f"megatron-moe/{key}-L{layers}/bs{b}/s{s}/w{world}-ep{ep}-{tag}/{rc}"
    line = {
        "id": rid,
        "spec": {"model": model, "model_config": {**config, "num_hidden_layers": layers}, "precision": "bf16",
                 "optimizer": "adamw", "batch_size": b, "seq_len": s,
                 "parallel": {"strategy": "ddp", "world_size": world, "tp": 1, "framework": "megatron"},
                 "megatron": mega},
        "fake": True,
    }
    if snapshot:
        line["snapshot"] = rid.replace("/", "-") + ".pickle"
    return line


out = Path(__file__).resolve().parents[1] / "specs.jsonl"
out.write_text("".join(json.dumps(row(*r)) + "\n" for r in ROWS))
print(out, len(ROWS))
