"""Prints the README's tables (markdown) from the rows and the estimates made before measuring: every real rank against
the fake rank that stands for it (its stage's first rank: data-parallel rank 0), phase by phase, and the worst real
rank against headroom's worst rank.
    python3 bench/nccl-megatron-x4/tools/compare.py"""
import json
from pathlib import Path

here = Path(__file__).resolve().parents[1]


def rows(name):
    return [json.loads(l) for l in (here / name).read_text().splitlines() if l.strip()]


real = rows("rows-nccl-h200x4-torch2.11.jsonl")
fake = {r["id"]: r for r in rows("rows-fake-h200-torch2.11.jsonl")}
predicted = {r["id"]: r for r in rows("predicted-before-measuring.jsonl")}


def phases(rank):
    """(name, allocated peak, reserved) of every phase: load, then each step's phases (the step's reserved peak)."""
    out = [("load", rank["load"]["peak_allocated"], rank["load"]["peak_reserved"])]
    for i, step in enumerate(rank["steps"], 1):
        out += [(f"{k[:-5]}{i}", v, step["peak_reserved"]) for k, v in step.items() if k.endswith("_peak")]
    return out


def steps_peak(rank):
    return max(v for step in rank["steps"] for k, v in step.items() if k.endswith("_peak"))


def signed(n):
    return f"{n:+,}"


def spread(values):
    values = sorted(set(values))
    return signed(values[0]) if len(values) == 1 else f"{signed(values[0])} to {signed(values[-1])}"


def short(rid):
    return rid.removeprefix("nccl-megatron-x4/")


print("| layout | NCCL rank | fake rank | steps peak allocated, NCCL | fake | NCCL - fake, every phase | peak reserved, NCCL | fake | NCCL - fake, every step |")
print("|---|---:|---:|---:|---:|---|---:|---:|---|")
for row in real:
    par = row["spec"]["parallel"]
    per_stage = par["world_size"] // par.get("pp", 1)
    for rank in row["measured"]["ranks"]:
        # Its stage's first rank (data-parallel rank 0), which the fake group plays.
        first = rank["rank"] // per_stage * per_stage
        twin = fake[row["id"] + (f"/rank{first}" if par.get("pp", 1) > 1 else "") + "/fake"]
        f = twin["measured"]["ranks"][0]
        a, b = phases(rank), phases(f)
        assert [p[0] for p in a] == [p[0] for p in b]
        print(f"| `{short(row['id'])}` | {rank['rank']} | {f['rank']} | {steps_peak(rank):,} | {steps_peak(f):,} | "
              f"{spread(x[1] - y[1] for x, y in zip(a, b))} | {rank['peak_reserved_bytes']:,} | "
              f"{f['peak_reserved_bytes']:,} | {spread(x[2] - y[2] for x, y in zip(a, b))} |")
print()
print("| layout | worst NCCL rank | headroom's worst rank | NCCL peak reserved | estimate | error | NCCL steps peak allocated | estimate | error |")
print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
for row in real:
    # The worst rank as headroom picks it: the most reserved, then the most allocated.
    worst = max(row["measured"]["ranks"], key=lambda r: (r["peak_reserved_bytes"], steps_peak(r), -r["rank"]))
    est = predicted[row["id"]]
    res, alloc = worst["peak_reserved_bytes"], steps_peak(worst)
    print(f"| `{short(row['id'])}` | {worst['rank']} | {est['worst_rank']['rank']} | {res:,} | "
          f"{est['peak_reserved_bytes']:,} | {100 * (est['peak_reserved_bytes'] - res) / res:+.2f}% | {alloc:,} | "
          f"{est['peak_allocated_bytes']:,} | {100 * (est['peak_allocated_bytes'] - alloc) / alloc:+.2f}% |")
