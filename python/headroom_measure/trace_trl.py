"""TRL's SFT, DPO and GRPO trainers under the tracer, as they run on CUDA.

TRL's fused LM head (`trl/kernels/chunked_logprob.py`) decides by the device: on CUDA
(`_use_triton`) it scores only the positions whose label is valid (`hidden[mask]`) and folds each
logits tile with Triton kernels that write into buffers the Python wrapper allocates; on the CPU it
scores every position and folds each tile with torch ops that allocate temporaries of the tile's
size. The tracer takes CUDA's path:

- **Triton.** `_use_triton` is true, and the two kernel launches do nothing: every tensor they
  write (the running statistics, the logits tile turned into its gradient) is allocated by the
  wrapper, and a Triton launch asks the caching allocator for nothing. `_addmm_fp32` takes CUDA's
  `addmm(..., out_dtype=float32, out=acc)`, a GEMM into the fp32 accumulator that allocates nothing
  but cuBLAS's workspace (a GEMM marker), where the CPU path copies both operands to fp32.
- **Valid positions.** `hidden[mask]`, `labels[mask]` and the backward's `masked_select` have a
  shape that depends on how many labels are valid. The harness builds the batches, so that number
  is known: the trainer's collator is run a second time on the real batch (outside the fake and
  recording modes), and the count of valid next-token labels answers every boolean mask of that
  batch's `(rows, length - 1)` shape. The answered operators allocate what CUDA's do: `nonzero`'s
  index tensor (`(count, 2)` int64, freed after the gather) and the gathered output.
- **GRPO.** Its batches come from generation, not a collator: every completion runs to
  `max_completion_length` as in the measured runs (`generate`'s stop check answered by length),
  so the masks are full, and NaN checks of the rewards read false.
"""

from __future__ import annotations

import contextlib


class _NoOpLaunch:
    """A Triton kernel's `kernel[grid](...)` launch that does nothing: it writes only into tensors
    its caller allocated, and fake tensors have no values to write."""

    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


class _TritonShim:
    """What the wrapper asks of the `triton` module when torch ships without it (the CPU wheel)."""

    @staticmethod
    def cdiv(a, b):
        return -(-a // b)


def addmm_fp32_cuda(rec, acc, a, b) -> None:
    """`_addmm_fp32` as it runs on CUDA: half-precision operands go to a GEMM with fp32 output into
    `acc` (`torch.addmm(..., out_dtype=torch.float32, out=acc)`), which allocates nothing but the
    cuBLAS workspace; fp32 operands add in place as on every device."""
    import torch

    if a.dtype in (torch.float16, torch.bfloat16):
        rec.gemm(bias_epilogue=False)
    else:
        acc.addmm_(a, b)


class TritonPath:
    """The fused LM head's CUDA branch, for the life of a `with` block."""

    def __init__(self, rec):
        self.rec = rec
        self._stack = contextlib.ExitStack()

    def __enter__(self):
        import trl.kernels.chunked_logprob as kernel
        import trl.trainer.utils as utils

        rec = self.rec

        def patch(module, name, value):
            had = hasattr(module, name)
            old = getattr(module, name, None)
            setattr(module, name, value)
            self._stack.callback(lambda: setattr(module, name, old) if had else delattr(module, name))

        patch(kernel, "_use_triton", lambda device: True)
        patch(utils, "_use_triton", lambda device: True)
        patch(kernel, "_forward_kernel", _NoOpLaunch())
        patch(kernel, "_backward_kernel", _NoOpLaunch())
        patch(kernel, "_addmm_fp32", lambda acc, a, b: addmm_fp32_cuda(rec, acc, a, b))
        if not hasattr(kernel, "triton"):
            patch(kernel, "triton", _TritonShim())
        return self

    def __exit__(self, *exc):
        return self._stack.__exit__(*exc)


class MaskAnswers:
    """The number of true elements of the boolean masks the traced code selects by, keyed by the
    mask's shape; `Recorder` asks it before a value-dependent operator runs. `rule`, where set,
    answers the shapes the table does not have (None: not known)."""

    def __init__(self, rule=None):
        self.counts: dict[tuple, int] = {}
        self.rule = rule
        # Masks whose every element is known: `isnan` of a fake tensor is all false (the traced
        # values are finite), its negation all true, and their reductions the same.
        self._uniform_masks: dict[int, tuple] = {}  # id -> (weak reference, value)

    def learn(self, shape, count: int):
        self.counts[tuple(int(d) for d in shape)] = int(count)

    def uniform(self, t):
        """The value of every element of `t`, where known; None otherwise."""
        entry = self._uniform_masks.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def count(self, mask) -> int:
        from .trace import TraceError

        value = self.uniform(mask)
        if value is not None:
            return mask.numel() if value else 0
        key = tuple(int(d) for d in mask.shape)
        answer = self.counts.get(key)
        if answer is None and self.rule is not None:
            answer = self.rule(key)
        if answer is None:
            known = ", ".join(str(list(k)) for k in self.counts) or "none"
            raise TraceError(
                f"a boolean mask of shape {list(key)} selects by value, and the tracer knows the number of valid "
                f"positions only for the batches' label masks (shapes {known})"
            )
        return answer

    def dispatch(self, rec, func, args, kwargs):
        """The value-dependent operators, answered; `NotImplemented` for every other operator."""
        import torch

        aten = torch.ops.aten
        if func is aten.isnan.default:
            return self._known(func(*args, **(kwargs or {})), False)
        value = self.uniform(args[0]) if args else None
        if value is not None and func in (aten.logical_not.default, aten.bitwise_not.default):
            return self._known(func(*args, **(kwargs or {})), not value)
        if value is not None and func in (aten.all.default, aten.all.dim, aten.any.default, aten.any.dim, aten.any.dims):
            return self._known(func(*args, **(kwargs or {})), value)
        if func is aten.nonzero.default:
            return self._nonzero(rec, args[0])
        if func is aten.masked_select.default:
            # CUDA's `masked_select`: both expanded to one shape, then `index` by the mask.
            x, mask = torch.broadcast_tensors(args[0], args[1])
            return self._index(rec, aten.index.Tensor, (x, [mask]))
        if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default, aten._index_put_impl_.default):
            if any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in args[1]):
                return self._index(rec, func, args, kwargs)
        return NotImplemented

    def _known(self, out, value: bool):
        import weakref

        self._uniform_masks[id(out)] = (weakref.ref(out), value)
        return out

    def _nonzero(self, rec, mask):
        import torch

        out = torch.empty((self.count(mask), mask.dim()), dtype=torch.long, device=mask.device)
        rec._maybe_alloc(out, "aten.nonzero.default")
        return out

    def _index(self, rec, func, args, kwargs=None):
        """`index` and `index_put` with a boolean index, as ATen's `expandTensors` runs them: the
        mask's `nonzero`, one int64 index per mask dimension (views of it), then the operator."""
        import torch

        indices = []
        for i in args[1]:
            if i is not None and i.dtype in (torch.bool, torch.uint8):
                indices.extend(self._nonzero(rec, i).unbind(1))
            else:
                indices.append(i)
        out = func(args[0], indices, *args[2:], **(kwargs or {}))
        # The output is allocated while the index tensor is alive; `index_backward`'s scatter
        # writes into its zeros instead (`Recorder._index_backward_in_place`).
        if not (func is torch.ops.aten.index_put.default and rec._index_backward_in_place(args, out)):
            rec._maybe_alloc(out, str(func))
        return out


def learn_label_masks(trainer, answers: MaskAnswers):
    """Wrap the trainer's collator: each batch is also collated for real, outside the fake and
    recording modes, and the count of its valid next-token labels answers its label mask.
    `labels` (SFT) or `completion_mask` (DPO) say which positions are scored. DPO's batch is the
    chosen rows over the rejected ones, and its metrics select each half by its own mask: a half's
    shape is answered when both halves have the same count (otherwise the shape is ambiguous)."""
    from torch.utils._python_dispatch import _disable_current_modes

    collate = trainer.data_collator

    def learning(features):
        with _disable_current_modes():
            learn_batch(collate(features), answers)
        return collate(features)

    trainer.data_collator = learning


def learn_batch(real, answers: MaskAnswers):
    """Teach `answers` the label masks of the collated batch `real` (real tensors)."""
    import torch

    if "labels" in real:
        valid = real["labels"][:, 1:] != -100
    else:
        valid = real["completion_mask"][:, 1:] != 0
        chosen, rejected = (int(torch.count_nonzero(h)) for h in valid.chunk(2, dim=0))
        if chosen == rejected:
            answers.learn(valid.chunk(2, dim=0)[0].shape, chosen)
    answers.learn(valid.shape, int(torch.count_nonzero(valid)))


class PrecomputedReference:
    """DPO's `precompute_ref_log_probs` pass (`_precompute_ref_logps`, run while the trainer is
    built) as it runs on CUDA. Its GPU work is each batch's reference forward
    (`compute_ref_log_probs`), which runs as traced code; the rest is host work on values:
    the batches collated on the host, the log-probabilities copied back (`.cpu()`) and written
    into the dataset's Arrow cache (`.numpy()`), keyed by a hash of the weights' bytes.

    So the pass runs outside the fake and recording modes, and each batch re-enters them: the
    batch is copied to the device (accelerate's `send_to_device`), the forward runs on the fused
    head's CUDA path with the batch's label mask answered, and the host receives zeros of the
    log-probabilities' shape. The device copies and the outputs stay alive until the next
    batch's replace them, as the loop's variables hold them. The weights' hash, which reads
    every weight back to the host and allocates nothing on the device, is a fresh random one, as
    the hash of random weights is (the cache is never hit). The pass is its own phase,
    `reference precompute`, whose peak counts as the measured run's construction peak does."""

    def __init__(self, rec):
        self.rec = rec
        self.held = None  # the last batch's device copy and outputs
        self._stack = contextlib.ExitStack()

    def __enter__(self):
        import uuid

        import trl.trainer.dpo_trainer as dpo

        trainer_class = dpo.DPOTrainer
        real_precompute = trainer_class._precompute_ref_logps
        tracer = self

        def precompute(trainer, dataset, name, batch_size):
            from torch.utils._python_dispatch import _disable_current_modes, _get_current_dispatch_mode_stack

            modes = _get_current_dispatch_mode_stack()
            tracer.rec.phase("reference precompute")
            try:
                with _disable_current_modes():
                    trainer.compute_ref_log_probs = tracer._on_device(trainer, modes)
                    try:
                        return real_precompute(trainer, dataset, name, batch_size)
                    finally:
                        del trainer.compute_ref_log_probs
            finally:
                tracer.held = None
                tracer.rec.phase("load")

        self._stack.callback(setattr, trainer_class, "_precompute_ref_logps", real_precompute)
        trainer_class._precompute_ref_logps = precompute
        self._stack.callback(setattr, dpo, "hash_module", dpo.hash_module)
        dpo.hash_module = lambda module: uuid.uuid4().hex
        return self

    def _on_device(self, trainer, modes):
        import torch
        from torch.utils._pytree import tree_map

        real_compute = type(trainer).compute_ref_log_probs
        rec = self.rec

        def compute(model, inputs):
            answers = MaskAnswers()
            learn_batch(inputs, answers)
            with contextlib.ExitStack() as modes_on:
                for mode in modes:
                    modes_on.enter_context(mode)
                rec.answers = answers
                modes_on.callback(setattr, rec, "answers", None)
                modes_on.enter_context(TritonPath(rec))
                on_device = tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, inputs)
                out = real_compute(trainer, model, on_device)
                self.held = (on_device, out)
            return tuple(torch.zeros(t.shape, dtype=t.dtype) for t in out)

        return compute

    def __exit__(self, *exc):
        return self._stack.__exit__(*exc)


FUSED_HEAD_TRAINERS = ("trl-sft", "trl-dpo", "trl-grpo")


def grpo_masks(ts):
    """GRPO's value-dependent masks when every completion runs to `max_completion_length`, as in
    the measured runs (a random model samples its end-of-sequence token about once in a
    vocabulary's worth of tokens): a scored batch of `rows` prompt-plus-completion sequences
    has `rows * completion_len` valid labels, one completion's mask keeps every token, and
    the per-completion "ended" masks (`is_eos.any(dim=1)`, `~is_truncated`) select none."""
    completion, length = ts.completion_len, ts.prompt_len + ts.completion_len

    def rule(shape):
        if len(shape) == 2 and shape[1] == length - 1:
            return shape[0] * completion
        if shape == (completion,):
            return completion
        if len(shape) == 1:
            return 0
        return None

    return MaskAnswers(rule)


class FullLengthGeneration:
    """`generate`'s stop check (`StopCheck`, which reads `unfinished_sequences.max() == 0` back
    to the host) answered by length: no sequence ends before `max_length` tokens."""

    def __init__(self, max_length: int):
        self.max_length = max_length

    def __enter__(self):
        from transformers.generation import utils

        self._real = utils.StopCheck.__call__
        max_length = self.max_length
        utils.StopCheck.__call__ = lambda check, unfinished, tokens, length: length >= max_length
        return self

    def __exit__(self, *exc):
        from transformers.generation import utils

        utils.StopCheck.__call__ = self._real
        return False


@contextlib.contextmanager
def on_cuda(rec, ts, trainer):
    """`trainer.train()` of a trainer with TRL's fused LM head as it runs on CUDA: the Triton
    path, and the label masks answered from the real batches. Other trainers run as they are."""
    if ts.trainer not in FUSED_HEAD_TRAINERS:
        yield
        return
    with contextlib.ExitStack() as stack:
        if ts.trainer == "trl-grpo":
            from .trace_decode import DecodeLayerReplay

            rec.answers = grpo_masks(ts)
            stack.enter_context(FullLengthGeneration(ts.prompt_len + ts.completion_len))
            stack.enter_context(DecodeLayerReplay(rec))
        else:
            rec.answers = MaskAnswers()
            learn_label_masks(trainer, rec.answers)
        stack.callback(setattr, rec, "answers", None)
        stack.enter_context(TritonPath(rec))
        yield
