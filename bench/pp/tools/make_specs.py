"""Writes bench/pp/specs.jsonl: pipeline-parallel runs (torch.distributed.pipelining's 1F1B, interleaved 1F1B and
GPipe schedules over an HF decoder split as torchtitan splits it) of three 7-8B models cut to 4-8 layers at their
real widths, each measured as one rank of its pipeline (the first, the last, or one between) under torch's fake
process group."""

import json
from pathlib import Path

# bench/tp's models at their real widths
MODELS = {
    "l8b": ("llama-3.1-8b", {"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
                              "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                              "vocab_size": 128256, "rope_theta": 500000.0}),
    "q7b": ("qwen2.5-7b", {"model_type": "qwen2", "hidden_size": 3584, "intermediate_size": 18944,
                            "num_attention_heads": 28, "num_key_value_heads": 4, "head_dim": 128,
                            "vocab_size": 152064, "rope_theta": 1000000.0}),
    "q3-8b": ("qwen3-8b", {"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288,
                            "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
                            "vocab_size": 151936, "rope_theta": 1000000.0}),
}

# model, layers, pp, schedule, vpp, microbatches, layers_per_stage, batch, seq, checkpointing, precision, ranks
# (in the order they run, three at a time on one GPU: large and small runs alternate)
RUNS = [
    ("l8b", 4, 2, "gpipe", 1, 4, None, 4, 1024, False, "amp-bf16", [1]),
    ("l8b", 8, 4, "1f1b", 1, 8, None, 8, 2048, True, "bf16", [1, 0]),
    ("l8b", 4, 2, "gpipe", 1, 4, None, 4, 1024, False, "amp-bf16", [0]),
    ("q3-8b", 8, 4, "interleaved-1f1b", 2, 8, None, 8, 2048, True, "bf16", [0]),
    ("q7b", 8, 2, "interleaved-1f1b", 2, 4, None, 4, 2048, False, "bf16", [1]),
    ("l8b", 4, 2, "1f1b", 1, 4, None, 4, 4096, False, "bf16", [0]),
    ("q7b", 6, 2, "1f1b", 1, 2, [4, 2], 2, 2048, True, "bf16", [0]),
    ("l8b", 8, 4, "1f1b", 1, 8, None, 8, 2048, True, "bf16", [3]),
    ("q7b", 8, 2, "interleaved-1f1b", 2, 4, None, 4, 2048, False, "bf16", [0]),
    ("q3-8b", 8, 4, "interleaved-1f1b", 2, 8, None, 8, 2048, True, "bf16", [3]),
    ("l8b", 4, 2, "1f1b", 1, 4, None, 4, 4096, False, "bf16", [1]),
    ("q7b", 6, 2, "1f1b", 1, 2, [4, 2], 2, 2048, True, "bf16", [1]),
]
# Allocator histories of the runs the model is least sure of: interleaving's last rank, a middle 1F1B rank.
SNAPSHOTS = {("q3-8b", 3), ("l8b", 1)}


def line_of(key, layers, pp, schedule, vpp, mb, split, batch, seq, gc, precision, rank):
    model, config = MODELS[key]
    parallel = {"strategy": "none", "world_size": pp, "pp": pp, "schedule": schedule, "microbatches": mb}
    if schedule == "interleaved-1f1b":
        parallel["vpp"] = vpp
    if split:
        parallel["layers_per_stage"] = split
    spec = {
        "model": model,
        "model_config": {**config, "num_hidden_layers": layers, "tie_word_embeddings": False},
        "precision": precision,
        "optimizer": "adamw",
        "batch_size": batch,
        "seq_len": seq,
        "gradient_checkpointing": gc,
        "parallel": parallel,
    }
    name = schedule.replace("interleaved-1f1b", f"i1f1b-v{vpp}")
    split_name = "-split" + "-".join(map(str, split)) if split else ""
    row_id = (
        f"pp/{key}-L{layers}/bs{batch}/s{seq}/{'gc' if gc else 'nogc'}/{precision}/pp{pp}-{name}-mb{mb}{split_name}"
        f"/rank{rank}"
    )
    line = {"id": row_id, "spec": spec, "fake": True, "rank": rank}
    if (key, rank) in SNAPSHOTS and pp == 4:
        line["snapshot"] = row_id.replace("/", "_") + ".pickle"
    return line


def main():
    out = Path(__file__).resolve().parents[1] / "specs.jsonl"
    lines = [json.dumps(line_of(*run[:-1], rank)) for run in RUNS for rank in run[-1]]
    out.write_text("\n".join(lines) + "\n")
    print(f"{len(lines)} lines to {out}")


if __name__ == "__main__":
    main()
