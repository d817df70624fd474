"""Summarise a torch.cuda.memory snapshot (plain or gzip pickle; no torch needed):
the allocated-bytes peak over the trace and the blocks live at it, with their Python frames,
plus every allocation >= BIG bytes over the trace (step-by-step order) with frames.

    python3 snappeak.py SNAP.pickle[.gz] > SUMMARY.json
    python3 snappeak.py --diff A.json B.json      # what is live at the peak in one and not the other
"""
import collections
import gzip
import json
import pickle
import re
import sys

MIN = 1 << 20  # blocks listed at the peak
BIG = 64 << 20  # allocations listed over the trace
SKIP = ("<frozen", "importlib", "runpy", "/torch/utils/_device.py", "/torch/nn/modules/module.py",
        "/torch/_tensor.py", "/torch/autograd/__init__.py", "/torch/utils/_contextlib.py",
        "/torch/utils/checkpoint.py:_checkpoint_hook", "/torch/amp/autocast_mode.py",
        "/torch/_compile.py", "/torch/_dynamo/", "functools.py")


def norm(path):
    for marker in ("site-packages/", "/tmp/site/"):
        if marker in path:
            return path.split(marker, 1)[1]
    return re.sub(r"^.*/python/headroom_measure/", "headroom_measure/", path)


def frames_of(e, n=10):
    out = []
    for f in e.get("frames") or []:
        loc = f"{norm(f['filename'])}:{f['line']}:{f['name']}"
        if any(s in f["filename"] or s in loc for s in SKIP):
            continue
        out.append(loc)
        if len(out) >= n:
            break
    return out


def phase_of(frames):
    """Step phase from the harness frame (line numbers differ between harness copies, names not)."""
    for f in frames:
        if f.startswith("headroom_measure/measure.py"):
            func = f.rsplit(":", 1)[1]
            if func in ("_train_forward", "_logprob_forward"):
                return "forward"
            if func in ("_build", "_prepare", "_hf_config"):
                return "build"
            return "measure:" + f.split(":")[1]
    return "no-python-stack (autograd engine: backward)" if not frames else "other"


def load(path):
    op = gzip.open if path.endswith(".gz") else open
    with op(path, "rb") as fh:
        return pickle.load(fh)


def summarise(path):
    snap = load(path)
    trace = snap["device_traces"][0]
    live = {}
    total = peak = 0
    peak_i = -1
    peak_live = None
    big = []
    step_marks = []  # (index, total) at each harness forward start: first alloc in _train_forward after a gap
    for i, e in enumerate(trace):
        a = e["action"]
        if a == "alloc":
            live[e["addr"]] = (e["size"], i)
            total += e["size"]
            if e["size"] >= BIG:
                fr = frames_of(e, 100)
                big.append({"i": i, "size": e["size"], "phase": phase_of(fr), "frames": fr[:10]})
            if total > peak:
                peak, peak_i = total, i
                peak_live = None  # materialised lazily below
        elif a == "free_completed":
            if e["addr"] in live:
                total -= live.pop(e["addr"])[0]
    # Second pass to the peak for the live set (cheap: traces are small).
    live = {}
    for i, e in enumerate(trace[: peak_i + 1]):
        if e["action"] == "alloc":
            live[e["addr"]] = i
        elif e["action"] == "free_completed":
            live.pop(e["addr"], None)
    # Where each block live at the peak is freed (the frame of its free_requested, if any).
    freed_at = {}
    pending = set(live)
    for j, e in enumerate(trace[peak_i + 1 :], start=peak_i + 1):
        if e["action"] == "free_requested" and e["addr"] in pending and e["addr"] not in freed_at:
            freed_at[e["addr"]] = (j, frames_of(e, 4))
    blocks = []
    for addr, i in live.items():
        e = trace[i]
        fr = frames_of(e, 100)
        blocks.append({
            "i": i, "size": e["size"], "phase": phase_of(fr), "frames": fr[:10],
            "freed_i": freed_at.get(addr, (None, []))[0], "freed_frames": freed_at.get(addr, (None, []))[1],
        })
    blocks.sort(key=lambda b: -b["size"])
    by_site = collections.defaultdict(lambda: [0, 0])
    for b in blocks:
        key = (b["frames"][0] if b["frames"] else "<no stack>")
        by_site[key][0] += b["size"]
        by_site[key][1] += 1
    pe = trace[peak_i]
    return {
        "file": path,
        "trace_entries": len(trace),
        "peak_allocated_in_trace": peak,
        "peak_index": peak_i,
        "peak_event": {"size": pe["size"], "phase": phase_of(frames_of(pe, 100)), "frames": frames_of(pe, 14)},
        "live_at_peak_total": sum(b["size"] for b in blocks),
        "live_at_peak_count": len(blocks),
        "live_at_peak_by_site": sorted(
            ({"site": k, "bytes": v[0], "blocks": v[1]} for k, v in by_site.items()), key=lambda d: -d["bytes"]
        ),
        "live_at_peak_blocks_ge_1MiB": [b for b in blocks if b["size"] >= MIN],
        "allocs_ge_64MiB": big,
    }


def diff(a_path, b_path):
    A, B = json.load(open(a_path)), json.load(open(b_path))
    print(f"A {A['file']}: peak {A['peak_allocated_in_trace']} at entry {A['peak_index']} ({A['peak_event']['phase']})")
    print(f"B {B['file']}: peak {B['peak_allocated_in_trace']} at entry {B['peak_index']} ({B['peak_event']['phase']})")
    print(f"B - A = {B['peak_allocated_in_trace'] - A['peak_allocated_in_trace']}")
    ca = collections.Counter(b["size"] for b in A["live_at_peak_blocks_ge_1MiB"])
    cb = collections.Counter(b["size"] for b in B["live_at_peak_blocks_ge_1MiB"])
    for name, X, only in (("only in A", A, ca - cb), ("only in B", B, cb - ca)):
        print(f"-- live at peak, >= 1 MiB, {name}: {sum(s * n for s, n in only.items())} bytes")
        for size, n in sorted(only.items(), key=lambda kv: -kv[0] * kv[1]):
            ex = next(b for b in X["live_at_peak_blocks_ge_1MiB"] if b["size"] == size)
            print(f"   {n} x {size} ({ex['phase']}) {' <- '.join(ex['frames'][:6])}")
            if ex.get("freed_frames"):
                print(f"      freed at {' <- '.join(ex['freed_frames'][:3])}")
    print("-- peak event frames A:", " <- ".join(A["peak_event"]["frames"][:8]))
    print("-- peak event frames B:", " <- ".join(B["peak_event"]["frames"][:8]))


if __name__ == "__main__":
    if sys.argv[1] == "--diff":
        diff(sys.argv[2], sys.argv[3])
    else:
        json.dump(summarise(sys.argv[1]), sys.stdout, indent=1)
