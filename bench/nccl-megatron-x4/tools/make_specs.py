"""Writes bench/nccl-megatron-x4/specs.jsonl: eight Megatron-core layouts at a world of 4, each run on real NCCL
(every rank) and under the fake process group (`fake_ranks`: rank 0, and a pipeline's first rank of every
stage). `snapshot`: rank 0's allocator history is recorded in both modes."""
import json
import sys
from pathlib import Path

here = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(here.parent / "megatron" / "tools"))
from rows import DENSE_MODELS, MOE_MODELS, recompute_keys  # noqa: E402

MODELS = {**DENSE_MODELS, "q30": MOE_MODELS["q30"]}
# (model, layers, batch, seq, tp, sp, pp, vpp, microbatches, ep, etp, distributed optimizer, recompute, overlap p2p,
#  snapshot)
ROWS = [
    ("l8b", 4, 1, 2048, 2, False, 1, 1, 1, 1, 1, True, ("selective", None, None), None, True),
    ("l8b", 4, 1, 4096, 4, True, 1, 1, 1, 1, 1, False, ("selective", None, None), None, True),
    ("q30", 2, 1, 4096, 1, False, 1, 1, 1, 4, 1, False, None, None, False),
    ("q30", 2, 1, 4096, 1, False, 1, 1, 1, 2, 2, True, ("full", "uniform", 1), None, True),
    ("l8b", 8, 4, 1024, 1, False, 2, 1, 4, 1, 1, True, ("selective", None, None), None, False),
    ("l8b", 8, 4, 1024, 1, False, 4, 1, 4, 1, 1, False, ("full", "uniform", 1), None, False),
    ("l8b", 8, 4, 1024, 1, False, 2, 2, 4, 1, 1, True, None, True, True),
    ("q30", 4, 2, 2048, 1, False, 2, 1, 2, 2, 1, True, None, None, False),
]
WORLD = 4


def row(key, layers, b, s, tp, sp, pp, vpp, mb, ep, etp, dist_opt, recompute, overlap, snapshot):
    model, config = MODELS[key]
    mega = {"distributed_optimizer": dist_opt}
    if ep > 1 or etp > 1 or key in MOE_MODELS:
        mega["expert_model_parallel_size"] = ep
    if etp > 1:
        mega["expert_tensor_parallel_size"] = etp
    if overlap is not None:
        mega["overlap_p2p_comm"] = overlap
    rc = recompute_keys(mega, recompute)
    parallel = {"strategy": "ddp", "world_size": WORLD, "tp": tp, "framework": "megatron"}
    shape = f"w{WORLD}-tp{tp}"
    if sp:
        parallel["sequence_parallel"] = True
        shape += "-sp"
    if pp > 1:
        parallel.update(pp=pp, microbatches=mb)
        shape += f"-pp{pp}"
        if vpp > 1:
            parallel.update(vpp=vpp, schedule="interleaved-1f1b")
            shape += f"-vpp{vpp}"
        shape += f"-mb{mb}"
    if key in MOE_MODELS:
        shape += f"-ep{ep}" + (f"-etp{etp}" if etp > 1 else "")
    shape += "-do" if dist_opt else "-nodo"
    if overlap:
        shape += "-overlap"
    rid = f"nccl-megatron-x4/{key}-L{layers}/bs{b}/s{s}/{shape}/{rc}"
    # A pipeline's fake runs: the first rank of every stage (Megatron's rank order puts pp outermost).
    fake_ranks = [stage * (WORLD // pp) for stage in range(pp)]
    return {
        "id": rid,
        "spec": {"model": model, "model_config": {**config, "num_hidden_layers": layers}, "precision": "bf16",
                 "optimizer": "adamw", "batch_size": b, "seq_len": s, "parallel": parallel, "megatron": mega},
        "fake_ranks": fake_ranks,
        "snapshot": snapshot,
    }


out = here / "specs.jsonl"
out.write_text("".join(json.dumps(row(*r)) + "\n" for r in ROWS))
print(out, len(ROWS))
