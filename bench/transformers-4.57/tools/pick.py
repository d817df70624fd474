"""Pick the 2 specs whose peak allocated differs most between the two rows files; write the
snapshot spec lines for each version.  python3 pick.py ROWS_A ROWS_B SPECS OUTDIR"""
import json, sys
a_path, b_path, specs_path, outdir = sys.argv[1:5]
import os
rows = lambda p: {r["id"]: r for r in map(json.loads, filter(str.strip, open(p)))} if os.path.exists(p) else {}
A, B = rows(a_path), rows(b_path)
specs = [json.loads(l) for l in open(specs_path) if l.strip()]
scored = []
for s in specs:
    if s["id"] in A and s["id"] in B:
        a, b = A[s["id"]]["measured"]["peak_allocated_bytes"], B[s["id"]]["measured"]["peak_allocated_bytes"]
        ra, rb = A[s["id"]]["measured"]["peak_reserved_bytes"], B[s["id"]]["measured"]["peak_reserved_bytes"]
        scored.append((abs(b - a) / a, s, a, b, ra, rb))
        print(f"{s['name']:28s} alloc A {a:>13d} B {b:>13d} {100*(b-a)/a:+7.3f}%   reserved A {ra:>13d} B {rb:>13d} {100*(rb-ra)/ra:+7.3f}%")
scored.sort(key=lambda t: -t[0])
top = [t[1] for t in scored[:2]]
print("snapshot:", [s["name"] for s in top])
for tag in ("5.17", "4.57"):
    with open(f"{outdir}/snap-{tag}.jsonl", "w") as fh:
        for s in top:
            fh.write(json.dumps(dict(s, snapshot=f"{s['name']}-tf{tag}.pickle")) + "\n")
