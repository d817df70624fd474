#!/usr/bin/env python3
"""Compare headroom's simulated timeline with a real allocation trace.

    compare_timeline.py SNAPSHOT.pickle TIMELINE.jsonl [--context N] [--max N]

SNAPSHOT is a torch.cuda.memory._dump_snapshot of the same run (headroom_measure --snapshot),
TIMELINE what `headroom estimate SPEC --timeline FILE` wrote. Both become sequences of
(+/-, bytes); the script aligns them (difflib) and prints each differing stretch with the
simulator's labels and the real Python frames, so the missing or extra tensor can be named.
"""

import argparse
import difflib
import gzip
import json
import pickle


def is_internal(filename):
    """torch's own frames and Python's `<...>` ones; the packages that call torch are what names a
    tensor. Matched by the installed package path, not a bare "torch/", which the device's
    /opt/torch/.venv would match for every package."""
    return "<" in filename or "/site-packages/torch/" in filename or filename.startswith("torch/")


def real_events(path):
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        snap = pickle.load(f)
    out = []
    # A rank's snapshot holds its own device's trace (the others are empty).
    trace = next((t for t in snap["device_traces"] if t), [])
    for e in trace:
        if e["action"] not in ("alloc", "free_completed"):
            continue
        frames = [fr for fr in e.get("frames", []) if not is_internal(fr["filename"])]
        where = " < ".join(f"{fr['filename'].split('/')[-1]}:{fr['line']}:{fr['name']}" for fr in frames[:2])
        out.append(("+" if e["action"] == "alloc" else "-", e["size"], where))
    return out


def sim_events(path):
    out = []
    for line in open(path):
        e = json.loads(line)
        out.append(("+" if e["alloc"] else "-", e["bytes"], e["label"]))
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("snapshot")
    ap.add_argument("timeline")
    ap.add_argument("--max", type=int, default=15, help="differing stretches to print")
    ap.add_argument("--skip", type=int, default=0, help="real events to skip (model build, imports)")
    args = ap.parse_args()
    real = real_events(args.snapshot)[args.skip:]
    sim = sim_events(args.timeline)
    a = [(s, b) for s, b, _ in real]
    b = [(s, b) for s, b, _ in sim]
    sm = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
    print(f"real {len(a)} events, simulated {len(b)}, similarity {sm.ratio():.4f}")
    shown = 0
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag == "equal":
            continue
        shown += 1
        if shown > args.max:
            break
        print(f"--- {tag} real[{i1}:{i2}] sim[{j1}:{j2}]")
        for s, size, where in real[i1:min(i2, i1 + 12)]:
            print(f"   real {s}{size:>12}  {where}")
        for s, size, label in sim[j1:min(j2, j1 + 12)]:
            print(f"   sim  {s}{size:>12}  {label}")


if __name__ == "__main__":
    main()
