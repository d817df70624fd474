"""Writes bench/megatron-vocab/specs.jsonl: Megatron-LM's vocabulary padding (`--make-vocab-size-divisible-by`, its
default 128, which slime and Megatron-LM's own scripts run with): the embedding, the output layer and the logits of
`vocab_size` rounded up to a multiple of 128 x tp. Dense, tied over a pipeline, and MoE with sequence parallelism;
every line is a fake-group rank."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "megatron-router" / "tools"))
from make_specs import rows  # noqa: E402

PAD = {"make_vocab_size_divisible_by": 128}

# (model, layers, batch, seq, world, {tp, sp, pp, mb, ep}, distributed optimizer, recompute, megatron settings,
#  ranks, snapshot of the first rank)
ROWS = [
    ("q3-8b", 4, 2, 2048, 4, {"tp": 4}, True, None, PAD, [0], False),
    ("l8b", 4, 1, 4096, 8, {"tp": 8, "sp": True}, False, None, PAD, [0], False),
    ("q30", 4, 2, 2048, 8, {"tp": 2, "sp": True, "ep": 4}, True, None, {**PAD, "moe_router_dtype": "fp32"}, [0], False),
    ("q3-4b", 8, 4, 1024, 4, {"tp": 2, "pp": 2, "mb": 4}, True, None, PAD, [0, 2], False),
]

out = Path(__file__).resolve().parents[1] / "specs.jsonl"
lines = [json.dumps(r) for spec in ROWS for r in rows(*spec, prefix="megatron-vocab")]
out.write_text("".join(l + "\n" for l in lines))
print(out, len(lines))
