"""Write specs-<release>.jsonl for the releases named (all by default): the matrix measured under
each older transformers release. The spec has no `versions` key (the harness refuses none but
reads none); rows get it after measuring."""
import json
import sys

from headroom_measure import spec as specmod
from headroom_measure.measure import default_id

BASE = {"task": "causal-lm", "mode": "train", "optimizer": "adamw", "gradient_checkpointing": False,
        "attention": "sdpa", "precision": "bf16"}
MATRIX = [
    ("qwen2.5-0.5b", 4, 2048, {}),
    ("qwen2.5-0.5b", 4, 2048, {"lora": {"r": 16, "alpha": 32, "targets": "all-linear", "dropout": 0.0}}),
    ("qwen2.5-0.5b", 4, 1024, {"attention": "eager"}),
    ("llama-3.2-1b", 4, 2048, {"gradient_checkpointing": True}),
    ("llama-3.2-1b", 2, 2048, {"precision": "amp-bf16"}),
    ("gpt2", 8, 1024, {"precision": "amp-bf16"}),
    ("gemma-2-2b", 2, 2048, {"gradient_checkpointing": True}),
    ("phi-3-mini", 2, 2048, {"gradient_checkpointing": True}),
]
# The releases and the rows each runs (indices into MATRIX): device call 1 ran 4.46.3 and 4.51.3
# (4.55.4's batch never started), call 2 one release of each range modelled after it.
CALL2 = [0, 2, 3, 5]
RELEASES = {"4.46.3": range(len(MATRIX)), "4.51.3": range(len(MATRIX)), "4.48.3": CALL2,
            "4.53.3": CALL2, "4.55.4": CALL2, "4.56.2": CALL2}


def name(model, b, s, extra):
    spec = {**BASE, **extra}
    parts = [model, spec["precision"].replace("-", "_"), f"bs{b}", f"s{s}", spec["attention"]]
    if spec["gradient_checkpointing"]:
        parts.append("gc")
    if "lora" in spec:
        parts.append("lora16")
    return "-".join(parts)


for release in sys.argv[1:] or RELEASES:
    rows = RELEASES[release]
    with open(f"specs-{release}.jsonl", "w") as out:
        for i in rows:
            model, b, s, extra = MATRIX[i]
            spec = {**BASE, "model": model, "batch_size": b, "seq_len": s, **extra}
            n = name(model, b, s, extra)
            row_id = default_id(specmod.parse(spec))
            line = {"id": f"{row_id}/transformers{release}", "name": f"{n}-tf{release}", "spec": spec,
                    "snapshot": f"{n}-tf{release}"}
            out.write(json.dumps(line) + "\n")
