"""Trace a DeepSpeed ZeRO-1/2/3 run as rank 0 of its world: the engine `dist.py` builds
(`deepspeed.initialize` with `ds_config`), under torch's `fake` process group on the CPU, inside
the tracer's `FakeTensorMode` (`trace.py`), on DeepSpeed's CUDA code path.

On a machine without a GPU DeepSpeed selects its CPU accelerator, another code path (a
shared-memory comm op, no streams). The tracer installs `CUDA_Accelerator` instead
(`deepspeed.accelerator.set_accelerator`), so every branch DeepSpeed takes on `is_synchronized_device()`,
`Stream`, `pin_memory` and the communication backend is the CUDA run's. What its methods would ask
the driver is answered here, none of it an allocation:
- **Device.** `set_device`, `current_device` and `device_count` name device 0; the tensors are the
  tracer's fake CPU tensors that stand for CUDA ones, so `device_name` and `current_device_name`
  say `cpu` (every `torch.device(...)` DeepSpeed builds from them is where the fake tensors live),
  as a string of its own type ([`DEVICE`]): the plain string `"cpu"` is DeepSpeed's name for
  the host. `FloatTensor` and `ByteTensor` make their small tensors on the device.
- **Streams and events.** Streams are `torch.cpu`'s, whose `stream(s)` context makes `s` current,
  and the recorder attributes each storage to the current stream (`trace_dist.Streams`), as CUDA's
  caching allocator takes `getCurrentCUDAStream()`; events and a stream's `synchronize` order
  nothing (the replay is sequential). `Tensor.record_stream`, which ZeRO-3 calls on its gathered
  parameters and gradients and which has no CPU kernel, is recorded for the replay
  ([`_record_streams`]).
- **Where a tensor lives.** `on_accelerator` says what CUDA would: every fake tensor but those the
  tracer made on the host (ZeRO-3 frees a parameter through `record_stream` only on the device).
- **Memory queries.** `memory_allocated`, `max_memory_allocated`, ... answer 0 and
  `reset_peak_memory_stats` does nothing: DeepSpeed calls them only to log (`see_memory_usage`).
  `empty_cache` is recorded where DeepSpeed calls it, for the replay to release the free segments.
- **Seeds and RNG state.** No-ops: random values do not exist under fake tensors.
- **Pinned host memory.** `pin_memory` returns the tensor, marked as host memory (`kind: host`,
  not replayed): DeepSpeed pins only what it keeps on the host, as `offload_param`'s partitions.

Host copies. The fake tensors stand for CUDA tensors but live on the CPU, where `.cpu()` is the
tensor itself. ZeRO-1/2's optimizer copies each bit16 parameter to the host
(`param.cpu_data = param.data.cpu()`), frees the device copy, calls `empty_cache()`, flattens the
host copies and moves the flat buffer to the device (`stage_1_and_2.py`, `DeepSpeedZeroOptimizer.__init__`).
The tracer makes those copies as CUDA makes them ([`_host_copies`]): `.cpu()` and `.to("cpu")` of
a device tensor are new host tensors (`kind: host`, out of the replay), what the flattening makes
from the host copies (the padding, the flat buffer) is host, and `.to(device)` of a host tensor is a
new device tensor. What a function makes on `"cpu"` (`torch.zeros(n, device="cpu")`) is host,
and so is what an operator makes from host tensors only, as a CPU kernel's output is
(`Recorder.host_follows_inputs`).

ZeRO-3's checks that every rank recorded the same module and parameter order broadcast rank 0's
lists and read them back; rank 0 of a fake world reads its own ([`_rank_checks`]).

`offload_param` runs so (its partitions pinned on the host, each gather's `.to(device)` a device
copy). So does `offload_optimizer`: DeepSpeed makes the fp32 master partitions, their gradient
buffers and bf16 staging buffers on `"cpu"` and pins them, copies each reduced gradient (cast to
fp32 on the device) into the host buffer, and after the host step copies the updated masters back
into the bf16 device partition, through buffers this module sees as they are. The host step
itself is DeepSpeedCPUAdam's C++ op, which DeepSpeed JIT-builds; it updates host tensors in place
and asks the device for nothing, so the tracer gives it an op that does nothing ([`_HostAdam`]),
and DeepSpeedCPUAdam's Python (its moments `zeros_like` the host masters) runs as it is.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os

from .trace import TraceError


class _DeviceName(str):
    """The CUDA device's name as the fake accelerator gives it: `cpu`, where the fake tensors
    live, told apart from the `"cpu"` DeepSpeed names the host with."""


DEVICE = _DeviceName("cpu")


def names_host(device) -> bool:
    """Whether DeepSpeed names the host by `device`: the string `"cpu"` (`OffloadDeviceEnum.cpu`
    included), not the accelerator's name. A `torch.device` is the fake tensors' own device,
    which stands for CUDA's."""
    return isinstance(device, str) and not isinstance(device, _DeviceName) and device == "cpu"

class _Event:
    def __init__(self, *args, **kwargs):
        pass

    def record(self, stream=None):
        pass

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, other):
        return 0.0


def fake_cuda_accelerator(rec, total_memory: int):
    """DeepSpeed's `CUDA_Accelerator` with the driver's answers given as the module doc says
    (`total_memory` only for its logs: ZeRO-1/2 size nothing by it)."""
    import torch
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    class Stream(torch.cpu.Stream):
        """`torch.cpu`'s stream with CUDA's waits, which order nothing here."""

        def synchronize(self):
            pass

        def query(self):
            return True

    default = Stream()  # current while the run is traced (`run_zero_loop`)

    class FakeCudaAccelerator(CUDA_Accelerator):
        def is_available(self):
            return True

        def device_count(self):
            return 1

        def set_device(self, device_index):
            pass

        def current_device(self):
            return 0

        def current_device_name(self):
            return DEVICE

        def device_name(self, device_index=None):
            return DEVICE

        def device(self, device_index=None):
            return contextlib.nullcontext()

        def synchronize(self, device_index=None):
            pass

        @property
        def Stream(self):
            return Stream

        def stream(self, stream):
            return torch.cpu.stream(stream)

        def current_stream(self, device_index=None):
            return torch.cpu.current_stream()

        def default_stream(self, device_index=None):
            return default

        @property
        def Event(self):
            return _Event

        def memory_allocated(self, device_index=None):
            return 0

        max_memory_allocated = memory_reserved = max_memory_reserved = memory_allocated
        memory_cached = max_memory_cached = memory_allocated

        def reset_peak_memory_stats(self, device_index=None):
            pass

        reset_max_memory_allocated = reset_max_memory_cached = reset_peak_memory_stats

        def empty_cache(self):
            rec.empty_cache()

        def memory_stats(self, device_index=None):
            return {}

        def total_memory(self, device_index=None):
            return total_memory

        available_memory = total_memory

        # CUDA's small tensors of Python values (`FloatTensor([norm])`), made on the device.
        @property
        def FloatTensor(self):
            return functools.partial(torch.tensor, dtype=torch.float, device=DEVICE)

        @property
        def ByteTensor(self):
            return functools.partial(torch.tensor, dtype=torch.uint8, device=DEVICE)

        def is_bf16_supported(self):
            return True

        def is_fp16_supported(self):
            return True

        def manual_seed(self, seed):
            pass

        manual_seed_all = manual_seed

        def initial_seed(self):
            return 0

        def set_rng_state(self, new_state, device_index=None):
            pass

        def pin_memory(self, tensor, align_bytes=1):
            rec.classify([tensor], "host")  # DeepSpeed pins only what it keeps on the host
            return tensor

        def is_pinned(self, tensor):
            return False

        def on_accelerator(self, tensor):
            return is_device(rec, tensor)

        def range_push(self, msg):
            pass

        def range_pop(self):
            pass

    return FakeCudaAccelerator()


def _record_streams(stack: contextlib.ExitStack, rec, streams) -> None:
    """`Tensor.record_stream(s)` recorded (`Recorder.record_stream`), `s` numbered by `streams`:
    the CPU has no kernel for it (`aten::record_stream`), and its effect is the caching
    allocator's, which the replay has."""
    import torch

    from .trace_dist import patch

    def record_stream(tensor, stream):
        rec.record_stream(tensor, streams.number(stream))

    patch(stack, torch.Tensor, "record_stream", record_stream)


def is_host(rec, tensor) -> bool:
    """Whether the tracer made `tensor`'s storage on the host."""
    sid = rec._id_of(tensor)
    return sid is not None and rec.storages[sid]["kind"] == "host"


def is_device(rec, tensor) -> bool:
    """Whether `tensor` stands for a CUDA tensor: a fake one not made on the host."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor) and not is_host(rec, tensor)


def _rank_checks(stack: contextlib.ExitStack, rec) -> None:
    """ZeRO-3's checks that every rank recorded the same module and parameter order
    (`assert_ints_same_as_other_ranks`) run as on the GPU, their tensors made and broadcast, and
    read back what rank 0 broadcast: its own list."""
    from deepspeed.runtime.zero import utils

    from .trace_dist import patch

    length, values = utils.assert_lst_len_same_as_other_ranks, utils.get_lst_from_rank0

    def same_length(lst):
        with rec.reading([len(lst)]):
            return length(lst)

    def from_rank0(lst):
        with rec.reading(lst):
            return values(lst)

    patch(stack, utils, "assert_lst_len_same_as_other_ranks", same_length)
    patch(stack, utils, "get_lst_from_rank0", from_rank0)


@contextlib.contextmanager
def _host_copies(rec):
    """`.cpu()` and `.to(device)` copy between host and device as on CUDA, and what DeepSpeed makes
    on the host is host memory (the module doc)."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_leaves

    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from .trace_dist import patch

    real_cpu, real_to = torch.Tensor.cpu, torch.Tensor.to
    real_flatten = DeepSpeedZeroOptimizer.flatten_dense_tensors_aligned

    def cpu(tensor, *args, **kwargs):
        if is_host(rec, tensor):
            return real_cpu(tensor, *args, **kwargs)
        return rec.copy_as(tensor, "host")

    def to(tensor, *args, **kwargs):
        target = kwargs.get("device", next((a for a in args if isinstance(a, (str, torch.device))), None))
        if is_host(rec, tensor) and target is not None and not names_host(target):
            return real_to(rec.copy_as(tensor, "temporary"), *args, **kwargs)  # to the device: a device copy
        if not is_host(rec, tensor) and names_host(target):
            tensor = rec.copy_as(tensor, "host")  # to the host: a host copy
        return real_to(tensor, *args, **kwargs)  # a cast stays where the tensor is

    def flatten_dense_tensors_aligned(self, tensor_list, alignment, use_cpu_data=False):
        first = len(rec.storages)
        out = real_flatten(self, tensor_list, alignment, use_cpu_data)
        if use_cpu_data:  # the padding (made on the host copies' `device`) and the flat buffer
            for storage in rec.storages[first:]:
                storage["kind"] = "host"
        return out

    class HostFactories(TorchFunctionMode):
        """What a function makes on the device DeepSpeed names the host is host memory."""

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if any(names_host(a) for a in (*args, *kwargs.values())):
                rec.classify([t for t in tree_leaves(out) if isinstance(t, torch.Tensor)], "host")
            return out

    with contextlib.ExitStack() as stack:
        patch(stack, torch.Tensor, "cpu", cpu)
        patch(stack, torch.Tensor, "to", to)
        patch(stack, DeepSpeedZeroOptimizer, "flatten_dense_tensors_aligned", flatten_dense_tensors_aligned)
        stack.enter_context(HostFactories())
        # An operator on host tensors (the offloaded optimizer's masters and gradients) makes
        # host tensors.
        patch(stack, rec, "host_follows_inputs", True)
        yield


class _HostAdam:
    """DeepSpeedCPUAdam's C++ op (`CPUAdamBuilder().load()`), which DeepSpeed JIT-builds: its
    `adam_update` steps the fp32 masters, gradients and moments in their host memory, in place,
    which asks the GPU for nothing. DeepSpeedCPUAdam's own Python runs as it is: its moments are
    made beside the host masters (`zeros_like(p)`), host memory."""

    def load(self):
        return self

    def create_adam(self, *args):
        pass

    def adam_update(self, *args):
        pass

    def destroy_adam(self, *args):
        pass


def _host_adam(stack: contextlib.ExitStack) -> None:
    """DeepSpeedCPUAdam steps through `_HostAdam`."""
    from deepspeed.ops.adam import cpu_adam

    from .trace_dist import patch

    patch(stack, cpu_adam, "CPUAdamBuilder", _HostAdam)


@contextlib.contextmanager
def deepspeed_on_cuda(rec, world_size: int, strategy: str):
    """Rank 0 of a fake world of `world_size` with DeepSpeed on its CUDA code path, as the module
    doc says; `strategy` names the spec's in the message if DeepSpeed does not import."""
    import torch

    # What torchrun sets for rank 0, which the engine reads; DeepSpeed's modules that ask for
    # the accelerator while they are imported get CUDA's.
    for name, value in (("LOCAL_RANK", 0), ("RANK", 0), ("WORLD_SIZE", world_size)):
        os.environ[name] = str(value)
    os.environ["DS_ACCELERATOR"] = "cuda"
    try:
        from deepspeed import accelerator
    except ImportError as err:
        raise TraceError(
            f"`parallel.strategy: {strategy}` runs DeepSpeed, which does not import here ({err}); "
            "install the version the run uses (`pip install deepspeed`)"
        ) from None

    from . import trace_zero_ranks
    from .trace_dist import Streams, fake_world

    fake = fake_cuda_accelerator(rec, 80 * 2**30)
    before = accelerator.get_accelerator()
    accelerator.set_accelerator(fake)
    try:
        with fake_world(world_size), _host_copies(rec), contextlib.ExitStack() as stack:
            stack.enter_context(torch.cpu.stream(fake.default_stream()))
            streams = Streams()
            rec.stream_of = streams.current
            _record_streams(stack, rec, streams)
            _rank_checks(stack, rec)
            _host_adam(stack)
            trace_zero_ranks.without_rank_views(stack)
            yield
            # Engines nothing holds any more go while the group lives: their `destroy` asks it
            # for the rank.
            gc.collect()
    finally:
        accelerator.set_accelerator(before)


def engine_step(rec, spec, engine, ids, autocast, mark=lambda part: None):
    """One step of a DeepSpeed engine as the harnesses run it: `loss = engine(...)`,
    `engine.backward(loss)`, `engine.step()` (which zeroes the gradients); `mark(part)` begins
    the phase of each part."""
    from . import measure as m

    mark("forward")
    start = len(rec.events)
    loss = m._train_forward(spec, engine, ids, autocast)
    rec.classify_phase("activation", start)
    rec.classify([loss], "temporary")
    mark("backward")
    engine.backward(loss)
    del loss
    mark("optimizer")
    engine.step()


def run_zero_loop(rec, spec, fields: dict, progress, steps: int):
    """`measure_dist`'s load and steps of a DeepSpeed engine on rank 0 of a fake world, every
    phase marked."""
    import torch

    from . import dist as d
    from . import measure as m
    from .trace import _ModuleNames, autocast_of

    par = spec.parallel
    device = torch.device("cpu")
    with deepspeed_on_cuda(rec, par.world_size, par.strategy):
        rec.phase("load")
        cfg = m._hf_config(spec, fields)
        cls = m._auto_class(spec)
        dtype = torch.bfloat16 if spec.precision == "bf16" else torch.float32
        engine = d._build_zero(spec, cfg, cls, dtype, device)
        _ModuleNames.current.name(engine.module)
        rec.classify(engine.module.parameters(), "parameter")
        rec.classify(engine.module.buffers(), "buffer")
        engine.train()
        ids = torch.randint(0, fields["vocab_size"], (spec.batch_size, spec.seq_len), device=device)
        rec.classify([ids], "input")

        # `measure_dist`'s autocast, which DeepSpeed's engine turns off inside its forward.
        autocast = autocast_of(spec)

        for step in range(1, steps + 1):
            if progress:
                progress(step, steps)
            engine_step(rec, spec, engine, ids, autocast, mark=lambda part: rec.phase(f"step {step} {part}"))
        del engine, ids
