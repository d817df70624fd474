"""What NCCL's communicators cost in device memory outside PyTorch's caching allocator, by group size and by the
first use of each kind of collective. Run one process per GPU:

    torchrun --nproc-per-node N bench/nccl-comms/tools/comms.py --out comms.jsonl

Each reading is `total - free` (`torch.cuda.mem_get_info`) less `torch.cuda.memory_reserved()`: memory the driver
gave to someone other than the caching allocator (the CUDA context, NCCL's buffers and its kernels' modules).
The steps, in order, each a reading and its difference from the one before:
1. the context (`torch.zeros(1)` on the device), then `init_process_group("nccl", device_id=...)` (the default
   communicator made at once, as Megatron-LM and the measurement harness make it);
2. the first call of each collective on the default group (OPS, one small tensor each; point-to-point between ring
   neighbours in one `batch_isend_irecv`, none in a group of one), then each once more with 64 MiB (buffers do not grow with the message);
3. for every group size s dividing the world (1 first): the world split into consecutive groups of s made twice
   (`new_group`; eager, since the default group is bound to the device), then OPS on this rank's first group of
   size s and again on its second.
Every rank appends one JSON line {rank, world, nccl, steps: [{step, outside_bytes, delta_bytes}]} to --out.
`--dry` walks the same steps on the CPU as rank 0 of torch's fake process group (WORLD_SIZE ranks), reading zeros."""

import argparse
import json
import os

import torch
import torch.distributed as dist

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv", "broadcast")


def run_op(op: str, group, numel: int, device) -> None:
    group = group or dist.group.WORLD
    size = dist.get_world_size(group)
    if op == "send_recv" and size == 1:
        return
    x = torch.ones(numel * size, device=device)
    if op == "all_reduce":
        dist.all_reduce(x[:numel], group=group)
    elif op == "all_gather":
        dist.all_gather_into_tensor(x, x[:numel].clone(), group=group)
    elif op == "reduce_scatter":
        dist.reduce_scatter_tensor(x[:numel].clone(), x, group=group)
    elif op == "all_to_all":
        dist.all_to_all_single(torch.empty_like(x), x, group=group)
    elif op == "broadcast":
        dist.broadcast(x, group_src=0, group=group)
    elif op == "send_recv":
        me = dist.get_group_rank(group, dist.get_rank())
        ahead = dist.get_global_rank(group, (me + 1) % size)
        behind = dist.get_global_rank(group, (me - 1) % size)
        y = torch.empty_like(x)
        for work in dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, x, ahead, group), dist.P2POp(dist.irecv, y, behind, group)]
        ):
            work.wait()
    if x.is_cuda:
        torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--dry", action="store_true")
    args = parser.parse_args()
    if args.dry:
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    steps = []

    def reading(step: str) -> None:
        outside = 0
        if not args.dry:
            torch.cuda.synchronize()
            free, total = torch.cuda.mem_get_info()
            outside = total - free - torch.cuda.memory_reserved()
        delta = outside - steps[-1]["outside_bytes"] if steps else outside
        steps.append({"step": step, "outside_bytes": outside, "delta_bytes": delta})

    torch.zeros(1, device=device)
    reading("context")
    if args.dry:
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", rank=0, world_size=int(os.environ["WORLD_SIZE"]), store=FakeStore())
    else:
        dist.init_process_group("nccl", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    reading("init default group")
    for numel, label in ((1024, "first"), (16 << 20, "64 MiB")):
        for op in OPS:
            run_op(op, None, numel, device)
            reading(f"default group: {op} ({label})")
    for size in [s for s in range(1, world + 1) if world % s == 0]:
        mine = []
        for copy in (1, 2):
            made = [dist.new_group(list(range(i, i + size))) for i in range(0, world, size)]
            mine.append(made[rank // size])
            reading(f"size {size}: new groups #{copy}")
        for copy, group in enumerate(mine, start=1):
            for op in OPS:
                run_op(op, group, 1024, device)
                reading(f"size {size} #{copy}: {op}")
    nccl = None if args.dry else ".".join(map(str, torch.cuda.nccl.version()))
    row = {"rank": rank, "world": world, "nccl": nccl, "steps": steps}
    with open(args.out, "a") as f:
        f.write(json.dumps(row) + "\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
