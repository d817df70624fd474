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


def rows():
    for key, layers, b, s, world, tp, pp, mb, ep, recompute, ranks in LAYOUTS:
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
    out = Path(__file__).resolve().parents[1] / "specs.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows()))
