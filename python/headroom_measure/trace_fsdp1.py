"""FSDP1 (`FullyShardedDataParallel`) traced as rank 0 of its world: the harness's own
`dist._build_fsdp1` and FSDP1's runtime under the tracer's fake tensors (`trace.py`) and torch's
`fake` process group (`trace_dist.py`). What differs between fake tensors on the CPU and CUDA
tensors is put back:

- **The meta model.** The GPU run builds the model on `meta` and `param_init_fn` materialises
  each unit with `to_empty`, which gives each module new Parameters (`Module._apply`'s branch for
  a plain tensor). Built on `meta` inside the fake mode, the parameters would be fake tensors,
  which `_apply` swaps in place instead, and fake tensors cannot be swapped. The meta model is
  built outside the fake mode, as the real meta tensors the GPU run has (they hold no memory);
  `to_empty` then makes the fake device tensors, one per parameter, as on the GPU.
- **Data pointers.** FSDP1 tells storages apart by their data pointers (`_same_storage`,
  `_data_ptr_allocated`, the catch-all reshard's "already resharded" check), which fake tensors
  do not have (every one reads 0). A fake storage's pointer is made its identity while it holds
  bytes and 0 once freed, as a CUDA storage's is.
- **Resized storages.** FSDP1 frees and re-allocates the unsharded flat parameters and the
  low-precision shards by resizing their storages (`_free_storage`, `_alloc_storage`, and
  `shard()`'s resize of the flat parameter it built), which no operator sees; those are
  recorded as a free and a new allocation.
- **Backward streams.** On the GPU the autograd engine runs each node on the stream its forward
  op ran on (`engine.cpp`); on the CPU it switches no stream. FSDP1 makes the original
  parameters as views of the unsharded flat parameter on its unshard stream, so the node that
  concatenates their gradients into the flat gradient runs, and allocates it, there.
  `_BackwardStreams` notes the stream of every function run on a side stream in the grad_fn of
  its outputs (`Node.metadata`), and a backward node that runs while no side stream is set
  explicitly allocates on its forward's stream.

Streams are followed as for FSDP2 otherwise (`trace_dist.Streams`): FSDP1 switches to its
pre-unshard, unshard and post-backward streams with `torch.cpu.stream(...)` on the CPU. Its
`record_stream` calls are no-ops for CPU tensors; on the GPU they defer a block's reuse until the
other stream's work is done, which a replay in program order (every kernel done when issued)
does not see either.

- **CPU offload.** FSDP1 moves each sharded flat parameter to the host after it is built
  (`flat_param_to(cpu)`), pins it and a host gradient shard (`_cpu_grad`), and under mixed
  precision casts each unshard's low-precision shard from `_local_shard.to(device)`; each reduced
  gradient shard is copied into `_cpu_grad`, where the optimizer steps. Every `torch.device` here
  is the fake tensors' `cpu`, so the moves are no-ops and the checks pass; the tracer makes the
  copies CUDA makes (`Fsdp1OnFakeTensors._offload`): a flat parameter's move a copy on the other
  side, each unshard's full-precision device copy, and what FSDP1 pins host memory.

Not put back yet: the engine sums a gradient's two contributions (a tied embedding's) on the
stream of the node they flow into, the root's unshard stream on the GPU, which the recorder cannot
name (the sum runs between nodes); here it is on the default stream.
"""

from __future__ import annotations

import contextlib

_STREAM = "headroom_forward_stream"


class _BackwardStreams:
    """`stream_of` for the recorder with the engine's rule: a backward node runs on its
    forward's stream unless a side stream is current. The forward's stream is noted in the
    grad_fn of each output made on a side stream (`Node.metadata`) by a torch function mode,
    which sees the outputs autograd returns (a view's, which the dispatch level does not)."""

    def __init__(self, rec):
        self.current = rec.stream_of

    def mode(self):
        import torch
        from torch.overrides import TorchFunctionMode
        from torch.utils._pytree import tree_leaves

        streams = self

        class Note(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                sid = streams.current()
                if sid:
                    for t in tree_leaves(out):
                        node = t.grad_fn if isinstance(t, torch.Tensor) else None
                        if node is not None:
                            node.metadata.setdefault(_STREAM, sid)
                return out

        return Note()

    def stream_of(self) -> int:
        import torch

        sid = self.current()
        node = torch._C._current_autograd_node() if sid == 0 else None
        return node.metadata.get(_STREAM, 0) if node is not None else sid


class Fsdp1OnFakeTensors:
    """The points above, for the life of a `with` block."""

    def __init__(self, rec, offload: bool = False):
        self.rec = rec
        self.offload = offload  # `offload_params`: CPU offload's copies made (`_offload`)
        self._stack = contextlib.ExitStack()

    def __enter__(self):
        import torch
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.distributed.fsdp import _flat_param

        from .trace_dist import patch

        rec = self.rec
        real_alloc, real_free = _flat_param._alloc_storage, _flat_param._free_storage

        def alloc_storage(tensor, size):
            real_alloc(tensor, size)
            rec.storage_resized(tensor, "fsdp1 _alloc_storage")

        def free_storage(tensor):
            real_free(tensor)
            rec.storage_resized(tensor, "fsdp1 _free_storage")

        real_storage_ptr = torch.UntypedStorage.data_ptr

        def storage_ptr(storage):
            if storage.device.type != "meta":
                return real_storage_ptr(storage)
            return storage._cdata if storage.nbytes() else 0

        def tensor_ptr(t):
            base = t.untyped_storage().data_ptr()
            return base + t.storage_offset() * t.element_size() if base else 0

        streams = _BackwardStreams(rec)
        patch(self._stack, rec, "stream_of", streams.stream_of)
        self._stack.enter_context(streams.mode())
        handle_cls = _flat_param.FlatParamHandle
        real_shard = handle_cls.shard

        def shard(handle):
            unsharded = handle.flat_param.detach()  # a view of the unsharded storage
            real_shard(handle)
            rec.storage_resized(unsharded, "fsdp1 shard")  # resized to 0 before `set_`: freed

        patch(self._stack, handle_cls, "shard", shard)
        if self.offload:
            self._offload(handle_cls)
        patch(self._stack, _flat_param, "_alloc_storage", alloc_storage)
        patch(self._stack, _flat_param, "_free_storage", free_storage)
        patch(self._stack, torch.UntypedStorage, "data_ptr", storage_ptr)
        patch(self._stack, FakeTensor, "data_ptr", tensor_ptr)
        return self

    def _offload(self, handle_cls):
        """CPU offload's copies, made as CUDA makes them (the module doc)."""
        import torch

        from .trace_dist import patch
        from .trace_zero import is_host

        rec = self.rec
        real_to, real_low = handle_cls.flat_param_to, handle_cls._use_low_precision_shard

        def flat_param_to(handle, *args, **kwargs):
            # Every move is between the host and the device: the flat parameter becomes a copy
            # on the other side, and the old storage goes.
            flat = handle.flat_param
            flat.data = rec.copy_as(flat, "temporary" if is_host(rec, flat) else "host")
            real_to(handle, *args, **kwargs)  # the views of the original parameters follow

        def use_low_precision_shard(handle):
            real_low(handle)
            if handle._offload_params:  # a pipeline's other FSDP1 instances may keep theirs on the device
                # `_mp_shard.copy_(_local_shard.to(device))`: the host shard's full-precision device
                # copy, cast into the low-precision shard and dropped.
                copy = rec.copy_as(handle.flat_param._local_shard, "temporary")
                del copy

        def pin_memory(tensor, *args, **kwargs):
            rec.classify([tensor], "host")  # FSDP1 pins what it keeps on the host
            return tensor

        # What FSDP1 makes from host tensors (the gradient writeback's `zeros_like(flat_param)`)
        # is host memory, as a CPU kernel's output is.
        patch(self._stack, rec, "host_follows_inputs", True)
        patch(self._stack, handle_cls, "flat_param_to", flat_param_to)
        patch(self._stack, handle_cls, "_use_low_precision_shard", use_low_precision_shard)
        patch(self._stack, torch.Tensor, "pin_memory", pin_memory)
        # The post-backward callback waits for the gradients' host copies; the replay is in order.
        patch(self._stack, torch.cpu.Stream, "synchronize", lambda stream: None)

    def __exit__(self, *exc):
        return self._stack.__exit__(*exc)


class _MetaOutsideFake:
    """The model class `_build_fsdp1` builds from, its `from_config` run outside the fake mode:
    under `torch.device("meta")` that makes real meta tensors, as the GPU run has."""

    def __init__(self, cls):
        from .trace_dist import _outside_fake

        self.from_config = _outside_fake(cls.from_config)


def build_fsdp1(rec, spec, cfg, cls, dtype, device):
    """`dist._build_fsdp1` on rank 0, from a meta model of real meta tensors."""
    from . import dist

    model, _ = dist._build_fsdp1(spec, cfg, _MetaOutsideFake(cls), dtype, device)
    return model
