"""Writes bench/megatron-etp/specs.jsonl: Megatron-core MoE rows with expert tensor parallelism
(`megatron.expert_tensor_parallel_size` 2 or 4, tp 1: the attention's tensor-parallel group is 1, so MoELayer
needs no sequence parallelism) as rank 0 of a fake world of 8 (local layer spec, MoEAlltoAllTokenDispatcher,
SequentialMLP, balanced routing)."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "megatron" / "tools"))
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "megatron-moe" / "tools"))
from rows import line, recompute_keys  # noqa: E402

Q30 = ("qwen3-30b-a3b", {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
       "moe_intermediate_size": 768, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
       "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
       "mlp_only_layers": [], "vocab_size": 151936, "rope_theta": 1000000.0, "rms_norm_eps": 1e-06,
       "tie_word_embeddings": False})
# (layers, batch, seq, world, ep, etp, distributed optimizer, recompute, snapshot)
ROWS = [
    (2, 1, 4096, 8, 1, 2, True, None, True),
    (2, 1, 4096, 8, 2, 2, False, None, False),
    (2, 1, 4096, 8, 2, 4, True, ("full", "uniform", 1), True),
    (2, 1, 2048, 8, 1, 4, False, ("full", "uniform", 1), False),
    (2, 1, 4096, 8, 1, 4, True, None, False),
    (4, 1, 2048, 8, 2, 2, True, ("selective", None, None), False),
]


def row(layers, b, s, world, ep, etp, dist_opt, recompute, snapshot):
    model, config = Q30
    mega = {"distributed_optimizer": dist_opt, "expert_model_parallel_size": ep, "expert_tensor_parallel_size": etp}
    rc = recompute_keys(mega, recompute)
    tag = "do" if dist_opt else "nodo"
    rid = f"megatron-etp/q30-L{layers}/bs{b}/s{s}/w{world}-ep{ep}-etp{etp}-{tag}/{rc}"
    parallel = {"strategy": "ddp", "world_size": world, "tp": 1, "framework": "megatron"}
    return line(rid, model, config, layers, b, s, parallel, mega, snapshot)


out = Path(__file__).resolve().parents[1] / "specs.jsonl"
out.write_text("".join(json.dumps(row(*r)) + "\n" for r in ROWS))
print(out, len(ROWS))
