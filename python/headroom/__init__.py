"""headroom: how much GPU memory an LLM training run will take, why it ran out, and what to change.

The `headroom` command's answers as Python dicts, with the keys its `--json` prints:

    import headroom
    est = headroom.estimate("examples/qwen2.5-7b-lora.yaml", gpu="h100-80gb")
    est["peak_reserved_bytes"], est["gpu"]["fits"]
    headroom.fit(spec, "h100-80gb", gpus=8)
    headroom.diagnose(str(oom_error), spec)
    headroom.snapshot("oom.pickle"); headroom.replay("oom.pickle", alloc_conf="expandable_segments:True")

A spec is a dict, YAML or JSON text, or a path; `spec_from(model, training_args, ...)` builds
one from the objects a script already has. Bad input raises `SpecError` (`field`, `value`,
`allowed`); other failures `HeadroomError`. `headroom.integrations` watches a live run;
`headroom.measure` measures a spec on this machine's GPU.
"""

from ._api import HeadroomError, SpecError, diagnose, estimate, fit, gpu_of_device, replay, snapshot
from ._native import __version__
from ._spec_from import spec_from

__all__ = [
    "HeadroomError",
    "SpecError",
    "__version__",
    "diagnose",
    "estimate",
    "fit",
    "gpu_of_device",
    "replay",
    "snapshot",
    "spec_from",
]
