"""Writes bench/ep/specs.jsonl: transformers 5.17's expert parallelism (`parallel.ep`: the config's
`base_model_ep_plan` through `maybe_distribute_model`) on a Qwen3-MoE and a Mixtral model cut to a few layers
at their real widths, each measured as rank 0 of its world under torch's fake process group."""

import json
from pathlib import Path

QWEN3 = {"model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
         "num_hidden_layers": 4, "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
         "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True, "decoder_sparse_step": 1,
         "mlp_only_layers": [], "vocab_size": 151936, "tie_word_embeddings": False, "max_position_embeddings": 40960,
         "rope_theta": 1000000.0, "rms_norm_eps": 1e-06, "hidden_act": "silu", "attention_bias": False,
         "use_sliding_window": False, "sliding_window": None, "output_router_logits": False,
         "router_aux_loss_coef": 0.001}
MIXTRAL = {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 2,
           "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
           "vocab_size": 32000, "tie_word_embeddings": False, "max_position_embeddings": 32768,
           "rope_theta": 1000000.0, "rms_norm_eps": 1e-05, "hidden_act": "silu", "sliding_window": None,
           "output_router_logits": False, "router_aux_loss_coef": 0.02}
QWEN2 = {"model_type": "qwen2_moe", "hidden_size": 3584, "intermediate_size": 18944, "moe_intermediate_size": 2560,
         "shared_expert_intermediate_size": 20480, "num_hidden_layers": 2, "num_attention_heads": 28,
         "num_key_value_heads": 4, "num_experts": 64, "num_experts_per_tok": 8, "norm_topk_prob": False,
         "decoder_sparse_step": 1, "mlp_only_layers": [], "qkv_bias": True, "vocab_size": 151936,
         "tie_word_embeddings": False, "max_position_embeddings": 131072, "rope_theta": 1000000.0,
         "rms_norm_eps": 1e-06, "hidden_act": "silu", "use_sliding_window": False, "sliding_window": 131072,
         "max_window_layers": 28, "output_router_logits": False, "router_aux_loss_coef": 0.001}
# key: (catalog model, model_config or None for the catalog's own, all layers)
MODELS = {"q3moe-L4": ("qwen3-30b-a3b", QWEN3), "mixtral-L2": ("mixtral-8x7b", MIXTRAL),
          "q2moe-57b-L2": ("qwen2-57b-a14b", QWEN2), "olmoe-L16": ("olmoe-1b-7b", None)}
LORA = {"r": 16, "alpha": 32, "targets": ["q_proj", "k_proj", "v_proj", "o_proj"], "dropout": 0.0}
# model, ep, batch, seq, checkpointing, lora, snapshot
LAYOUTS = [
    ("q3moe-L4", 2, 1, 4096, False, False, True),
    ("q3moe-L4", 4, 2, 4096, True, False, False),
    ("q3moe-L4", 8, 1, 4096, False, False, False),
    ("q3moe-L4", 8, 1, 8192, True, False, False),
    ("q3moe-L4", 4, 2, 4096, True, True, False),
    ("mixtral-L2", 2, 1, 4096, False, False, False),
    ("mixtral-L2", 4, 2, 4096, True, False, False),
    ("mixtral-L2", 8, 2, 4096, False, False, True),
]

# Measured in a second call (specs-call2.jsonl), predicted before it (predicted-before-measuring-call2.txt): two more
# families, the batched_mm experts, and the LoRA row again under the harness that counts the base model in `params`.
LAYOUTS_CALL2 = [
    ("olmoe-L16", 4, 1, 4096, False, False, True),
    ("q2moe-57b-L2", 4, 1, 4096, True, False, False),
    ("q3moe-L4", 2, 1, 64, False, False, False, "batched_mm"),
    ("q3moe-L4", 4, 2, 4096, True, True, False),
    ("mixtral-L2", 2, 2, 4096, True, True, False),
]


def line_of(key, ep, batch, seq, gc, lora, snapshot, experts=None):
    model, config = MODELS[key]
    spec = {
        "model": model,
        **({"model_config": config} if config else {}),
        "attention": "sdpa",
        "precision": "bf16",
        "optimizer": "adamw" if lora else "adamw-forloop",
        "batch_size": batch,
        "seq_len": seq,
        "gradient_checkpointing": gc,
        "parallel": {"strategy": "none", "world_size": ep, "ep": ep},
    }
    if lora:
        spec["lora"] = LORA
    if experts:
        spec["experts_implementation"] = experts
    row_id = f"ep/{key}/bs{batch}/s{seq}/{'gc' if gc else 'nogc'}/ep{ep}" + ("/lora-attn" if lora else "")
    row_id += f"/{experts}" if experts else ""
    line = {"id": row_id, "spec": spec, "fake": True}
    if snapshot:
        line["snapshot"] = row_id.replace("/", "_") + ".pickle"
    return line


if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    (here.parent / "specs.jsonl").write_text("".join(json.dumps(line_of(*layout)) + "\n" for layout in LAYOUTS))
    (here / "specs-call2.jsonl").write_text("".join(json.dumps(line_of(*l)) + "\n" for l in LAYOUTS_CALL2))
