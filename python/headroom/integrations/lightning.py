"""`HeadroomLightningCallback`: a Lightning `Trainer`'s steps measured beside headroom's
estimate, as `HeadroomCallback` does for transformers' `Trainer`.

    trainer = L.Trainer(callbacks=[HeadroomLightningCallback(spec, gpu="h100-80gb")])

Phases: `forward` from the batch's start to `on_before_backward`, `backward` to
`on_after_backward`, `optimizer` from there to the batch's end. On an out-of-memory error
(Lightning's `on_exception`) it dumps a snapshot (with `record_history=True`), diagnoses the
error against the spec and prints the remedies. Without a spec, one is built by
`headroom.spec_from` from `pl_module.model` (or the module itself) and the trainer's precision,
with `spec_overrides` (`seq_len=`, `batch_size=`) on top.
"""

from __future__ import annotations

from .._spec_from import spec_from
from ._watch import CallbackSettings

# Lightning's precision flag -> the spec's precision.
_PRECISIONS = {
    "bf16-true": "bf16",
    "bf16-mixed": "amp-bf16",
    "16-mixed": "amp-fp16",
    "32-true": "fp32",
    "32": "fp32",
}


def _base() -> type:
    for module in ("lightning.pytorch", "pytorch_lightning"):
        try:
            return __import__(module, fromlist=["Callback"]).Callback
        except ImportError:
            continue
    return object


class _LightningCallback(CallbackSettings):
    @property
    def rows(self) -> list[dict]:
        return self.watch.rows

    def on_fit_start(self, trainer, pl_module):
        if self.watch.spec is None:
            model = getattr(pl_module, "model", pl_module)
            spec = spec_from(model, **self.spec_overrides)
            precision = _PRECISIONS.get(str(getattr(trainer, "precision", "")))
            if precision and "precision" not in self.spec_overrides:
                spec["precision"] = precision
            self.watch.spec = spec
        self.watch.start()
        if self.record_history and self.torch.cuda.is_available():
            self.watch.record_history(self.torch, self.history_max_entries)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.watch.begin_step(trainer.global_step + 1)
        self.watch.begin("forward")

    def on_before_backward(self, trainer, pl_module, loss):
        self.watch.begin("backward")

    def on_after_backward(self, trainer, pl_module):
        self.watch.begin("optimizer")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.watch.end_step()

    def on_exception(self, trainer, pl_module, exception):
        kind = getattr(self.torch.cuda, "OutOfMemoryError", None)
        if (isinstance(kind, type) and isinstance(exception, kind)) or "out of memory" in str(exception):
            self.watch.on_oom(exception, self.torch)


class HeadroomLightningCallback(_LightningCallback, _base()):
    """A Lightning `Callback` that sets each step's measured peaks beside headroom's estimate
    (the arguments are `HeadroomCallback`'s)."""
