"""`headroom measure` from Python: the spec's three steps run on this machine's GPU by the
measurement harness (`headroom_measure`, shipped in this package as the `headroom` command
embeds it), beside the estimate for the GPU it ran on.

`measure(spec)` returns what `headroom measure SPEC --json` prints: the harness's record
(`measured`, the calibration format `headroom validate` reads), the `estimate`, and the errors.
The harness runs in a fresh Python process (by default this one's interpreter, which needs
torch with CUDA, transformers and peft), as the CLI runs it, so a run leaves this process's GPU
memory as it was. The harness's own modules are importable as `headroom.measure.harness`
(`python -m headroom_measure run|trace|batch|pipeline|dist`).
"""

from __future__ import annotations

from typing import Optional

import headroom_measure as harness

from ._api import PathLike, SpecLike, _measure

__all__ = ["harness", "measure"]


def measure(
    spec: SpecLike,
    *,
    snapshot: Optional[PathLike] = None,
    record: Optional[PathLike] = None,
    python: Optional[str] = None,
    spec_dir: Optional[PathLike] = None,
) -> dict:
    """Measure the spec on this GPU: `headroom measure SPEC --json`.

    `snapshot` also saves a `torch.cuda.memory` snapshot of the run there; `record` appends the
    measurement to a calibration file (JSON lines); `python` is the interpreter that has torch
    (default: `HEADROOM_PYTHON`, else this one). A spec given as a dict or text resolves its
    relative model paths against `spec_dir` (default: the working directory).
    """
    return _measure(spec, python, snapshot, record, spec_dir)
