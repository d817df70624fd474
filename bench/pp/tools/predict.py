"""Prints `headroom estimate --json`'s peak of the measured rank (of its pipeline stage) for every line of a specs file (the stage the
rank holds first), before the runs are measured.

    python bench/pp/tools/predict.py bench/pp/specs.jsonl [HEADROOM]
"""

import json
import subprocess
import sys
import tempfile

specs = sys.argv[1]
binary = sys.argv[2] if len(sys.argv) > 2 else "headroom"
for line in open(specs):
    line = json.loads(line)
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(line["spec"], f)
        f.flush()
        out = subprocess.run([binary, "estimate", f.name, "--gpu", "h100-80gb", "--json"], capture_output=True, text=True)
    if out.returncode:
        print(f"{line['id']}: error {out.stderr.strip()}")
        continue
    est = json.loads(out.stdout)
    # Stages name the first of their ranks (dp x tp of them, which hold alike).
    par = line["spec"]["parallel"]
    per_stage = par["world_size"] // par["pp"]
    stage = next(s for s in est["stages"] if s["worst_rank"] == line["rank"] // per_stage * per_stage)
    print(f"{line['id']}: allocated {stage['peak_allocated_bytes']:,} reserved {stage['peak_reserved_bytes']:,}")
