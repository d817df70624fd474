"""Writes bench/cp/tools/specs-call2.jsonl: layouts where the ring's own buffers, not the loss, set the peak: the
real widths of Llama-3.1-8B and Qwen3-8B with a 4096-token vocabulary, 32k to 128k tokens (16k per rank)."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_specs import line_of  # noqa: E402  (this folder's, which imports bench/tp's models)

# model, world, cp, tp, sp, batch, seq, checkpointing, FSDP2 mixed-precision policy (fp32 masters)
LAYOUTS = [
    ("l8b", 8, 8, 1, False, 1, 131072, True, False),
    ("l8b", 8, 4, 1, False, 1, 65536, False, False),
    ("q3-8b", 16, 8, 2, True, 1, 131072, True, False),
    ("l8b", 4, 2, 1, False, 2, 32768, False, False),
]
SNAPSHOTS = (0, 1)
VOCAB = 4096

lines = []
for layout in LAYOUTS:
    line = line_of(*layout)
    line["spec"]["model_config"]["vocab_size"] = VOCAB
    line["id"] = line["id"].replace("-L4/", f"-L4-v{VOCAB}/")
    lines.append(line)
for i in SNAPSHOTS:
    lines[i]["snapshot"] = lines[i]["id"].replace("/", "-") + ".pickle"
Path(__file__).resolve().parent.joinpath("specs-call2.jsonl").write_text(
    "".join(json.dumps(line) + "\n" for line in lines)
)
