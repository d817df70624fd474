"""Prints `headroom estimate SPEC --gpu h200 --rank RANK --json` of every line of specs.jsonl: the row's own rank,
its load and steps' peaks, one JSON line each (what predicted-before-measuring*.jsonl hold); the second argument names
another specs file in bench/parallel-holdout."""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

headroom = sys.argv[1] if len(sys.argv) > 1 else "headroom"
specs = sys.argv[2] if len(sys.argv) > 2 else "specs.jsonl"
for line in (Path(__file__).resolve().parents[1] / specs).read_text().splitlines():
    row = json.loads(line)
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(row["spec"], f)
    out = subprocess.run([headroom, "estimate", f.name, "--gpu", "h200", "--rank", str(row["rank"]), "--json"],
                         capture_output=True, text=True, check=True)
    est = json.loads(out.stdout)
    phases = {f"{p['name']}{p['step']}": p["peak_allocated_bytes"] for p in est["phases"]}
    print(json.dumps({"id": row["id"], "rank": row["rank"], "peak_allocated_bytes": est["peak_allocated_bytes"],
                      "peak_reserved_bytes": est["peak_reserved_bytes"], "phases": phases}))
