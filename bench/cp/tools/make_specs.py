"""Writes bench/cp/specs.jsonl: context-parallel layouts (torchtitan's: ring attention over SDPA, FSDP2 over
dp x cp, optionally tensor parallelism with or without sequence parallelism) of three 7-8B models cut to 4 layers at
their real widths, at 16k to 64k tokens, each measured as rank 0 of its world under torch's fake process group."""

import json
from pathlib import Path

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
MP = {"param_dtype": "bf16", "reduce_dtype": "fp32"}
# model, world, cp, tp, sp, batch, seq, checkpointing, FSDP2 mixed-precision policy (fp32 masters)
LAYOUTS = [
    ("l8b", 4, 2, 1, False, 1, 16384, True, False),
    ("l8b", 8, 4, 1, False, 1, 32768, True, False),
    ("l8b", 8, 8, 1, False, 1, 65536, True, False),
    ("l8b", 16, 4, 2, True, 1, 32768, True, False),
    ("l8b", 8, 4, 1, False, 2, 16384, True, True),
    ("q7b", 8, 2, 2, False, 1, 16384, False, False),
    ("q3-8b", 32, 8, 4, True, 1, 65536, True, False),
    ("q3-8b", 16, 8, 1, False, 1, 32768, False, False),
]
SNAPSHOTS = (1, 3, 5)  # rows that keep a memory history


def line_of(key, world, cp, tp, sp, batch, seq, gc, mp):
    model, config = MODELS[key]
    parallel = {"strategy": "fsdp", "world_size": world, "cp": cp}
    if tp > 1:
        parallel.update({"tp": tp, "sequence_parallel": sp})
    if mp:
        parallel["mixed_precision"] = MP
    spec = {
        "model": model,
        "model_config": {**config, "num_hidden_layers": 4, "tie_word_embeddings": False},
        "precision": "fp32" if mp else "bf16",
        "optimizer": "adamw",
        "batch_size": batch,
        "seq_len": seq,
        "gradient_checkpointing": gc,
        "parallel": parallel,
    }
    layout = f"w{world}-cp{cp}" + (f"-tp{tp}" if tp > 1 else "") + ("-sp" if sp else "")
    row_id = f"cp/{key}-L4/bs{batch}/s{seq}/{'gc' if gc else 'nogc'}/{layout}/fsdp" + ("-mp" if mp else "")
    return {"id": row_id, "spec": spec, "fake": True}


lines = [line_of(*layout) for layout in LAYOUTS]
for i in SNAPSHOTS:
    lines[i]["snapshot"] = lines[i]["id"].replace("/", "-") + ".pickle"
here = Path(__file__).resolve().parent
here.parent.joinpath("specs.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
