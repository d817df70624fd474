"""Writes bench/megatron-holdout/specs.jsonl: Megatron-core layouts chosen to differ from every measured row before
the model saw them: tied word embeddings (one stage, and a last stage holding its own copy), Mixtral's experts,
a pipeline of three stages, tensor parallelism of 8 at 8k tokens, odd batch and sequence sizes, a middle stage of an
interleaved pipeline, expert tensor parallelism of 2 under expert parallelism of 8. Every line is a fake-group rank."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "megatron" / "tools"))
from rows import DENSE_MODELS, MOE_MODELS, MORE_MODELS, layout_keys, line, recompute_keys  # noqa: E402

MODELS = {**DENSE_MODELS, **MOE_MODELS, **MORE_MODELS}

# (model, layers, batch, seq, world, {tp, sp, pp, vpp, mb, ep, etp}, distributed optimizer, recompute, ranks,
#  snapshot of the first rank)
ROWS = [
    ("q3-4b", 6, 2, 2048, 1, {}, False, None, [0], True),
    ("q3-4b", 6, 1, 4096, 8, {"tp": 2, "sp": True}, True, ("selective", None, None), [0], False),
    ("l3b", 4, 2, 2048, 4, {"tp": 4}, False, ("full", "uniform", 1), [0], False),
    ("q1.5b", 8, 4, 1024, 2, {"tp": 2}, False, None, [0], False),
    ("l1b", 4, 1, 4096, 1, {}, True, ("full", "block", 2), [0], False),
    ("q3-4b", 8, 4, 2048, 4, {"pp": 2, "mb": 4}, True, ("selective", None, None), [0, 2], True),
    ("l3b", 8, 4, 1024, 4, {"tp": 2, "sp": True, "pp": 2, "vpp": 2, "mb": 4}, False, None, [0, 2], False),
    ("mx7", 2, 1, 4096, 8, {"ep": 8}, True, None, [0], True),
    ("mx7", 2, 1, 4096, 8, {"ep": 4}, False, ("selective", None, None), [0], False),
    ("mx7", 4, 2, 2048, 16, {"tp": 2, "sp": True, "ep": 8, "etp": 1}, True, ("full", "uniform", 1), [0], False),
    ("mx7", 4, 4, 1024, 8, {"pp": 2, "mb": 4, "ep": 4}, True, None, [0, 4], False),
    ("mx7", 2, 1, 4096, 8, {"ep": 2, "etp": 2}, False, None, [0], False),
    ("m7b", 4, 2, 4096, 4, {"tp": 4, "sp": True}, True, ("full", "block", 1), [0], False),
    ("q3-8b", 6, 1, 8192, 8, {"tp": 8}, False, ("selective", None, None), [0], False),
    ("q7b", 8, 8, 1024, 16, {"tp": 2, "pp": 4, "vpp": 2, "mb": 8}, True, ("selective", None, None), [4, 12], False),
    ("l8b", 6, 3, 2048, 3, {"pp": 3, "mb": 3}, False, None, [0, 1, 2], False),
    ("q30", 4, 2, 2048, 16, {"tp": 2, "sp": True, "ep": 8}, True, ("selective", None, None), [0], False),
    ("q3-8b", 4, 3, 1536, 6, {"tp": 2}, False, None, [0], False),
    ("l8b", 4, 1, 2048, 4, {}, True, ("full", "uniform", 2), [0], False),
]


# Measured in a second call (specs-call2.jsonl), predicted before it: pipelines, where the first
# call's reserved misses were, tied and untied, dense and Mixtral.
CALL2 = [
    ("l3b", 8, 4, 1024, 2, {"pp": 2, "vpp": 2, "mb": 4}, False, None, [0, 1], True),
    ("l8b", 8, 8, 512, 4, {"pp": 4, "vpp": 2, "mb": 8}, False, None, [0, 3], False),
    ("q3-8b", 8, 6, 1024, 4, {"tp": 2, "pp": 2, "mb": 6}, False, ("full", "uniform", 1), [0, 2], False),
    ("mx7", 4, 2, 2048, 16, {"pp": 2, "mb": 2, "ep": 8}, True, ("selective", None, None), [0, 8], False),
    ("q30", 4, 4, 1024, 8, {"tp": 2, "sp": True, "pp": 2, "vpp": 2, "mb": 4, "ep": 2}, True, None, [0, 4], False),
    ("q7b", 8, 4, 1024, 2, {"pp": 2, "mb": 4, "split": [3, 5]}, False, ("selective", None, None), [0, 1], False),
    ("q3-4b", 8, 4, 1024, 4, {"pp": 4, "mb": 4}, False, None, [0, 3], False),
    ("l3b", 8, 4, 1024, 8, {"tp": 2, "sp": True, "pp": 2, "vpp": 2, "mb": 4}, True, ("full", "uniform", 1),
     [0, 4, 7], False),
    ("q1.5b", 8, 2, 2048, 4, {"tp": 2, "pp": 2, "mb": 2}, True, None, [0, 2], False),
    ("mx7", 2, 2, 2048, 8, {"pp": 2, "mb": 2, "ep": 4}, False, ("full", "block", 1), [0, 4], False),
]

# A third call: the second call's miss (q1.5b's last stage) again with a snapshot, beside the
# layouts that tell its causes apart (no distributed optimizer, tp 1, an untied Qwen2), and more
# layouts not measured before: 4 virtual stages a rank, interleaving without overlapped p2p,
# Llama-3.1-70B's widths under tp 8 with sequence parallelism, Mistral-NeMo's head_dim, Qwen3-235B
# experts over a pipeline, Mixtral with expert tensor parallelism beside tp 2.
CALL3 = [
    ("q1.5b", 8, 2, 2048, 4, {"tp": 2, "pp": 2, "mb": 2}, True, None, [2], True),
    ("q1.5b", 8, 2, 2048, 4, {"tp": 2, "pp": 2, "mb": 2}, False, None, [2], False),
    ("q1.5b", 8, 2, 2048, 2, {"pp": 2, "mb": 2}, True, None, [1], False),
    ("q7b", 4, 2, 2048, 4, {"tp": 2, "pp": 2, "mb": 2}, True, None, [2], False),
    ("l8b", 8, 4, 1024, 2, {"pp": 2, "vpp": 4, "mb": 4}, False, None, [0, 1], False),
    ("q3-8b", 8, 4, 1024, 4, {"tp": 2, "pp": 2, "vpp": 2, "mb": 4, "overlap": False}, True,
     ("selective", None, None), [0, 2], False),
    ("l70b", 2, 1, 4096, 8, {"tp": 8, "sp": True}, True, None, [0], False),
    ("nemo", 4, 2, 2048, 4, {"tp": 2}, False, ("full", "uniform", 2), [0], False),
    ("q235", 2, 2, 1024, 16, {"pp": 2, "mb": 2, "ep": 8}, True, None, [0, 8], False),
    ("mx7", 2, 1, 4096, 8, {"tp": 2, "sp": True, "ep": 2, "etp": 2}, True, ("selective", None, None), [0],
     False),
]

# A fourth call: the distributed optimizer's last data-parallel ranks of large worlds (dense and expert
# buffers), a tied model over four stages interleaved, a Qwen3-MoE stage of one layer in the middle of four, tp 4 with
# sequence parallelism under an interleaved pipeline.
CALL4 = [
    ("mx7", 2, 1, 4096, 64, {"ep": 8}, True, None, [63], False),
    ("q3-4b", 8, 8, 1024, 8, {"pp": 4, "vpp": 2, "mb": 8}, True, ("selective", None, None), [0, 7], False),
    ("q30", 4, 4, 1024, 8, {"pp": 4, "mb": 4, "ep": 2}, True, None, [2, 5], False),
    ("q3-8b", 8, 4, 2048, 16, {"tp": 4, "sp": True, "pp": 2, "vpp": 2, "mb": 4}, True, ("full", "uniform", 1),
     [7, 15], False),
    ("l8b", 4, 2, 4096, 32, {"tp": 2}, True, None, [31], False),
]

# The first call's two largest reserved misses again, each with an allocator snapshot
# (specs-snapshot.jsonl; their rows stay out of the gate, which has the first call's).
SNAPSHOT = [
    ("l3b", 8, 4, 1024, 4, {"tp": 2, "sp": True, "pp": 2, "vpp": 2, "mb": 4}, False, None, [0], True),
    ("mx7", 4, 4, 1024, 8, {"pp": 2, "mb": 4, "ep": 4}, True, None, [4], True),
]


def rows(key, layers, b, s, world, lay, dist_opt, recompute, ranks, snapshot):
    model, config = MODELS[key]
    mega = {"distributed_optimizer": dist_opt}
    rc = recompute_keys(mega, recompute)
    parallel, tag = layout_keys(world, lay, mega)
    tag += "-do" if dist_opt else "-nodo"
    for rank in ranks:
        staged = parallel.get("pp", 1) > 1 or rank != 0
        rid = f"megatron-holdout/{key}-L{layers}/bs{b}/s{s}/{tag}/{rc}" + (f"/rank{rank}" if staged else "")
        yield line(rid, model, config, layers, b, s, dict(parallel), dict(mega), snapshot and rank == ranks[0],
                   rank=rank)


for name, table in [("specs.jsonl", ROWS), ("specs-call2.jsonl", CALL2), ("specs-call3.jsonl", CALL3), ("specs-call4.jsonl", CALL4), ("specs-snapshot.jsonl", SNAPSHOT)]:
    out = Path(__file__).resolve().parents[1] / name
    lines = [json.dumps(r) for spec in table for r in rows(*spec)]
    out.write_text("".join(l + "\n" for l in lines))
    print(out, len(lines))
