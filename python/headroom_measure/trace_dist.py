"""Trace a sharded run as one rank of its world (rank 0, or the one `--rank` names): FSDP2
(`fully_shard`), torchtitan's tensor parallelism, torch.distributed.pipelining's schedules
(`pp.py`, alone or under FSDP2), context parallelism's ring attention and transformers' expert
parallelism, built and stepped by the measuring harness's own code (`dist.py`), under torch's
`fake` process group on the CPU, inside the tracer's `FakeTensorMode` (`trace.py`). DDP and FSDP1
run in the same world, as `trace_ddp.py` and `trace_fsdp1.py` run them.

A pipeline rank builds its stages from real meta tensors (`to_empty` then makes the device ones, as
on the GPU), its `PipelineStage`s allocate their receive buffers when the schedule first runs, and
the fake group's `isend`/`irecv` complete at once, as in the measured fake-group rows. Context
parallelism's `context_parallel` patches `F.scaled_dot_product_attention` by its name with the
ring, which the tracer's CUDA attention keeps (`cuda_emulation.py`); the ring's all-gather and
all-to-all allocate their outputs, and each step's flash kernels run on fake tensors, the
backward's marker naming its key rows (`trace.py`).

The fake group makes every collective a no-op while FSDP2 allocates its all-gather and
reduce-scatter buffers at their full size, as the measured fake-group rows do. What the CPU path
does differently from CUDA is put back:
- **Streams.** FSDP2 switches streams with `device_handle.stream(...)`; on the CPU that is
  `torch.cpu`'s stream context, which tracks the current stream object and nothing else.
  Each storage is attributed to the stream current at its allocation ([`Streams`]), as CUDA's
  caching allocator takes `getCurrentCUDAStream()`, so the replay serves it from that stream's
  pools. FSDP2 orders its streams with events and keeps cross-stream tensors alive by reference
  (`all_gather_state`, `reduce_scatter_state`), never by `record_stream`, so a storage's free is
  the moment its last reference goes, as on CUDA.
- **Resized storages.** FSDP2 frees and re-allocates the unsharded parameters by resizing their
  storages (`free_storage`, `alloc_storage`), which no operator sees; those are recorded as a
  free and a new allocation.
- **CPU offload.** Under `CPUOffloadPolicy` the shards live on the host and each unshard copies
  them to the device (`.to(device)`), and each sharded gradient is copied back to the host. On
  the CPU both copies are no-ops that return the same storage; the tracer makes the copies CUDA
  makes and keeps host tensors out of the replay (`kind: host`).
"""

from __future__ import annotations

import contextlib

from .trace import TraceError

# The strategies the tracer runs here (DeepSpeed's: `trace_zero`).
TRACEABLE = ("fsdp", "fsdp1", "ddp", "none", "zero1", "zero2", "zero3")


def refuse_untraceable_parallel(par) -> None:
    """Refuse, by name, the layouts the tracer cannot run as rank 0 of a fake world."""
    if par.framework == "megatron":
        if par.pp > 1:
            raise TraceError(
                f"`parallel.pp: {par.pp}` with framework megatron: the tracer runs Megatron-core without pipeline "
                "parallelism (pp 1); `headroom estimate` models Megatron's pipeline schedules natively"
            )
        return
    if par.strategy not in TRACEABLE:
        raise TraceError(
            f"`parallel.strategy: {par.strategy}`: the tracer runs ddp, fsdp1, fsdp (FSDP2), zero1, zero2, zero3, "
            "and tensor, pipeline, context and expert parallelism (strategy none or fsdp); `headroom estimate` models "
            f"{par.strategy} natively"
        )


class Streams:
    """Numbers the streams storages are allocated or used on (`record_stream`): 0 for the default
    stream, then 1, 2, ... in the order the others are first named."""

    def __init__(self):
        import torch

        self._cpu = torch.cpu
        self._ids = {id(torch.cpu.current_stream()): 0}
        self._keep = [torch.cpu.current_stream()]  # the ids stay unique while the streams live

    def current(self) -> int:
        return self.number(self._cpu.current_stream())

    def number(self, stream) -> int:
        """`stream`'s number, given it now if it has none."""
        sid = self._ids.get(id(stream))
        if sid is None:
            sid = len(self._keep)
            self._ids[id(stream)] = sid
            self._keep.append(stream)
        return sid


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0):
    """Rank `rank` of a world of `world_size` under torch's `fake` process group, as `measure_dist`
    and `measure_pipeline` start it on the GPU (`HEADROOM_FAKE_WORLD`, `HEADROOM_FAKE_RANK`)."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import torch.distributed._tools.fake_collectives  # noqa: F401 - collectives on fake tensors

    dist.init_process_group("fake", rank=rank, world_size=world_size, store=FakeStore())
    try:
        yield
    finally:
        dist.destroy_process_group()


def _outside_fake(fn):
    """`fn` run with no dispatch mode: on real tensors, unrecorded."""
    import functools

    from torch.utils._python_dispatch import _disable_current_modes

    @functools.wraps(fn)
    def outside(*args, **kwargs):
        with _disable_current_modes():
            return fn(*args, **kwargs)

    return outside


def patch(stack: contextlib.ExitStack, owner, name: str, value) -> None:
    """`owner.name` is `value` until `stack` closes."""
    if name in vars(owner):
        stack.callback(setattr, owner, name, vars(owner)[name])
    else:  # inherited: the patch shadows it until it goes
        stack.callback(delattr, owner, name)
    setattr(owner, name, value)


class _FsdpCuda:
    """FSDP2's storage resizes recorded, and CPU offload's copies made as CUDA makes them."""

    def __init__(self, rec):
        self.rec = rec
        self._stack = contextlib.ExitStack()

    def __enter__(self):
        import torch
        from torch.distributed import device_mesh
        from torch.distributed.tensor import _sharding_prop
        from torch.distributed.fsdp._fully_shard import _fsdp_init, _fsdp_param, _fsdp_param_group

        rec = self.rec
        real_alloc, real_free = _fsdp_param.alloc_storage, _fsdp_param.free_storage

        def alloc_storage(tensor):
            real_alloc(tensor)
            rec.storage_resized(tensor, "fsdp alloc_storage (unsharded parameter)")
            rec.classify([tensor], "parameter")

        def free_storage(tensor):
            real_free(tensor)
            rec.storage_resized(tensor, "fsdp free_storage")

        # Meshes are real: a rank's coordinates are computed from the mesh tensor's values, when
        # the mesh is made and when a dimension is sliced or flattened out of it.
        self._patch(device_mesh, "init_device_mesh", _outside_fake(device_mesh.init_device_mesh))
        # `fully_shard` without a mesh makes the default one through its own import of it.
        self._patch(_fsdp_init, "init_device_mesh", _outside_fake(_fsdp_init.init_device_mesh))
        for name in ("__init__", "__getitem__", "_flatten"):
            self._patch(device_mesh.DeviceMesh, name, _outside_fake(getattr(device_mesh.DeviceMesh, name)))
        # DTensor's sharding propagation runs each op on fake arguments of its own to learn the
        # output's shape: bookkeeping that allocates nothing on the GPU.
        propagator = _sharding_prop.ShardingPropagator
        self._patch(
            propagator,
            "_propagate_tensor_meta_non_cached",
            _outside_fake(propagator._propagate_tensor_meta_non_cached),
        )
        self._patch(_fsdp_param, "alloc_storage", alloc_storage)
        self._patch(_fsdp_param, "free_storage", free_storage)

        cls = _fsdp_param.FSDPParam
        real_inputs = cls.all_gather_inputs

        def all_gather_inputs(fsdp_param):
            if fsdp_param.offload_to_cpu and fsdp_param.sharded_state == _fsdp_param.ShardedState.SHARDED:
                # `.to(device, non_blocking=True)` of the host shard: a device copy, cast to
                # `param_dtype` when the policy asks (the copy then goes).
                copy = fsdp_param._sharded_param_data.clone()
                return [_fsdp_param._to_dtype_if_needed(copy, fsdp_param.param_dtype)]
            return real_inputs.fget(fsdp_param)

        self._patch(cls, "all_gather_inputs", property(all_gather_inputs))
        # Pinned host memory is host memory: the shard stays as it is.
        self._patch(torch.Tensor, "pin_memory", lambda t, *args, **kwargs: t)
        self._patch(torch.Tensor, "is_pinned", lambda t, *args, **kwargs: True)

        real_reduce = _fsdp_param_group.foreach_reduce

        def foreach_reduce(fsdp_params, *args, **kwargs):
            out = real_reduce(fsdp_params, *args, **kwargs)
            for fsdp_param in fsdp_params:
                if fsdp_param.offload_to_cpu and fsdp_param.sharded_param.grad is not None:
                    # The sharded gradient copied to the host; the device view goes.
                    grad = fsdp_param.sharded_param.grad
                    host = grad._local_tensor.clone()
                    rec.classify([host], "host")
                    grad._local_tensor = host
            return out

        self._patch(_fsdp_param_group, "foreach_reduce", foreach_reduce)
        return self

    def _patch(self, owner, name, value):
        patch(self._stack, owner, name, value)

    def __exit__(self, *exc):
        return self._stack.__exit__(*exc)


def run_dist_loop(rec, spec, fields: dict, progress, steps: int, rank: int = 0):
    """`measure_dist`'s load and steps on rank `rank` of a fake world (dist.py), every phase
    marked; DDP's C++ as `trace_ddp.py` runs it, a pipeline's schedule as `run_pipeline_steps`."""
    import torch

    from . import dist as d
    from . import measure as m
    from .trace import _ModuleNames, autocast_of, train_step
    from .trace_ddp import DdpOnFakeTensors, build_ddp
    from .trace_fsdp1 import Fsdp1OnFakeTensors, _MetaOutsideFake, build_fsdp1

    par = spec.parallel
    rec.stream_of = Streams().current
    device = torch.device("cpu")
    ddp = par.strategy == "ddp"
    wrappers = {"ddp": lambda: DdpOnFakeTensors(rec), "fsdp1": lambda: Fsdp1OnFakeTensors(rec, par.offload_params)}
    wrapper = wrappers.get(par.strategy, contextlib.nullcontext)
    with fake_world(par.world_size, rank), _FsdpCuda(rec), wrapper():
        rec.phase("load")
        cfg = m._hf_config(spec, fields)
        cls = m._auto_class(spec)
        dtype = torch.bfloat16 if spec.precision == "bf16" else torch.float32
        cp_mesh = pipeline_step = None
        if par.pp > 1:
            from . import pp

            # Stages built from real meta tensors, which `to_empty` replaces as on the GPU.
            chunks, pipeline_step, _ = pp.build(spec, cfg, _MetaOutsideFake(cls), dtype, device, rank, cuda_autocast=True)
            model = torch.nn.ModuleList(chunks)
        elif par.framework == "transformers" or par.ep > 1:
            model, _ = d._build_transformers_plan(spec, cfg, _MetaOutsideFake(cls), dtype, device)
        elif par.tp > 1 or par.cp > 1:
            model, cp_mesh = d._build_torchtitan(spec, cfg, cls, dtype, device)
        elif ddp:
            model = build_ddp(rec, spec, cfg, cls, dtype, device)
        elif par.strategy == "fsdp1":
            model = build_fsdp1(rec, spec, cfg, cls, dtype, device)
        else:
            model = d._build_fsdp(spec, cfg, cls, dtype, device)
        _ModuleNames.current.name(model)
        params = list(model.parameters())
        rec.classify(params, "host" if par.offload_params else "parameter")
        rec.classify(model.buffers(), "buffer")
        trainable = [p for p in params if p.requires_grad]
        optimizer = m._optimizer(spec, trainable)
        model.train()
        ids = torch.randint(0, fields["vocab_size"], (spec.batch_size, spec.seq_len), device=device)
        rec.classify([ids], "input")
        autocast = autocast_of(spec)

        def loss_context():
            if par.tp == 1 or par.framework == "transformers":
                return contextlib.nullcontext()
            from torch.distributed.tensor.parallel import loss_parallel

            return loss_parallel()

        for step in range(1, steps + 1):
            if progress:
                progress(step, steps)
            mark = lambda part: rec.phase(f"step {step} {part}")  # noqa: E731
            if pipeline_step is not None:
                run_pipeline_step(
                    rec, pipeline_step, ids, autocast, loss_context, optimizer, trainable, mark,
                    sharded=par.strategy == "fsdp",
                )  # fmt: skip
                continue
            inputs, passes = ids, contextlib.nullcontext
            if cp_mesh is not None:
                # The step's fresh batch, which `context_parallel` shards in place (dist.py).
                inputs = ids.clone()
                rec.classify([inputs], "input")
                passes = lambda: d._context_parallel(cp_mesh, inputs)  # noqa: E731
            train_step(
                rec, spec, model, inputs, autocast, optimizer, trainable, sharded=not (ddp or par.ep > 1),
                host_step=par.offload_params, loss_context=loss_context, passes=passes, mark=mark,
            )  # fmt: skip
            del inputs, passes
        del model, optimizer, params, trainable, ids


def run_pipeline_step(rec, pipeline_step, ids, autocast, loss_context, optimizer, trainable, mark, sharded: bool):
    """One step of `measure_dist`'s pipeline loop: `schedule.step` (every micro-batch's forward
    and backward, in the schedule's order) under autocast, then `optimizer.step()` and `zero_grad`.
    Each stage backward (`stage_backward`, the last stage's loss included) is watched for the
    autograd engine's in-place sums, as a single-GPU backward is (`train_step`), but for the
    received output gradients, which the stage keeps; under FSDP2 FSDP2 reduces the gradients
    itself."""
    import torch
    from torch.distributed.pipelining import stage as stage_module
    from torch.utils._pytree import tree_leaves

    from .trace import _classify_optimizer_state

    real = stage_module.stage_backward

    def stage_backward(stage_output, output_grads, input_values, *args, **kwargs):
        if not sharded:
            for t in tree_leaves(stage_output):
                if getattr(t, "grad_fn", None) is not None:
                    rec.watch_accumulation(t.grad_fn)
        # The stage keeps the gradients it received (its receive buffers): never summed into.
        kept = {t.untyped_storage()._cdata for t in tree_leaves(output_grads) if isinstance(t, torch.Tensor)}
        rec.kept |= kept
        try:
            return real(stage_output, output_grads, input_values, *args, **kwargs)
        finally:
            rec.accumulating = False
            rec.kept -= kept

    mark("schedule")
    stage_module.stage_backward = stage_backward
    try:
        with autocast(), loss_context():
            losses = pipeline_step(ids)
    finally:
        stage_module.stage_backward = real
    del losses
    rec.classify([p.grad for p in trainable if p.grad is not None], "gradient")
    mark("optimizer")
    optimizer.step()
    _classify_optimizer_state(rec, optimizer)
    optimizer.zero_grad(set_to_none=True)
