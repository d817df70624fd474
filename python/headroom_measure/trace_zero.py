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
  say `cpu` (every `torch.device(...)` DeepSpeed builds from them is where the fake tensors live).
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
The tracer makes those copies as CUDA makes them ([`_host_copies`]): `.cpu()` of a device tensor
is a new host tensor (`kind: host`, out of the replay), what the flattening makes from the host
copies (the padding, the flat buffer) is host, and `.to(device)` of a host tensor is a new device tensor.

ZeRO-3's checks that every rank recorded the same module and parameter order broadcast rank 0's
lists and read them back; rank 0 of a fake world reads its own ([`_rank_checks`]).

`offload_param` runs so (its partitions pinned on the host, each gather's `.to(device)` a device
copy); `offload_optimizer` is refused ([`refuse_untraceable_zero`] says why).
"""

from __future__ import annotations

import contextlib
import os

from .trace import TraceError

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
            return "cpu"

        def device_name(self, device_index=None):
            return "cpu"

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
    """`.cpu()` and `.to(device)` copy between host and device as on CUDA (the module doc)."""
    import torch
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    from .trace_dist import patch

    real_cpu, real_to = torch.Tensor.cpu, torch.Tensor.to
    real_flatten = DeepSpeedZeroOptimizer.flatten_dense_tensors_aligned

    def cpu(tensor, *args, **kwargs):
        if is_host(rec, tensor):
            return real_cpu(tensor, *args, **kwargs)
        copy = tensor.clone()
        rec.classify([copy], "host")
        return copy

    def to(tensor, *args, **kwargs):
        if not is_host(rec, tensor):
            return real_to(tensor, *args, **kwargs)
        if "device" in kwargs or any(isinstance(a, (str, torch.device)) for a in args):
            return real_to(tensor.clone(), *args, **kwargs)  # to the device: a device copy
        out = real_to(tensor, *args, **kwargs)  # a cast stays on the host
        rec.classify([out], "host")
        return out

    def flatten_dense_tensors_aligned(self, tensor_list, alignment, use_cpu_data=False):
        first = len(rec.storages)
        out = real_flatten(self, tensor_list, alignment, use_cpu_data)
        if use_cpu_data:  # the padding and the flat buffer are made on the host
            for storage in rec.storages[first:]:
                storage["kind"] = "host"
        return out

    with contextlib.ExitStack() as stack:
        patch(stack, torch.Tensor, "cpu", cpu)
        patch(stack, torch.Tensor, "to", to)
        patch(stack, DeepSpeedZeroOptimizer, "flatten_dense_tensors_aligned", flatten_dense_tensors_aligned)
        yield


def refuse_untraceable_zero(par) -> None:
    """Refuse, by name, the DeepSpeed layouts the tracer cannot run."""
    if par.offload_optimizer:
        raise TraceError(
            f"`parallel.offload_optimizer: true` under {par.strategy}: DeepSpeedCPUAdam, the C++ op DeepSpeed "
            "JIT-builds for the host step, reads the tensors' memory, which fake tensors do not have; the tracer "
            "runs offload_params without it; `headroom estimate` models the optimizer offload natively"
        )


def run_zero_loop(rec, spec, fields: dict, progress, steps: int):
    """`measure_dist`'s load and steps of a DeepSpeed engine on rank 0 of a fake world, every
    phase marked."""
    import torch

    # What torchrun sets for rank 0, which the engine reads; DeepSpeed's modules that ask for
    # the accelerator while they are imported get CUDA's.
    for name, value in (("LOCAL_RANK", 0), ("RANK", 0), ("WORLD_SIZE", spec.parallel.world_size)):
        os.environ[name] = str(value)
    os.environ["DS_ACCELERATOR"] = "cuda"
    try:
        from deepspeed import accelerator
    except ImportError as err:
        raise TraceError(
            f"`parallel.strategy: {spec.parallel.strategy}` runs DeepSpeed, which does not import here ({err}); "
            "install the version the run uses (`pip install deepspeed`)"
        ) from None

    from . import dist as d
    from . import measure as m
    from .trace import _ModuleNames, autocast_of
    from .trace_dist import Streams, fake_world

    par = spec.parallel
    fake = fake_cuda_accelerator(rec, 80 * 2**30)
    before = accelerator.get_accelerator()
    accelerator.set_accelerator(fake)
    device = torch.device("cpu")
    try:
        with fake_world(par.world_size), _host_copies(rec), contextlib.ExitStack() as stack:
            stack.enter_context(torch.cpu.stream(fake.default_stream()))
            streams = Streams()
            rec.stream_of = streams.current
            _record_streams(stack, rec, streams)
            _rank_checks(stack, rec)
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
                rec.phase(f"step {step} forward")
                start = len(rec.events)
                loss = m._train_forward(spec, engine, ids, autocast)
                rec.classify_phase("activation", start)
                rec.classify([loss], "temporary")
                rec.phase(f"step {step} backward")
                engine.backward(loss)
                del loss
                rec.phase(f"step {step} optimizer")
                engine.step()
            del engine, ids
    finally:
        accelerator.set_accelerator(before)
