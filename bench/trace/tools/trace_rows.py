"""Trace the measured rows of calibration files under fake tensors, one process per row.

    python bench/trace/tools/trace_rows.py ROWS.jsonl... --out-dir bench/trace/traces [--jobs N] [--only SUBSTR]

Each row's spec (a pipeline row's pipeline) is traced with `python -m headroom_measure trace` (the catalog resolves model
names) into OUT_DIR/<row id with / as __>.json.gz; rows the tracer refuses (4-bit, the eager
experts loop, ...) are listed with the reason. A row of one rank of a fake world is traced as that rank. Prints one line per row.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def trace_one(row, out_dir: Path):
    name = row["id"].replace("/", "__")
    out = out_dir / f"{name}.json.gz"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")]))
    ranks = row.get("measured", {}).get("ranks") or []
    # A row of one rank of a fake world is traced as that rank (a pipeline's stages differ).
    rank = ["--rank", str(ranks[0]["rank"])] if len(ranks) == 1 and ranks[0].get("rank") else []
    t0 = time.time()
    proc = subprocess.run(
        [sys.executable, "-m", "headroom_measure", "trace", "--spec-json", json.dumps(row.get("spec") or row["pipeline"]), "--out", str(out), *rank],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    message = proc.stderr.strip().splitlines()[-1] if proc.returncode else ""
    return row["id"], proc.returncode, round(time.time() - t0, 1), message


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("rows", nargs="+")
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--only")
    args = parser.parse_args()
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(line) for path in args.rows for line in open(path) if line.strip()]
    rows = [r for r in rows if not args.only or args.only in r["id"]]
    with ThreadPoolExecutor(args.jobs) as pool:
        for rid, rc, secs, message in pool.map(lambda r: trace_one(r, out_dir), rows):
            print(json.dumps({"id": rid, "rc": rc, "wall_s": secs, "error": message}), flush=True)


if __name__ == "__main__":
    main()
