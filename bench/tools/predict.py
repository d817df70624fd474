"""Prints `headroom estimate SPEC --gpu h200 --rank RANK --json` of every line of a specs file: the row's own rank,
its peaks and each phase's, one JSON line each (what the predicted-before-measuring*.jsonl files hold).

    python3 bench/tools/predict.py bench/megatron-holdout/specs-call2.jsonl [HEADROOM]"""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

specs = Path(sys.argv[1])
headroom = sys.argv[2] if len(sys.argv) > 2 else "headroom"
for line in specs.read_text().splitlines():
    row = json.loads(line)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(row["spec"], f)
    out = subprocess.run([headroom, "estimate", f.name, "--gpu", "h200", "--rank", str(row.get("rank", 0)), "--json"],
                         capture_output=True, text=True, check=True)
    est = json.loads(out.stdout)
    phases = {f"{p['name']}{p['step']}": p["peak_allocated_bytes"] for p in est["phases"]}
    print(json.dumps({"id": row["id"], "rank": row.get("rank", 0), "peak_allocated_bytes": est["peak_allocated_bytes"],
                      "peak_reserved_bytes": est["peak_reserved_bytes"], "phases": phases}))
