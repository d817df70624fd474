"""PyTorch's own estimate of the same rows: `MemTracker` under `FakeTensorMode`, the run's real
code on fake CUDA tensors (a machine with a CUDA GPU is needed for the backward: the autograd
engine asks the driver for a context; no GPU memory is used).

    python bench/trace/tools/memtracker_rows.py ROWS.jsonl... --out FILE.jsonl [--jobs N]

One JSON line per row: the row id, MemTracker's peak (its "Total" over the steps, the number
its documentation reports) and the wall time.
"""

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def child(spec_json: str) -> dict:
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.mem_tracker import MemTracker

    sys.path.insert(0, str(ROOT / "python"))
    from headroom_measure import measure as m
    from headroom_measure import spec as specmod
    from headroom_measure.__main__ import load_catalog

    spec = specmod.parse(json.loads(spec_json))
    fields = specmod.resolve_model_config(spec, load_catalog(None))
    t0 = time.time()
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = m._prepare(spec, m._build(spec, m._hf_config(spec, fields), device="cuda"))
        trainable = [p for p in model.parameters() if p.requires_grad]
        train = spec.mode == "train"
        optimizer = m._optimizer(spec, trainable) if train else None
        dtype = {"amp-bf16": torch.bfloat16, "bf16": torch.bfloat16, "amp-fp16": torch.float16}.get(spec.precision)
        ids = torch.randint(0, fields["vocab_size"], (spec.batch_size, spec.seq_len), device="cuda")

        def autocast():
            return torch.autocast("cuda", dtype=dtype) if dtype else torch.autocast("cuda", enabled=False)

        tracker = MemTracker()
        tracker.track_external(model, *([optimizer] if optimizer else []))
        with tracker:
            for _ in range(3):
                if train:
                    loss = m._train_forward(spec, model, ids, autocast)
                    loss.backward()
                    del loss
                    if optimizer is not None:
                        optimizer.step()
                        optimizer.zero_grad(set_to_none=True)
                else:
                    with torch.no_grad():
                        m._logprob_forward(model, ids, autocast)
                tracker.reset_mod_stats()
        peak = max(v["Total"] for v in tracker.get_tracker_snapshot("peak").values())
    return {"memtracker_peak_bytes": int(peak), "memtracker_wall_s": round(time.time() - t0, 1)}


def run_row(row):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "python"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, __file__, "--child", json.dumps(row["spec"])], capture_output=True, text=True, env=env
    )
    if proc.returncode:
        return {"id": row["id"], "error": (proc.stderr.strip().splitlines() or [""])[-1]}
    return {"id": row["id"], **json.loads(proc.stdout.strip().splitlines()[-1])}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("rows", nargs="*")
    parser.add_argument("--out")
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--child")
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child)))
        return
    rows = [json.loads(line) for path in args.rows for line in open(path) if line.strip()]
    with open(args.out, "a") as out, ThreadPoolExecutor(args.jobs) as pool:
        for result in pool.map(run_row, rows):
            out.write(json.dumps(result) + "\n")
            out.flush()
            print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
