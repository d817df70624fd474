"""Writes bench/megatron-dp-ranks/specs.jsonl: Megatron-core pipeline ranks at data-parallel positions other than 0
under the distributed optimizer, each one rank of a fake world (the line's `rank` is the global rank the fake process
group is initialised with; Megatron's rank order tp-cp-ep-dp-pp makes it pipeline rank `rank // (world / pp)` at
data-parallel position `rank // tp % dp`). Each data-parallel rank steps its own shard of the gradient buffers."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "megatron" / "tools"))
from rows import DENSE_MODELS, MOE_MODELS, line, recompute_keys  # noqa: E402

MODELS = {**DENSE_MODELS, **MOE_MODELS}
# (model, layers, batch, seq, world, tp, pp, microbatches, ep, recompute, ranks)
LAYOUTS = [
    ("l8b", 8, 8, 1024, 8, 1, 2, 8, 1, ("selective", None, None), [1, 2, 3, 5, 7]),
    ("q7b", 8, 6, 2048, 8, 2, 2, 6, 1, ("selective", None, None), [3, 6]),
    ("q30", 4, 4, 2048, 8, 1, 2, 4, 2, None, [1, 3, 6]),
]


# Call 3, after the fixes, estimated before it: other models, deeper pipelines, full recomputation.
LAYOUTS_CALL3 = [
    ("q3-8b", 8, 4, 2048, 8, 2, 2, 4, 1, ("selective", None, None), [2, 4, 6]),
    ("l8b", 8, 8, 2048, 16, 2, 4, 8, 1, ("full", "uniform", 1), [5, 15]),
]


def rows(layouts=LAYOUTS):
    for key, layers, b, s, world, tp, pp, mb, ep, recompute, ranks in layouts:
        model, config = MODELS[key]
        mega = {"distributed_optimizer": True}
        if ep > 1:
            mega["expert_model_parallel_size"] = ep
        rc = recompute_keys(mega, recompute)
        parallel = {"strategy": "ddp", "world_size": world, "tp": tp, "framework": "megatron", "pp": pp,
                    "microbatches": mb}
        ep_tag = f"-ep{ep}" if ep > 1 else ""
        for rank in ranks:
            rid = f"megatron-dp-ranks/{key}-L{layers}/bs{b}/s{s}/w{world}-tp{tp}-pp{pp}{ep_tag}-mb{mb}-do/{rc}/rank{rank}"
            yield line(rid, model, config, layers, b, s, parallel, mega, False, rank=rank)


if __name__ == "__main__":
    here = Path(__file__).resolve().parents[1]
    (here / "specs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows()))
    (here / "specs-call3.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows(LAYOUTS_CALL3)))
