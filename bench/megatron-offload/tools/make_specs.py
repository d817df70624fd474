"""Writes bench/megatron-offload/specs.jsonl: Megatron-LM's `--optimizer-cpu-offload` as slime runs it (with
`--use-precision-aware-optimizer`, which Megatron-LM requires beside it, the distributed optimizer, the whole
optimizer on the host, and `--overlap-cpu-optimizer-d2h-h2d` on some rows). Dense and MoE, tensor, pipeline and
interleaved layouts, the first and last data-parallel shard; every line is a fake-group rank. The same for
specs-call2.jsonl (CALL2)."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "megatron-router" / "tools"))
from make_specs import rows  # noqa: E402

OFFLOAD = {"optimizer_cpu_offload": True}
OVERLAP = {**OFFLOAD, "overlap_cpu_optimizer_d2h_h2d": True}
FP32 = {"moe_router_dtype": "fp32"}

# (model, layers, batch, seq, world, {tp, sp, pp, vpp, mb, ep, etp}, distributed optimizer, recompute, megatron
#  settings, ranks, snapshot of the first rank)
ROWS = [
    ("q3-8b", 4, 2, 2048, 8, {"tp": 2}, True, None, OFFLOAD, [0, 7], True),
    ("q3-8b", 4, 2, 2048, 8, {"tp": 2}, True, None, OVERLAP, [0], False),
    ("l8b", 4, 1, 4096, 32, {"tp": 4, "sp": True}, True, ("full", "uniform", 1), OVERLAP, [0], False),
    ("q30", 4, 2, 2048, 8, {"ep": 8}, True, None, {**OVERLAP, **FP32}, [0], True),
    ("q30", 4, 4, 1024, 16, {"tp": 2, "sp": True, "pp": 2, "mb": 4, "ep": 4}, True, None, {**OFFLOAD, **FP32},
     [0, 8], False),
    ("q3-4b", 8, 4, 1024, 8, {"tp": 2, "pp": 2, "vpp": 2, "mb": 4}, True, None, OVERLAP, [0, 4], False),
    ("q1.5b", 4, 4, 2048, 8, {}, True, None, OFFLOAD, [0, 7], False),
]


# Call 2, estimated after the first call's fix (the host-to-device casts) and the harness's fix (a run without a
# pipeline now plays the line's rank, not rank 0): the last data-parallel shards again, an MoE model with expert
# tensor parallelism, Qwen3-235B's experts, and a tied model over a pipeline.
CALL2 = [
    ("q3-8b", 4, 2, 2048, 8, {"tp": 2}, True, None, OFFLOAD, [7], False),
    ("q1.5b", 4, 4, 2048, 8, {}, True, None, OVERLAP, [7], True),
    ("q30", 4, 2, 2048, 16, {"tp": 2, "sp": True, "ep": 4, "etp": 2}, True, ("selective", None, None),
     {**OVERLAP, **FP32, "moe_aux_loss_coeff": 1e-3}, [0, 15], False),
    ("q235", 2, 1, 4096, 16, {"ep": 16}, True, None, {**OVERLAP, **FP32}, [0], False),
    ("q3-4b", 8, 4, 1024, 8, {"tp": 2, "pp": 2, "mb": 4}, True, ("full", "uniform", 1), OFFLOAD, [1, 7], False),
]

if __name__ == "__main__":
    for name, table in [("specs.jsonl", ROWS), ("specs-call2.jsonl", CALL2)]:
        out = Path(__file__).resolve().parents[1] / name
        lines = [json.dumps(r) for spec in table for r in rows(*spec, prefix="megatron-offload")]
        out.write_text("".join(l + "\n" for l in lines))
        print(out, len(lines))
