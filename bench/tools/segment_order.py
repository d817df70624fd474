"""How often a new cudaMalloc segment lands below the segments of its pool and stream alive at
that moment, over every snapshot under bench/ (bench/addresses.md).

    python3 bench/tools/segment_order.py
"""
import glob, gzip, pickle, statistics
from pathlib import Path

MIB = 1 << 20
root = Path(__file__).resolve().parents[1]
totals = {"small": [0, 0], "large": [0, 0]}
per_snapshot = []
for path in sorted(glob.glob(str(root / "**/*.pickle*"), recursive=True)):
    with (gzip.open if path.endswith(".gz") else open)(path, "rb") as f:
        snap = pickle.load(f)
    trace = (snap.get("device_traces") or [[]])[0]
    events = [e for e in trace if e["action"] in ("segment_alloc", "segment_free")]
    if not any(e["action"] == "segment_alloc" for e in events):
        continue
    info, allocated, alive = {}, set(), set()
    for e in events:
        info.setdefault(e["addr"], (e["size"], e.get("stream")))
        if e["action"] == "segment_alloc":
            allocated.add(e["addr"])
        elif e["addr"] not in allocated:
            alive.add(e["addr"])
    for s in snap.get("segments", []):
        if s["address"] not in allocated and not s.get("is_expandable"):
            alive.add(s["address"])
            info[s["address"]] = (s["total_size"], s.get("stream"))
    pool = lambda a: "small" if info[a][0] == 2 * MIB else "large"
    local = [0, 0]
    for e in events:
        a = e["addr"]
        if e["action"] == "segment_free":
            alive.discard(a)
            continue
        for other in alive:
            if pool(other) == pool(a) and info[other][1] == info[a][1]:
                totals[pool(a)][a < other] += 1
                if pool(a) == "large":
                    local[a < other] += 1
        alive.add(a)
    if sum(local):
        per_snapshot.append(local[1] / sum(local))
for name, (above, below) in totals.items():
    print(f"{name}: {above + below} pairs, new segment below {below / (above + below):.1%}")
print(f"large, median per snapshot: {statistics.median(per_snapshot):.1%} over {len(per_snapshot)}")
