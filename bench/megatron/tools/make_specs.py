"""Writes bench/megatron/specs.jsonl: Megatron-core GPTModel rows (local layer spec) as rank 0 of a fake world."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "megatron" / "tools"))
from rows import DENSE_MODELS as MODELS, line, recompute_keys  # noqa: E402

# (model, layers, batch, seq, world, tp, distributed optimizer, recompute (granularity, method, layers), snapshot)
# Call 1 took snapshots of rows 4, 6 and 9; call 2 (every row again, the harness moving the model to the GPU
# before Float16Module as Megatron-LM does) of rows 1, 7 and 12.
ROWS = [
    ("l8b", 2, 1, 2048, 1, 1, False, None, True),
    ("l8b", 2, 1, 2048, 4, 1, True, ("full", "uniform", 1), False),
    ("l8b", 4, 1, 2048, 2, 2, False, None, False),
    ("l8b", 4, 2, 2048, 8, 2, True, ("selective", None, None), False),
    ("l8b", 4, 1, 4096, 4, 4, False, ("selective", None, None), False),
    ("l8b", 4, 2, 4096, 16, 4, True, ("full", "uniform", 1), False),
    ("l8b", 4, 2, 2048, 8, 8, False, ("full", "block", 2), True),
    ("l8b", 4, 1, 4096, 64, 8, True, None, False),
    ("q7b", 4, 1, 2048, 8, 4, True, None, False),
    ("q3-8b", 4, 1, 2048, 16, 2, True, ("selective", None, None), False),
    ("q3-8b", 4, 2, 4096, 32, 8, False, ("full", "uniform", 2), False),
    ("q7b", 4, 1, 4096, 2, 2, False, ("full", "block", 1), True),
]


def row(key, layers, b, s, world, tp, dist_opt, recompute, snapshot):
    model, config = MODELS[key]
    mega = {"distributed_optimizer": dist_opt}
    rc = recompute_keys(mega, recompute)
    tag = "do" if dist_opt else "nodo"
    rid = f"megatron/{key}-L{layers}/bs{b}/s{s}/w{world}-tp{tp}-{tag}/{rc}"
    parallel = {"strategy": "ddp", "world_size": world, "tp": tp, "framework": "megatron"}
    return line(rid, model, config, layers, b, s, parallel, mega, snapshot)


# The largest rows (tp 1 and 2) are kept apart: two run on the GPU at a time.
out = Path(__file__).resolve().parents[1] / "specs.jsonl"
out.write_text("".join(json.dumps(row(*r)) + "\n" for r in ROWS))
print(out, len(ROWS))
