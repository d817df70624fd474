"""Writes bench/parallel-holdout/specs.jsonl: torch-native layouts (torchtitan's tensor-parallel plan, torch's ring
context parallelism, torch.distributed.pipelining, FSDP2 inside pipelines, transformers' tp_plan and expert
parallelism) in combinations no row measured before: other models (Mistral-7B-v0.3, Qwen2.5-7B's biases, Qwen3-8B's
q/k norms, Mixtral) at other sizes, three stages, GPipe under autocast, FSDP2 mixed precision beside tensor and
context parallelism. Every line is a fake-group rank."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "megatron" / "tools"))
from rows import DENSE_MODELS, MORE_MODELS  # noqa: E402

MODELS = {
    **DENSE_MODELS,
    "m7b": MORE_MODELS["m7b"],
    # transformers' MixtralConfig as bench/ep writes it (its harness builds the HF model).
    "mx7": ("mixtral-8x7b", {"model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336,
            "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
            "vocab_size": 32000, "tie_word_embeddings": False, "max_position_embeddings": 32768,
            "rope_theta": 1000000.0, "rms_norm_eps": 1e-05, "hidden_act": "silu", "sliding_window": None,
            "output_router_logits": False, "router_aux_loss_coef": 0.02}),
}
MP = {"param_dtype": "bf16", "reduce_dtype": "fp32"}

# (model, layers, batch, seq, checkpointing, precision, parallel, ranks, extra spec keys)
ROWS = [
    ("m7b", 4, 2, 2048, False, "bf16", {"strategy": "none", "world_size": 4, "tp": 4, "sequence_parallel": True}, [0], {}),
    ("q3-8b", 4, 2, 4096, True, "fp32", {"strategy": "fsdp", "world_size": 8, "tp": 2, "sequence_parallel": False,
                                        "mixed_precision": MP}, [0], {}),
    ("m7b", 4, 1, 32768, True, "bf16", {"strategy": "fsdp", "world_size": 4, "cp": 4}, [0, 3], {}),
    ("q7b", 4, 1, 32768, True, "bf16", {"strategy": "fsdp", "world_size": 16, "cp": 4, "tp": 2,
                                       "sequence_parallel": True}, [0], {}),
    ("l8b", 4, 1, 16384, False, "fp32", {"strategy": "fsdp", "world_size": 8, "cp": 2, "mixed_precision": MP,
                                        "reshard_after_forward": False}, [0], {}),
    ("q3-8b", 6, 6, 1024, False, "bf16", {"strategy": "none", "world_size": 3, "pp": 3, "schedule": "1f1b",
                                         "microbatches": 6}, [0, 1, 2], {}),
    ("m7b", 8, 4, 2048, True, "bf16", {"strategy": "none", "world_size": 2, "pp": 2, "vpp": 2,
                                      "schedule": "interleaved-1f1b", "microbatches": 4}, [0, 1], {}),
    ("q7b", 4, 2, 2048, True, "amp-bf16", {"strategy": "none", "world_size": 2, "pp": 2, "schedule": "gpipe",
                                          "microbatches": 2}, [0, 1], {}),
    ("q3-8b", 8, 4, 2048, False, "bf16", {"strategy": "fsdp", "world_size": 4, "pp": 2, "schedule": "1f1b",
                                         "microbatches": 4, "reshard_after_forward": True, "units": "layers"},
     [0, 2], {}),
    ("m7b", 8, 4, 1024, True, "bf16", {"strategy": "fsdp", "world_size": 8, "pp": 2, "tp": 2, "schedule": "1f1b",
                                      "microbatches": 4, "reshard_after_forward": False, "units": "layers"},
     [0, 4], {}),
    ("q7b", 4, 1, 4096, True, "bf16", {"strategy": "none", "world_size": 4, "tp": 4, "framework": "transformers"},
     [0], {"attention": "sdpa", "optimizer": "adamw-forloop"}),
    ("q3-8b", 4, 2, 2048, False, "bf16", {"strategy": "none", "world_size": 2, "tp": 2,
                                         "framework": "transformers"}, [0], {"attention": "sdpa",
                                                                            "optimizer": "adamw-forloop"}),
    ("mx7", 2, 1, 4096, True, "bf16", {"strategy": "none", "world_size": 2, "ep": 2}, [0],
     {"attention": "sdpa", "optimizer": "adamw-forloop"}),
]


def tag(p: dict) -> str:
    out = [f"w{p['world_size']}"]
    for key in ("tp", "cp", "pp", "vpp", "ep"):
        if p.get(key, 1) > 1:
            out.append(f"{key}{p[key]}")
    if p.get("sequence_parallel"):
        out.append("sp")
    if "schedule" in p:
        out.append({"1f1b": "1f1b", "interleaved-1f1b": "i1f1b", "gpipe": "gpipe"}[p["schedule"]] + f"-mb{p['microbatches']}")
    if p.get("framework") == "transformers":
        out.append("hf")
    if "mixed_precision" in p:
        out.append("mp")
    if p.get("reshard_after_forward") is False:
        out.append("noreshard")
    return "-".join(out) + "/" + p["strategy"]


lines = []
for key, layers, b, s, gc, precision, parallel, ranks, extra in ROWS:
    model, config = MODELS[key]
    spec = {"model": model, "model_config": {**config, "num_hidden_layers": layers}, "precision": precision,
            "optimizer": "adamw", "batch_size": b, "seq_len": s, "gradient_checkpointing": gc, "parallel": parallel,
            **extra}
    for rank in ranks:
        staged = len(ranks) > 1 or rank
        rid = f"parallel-holdout/{key}-L{layers}/bs{b}/s{s}/{'gc' if gc else 'nogc'}/{precision}/{tag(parallel)}"
        line = {"id": rid + (f"/rank{rank}" if staged else ""), "spec": spec, "fake": True, "rank": rank}
        lines.append(json.dumps(line))
out = Path(__file__).resolve().parents[1] / "specs.jsonl"
out.write_text("".join(l + "\n" for l in lines))
print(out, len(lines))
