"""Prints the results table of bench/cross-holdout/README.md: each row of the call-1 row files against
predicted-before-measuring.jsonl (errors = predicted / measured - 1), flagged past 0.5% allocated or 3% reserved.

    python3 bench/cross-holdout/tools/table.py
"""
import json
from pathlib import Path

here = Path(__file__).resolve().parents[1]
pred = {json.loads(l)["id"]: json.loads(l) for l in (here / "predicted-before-measuring.jsonl").read_text().splitlines()}
print("| id | measured allocated | predicted | error | measured reserved | predicted | error | peak in |")
print("|---|---:|---:|---:|---:|---:|---:|---|")
for f in sorted(here.glob("rows-h200-*.jsonl")):
    for line in f.read_text().splitlines():
        r = json.loads(line)
        m, p = r["measured"], pred[r["id"]]
        ea = p["peak_allocated_bytes"] / m["peak_allocated_bytes"] - 1
        er = p["peak_reserved_bytes"] / m["peak_reserved_bytes"] - 1
        flag = " **miss**" if abs(ea) > 0.005 or abs(er) > 0.03 else ""
        seg = m.get("peak_segment")
        if seg is None:  # single-run and dist rows: the phase of the largest step peak
            steps = m.get("steps") or (m.get("ranks") or [{}])[0].get("steps") or []
            best = max(((s.get(k) or 0, k[:-5]) for s in steps for k in ("fwd_peak", "bwd_peak", "opt_peak")), default=(0, "?"))
            seg = best[1]
        print(f"| `{r['id']}` | {m['peak_allocated_bytes']:,} | {p['peak_allocated_bytes']:,} | {ea:+.2%} | "
              f"{m['peak_reserved_bytes']:,} | {p['peak_reserved_bytes']:,} | {er:+.2%}{flag} | {seg} |")
