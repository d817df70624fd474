"""Trace a pipeline (pipeline.py: several models in one process, phase by phase) under fake
tensors on the CPU, as `measure_pipeline` runs it on the GPU: the instances built in list order
by the same builders (the single-run harness's, dist.py's FSDP2 as rank 0 of the fake process
group, DDP and FSDP1 likewise as `trace_ddp.py` and `trace_fsdp1.py` run them, an nf4 model as
`trace_nf4.py` loads it, bitsandbytes as `bitsandbytes_emulation.py` runs it, FSDP2
`CPUOffloadPolicy` in a group of one, DeepSpeed engines as `trace_zero.py` runs them, each train
pass `engine.backward` and `engine.step`), one `input_ids` per batch shape, then every
phase of every iteration with its moves and passes. Each trace phase is one measured record
(`name`, `iteration`), beginning where the harness resets the peak counters.

What the CPU cannot show is put back:
- **Moves.** `model.cpu()` / `.cuda()` and the optimizer states' `.to()` are no-ops between
  fake CPU tensors. Each storage the move copies is recorded as the copy CUDA makes: to the host,
  the device storage is freed and a host one takes its place; to the device, a device storage is
  allocated, in `Module._apply`'s order (children first, then each parameter, its gradient, then
  the buffers).
- **Host-homed models.** Built on the host (`home: cpu`, FSDP2 offload in a group of one), every
  storage of the build is host memory until a move brings it in.
- **Rollout engines.** A colocated vLLM-style engine (`engine: vllm`) runs no PyTorch model: it
  holds `gpu_memory_utilization` of the device outside the caching allocator while awake, as
  the native simulator's contract has it (`sim/harness/pipeline.rs`). The trace lists the
  engines and records when each wakes (after `empty_cache()`) and sleeps: created awake in its
  place among the instances and put to sleep at once if it sleeps; first thing in each phase
  (before its peak counters are reset, as the frameworks switch engines between phases), those
  the phase does not run go to sleep, then those it runs wake. The replay sizes the share on the
  GPU it replays on. The GPU harness measures no engine.
- **Generation.** `generate` stops when every sequence is finished, a value fake tensors do not
  have: with no end-of-sequence token, the harness's sequences end exactly at `max_new_tokens`,
  and the stop check says so by length.
"""

from __future__ import annotations

import contextlib
import time

from .trace import TraceError


def refuse_untraceable_pipeline(pipe) -> None:
    """Refuse, by instance, what the tracer cannot run (pipeline.py parsed `pipe`)."""
    from .trace import refuse_untraceable

    for k, inst in enumerate(pipe.instances):
        try:
            refuse_untraceable(inst.spec)
            if inst.spec.parallel is not None and inst.spec.parallel.framework == "megatron":
                raise TraceError(
                    "`parallel.framework: megatron`: the pipeline tracer builds transformers models (fsdp, fsdp1, "
                    "ddp and DeepSpeed instances); Megatron-core is traced in a run spec"
                )
        except TraceError as err:
            raise TraceError(f"instances[{k}] ({inst.name}): {err}") from None


class _Instance:
    """A built instance and where its parameters and optimizer states are."""

    def __init__(self, inst, model, module, optimizer, params_on_device: bool, engine: bool = False):
        self.inst = inst
        self.model = model  # what passes call: the FSDP2 module, the DeepSpeed engine or the (peft) model
        self.engine = engine  # a DeepSpeed engine, which steps and zeroes its gradients itself
        self.module = module  # the transformers module (generate)
        self.optimizer = optimizer
        self.params_on_device = params_on_device
        self.states_on_device = True


class Engines:
    """A pipeline's rollout engines: the pipeline without them (what pipeline.py parses and the
    harness runs), where each is created among the instances, the engines each phase runs, and
    which are awake."""

    def __init__(self, raw: dict):
        self.raw = raw
        self.listed: list[dict] = []  # the trace's `engines`
        self.sleeps: list[bool] = []
        self.after: list[int] = []  # model instances created before each engine
        self.runs: list[set[int]] = []  # per phase
        self.awake: list[bool] = []
        if "instances" not in raw:
            return
        names = {}
        models = []
        for item in raw["instances"]:
            if isinstance(item, dict) and "engine" in item:
                names[item.get("name")] = len(self.listed)
                share = item.get("gpu_memory_utilization")
                self.listed.append({"name": item.get("name"), "gpu_memory_utilization": share})
                self.sleeps.append(item.get("sleep_level") is not None)
                self.after.append(sum(1 for m in models if "shares" not in m))
            else:
                models.append(item)
        if not self.listed:
            return
        phases = []
        for phase in raw.get("phases", []):
            runs = [r for r in phase.get("run", []) if _run_target(r) not in names]
            self.runs.append({names[_run_target(r)] for r in phase.get("run", []) if _run_target(r) in names})
            phases.append({**phase, "run": runs})
        self.raw = {**raw, "instances": models, "phases": phases}
        self.awake = [False] * len(self.listed)

    def create(self, rec, built: int):
        """The engines created after `built` model instances: awake, then asleep if they sleep."""
        for k, after in enumerate(self.after):
            if after == built:
                self._set(rec, k, True)
                if self.sleeps[k]:
                    self._set(rec, k, False)

    def before_phase(self, rec, phase: int):
        """Those the phase does not run go to sleep, then those it runs wake."""
        for k in range(len(self.listed)):
            if k not in self.runs[phase] and self.sleeps[k]:
                self._set(rec, k, False)
        for k in sorted(self.runs[phase]):
            self._set(rec, k, True)

    def _set(self, rec, k: int, awake: bool):
        if self.awake[k] != awake:
            self.awake[k] = awake
            rec.events.append(["engine", k, awake])


def _run_target(run):
    return run if isinstance(run, str) else run.get("instance") if isinstance(run, dict) else None


def trace_pipeline(pipe, engines: Engines, raw: dict, fields: list[dict], out_path: str, progress=None) -> dict:
    """Run the pipeline under fake tensors and write its trace to `out_path`; `pipe` is
    pipeline.py's parse of `engines.raw` (the pipeline without its engines), `raw` the pipeline
    as given (with each instance's `model_config`), the trace's `spec`."""
    from .trace import Recorder, fake_cuda, write_trace
    from .trace_dist import Streams

    refuse_untraceable_pipeline(pipe)
    t0 = time.time()
    rec = Recorder()
    with _kernel_libraries(pipe), fake_cuda(rec):
        rec.stream_of = Streams().current
        with _process_group(pipe, rec):
            _run(rec, pipe, engines, fields, progress)
    return write_trace(rec, raw, t0, out_path, engines.listed)


def _kernel_libraries(pipe) -> contextlib.AbstractContextManager:
    """bitsandbytes emulated as on the GPU (`trace._kernel_libraries`) when an instance calls it."""
    from .trace import _kernel_libraries

    bnb = [i.spec for i in pipe.instances if i.spec.optimizer == "adamw-8bit" or i.spec.quantization]
    return _kernel_libraries(bnb[0]) if bnb else contextlib.nullcontext()


@contextlib.contextmanager
def _process_group(pipe, rec):
    """Rank 0 of the sharded instances' world under the fake group, or a group of one for FSDP2
    offload, with FSDP2's storage resizes and offload copies made as on CUDA, DeepSpeed on its
    CUDA code path where an instance is an engine (`trace_zero.deepspeed_on_cuda`), and DDP's and
    FSDP1's points of tensor memory put back where an instance is one (`trace_ddp.py`,
    `trace_fsdp1.py`: FSDP1's offload copies only for its handles that offload); none otherwise."""
    from .trace_ddp import DdpOnFakeTensors
    from .trace_dist import _FsdpCuda, fake_world
    from .trace_fsdp1 import Fsdp1OnFakeTensors
    from .trace_zero import deepspeed_on_cuda

    world = pipe.world_size or (1 if any(i.host_fsdp for i in pipe.instances) else 0)
    if not world:
        yield
        return
    zero = [_strategy(i) for i in pipe.instances if _is_engine(i)]
    strategies = {_strategy(i) for i in pipe.instances}
    with contextlib.ExitStack() as stack:
        stack.enter_context(deepspeed_on_cuda(rec, world, zero[0]) if zero else fake_world(world))
        stack.enter_context(_FsdpCuda(rec))
        if "ddp" in strategies:
            stack.enter_context(DdpOnFakeTensors(rec))
        if "fsdp1" in strategies:
            offload = any(i.spec.parallel.offload_params for i in pipe.instances if _strategy(i) == "fsdp1")
            stack.enter_context(Fsdp1OnFakeTensors(rec, offload))
        yield


def _strategy(inst) -> str | None:
    return inst.spec.parallel.strategy if inst.spec.parallel is not None else None


def _is_engine(inst) -> bool:
    return (_strategy(inst) or "").startswith("zero")


def _run(rec, pipe, engines: Engines, fields: list[dict], progress):
    import torch

    rec.phase("load", 0)
    torch.zeros(1)  # the harness's first CUDA tensor, before the peak counters are reset
    models = []
    for inst, f in zip(pipe.instances, fields):
        engines.create(rec, len(models))
        models.append(_build(rec, inst, f))
    engines.create(rec, len(models))
    torch.manual_seed(1234)
    inputs = {}
    for inst in pipe.instances:
        shape = (inst.spec.batch_size, inst.spec.seq_len)
        if shape not in inputs:
            vocab = min(
                f["vocab_size"] for j, f in zip(pipe.instances, fields) if (j.spec.batch_size, j.spec.seq_len) == shape
            )
            inputs[shape] = torch.randint(0, vocab, shape)
            rec.classify([inputs[shape]], "input")
    total = pipe.iterations * len(pipe.phases)
    for it in range(pipe.iterations):
        for n, phase in enumerate(pipe.phases):
            if progress:
                progress(it * len(pipe.phases) + n + 1, total)
            rec.phase(phase.name, it)
            if engines.listed:
                engines.before_phase(rec, n)
            _run_phase(rec, pipe, models, inputs, phase)
    models.clear()
    inputs.clear()


def _build(rec, inst, f) -> _Instance:
    """One instance as `measure_pipeline`'s `load` builds it."""
    import torch

    from . import dist as distmod
    from . import pipeline
    from .measure import _auto_class, _build, _hf_config, _optimizer, _prepare
    from .trace_ddp import build_ddp
    from .trace_fsdp1 import build_fsdp1
    from .trace_nf4 import build_nf4, prepared, quant_states

    spec = inst.spec
    par = spec.parallel
    first = len(rec.storages)
    if inst.host_fsdp:
        model = pipeline._fsdp2_offload(pipeline._build_on_cpu(spec, f))
    elif _is_engine(inst):
        # The engine's partitions are where DeepSpeed puts them (`offload_param`'s pinned on the host).
        dtype = torch.bfloat16 if spec.precision == "bf16" else torch.float32
        engine = distmod._build_zero(spec, _hf_config(spec, f), _auto_class(spec), dtype, torch.device("cpu"))
        rec.classify(engine.module.parameters(), "parameter")
        rec.classify(engine.module.buffers(), "buffer")
        for name, module in engine.module.named_modules():
            module._headroom_name = f"{inst.name}.{name}" if name else inst.name
        engine.train() if spec.mode == "train" else engine.eval()
        return _Instance(inst, engine, engine.module, None, params_on_device=True, engine=True)
    elif par is not None:  # the strategies the tracer cannot run are refused before
        dtype = torch.bfloat16 if spec.precision == "bf16" else torch.float32
        builders = {"ddp": build_ddp, "fsdp1": build_fsdp1}
        build = builders.get(par.strategy)
        args = (spec, _hf_config(spec, f), _auto_class(spec), dtype, torch.device("cpu"))
        model = build(rec, *args) if build else distmod._build_fsdp(*args)
    elif spec.quantization:
        model = prepared(rec, spec, build_nf4(rec, spec, _hf_config(spec, f)))
        rec.classify(quant_states(model), "parameter")
    elif inst.home == "cpu":
        model = _prepare(spec, pipeline._build_on_cpu(spec, f))
    else:
        model = _prepare(spec, _build(spec, _hf_config(spec, f), device="cpu"))
    on_host = inst.home == "cpu" or (par is not None and par.offload_params)
    if inst.home == "cpu":
        for s in rec.storages[first:]:
            s["kind"] = "host"
    else:
        rec.classify(model.parameters(), "host" if on_host else "parameter")
        rec.classify(model.buffers(), "buffer")
    for name, module in model.named_modules():
        module._headroom_name = f"{inst.name}.{name}" if name else inst.name  # the instance's modules, by its name
    train = spec.mode == "train"
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = _optimizer(spec, trainable) if train else None
    model.train() if train else model.eval()
    return _Instance(inst, model, model, optimizer, params_on_device=not on_host)


def _run_phase(rec, pipe, models: list[_Instance], inputs: dict, phase):
    """`measure_pipeline`'s `run_phase`: the moves out, the host-homed instances in, the passes,
    and the moves back."""
    moved_out = [k for k in phase.offload if models[k].params_on_device]
    for k in moved_out:
        _move_params(rec, models[k], to_device=False)
    states_out = [k for k in phase.offload_optimizer if _move_states(rec, models[k], to_device=False)]
    if moved_out or states_out:
        rec.empty_cache()
    moved_in = []
    for pd in phase.passes:
        inst = pipe.instances[pd.instance]
        if inst.home == "cpu" and not inst.host_fsdp and pd.instance not in moved_in:
            _move_params(rec, models[pd.instance], to_device=True)
            moved_in.append(pd.instance)
    for pd in phase.passes:
        for _ in range(pd.repeat):
            _run_pass(rec, models[pd.instance], inputs, pd)
    for k in moved_in:
        _move_params(rec, models[k], to_device=False)
    if moved_in or moved_out or states_out:
        rec.empty_cache()
    for k in moved_out:
        _move_params(rec, models[k], to_device=True)
    for k in states_out:
        _move_states(rec, models[k], to_device=True)


def _run_pass(rec, m: _Instance, inputs: dict, pd):
    """`measure_pipeline`'s `run_pass`: a train step, a no-grad log-prob pass, or `generate`."""
    import torch

    from .measure import _logprob_forward
    from .trace import autocast_of, train_step

    spec = m.inst.spec
    ids = inputs[(spec.batch_size, spec.seq_len)]
    autocast = autocast_of(spec)
    if pd.kind == "train" and m.engine:
        from .trace_zero import engine_step

        engine_step(rec, spec, m.model, ids, autocast)
    elif pd.kind == "train":
        par = spec.parallel
        trainable = [p for p in m.model.parameters() if p.requires_grad]
        train_step(
            rec, spec, m.model, ids, autocast, m.optimizer, trainable,
            sharded=par is not None and par.strategy != "ddp", host_step=par is not None and par.offload_params,
        )  # fmt: skip
    elif pd.kind == "forward":
        with torch.no_grad():
            _logprob_forward(m.model, ids, autocast)
    else:
        m.module.eval()
        with torch.no_grad(), autocast(), _StopAtLength(ids.shape[1]):
            out = m.module.generate(
                ids[:, : spec.seq_len - pd.new_tokens],
                max_new_tokens=pd.new_tokens,
                min_new_tokens=pd.new_tokens,
                do_sample=False,
                use_cache=True,
                pad_token_id=0,
                eos_token_id=None,
            )
        if out.shape[1] != spec.seq_len:
            raise TraceError(f"generate stopped at {out.shape[1]} tokens, not {spec.seq_len}")
        del out
        if spec.mode == "train":
            m.module.train()


class _StopAtLength:
    """transformers' `StopCheck` with its flag computed as on the GPU (`max() == 0`, two small
    tensors) and the answer the real run reads: sequences end at `length` tokens, as none has an
    end-of-sequence token."""

    def __init__(self, length: int):
        self.length = length

    def __enter__(self):
        from transformers.generation import utils

        self._real = real = utils.StopCheck.__call__
        length = self.length

        def call(check, unfinished_sequences, tokens, cur_len):
            real(check, unfinished_sequences, tokens, cur_len)
            return cur_len >= length

        utils.StopCheck.__call__ = call
        return self

    def __exit__(self, *exc):
        from transformers.generation import utils

        utils.StopCheck.__call__ = self._real
        return False


def _apply_order(module):
    """The tensors `Module._apply` converts, in its order: children first, then each parameter
    and its gradient, then the buffers."""
    for child in module.children():
        yield from _apply_order(child)
    for p in module._parameters.values():
        if p is not None:
            yield p, "parameter"
            if p.grad is not None:
                yield p.grad, "gradient"
    for b in module._buffers.values():
        if b is not None:
            yield b, "buffer"


def _move_params(rec, m: _Instance, to_device: bool):
    """`model.cuda()` or `model.cpu()`."""
    _relocate(rec, _apply_order(m.model), to_device, "model.cuda()" if to_device else "model.cpu()")
    m.params_on_device = to_device


def _move_states(rec, m: _Instance, to_device: bool) -> bool:
    """verl's and slime's optimizer offload: each state tensor of more than one element moved
    (`state[k] = v.to(where)`); whether any moved."""
    import torch

    if m.optimizer is None or m.states_on_device == to_device:
        return False
    states = [
        (v, "optimizer_state")
        for state in m.optimizer.state.values()
        for v in state.values()
        if torch.is_tensor(v) and v.numel() > 1
    ]
    if not states:
        return False
    _relocate(rec, states, to_device, "optimizer state .to()")
    m.states_on_device = to_device
    return True


def _relocate(rec, tensors, to_device: bool, op: str):
    """Each storage of `tensors` (with the kind it has on the device) copied to the other side:
    the old storage freed, a new one allocated in its place (a host one never reaches the
    device)."""
    seen = set()
    for t, kind in tensors:
        t = getattr(t, "_local_tensor", t)
        key = t.untyped_storage()._cdata
        sid = rec.live.get(key)
        if key in seen or sid is None:
            continue
        seen.add(key)
        if (rec.storages[sid]["kind"] != "host") == to_device:
            continue  # already there (a tied weight, met before)
        rec._free(key, sid)
        rec._maybe_alloc(t, op)
        rec.storages[rec.live[key]]["kind"] = kind if to_device else "host"
