"""Writes bench/megatron-moe/specs.jsonl: Megatron-core MoE rows (local layer spec, MoEAlltoAllTokenDispatcher,
SequentialMLP, balanced routing) as rank 0 of a fake world, tp 1 (Megatron's MoELayer needs sequence parallelism
with tp > 1, which the local spec refuses)."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "megatron" / "tools"))
from rows import MOE_MODELS as MODELS, line, recompute_keys  # noqa: E402

# (model, layers, batch, seq, world, ep, distributed optimizer, recompute (granularity, method, layers), snapshot)
ROWS = [
    ("q30", 2, 1, 4096, 8, 1, True, None, True),
    ("q235", 1, 1, 2048, 16, 8, False, ("full", "uniform", 1), False),
    ("q30", 2, 1, 4096, 4, 4, False, None, True),
    ("q235", 1, 1, 4096, 64, 8, True, None, True),
    ("q30", 4, 1, 2048, 16, 2, True, ("selective", None, None), False),
    ("q30", 2, 2, 2048, 8, 8, True, ("full", "uniform", 1), True),
    ("q30", 4, 1, 4096, 64, 8, False, ("full", "block", 2), False),
    ("q235", 2, 1, 2048, 32, 16, True, ("selective", None, None), False),
    ("q30", 2, 1, 2048, 32, 4, True, ("selective", None, None), False),
    ("q30", 2, 1, 2048, 2, 2, False, None, False),
]


def row(key, layers, b, s, world, ep, dist_opt, recompute, snapshot):
    model, config = MODELS[key]
    mega = {"distributed_optimizer": dist_opt, "expert_model_parallel_size": ep}
    rc = recompute_keys(mega, recompute)
    tag = "do" if dist_opt else "nodo"
    rid = f"megatron-moe/{key}-L{layers}/bs{b}/s{s}/w{world}-ep{ep}-{tag}/{rc}"
    parallel = {"strategy": "ddp", "world_size": world, "tp": 1, "framework": "megatron"}
    return line(rid, model, config, layers, b, s, parallel, mega, snapshot)


out = Path(__file__).resolve().parents[1] / "specs.jsonl"
out.write_text("".join(json.dumps(row(*r)) + "\n" for r in ROWS))
print(out, len(ROWS))
