"""Estimate each measured row's spec with its release as `versions` and print the errors."""
import json
import subprocess
import sys
import tempfile

headroom = sys.argv[1]
for path in sys.argv[2:]:
    for line in open(path):
        row = json.loads(line)
        release = row["env"]["transformers"]
        spec = {**row["spec"], "versions": {"transformers": release}}
        with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
            json.dump(spec, f)
            f.flush()
            est = json.loads(subprocess.run([headroom, "estimate", "--json", f.name], check=True,
                                            capture_output=True, text=True).stdout)
        m = row["measured"]
        a, r = m["peak_allocated_bytes"], m["peak_reserved_bytes"]
        ea, er = est["peak_allocated_bytes"], est["peak_reserved_bytes"]
        warn = "; ".join(est["assumptions"]["warnings"])
        print(f"{row['id']:66s} {a:>15,} {ea:>15,} {100*(ea-a)/a:+6.2f}%  {r:>15,} {er:>15,} {100*(er-r)/r:+6.2f}%  {warn}")
