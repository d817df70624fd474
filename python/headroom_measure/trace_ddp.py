"""`DistributedDataParallel` traced as rank 0 of its world: the real wrapper and its C++ `Reducer`
run under the tracer's fake tensors (`trace.py`) and torch's `fake` process group
(`trace_dist.py`), so every gradient bucket, bucket rebuild and broadcast buffer the Reducer asks
for is an operator the recorder sees.

Two points of DDP's C++ read or write tensor memory, which fake tensors do not have, and one
needs what the fake process group does not give; each is handled so that it makes the device
allocations it makes on the GPU, in the same order:

- **The constructor's parameter check** (`_verify_params_across_processes`, `reducer.cpp`): it
  writes each parameter's sizes and strides into a host tensor, copies it to the device,
  broadcasts it, and reads every rank's parameter count after an all-gather. On the CPU its
  `.to(device)` copies are no-ops, so running it there would not make its device tensors;
  `_verify_params` makes them as it does on the GPU (the parameter count's copy, one all-gather
  output per rank, ProcessGroupNCCL's flat all-gather buffer, the metadata's copy, freed as its
  locals go). The check itself cannot fail here: every rank of the fake world holds the same
  model.
- **The bucket rebuild before the second forward** (`Reducer::rebuild_buckets`): it computes
  the new buckets from the order the first backward readied the gradients in, then
  `sync_bucket_indices` writes them into host int tensors, copies those to the device,
  broadcasts from rank 0 and reads them back. During the call, `_Dispatch` answers the two
  host tensors' allocations (`at::empty` without a device) with real CPU tensors, which the
  recorder leaves out (host memory), and their copies back from the device with nothing: on rank
  0, the broadcast's source, the copy brings back what was written. The device tensors and the new
  buckets are the Reducer's own, recorded as any operator's.
- **The all-reduce's result**: the Reducer takes each bucket's reduced tensor from the
  collective's future, which NCCL's work fills and the fake group's leaves empty; `_Dispatch`
  gives the fake group's all-reduce a work whose future holds its (in-place) tensors.

Everything else runs as is: the state broadcast (`_broadcast_coalesced`: flat buckets of up to
250 MiB, two in flight), the Reducer's buckets (one per dtype until the rebuild, then 1 MiB
first and 25 MiB after in gradient-ready order), each gradient's copy into its bucket view scaled
by 1 / world size (`mul_out`, no allocation), the all-reduce in place, the copies back into
`.grad`, and the buffers' broadcast before every forward.
"""

from __future__ import annotations

import contextlib


def _verify_params(process_group, tensors, logger=None):
    """`verify_params_across_processes` (reducer.cpp) as its device allocations on the GPU under
    NCCL: `at::tensor({count})` copied to the device, `empty_like` of it once per rank for the
    all-gather, which ProcessGroupNCCL gathers through a flat buffer of them all (freed when the
    collective returns), then the sizes-and-strides metadata copied to the device; at the end
    the metadata goes, then the gathered counts in order, then the count."""
    import torch

    device = tensors[0].device
    world = process_group.size()
    count = torch.empty(1, dtype=torch.long, device=device)
    gathered = [torch.empty_like(count) for _ in range(world)]
    flat = torch.empty(world, dtype=torch.long, device=device)
    del flat
    metadata = torch.empty(sum(2 * t.dim() for t in tensors), dtype=torch.long, device=device)
    del metadata
    while gathered:
        del gathered[0]
    del count


class _Dispatch:
    """What the recorder's `answers` hook answers while DDP runs, every other operator asked of
    the answers in place before (`outer`).

    - The fake process group's all-reduce returns a work whose future holds nothing, where
      NCCL's holds the reduced tensors, which the Reducer takes as the bucket's result
      (`parseCppCommHookResult`): its work is replaced by one whose future holds them (the
      tensors reduced in place; nothing is allocated).
    - During a bucket rebuild (`rebuilding`), `sync_bucket_indices`'s host tensors: an `empty`
      with no device is `at::empty(..., at::kInt)`, a host tensor, made real so the Reducer can
      write the indices into it (the recorder leaves real tensors out); a copy into a real tensor
      is the copy back from the device, which on rank 0, the broadcast's source, brings back the
      same values."""

    def __init__(self, outer):
        self.outer = outer
        self.rebuilding = False

    def uniform(self, t):
        return self.outer.uniform(t) if self.outer is not None else None

    def dispatch(self, rec, func, args, kwargs):
        import torch
        from torch._C._distributed_c10d import _create_work_from_future
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.utils._python_dispatch import _disable_current_modes

        aten = torch.ops.aten
        if func is torch.ops.c10d.allreduce_.default:
            tensors, _ = func(*args, **(kwargs or {}))
            future = torch.futures.Future()
            future.set_result(tensors)
            return tensors, _create_work_from_future(future).boxed()
        if self.rebuilding:
            if func is aten.empty.memory_format and (kwargs or {}).get("device") is None:
                with _disable_current_modes():
                    return func(*args, **(kwargs or {}))
            if func is aten.copy_.default and not isinstance(args[0], FakeTensor):
                return args[0]
        if self.outer is not None:
            return self.outer.dispatch(rec, func, args, kwargs)
        return NotImplemented


class DdpOnFakeTensors:
    """The three points above handled for the life of a `with` block."""

    def __init__(self, rec):
        self.rec = rec
        self._stack = contextlib.ExitStack()

    def __enter__(self):
        import torch.distributed as dist
        from torch.nn.parallel import distributed as ddp_module

        from .trace_dist import patch

        rec = self.rec
        answers = _Dispatch(rec.answers)
        patch(self._stack, rec, "answers", answers)
        real_rebuild = dist.Reducer._rebuild_buckets

        def rebuild_buckets(reducer):
            start = len(rec.events)
            answers.rebuilding = True
            try:
                rebuilt = real_rebuild(reducer)
            finally:
                answers.rebuilding = False
            rec.classify_phase("gradient", start)  # the new buckets
            return rebuilt

        patch(self._stack, ddp_module, "_verify_param_shape_across_processes", _verify_params)
        patch(self._stack, dist.Reducer, "_rebuild_buckets", rebuild_buckets)
        return self

    def __exit__(self, *exc):
        return self._stack.__exit__(*exc)


def build_ddp(rec, spec, cfg, cls, dtype, device):
    """`dist._build_ddp` on rank 0: the model, then `DistributedDataParallel(model)` with its
    defaults. What is alive when it returns beside the parameters and buffers is the Reducer's
    gradient buckets."""
    from . import dist

    start = len(rec.events)
    model = dist._build_ddp(spec, cfg, cls, dtype, device, local_rank=0)
    rec.classify_phase("gradient", start)
    rec.classify(model.parameters(), "parameter")
    rec.classify(model.buffers(), "buffer")
    return model
