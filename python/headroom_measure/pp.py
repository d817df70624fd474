"""Pipeline parallelism as torchtitan runs it (`parallel.pp`): torch.distributed.pipelining's
`PipelineStage` over a slice of an HF decoder, driven by `Schedule1F1B`, `ScheduleInterleaved1F1B` or
`ScheduleGPipe`, on the rank `dist.get_rank()` names (dist.py runs one rank of a fake world).

How a rank's stages are built (torchtitan's `pipeline_module_split` on an HF model):
  1. Stage `s` of `pp * vpp` holds layers `layers_per_stage[s]` (an even split by default). Rank `r` holds
     stages `r, r + pp, ...` (torchtitan's "loop" placement).
  2. Each stage is its own `cls.from_config` on the meta device with `num_hidden_layers` its layer count
     (`layer_types` sliced to match); a stage that is not first drops `embed_tokens` (it is called with
     `inputs_embeds`), one that is not last has `norm = nn.Identity()` and no `lm_head` (it returns the
     decoder's last hidden state). Gradient checkpointing as measure.py.
  3. `PipelineStage(stage, index, pp * vpp, device, input_args=..., output_args=...)` with meta tensors
     of the stage's input (token ids on the first stage, else hidden states in the parameters' dtype) and
     output (hidden states, or on the last stage logits in the autocast dtype). Passing them skips the
     runtime shape inference, whose `recv_object_list` the fake process group cannot serve.
  4. `to_empty(device)`, `normal_(std=0.02)` of every parameter, the rotary module rebuilt on the device
     (stage by stage, in stage order), then one AdamW (foreach) over every stage's parameters.
  5. The loss is HF's `ForCausalLMLoss(logits, labels, vocab_size)` per micro-batch (labels = the ids);
     the schedule splits `batch_size` rows into `microbatches` (`tensor_split` views) and runs
     `step(ids, target=ids, losses=[], return_outputs=False)` (torchtitan's call) under the autocast of
     the spec's precision; `scale_grads` (the default) divides the gradients by the micro-batch count.

With strategy fsdp (torchtitan's PP x FSDP2) the world is a `(pp, dp)` device mesh, pp outermost (rank `r` is
pipeline rank `r // (world_size / pp)`), and each stage is `fully_shard`ed over `mesh["dp"]` before `to_empty` (`_fully_shard_stage`:
the units torchtitan's `apply_fsdp` makes, then the stage itself as the root); the stage's `PipelineStage` talks over
`mesh["pp"]`. torch's schedules then drive FSDP2 themselves: no gradient reduction and no resharding after any
micro-batch's backward, one reduce-scatter per unit when the stage's last backward is done (`perform_reduce_grad`),
and `ScheduleInterleaved1F1B` unshards its stages before their first forward. Under a `MixedPrecisionPolicy` the
stage boundary carries `param_dtype` tensors. With `tp > 1` the mesh is `(pp, dp, tp)` and each stage gets
torchtitan's tensor-parallel plan over `mesh["tp"]` first (dist.py's `_parallelize_tp`, without sequence parallelism:
the stages exchange whole hidden states); the step then runs under `loss_parallel()`.

Under the fake process group every `isend`/`irecv` completes at once and moves nothing: a stage reads
whatever its receive buffer holds (torch.empty), so the losses mean nothing; memory is as a real rank's,
the NCCL work objects' hold on sent tensors aside.
"""

from __future__ import annotations

import copy

from .spec import SpecError

def stage_layers(par, layers: int) -> list[int]:
    """Decoder layers per stage: `layers_per_stage`, or an even split (the first stages take the
    remainder, as torchtitan's `generate_llm_fqn_per_model_part` does)."""
    stages = par.pp * par.vpp
    if par.layers_per_stage:
        return list(par.layers_per_stage)
    base, extra = divmod(layers, stages)
    return [base + (1 if s < extra else 0) for s in range(stages)]


def _stage_module(cls, cfg, attention, dtype, first: bool, last: bool, layers: int, spec):
    import torch
    from torch import nn

    stage_cfg = copy.deepcopy(cfg)
    stage_cfg.num_hidden_layers = layers
    if getattr(stage_cfg, "layer_types", None):
        stage_cfg.layer_types = stage_cfg.layer_types[:layers]
    with torch.device("meta"):
        model = cls.from_config(stage_cfg, dtype=dtype, attn_implementation=attention)
    if spec.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if first:
            model.enable_input_require_grads()
    if not first:
        model.model.embed_tokens = None
    if not last:
        model.model.norm = nn.Identity()
        model.lm_head = None

    class Chunk(nn.Module):
        def __init__(self):
            super().__init__()
            self.inner = model

        def forward(self, x):
            kwargs = {"input_ids": x} if first else {"inputs_embeds": x}
            if last:
                return self.inner(**kwargs).logits
            return self.inner.model(**kwargs).last_hidden_state

    return Chunk()


def _fully_shard_stage(chunk, units: str, kwargs: dict, first: bool, last: bool) -> None:
    """`fully_shard` a stage as torchtitan's `apply_fsdp` does a model part: each decoder layer, under
    `units: accelerate` also the input embedding (first stage) and `[final norm, head]` kept gathered (last
    stage), then the stage itself as the root (the rest of its parameters)."""
    from torch.distributed.fsdp import fully_shard

    model = chunk.inner
    for layer in model.model.layers:
        fully_shard(layer, **kwargs)
    root_kwargs = dict(kwargs)
    if units == "accelerate":
        if first:
            fully_shard(model.model.embed_tokens, **kwargs)
        if last:
            fully_shard([model.model.norm, model.lm_head], **{**kwargs, "reshard_after_forward": False})
        del root_kwargs["reshard_after_forward"]
    elif units != "layers":
        raise SpecError(f"`parallel.units`: {units!r} is not measured inside a pipeline; use layers or accelerate")
    fully_shard(chunk, **root_kwargs)


def build(spec, cfg, cls, dtype, device, rank: int, cuda_autocast: bool | None = None):
    """The rank's stages and a callable running one schedule step; see the module docstring.
    `cuda_autocast`: the step runs under CUDA's autocast (by default when `device` is a GPU; the
    tracer emulates it on the CPU), so the last stage's logits are in the autocast dtype.
    Returns (chunks, step, counts)."""
    import torch
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
    from transformers.loss.loss_utils import ForCausalLMLoss

    from .dist import _fully_shard_kwargs, _initialize, _parallelize_tp

    par = spec.parallel
    stages = par.pp * par.vpp
    split = stage_layers(par, cfg.num_hidden_layers)
    if sum(split) != cfg.num_hidden_layers:
        raise SpecError(f"`parallel.layers_per_stage`: {split} must hold the model's {cfg.num_hidden_layers} layers")
    mb = spec.batch_size // par.microbatches
    act_dtype = dtype
    if cuda_autocast is None:
        cuda_autocast = device.type == "cuda"
    out_dtype = torch.bfloat16 if spec.precision in ("bf16", "amp-bf16") and cuda_autocast else dtype
    dp = par.world_size // par.pp
    mesh = fsdp_kwargs = None
    if par.strategy == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import OffloadPolicy

        dp //= par.tp
        mesh = init_device_mesh(device.type, (par.pp, dp, par.tp), mesh_dim_names=("pp", "dp", "tp"))
        fsdp_kwargs = _fully_shard_kwargs(torch, par, mesh["dp"], OffloadPolicy())
        if par.mixed_precision is not None and par.mixed_precision["param_dtype"] == "bf16":
            act_dtype = out_dtype = torch.bfloat16
    mine = list(range(rank // (par.world_size // par.pp), stages, par.pp))
    chunks, pipe_stages = [], []
    for s in mine:
        first, last = s == 0, s == stages - 1
        chunk = _stage_module(cls, cfg, spec.attention, dtype, first, last, split[s], spec)
        with torch.device("meta"):
            if first:
                x = torch.empty(mb, spec.seq_len, dtype=torch.long)
            else:
                x = torch.empty(mb, spec.seq_len, cfg.hidden_size, dtype=act_dtype)
            if last:
                y = torch.empty(mb, spec.seq_len, cfg.vocab_size, dtype=out_dtype)
            else:
                y = torch.empty(mb, spec.seq_len, cfg.hidden_size, dtype=act_dtype)
        if par.tp > 1:
            _parallelize_tp(chunk.inner, mesh["tp"], par.sequence_parallel)
        if mesh is not None:
            _fully_shard_stage(chunk, par.units, fsdp_kwargs, first, last)
        chunks.append(chunk)
        pipe_stages.append((chunk, s, x, y))
    built = []
    group = mesh["pp"].get_group() if mesh is not None else None
    for chunk, s, x, y in pipe_stages:
        chunk.to_empty(device=device)
        _initialize(chunk.inner, device)
        built.append(PipelineStage(chunk, s, stages, device, input_args=(x,), output_args=(y,), group=group))
    vocab = cfg.vocab_size

    def loss_fn(logits, labels):
        return ForCausalLMLoss(logits, labels, vocab)

    if par.schedule == "interleaved-1f1b":
        schedule = ScheduleInterleaved1F1B(built, par.microbatches, loss_fn=loss_fn)
    elif par.schedule == "gpipe":
        schedule = ScheduleGPipe(built[0], par.microbatches, loss_fn=loss_fn)
    else:
        schedule = Schedule1F1B(built[0], par.microbatches, loss_fn=loss_fn)
    has_first = 0 in mine
    has_last = stages - 1 in mine

    def step(ids) -> list:
        """One `schedule.step`; the last stage's per-micro-batch losses (empty elsewhere)."""
        losses: list = []
        target = ids if has_last else None
        if has_first:
            schedule.step(ids, target=target, losses=losses if has_last else None, return_outputs=False)
        else:
            schedule.step(target=target, losses=losses if has_last else None, return_outputs=False)
        return losses

    # The whole model's count, as a run without pipelining reports it.
    with torch.device("meta"):
        whole = cls.from_config(cfg, dtype=dtype, attn_implementation=spec.attention)
    params = sum(p.numel() for p in whole.parameters())
    return chunks, step, (params, params)
