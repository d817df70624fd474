"""Writes bench/megatron-moe-sp/specs.jsonl: Megatron-core MoE rows with tensor and sequence parallelism (local
layer spec with torch norms marked sequence_parallel, MoEAlltoAllTokenDispatcher, SequentialMLP, balanced routing)
as rank 0 of a fake world. Expert tensor parallelism 1 (slime's layout) and left unset (Megatron-LM's default: tp)."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "megatron" / "tools"))
from rows import MOE_MODELS as MODELS, line, recompute_keys  # noqa: E402

# (model, layers, batch, seq, world, tp, ep, etp (None: unset), distributed optimizer, recompute, snapshot)
ROWS = [
    ("q30", 2, 1, 4096, 8, 2, 4, 1, True, None, True),
    ("q30", 2, 1, 4096, 16, 4, 8, 1, True, ("full", "uniform", 1), False),
    ("q30", 2, 2, 2048, 8, 2, 4, 1, False, ("selective", None, None), False),
    ("q30", 2, 1, 4096, 8, 2, 2, None, True, None, False),
    ("q30", 4, 1, 2048, 32, 4, 8, 1, True, ("selective", None, None), False),
    ("q235", 1, 1, 4096, 64, 4, 16, 1, True, ("full", "uniform", 1), True),
]


def row(key, layers, b, s, world, tp, ep, etp, dist_opt, recompute, snapshot):
    model, config = MODELS[key]
    mega = {"distributed_optimizer": dist_opt, "expert_model_parallel_size": ep}
    if etp is not None:
        mega["expert_tensor_parallel_size"] = etp
    rc = recompute_keys(mega, recompute)
    tag = "do" if dist_opt else "nodo"
    experts = f"ep{ep}" + (f"-etp{etp}" if etp is not None else "")
    rid = f"megatron-moe-sp/{key}-L{layers}/bs{b}/s{s}/w{world}-tp{tp}-sp-{experts}-{tag}/{rc}"
    parallel = {"strategy": "ddp", "world_size": world, "tp": tp, "sequence_parallel": True,
                "framework": "megatron"}
    return line(rid, model, config, layers, b, s, parallel, mega, snapshot)


out = Path(__file__).resolve().parents[1] / "specs.jsonl"
out.write_text("".join(json.dumps(row(*r)) + "\n" for r in ROWS))
print(out, len(ROWS))
