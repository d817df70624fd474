"""Writes bench/megatron-pp/specs.jsonl: Megatron-core pipeline ranks (1F1B, local layer spec), each one rank of
a fake world: the line's `rank` is the global rank the fake process group is initialised with, so the process is
pipeline rank `rank // (world / pp)` (Megatron's rank order tp-cp-ep-dp-pp)."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "megatron" / "tools"))
from rows import DENSE_MODELS, line, recompute_keys  # noqa: E402

MODELS = {key: DENSE_MODELS[key] for key in ("l8b", "q7b")}
# (model, layers, batch, seq, world, tp, pp, microbatches, layers_per_stage, distributed optimizer,
#  recompute (granularity, method, layers), rank, snapshot)
ROWS = [
    ("l8b", 8, 4, 1024, 2, 1, 2, 4, None, False, None, 0, True),
    ("l8b", 8, 8, 1024, 8, 1, 4, 8, None, True, ("selective", None, None), 0, False),
    ("l8b", 8, 8, 1024, 8, 1, 4, 8, None, True, ("selective", None, None), 2, True),
    ("l8b", 8, 4, 1024, 2, 1, 2, 4, None, False, None, 1, False),
    ("l8b", 8, 4, 2048, 16, 2, 4, 4, None, True, ("full", "uniform", 1), 12, False),
    ("q7b", 8, 6, 2048, 8, 2, 2, 6, None, True, ("selective", None, None), 0, False),
    ("q7b", 8, 6, 2048, 8, 2, 2, 6, None, True, ("selective", None, None), 4, False),
    ("l8b", 4, 2, 2048, 4, 1, 4, 2, None, False, None, 1, False),
    ("q7b", 8, 8, 1024, 8, 2, 4, 8, None, False, None, 4, False),
    ("q7b", 6, 5, 1024, 8, 1, 2, 5, [2, 4], True, ("full", "block", 1), 4, False),
]


def row(key, layers, b, s, world, tp, pp, mb, split, dist_opt, recompute, rank, snapshot):
    model, config = MODELS[key]
    mega = {"distributed_optimizer": dist_opt}
    rc = recompute_keys(mega, recompute)
    tag = "do" if dist_opt else "nodo"
    parallel = {"strategy": "ddp", "world_size": world, "tp": tp, "framework": "megatron", "pp": pp,
                "microbatches": mb}
    shape = f"pp{pp}-mb{mb}"
    if split:
        parallel["layers_per_stage"] = split
        shape += "-split" + "-".join(map(str, split))
    rid = f"megatron-pp/{key}-L{layers}/bs{b}/s{s}/w{world}-tp{tp}-{shape}-{tag}/{rc}/rank{rank}"
    return line(rid, model, config, layers, b, s, parallel, mega, snapshot, rank=rank)


# Three run at a time on one H100: the two largest (rows 1 and 4, about 30 GB each) are apart from the
# third largest (the last row).
out = Path(__file__).resolve().parents[1] / "specs.jsonl"
out.write_text("".join(json.dumps(row(*r)) + "\n" for r in ROWS))
print(out, len(ROWS))
