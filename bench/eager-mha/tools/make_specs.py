"""Writes bench/eager-mha/specs.jsonl: eager attention where each query head has its own key head (MHA), whose values
(and, without a rotary embedding, queries) matmul copies: GPT-2 (fused c_attn, no rotary), Llama-2 (separate
projections), Phi-3 (fused qkv_proj, rotary by cat), single-GPU runs of the measuring loop."""
import json
from pathlib import Path

MODELS = json.loads((Path(__file__).resolve().parents[3] / "crates/headroom/data/models.json").read_text())["models"]


def spec(model, layers, precision, batch, seq, **extra):
    config = dict(MODELS[model], num_hidden_layers=layers)
    out = {"model": model, "model_config": config, "precision": precision, "optimizer": "adamw",
           "batch_size": batch, "seq_len": seq, "attention": "eager", **extra}
    return out


ROWS = [
    ("gpt2/bf16/bs4/s1024", spec("gpt2", 12, "bf16", 4, 1024)),
    ("gpt2-medium/amp_bf16/bs4/s1024", spec("gpt2-medium", 24, "amp-bf16", 4, 1024)),
    ("llama-2-7b-L4/bf16/bs2/s1024/lora16", spec("llama-2-7b", 4, "bf16", 2, 1024,
                                                  lora={"r": 16, "alpha": 32, "targets": "all-linear"})),
    ("phi-3-mini-L8/bf16/bs2/s2048", spec("phi-3-mini", 8, "bf16", 2, 2048)),
]
out = Path(__file__).resolve().parents[1] / "specs.jsonl"
out.write_text("".join(json.dumps({"id": f"eager-mha/{rid}", "spec": s}) + "\n" for rid, s in ROWS))
print(out, len(ROWS))
