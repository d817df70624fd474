"""`HeadroomCallback`: transformers' `Trainer` (and TRL's trainers, built on it) measured beside
headroom's estimate, step by step.

    from headroom.integrations import watch
    trainer = Trainer(model=model, args=args, ...)
    watch(trainer, seq_len=2048)           # adds the callback and catches out-of-memory errors
    trainer.train()

Before training it prints the estimate for this run and whether it fits the GPU; after every
step, each phase's measured peak allocated and reserved bytes beside the estimate, with a
`HeadroomWarning` where they part by more than `threshold`. On a CUDA out-of-memory error in
`trainer.train()` (with `watch`, or `callback.attach(trainer)`) it dumps a memory snapshot (with
`record_history=True`), diagnoses the error against the spec and prints the remedies ranked by
what they save; the error is then raised as it was.

The spec is given, or built by `headroom.spec_from` from the trainer's model and arguments
(a TRL config's `max_length` gives the sequence length; else `seq_len=`, else the first
batch's shape). Importing `headroom` imports no transformers; this module does, when
`headroom.integrations.HeadroomCallback` is first used (without transformers the class still
works, duck-typed, for tests).
"""

from __future__ import annotations

import functools
from typing import Any, Optional

from headroom_measure.trainers import core_model

from .._spec_from import spec_from
from ._watch import CallbackSettings


def _base() -> type:
    try:
        from transformers import TrainerCallback
    except ImportError:  # duck-typed: the Trainer calls the events by name
        return object
    return TrainerCallback


def _is_oom(exc: BaseException, torch: Any) -> bool:
    kind = getattr(getattr(torch, "cuda", None), "OutOfMemoryError", None)
    return (isinstance(kind, type) and isinstance(exc, kind)) or "out of memory" in str(exc)


class _Callback(CallbackSettings):
    def __init__(self, *args: Any, **kwargs: Any):
        super().__init__(*args, **kwargs)
        # False between steps, True within one, None where no step is measured.
        self.in_step: Optional[bool] = False
        self.hooks: list = []
        self.depth = 0

    @property
    def rows(self) -> list[dict]:
        """Every phase measured so far beside the estimate (what was printed)."""
        return self.watch.rows

    @property
    def estimate(self) -> Optional[dict]:
        return self.watch.estimate

    # -------------------------------------------------------------- the Trainer's events

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        gpus = getattr(args, "n_gpu", 1) or 1
        if gpus > 1:
            # One process driving several GPUs: the Trainer wraps the model in
            # nn.DataParallel, whose replicas run the hooks in threads of their own devices.
            self.watch.out(
                f"headroom: the Trainer runs torch.nn.DataParallel over {gpus} GPUs in one process; "
                "headroom models one process per GPU (torchrun or accelerate launch), so it sets no "
                "step beside the estimate here. Launch one process per GPU, or make one GPU visible "
                "(CUDA_VISIBLE_DEVICES=0)."
            )
            self.in_step = None
            return
        if self.watch.spec is None and model is not None:
            spec = spec_from(model, args, **self.spec_overrides)
            self.watch.spec = spec
        spec = self.watch.spec
        # A dict without a sequence length waits for the first batch to say it.
        if spec is not None and (not isinstance(spec, dict) or "seq_len" in spec or self._grpo()):
            self.watch.start()
        if model is not None and not self.hooks:
            core = core_model(model)
            self.hooks.append(core.register_forward_pre_hook(self._forward_begins, with_kwargs=True))
            self.hooks.append(core.register_forward_hook(self._forward_ends, with_kwargs=True))
        if self.record_history and self.torch.cuda.is_available():
            self.watch.record_history(self.torch, self.history_max_entries)

    def on_step_begin(self, args, state, control, **kwargs):
        if self.in_step is False:
            self.in_step = True
            self.watch.begin_step(state.global_step + 1)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        # Where the end of backward was not seen (a loss computed outside the model), the
        # optimizer phase starts here, after gradient clipping.
        if self.in_step and self.watch.phase != "optimizer":
            self.watch.begin("optimizer")

    def on_step_end(self, args, state, control, **kwargs):
        if self.in_step:
            self.in_step = False
            self.watch.end_step()

    def on_train_end(self, args, state, control, **kwargs):
        for h in self.hooks:
            h.remove()
        self.hooks.clear()

    # -------------------------------------------------------------- the model's hooks

    def _grpo(self) -> bool:
        spec = self.watch.spec
        return isinstance(spec, dict) and spec.get("trainer") == "trl-grpo"

    def _forward_begins(self, module, args, kwargs):
        if not self.in_step or not module.training or not self.torch.is_grad_enabled():
            return None
        self.depth += 1
        if self.depth == 1:
            if self.watch.estimate is None and isinstance(self.watch.spec, dict):
                self._spec_from_batch(args, kwargs)
            self.watch.begin("forward")
        return None

    def _forward_ends(self, module, args, kwargs, output):
        if not self.in_step or not module.training or not self.torch.is_grad_enabled():
            return None
        self.depth -= 1
        if self.depth == 0:
            loss = output.get("loss") if isinstance(output, dict) else getattr(output, "loss", None)
            if loss is not None and getattr(loss, "requires_grad", False):
                loss.register_hook(self._backward_begins)
        return None

    def _backward_begins(self, grad):
        self.watch.begin("backward")
        # The engine runs queued callbacks when this backward pass ends (FSDP marks its
        # post-backward the same way).
        self.torch.autograd.Variable._execution_engine.queue_callback(self._backward_ends)
        return None

    def _backward_ends(self):
        self.watch.begin("optimizer")

    def _spec_from_batch(self, args, kwargs) -> None:
        """The batch and sequence of the first batch, where the spec does not say them."""
        ids = kwargs.get("input_ids", args[0] if args else None)
        shape = getattr(ids, "shape", None)
        spec = dict(self.watch.spec)
        if shape is not None and len(shape) == 2:
            spec.setdefault("seq_len", int(shape[1]))
            spec.setdefault("batch_size", int(shape[0]))
        if "seq_len" in spec:
            self.watch.start(spec)

    # -------------------------------------------------------------- out of memory

    def attach(self, trainer: Any) -> Any:
        """Adds this callback to `trainer` and wraps its `train` so that a CUDA out-of-memory
        error is diagnosed (then raised as it was). Returns the trainer."""
        if self not in getattr(trainer.callback_handler, "callbacks", []):
            trainer.add_callback(self)
        train = trainer.train

        @functools.wraps(train)
        def guarded(*args, **kwargs):
            try:
                return train(*args, **kwargs)
            except Exception as exc:
                if _is_oom(exc, self.torch):
                    self.oom(exc)
                raise

        trainer.train = guarded
        return trainer

    def oom(self, exc: BaseException) -> dict:
        """Dumps the snapshot (when recording), diagnoses `exc` with the spec and prints the
        ranked remedies; returns `{"snapshot": path, "diagnosis": diagnose's dict}`."""
        return self.watch.on_oom(exc, self.torch)


class HeadroomCallback(_Callback, _base()):
    """A transformers `TrainerCallback` that sets each step's measured peaks beside headroom's
    estimate.

    `spec`: the run spec (dict, text or path); None builds it with `headroom.spec_from` from
    the trainer's model and arguments, with `spec_overrides` (`seq_len=2048`) on top. `gpu`:
    the GPU to judge the fit on (default: the one training runs on). `threshold`: the fraction
    by which a measured peak may part from the estimate before a `HeadroomWarning`.
    `record_history`: record allocation history so an out-of-memory error dumps a snapshot.
    `out`: where the lines go (default: stderr).
    """


def watch(trainer: Any, spec: Optional[dict] = None, gpu: Optional[str] = None, threshold: float = 0.05, **kwargs: Any):
    """Adds a `HeadroomCallback` to `trainer`, catching out-of-memory errors in `train()`;
    returns the callback (its `rows` hold every phase measured)."""
    callback = HeadroomCallback(spec, gpu, threshold, **kwargs)
    callback.attach(trainer)
    return callback
