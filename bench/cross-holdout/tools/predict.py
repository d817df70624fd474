"""`headroom estimate SPEC --gpu h200 --rank RANK --json` of every line of the spec files named, with the line's
`versions` merged into its spec (the harness spec carries none), one JSON line each: what
predicted-before-measuring.jsonl holds (bench/tools/predict.py's format, plus `versions` and the warnings).
A spec headroom refuses gets `refused` with the message instead of peaks.

    python3 bench/cross-holdout/tools/predict.py HEADROOM SPECS.jsonl... > bench/cross-holdout/predicted-before-measuring.jsonl
"""
import json
import subprocess
import sys
import tempfile

headroom, files = sys.argv[1], sys.argv[2:]
for path in files:
    for text in open(path):
        row = json.loads(text)
        spec = dict(row["spec"])
        if row.get("versions"):
            spec["versions"] = row["versions"]
        with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
            json.dump(spec, f)
            f.flush()
            out = subprocess.run([headroom, "estimate", f.name, "--gpu", "h200", "--rank", str(row.get("rank", 0)),
                                  "--json"], capture_output=True, text=True)
        rec = {"id": row["id"], "file": path.split("/")[-1], "rank": row.get("rank", 0),
               "versions": row.get("versions")}
        if out.returncode != 0:
            rec["refused"] = out.stderr.strip()
        else:
            est = json.loads(out.stdout)
            rec.update(peak_allocated_bytes=est["peak_allocated_bytes"], peak_reserved_bytes=est["peak_reserved_bytes"],
                       phases={f"{p['name']}{p['step']}": p["peak_allocated_bytes"] for p in est["phases"]},
                       warnings=est["assumptions"]["warnings"])
        print(json.dumps(rec), flush=True)
