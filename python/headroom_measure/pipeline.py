"""Measure a pipeline: several models in one process per GPU (RLHF, GRPO, DPO, reward scoring),
and the phases of an iteration that run passes of them.

    python -m headroom_measure pipeline PIPELINE.yaml [--id ID] [--out FILE.jsonl] [--snapshot FILE]
    torchrun --nproc-per-node N -m headroom_measure pipeline PIPELINE.yaml ...   (sharded instances)

The format is the one `headroom estimate` reads (crates/headroom/src/spec/pipeline.rs):

```yaml
instances:
  - {name: actor, model: qwen2.5-1.5b, precision: amp-bf16, batch_size: 4, seq_len: 1024}
  - {name: ref, model: qwen2.5-1.5b, precision: bf16, mode: forward, batch_size: 4, seq_len: 1024, home: cpu}
  - {name: scorer, shares: actor}           # the same model object under a second name
phases:
  - {name: rollout, run: [{instance: actor, pass: generate, new_tokens: 256}]}
  - {name: ref_logprob, run: [ref], offload: [actor]}
  - {name: train, run: [actor]}
iterations: 3
```

The older form `{policy, reference, placement, iterations}` (bench/pipelines/*.json) is read as the
two-instance pipeline it describes: instances `policy` (train) and `reference` (mode forward),
phases `ref_logprob` (the reference's forward pass) and `train` (a policy step). `resident`: the
reference is built on the GPU. `manual-offload`: it is built on the host (`home: cpu`) and
`ref_logprob` offloads the policy. `fsdp2-offload`: it is built on the host and wrapped with FSDP2
`CPUOffloadPolicy` in a one-process group (below).

Exactly what the harness does, in this order (the estimator's simulator copies it):

* Process: with a sharded instance (`parallel`: ddp, fsdp, fsdp1 or zero1-3) the pipeline runs under
  `torchrun --nproc-per-node world_size`, every rank running all of it: `torch.cuda.set_device(LOCAL_RANK)`,
  `dist.init_process_group("nccl", device_id=...)` as dist.py does. With `HEADROOM_FAKE_WORLD=W` (and
  WORLD_SIZE=W) one process runs rank 0 of a world of W under torch's fake process group instead
  (a DDP instance's all-reduce hook then hands back the bucket itself: `_bucket_as_reduced`). Then `torch.zeros(1)` on the
  device; `cuda_context_bytes` is total - free after it. With --snapshot,
  `torch.cuda.memory._record_memory_history(max_entries=10_000_000, stacks="python")` next
  (rank 0 only, or every rank when the path holds `{rank}`).
* `load` (one measured phase; the peak counters are reset after `torch.zeros(1)`): the instances
  in list order (an alias, `shares:`, builds nothing), each as the single-run harness builds it:
  - `home: gpu`, no `parallel`: `measure._build` (`from_config` under `torch.device("cuda")`,
    bf16 parameters for bf16, fp32 otherwise; nf4 through a bf16 checkpoint), then
    `measure._prepare`: kbit_prepare, LoRA (`get_peft_model`), gradient checkpointing
    (`gradient_checkpointing_enable(use_reentrant=False)`, `enable_input_require_grads()`).
  - `home: cpu`: `from_config` on the host (no device context), then `measure._prepare`.
  - `parallel` fsdp / ddp: `dist._build_fsdp` / `dist._build_ddp`, exactly as dist.py builds them
    (meta device, `fully_shard` per layer then the root, `to_empty`, `normal_(std=0.02)`, rotary
    rebuilt; or `from_config` on the GPU and `DistributedDataParallel`), checkpointing included.
  - `parallel` zero1 / zero2 / zero3: `dist._build_zero` (a DeepSpeed engine with its own
    optimizer; a `mode: forward` instance, zero3 only, an inference engine without one). A train
    pass is `loss = engine(...)`, `engine.backward(loss)`, `engine.step()`.
  - `home: cpu` with `parallel: {strategy: fsdp, world_size: 1, offload_params: true}` (the old
    `fsdp2-offload`): `from_config` on the host, then `fully_shard(layer, offload_policy=
    CPUOffloadPolicy(), mp_policy=MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32))` per
    layer and for the root, in a one-process NCCL group made for it; it is never moved as a whole.
  Then, for `mode: train`, the optimizer over its trainable parameters (`measure._optimizer`:
  AdamW etc., lazy states) and a GradScaler for amp-fp16; `model.train()`, or `model.eval()` for
  mode forward. After all instances: `torch.manual_seed(1234 + rank)` and one `input_ids =
  torch.randint(0, vocab, (batch_size, seq_len))` on the device per distinct (batch_size,
  seq_len), in instance order (vocab: the smallest of the instances of that shape).
* Each iteration runs the phases in order; each phase is one measured record. At its start
  `torch.cuda.synchronize()` (and `dist.barrier()` under torchrun), `reset_peak_memory_stats()`.
  1. The `offload` instances whose parameters are on the GPU go out, in the listed order:
     `model.cpu()` (parameters and buffers; gradients stay where they are); an item
     `{instance, optimizer: true}` also moves each optimizer state tensor (`state[k] =
     v.to("cpu")`, as verl's `offload_fsdp_optimizer` and slime's `move_torch_optimizer` do;
     `params: false` moves the states alone); then `torch.cuda.empty_cache()` if any moved.
  2. The `home: cpu` instances that the phase runs come in, in the order of their first pass:
     `model.cuda()` (not the FSDP2-offloaded one: its layers come in one by one by themselves).
  3. The passes in order, each `repeat` times:
     - `train`: `loss = model(input_ids=ids, labels=ids).loss` under the instance's autocast
       (`measure._train_forward`: bf16 for amp-bf16 and bf16, fp16 for amp-fp16, none for fp32),
       `loss.backward()` (through the GradScaler for amp-fp16), `optimizer.step()`,
       `optimizer.zero_grad(set_to_none=True)` (`model.zero_grad` with optimizer none).
     - `forward`: `measure._logprob_forward` under `torch.no_grad()`: `logits =
       model(input_ids=ids).logits` under the autocast, `log_softmax(logits.float(), -1)`,
       `gather` of the next tokens; the result is dropped at once.
     - `generate`: with `m` the HF module (DDP's `.module`; the FSDP2 module itself),
       `m.eval()`, then under `torch.no_grad()` and the instance's autocast
       `out = m.generate(ids[:, :seq_len - new_tokens], max_new_tokens=new_tokens,
       min_new_tokens=new_tokens, do_sample=False, use_cache=True, pad_token_id=0,
       eos_token_id=None)` (no attention mask is passed: generate derives it from the ids and
       pad_token_id), `del out` at once, then `m.train()` if the instance trains. The prompt is
       a view of the instance's `input_ids`; transformers 5.x builds a DynamicCache and passes
       `logits_to_keep=1`.
     The default pass is the instance's mode (train, or forward).
  4. The instances brought in go back out (`model.cpu()`), `empty_cache()` if anything moved in
     1. or 2., then the offloaded ones come back in (`model.cuda()`, then their states).
  5. `torch.cuda.synchronize()` (and `dist.barrier(); torch.cuda.synchronize()` under torchrun),
     then the phase's counters are read.
  Peak counters are also read and reset between the parts of a pass (a train pass's forward,
  backward and optimizer step; each pass): the phase's `peak_allocated` / `peak_reserved` are the
  largest of these windows, so they equal one reading over the whole phase.
* A record: `{"id", "pipeline": <the spec as given>, "measured": {"phases": [{"phase",
  "iteration", "peak_allocated", "peak_reserved", "end_allocated", "end_reserved",
  "alloc_retries", "inactive_split_peak", "host_rss_bytes", "s", "moved_out", "moved_in",
  "passes": [{"instance", "pass", "peak_allocated", "peak_reserved", fwd_peak/bwd_peak/opt_peak
  for train}]}], "cuda_context_bytes", "params": {instance: count}}, "env"}`. An out-of-memory
  error ends the run; its phase is recorded with `oom` (PyTorch's message) and the counters at
  that moment. Under torchrun rank 0 writes the record: `measured.phases` are rank 0's, and
  `measured.ranks` holds every rank's `{rank, local_rank, phases, cuda_context_bytes,
  device_used_end_bytes, host_rss_peak_bytes}`.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
from dataclasses import dataclass, field

from .spec import Parallel, Spec, SpecError, parse

PLACEMENTS = ("resident", "manual-offload", "fsdp2-offload")
PASSES = ("train", "forward", "generate")
HOMES = ("gpu", "cpu")
TOP_KEYS = ("instances", "phases", "iterations")
LEGACY_KEYS = ("policy", "reference", "placement", "iterations")
PHASE_KEYS = ("name", "run", "offload")
RUN_KEYS = ("instance", "pass", "repeat", "new_tokens")
PIPELINE_STRATEGIES = ("ddp", "fsdp", "fsdp1", "zero1", "zero2", "zero3")
SNAPSHOT_ENTRIES = 10_000_000


@dataclass
class Instance:
    name: str
    spec: Spec
    home: str = "gpu"
    aliases: list[str] = field(default_factory=list)

    @property
    def host_fsdp(self) -> bool:
        """Built on the host and wrapped with FSDP2 CPUOffloadPolicy in a one-process group."""
        p = self.spec.parallel
        return self.home == "cpu" and p is not None and p.strategy == "fsdp" and p.world_size == 1 and p.offload_params

    @property
    def world_size(self) -> int:
        """Processes this instance is spread over (0: not sharded by the launcher)."""
        p = self.spec.parallel
        return 0 if p is None or self.host_fsdp else p.world_size


@dataclass
class PassDef:
    instance: int
    kind: str  # train | forward | generate
    repeat: int = 1
    new_tokens: int = 0
    name: str = ""  # the name the phase used (an alias, perhaps)


@dataclass
class Phase:
    name: str
    passes: list[PassDef]
    offload: list[int]  # instances whose parameters leave the GPU for the phase (`model.cpu()`)
    offload_optimizer: list[int] = field(default_factory=list)  # whose optimizer states do


@dataclass
class Pipeline:
    instances: list[Instance]
    phases: list[Phase]
    iterations: int = 3
    placement: str | None = None  # the older form's placement

    @property
    def world_size(self) -> int:
        """torchrun's process count: the sharded instances' world_size (0: one plain process)."""
        return max((i.world_size for i in self.instances), default=0)

    def find(self, name: str) -> int | None:
        for k, inst in enumerate(self.instances):
            if inst.name == name or name in inst.aliases:
                return k
        return None

    def names(self) -> list[str]:
        return [n for inst in self.instances for n in [inst.name, *inst.aliases]]


def _err(at: str, value, allowed: str) -> SpecError:
    return SpecError(f"`{at}`: {value!r} is not allowed; {allowed}")


def _prefixed(err: SpecError, at: str) -> SpecError:
    msg = str(err)
    if msg.startswith("`"):
        return SpecError(f"`{at}.{msg[1:]}")
    return SpecError(f"`{at}`: {msg}")


def _unknown_keys(obj: dict, at: str, known: tuple) -> None:
    for key in obj:
        if key not in known:
            where = f"{at}.{key}" if at else key
            raise SpecError(f"`{where}` is not a key here; use {', '.join(known)}")


def _iterations(raw: dict) -> int:
    value = raw.get("iterations", 3)
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 100:
        raise _err("iterations", value, "use an integer from 1 to 100")
    return value


def _check_instance(inst: Instance, at: str) -> None:
    spec = inst.spec
    if inst.home == "cpu" and spec.quantization:
        raise _err(f"{at}.home", "cpu", "a 4-bit model is loaded on the GPU: use home: gpu")
    par = spec.parallel
    if par is None:
        return
    if par.strategy not in PIPELINE_STRATEGIES:
        raise _err(
            f"{at}.parallel.strategy", par.strategy, f"use one of {', '.join(PIPELINE_STRATEGIES)} in a pipeline"
        )
    if inst.home == "cpu" and not inst.host_fsdp:
        raise _err(
            f"{at}.home",
            "cpu",
            "a sharded model is built on the GPU (home: gpu); on the host only FSDP2 offload, "
            "parallel: {strategy: fsdp, world_size: 1, offload_params: true}",
        )


def parse_pipeline(raw: dict) -> Pipeline:
    """Validate a pipeline (either form); errors name the field, the value and what is allowed."""
    if not isinstance(raw, dict):
        raise SpecError("a pipeline is a mapping {instances, phases, iterations}")
    if any(key in raw for key in ("policy", "reference", "placement")):
        return _parse_legacy(raw)
    _unknown_keys(raw, "", TOP_KEYS)

    def non_empty(key: str, what: str) -> list:
        value = raw.get(key)
        if not isinstance(value, list) or not value:
            raise _err(key, value, f"use a non-empty list of {what}")
        return value

    pipe = Pipeline(instances=[], phases=[], iterations=_iterations(raw))
    for i, item in enumerate(non_empty("instances", "instances {name, model, ...}")):
        at = f"instances[{i}]"
        if not isinstance(item, dict):
            raise _err(at, item, "use a mapping {name, model, ...} or {name, shares}")
        fields = dict(item)
        name = fields.pop("name", None)
        if not isinstance(name, str) or not name:
            raise _err(f"{at}.name", name, "give the instance a name")
        if pipe.find(name) is not None:
            raise _err(f"{at}.name", name, f"instance names must be different; taken: {', '.join(pipe.names())}")
        if "shares" in fields:
            target = fields.pop("shares")
            if fields:
                raise SpecError(f"`{at}.{sorted(fields)[0]}` is not a key here; an alias has only name and shares")
            owner = next((x for x in pipe.instances if x.name == target), None)
            if owner is None:
                earlier = ", ".join(x.name for x in pipe.instances) or "none yet"
                raise _err(f"{at}.shares", target, f"use the name of an instance listed before it: {earlier}")
            owner.aliases.append(name)
            continue
        if "engine" in fields:
            raise _err(
                f"{at}.engine",
                fields["engine"],
                "this harness measures models in PyTorch's caching allocator; a rollout engine "
                "(vLLM) is estimated, not measured here: leave the instance out",
            )
        home = fields.pop("home", "gpu")
        if home not in HOMES:
            raise _err(f"{at}.home", home, "use gpu or cpu")
        try:
            spec = parse(fields, forward_parallel=True)
        except SpecError as err:
            raise _prefixed(err, at) from None
        inst = Instance(name=name, spec=spec, home=home)
        _check_instance(inst, at)
        pipe.instances.append(inst)

    sharded = [(k, x) for k, x in enumerate(pipe.instances) if x.world_size]
    for k, inst in sharded[1:]:
        if inst.world_size != sharded[0][1].world_size:
            first = sharded[0][1]
            raise _err(
                f"instances[{k}].parallel.world_size",
                inst.world_size,
                f"one process group per pipeline: use {first.world_size}, the world_size of {first.name}",
            )
    for k, inst in enumerate(pipe.instances):
        if inst.host_fsdp and sharded:
            raise _err(
                f"instances[{k}].home",
                "cpu",
                "FSDP2 offload in its own one-process group cannot run beside instances sharded over ranks",
            )

    for i, item in enumerate(non_empty("phases", "phases {name, run, offload}")):
        pipe.phases.append(_parse_phase(pipe, item, f"phases[{i}]"))
    return pipe


def _parse_phase(pipe: Pipeline, item, at: str) -> Phase:
    if not isinstance(item, dict):
        raise _err(at, item, "use a mapping {name, run, offload}")
    _unknown_keys(item, at, PHASE_KEYS)
    name = item.get("name")
    if not isinstance(name, str) or not name or name == "load":
        raise _err(f"{at}.name", name, "give the phase a name (not `load`, the building phase)")
    runs = item.get("run")
    if not isinstance(runs, list):
        raise _err(f"{at}.run", runs, "use a list of instance names or {instance, pass, repeat, new_tokens}")
    names = ", ".join(pipe.names())
    passes = []
    for j, run in enumerate(runs):
        rat = f"{at}.run[{j}]"
        kind = None
        repeat = 1
        new_tokens = None
        if isinstance(run, str):
            target = run
        elif isinstance(run, dict):
            _unknown_keys(run, rat, RUN_KEYS)
            target = run.get("instance")
            kind = run.get("pass")
            if kind is not None and kind not in PASSES:
                raise _err(f"{rat}.pass", kind, f"use one of {', '.join(PASSES)}")
            if "new_tokens" in run:
                new_tokens = run["new_tokens"]
                if kind != "generate":
                    raise _err(f"{rat}.new_tokens", new_tokens, "new_tokens goes with pass: generate")
            if kind == "generate" and (
                isinstance(new_tokens, bool) or not isinstance(new_tokens, int) or new_tokens < 1
            ):
                raise _err(f"{rat}.new_tokens", new_tokens, "a generate pass needs new_tokens, an integer >= 1")
            repeat = run.get("repeat", 1)
            if isinstance(repeat, bool) or not isinstance(repeat, int) or not 1 <= repeat <= 64:
                raise _err(f"{rat}.repeat", repeat, "use an integer from 1 to 64")
        else:
            raise _err(rat, run, "use an instance name or a mapping {instance, pass, repeat, new_tokens}")
        k = pipe.find(target) if isinstance(target, str) else None
        if k is None:
            raise _err(rat if isinstance(run, str) else f"{rat}.instance", target, f"use an instance name: {names}")
        spec = pipe.instances[k].spec
        kind = kind or spec.mode
        if kind == "train" and spec.mode != "train":
            raise _err(f"{rat}.pass", "train", f"{target} is built for `mode: forward`; use pass: forward or generate")
        if kind == "generate" and new_tokens >= spec.seq_len:
            raise _err(
                f"{rat}.new_tokens",
                new_tokens,
                f"the prompt is seq_len - new_tokens: use fewer than {spec.seq_len} (seq_len of {target})",
            )
        passes.append(PassDef(instance=k, kind=kind, repeat=repeat, new_tokens=new_tokens or 0, name=target))
    offload_raw = item.get("offload", [])
    if not isinstance(offload_raw, list):
        raise _err(f"{at}.offload", offload_raw, "use a list of instance names or {instance, params, optimizer}")
    offload, offload_optimizer = [], []
    for j, target in enumerate(offload_raw):
        oat = f"{at}.offload[{j}]"
        moves_params, moves_optimizer = True, False
        if isinstance(target, dict):
            extra = sorted(set(target) - {"instance", "params", "optimizer"})
            if extra:
                raise _err(f"{oat}.{extra[0]}", target[extra[0]], "use instance, params, optimizer")
            moves_params, moves_optimizer = target.get("params", True), target.get("optimizer", False)
            for key, value in (("params", moves_params), ("optimizer", moves_optimizer)):
                if not isinstance(value, bool):
                    raise _err(f"{oat}.{key}", value, "use true or false")
            if not (moves_params or moves_optimizer):
                raise _err(oat, target, "offload the parameters, the optimizer states or both")
            target = target.get("instance")
            oat = f"{oat}.instance"
        k = pipe.find(target) if isinstance(target, str) else None
        if k is None:
            raise _err(oat, target, f"use an instance name: {names}")
        if any(p.instance == k for p in passes):
            raise _err(oat, target, "an instance the phase runs cannot be offloaded in it")
        if moves_optimizer and pipe.instances[k].spec.mode != "train":
            raise _err(oat, target, "only a training instance has optimizer states")
        if moves_params:
            offload.append(k)
        if moves_optimizer:
            offload_optimizer.append(k)
    return Phase(name=name, passes=passes, offload=offload, offload_optimizer=offload_optimizer)


def _parse_legacy(raw: dict) -> Pipeline:
    """`{policy, reference, placement, iterations}`: the two-instance pipeline it describes."""
    _unknown_keys(raw, "", LEGACY_KEYS)
    for key in ("policy", "reference"):
        if not isinstance(raw.get(key), dict):
            raise _err(key, raw.get(key), "a run spec (mapping) is required")
    placement = raw.get("placement", "resident")
    if placement not in PLACEMENTS:
        raise _err("placement", placement, f"use one of {', '.join(PLACEMENTS)}")
    try:
        policy = parse(raw["policy"])
    except SpecError as err:
        raise _prefixed(err, "policy") from None
    try:
        reference = parse(dict(raw["reference"], mode="forward"))
    except SpecError as err:
        raise _prefixed(err, "reference") from None
    reference.optimizer = "none"
    if policy.mode != "train":
        raise _err("policy.mode", policy.mode, "the policy trains: use train")
    if (reference.batch_size, reference.seq_len) != (policy.batch_size, policy.seq_len):
        raise _err(
            "reference.batch_size/seq_len",
            f"{reference.batch_size} x {reference.seq_len}",
            f"the reference scores the policy's batch: use {policy.batch_size} x {policy.seq_len}",
        )
    home, offload = "gpu", []
    if placement == "manual-offload":
        home, offload = "cpu", [0]
    elif placement == "fsdp2-offload":
        home = "cpu"
        reference.parallel = Parallel(strategy="fsdp", world_size=1, shard_size=1, offload_params=True)
    instances = [Instance("policy", policy), Instance("reference", reference, home=home)]
    for k, inst in enumerate(instances):
        _check_instance(inst, inst.name)
    phases = [
        Phase("ref_logprob", [PassDef(instance=1, kind="forward", name="reference")], offload),
        Phase("train", [PassDef(instance=0, kind="train", name="policy")], []),
    ]
    return Pipeline(instances=instances, phases=phases, iterations=_iterations(raw), placement=placement)


def is_pipeline(raw) -> bool:
    """Whether a parsed document is a pipeline rather than a run spec (as the estimator decides)."""
    return isinstance(raw, dict) and ("instances" in raw or "policy" in raw)


def load_pipeline(path: str) -> tuple[dict, Pipeline]:
    """The raw mapping (as given) and the validated pipeline of a YAML or JSON file."""
    from pathlib import Path

    text = Path(path).read_text()
    if str(path).endswith(".json"):
        raw = json.loads(text)
    else:
        import yaml

        raw = yaml.safe_load(text)
    return raw, parse_pipeline(raw)


# ------------------------------------------------------------------ measuring (needs torch)


def _host_rss() -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _build_on_cpu(spec: Spec, fields: dict):
    import torch

    from .measure import _auto_class, _hf_config

    cfg = _hf_config(spec, fields)
    dtype = torch.bfloat16 if spec.precision == "bf16" else torch.float32
    return _auto_class(spec).from_config(cfg, dtype=dtype, attn_implementation=spec.attention)


def _fsdp2_offload(model):
    import torch
    import torch.distributed as dist
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl", rank=0, world_size=1, device_id=torch.device("cuda", torch.cuda.current_device()))
    kwargs = {
        "offload_policy": CPUOffloadPolicy(),
        "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    }
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    fully_shard(model, **kwargs)
    return model


def _bucket_as_reduced(state, bucket):
    """DDP's all-reduce under the fake process group: the bucket, as NCCL leaves it reduced in
    place. DDP's default hook takes the reduced bucket from the collective's future, which the
    fake group's work leaves empty (the backward fails); this hook allocates nothing, as that one
    does not."""
    import torch

    future = torch.futures.Future()
    future.set_result(bucket.buffer())
    return future


class _Peaks:
    """Running maxima over windows of the allocator's peak counters (each window ends with
    `reset_peak_memory_stats()`)."""

    def __init__(self):
        self.allocated = self.reserved = self.split = 0

    def take(self) -> tuple[int, int]:
        import torch

        s = torch.cuda.memory_stats()
        a = s.get("allocated_bytes.all.peak", 0)
        r = s.get("reserved_bytes.all.peak", 0)
        self.allocated = max(self.allocated, a)
        self.reserved = max(self.reserved, r)
        self.split = max(self.split, s.get("inactive_split_bytes.all.peak", 0))
        torch.cuda.reset_peak_memory_stats()
        return a, r


def _snapshot_path(snapshot: str | None, rank: int) -> str | None:
    if not snapshot:
        return None
    if "{rank}" in snapshot:
        return snapshot.replace("{rank}", str(rank))
    return snapshot if rank == 0 else None


def measure_pipeline(
    pipe: Pipeline,
    fields: list[dict],
    row_id: str,
    raw: dict,
    snapshot: str | None = None,
    stacks: str = "python",
) -> dict | None:
    """Measure every phase of every iteration; returns the record (None on ranks other than 0)."""
    import torch

    from . import dist as distmod
    from .measure import _auto_class, _build, _hf_config, _logprob_forward, _optimizer, _prepare, _train_forward, _versions, _KEPT

    t0 = time.time()
    world = pipe.world_size
    rank = local_rank = 0
    dist = None
    fake_world = int(os.environ.get("HEADROOM_FAKE_WORLD", 0))
    if world and fake_world:
        # Rank 0 of a world of `world` on one GPU: torch's fake process group (see dist.py).
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore

        if fake_world != world:
            raise RuntimeError(f"HEADROOM_FAKE_WORLD is {fake_world} but the instances span {world} ranks")
        torch.cuda.set_device(0)
        dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    elif world:
        import torch.distributed as dist

        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        if "WORLD_SIZE" not in os.environ:  # world_size 1 without torchrun
            os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
            os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
            os.environ.setdefault("MASTER_PORT", "29533")
        dist.init_process_group("nccl", device_id=torch.device("cuda", local_rank))
        rank = dist.get_rank()
        if dist.get_world_size() != world:
            raise RuntimeError(f"parallel.world_size is {world} but torchrun started {dist.get_world_size()} processes")
    device = torch.device("cuda", torch.cuda.current_device())
    torch.zeros(1, device=device)
    free, total = torch.cuda.mem_get_info()
    context = total - free
    snap = _snapshot_path(snapshot, rank)
    if snap and stacks == "none":  # events without stack traces (ZeRO-3's recomputation crashes with them)
        torch.cuda.memory._record_memory_history(max_entries=SNAPSHOT_ENTRIES, context=None)
    elif snap:
        torch.cuda.memory._record_memory_history(max_entries=SNAPSHOT_ENTRIES, stacks=stacks)

    def sync() -> None:
        torch.cuda.synchronize()
        if dist is not None and not fake_world:
            dist.barrier(device_ids=[local_rank])
            torch.cuda.synchronize()

    autocast_dtypes = {"amp-bf16": torch.bfloat16, "bf16": torch.bfloat16, "amp-fp16": torch.float16}

    def autocast_of(spec: Spec):
        dtype = autocast_dtypes.get(spec.precision)
        if spec.parallel is not None and spec.parallel.mixed_precision is not None:
            dtype = torch.bfloat16 if spec.autocast == "bf16" else None  # the policy casts

        def autocast():
            if dtype is None:
                return torch.autocast("cuda", enabled=False)
            return torch.autocast("cuda", dtype=dtype)

        return autocast

    phases: list[dict] = []
    models: list = []  # what passes call: the wrapper (DDP, FSDP2, peft) or the model
    hf: list = []  # the transformers module (generate)
    opts: list = []
    scalers: list = []
    inputs: dict = {}
    params: dict = {}
    engines: set[int] = set()  # DeepSpeed engines: they step and zero their gradients themselves

    def load(peaks: _Peaks) -> dict:
        for inst, f in zip(pipe.instances, fields):
            spec = inst.spec
            cfg = _hf_config(spec, f)
            dtype = torch.bfloat16 if spec.precision == "bf16" else torch.float32
            cls = _auto_class(spec)
            if inst.host_fsdp:
                model = _fsdp2_offload(_build_on_cpu(spec, f))
                module = model
            elif spec.parallel is not None and spec.parallel.strategy == "fsdp":
                model = distmod._build_fsdp(spec, cfg, cls, dtype, device)
                module = model
            elif spec.parallel is not None and spec.parallel.strategy == "fsdp1":
                model, _ = distmod._build_fsdp1(spec, cfg, cls, dtype, device)
                module = model.module
            elif spec.parallel is not None and spec.parallel.strategy.startswith("zero"):
                model = distmod._build_zero(spec, cfg, cls, dtype, device)
                module = model.module
                engines.add(len(models))
            elif spec.parallel is not None:
                model = distmod._build_ddp(spec, cfg, cls, dtype, device, local_rank)
                if fake_world:
                    model.register_comm_hook(None, _bucket_as_reduced)
                module = model.module
            elif inst.home == "cpu":
                model = _prepare(spec, _build_on_cpu(spec, f))
                module = model
            else:
                model = _prepare(spec, _build(spec, cfg))
                module = model
            train = spec.mode == "train"
            trainable = [p for p in model.parameters() if p.requires_grad]
            opts.append(_optimizer(spec, trainable) if train and len(models) not in engines else None)
            scalers.append(torch.amp.GradScaler("cuda") if train and spec.precision == "amp-fp16" else None)
            model.train() if train else model.eval()
            models.append(model)
            hf.append(module)
            params[inst.name] = distmod._count_params(module, max(world, 1))
        torch.manual_seed(1234 + rank)
        for inst, f in zip(pipe.instances, fields):
            shape = (inst.spec.batch_size, inst.spec.seq_len)
            if shape not in inputs:
                vocab = min(
                    g["vocab_size"]
                    for j, g in zip(pipe.instances, fields)
                    if (j.spec.batch_size, j.spec.seq_len) == shape
                )
                inputs[shape] = torch.randint(0, vocab, shape, device=device)
        return {}

    def on_gpu(k: int) -> bool:
        return any(p.is_cuda for p in models[k].parameters())

    def run_pass(pd: PassDef, peaks: _Peaks) -> dict:
        k = pd.instance
        spec = pipe.instances[k].spec
        model, ids, autocast = models[k], inputs[(spec.batch_size, spec.seq_len)], autocast_of(spec)
        rec: dict = {"instance": pd.name, "pass": pd.kind}
        if pd.kind == "train":
            opt, scaler = opts[k], scalers[k]
            loss = _train_forward(spec, model, ids, autocast)
            torch.cuda.synchronize()
            rec["fwd_peak"] = peaks.take()[0]
            if k in engines:
                model.backward(loss)
            else:
                (scaler.scale(loss) if scaler else loss).backward()
            del loss
            torch.cuda.synchronize()
            rec["bwd_peak"] = peaks.take()[0]
            _KEPT.clear()
            if k in engines:
                model.step()
                torch.cuda.synchronize()
                rec["opt_peak"] = peaks.take()[0]
            elif opt is not None:
                if scaler:
                    scaler.step(opt)
                    scaler.update()
                else:
                    opt.step()
                torch.cuda.synchronize()
                rec["opt_peak"] = peaks.take()[0]
                opt.zero_grad(set_to_none=True)
            else:
                model.zero_grad(set_to_none=True)
        elif pd.kind == "forward":
            with torch.no_grad():
                _logprob_forward(model, ids, autocast)
        else:
            m = hf[k]
            m.eval()
            with torch.no_grad(), autocast():
                out = m.generate(
                    ids[:, : spec.seq_len - pd.new_tokens],
                    max_new_tokens=pd.new_tokens,
                    min_new_tokens=pd.new_tokens,
                    do_sample=False,
                    use_cache=True,
                    pad_token_id=0,
                    eos_token_id=None,
                )
            rec["generated_shape"] = list(out.shape)
            del out
            if spec.mode == "train":
                m.train()
        torch.cuda.synchronize()
        a, r = peaks.take()
        rec["peak_allocated"] = max([a, *(v for key, v in rec.items() if key.endswith("_peak"))])
        rec["peak_reserved"] = r
        return rec

    def move_states(k: int, where) -> bool:
        # verl's offload_fsdp_optimizer / slime's move_torch_optimizer: each state tensor moved
        moved = False
        for state in opts[k].state.values() if opts[k] is not None else ():
            for key, value in state.items():
                if torch.is_tensor(value) and value.device != torch.device(where) and value.numel() > 1:
                    state[key] = value.to(where)
                    moved = True
        return moved

    def run_phase(phase: Phase) -> dict:
        moved_out = [k for k in phase.offload if on_gpu(k)]
        for k in moved_out:
            models[k].cpu()
        states_out = [k for k in phase.offload_optimizer if move_states(k, "cpu")]
        if moved_out or states_out:
            torch.cuda.empty_cache()
        moved_in: list[int] = []
        for pd in phase.passes:
            k = pd.instance
            inst = pipe.instances[k]
            if inst.home == "cpu" and not inst.host_fsdp and k not in moved_in:
                models[k].cuda()
                moved_in.append(k)
        passes = []
        for pd in phase.passes:
            for _ in range(pd.repeat):
                passes.append(run_pass(pd, peaks_now))
        for k in moved_in:
            models[k].cpu()
        if moved_in or moved_out or states_out:
            torch.cuda.empty_cache()
        for k in moved_out:
            models[k].cuda()
        for k in states_out:
            move_states(k, device)
        return {
            "moved_out": [pipe.instances[k].name for k in moved_out],
            "optimizer_out": [pipe.instances[k].name for k in states_out],
            "moved_in": [pipe.instances[k].name for k in moved_in],
            "passes": passes,
        }

    def measured(name: str, iteration: int, body) -> bool:
        nonlocal peaks_now
        print(f"[rank {rank} {time.time() - t0:7.1f}s] {name} {iteration}", file=sys.stderr, flush=True)
        sync()
        torch.cuda.reset_peak_memory_stats()
        peaks_now = _Peaks()
        start = time.time()
        try:
            sub = body() or {}
            sync()
        except torch.cuda.OutOfMemoryError as err:
            peaks_now.take()
            phases.append({"phase": name, "iteration": iteration, "oom": str(err), **counters(peaks_now)})
            return False
        peaks_now.take()
        phases.append({"phase": name, "iteration": iteration, **counters(peaks_now), "s": round(time.time() - start, 3), **sub})
        return True

    def counters(peaks: _Peaks) -> dict:
        s = torch.cuda.memory_stats()
        return {
            "peak_allocated": peaks.allocated,
            "peak_reserved": peaks.reserved,
            "end_allocated": torch.cuda.memory_allocated(),
            "end_reserved": torch.cuda.memory_reserved(),
            "alloc_retries": s.get("num_alloc_retries", 0),
            "inactive_split_peak": peaks.split,
            "host_rss_bytes": _host_rss(),
        }

    peaks_now = _Peaks()
    if measured("load", 0, lambda: load(peaks_now)):
        stop = False
        for it in range(pipe.iterations):
            for phase in pipe.phases:
                if not measured(phase.name, it, lambda: run_phase(phase)):
                    stop = True
                    break
            if stop:
                break

    if snap:
        torch.cuda.memory._dump_snapshot(snap)
        torch.cuda.memory._record_memory_history(enabled=None)
    free, total = torch.cuda.mem_get_info()
    mine = {
        "rank": rank,
        "local_rank": local_rank,
        "phases": phases,
        "cuda_context_bytes": context,
        "device_used_end_bytes": total - free,
        "host_rss_peak_bytes": distmod._host_rss_peak(),
    }
    ranks = [mine]
    if dist is not None and fake_world:
        ranks = [mine]  # only rank 0 exists; the fake group moves no data
    elif dist is not None:
        ranks = [None] * dist.get_world_size()
        dist.all_gather_object(ranks, mine)
    record = None
    if rank == 0:
        env = {
            "gpu": torch.cuda.get_device_properties(device).name,
            "gpu_total_bytes": total,
            **_versions(),
            "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""),
        }
        if dist is not None:
            env.update(
                world_size=dist.get_world_size(),
                launcher="fake process group (one process, rank 0)"
                if fake_world
                else ("torchrun" if "TORCHELASTIC_RUN_ID" in os.environ else "none"),
                process_group="fake" if fake_world else "nccl",
                nccl=".".join(map(str, torch.cuda.nccl.version())),
                nccl_env={k: v for k, v in sorted(os.environ.items()) if k.startswith(("NCCL_", "TORCH_SYMM", "NVSHMEM"))},
            )
        env["wall_s"] = round(time.time() - t0, 2)
        measured_out = {"phases": phases, "cuda_context_bytes": context, "params": params}
        if dist is not None:
            measured_out["ranks"] = ranks
        record = {"id": row_id, "pipeline": raw, "measured": measured_out, "env": env}
    if dist is not None:
        if not fake_world:
            dist.barrier()
        dist.destroy_process_group()
    gc.collect()
    return record
