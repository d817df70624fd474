"""Estimate every spec line of the releases named with `headroom estimate --json`, the release
given as `versions`, and write hint_bytes (reserved x 1.1) into the spec files plus
predictions-<label>.jsonl.
    python3 tools/predict.py HEADROOM LABEL RELEASE..."""
import json
import subprocess
import sys
import tempfile

headroom, label, releases = sys.argv[1], sys.argv[2], sys.argv[3:]
out = open(f"predictions-{label}.jsonl", "w")
for release in releases:
    path = f"specs-{release}.jsonl"
    lines = [json.loads(x) for x in open(path)]
    for line in lines:
        spec = {**line["spec"], "versions": {"transformers": release}}
        with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
            json.dump(spec, f)
            f.flush()
            est = json.loads(subprocess.run([headroom, "estimate", "--json", f.name], check=True,
                                            capture_output=True, text=True).stdout)
        alloc, reserved = est["peak_allocated_bytes"], est["peak_reserved_bytes"]
        line["hint_bytes"] = int(reserved * 1.1)
        warnings = [w for w in est["assumptions"]["warnings"]]
        out.write(json.dumps({"id": line["id"], "allocated": alloc, "reserved": reserved,
                              "warnings": warnings}) + "\n")
    with open(path, "w") as f:
        f.writelines(json.dumps(x) + "\n" for x in lines)
