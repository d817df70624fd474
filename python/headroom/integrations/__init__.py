"""Training callbacks that set a live run's measured GPU memory beside headroom's estimate.

- `HeadroomCallback`, `watch(trainer)`: transformers' `Trainer` and TRL's trainers.
- `HeadroomLightningCallback`: Lightning.

They load on first use, so `import headroom` imports no training library.
"""

from __future__ import annotations

from typing import Any

from ._watch import HeadroomWarning

__all__ = ["HeadroomCallback", "HeadroomLightningCallback", "HeadroomWarning", "watch"]


def __getattr__(name: str) -> Any:
    if name in ("HeadroomCallback", "watch"):
        from . import transformers

        return getattr(transformers, name)
    if name == "HeadroomLightningCallback":
        from . import lightning

        return lightning.HeadroomLightningCallback
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
