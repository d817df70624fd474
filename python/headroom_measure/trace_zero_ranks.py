"""ZeRO-3's gathers and reduce-scatters as rank 0 makes them, without a view per rank of the world.

DeepSpeed cuts each flat buffer it gathers or reduce-scatters into one `narrow` view per rank
(`_all_gather_dtype`, `AllGatherCoalescedHandle.wait`, `Init._allgather_params`,
`reduce_scatter_coalesced`): at a world of 512 that is 512 views per parameter and collective,
each a fake-tensor dispatch of about 0.3 ms on the CPU, and a trace of a 512-rank run took hours.
A view allocates nothing. Each function here is DeepSpeed 0.18.2's with its per-rank views
replaced by their lengths; what allocates is made as DeepSpeed makes it, at the same sizes, in the
same order, on the same stream, and freed at the same points:
- a gather's flat buffer (`_all_gather_dtype`, `_allgather_params`);
- each gathered parameter, the `cat` of its ranks' pieces (`wait`): the pieces' values do not
  exist under fake tensors, so the `cat` of one view of the buffer as long as the pieces together
  allocates what theirs does, and `record_stream` of the pieces, which all live in that buffer,
  is `record_stream` of the buffer (recorded once per storage and stream either way);
- `_allgather_params`'s replicated parameters, into which it copies each rank's piece (copies
  that allocate nothing);
- a reduce-scatter's padding of each rank's short chunk, rank by rank, the `cat` of the chunks
  and the paddings, and the paddings freed in reverse as their list goes when it returns.

`test_trace_zero.py` holds a trace made so to the trace made with DeepSpeed's own loops, event for
event.
"""

from __future__ import annotations

import contextlib
import math

from .trace import TraceError


class RankPartitions:
    """The `world` partitions of `flat`, each rank's `narrow` made when it is asked for."""

    def __init__(self, flat, partition_numel: int, world: int):
        self.flat, self.partition_numel, self.world = flat, partition_numel, world

    def __len__(self):
        return self.world

    def __getitem__(self, rank: int):
        if not 0 <= rank < self.world:
            raise IndexError(rank)
        return self.flat.narrow(0, self.partition_numel * rank, self.partition_numel)


def without_rank_views(stack: contextlib.ExitStack) -> None:
    """DeepSpeed's four per-rank loops replaced (the module doc) until `stack` closes."""
    import torch
    from deepspeed.accelerator import get_accelerator
    from deepspeed.runtime.comm import coalesced_collectives
    from deepspeed.runtime.zero import partition_parameters as pp
    from deepspeed.runtime.zero import stage3

    from .trace_dist import patch

    handle_class = pp.AllGatherCoalescedHandle
    real_wait, real_allgather_params = handle_class.wait, pp.Init._allgather_params
    real_convert = pp.Init._convert_to_deepspeed_param

    def all_gather_dtype(params, world_size, rank_in_group, ds_process_group, allgather_dtype):
        dtype = params[0].dtype
        assert all(p.dtype == dtype for p in params), "all params must have the same dtype"
        use_secondary_tensor = params[0].ds_secondary_tensor is not None
        groups = (lambda p: p.ds_secondary_tensor_num_of_groups) if use_secondary_tensor else (lambda p: 1)
        partition_numel = sum(p.ds_tensor.ds_numel * groups(p) for p in params)
        device = get_accelerator().current_device_name()
        flat = torch.empty(partition_numel * world_size, dtype=allgather_dtype, device=device, requires_grad=False)
        partitions = RankPartitions(flat, partition_numel, world_size)
        own = partitions[rank_in_group]
        sources = [p.ds_secondary_tensor if use_secondary_tensor else p.ds_tensor for p in params]
        pp.instrument_w_nvtx(torch.cat)([s.to(device).to(allgather_dtype) for s in sources], out=own)
        handle = pp._dist_allgather_fn(own, flat, ds_process_group)
        return handle_class(
            allgather_handle=handle, params=params, partitions=partitions, world_size=world_size,
            use_secondary_tensor=use_secondary_tensor,
        )  # fmt: skip

    def convert_to_deepspeed_param(self, param):
        real_convert(self, param)
        # `all_gather_coalesced` (under `instrument_w_nvtx`) calls the `_all_gather_dtype` it closes over.
        _set_free_variable(_free_variable(param.all_gather_coalesced, "func"), "_all_gather_dtype", all_gather_dtype)

    def wait(self, handle_dependency=True):
        if self.complete or self.quantization or not isinstance(self.partitions, RankPartitions):
            return real_wait(self, handle_dependency)
        pp.instrument_w_nvtx(self.allgather_handle.wait)()
        synchronized = get_accelerator().is_synchronized_device()
        param_offset = 0
        for param in self.params:
            assert param.ds_status == pp.ZeroParamStatus.INFLIGHT, f"expected param {param.ds_summary()} to be inflight"
            ds_tensor_numel = param.ds_tensor.ds_numel
            if self.use_secondary_tensor:
                ds_tensor_numel *= param.ds_secondary_tensor_num_of_groups
            pieces = [self.partitions.flat.narrow(0, param_offset, param.ds_numel)]
            param.data = pp.instrument_w_nvtx(torch.cat)(pieces).view(param.ds_shape).to(param.ds_tensor.dtype)
            param.ds_status = pp.ZeroParamStatus.AVAILABLE
            if not synchronized and handle_dependency:
                for piece in pieces:
                    piece.record_stream(get_accelerator().current_stream())
            param_offset += ds_tensor_numel
        self.complete = True
        if not synchronized and not handle_dependency:
            handle_class.data_buffer.append(pieces)

    @torch.no_grad()
    def allgather_params(self, param_list, hierarchy=0):
        if not param_list or hasattr(param_list[0], "ds_quant_scale"):
            return real_allgather_params(self, param_list, hierarchy)
        partition_numel = sum(param.ds_tensor.ds_numel for param in param_list)
        flat = torch.empty(
            partition_numel * self.num_partitions, dtype=param_list[0].ds_tensor.dtype, device=self.local_device
        )
        own = RankPartitions(flat, partition_numel, self.num_partitions)[self.get_partition_rank()]
        offset = 0
        for param in param_list:
            own.narrow(0, offset, param.ds_tensor.ds_numel).copy_(param.ds_tensor.data)
            offset += param.ds_tensor.ds_numel
        pp.dist.all_gather_into_tensor(flat, own, group=self.get_partition_dp_group(param), async_op=False)
        for param in param_list:
            replicated = torch.empty(param.ds_shape, dtype=param.ds_tensor.dtype, device=self.local_device)
            param.data = replicated.data
        return None

    @pp.instrument_w_nvtx
    @torch.no_grad()
    def reduce_scatter_coalesced(tensors, group=None):
        this_rank, world = pp.dist.get_rank(group), pp.dist.get_world_size(group)
        chunks = [math.ceil(t.numel() / world) for t in tensors]

        def chunk_of(i, rank):  # the numel of `tensors[i].view(-1)[rank * chunk : (rank + 1) * chunk]`
            return max(0, min(chunks[i], tensors[i].numel() - rank * chunks[i]))

        if len(tensors) == 1 and tensors[0].numel() % world == 0:
            flat = tensors[0].view(-1)
        else:
            padding = [
                torch.empty(chunks[i] - chunk_of(i, rank), dtype=t.dtype, device=t.device)
                for rank in range(world)
                for i, t in enumerate(tensors)
                if chunk_of(i, rank) < chunks[i]
            ]
            flat = pp.instrument_w_nvtx(torch.cat)([t.view(-1) for t in tensors] + padding)
        flat.div_(world)
        own = RankPartitions(flat, sum(chunks), world)[this_rank]  # `torch.chunk(flat, world)[this_rank]`
        coalesced_collectives._torch_reduce_scatter_fn(flat, own, group=group)
        out, offset = [], 0
        for i in range(len(tensors)):
            out.append(own.narrow(0, offset, chunk_of(i, this_rank)))
            offset += chunks[i]
        return out

    patch(stack, pp.Init, "_convert_to_deepspeed_param", convert_to_deepspeed_param)
    patch(stack, handle_class, "wait", wait)
    patch(stack, pp.Init, "_allgather_params", allgather_params)
    patch(stack, stage3, "reduce_scatter_coalesced", reduce_scatter_coalesced)


def _free_variable(function, name: str):
    """The value `function` closes over as `name`."""
    code = function.__code__
    if name not in code.co_freevars:
        raise TraceError(f"DeepSpeed's `{code.co_name}` has no `{name}`: the tracer follows DeepSpeed 0.18.2's ZeRO-3")
    return function.__closure__[code.co_freevars.index(name)].cell_contents


def _set_free_variable(function, name: str, value) -> None:
    """`function` closes over `value` as `name` from now on."""
    _free_variable(function, name)
    function.__closure__[function.__code__.co_freevars.index(name)].cell_contents = value
