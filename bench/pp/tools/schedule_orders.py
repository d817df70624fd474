"""The order torch 2.11's pipeline schedules run each rank's forwards and backwards, recorded by
running them under the fake process group on the CPU (`Schedule1F1B`, `ScheduleGPipe`,
`ScheduleInterleaved1F1B` over one-linear stages): `F<stage>.<micro-batch>` / `B...`. The lines are
the expected orders of `sim::strategy::pp`'s test.

    python bench/pp/tools/schedule_orders.py
"""
import torch, torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.pipelining import stage as stmod
log=[]
of, ob = stmod._PipelineStageBase.forward_one_chunk, stmod._PipelineStageBase.backward_one_chunk
def f(self, i, *a, **k):
    log.append(f"F{self.stage_index}.{i}"); return of(self, i, *a, **k)
def b(self, i, *a, **k):
    log.append(f"B{self.stage_index}.{i}"); return ob(self, i, *a, **k)
stmod._PipelineStageBase.forward_one_chunk=f; stmod._PipelineStageBase.backward_one_chunk=b
def run(kind, pp, vpp, n, rank):
    dist.init_process_group("fake", rank=rank, world_size=pp, store=FakeStore())
    stages=[PipelineStage(torch.nn.Linear(2,2), s, pp*vpp, torch.device("cpu"), input_args=(torch.empty(1,2),), output_args=(torch.empty(1,2),)) for s in range(rank, pp*vpp, pp)]
    loss=lambda a,b: a.sum()
    sch = {"interleaved-1f1b": lambda: ScheduleInterleaved1F1B(stages, n, loss_fn=loss), "1f1b": lambda: Schedule1F1B(stages[0], n, loss_fn=loss), "gpipe": lambda: ScheduleGPipe(stages[0], n, loss_fn=loss)}[kind]()
    log.clear()
    x=torch.randn(n,2)
    args=(x,) if rank==0 else ()
    sch.step(*args, target=torch.randn(n,2) if (rank + (vpp-1)*pp)==pp*vpp-1 else None)
    dist.destroy_process_group()
    print(f'("{kind}", {pp}, {vpp}, {n}, {rank}, "{" ".join(log)}"),')
for pp,n in [(2,4),(4,4),(4,8)]:
    for r in range(pp):
        run("1f1b",pp,1,n,r); run("gpipe",pp,1,n,r)
for pp,vpp,n in [(2,2,4),(4,2,8),(4,2,4),(2,2,2),(4,3,8),(2,2,6)]:
    for r in range(pp): run("interleaved-1f1b",pp,vpp,n,r)
