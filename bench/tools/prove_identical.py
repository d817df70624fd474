#!/usr/bin/env python3
"""Every output a speed change must leave byte-identical, written by one `headroom` binary.

    bench/tools/prove_identical.py BINARY OUTDIR        # write the outputs
    bench/tools/prove_identical.py --compare REF NEW    # the directories must match

Run it with the binary before a change (the reference) and after, then compare: speed work on
the simulator (bench/PERFORMANCE.md) may change no byte of what it reports. Written per spec:
`estimate --json` without a limit, on an H200 and on an H100-80GB, the plain table, and the
sha256 of `--timeline` (every simulated allocation and free) unlimited and on an H100-80GB.
The specs: every row with a `spec` of the JSON-lines files under bench/, the YAML examples
(pipelines included), the spec of each `*.spec.json` beside the distributed runs' snapshots and
the three specs of the criterion bench. Also `validate --json` of the measured corpus,
`replay --json` of every snapshot under its recorded allocator config and three others, and
`fit --json` of the examples on one H100 and on four A100-40GB.
"""

import argparse
import concurrent.futures
import filecmp
import hashlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

BENCH_SPECS = {
    "bench-70b-full": {"model": "llama-3.1-70b", "precision": "amp-bf16", "optimizer": "adamw",
                       "batch_size": 1, "seq_len": 4096, "gradient_checkpointing": True},
    "bench-70b-qlora": {"model": "llama-3.1-70b", "precision": "bf16", "quantization": "nf4",
                        "kbit_prepare": True, "batch_size": 1, "seq_len": 4096,
                        "gradient_checkpointing": True,
                        "lora": {"r": 16, "alpha": 32, "targets": "all-linear",
                                 "dropout": 0.05}},
    "bench-72b-lora": {"model": "qwen2.5-72b", "precision": "bf16", "batch_size": 2,
                       "seq_len": 2048,
                       "lora": {"r": 16, "alpha": 32, "targets": "all-linear",
                                "dropout": 0.05}},
}

ALLOC_CONFS = [None, "expandable_segments:True", "max_split_size_mb:64",
               "roundup_power2_divisions:4"]


def run(binary, args):
    """stdout, stderr and exit status of one call, as text."""
    p = subprocess.run([binary, *args], capture_output=True, text=True)
    return f"rc {p.returncode}\n--- stdout\n{p.stdout}--- stderr\n{p.stderr}"


def spec_files(tmp):
    """(name, path) of every spec: JSON-lines rows written out, examples, bench specs."""
    specs = []
    for jsonl in sorted(ROOT.glob("bench/**/*.jsonl")):
        rel = jsonl.relative_to(ROOT)
        for n, line in enumerate(jsonl.read_text().splitlines()):
            if not line.strip():
                continue
            spec = json.loads(line).get("spec")
            if spec is None:
                continue
            # A model given as a file is found next to the rows.
            model = spec.get("model")
            if isinstance(model, str) and (jsonl.parent / model).is_file():
                spec["model"] = str(jsonl.parent / model)
            name = f"{str(rel).replace('/', '_')}-{n:03d}"
            path = tmp / f"{name}.json"
            path.write_text(json.dumps(spec))
            specs.append((name, path))
    for example in sorted(ROOT.glob("examples/*.yaml")):
        specs.append((f"examples_{example.stem}", example))
    # A snapshot's spec line (`{"id", "spec", ...}`): its spec is what was run.
    for line in sorted(ROOT.glob("bench/distributed/*/*.spec.json")):
        rel = line.relative_to(ROOT / "bench")
        name = str(rel.with_suffix("")).replace("/", "_")
        path = tmp / f"{name}.json"
        path.write_text(json.dumps(json.loads(line.read_text())["spec"]))
        specs.append((name, path))
    for name, spec in BENCH_SPECS.items():
        path = tmp / f"{name}.json"
        path.write_text(json.dumps(spec))
        specs.append((name, path))
    return specs


def timeline_hash(binary, spec, tmp, extra):
    """sha256 of `estimate --timeline` (with `extra` arguments), or why there is none."""
    with tempfile.NamedTemporaryFile(dir=tmp, suffix=".jsonl") as f:
        out = run(binary, ["estimate", str(spec), "--json", "--timeline", f.name, *extra])
        digest = hashlib.sha256(Path(f.name).read_bytes()).hexdigest()
    return f"{digest}\n{out}"


def estimate_outputs(binary, name, spec, tmp):
    text = []
    for title, args in [
        ("json", ["--json"]),
        ("json h200", ["--json", "--gpu", "h200"]),
        ("json h100-80gb", ["--json", "--gpu", "h100-80gb"]),
        ("table h200", ["--gpu", "h200"]),
    ]:
        text.append(f"=== estimate {title}\n{run(binary, ['estimate', str(spec), *args])}")
    text.append(f"=== timeline\n{timeline_hash(binary, spec, tmp, [])}")
    text.append(f"=== timeline h100-80gb\n{timeline_hash(binary, spec, tmp, ['--gpu', 'h100-80gb'])}")
    # Messages that name the spec name its temporary folder, which differs between sittings.
    return name, "".join(text).replace(str(tmp), "$TMP")


def replay_outputs(binary, snapshot):
    text = []
    for conf in ALLOC_CONFS:
        args = ["replay", str(snapshot), "--json"]
        if conf:
            args += ["--alloc-conf", conf]
        text.append(f"=== replay {conf}\n{run(binary, args)}")
    return "".join(text)


def write_outputs(binary, out):
    binary = str(Path(binary).resolve())
    out.mkdir(parents=True, exist_ok=False)
    with tempfile.TemporaryDirectory() as d, concurrent.futures.ThreadPoolExecutor(
        os.cpu_count() or 2
    ) as pool:
        tmp = Path(d)
        specs = spec_files(tmp)
        jobs = [pool.submit(estimate_outputs, binary, n, s, tmp) for n, s in specs]
        for job in jobs:
            name, text = job.result()
            (out / f"estimate-{name}.txt").write_text(text)
        for snapshot in sorted(ROOT.glob("bench/**/*.pickle.gz")):
            name = str(snapshot.relative_to(ROOT)).replace("/", "_")
            (out / f"replay-{name}.txt").write_text(replay_outputs(binary, snapshot))
        corpus = sorted(
            str(p) for p in ROOT.glob("bench/**/*.jsonl")
            if any("measured" in json.loads(line) for line in p.read_text().splitlines()
                   if line.strip())
        )
        (out / "validate.txt").write_text(run(binary, ["validate", *corpus, "--json"]))
        for example in sorted(ROOT.glob("examples/*.yaml")):
            text = run(binary, ["fit", str(example), "--gpu", "h100-80gb", "--json"])
            text += run(binary, ["fit", str(example), "--gpu", "a100-40gb", "--gpus", "4",
                                 "--json"])
            (out / f"fit-{example.stem}.txt").write_text(text)
    print(f"{len(list(out.iterdir()))} files in {out} ({len(specs)} specs)")


def compare(ref, new):
    names = sorted({p.name for p in ref.iterdir()} | {p.name for p in new.iterdir()})
    differ = [n for n in names
              if not ((ref / n).is_file() and (new / n).is_file()
                      and filecmp.cmp(ref / n, new / n, shallow=False))]
    for n in differ:
        print(f"differs: {n}")
    print(f"{len(names) - len(differ)} of {len(names)} files identical")
    return 1 if differ else 0


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--compare", action="store_true", help="compare two output directories")
    parser.add_argument("first", type=Path, help="the binary (or the reference directory)")
    parser.add_argument("second", type=Path, help="the output directory (or the new one)")
    args = parser.parse_args()
    if args.compare:
        return compare(args.first, args.second)
    write_outputs(args.first, args.second)
    return 0


if __name__ == "__main__":
    sys.exit(main())
