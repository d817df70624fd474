"""Writes bench/megatron-pp-vpp/specs.jsonl: Megatron-core pipeline ranks under the interleaved 1F1B schedule
(`vpp` model chunks per rank, local layer spec), each one rank of a fake world: the line's `rank` is the global rank
the fake process group is initialised with, so the process is pipeline rank `rank // (world / pp)` (Megatron's rank
order tp-cp-ep-dp-pp). `ROWS` were measured with `--no-overlap-p2p-communication` (`megatron.overlap_p2p_comm: false`),
`OVERLAP_ROWS` with Megatron-LM's default overlap."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "megatron" / "tools"))
from rows import DENSE_MODELS, line, recompute_keys  # noqa: E402

MODELS = {key: DENSE_MODELS[key] for key in ("l8b", "q7b")}
# Qwen3-30B-A3B at its real widths, as bench/megatron-pp-moe measured it.
_moe = json.loads((Path(__file__).resolve().parents[2] / "megatron-pp-moe" / "specs.jsonl").read_text().splitlines()[0])
MODELS["q30"] = (_moe["spec"]["model"], {k: v for k, v in _moe["spec"]["model_config"].items()
                                         if k != "num_hidden_layers"})
# (model, layers, batch, seq, world, tp, pp, vpp, microbatches, distributed optimizer,
#  recompute (granularity, method, layers), rank, snapshot[, expert parallel])
ROWS = [
    ("l8b", 8, 4, 1024, 2, 1, 2, 2, 4, False, None, 0, True),
    ("l8b", 8, 4, 1024, 2, 1, 2, 2, 4, False, None, 1, False),
    ("l8b", 8, 8, 1024, 8, 1, 4, 2, 8, True, ("selective", None, None), 0, False),
    ("l8b", 8, 8, 1024, 8, 1, 4, 2, 8, True, ("selective", None, None), 4, True),
    ("l8b", 8, 8, 1024, 8, 1, 4, 2, 8, True, ("selective", None, None), 6, False),
    ("l8b", 8, 4, 2048, 16, 2, 4, 2, 4, True, ("full", "uniform", 1), 12, False),
    ("q7b", 8, 4, 2048, 8, 2, 2, 2, 4, True, ("selective", None, None), 0, False),
    ("q7b", 6, 6, 1024, 4, 1, 2, 3, 6, False, ("full", "block", 1), 0, False),
    ("q7b", 6, 6, 1024, 4, 1, 2, 3, 6, False, ("full", "block", 1), 2, False),
    ("q30", 4, 2, 2048, 4, 1, 2, 2, 2, True, None, 0, False, 2),
    ("q30", 4, 2, 2048, 4, 1, 2, 2, 2, True, None, 2, False, 2),
    ("q30", 4, 4, 2048, 8, 1, 2, 2, 4, False, ("selective", None, None), 0, False, 4),
    ("q30", 4, 4, 2048, 8, 1, 2, 2, 4, False, ("selective", None, None), 4, True, 4),
]
OVERLAP_ROWS = [
    ("l8b", 8, 8, 1024, 8, 1, 4, 2, 8, True, ("selective", None, None), 0, True),
    ("l8b", 8, 8, 1024, 8, 1, 4, 2, 8, True, ("selective", None, None), 4, True),
    ("l8b", 8, 8, 1024, 8, 1, 4, 2, 8, True, ("selective", None, None), 6, False),
    ("q7b", 6, 6, 1024, 4, 1, 2, 3, 6, False, ("full", "block", 1), 2, False),
]


def row(key, layers, b, s, world, tp, pp, vpp, mb, dist_opt, recompute, rank, snapshot, ep=1, overlap=False):
    model, config = MODELS[key]
    mega = {"distributed_optimizer": dist_opt}
    if ep > 1:
        mega["expert_model_parallel_size"] = ep
    rc = recompute_keys(mega, recompute)
    mega["overlap_p2p_comm"] = overlap
    tag = ("do" if dist_opt else "nodo") + ("-overlap" if overlap else "")
    parallel = {"strategy": "ddp", "world_size": world, "tp": tp, "framework": "megatron", "pp": pp, "vpp": vpp,
                "schedule": "interleaved-1f1b", "microbatches": mb}
    shape = f"tp{tp}-pp{pp}-vpp{vpp}" + (f"-ep{ep}" if ep > 1 else "")
    rid = f"megatron-pp-vpp/{key}-L{layers}/bs{b}/s{s}/w{world}-{shape}-mb{mb}-{tag}/{rc}/rank{rank}"
    return line(rid, model, config, layers, b, s, parallel, mega, snapshot, rank=rank)


out = Path(__file__).resolve().parents[1] / "specs.jsonl"
lines = [row(*r) for r in ROWS] + [row(*r, overlap=True) for r in OVERLAP_ROWS]
out.write_text("".join(json.dumps(r) + "\n" for r in lines))
print(out, len(lines))
