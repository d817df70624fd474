"""Per-rank peak memory of Megatron-core pipeline parallelism (`parallel.framework: megatron` with `pp > 1`),
one rank of a world under torch's fake process group on one GPU, or every rank of a real world under torchrun and
NCCL (megatron.py says what differs: the device, the eager communicator, the barrier before each reading).
    HEADROOM_FAKE_WORLD=W HEADROOM_FAKE_RANK=R WORLD_SIZE=W RANK=0 LOCAL_RANK=0 \\
        python -m headroom_measure dist --spec-json SPEC --out F
    torchrun --nproc-per-node W -m headroom_measure dist --spec-json SPEC --out F
The fake group is initialised with rank R of the world, so `parallel_state.initialize_model_parallel(tp, pp)`
(rank order tp-cp-ep-dp-pp) makes this process pipeline rank `R // (W / pp)`: the first stage holds the
embedding, the last the final norm, the output layer and the loss, every stage its `num_layers / pp` layers.
Each stage is built as megatron.py builds the whole model (`GPTModel(pre_process, post_process)`, `model.cuda()`,
`Float16Module`, Megatron's DDP, `get_megatron_optimizer`), with what Megatron-LM's training sets for a pipeline
(`core_transformer_config_from_args`, `setup_model_and_optimizer`): `deallocate_pipeline_outputs=True`,
`pipeline_dtype=bf16`, `batch_p2p_comm=True` (no p2p overlap), `config.no_sync_func = ddp_model.no_sync`,
`config.finalize_model_grads_func = finalize_model_grads`.
With `vpp > 1` (schedule interleaved-1f1b) the rank builds one chunk per virtual stage as Megatron-LM's `get_model`
does (`megatron.build_chunks`: the embedding on the first rank's chunk 0, the loss on the last rank's last chunk,
each chunk its own DDP, one optimizer over all), with `megatron.overlap_p2p_comm` as Megatron-LM's arguments set it
(on unless given false, `--no-overlap-p2p-communication`: then `batch_p2p_comm=True` as without interleaving; the
row's spec says which), `no_sync_func` one per chunk, and runs `forward_backward_pipelining_with_interleaving` instead; `env.order` names
each forward's chunk (`@c`).
A step is `zero_grad_buffer()` of every chunk, `optimizer.zero_grad()`, then Megatron's
`forward_backward_pipelining_without_interleaving` over `microbatches` micro-batches of `batch_size /
microbatches` sequences (the step phase: every forward, backward and receive, and `finalize_model_grads`),
then `optimizer.step()` (the opt phase). A receive is the `torch.empty(..., requires_grad=True)` Megatron makes for
it, which the fake group's receives leave as it is (its losses are meaningless).
The inputs (`input_ids`, `position_ids`, `loss_mask` of one micro-batch) are made once and every micro-batch
reads them; the loss function is pretrain_gpt's sum over the mask divided by the token count, returned as
`(loss, {})` (nothing kept in `forward_data_store`). The order in which the schedule runs forwards and backwards
is recorded in `env.order` (the Rust schedule's test compares it).
"""

from __future__ import annotations

import os
import sys
import time

from .measure import STEPS
from .spec import Spec


def measure_megatron_pp(spec: Spec, fields: dict, row_id: str | None = None, snapshot: str | None = None,
                        stacks: str = "python") -> dict:
    """Rank HEADROOM_FAKE_RANK of a fake world, or every rank of a real one: build its stage, then three steps; the
    record (dist.py's shape) on rank 0."""
    import torch

    from .megatron import (
        balanced_routing,
        routed_tokens,
        build_chunks,
        every_rank,
        fake_group,
        finish,
        load_record,
        megatron_options,
        moe_fields,
        phase_end,
        spec_and_env,
        start_rank,
    )

    t0 = time.time()
    options = megatron_options(spec)
    par = spec.parallel
    # Megatron-LM overlaps an interleaved schedule's p2p communication unless told not to.
    overlap = par.vpp > 1 and options["overlap_p2p_comm"] is not False
    if par.vpp > 1:
        options["overlap_p2p_comm"] = overlap
    world, pp, n = par.world_size, par.pp, par.microbatches
    rank = int(os.environ.get("HEADROOM_FAKE_RANK", "0"))
    micro = spec.batch_size // n
    device, context, rank, snapshot = start_rank(world, rank, snapshot, stacks, options["eager_nccl_init"])
    from megatron.core import parallel_state
    from megatron.core.distributed import finalize_model_grads
    from megatron.core.pipeline_parallel import schedules
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=par.tp,
        pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=par.vpp if par.vpp > 1 else None,
        expert_model_parallel_size=options["expert_model_parallel_size"],
        create_gloo_process_groups=False,
    )
    model_parallel_cuda_manual_seed(1234)
    pp_rank = parallel_state.get_pipeline_model_parallel_rank()
    first, last = pp_rank == 0, pp_rank == pp - 1
    vpp = par.vpp
    if vpp > 1:
        # One chunk per virtual stage: the embedding on the first rank's first, the loss on the last rank's last.
        parts = [(c, first and c == 0, last and c == vpp - 1) for c in range(vpp)]
    else:
        parts = [(None, first, last)]
    chunks, optimizer = build_chunks(spec, fields, options, parts)
    for chunk in chunks:
        chunk.train()
    ddp_model = chunks[0]
    config = ddp_model.config
    config.deallocate_pipeline_outputs = True
    config.overlap_p2p_comm, config.batch_p2p_comm = overlap, not overlap
    config.no_sync_func = ddp_model.no_sync if vpp == 1 else [chunk.no_sync for chunk in chunks]
    config.finalize_model_grads_func = finalize_model_grads
    load = load_record()
    torch.manual_seed(1234)
    ids = torch.randint(0, fields["vocab_size"], (micro, spec.seq_len), device=device)
    position_ids = torch.arange(spec.seq_len, device=device).unsqueeze(0).expand_as(ids)
    loss_mask = torch.ones(micro * spec.seq_len, device=device)
    if (experts_fields := moe_fields(fields)) is not None:
        experts, top_k, _ = experts_fields
        fixed_routing = balanced_routing(  # noqa: F841 (kept alive: the router copies it every layer)
            routed_tokens(spec, micro), experts, top_k
        )

    def loss_func(output_tensor):
        loss = torch.sum(output_tensor.view(-1).float() * loss_mask) / loss_mask.sum()
        return loss, {}

    order = []

    def forward_step(data_iterator, model):
        chunk = next(i for i, c in enumerate(chunks) if c is model) if vpp > 1 else None
        order.append(f"F{pp_rank}.{sum(o[0] == 'F' for o in order)}" + (f"@{chunk}" if vpp > 1 else ""))
        output = model(ids, position_ids, None, labels=ids)
        return output, loss_func

    original_backward = schedules.backward_step

    def logged_backward(*args, **kwargs):
        order.append(f"B{pp_rank}.{sum(o[0] == 'B' for o in order)}")
        return original_backward(*args, **kwargs)

    schedules.backward_step = logged_backward

    steps, orders = [], []
    peak_reserved = load["peak_reserved"]
    schedule = (schedules.forward_backward_pipelining_with_interleaving if vpp > 1
                else schedules.forward_backward_pipelining_without_interleaving)
    for step in range(STEPS):
        for chunk in chunks:
            chunk.zero_grad_buffer()
        optimizer.zero_grad()
        rec = {"start_allocated": torch.cuda.memory_allocated()}
        torch.cuda.reset_peak_memory_stats()
        order.clear()
        schedule(
            forward_step_func=forward_step,
            data_iterator=[iter(range(n)) for _ in chunks] if vpp > 1 else iter(range(n)),
            model=chunks,
            num_microbatches=n,
            seq_length=spec.seq_len,
            micro_batch_size=micro,
            forward_only=False,
        )
        orders.append(" ".join(order))
        phase_end(rec, "step_peak")
        optimizer.step()
        phase_end(rec, "opt_peak")
        rec["end_allocated"] = torch.cuda.memory_allocated()
        peak_reserved = max(peak_reserved, rec["peak_reserved"])
        steps.append(rec)
        print(f"[rank {rank} {time.time() - t0:6.1f}s] step {step + 1}: {rec}", file=sys.stderr, flush=True)
    schedules.backward_step = original_backward
    if snapshot:
        torch.cuda.memory._dump_snapshot(snapshot)
        torch.cuda.memory._record_memory_history(enabled=None)
    free, total = torch.cuda.mem_get_info()
    phase_peaks = [load["peak_allocated"]] + [v for r in steps for k, v in r.items() if k.endswith("_peak")]
    # This stage's parameters, a tensor-parallel weight at its global size.
    stage_params = sum(
        p.numel() * (par.tp if getattr(p, "tensor_model_parallel", False) else 1)
        for chunk in chunks for p in chunk.parameters()
    )
    mine = {
        "rank": rank,
        "pipeline_rank": pp_rank,
        "local_rank": device.index,
        "load": load,
        "steps": steps,
        "peak_allocated_bytes": max(phase_peaks),
        "peak_reserved_bytes": peak_reserved,
        "cuda_context_bytes": context,
        "device_used_end_bytes": total - free,
        "stage_params": stage_params,
    }
    ranks = every_rank(mine)
    # The row's count: this stage's under the fake group, every stage's under NCCL.
    params = sum({r["pipeline_rank"]: r["stage_params"] for r in ranks}.values())
    spec_json, env = spec_and_env(
        spec, options, fields, device, total, world, rank, t0,
        schedule=schedule.__name__,
        order=orders[-1],
        orders_agree=len(set(orders)) == 1,
    )
    return finish({
        "id": row_id or f"megatron/{spec.model}/w{world}-tp{par.tp}-pp{pp}-vpp{vpp}" + (f"/rank{rank}" if fake_group() else ""),
        "spec": spec_json,
        "measured": {
            "peak_allocated_bytes": max(r["peak_allocated_bytes"] for r in ranks),
            "peak_reserved_bytes": max(r["peak_reserved_bytes"] for r in ranks),
            "ranks": ranks,
            "params": params,
            "trainable_params": params,
        },
        "env": env,
    })
