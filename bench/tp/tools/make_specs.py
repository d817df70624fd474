"""Writes bench/tp/specs.jsonl: tensor-parallel layouts (torchtitan's plan, with and without sequence
parallelism, alone or under FSDP2 over the data-parallel dimension) of three 7-8B models cut to 4 layers at
their real widths, each measured as rank 0 of its world under torch's fake process group."""

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
# model, strategy, world, tp, sp, batch, seq, checkpointing, FSDP2 mixed-precision policy (fp32 masters)
LAYOUTS = [
    ("l8b", "none", 2, 2, False, 1, 4096, False, False),
    ("l8b", "none", 2, 2, True, 1, 4096, False, False),
    ("l8b", "fsdp", 8, 4, True, 2, 4096, False, False),
    ("l8b", "fsdp", 8, 4, False, 2, 4096, False, False),
    ("l8b", "fsdp", 16, 8, True, 2, 4096, True, False),
    ("l8b", "fsdp", 64, 8, False, 1, 8192, True, False),
    ("l8b", "fsdp", 16, 4, True, 4, 2048, True, True),
    ("q7b", "fsdp", 4, 2, False, 2, 2048, False, False),
    ("q7b", "fsdp", 8, 4, True, 2, 4096, True, False),
    ("q7b", "none", 4, 4, True, 1, 4096, False, False),
    ("q3-8b", "fsdp", 8, 2, True, 2, 4096, True, False),
    ("q3-8b", "none", 8, 8, False, 2, 2048, False, False),
    ("q3-8b", "fsdp", 32, 4, True, 1, 8192, False, True),
    ("q3-8b", "fsdp", 16, 8, True, 4, 4096, True, False),
]

# Measured in a second call (specs-call2.jsonl), predicted before it (predicted-before-measuring-call2.txt).
LAYOUTS_CALL2 = [
    ("l8b", "fsdp", 16, 8, True, 2, 4096, False, False),
    ("l8b", "fsdp", 8, 4, True, 2, 4096, True, False),
    ("q7b", "fsdp", 8, 2, True, 4, 4096, True, False),
    ("q3-8b", "fsdp", 16, 4, False, 2, 4096, True, False),
]


def lines_of(layouts):
    lines = []
    for key, strategy, world, tp, sp, batch, seq, gc, mp in layouts:
        lines.append(json.dumps(line_of(key, strategy, world, tp, sp, batch, seq, gc, mp)))
    return lines


def line_of(key, strategy, world, tp, sp, batch, seq, gc, mp):
    model, config = MODELS[key]
    parallel = {"strategy": strategy, "world_size": world, "tp": tp, "sequence_parallel": sp}
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
    row_id = f"tp/{key}-L4/bs{batch}/s{seq}/{'gc' if gc else 'nogc'}/w{world}-tp{tp}{'-sp' if sp else ''}"
    row_id += f"/{strategy}" + ("-mp" if mp else "")
    return {"id": row_id, "spec": spec, "fake": True}


def main():
    lines = lines_of(LAYOUTS)
    for i in (2, 3):  # two rows, with and without sequence parallelism, keep a memory history
        line = json.loads(lines[i])
        line["snapshot"] = line["id"].replace("/", "-") + ".pickle"
        lines[i] = json.dumps(line)
    here = Path(__file__).resolve().parent
    here.parent.joinpath("specs.jsonl").write_text("\n".join(lines) + "\n")
    # Call 2: the new layouts, then the two rows whose reserved the estimate missed again, with a memory history,
    call2 = lines_of(LAYOUTS_CALL2)
    # ... and a tensor-parallel-alone row, whose optimizer step the estimate missed.
    for i in (4, 5, 9):
        line = json.loads(lines[i])
        line["snapshot"] = line["id"].replace("/", "-") + ".pickle"
        call2.append(json.dumps(line))
    here.joinpath("specs-call2.jsonl").write_text("\n".join(call2) + "\n")
    print(len(lines), "specs,", len(call2), "in call 2")


if __name__ == "__main__":
    main()
