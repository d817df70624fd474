"""Writes bench/megatron-moe/specs.jsonl: Megatron-core MoE rows (local layer spec, MoEAlltoAllTokenDispatcher,
SequentialMLP, balanced routing) as rank 0 of a fake world, tp 1 (Megatron's MoELayer needs sequence parallelism
with tp > 1, which the local spec refuses)."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "megatron" / "tools"))
from rows import line, recompute_keys  # noqa: E402

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
    rc = recompute_keys(mega, recompute)
    tag = "do" if dist_opt else "nodo"
    rid = f"megatron-moe/{key}-L{layers}/bs{b}/s{s}/w{world}-ep{ep}-{tag}/{rc}"
    parallel = {"strategy": "ddp", "world_size": world, "tp": 1, "framework": "megatron"}
    return line(rid, model, config, layers, b, s, parallel, mega, snapshot)


out = Path(__file__).resolve().parents[1] / "specs.jsonl"
out.write_text("".join(json.dumps(row(*r)) + "\n" for r in ROWS))
print(out, len(ROWS))
