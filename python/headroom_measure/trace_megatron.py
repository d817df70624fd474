"""Trace a Megatron-core run (`parallel.framework: megatron`) as rank 0 of its world: the model, DDP and
optimizer `megatron.py` builds (`initialize`, `build`) and its `train_step` (`forward_backward_no_pipelining`
with one micro-batch, `finalize_model_grads`, `optimizer.step()`), under torch's `fake` process group on the
CPU, inside the tracer's `FakeTensorMode` (`trace.py`).

The fake tensors are CUDA's: Megatron makes its tensors on `torch.cuda.current_device()` and moves the local
spec's host-made norms there with `model.cuda()`, and `FakeTensorMode` makes fake `cuda` tensors without a GPU.
So every branch Megatron takes on the device is the GPU run's, and what it makes on the CPU (the norms before
`model.cuda()`, the RNG states) is host memory (`Recorder.host_device`), out of the replay. What Megatron asks
the driver is answered here ([`cuda_answers`]), none of it an allocation:
- **Device.** `current_device` (0), `device_count` (1), `set_device`, `synchronize`,
  `get_device_capability` (an H100's, 9.0, as the measured rows ran on).
- **Streams and events.** Megatron's DDP without `overlap_grad_reduce` reduces on the current stream; a
  stream is `torch.cpu`'s (the current stream's number is what the recorder attributes each storage to,
  `trace_dist.Streams`), events order nothing (the replay is sequential).
- **RNG.** `model_parallel_cuda_manual_seed` and the tracker's `fork` save and restore CUDA generator states,
  host byte tensors; here they are the CPU generator's, read outside the fake mode: random values do not
  exist under fake tensors, and no state is on the device.
- **Memory queries.** Answered 0; `empty_cache` is recorded.
- **Coalesced collectives.** The gradient buckets' all-reduces or reduce-scatters run one by one
  ([`_one_by_one`]).
- **Objects.** `all_gather_object` (the optimizer's check that every rank has the same parameter groups)
  gathers this rank's object from every rank ([`_identical_objects`]).

Megatron's own allocations all run as they are: the DDP's persistent fp32 gradient buffers (`grad_data`), the
distributed optimizer's bf16 `param_data` and fp32 main-parameter shards, the global memory buffer
(`get_global_memory_buffer`, the gathers of tensor parallelism), `DotProductAttention`'s `[b·heads, s, s]` score
matrix (`baddbmm` into a buffer of that buffer), the causal mask made at each call, recomputation's
checkpoints.

An MoE model routes as the harness makes it route (`megatron.balanced_routing`): every expert receives
tokens·k / E tokens. The dispatcher reads the token counts back to the host to split the tokens among the
experts (`maybe_move_tensor_to_cpu` of `tokens_per_expert` and the all-to-all's split sizes, then `.tolist()`);
those copies hold the balanced counts ([`_balanced_counts`]), which the GPU run reads too.
"""

from __future__ import annotations

import contextlib

from .trace import TraceError

INSTALL = "pip install megatron-core==0.19.0"


def require_megatron() -> None:
    """Refuse, saying what to install, when megatron-core does not import."""
    try:
        import megatron.core  # noqa: F401
    except ImportError as err:
        raise TraceError(
            f"`parallel.framework: megatron` runs Megatron-core, which does not import here ({err}); "
            f"install the version the run uses (`{INSTALL}`, with `--no-deps` beside torch)"
        ) from None


def refuse_untraceable_megatron(spec) -> None:
    """The spec's `megatron` block checked as the harness checks it, the optimizer's CPU offload (its host copies
    leave the fake tensors' world), and expert tensor parallelism when given (left unset it is tp, refused once the
    model is known to have experts: `run_megatron_loop`)."""
    from .megatron import megatron_options
    from .spec import SpecError

    try:
        options = megatron_options(spec)
    except SpecError as err:
        raise TraceError(str(err)) from None
    if options["optimizer_cpu_offload"]:
        raise TraceError(
            "`megatron.optimizer_cpu_offload: true`: the tracer cannot follow HybridDeviceOptimizer's copies to the "
            "host; `headroom estimate` models it natively"
        )
    if (spec.raw.get("megatron") or {}).get("expert_tensor_parallel_size", 1) != 1:
        raise untraced_expert_tensor_parallelism(options)


def untraced_expert_tensor_parallelism(options: dict) -> TraceError:
    """Expert tensor parallelism's token counts are not what the balanced reads give."""
    return TraceError(
        f"`megatron.expert_tensor_parallel_size: {options['expert_tensor_parallel_size']}`: the tracer runs "
        "Megatron's experts with expert tensor parallelism 1; `headroom estimate` models it natively"
    )


@contextlib.contextmanager
def cuda_answers(rec):
    """`torch.cuda`'s driver queries answered as the module doc says, for the life of the block."""
    import torch
    from megatron.core.distributed import param_and_grad_buffer
    from megatron.core.tensor_parallel import random as mrandom

    from .trace_dist import Streams, _outside_fake, patch
    from .trace_zero import DEVICE, _Event

    class Stream(torch.cpu.Stream):
        """`torch.cpu`'s stream with CUDA's waits, which order nothing here."""

        def __new__(cls, *args, **kwargs):
            return super().__new__(cls)

        def synchronize(self):
            pass

        def wait_stream(self, stream):
            pass

        def wait_event(self, event):
            pass

        def record_event(self, event=None):
            return event or _Event()

        def query(self):
            return True

    rng_state = _outside_fake(lambda device="cuda": torch.get_rng_state())
    answers = {
        "_lazy_init": lambda: None,
        "current_device": lambda: DEVICE,
        "device_count": lambda: 1,
        "set_device": lambda device: None,
        "synchronize": lambda device=None: None,
        "get_device_capability": lambda device=None: (9, 0),
        "manual_seed": lambda seed: None,
        "manual_seed_all": lambda seed: None,
        "get_rng_state": rng_state,
        "set_rng_state": lambda state, device="cuda": None,
        "Stream": Stream,
        "Event": _Event,
        "stream": torch.cpu.stream,
        "current_stream": lambda device=None: torch.cpu.current_stream(),
        "default_stream": lambda device=None: torch.cpu.current_stream(),
        "memory_allocated": lambda device=None: 0,
        "max_memory_allocated": lambda device=None: 0,
        "memory_reserved": lambda device=None: 0,
        "reset_peak_memory_stats": lambda device=None: None,
        "memory_stats": lambda device=None: {},
        "empty_cache": rec.empty_cache,
        "is_current_stream_capturing": lambda: False,
    }
    with contextlib.ExitStack() as stack:
        for name, value in answers.items():
            patch(stack, torch.cuda, name, value)
        patch(stack, torch.cuda.random, "get_rng_state", rng_state)
        patch(stack, mrandom, "_set_cuda_rng_state", lambda state, device=-1, graph_safe=False: None)
        patch(stack, torch.distributed, "all_gather_object", _identical_objects)
        patch(stack, param_and_grad_buffer, "_coalescing_manager", _one_by_one)
        stack.enter_context(_OnTheDevice(rec))
        patch(stack, torch.Tensor, "type", _cuda_type(torch.Tensor.type, rec))
        patch(stack, rec, "host_follows_inputs", True)
        rec.stream_of = Streams().current
        yield


@contextlib.contextmanager
def _one_by_one(group=None, device=None, async_ops=False):
    """`_coalescing_manager` as the fake group runs what it coalesces: each collective on its own, in place on
    the buffers the caller passes (the gradient buckets), as NCCL's coalesced kernel writes them; torch has no
    fake implementation of the coalesced operators."""
    from torch.distributed.distributed_c10d import _CoalescingManager

    yield _CoalescingManager()


def _identical_objects(object_list, obj, group=None):
    """`all_gather_object` in a world of identical ranks: every rank's object is this one's. Under the fake
    group the pickled objects travel through host tensors (its backend is not NCCL), which ask the GPU for
    nothing; fake tensors cannot hold their bytes."""
    object_list[:] = [obj] * len(object_list)


def _balanced_counts(tokens_times_topk: int):
    """`maybe_move_tensor_to_cpu` of the dispatcher's token counts as the balanced routing makes them (the
    module doc): the host copy of a count tensor, every entry equal, summing to the tokens·k each rank sends
    and receives in a world of identical ranks (expert tensor parallelism 1). The copy is host memory, a
    numpy array made outside the fake mode so that it keeps its values (the dispatcher and the experts read
    them with `.tolist()` and `.ravel()`, which numpy has)."""
    import torch

    from .trace_dist import _outside_fake

    @_outside_fake
    def host_values(numel: int, shape, as_numpy: bool):
        host = torch.full(shape, tokens_times_topk // numel, dtype=torch.long)
        return host.numpy() if as_numpy else host

    def maybe_move_tensor_to_cpu(tensor, as_numpy=False, record_stream=False):
        if not isinstance(tensor, torch.Tensor):
            return tensor
        # numpy: a host tensor would be made fake by the first operator that reads it.
        return host_values(tensor.numel(), tuple(tensor.shape), True)

    return maybe_move_tensor_to_cpu


def run_megatron_loop(rec, spec, fields: dict, progress, steps: int):
    """`measure_megatron`'s build and steps on rank 0 of a fake world, every phase marked."""
    require_megatron()
    from megatron.core import parallel_state
    from megatron.core.transformer.moe import router, token_dispatcher

    from . import megatron as mg
    from .trace import _classify_optimizer_state, _ModuleNames
    from .trace_dist import fake_world, patch

    options = mg.megatron_options(spec)
    moe = mg.moe_fields(fields)
    if moe and options["expert_tensor_parallel_size"] != 1:
        raise untraced_expert_tensor_parallelism(options)
    with fake_world(spec.parallel.world_size), cuda_answers(rec), contextlib.ExitStack() as stack:
        # `balanced_routing` replaces these two for the life of the process; here, of the trace.
        patch(stack, router, "topk_routing_with_score_function", router.topk_routing_with_score_function)
        patch(stack, token_dispatcher, "gather_from_sequence_parallel_region",
              token_dispatcher.gather_from_sequence_parallel_region)  # fmt: skip
        rec.phase("load")
        mg.initialize(spec, options)
        try:
            ddp_model, optimizer = mg.build(spec, fields, options)
            _ModuleNames.current.name(ddp_model)
            rec.classify(ddp_model.parameters(), "parameter")
            for buffer in ddp_model.buffers + ddp_model.expert_parallel_buffers:
                rec.classify([buffer.grad_data], "gradient")
                if buffer.param_data is not None:
                    rec.classify([buffer.param_data], "parameter")
            ddp_model.train()
            batch = mg.inputs(spec, fields, "cuda")
            rec.classify(batch, "input")
            fixed = None
            if moe:
                experts, top_k, _ = moe
                tokens = mg.routed_tokens(spec, spec.batch_size)
                share = tokens * top_k // experts
                with rec.reading([share, share]):
                    fixed = mg.balanced_routing(tokens, experts, top_k)
                rec.classify([fixed], "input")
                tokens_times_topk = tokens * top_k
                patch(stack, token_dispatcher, "maybe_move_tensor_to_cpu", _balanced_counts(tokens_times_topk))
            for step in range(1, steps + 1):
                if progress:
                    progress(step, steps)
                start = [len(rec.events)]

                def mark(part, step=step, start=start):
                    if part == "backward":
                        rec.classify_phase("activation", start[0])
                    if part == "end":
                        _classify_optimizer_state(rec, optimizer_of(optimizer))
                        return
                    start[0] = len(rec.events)
                    rec.phase(f"step {step} {part}")

                mg.train_step(ddp_model, optimizer, batch, mark)
            del ddp_model, optimizer, batch, fixed
        finally:
            parallel_state.destroy_model_parallel()


def optimizer_of(optimizer):
    """The `torch.optim` optimizer inside Megatron's wrapper (`ChainedOptimizer` of one, or the wrapper itself)."""
    inner = getattr(optimizer, "chained_optimizers", [optimizer])
    return inner[0].optimizer if len(inner) == 1 else _Chained([o.optimizer for o in inner])


class _Chained:
    """Several `torch.optim` optimizers' groups and state seen as one's."""

    def __init__(self, optimizers):
        self.param_groups = [g for o in optimizers for g in o.param_groups]
        self.state = {p: s for o in optimizers for p, s in o.state.items()}


FACTORIES = ("empty", "zeros", "ones", "full", "rand", "randn", "randint", "arange", "tensor", "empty_strided", "linspace")


def _cuda_type(real, rec):
    """`Tensor.type()` as CUDA names a device tensor's type (`torch.cuda.BFloat16Tensor`), which Megatron's
    optimizers check."""
    from .trace_zero import is_device

    def type_(tensor, *args, **kwargs):
        name = real(tensor, *args, **kwargs)
        if not args and not kwargs and is_device(rec, tensor) and not name.startswith("torch.cuda."):
            return name.replace("torch.", "torch.cuda.", 1)
        return name

    return type_


def _device_target(value) -> bool:
    """Whether `value` names the GPU (`"cuda"`, `cuda:0`, an index, the fake `current_device()`)."""
    import torch

    from .trace_zero import _DeviceName

    if isinstance(value, _DeviceName) or (isinstance(value, int) and not isinstance(value, bool)):
        return True
    if isinstance(value, str):
        return value.startswith("cuda")
    return isinstance(value, torch.device) and value.type == "cuda"


class _OnTheDevice:
    """The fake tensors are CPU ones that stand for CUDA's (as every tracer's): what Megatron makes or moves
    on the GPU is made on the CPU, and what it makes on the host (a factory without a device, the string
    `"cpu"`: the local spec's norms before `model.cuda()`) is host memory; `.cuda()` and `.to(<the GPU>)` of
    a host tensor are device copies, `.cpu()` and `.to("cpu")` of a device tensor host copies."""

    def __init__(self, rec):
        self.rec = rec

    def __enter__(self):
        import torch
        from torch.overrides import TorchFunctionMode
        from torch.utils._pytree import tree_leaves, tree_map

        from megatron.core.tensor_parallel import random as mrandom

        from .trace_dist import patch
        from .trace_zero import is_host, names_host

        rec = self.rec
        cpu = torch.device("cpu")
        factories = {getattr(torch, name) for name in FACTORIES}

        def on_host(out):
            rec.classify([t for t in tree_leaves(out) if isinstance(t, torch.Tensor)], "host")

        class Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = dict(kwargs or {})
                if func is torch.Tensor.cuda:
                    tensor = args[0]
                    return rec.copy_as(tensor, "temporary") if is_host(rec, tensor) else tensor
                if func is torch.Tensor.cpu:
                    tensor = args[0]
                    return tensor if is_host(rec, tensor) else rec.copy_as(tensor, "host")
                if func is torch.tensor and isinstance(args[0], (list, tuple)):
                    # A list of tensors (Megatron's norms of every gradient): each value read back to the host.
                    args = (tree_map(lambda v: float(v) if isinstance(v, torch.Tensor) else v, list(args[0])),
                            *args[1:])  # fmt: skip
                to_device = to_host = False
                if "device" in kwargs:
                    to_device, to_host = _device_target(kwargs["device"]), names_host(kwargs["device"])
                    if to_device:
                        kwargs["device"] = cpu
                args = list(args)
                for i, a in enumerate(args):
                    if _device_target(a) and not isinstance(a, int) or (isinstance(a, int) and func is torch.Tensor.to and i == 1):
                        args[i], to_device = cpu, True
                    elif names_host(a):
                        to_host = True
                if func is torch.Tensor.to:
                    tensor = args[0]
                    if to_device and is_host(rec, tensor):
                        args[0] = rec.copy_as(tensor, "temporary")
                    elif to_host and not is_host(rec, tensor):
                        args[0] = rec.copy_as(tensor, "host")
                    return func(*args, **kwargs)
                out = func(*args, **kwargs)
                if to_host or (func in factories and kwargs.get("device") is None and not to_device):
                    on_host(out)
                return out

        self._mode = Mode()
        self._mode.__enter__()
        # The autograd engine does not carry function modes into the backward, where Megatron's
        # checkpointing (`CheckpointFunction`, full and selective recompute) runs the forward again.
        checkpoint = mrandom.CheckpointFunction
        real_backward = checkpoint.backward
        mode = self._mode

        def backward(ctx, *args):
            with mode:
                return real_backward(ctx, *args)

        self._stack = contextlib.ExitStack()
        patch(self._stack, checkpoint, "backward", staticmethod(backward))
        return self

    def __exit__(self, *exc):
        self._stack.close()
        return self._mode.__exit__(*exc)
