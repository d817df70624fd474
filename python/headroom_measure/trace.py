"""Trace a spec's steps under fake tensors on the CPU: every storage the caching allocator would
be asked for, in order, written as a headroom trace file (docs/trace-format.md).

The real modeling, peft and optimizer code runs as `headroom measure` runs it (the same build,
prepare, forward, backward and step functions; for a trainer spec, transformers' `Trainer` or
TRL's reward trainer as `trainers.py` builds it, whole), but on `FakeTensorMode` tensors that
have shapes and no data, with CUDA's decisions emulated (`cuda_emulation.py`). A dispatch mode below
autograd sees each operator's outputs: a storage it has not seen is an allocation, and a weak
reference to it reports the free when the storage dies, exactly when the real one would be
returned to the allocator. Operators whose CUDA kernels allocate inside themselves (GEMMs,
reductions, fused attention backward) leave a marker for the Rust side to expand.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import math
import time
import weakref

from .spec import Spec

STEPS = 3
# `linear` reaches the recorder whole only below autograd (a `PYTHON_KERNELS` kernel's `F.linear`),
# where CUDA runs it as `addmm` with its bias (flattening the leading dimensions) or `mm` without.
KERNEL_MARKERS_GEMM = {
    "mm", "addmm", "bmm", "baddbmm", "addbmm", "addmv", "mv", "_grouped_mm", "_addmm_activation", "linear",
}  # fmt: skip
ATTENTION_BACKWARD = {
    "_scaled_dot_product_flash_attention_backward": "flash",
    "_scaled_dot_product_cudnn_attention_backward": "cudnn",
    "_scaled_dot_product_efficient_attention_backward": "efficient",
}
# Operators whose CUDA kernels are Python (a library's wrapper around its C launch), by operator,
# run by the recorder with itself active, so that what they allocate inside is recorded; the
# emulations fill it for the life of their `with` block (`bitsandbytes_emulation.py`).
PYTHON_KERNELS: dict = {}


class TraceError(RuntimeError):
    """The spec asks for something the tracer cannot run under fake tensors."""


def refuse_untraceable(spec):
    """Refuse, naming the key, what cannot run under fake tensors; `spec` is a run or trainer spec."""
    from .trainers import TrainerSpec

    trainer = isinstance(spec, TrainerSpec)
    if trainer:
        spec = spec.base
    if spec.experts_implementation == "eager" and (trainer or spec.parallel is not None):
        raise TraceError(
            "`experts_implementation: eager`: the per-expert loop is traced over an assumed routing in the "
            "measuring loop on one GPU, not yet in a trainer or a parallel run; the tracer runs grouped_mm and "
            "batched_mm there, and `headroom estimate` models the loop natively (an even spread, or "
            "`routing.max_tokens_per_expert_factor`)"
        )
    if spec.parallel is not None:
        from .trace_dist import refuse_untraceable_parallel

        refuse_untraceable_parallel(spec.parallel)
        if spec.parallel.framework == "megatron":
            from .trace_megatron import refuse_untraceable_megatron

            refuse_untraceable_megatron(spec)


class Recorder:
    """A `TorchDispatchMode` that records storage allocations and frees, and kernel markers."""

    def __init__(self):
        self.storages: list[dict] = []
        self.events: list[list] = []
        self.phases: list[dict] = []
        self.live: dict[int, int] = {}  # storage address (`_cdata`) -> storage id
        self.modules: list[str] = []
        # Between a backward node's return and the next node's start: the engine is adding the
        # node's gradients into the buffers of the nodes they flow to.
        self.accumulating = False
        self.scalar_reads = 0
        # The stream an allocation is made on (0: the default stream); a sharded run's tracer
        # follows the streams its wrapper switches to (`trace_dist.Streams`).
        self.stream_of = lambda: 0
        # Answers to operators whose output shape depends on values (`trace_trl.MaskAnswers`).
        self.answers = None
        # Values the next scalar reads return, in order (`reading`).
        self.known_reads: list = []
        self.bounds = IndexBounds()
        # Whether an operator whose tensor inputs all live on the host makes its outputs there, as
        # a CPU kernel does (`kind: host`); the DeepSpeed tracer, whose optimizer offload computes
        # on host tensors, turns it on (`trace_zero.py`).
        self.host_follows_inputs = False
        self.stream_uses: set[tuple[int, int]] = set()  # (storage, stream) pairs recorded
        # Storages a caller keeps while the engine sums into gradients (a pipeline stage's
        # received output gradients): the engine never holds their last reference.
        self.kept: set[int] = set()

    # -- what the step loop calls ------------------------------------------------------------

    def phase(self, name: str, iteration: int | None = None):
        """A phase begins; a pipeline's phases also name their iteration."""
        self.phases.append({"name": name, "event": len(self.events)})
        if iteration is not None:
            self.phases[-1]["iteration"] = iteration

    def empty_cache(self):
        self.events.append(["empty_cache"])

    def caching_allocator_warmup(self, weight_bytes: int):
        """transformers' loader reserving `weight_bytes` at once (`trace_load.py`)."""
        self.events.append(["caching_allocator_warmup", weight_bytes])

    @contextlib.contextmanager
    def reading(self, values):
        """The scalar reads made inside return `values`, in order: what the real run reads back
        is known to the caller (rank 0 of a fake world reading its own broadcast)."""
        self.known_reads = list(values)
        try:
            yield
        finally:
            self.known_reads = []

    def record_stream(self, tensor, stream: int):
        """`tensor.record_stream(s)`, `s` numbered as `stream_of` numbers streams: its storage's
        block, once freed, waits for the work queued on that stream before it is reused. A block
        keeps a set of the streams that used it (`stream_uses`), so each storage and stream is
        recorded once: ZeRO-3 records every rank's partition of one gathered buffer."""
        sid = self._id_of(tensor)
        if sid is not None and (sid, stream) not in self.stream_uses:
            self.stream_uses.add((sid, stream))
            self.events.append(["record_stream", sid, stream])

    def classify(self, tensors, kind: str):
        """Mark the storages of `tensors` (still alive) as holding `kind`."""
        for t in tensors:
            sid = self._id_of(t)
            if sid is not None:
                self.storages[sid]["kind"] = kind

    def copy_as(self, tensor, kind: str):
        """A copy of `tensor` whose storages hold `kind`: the copy CUDA makes on the other side
        of a host-device move (differentiable, as `.to()` is), which between fake CPU tensors is a
        no-op."""
        first = len(self.storages)
        copy = tensor.clone()
        for storage in self.storages[first:]:
            storage["kind"] = kind
        return copy

    def classify_phase(self, kind: str, since_event: int):
        """Storages allocated since `since_event`, alive now and not yet classified: `kind`."""
        for sid in self.live.values():
            s = self.storages[sid]
            if s["kind"] == "temporary" and s["first_event"] >= since_event:
                s["kind"] = kind

    def watch_accumulation(self, root):
        """Hooks on every node of the graph behind `root`: after a node returns, the engine
        accumulates its gradients; when the next node starts, that is over."""
        recorder = self

        def after(*_):
            recorder.accumulating = True

        def before(*_):
            recorder.accumulating = False

        seen, todo = set(), [root]
        while todo:
            node = todo.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            node.register_hook(after)
            node.register_prehook(before)
            todo.extend(fn for fn, _ in node.next_functions)

    def _id_of(self, t):
        import torch

        if not isinstance(t, torch.Tensor):
            return None
        # A DTensor (sharded runs) holds its storage in its local tensor.
        t = getattr(t, "_local_tensor", t)
        try:
            return self.live.get(t.untyped_storage()._cdata)
        except (RuntimeError, NotImplementedError):
            return None

    # -- the dispatch mode -------------------------------------------------------------------

    def mode(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        recorder = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if any(issubclass(t, DTensor) for t in types):
                    # DTensor's own dispatch runs the ops on the local tensors, and its
                    # redistributions' collectives, back through this mode: those allocate.
                    return NotImplemented
                if func is local_scalar:
                    return recorder._scalar(args[0])
                if func is wait_tensor:
                    # CUDA's `wait_tensor` returns the collective's output itself; the fake
                    # kernel makes a new tensor, which no run allocates.
                    return args[0]
                out = NotImplemented
                if recorder.answers is not None:
                    out = recorder.answers.dispatch(recorder, func, args, kwargs)
                if out is NotImplemented and func is bincount:
                    out = recorder.bounds.bincount(recorder, args, kwargs)
                if out is NotImplemented and func is embedding_backward:
                    out = embedding_dense_backward(recorder, func, args, kwargs)
                if out is NotImplemented and func in PYTHON_KERNELS:
                    with self:
                        return PYTHON_KERNELS[func](*args, **(kwargs or {}))
                if out is NotImplemented:
                    out = func(*args, **(kwargs or {}))
                recorder._after(func, args, kwargs, out)
                return out

        import torch
        from torch.distributed.tensor import DTensor

        local_scalar = torch.ops.aten._local_scalar_dense.default
        wait_tensor = torch.ops._c10d_functional.wait_tensor.default
        bincount = torch.ops.aten.bincount.default
        embedding_backward = torch.ops.aten.embedding_dense_backward.default

        return Mode()

    def _scalar(self, t):
        """A value read back to Python (`.item()`, `bool(t)`), which fake tensors do not have.
        Reads whose values the caller knows return them (`reading`). The other reads the traced
        code makes decide no allocation: transformers' masking asks "is
        every row unpacked / unpadded" (true of the harness's dense batch) and the optimizers
        read their step counter for the bias correction (any positive value). A mask whose value
        the answers know (a NaN check) reads as that."""
        import torch

        self.scalar_reads += 1
        if self.known_reads:
            return self.known_reads.pop(0)
        if getattr(t, "constant", None) is not None:
            # Made from Python values (`torch.tensor([mask_type])`): the fake mode keeps the real values.
            return t.constant.item()
        known = self.answers.uniform(t) if self.answers is not None else None
        if known is not None:
            return known
        return True if t.dtype == torch.bool else 1

    def _after(self, func, args, kwargs, out):
        import torch
        from torch.utils._pytree import tree_leaves

        name = func._schema.name.removeprefix("aten::")
        if self.accumulating and func is torch.ops.aten.add.Tensor and self._accumulate_in_place(args, out):
            return
        first = len(self.storages)
        if func is torch.ops.aten.index_put.default and self._index_backward_in_place(args, out):
            return
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._maybe_alloc(t, str(func))
        if self.host_follows_inputs and len(self.storages) > first and self._on_host(args, kwargs):
            for s in self.storages[first:]:
                s["kind"] = "host"
        self.bounds.after(self, func, args, kwargs, out)
        if name in KERNEL_MARKERS_GEMM:
            bias = {"addmm": args[0], "linear": args[2] if len(args) > 2 else (kwargs or {}).get("bias")}.get(name)
            self.gemm(isinstance(bias, torch.Tensor) and bias.dim() == 1)
        elif name == "sum" and func._overloadname == "dim_IntList":
            self._outer_sum(args)
        elif name in ATTENTION_BACKWARD:
            self._attention_backward(ATTENTION_BACKWARD[name], args)

    def _on_host(self, args, kwargs) -> bool:
        """Whether the operator's tensor inputs (one at least) all live on the host."""
        import torch
        from torch.utils._pytree import tree_leaves

        ids = [self._id_of(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        return bool(ids) and all(sid is not None and self.storages[sid]["kind"] == "host" for sid in ids)

    def gemm(self, bias_epilogue: bool):
        """A cuBLAS GEMM, whose workspace the Rust side sizes. The autograd engine runs the
        backward on its own thread, whose cuBLAS handle has its own workspace."""
        import torch

        thread = 0 if torch._C._current_autograd_node() is None else 1
        self.events.append(["gemm", bias_epilogue, thread])

    def _accumulate_in_place(self, args, out) -> bool:
        """The autograd engine sums two gradients of one input in place (`InputBuffer::accumulate`):
        into the first when it holds the only reference to it and its layout is dense and
        non-overlapping (`can_accumulate_inplace`), else into the second when that one can be;
        fake tensors are tensor subclasses, which it always sums out of place. Where the real
        engine would have summed in place, the sum's storage takes over that gradient's id and
        nothing is allocated or freed."""
        import torch
        from torch._prims_common import is_non_overlapping_and_dense_or_false

        if not isinstance(out, torch.Tensor):
            return False
        for grad in args[:2]:
            if not isinstance(grad, torch.Tensor):
                return False
            key = grad.untyped_storage()._cdata
            sid = self.live.get(key)
            if (
                sid is not None
                and key not in self.kept
                and grad.shape == out.shape
                and grad.dtype == out.dtype
                and is_non_overlapping_and_dense_or_false(grad)
                and torch._C._storage_Use_Count(key) <= 2  # the fake tensor and its meta tensor
            ):
                del self.live[key]
                self.adopt(out.untyped_storage(), sid)
                return True
        return False

    def _index_backward_in_place(self, args, out) -> bool:
        """`IndexBackward0` (`index_backward`) scatters the gradient into `grad.new_zeros(...)`
        in place (`index_put_`), but out of place (`index_put`) for tensor subclasses, which
        fake tensors are: the result takes over the zeros' storage, as on the GPU."""
        import torch

        node = torch._C._current_autograd_node()
        if node is None or node.name() != "IndexBackward0" or not isinstance(out, torch.Tensor):
            return False
        key = args[0].untyped_storage()._cdata
        sid = self.live.get(key)
        if sid is None:
            return False
        del self.live[key]
        self.adopt(out.untyped_storage(), sid)
        return True

    def _maybe_alloc(self, t, op: str):
        from torch._subclasses.fake_tensor import FakeTensor

        # A DTensor's storage is its local tensor's.
        t = getattr(t, "_local_tensor", t)
        if t.device.type == "meta":  # shapes only, never allocated (a model built on `meta`)
            return
        if not isinstance(t, FakeTensor):  # made outside the fake mode on purpose: host memory (trace_ddp.py)
            return
        try:
            st = t.untyped_storage()
        except (RuntimeError, NotImplementedError):
            return
        key = st._cdata
        if key in self.live:
            return
        size = st.nbytes()
        if size == 0:
            return
        sid = len(self.storages)
        self.storages.append(
            {
                "bytes": int(size),
                "kind": "temporary",
                "op": op,
                "module": self.modules[-1] if self.modules else "",
                "first_event": len(self.events),
            }
        )
        stream = self.stream_of()
        if stream:
            self.storages[sid]["stream"] = stream
        self.events.append(["alloc", sid])
        self.adopt(st, sid)

    def adopt(self, storage, sid: int):
        """`storage` holds storage `sid` from now on: its death frees it."""
        self.live[storage._cdata] = sid
        weakref.finalize(storage, self._free, storage._cdata, sid)

    def storage_resized(self, t, op: str):
        """`t`'s storage was resized in place (FSDP2 frees and re-allocates its unsharded
        parameters so): to 0 bytes it is freed; to more, allocated anew."""
        key = t.untyped_storage()._cdata
        sid = self.live.get(key)
        if t.untyped_storage().nbytes() == 0:
            if sid is not None:
                self._free(key, sid)
        elif sid is None:
            self._maybe_alloc(t, op)

    def _free(self, key: int, sid: int):
        if self.live.get(key) == sid:
            del self.live[key]
            self.events.append(["free", sid])

    def _outer_sum(self, args):
        """`sum(x, dims)` over x's leading dimensions of a contiguous x (`sum_to_size` of a
        broadcast gradient): CUDA's outer reduction, which may stage partial sums."""
        x, dims = args[0], args[1]
        if not x.is_contiguous() or not dims:
            return
        dims = sorted(d % x.dim() for d in dims)
        if dims != list(range(len(dims))):
            return
        inputs = math.prod(x.shape[: len(dims)])
        outputs = math.prod(x.shape[len(dims) :])
        if outputs and inputs > 1:
            self.events.append(["reduce", int(outputs), int(inputs)])

    def _attention_backward(self, kernel: str, args):
        # (grad_out, query, key, ...): query (b, heads, s, head_dim), key (b, kv_heads, s_k, d); a
        # ring attention step attends half its queries to a whole chunk of keys (s_k > s).
        q, k = args[1], args[2]
        b, heads, s, head_dim = (int(x) for x in q.shape)
        gqa = int(k.shape[1]) != heads
        event = ["attention_backward", kernel, b, heads, s, head_dim, gqa, q.element_size()]
        if int(k.shape[2]) != s:
            event.append(int(k.shape[2]))
        self.events.append(event)


class IndexBounds:
    """Storages whose every value is known to lie in [0, n): `topk`'s indices along a dimension of
    n elements, until an operator writes into them. Their `bincount(minlength=m)` with n <= m has
    exactly m bins (its length is max(max + 1, minlength)), a shape fake tensors refuse as
    data-dependent; transformers' `load_balancing_loss_func` counts the experts' top-k choices so."""

    def __init__(self):
        self.bound: dict[int, int] = {}  # storage id -> n

    def after(self, rec: Recorder, func, args, kwargs, out):
        import torch

        if func is torch.ops.aten.topk.default:
            dim = args[2] if len(args) > 2 else (kwargs or {}).get("dim", -1)
            sid = rec._id_of(out[1])
            if sid is not None:
                self.bound[sid] = int(args[0].shape[dim])
            return
        if not func._schema.is_mutable:
            return
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is not None and arg.alias_info.is_write:
                value = args[i] if i < len(args) else (kwargs or {}).get(arg.name)
                self.bound.pop(rec._id_of(value), None)

    def bincount(self, rec: Recorder, args, kwargs):
        """`_bincount_cuda_template` of a bounded, unweighted, 1-D `x`: `x.min()` and `x.max()`
        each a one-element tensor read back to the host and freed, then the `zeros(m)` int64
        counts (its histogram kernel counts in shared memory, allocating nothing more).
        `NotImplemented` when the bound is not known."""
        import torch

        kwargs = kwargs or {}
        x = args[0]
        weights = args[1] if len(args) > 1 else kwargs.get("weights")
        minlength = args[2] if len(args) > 2 else kwargs.get("minlength", 0)
        bound = self.bound.get(rec._id_of(x))
        if weights is not None or x.dim() != 1 or x.numel() == 0 or bound is None or bound > minlength:
            return NotImplemented
        for reduction in ("aten.min.default", "aten.max.default"):
            scalar = torch.empty((), dtype=x.dtype, device=x.device)
            rec._maybe_alloc(scalar, reduction)
            del scalar
        out = torch.zeros(minlength, dtype=torch.long, device=x.device)
        rec._maybe_alloc(out, "aten.bincount.default")
        return out


def embedding_dense_backward(rec: Recorder, func, args, kwargs):
    """`embedding_dense_backward_cuda` (`Embedding.cu`, `EmbeddingBackwardKernel.cu`) past 3072
    indices, with the buffers it allocates inside itself: the indices sorted (`sorted_indices`,
    `orig_indices`, an `arange` freed at once), the gradient (`zeros`), then per segment of equal
    index its offsets, its partial segments of `NROWS_PER_THREAD` (10) rows and a buffer of every
    partial segment's sums in the accumulation dtype (fp32 for 16-bit gradients), freed in
    reverse as their scopes end (as `sim/engine/backward.rs` models it; cub's scratch left out).
    `NotImplemented` up to 3072 indices, where one kernel accumulates into the gradient."""
    import torch

    kwargs = kwargs or {}
    names = [a.name for a in func._schema.arguments]
    bound = dict(zip(names, args), **kwargs)
    grad, indices, num_weights = bound["grad_output"], bound["indices"], int(bound["num_weights"])
    n = indices.numel()
    if n <= 3072:
        return NotImplemented
    width = grad.numel() // n
    max_segments = min(n, num_weights)
    max_partial = n // 10 + max_segments
    acc = torch.float32 if grad.dtype in (torch.bfloat16, torch.float16) else grad.dtype

    def buffer(numel, dtype, what):
        t = torch.empty(numel, dtype=dtype, device=grad.device)
        rec._maybe_alloc(t, f"embedding_dense_backward: {what}")
        return t

    index = indices.dtype
    held = [buffer(n, index, "sorted indices"), buffer(n, index, "original positions")]
    arange = buffer(n, index, "arange")
    del arange
    out = func(*args, **kwargs)
    rec._maybe_alloc(out, str(func))
    for numel, dtype, what in (
        (n, index, "segment offsets"), (1, torch.int64, "segment count"), (max_segments, index, "partials per segment"),
        (max_segments, index, "partials per segment offset"), (1, torch.int64, "partial segment count"),
        (max_partial, index, "partial segment offsets"), (max_partial * width, acc, "partial segment sums"),
    ):  # fmt: skip
        held.append(buffer(numel, dtype, what))
    while held:
        held.pop()
    return out


def trace(spec, fields: dict, out_path: str, progress=None, rank: int = 0) -> dict:
    """Run the spec's steps under fake tensors and write the trace to `out_path`. `spec` is a run
    spec (`spec.Spec`: the measuring loop's three steps) or a trainer spec
    (`trainers.TrainerSpec`: the real `Trainer` or TRL trainer's `max_steps`). A sharded spec runs
    as rank `rank` of its world (a pipeline's stages differ by rank)."""
    from .trainers import TrainerSpec

    trainer_spec = spec if isinstance(spec, TrainerSpec) else None
    run_spec = trainer_spec.base if trainer_spec else spec
    refuse_untraceable(spec)
    refuse_rank(run_spec, rank)
    t0 = time.time()
    if trainer_spec:
        # Libraries that make tensors when imported make real ones, outside the fake mode.
        _import_trainer_modules(trainer_spec)
    rec = Recorder()
    with _kernel_libraries(run_spec, trainer_spec), fake_cuda(rec):
        if trainer_spec:
            _run_trainer(rec, trainer_spec, fields, progress)
        elif run_spec.parallel is not None and run_spec.parallel.framework == "megatron":
            from .trace_megatron import run_megatron_loop

            run_megatron_loop(rec, run_spec, fields, progress, STEPS)
        elif run_spec.parallel is not None and run_spec.parallel.strategy.startswith("zero"):
            from .trace_zero import run_zero_loop

            run_zero_loop(rec, run_spec, fields, progress, STEPS)
        elif run_spec.parallel is not None:
            from .trace_dist import run_dist_loop

            run_dist_loop(rec, run_spec, fields, progress, STEPS, rank)
        else:
            if run_spec.experts_implementation == "eager":
                from .trace_experts import EvenRouting

                rec.answers = EvenRouting.for_spec(run_spec, fields)
            _run_loop(rec, run_spec, fields, progress)
    spec_json = spec.to_json()
    if run_spec.model_config and "model_config" not in spec_json:
        spec_json["model_config"] = dict(run_spec.model_config)
    return write_trace(rec, spec_json, t0, out_path, rank=rank if run_spec.parallel is not None else None)


def refuse_rank(spec: Spec, rank: int):
    """A rank other than 0 is one of the spec's world, and only a sharded run has one."""
    world = spec.parallel.world_size if spec.parallel is not None else 1
    if rank and not 0 <= rank < world:
        raise TraceError(f"`--rank {rank}`: the spec's world has ranks 0 to {world - 1}")


@contextlib.contextmanager
def fake_cuda(rec: Recorder):
    """Fake tensors on the CPU taking CUDA's decisions, every storage recorded by `rec` and named
    by the module running."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .cuda_emulation import CudaEmulation

    fake = FakeTensorMode(allow_non_fake_inputs=True)
    with CudaEmulation(), _RealCodePaths(), fake, rec.mode(), _ModuleNames(rec):
        yield


def _kernel_libraries(spec: Spec, trainer_spec=None) -> contextlib.ExitStack:
    """The emulations of the CUDA kernel libraries the run calls (bitsandbytes, liger-kernel),
    entered before the fake mode: a library that makes tensors when imported makes real ones."""
    libraries = contextlib.ExitStack()
    if spec.optimizer == "adamw-8bit" or spec.quantization:
        from .bitsandbytes_emulation import BitsAndBytesOnTheGpu

        libraries.enter_context(BitsAndBytesOnTheGpu())
    if trainer_spec is not None and trainer_spec.use_liger_kernel:
        from .liger_emulation import LigerOnTheGpu

        libraries.enter_context(LigerOnTheGpu())
    return libraries


def autocast_of(spec: Spec):
    """The autocast context the measuring harness runs a step's forward in, for `spec`'s precision
    (under FSDP2's MixedPrecisionPolicy only the spec's own `autocast`)."""
    import torch

    dtype = {"amp-bf16": torch.bfloat16, "bf16": torch.bfloat16, "amp-fp16": torch.float16}.get(spec.precision)
    if spec.parallel is not None and spec.parallel.mixed_precision is not None:
        dtype = torch.bfloat16 if spec.autocast == "bf16" else None

    def autocast():
        if dtype is None:
            return torch.autocast("cuda", enabled=False)
        return torch.autocast("cuda", dtype=dtype)

    return autocast


def write_trace(
    rec: Recorder, spec_json: dict, t0: float, out_path: str, engines: list | None = None, rank: int | None = None
) -> dict:
    """The trace file of what `rec` recorded (docs/trace-format.md), `spec_json` the spec as
    run, its wall time counted from `t0`; a pipeline's rollout `engines`, if it has any; the
    `rank` of its world a sharded run ran as."""
    from . import measure as m

    for s in rec.storages:
        s.pop("first_event", None)
    doc = {
        "format": "headroom-trace",
        "version": 1,  # as held here; the file is written compact, as version 2
        "spec": spec_json,
        "env": {**m._versions(), "device": "cpu (fake tensors, CUDA emulated)",
            "scalar_reads": rec.scalar_reads, "wall_s": round(time.time() - t0, 2),
            **({"rank": rank} if rank is not None else {})},
        "phases": rec.phases,
        "storages": rec.storages,
        "events": rec.events,
    }
    if engines:
        doc["engines"] = engines
    opener = gzip.open if out_path.endswith(".gz") else open
    with opener(out_path, "wt") as f:
        json.dump(compact(doc), f, separators=(",", ":"))
    return doc


def compact(doc: dict) -> dict:
    """Version 2 of a version 1 trace `doc` (docs/trace-format.md): storages as columns whose
    kinds, ops and modules index a table of names, and each allocation of the next storage
    written `0`, each free of storage `i` written `next - i`, `next` the allocations before it."""
    if doc["version"] == 2:
        return doc
    names = {"kind": {}, "op": {}, "module": {}}
    columns = {"bytes": [], "kind": [], "op": [], "module": []}
    streams = []
    for s in doc["storages"]:
        columns["bytes"].append(s["bytes"])
        for key, table in names.items():
            columns[key].append(table.setdefault(s[key], len(table)))
        streams.append(s.get("stream", 0))
    if any(streams):
        columns["stream"] = streams
    columns["names"] = {key: list(table) for key, table in names.items()}
    events, allocated = [], 0
    for e in doc["events"]:
        if e[0] == "alloc" and e[1] == allocated:
            events.append(0)
        elif e[0] == "free" and e[1] < allocated:
            events.append(allocated - e[1])
        else:
            events.append(e)
        allocated += e[0] == "alloc"
    return {**doc, "version": 2, "storages": columns, "events": events}


def expand(doc: dict) -> dict:
    """Version 1 of a trace `doc` written by `compact` (or already version 1)."""
    if doc["version"] == 1:
        return doc
    columns = doc["storages"]
    names = columns["names"]
    streams = columns.get("stream")
    storages = []
    for i, size in enumerate(columns["bytes"]):
        s = {"bytes": size, **{key: names[key][columns[key][i]] for key in ("kind", "op", "module")}}
        if streams is not None and streams[i]:
            s["stream"] = streams[i]
        storages.append(s)
    events, allocated = [], 0
    for e in doc["events"]:
        if e == 0:
            e = ["alloc", allocated]
        elif isinstance(e, int):
            e = ["free", allocated - e]
        events.append(e)
        allocated += e[0] == "alloc"
    return {**doc, "version": 1, "storages": storages, "events": events}


def read_trace(path: str) -> dict:
    """A trace file as version 1 holds it, whichever version it was written in."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        return expand(json.load(f))


def _run_loop(rec: Recorder, spec: Spec, fields: dict, progress):
    """The measuring loop's load and three steps (measure.py), every phase marked."""
    import torch

    from . import measure as m

    rec.phase("load")
    cfg = m._hf_config(spec, fields)
    if spec.quantization:
        from .trace_nf4 import build_nf4, prepared, quant_states

        model = prepared(rec, spec, build_nf4(rec, spec, cfg))
        rec.classify(quant_states(model), "parameter")
    else:
        model = m._prepare(spec, m._build(spec, cfg, device="cpu"))
    _ModuleNames.current.name(model)
    rec.classify(model.parameters(), "parameter")
    rec.classify(model.buffers(), "buffer")
    trainable = [p for p in model.parameters() if p.requires_grad]
    train = spec.mode == "train"
    optimizer = m._optimizer(spec, trainable) if train else None
    autocast = autocast_of(spec)
    model.train() if train else model.eval()
    ids = torch.randint(0, fields.get("vocab_size"), (spec.batch_size, spec.seq_len), device="cpu")
    rec.classify([ids], "input")

    for step in range(1, STEPS + 1):
        if progress:
            progress(step, STEPS)
        if train:
            train_step(rec, spec, model, ids, autocast, optimizer, trainable, mark=lambda part: rec.phase(f"step {step} {part}"))
        else:
            rec.phase(f"step {step} forward")
            with torch.no_grad():
                m._logprob_forward(model, ids, autocast)
    del model, optimizer, trainable, ids


def train_step(
    rec: Recorder, spec: Spec, model, ids, autocast, optimizer, trainable, mark=None, sharded=False, host_step=False,
    loss_context=contextlib.nullcontext, passes=contextlib.nullcontext,
):
    """One step of the measuring loop (forward, backward, `optimizer.step()`, `zero_grad`), its
    storages classified; `mark(part)` begins the phase of each part (`forward`, `backward`,
    `optimizer`). `sharded`: FSDP2's or tensor parallelism's backward, whose gradients FSDP2
    reduces itself. `host_step`: the shards, their gradients and the step live on the host
    (CPU offload). `passes()`: a context around forward and backward together (context
    parallelism's)."""
    from . import measure as m

    mark = mark or (lambda part: None)
    with passes():
        mark("forward")
        start = len(rec.events)
        with loss_context():
            loss = m._train_forward(spec, model, ids, autocast)
        rec.classify_phase("activation", start)
        rec.classify([loss], "temporary")
        mark("backward")
        if not sharded:
            rec.watch_accumulation(loss.grad_fn)
        with loss_context():
            loss.backward()
        rec.accumulating = False
        del loss
    rec.classify([p.grad for p in trainable if p.grad is not None], "host" if host_step else "gradient")
    if optimizer is None:
        model.zero_grad(set_to_none=True)
        return
    mark("optimizer")
    first = len(rec.storages)
    optimizer.step()
    if host_step:
        for s in rec.storages[first:]:
            s["kind"] = "host"
    else:
        _classify_optimizer_state(rec, optimizer)
    optimizer.zero_grad(set_to_none=True)


def _run_trainer(rec: Recorder, ts, fields: dict, progress):
    """The trainer as `trainers.py` measures it (`build_trainer`, then `train()`), with the CPU
    as the device (`use_cpu`; the fake tensors stand for CUDA ones). Where the GPU run builds
    the model on the device (`hf`) or a TRL trainer loads the saved random checkpoint onto it,
    the model is built from the same config on the CPU: a checkpoint of fake tensors has no
    bytes to save. Phases follow the trainer's own hooks: its callbacks' step begin, pre- and
    post-optimizer step, and `accelerator.backward`."""
    import shutil
    import tempfile

    from transformers import TrainerCallback
    from transformers.trainer_callback import PrinterCallback

    from . import trace_trl, trainers

    rec.phase("load")
    ckpt = tempfile.mkdtemp(prefix="headroom-trace-ckpt-")
    try:
        trainers._hf_config(ts, fields).save_pretrained(ckpt)
        tokenizer = trainers._tokenizer(int(fields["vocab_size"]), ckpt)
        trainer_box = []

        class Phases(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                if progress:
                    progress(state.global_step + 1, ts.max_steps)
                rec.phase(f"step {state.global_step + 1} forward")

            def on_pre_optimizer_step(self, args, state, control, **kwargs):
                rec.classify(
                    [p.grad for p in trainer_box[0].model.parameters() if p.grad is not None], "gradient"
                )
                rec.phase(f"step {state.global_step + 1} optimizer")

            def on_optimizer_step(self, args, state, control, **kwargs):
                _classify_optimizer_state(rec, trainer_box[0].optimizer)
                rec.phase(f"step {state.global_step + 1} zero_grad")

        with _LoadAsFromPretrained(rec), contextlib.ExitStack() as building:
            if ts.trainer == "trl-dpo" and ts.precompute_ref_log_probs:
                building.enter_context(trace_trl.PrecomputedReference(rec))
            trainer = trainers.build_trainer(ts, fields, ckpt, tokenizer, [Phases()], device="cpu")
        trainer.remove_callback(PrinterCallback)  # the end-of-training metrics, on stdout
        trainer_box.append(trainer)
        _ModuleNames.current.name(trainer.model)
        rec.classify(trainer.model.parameters(), "parameter")
        rec.classify(trainer.model.buffers(), "buffer")
        accelerator = trainer.accelerator
        backward = accelerator.backward

        def marked_backward(loss, **kwargs):
            rec.phase(f"step {trainer.state.global_step + 1} backward")
            rec.watch_accumulation(loss.grad_fn)
            try:
                return backward(loss, **kwargs)
            finally:
                rec.accumulating = False

        accelerator.backward = marked_backward
        with _AcceleratorEmptiesTheCache(rec), trace_trl.on_cuda(rec, ts, trainer):
            trainer.train()
        trainer_box.clear()
        del trainer, accelerator, backward
    finally:
        shutil.rmtree(ckpt, ignore_errors=True)


def _import_trainer_modules(ts):
    import importlib

    names = ["transformers.trainer", "transformers.trainer_callback", "datasets", "tokenizers"]
    if ts.trainer != "hf":
        names.append(f"trl.trainer.{ts.trainer.removeprefix('trl-')}_trainer")
    if ts.base.lora is not None:
        names.append("peft")
    for name in names:
        importlib.import_module(name)


class _LoadAsFromPretrained:
    """TRL's `create_model_from_path` as the tracer needs it: the model of the saved config (the
    dtype and attention `model_init_kwargs` give, `num_labels` for a reward head) built on `meta`
    and loaded onto the device as `from_pretrained` loads the checkpoint (`trace_load.py`)."""

    MODULES = (
        "trl.trainer.utils", "trl.trainer.sft_trainer", "trl.trainer.dpo_trainer", "trl.trainer.grpo_trainer",
        "trl.trainer.reward_trainer",
    )

    def __init__(self, rec):
        self.rec = rec
        self.saved = []

    def __enter__(self):
        import importlib

        from .trace_load import checkpoint_of, load_on_device

        rec = self.rec

        def create_model_from_path(model_id, architecture=None, **kwargs):
            import torch
            from transformers import AutoConfig, AutoModelForCausalLM

            config = AutoConfig.from_pretrained(model_id)
            if "num_labels" in kwargs:
                config.num_labels = kwargs["num_labels"]
            dtype = kwargs.get("dtype", "float32")
            dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
            arch = architecture or AutoModelForCausalLM
            extra = {"attn_implementation": kwargs["attn_implementation"]} if "attn_implementation" in kwargs else {}
            with torch.device("meta"):
                model = arch.from_config(config, dtype=dtype, **extra)
            load_on_device(rec, model, checkpoint_of(model))
            return model.eval()

        for name in self.MODULES:
            module = importlib.import_module(name)
            if hasattr(module, "create_model_from_path"):
                self.saved.append((module, module.create_model_from_path))
                module.create_model_from_path = create_model_from_path
        return self

    def __exit__(self, *exc):
        for module, real in self.saved:
            module.create_model_from_path = real
        return False


class _AcceleratorEmptiesTheCache:
    """accelerate's `clear_device_cache` (`Trainer.train()` starts with `accelerator.free_memory()`)
    empties the CUDA cache where CUDA is available, which the CPU it runs on is not: it records
    the `empty_cache` the GPU run makes. After DPO's reference precompute that releases the
    pass's cached segments before training starts."""

    def __init__(self, rec: Recorder):
        self.rec = rec

    def __enter__(self):
        import gc

        from accelerate.utils import memory

        self._real = memory.clear_device_cache
        rec = self.rec

        def clear_device_cache(garbage_collection: bool = False) -> None:
            if garbage_collection:
                gc.collect()
            rec.empty_cache()

        memory.clear_device_cache = clear_device_cache
        return self

    def __exit__(self, *exc):
        from accelerate.utils import memory

        memory.clear_device_cache = self._real
        return False


def _classify_optimizer_state(rec: Recorder, optimizer):
    """The optimizer's state tensors; `step` counters live on the host unless the optimizer is
    fused or capturable (`torch.optim`'s `_get_scalar_dtype` tensors), so the GPU never sees them."""
    import torch

    for group in optimizer.param_groups:
        on_device = group.get("fused") or group.get("capturable")
        for p in group["params"]:
            for name, t in optimizer.state.get(p, {}).items():
                if isinstance(t, torch.Tensor):
                    host = name == "step" and not on_device
                    rec.classify([t], "host" if host else "optimizer_state")


class _RealCodePaths:
    """transformers takes its compile-friendly branches for fake tensors (`is_tracing` counts
    them as tracing), materialising masks a real run never builds; the tracer wants the branches
    a real run takes.


    Also: `Module.to()` swaps each parameter with its converted self when the tensor is a
    subclass, and `swap_tensors` refuses a tensor that has a weak reference, which
    `FakeTensorMode` keeps to every fake tensor (either side of the swap); swapping a parameter with a parameter over the
    same tensor (a conversion to the device and dtype it has) is a no-op, and is made one; any
    other conversion sets the parameter's data, as `Module.to()` does for a plain tensor."""

    def __enter__(self):
        import torch.utils
        from transformers.utils import import_utils

        self._fake = import_utils.is_fake_tensor
        import_utils.is_fake_tensor = lambda tensor: False
        self._swap = real_swap = torch.utils.swap_tensors

        def swap(t1, t2):
            if _same_tensor(t1, t2):
                return None
            if weakref.getweakrefcount(t1) or weakref.getweakrefcount(t2):
                # What `Module.to()` does for a plain tensor: the parameter object stays, its
                # data becomes the converted tensor; a fake tensor's device is its own attribute.
                t1.data = t2.data
                if hasattr(t2, "fake_device"):
                    t1.fake_device = t2.fake_device
                return None
            return real_swap(t1, t2)

        torch.utils.swap_tensors = swap
        return self

    def __exit__(self, *exc):
        import torch.utils
        from transformers.utils import import_utils

        import_utils.is_fake_tensor = self._fake
        torch.utils.swap_tensors = self._swap
        return False


def _same_tensor(a, b) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and a.untyped_storage()._cdata == b.untyped_storage()._cdata
    )


class _ModuleNames:
    """Forward pre- and post-hooks on every module name the innermost one running."""

    current: "_ModuleNames"

    def __init__(self, rec: Recorder):
        self.rec = rec
        self.handles = []

    def __enter__(self):
        import torch

        _ModuleNames.current = self
        rec = self.rec

        def pre(module, args):
            rec.modules.append(getattr(module, "_headroom_name", type(module).__name__))

        def post(module, args, out):
            if rec.modules:
                rec.modules.pop()

        self.handles = [
            torch.nn.modules.module.register_module_forward_pre_hook(pre),
            torch.nn.modules.module.register_module_forward_hook(post, always_call=True),
        ]
        return self

    def name(self, model):
        for name, module in model.named_modules():
            module._headroom_name = name

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()
        return False
