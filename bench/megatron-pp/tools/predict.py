"""Prints `headroom estimate --json` of every line of specs.jsonl (or of the file named by the second argument,
relative to bench/megatron-pp) as the stage its rank holds (the stage's peaks
from `stages`), one JSON line each: what bench/megatron-pp's predictions files hold."""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

headroom = sys.argv[1] if len(sys.argv) > 1 else "headroom"
for line in (Path(__file__).resolve().parents[1] / (sys.argv[2] if len(sys.argv) > 2 else "specs.jsonl")).read_text().splitlines():
    row = json.loads(line)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(row["spec"], f)
    out = subprocess.run([headroom, "estimate", f.name, "--gpu", "h100-80gb", "--json"], capture_output=True,
                         text=True, check=True)
    estimate = json.loads(out.stdout)
    par = row["spec"]["parallel"]
    pp_rank = row["rank"] // (par["world_size"] // par["pp"])
    stage = next(s for s in estimate["stages"] if s["stage"] == pp_rank)
    print(json.dumps({"id": row["id"], "rank": row["rank"], "stage": pp_rank,
                      "peak_allocated_bytes": stage["peak_allocated_bytes"],
                      "peak_reserved_bytes": stage["peak_reserved_bytes"],
                      "worst_rank": estimate["worst_rank"]}))
