"""Command line of the measurement harness.

    python -m headroom_measure run SPEC [--catalog FILE] [--snapshot FILE] [--id ID]
    python -m headroom_measure batch SPECS.jsonl --out RESULTS.jsonl [--catalog FILE] [--jobs N]
    python -m headroom_measure trace SPEC --out TRACE.json[.gz] [--catalog FILE]
    python -m headroom_measure pipeline PIPELINE.yaml [--id ID] [--out FILE] [--snapshot FILE]
    torchrun --nproc-per-node N -m headroom_measure pipeline PIPELINE.yaml ...  (sharded instances)
    torchrun --nproc-per-node N -m headroom_measure dist SPEC --out FILE.jsonl [--id ID] [--snapshot FILE]

`run` measures one spec in this process and prints one calibration-format JSON line.
`pipeline` measures a pipeline: instances built in one process, phases of train / forward /
generate passes, host offload (see pipeline.py); it prints the record (rank 0 under torchrun).
`dist` measures a spec with a `parallel` block on N GPUs, one process each (see dist.py); rank 0
appends the record to --out and prints it. With `parallel.framework: megatron` it measures Megatron-core
on every rank under torchrun, or as one rank of a fake world (HEADROOM_FAKE_WORLD; see megatron.py).
`trace` runs the spec's steps under fake tensors on the CPU (no GPU needed) and writes a headroom
trace file (docs/trace-format.md) for `headroom trace` to replay through the allocator.
`batch` runs every line of SPECS.jsonl ({"id", "spec", optional "hint_bytes"}) in a fresh process
each, up to --jobs at once while their hinted peaks fit the GPU, and appends the records to --out.
Exit code 2 on a bad spec or a missing dependency, with a message saying what is missing.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from . import spec as specmod

DEFAULT_CATALOG = Path(__file__).resolve().parents[2] / "crates" / "headroom" / "data" / "models.json"


def load_catalog(path: str | None) -> dict:
    candidate = Path(path) if path else DEFAULT_CATALOG
    if not candidate.is_file():
        if path:
            raise specmod.SpecError(f"--catalog: {path} does not exist")
        return {}
    data = json.loads(candidate.read_text())
    return data.get("models", data)


def missing_dependencies() -> list[str]:
    missing = []
    for name in ("torch", "transformers"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    return missing


def _fail(message: str) -> int:
    print(f"error: {message}", file=sys.stderr)
    return 2


def cmd_run(args) -> int:
    try:
        spec = specmod.parse(json.loads(args.spec_json)) if args.spec_json else specmod.load(args.spec)
        fields = specmod.resolve_model_config(spec, load_catalog(args.catalog))
    except (specmod.SpecError, OSError, json.JSONDecodeError) as err:
        return _fail(str(err))
    if spec.parallel is not None and spec.parallel.framework == "megatron":
        return _fail(
            "framework megatron is measured by `dist`: under `torchrun --nproc-per-node "
            f"{spec.parallel.world_size} -m headroom_measure dist SPEC --out FILE`, or as rank 0 of a fake process "
            f"group: HEADROOM_FAKE_WORLD={spec.parallel.world_size} WORLD_SIZE={spec.parallel.world_size} RANK=0 "
            "LOCAL_RANK=0 python -m headroom_measure dist SPEC --out FILE"
        )
    missing = missing_dependencies()
    if missing:
        return _fail(
            f"{', '.join(missing)} not installed; `pip install torch transformers peft` "
            "(and bitsandbytes for nf4 / adamw-8bit) in this Python to measure"
        )
    if spec.expandable_segments:
        # Read when CUDA initialises, which has not happened yet in this process.
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(filter(None, [conf, "expandable_segments:True"]))
    import torch

    if not torch.cuda.is_available():
        return _fail("torch sees no CUDA GPU; `headroom measure` needs one (headroom estimate does not)")
    from .measure import measure

    record = measure(spec, fields, snapshot=args.snapshot, row_id=args.id, stacks=args.stacks)
    print(json.dumps(record), flush=True)
    return 0


def cmd_trace(args) -> int:
    from . import pipeline, trainers

    try:
        raw = json.loads(args.spec_json) if args.spec_json else specmod.load_raw(args.spec)
        if pipeline.is_pipeline(raw):
            return _trace_pipeline(raw, args)
        if isinstance(raw, dict) and "trainer" in raw:
            spec = trainers.parse(raw)
            fields = specmod.resolve_model_config(spec.base, load_catalog(args.catalog))
        else:
            spec = specmod.parse(raw)
            fields = specmod.resolve_model_config(spec, load_catalog(args.catalog))
    except (specmod.SpecError, OSError, json.JSONDecodeError) as err:
        return _fail(str(err))
    from .trace import TraceError, refuse_rank, refuse_untraceable, trace

    try:
        refuse_untraceable(spec)
        refuse_rank(spec.base if isinstance(spec, trainers.TrainerSpec) else spec, args.rank)
    except TraceError as err:
        return _fail(str(err))
    return _run_tracer(lambda progress: trace(spec, fields, args.out, progress=progress, rank=args.rank), "step")


def _run_tracer(run, unit: str) -> int:
    """`run(progress)` with the tracer's dependencies checked and its failures said plainly."""
    from .cuda_emulation import EmulationError
    from .trace import TraceError

    missing = missing_dependencies()
    if missing:
        return _fail(
            f"{', '.join(missing)} not installed; `headroom trace` runs the real model code under fake tensors: "
            "`pip install torch transformers peft` in this Python (or pass --python PATH to one that has them)"
        )

    def progress(step, steps):
        print(f"tracing {unit} {step} of {steps}", file=sys.stderr, flush=True)

    try:
        with _stdout_to_stderr():
            run(progress)
    except (TraceError, EmulationError) as err:
        return _fail(str(err))
    except Exception as err:  # noqa: BLE001 - the model's own code failed on fake tensors
        first_line = (str(err).strip().splitlines() or [""])[0][:300]
        return _fail(
            f"the run's code failed under fake tensors ({type(err).__name__}: {first_line}); an operator whose "
            "output shape depends on tensor values (nonzero, bincount) or a kernel without a fake implementation "
            "cannot be traced; `headroom estimate` models supported model types natively"
        )
    return 0


@contextlib.contextmanager
def _stdout_to_stderr():
    """What the traced libraries print goes to stderr, at the file descriptor: the tracer's
    output is its file, and the libraries write to stdout through handles they took when
    imported (DeepSpeed's logger, a trainer's metrics) or from C++."""
    sys.stdout.flush()
    saved = os.dup(1)
    os.dup2(2, 1)
    try:
        yield
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)


def _trace_pipeline(raw, args) -> int:
    """`trace` of a pipeline spec (trace_pipeline.py)."""
    from . import pipeline
    from .trace import TraceError
    from .trace_pipeline import Engines, refuse_untraceable_pipeline, trace_pipeline

    try:
        engines = Engines(raw)
        pipe = pipeline.parse_pipeline(engines.raw)
        catalog = load_catalog(args.catalog)
        fields = [specmod.resolve_model_config(inst.spec, catalog) for inst in pipe.instances]
        refuse_untraceable_pipeline(pipe)
    except (specmod.SpecError, TraceError) as err:
        return _fail(str(err))
    return _run_tracer(lambda progress: trace_pipeline(pipe, engines, raw, fields, args.out, progress=progress), "phase")


def cmd_pipeline(args) -> int:
    from . import pipeline

    try:
        raw, pipe = pipeline.load_pipeline(args.spec)
        catalog = load_catalog(args.catalog)
        fields = [specmod.resolve_model_config(inst.spec, catalog) for inst in pipe.instances]
    except (specmod.SpecError, OSError, json.JSONDecodeError) as err:
        return _fail(str(err))
    world = pipe.world_size
    started = int(os.environ.get("WORLD_SIZE", "0"))
    if world and started != world and not (world == 1 and started == 0):
        return _fail(
            f"the sharded instances' `parallel.world_size` is {world} but WORLD_SIZE is {started or 'unset'}; "
            f"start it with `torchrun --nproc-per-node {world} -m headroom_measure pipeline ...`"
        )
    if not world and started > 1:
        return _fail(f"no instance has `parallel` but WORLD_SIZE is {started}; run it without torchrun")
    missing = missing_dependencies()
    if missing:
        return _fail(f"{', '.join(missing)} not installed; `pip install torch transformers peft` to measure")
    record = pipeline.measure_pipeline(
        pipe, fields, args.id or Path(args.spec).stem, raw, snapshot=args.snapshot, stacks=args.stacks
    )
    if record is not None:
        line = json.dumps(record)
        if args.out:
            with open(args.out, "a") as out:
                out.write(line + "\n")
        print(line, flush=True)
    return 0


def cmd_dist(args) -> int:
    try:
        spec = specmod.parse(json.loads(args.spec_json)) if args.spec_json else specmod.load(args.spec)
        if spec.parallel is None:
            raise specmod.SpecError("`parallel`: `dist` needs a spec with a parallel block {strategy, world_size}")
        fields = specmod.resolve_model_config(spec, load_catalog(args.catalog))
    except (specmod.SpecError, OSError, json.JSONDecodeError) as err:
        return _fail(str(err))
    world = int(os.environ.get("WORLD_SIZE", "0"))
    if world != spec.parallel.world_size:
        return _fail(
            f"`parallel.world_size` is {spec.parallel.world_size} but WORLD_SIZE is {world or 'unset'}; "
            f"start it with `torchrun --nproc-per-node {spec.parallel.world_size} -m headroom_measure dist ...`"
        )
    missing = missing_dependencies()
    if spec.parallel.strategy.startswith("zero"):
        try:
            __import__("deepspeed")
        except ImportError:
            missing.append("deepspeed")
    if missing:
        return _fail(f"{', '.join(missing)} not installed; `pip install torch transformers deepspeed` to measure")
    if spec.expandable_segments:
        conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = ",".join(filter(None, [conf, "expandable_segments:True"]))
    if spec.parallel.framework == "megatron":
        from .megatron import megatron_options, measure_megatron

        try:
            megatron_options(spec)
            __import__("megatron.core")
        except specmod.SpecError as err:
            return _fail(str(err))
        except ImportError:
            return _fail("megatron-core not installed; `pip install megatron-core==0.19.0` to measure framework megatron")
        if spec.parallel.pp > 1:
            from .megatron_pp import measure_megatron_pp

            record = measure_megatron_pp(spec, fields, row_id=args.id, snapshot=args.snapshot, stacks=args.stacks)
        else:
            record = measure_megatron(spec, fields, row_id=args.id, snapshot=args.snapshot, stacks=args.stacks)
    else:
        from .dist import measure_dist

        record = measure_dist(spec, fields, row_id=args.id, snapshot=args.snapshot, stacks=args.stacks)
    if record is not None:
        line = json.dumps(record)
        with open(args.out, "a") as out:
            out.write(line + "\n")
        print(line, flush=True)
    return 0


def _child_command(line: dict, catalog: str | None, snapshot_dir: str | None) -> list[str]:
    cmd = [sys.executable, "-m", "headroom_measure", "run", "--spec-json", json.dumps(line["spec"])]
    if line.get("id"):
        cmd += ["--id", line["id"]]
    if catalog:
        cmd += ["--catalog", catalog]
    if snapshot_dir and line.get("snapshot"):
        cmd += ["--snapshot", str(Path(snapshot_dir) / line["snapshot"])]
        if line.get("stacks"):
            cmd += ["--stacks", line["stacks"]]
    return cmd


def cmd_batch(args) -> int:
    lines = [json.loads(l) for l in Path(args.specs).read_text().splitlines() if l.strip()]
    budget = args.budget_gib * 2**30
    pending = list(lines)
    running: list[tuple[subprocess.Popen, dict, float]] = []
    out = open(args.out, "a")
    started = time.time()
    done = failed = 0

    def in_use() -> int:
        return sum(int(l.get("hint_bytes", budget)) for _, l, _ in running)

    def quantized(line: dict) -> bool:
        # 4-bit rows write a bf16 checkpoint to disk first: one at a time.
        return bool(line["spec"].get("quantization"))

    while pending or running:
        # Start what fits: one at a time when hints are missing; the largest first otherwise.
        while pending and len(running) < args.jobs:
            fits = [
                l
                for l in pending
                if not (running and in_use() + int(l.get("hint_bytes", budget)) > budget)
                and not (quantized(l) and any(quantized(r) for _, r, _ in running))
            ]
            if not fits:
                break
            line = fits[0]
            pending.remove(line)
            env = dict(os.environ)
            env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1]) + os.pathsep + env.get("PYTHONPATH", "")
            alloc = (line["spec"].get("allocator") or {}).get("expandable_segments")
            env["PYTORCH_CUDA_ALLOC_CONF"] = "expandable_segments:True" if alloc else ""
            if len(running) > 0 or args.jobs > 1:
                env["HEADROOM_SHARED_GPU"] = "1"
            proc = subprocess.Popen(
                _child_command(line, args.catalog, args.snapshot_dir),
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
            )
            running.append((proc, line, time.time()))
        time.sleep(0.2)
        for item in list(running):
            proc, line, t0 = item
            if proc.poll() is None:
                continue
            running.remove(item)
            stdout, stderr = proc.communicate()
            if proc.returncode == 0 and stdout.strip():
                out.write(stdout.strip().splitlines()[-1] + "\n")
                out.flush()
                done += 1
                status = "ok"
            else:
                failed += 1
                status = f"FAILED rc={proc.returncode}: {stderr.strip().splitlines()[-1] if stderr.strip() else ''}"
                with open(args.out + ".errors", "a") as err:
                    err.write(json.dumps({"id": line.get("id"), "rc": proc.returncode, "stderr": stderr[-4000:]}) + "\n")
            print(
                f"[{done + failed}/{len(lines)} {time.time() - started:6.0f}s] {line.get('id')}: "
                f"{status} ({time.time() - t0:.0f}s)",
                flush=True,
            )
    out.close()
    return 0 if failed == 0 else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="headroom_measure", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="measure one run spec")
    run.add_argument("spec", nargs="?")
    run.add_argument("--spec-json", help="the spec inline, as JSON")
    run.add_argument("--catalog")
    run.add_argument("--snapshot", help="write a torch.cuda.memory snapshot of the run here")
    run.add_argument("--stacks", default="python", choices=["python", "all"], help="frames kept in the snapshot")
    run.add_argument("--id")
    pipe = sub.add_parser("pipeline", help="measure a pipeline: several models, phases of passes")
    pipe.add_argument("spec", help="a pipeline, YAML or JSON")
    pipe.add_argument("--catalog")
    pipe.add_argument("--snapshot", help="rank 0 writes a memory snapshot here; with {rank} in it, every rank")
    pipe.add_argument(
        "--stacks", default="python", choices=["python", "all", "none"], help="frames kept in the snapshot"
    )
    pipe.add_argument("--out", help="(rank 0) append the record here too")
    pipe.add_argument("--id")
    dst = sub.add_parser("dist", help="measure a parallel spec, one process per GPU (under torchrun)")
    dst.add_argument("spec", nargs="?")
    dst.add_argument("--spec-json", help="the spec inline, as JSON")
    dst.add_argument("--out", required=True, help="rank 0 appends the record here")
    dst.add_argument("--catalog")
    dst.add_argument("--snapshot", help="rank 0 writes a torch.cuda.memory snapshot here; with {rank} in it, every rank")
    dst.add_argument(
        "--stacks", default="python", choices=["python", "all", "none"], help="frames kept in the snapshot"
    )
    dst.add_argument("--id")
    trc = sub.add_parser("trace", help="trace a spec's steps under fake tensors on the CPU")
    trc.add_argument("spec", nargs="?")
    trc.add_argument("--spec-json", help="the spec inline, as JSON")
    trc.add_argument("--out", required=True, help="the trace file to write (.json or .json.gz)")
    trc.add_argument("--catalog")
    trc.add_argument(
        "--rank", type=int, default=0, help="the rank of a sharded spec's world to trace (a pipeline's stages differ)"
    )
    batch = sub.add_parser("batch", help="measure many specs, a fresh process each")
    batch.add_argument("specs")
    batch.add_argument("--out", required=True)
    batch.add_argument("--catalog")
    batch.add_argument("--jobs", type=int, default=1)
    batch.add_argument("--budget-gib", type=float, default=120.0)
    batch.add_argument("--snapshot-dir")
    args = parser.parse_args(argv)
    if args.command == "run":
        if not args.spec and not args.spec_json:
            parser.error("run needs SPEC or --spec-json")
        return cmd_run(args)
    if args.command == "pipeline":
        return cmd_pipeline(args)
    if args.command == "trace":
        if not args.spec and not args.spec_json:
            parser.error("trace needs SPEC or --spec-json")
        return cmd_trace(args)
    if args.command == "dist":
        if not args.spec and not args.spec_json:
            parser.error("dist needs SPEC or --spec-json")
        return cmd_dist(args)
    return cmd_batch(args)


if __name__ == "__main__":
    sys.exit(main())
