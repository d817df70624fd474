"""Prints what megatron-core 0.19's `forward_backward_pipelining_with_interleaving` does on each pipeline rank with
`batch_p2p_comm` (no p2p overlap), or with `overlap_p2p_comm` (`--overlap`: Megatron-LM's default for interleaved
pipelines, without `overlap_p2p_comm_warmup_flush`), run on the CPU with its communication and compute stood in for: every receive
of an input (R) and of a gradient (G), forward (F<chunk>.<microbatch>), `deallocate_output_tensor` of a sent output
(D) and backward (B<chunk>.<microbatch>), in order. The Rust schedule's test (`sim/strategy/megatron_interleaved.rs`)
holds these lines.
    PYTHONPATH=/path/to/megatron-core python bench/megatron-pp-vpp/tools/schedule_steps.py [--overlap]
"""
import sys
import types

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel import schedules
from megatron.core.process_groups_config import ProcessGroupCollection
from torch.testing._internal.distributed.fake_pg import FakeStore


class Group:
    def __init__(self, size=1, rank=0):
        self._size, self._rank = size, rank

    def size(self):
        return self._size

    def rank(self):
        return self._rank


class Config(types.SimpleNamespace):
    def __getattr__(self, name):  # every other setting off
        return None


class Work:
    def wait(self):
        pass


def steps(pp: int, vpp: int, n: int, rank: int, overlap: bool) -> str:
    log = []
    config = Config(deallocate_pipeline_outputs=True, hidden_size=1, batch_p2p_comm=not overlap,
                    overlap_p2p_comm=overlap, microbatch_group_size_per_vp_stage=pp,
                    virtual_pipeline_model_parallel_size=vpp)

    def handles(sent, received, send_key, recv_key):  # `_p2p_ops`' requests, as `overlap_p2p_comm` returns them
        return {**({send_key: Work()} if sent is not None else {}), **({recv_key: Work()} if received else {})}

    def received(recv_prev=False, recv_next=False):
        prev = nxt = None
        if recv_prev:
            log.append("R")
            prev = torch.zeros(1)
        if recv_next:
            log.append("G")
            nxt = torch.zeros(1)
        return prev, nxt

    class P2p:
        pp_group = Group(pp, rank)
        virtual_pipeline_model_parallel_size = vpp

        def recv_forward(self, shapes, first):
            return received(recv_prev=not first)[0]

        def recv_backward(self, shapes, is_last_stage):
            return received(recv_next=not is_last_stage)[1]

        def send_forward_recv_forward(self, out, recv_prev, tensor_shape, overlap_p2p_comm=False):
            prev = received(recv_prev=recv_prev)[0]
            return (prev, handles(out, recv_prev, "send_next", "recv_prev")) if overlap_p2p_comm else prev

        def send_backward_recv_backward(self, grad, recv_next, tensor_shape, overlap_p2p_comm=False):
            nxt = received(recv_next=recv_next)[1]
            return (nxt, handles(grad, recv_next, "send_prev", "recv_next")) if overlap_p2p_comm else nxt

        def send_forward_backward_recv_forward_backward(self, out, grad, recv_prev, recv_next, tensor_shape):
            return received(recv_prev, recv_next)

    def forward_step(forward_step_func, data_iterator, model, *args, current_microbatch=None, vp_stage=None,
                     **kwargs):
        log.append(f"F{vp_stage}.{current_microbatch}")
        out = torch.zeros(1)
        out.tag = f"{vp_stage}.{current_microbatch}"
        return out, 0

    def backward_step(input_tensor, output_tensor, output_tensor_grad, config):
        log.append(f"B{output_tensor.tag}")

    P2p.config = config
    chunks = [torch.nn.Module() for _ in range(vpp)]
    for chunk in chunks:
        chunk.config, chunk.model_type = config, None
    pgs = ProcessGroupCollection()
    pgs.tp, pgs.cp = Group(), Group()
    saved = (schedules.forward_step, schedules.backward_step, schedules.deallocate_output_tensor)
    schedules.forward_step, schedules.backward_step = forward_step, backward_step
    schedules.deallocate_output_tensor = lambda out, deallocate: out is not None and log.append("D")
    try:
        schedules.forward_backward_pipelining_with_interleaving(
            forward_step_func=None, data_iterator=[None] * vpp, model=chunks, num_microbatches=n, seq_length=1,
            micro_batch_size=1, p2p_communicator=P2p(), pg_collection=pgs,
        )
    finally:
        schedules.forward_step, schedules.backward_step, schedules.deallocate_output_tensor = saved
    return " ".join(log)


# `torch.zeros([], device="cuda")` of `total_num_tokens` is made on the CPU.
schedules.torch = types.SimpleNamespace(
    **{k: getattr(torch, k) for k in ("int", "Tensor", "nn", "distributed", "cuda")},
    zeros=lambda *a, **k: torch.zeros(*a, dtype=k.get("dtype")),
)
dist.init_process_group("fake", rank=0, world_size=1, store=FakeStore())
overlap = "--overlap" in sys.argv[1:]
for pp, vpp, n in [(2, 2, 2), (2, 2, 4), (2, 3, 4), (4, 2, 4), (4, 2, 8), (2, 2, 6), (4, 4, 4)]:
    for rank in range(pp):
        print(f'({pp}, {vpp}, {n}, {rank}, "{steps(pp, vpp, n, rank, overlap)}"),')
