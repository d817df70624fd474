"""Writes bench/megatron-pp-sp/specs.jsonl: Megatron-core pipelines (1F1B and interleaved) with tensor and sequence
parallelism (local layer spec, torch norms marked sequence_parallel), one fake-group run per pipeline rank measured:
the first rank of each stage."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "megatron" / "tools"))
from rows import DENSE_MODELS as MODELS, line, recompute_keys  # noqa: E402

# (model, layers, batch, seq, world, tp, pp, vpp, microbatches, distributed optimizer, recompute, ranks, snapshot)
ROWS = [
    ("l8b", 8, 4, 2048, 8, 2, 2, 1, 4, True, None, [0, 4], True),
    ("q7b", 8, 8, 1024, 16, 4, 4, 1, 8, False, ("selective", None, None), [0, 12], False),
    ("l8b", 8, 4, 2048, 8, 2, 2, 2, 4, True, ("full", "uniform", 1), [0, 4], False),
]


def rows(key, layers, b, s, world, tp, pp, vpp, micro, dist_opt, recompute, ranks, snapshot):
    model, config = MODELS[key]
    mega = {"distributed_optimizer": dist_opt}
    rc = recompute_keys(mega, recompute)
    tag = "do" if dist_opt else "nodo"
    chunks = f"-vpp{vpp}" if vpp > 1 else ""
    parallel = {"strategy": "ddp", "world_size": world, "tp": tp, "sequence_parallel": True,
                "framework": "megatron", "pp": pp, "microbatches": micro}
    if vpp > 1:
        parallel.update(vpp=vpp, schedule="interleaved-1f1b")
    for rank in ranks:
        rid = f"megatron-pp-sp/{key}-L{layers}/bs{b}/s{s}/w{world}-tp{tp}-sp-pp{pp}{chunks}-mb{micro}-{tag}/{rc}/rank{rank}"
        yield line(rid, model, config, layers, b, s, parallel, dict(mega), snapshot and rank == 0, rank=rank)


out = Path(__file__).resolve().parents[1] / "specs.jsonl"
lines = [json.dumps(r) for spec in ROWS for r in rows(*spec)]
out.write_text("".join(l + "\n" for l in lines))
print(out, len(lines))
