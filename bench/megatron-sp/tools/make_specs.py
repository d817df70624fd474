"""Writes bench/megatron-sp/specs.jsonl: bench/megatron's tensor-parallel rows again with sequence parallelism
(Megatron-core GPTModel, local layer spec with torch norms marked sequence_parallel) as rank 0 of a fake world."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "megatron" / "tools"))
from rows import DENSE_MODELS as MODELS, line, recompute_keys  # noqa: E402

# (model, layers, batch, seq, world, tp, distributed optimizer, recompute (granularity, method, layers), snapshot):
# bench/megatron's ten rows with tp > 1, each with sequence_parallel.
ROWS = [
    ("l8b", 4, 1, 2048, 2, 2, False, None, True),
    ("l8b", 4, 2, 2048, 8, 2, True, ("selective", None, None), False),
    ("l8b", 4, 1, 4096, 4, 4, False, ("selective", None, None), False),
    ("l8b", 4, 2, 4096, 16, 4, True, ("full", "uniform", 1), True),
    ("l8b", 4, 2, 2048, 8, 8, False, ("full", "block", 2), False),
    ("l8b", 4, 1, 4096, 64, 8, True, None, False),
    ("q7b", 4, 1, 2048, 8, 4, True, None, False),
    ("q3-8b", 4, 1, 2048, 16, 2, True, ("selective", None, None), False),
    ("q3-8b", 4, 2, 4096, 32, 8, False, ("full", "uniform", 2), True),
    ("q7b", 4, 1, 4096, 2, 2, False, ("full", "block", 1), False),
]


def row(key, layers, b, s, world, tp, dist_opt, recompute, snapshot):
    model, config = MODELS[key]
    mega = {"distributed_optimizer": dist_opt}
    rc = recompute_keys(mega, recompute)
    tag = "do" if dist_opt else "nodo"
    rid = f"megatron-sp/{key}-L{layers}/bs{b}/s{s}/w{world}-tp{tp}-sp-{tag}/{rc}"
    parallel = {"strategy": "ddp", "world_size": world, "tp": tp, "sequence_parallel": True, "framework": "megatron"}
    return line(rid, model, config, layers, b, s, parallel, mega, snapshot)


out = Path(__file__).resolve().parents[1] / "specs.jsonl"
out.write_text("".join(json.dumps(row(*r)) + "\n" for r in ROWS))
print(out, len(ROWS))
