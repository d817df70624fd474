"""Writes bench/tp-hf/specs.jsonl: transformers 5.17's own tensor parallelism (`parallel.framework:
transformers`: `DistributedConfig(tp_size=tp)` through `maybe_distribute_model`, the config's
`base_model_tp_plan` and the head's `colwise_gather_output`) on Llama-3.1-8B, Qwen2.5-7B, Qwen3-8B and
Llama-3.1-70B cut to a few layers at their real widths, each measured as rank 0 of its world under torch's fake
process group."""

import json
from pathlib import Path

MODELS = {
    "l8b-L4": ("llama-3.1-8b", {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
                                 "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                                 "vocab_size": 128256, "rope_theta": 500000.0, "num_hidden_layers": 4,
                                 "tie_word_embeddings": False}),
    "q7b-L4": ("qwen2.5-7b", {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
                               "num_attention_heads": 28, "num_key_value_heads": 4, "head_dim": 128,
                               "vocab_size": 152064, "rope_theta": 1000000.0, "num_hidden_layers": 4,
                               "tie_word_embeddings": False}),
    "q3-8b-L4": ("qwen3-8b", {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
                               "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                               "vocab_size": 151936, "rope_theta": 1000000.0, "num_hidden_layers": 4,
                               "tie_word_embeddings": False}),
    "l70b-L2": ("llama-3.1-70b", {"model_type": "llama", "hidden_size": 8192, "intermediate_size": 28672,
                                   "num_attention_heads": 64, "num_key_value_heads": 8, "head_dim": 128,
                                   "vocab_size": 128256, "rope_theta": 500000.0, "num_hidden_layers": 2,
                                   "tie_word_embeddings": False}),
}
# model, tp, batch, seq, checkpointing, snapshot
LAYOUTS = [
    ("l8b-L4", 2, 1, 4096, False, True),
    ("l8b-L4", 4, 2, 4096, True, False),
    ("l8b-L4", 8, 1, 8192, True, False),
    ("l8b-L4", 8, 4, 2048, False, False),
    ("q7b-L4", 2, 2, 4096, False, False),
    ("q7b-L4", 4, 1, 8192, True, False),
    ("q3-8b-L4", 4, 2, 4096, False, True),
    ("q3-8b-L4", 2, 1, 8192, True, False),
    ("l70b-L2", 8, 1, 4096, False, False),
]


def line_of(key, tp, batch, seq, gc, snapshot):
    model, config = MODELS[key]
    spec = {
        "model": model,
        "model_config": config,
        "attention": "sdpa",
        "precision": "bf16",
        "optimizer": "adamw-forloop",
        "batch_size": batch,
        "seq_len": seq,
        "gradient_checkpointing": gc,
        "parallel": {"strategy": "none", "world_size": tp, "tp": tp, "framework": "transformers"},
    }
    row_id = f"tp-hf/{key}/bs{batch}/s{seq}/{'gc' if gc else 'nogc'}/tp{tp}"
    line = {"id": row_id, "spec": spec, "fake": True}
    if snapshot:
        line["snapshot"] = row_id.replace("/", "_") + ".pickle"
    return line


if __name__ == "__main__":
    here = Path(__file__).resolve().parent
    lines = [json.dumps(line_of(*layout)) for layout in LAYOUTS]
    (here.parent / "specs.jsonl").write_text("\n".join(lines) + "\n")
