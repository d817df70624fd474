"""Writes bench/pp/specs-fsdp.jsonl (and specs-fsdp-call2.jsonl: tensor parallelism under it, and one run again
with its allocator history): torchtitan's PP x FSDP2 (each stage `fully_shard`ed over the data-parallel
mesh dimension of a `(pp, dp)` mesh, driven by torch.distributed.pipelining's schedules) of Llama-3.2-3B and
Qwen2.5-1.5B at their real widths with untied heads, cut to 8 layers, each measured as one rank (the first
pipeline stage's or the last's) under torch's fake process group."""

import json
from pathlib import Path

MODELS = {
    "l3b": ("llama-3.2-3b", {"model_type": "llama", "hidden_size": 3072, "intermediate_size": 8192,
                              "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128,
                              "vocab_size": 128256, "rope_theta": 500000.0}),
    "q1.5b": ("qwen2.5-1.5b", {"model_type": "qwen2", "hidden_size": 1536, "intermediate_size": 8960,
                                "num_attention_heads": 12, "num_key_value_heads": 2, "head_dim": 128,
                                "vocab_size": 151936, "rope_theta": 1000000.0}),
}
MP = {"param_dtype": "bf16", "reduce_dtype": "fp32"}

# model, pp, dp, schedule, microbatches, batch, seq, checkpointing, precision, policy, reshard_after_forward, units,
# ranks (global: pipeline rank r // (dp x tp)), tp
RUNS = [
    ("l3b", 2, 4, "1f1b", 4, 4, 2048, False, "bf16", None, False, "layers", [0, 7]),
    ("l3b", 4, 2, "1f1b", 8, 8, 1024, True, "bf16", None, True, "layers", [0, 7]),
    ("l3b", 2, 2, "interleaved-1f1b", 4, 4, 2048, False, "bf16", None, False, "accelerate", [0, 3]),
    ("q1.5b", 2, 8, "1f1b", 4, 4, 2048, False, "fp32", MP, False, "accelerate", [0, 15]),
    ("l3b", 4, 2, "interleaved-1f1b", 8, 8, 1024, True, "fp32", MP, False, "layers", [6]),
]
# The second call: torchtitan's tensor-parallel plan (without sequence parallelism) under FSDP2 within the stages on a
# (pp, dp, tp) mesh, and the first rank of pp 4 with reshard_after_forward again, with its allocator history.
RUNS_CALL2 = [
    ("l3b", 2, 2, "1f1b", 4, 4, 2048, False, "bf16", None, False, "layers", [0, 7], 2),
    ("l3b", 2, 2, "interleaved-1f1b", 4, 4, 2048, True, "fp32", MP, False, "accelerate", [7], 2),
    ("l3b", 4, 2, "1f1b", 8, 8, 1024, True, "bf16", None, True, "layers", [0], 1),
]
# Allocator histories: the interleaved schedule's explicit unshard, the policy's fp32 accumulation.
SNAPSHOTS = {(2, 0), (3, 15), (5, 7), (7, 0)}


def line_of(i, key, pp, dp, schedule, mb, batch, seq, gc, precision, policy, raf, units, rank, tp=1):
    model, config = MODELS[key]
    parallel = {"strategy": "fsdp", "world_size": pp * dp * tp, "pp": pp, "schedule": schedule, "microbatches": mb,
                "reshard_after_forward": raf, "units": units}  # fmt: skip
    if tp > 1:
        parallel["tp"] = tp
    if schedule == "interleaved-1f1b":
        parallel["vpp"] = 2
    if policy:
        parallel["mixed_precision"] = policy
    spec = {
        "model": model,
        "model_config": {**config, "num_hidden_layers": 8, "tie_word_embeddings": False},
        "precision": precision,
        "optimizer": "adamw",
        "batch_size": batch,
        "seq_len": seq,
        "gradient_checkpointing": gc,
        "parallel": parallel,
    }
    name = schedule.replace("interleaved-1f1b", "i1f1b-v2")
    prec = "mp-bf16-fp32" if policy else precision
    row_id = (
        f"pp-fsdp/{key}-L8/bs{batch}/s{seq}/{'gc' if gc else 'nogc'}/{prec}/pp{pp}-dp{dp}{f'-tp{tp}' if tp > 1 else ''}"
        f"-{name}-mb{mb}"
        f"/raf-{str(raf).lower()}-{units}/rank{rank}"
    )
    line = {"id": row_id, "spec": spec, "fake": True, "rank": rank}
    if (i, rank) in SNAPSHOTS:
        line["snapshot"] = row_id.replace("/", "_") + ".pickle"
    return line


def main():
    here = Path(__file__).resolve().parents[1]
    for name, runs, first in [("specs-fsdp.jsonl", RUNS, 0), ("specs-fsdp-call2.jsonl", RUNS_CALL2, len(RUNS))]:
        lines = [
            json.dumps(line_of(first + i, *run[:12], rank, *run[13:])) for i, run in enumerate(runs) for rank in run[12]
        ]
        (here / name).write_text("\n".join(lines) + "\n")
        print(f"{len(lines)} lines to {here / name}")


if __name__ == "__main__":
    main()
