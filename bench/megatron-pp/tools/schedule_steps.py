"""Prints what megatron-core 0.19's `forward_backward_pipelining_without_interleaving` does on each pipeline rank,
run on the CPU with its communication and compute stood in for: every receive (`recv_forward`,
`send_backward_recv_forward`: R; `send_forward_recv_backward`, `recv_backward`: G), forward (F<microbatch>),
`deallocate_output_tensor` (D) and backward (B<microbatch>), in order. The Rust schedule's test
(`sim/strategy/megatron_pp.rs`) holds these lines.
    PYTHONPATH=/path/to/megatron-core python bench/megatron-pp/tools/schedule_steps.py
"""
import types

import torch
from megatron.core.pipeline_parallel import schedules
from megatron.core.process_groups_config import ProcessGroupCollection


class Group:
    def size(self):
        return 1


class Config(types.SimpleNamespace):
    def __getattr__(self, name):  # every other setting off
        return None


def steps(pp: int, n: int, rank: int) -> str:
    log = []
    count = {"F": 0, "B": 0}

    config = Config(deallocate_pipeline_outputs=True, hidden_size=1)

    class P2p:
        total_stages, current_stage = pp, rank
        is_pp_first_stage, is_pp_last_stage = rank == 0, rank == pp - 1

        def recv_forward(self, shapes, first):
            log.append("R")

        def send_backward_recv_forward(self, grad, shapes, first):
            log.append("R")

        def send_forward_recv_backward(self, out, shapes, last):
            log.append("G")

        def recv_backward(self, shapes, last):
            log.append("G")

        def send_forward(self, out, last):
            pass

        def send_backward(self, grad, first):
            pass

    def forward_step(*args, **kwargs):
        log.append(f"F{count['F']}")
        count["F"] += 1
        return torch.zeros(1), 0

    def backward_step(*args, **kwargs):
        log.append(f"B{count['B']}")
        count["B"] += 1

    P2p.config = config
    model = types.SimpleNamespace(config=config)
    pgs = ProcessGroupCollection()
    pgs.tp, pgs.cp = Group(), Group()
    saved = (schedules.forward_step, schedules.backward_step, schedules.deallocate_output_tensor, schedules.torch)
    schedules.forward_step, schedules.backward_step = forward_step, backward_step
    schedules.deallocate_output_tensor = lambda out, deallocate: log.append("D")
    # `torch.zeros([], device="cuda")` of `total_num_tokens`, made on the CPU.
    schedules.torch = types.SimpleNamespace(
        zeros=lambda *a, **k: torch.zeros(*a, dtype=k.get("dtype")), int=torch.int, Tensor=torch.Tensor
    )
    try:
        schedules.forward_backward_pipelining_without_interleaving(
            forward_step_func=None, data_iterator=None, model=[model], num_microbatches=n, seq_length=1,
            micro_batch_size=1, p2p_communicator=P2p(), pg_collection=pgs,
        )
    finally:
        schedules.forward_step, schedules.backward_step, schedules.deallocate_output_tensor, schedules.torch = saved
    return " ".join(log)


for pp, n in [(2, 1), (2, 4), (3, 2), (4, 2), (4, 4), (4, 8), (8, 3)]:
    for rank in range(pp):
        print(f'({pp}, {n}, {rank}, "{steps(pp, n, rank)}"),')
