"""The blocks live at the allocated peak of a torch.cuda.memory snapshot, and of a headroom timeline, grouped by
who allocated them, so the two can be set side by side. Works on a trace cut by max_entries: the allocated
bytes are rebuilt backwards from the blocks active at the dump (`segments`), so they are absolute, and a block
allocated before the trace began is named by the frames of its free.

    python3 peak_live.py SNAPSHOT.pickle.gz [--min BYTES] [--frames N]
    python3 peak_live.py TIMELINE.jsonl [--min BYTES]          (headroom estimate SPEC --timeline FILE)
    python3 peak_live.py SNAPSHOT.pickle.gz --at-peak-of TIMELINE.jsonl ...   (both, one after the other)
"""
import argparse
import collections
import gzip
import json
import pickle

SKIP = ("<frozen", "importlib", "runpy", "/torch/", "functools.py", "threading.py", "contextlib.py")


def where(frames, n):
    out = []
    for f in frames or []:
        if not f["filename"].endswith(".py") or any(s in f["filename"] for s in SKIP):
            continue
        name = f["filename"]
        for marker in ("site-packages/", "/tmp/site/", "/tmp/sites/"):
            if marker in name:
                name = name.split(marker, 1)[1]
        out.append(f"{name.split('/', 1)[-1] if name.startswith('site-') else name}:{f['line']}:{f['name']}")
        if len(out) >= n:
            break
    return " < ".join(out) or "<no python stack: autograd engine>"


def snapshot(path, nframes, min_bytes):
    with (gzip.open if path.endswith(".gz") else open)(path, "rb") as fh:
        snap = pickle.load(fh)
    trace = next((t for t in snap["device_traces"] if t), [])
    end_live = {}
    for seg in snap["segments"]:
        for b in seg["blocks"]:
            if b["state"] != "inactive":
                end_live[b["address"]] = b["size"]
    total = sum(end_live.values())
    # Walk backwards: totals[i] = allocated just after event i.
    totals = [0] * len(trace)
    for i in range(len(trace) - 1, -1, -1):
        totals[i] = total
        e = trace[i]
        if e["action"] == "alloc":
            total -= e["size"]
        elif e["action"] == "free_completed":
            total += e["size"]
    peak_i = max(range(len(trace)), key=lambda i: totals[i])
    # Live at the peak: allocated at or before peak_i (in the trace or before it) and not freed by then.
    live = {}
    for e in trace[: peak_i + 1]:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], e.get("frames"), "alloc")
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    allocated_later = set()
    freed_frames = {}
    for e in trace[peak_i + 1:]:
        if e["action"] == "alloc":
            allocated_later.add(e["addr"])
        elif e["action"] == "free_requested" and e["addr"] not in freed_frames:
            freed_frames[e["addr"]] = e.get("frames")
        elif e["action"] == "free_completed" and e["addr"] not in live and e["addr"] not in allocated_later:
            live[e["addr"]] = (e["size"], freed_frames.get(e["addr"]), "freed-later (allocated before the trace)")
    for addr, size in end_live.items():
        if addr not in live and addr not in allocated_later:
            live[addr] = (size, None, "alive at the dump (allocated before the trace)")
    groups = collections.defaultdict(lambda: [0, 0, collections.Counter()])
    for addr, (size, frames, how) in live.items():
        key = where(frames, nframes) if frames else how
        g = groups[key]
        g[0] += size
        g[1] += 1
        g[2][size] += 1
    print(f"{path}: {len(trace)} events, peak allocated {totals[peak_i]:,} at event {peak_i} "
          f"({trace[peak_i]['action']} {trace[peak_i]['size']:,} at {where(trace[peak_i].get('frames'), nframes)})")
    report(groups, min_bytes)


def timeline(path, min_bytes):
    live = {}
    total = peak = 0
    peak_live = {}
    events = [json.loads(line) for line in open(path)]
    peak_i = 0
    for i, e in enumerate(events):
        if e["alloc"]:
            total += e["bytes"]
            if total > peak:
                peak, peak_i = total, i
        else:
            total -= e["bytes"]
    for e in events[: peak_i + 1]:
        key = (e["address"], e["bytes"])
        if e["alloc"]:
            live[e["address"]] = (e["bytes"], e["label"], e.get("component"))
        else:
            live.pop(e["address"], None)
    groups = collections.defaultdict(lambda: [0, 0, collections.Counter()])
    for addr, (size, label, comp) in live.items():
        g = groups[f"[{comp}] {label}"]
        g[0] += size
        g[1] += 1
        g[2][size] += 1
    print(f"{path}: {len(events)} events, peak allocated {peak:,} at event {peak_i} ({events[peak_i]['label']})")
    report(groups, min_bytes)


def report(groups, min_bytes):
    rows = sorted(groups.items(), key=lambda kv: -kv[1][0])
    shown = 0
    for key, (size, n, sizes) in rows:
        if size < min_bytes:
            continue
        shown += size
        common = ", ".join(f"{c} x {s:,}" for s, c in sizes.most_common(3))
        print(f"  {size:>15,} {n:>6} blocks ({common})  {key}")
    rest = sum(v[0] for k, v in rows) - shown
    print(f"  {rest:>15,}        in groups under {min_bytes:,} B")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--min", type=int, default=16 << 20)
    ap.add_argument("--frames", type=int, default=3)
    args = ap.parse_args()
    for f in args.files:
        if f.endswith(".jsonl"):
            timeline(f, args.min)
        else:
            snapshot(f, args.frames, args.min)


if __name__ == "__main__":
    main()
