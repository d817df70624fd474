"""Prints `headroom estimate --gpu h200 --json` of every line of specs.jsonl, one JSON line each: the worst rank's
peaks and phases, and a pipeline's every stage (what `predicted-before-measuring.jsonl` holds).
    python3 bench/nccl-megatron-x4/tools/predict.py [HEADROOM]"""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

headroom = sys.argv[1] if len(sys.argv) > 1 else "headroom"
for line in (Path(__file__).resolve().parents[1] / "specs.jsonl").read_text().splitlines():
    row = json.loads(line)
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(row["spec"], f)
        f.flush()
        out = subprocess.run([headroom, "estimate", f.name, "--gpu", "h200", "--json"], capture_output=True,
                             text=True, check=True)
    est = json.loads(out.stdout)
    print(json.dumps({
        "id": row["id"],
        "worst_rank": est["worst_rank"],
        "peak_allocated_bytes": est["peak_allocated_bytes"],
        "peak_reserved_bytes": est["peak_reserved_bytes"],
        "nccl_bytes": est["nccl_bytes"],
        "phases": est["phases"],
        "stages": [{k: s[k] for k in ("stage", "ranks", "peak_allocated_bytes", "peak_reserved_bytes")}
                   for s in est.get("stages") or []],
    }))
