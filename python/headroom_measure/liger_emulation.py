"""liger-kernel's Triton kernels (`use_liger_kernel`) under the tracer, as they run on an sm90 GPU.

liger's autograd Functions (`LigerRMSNormFunction`, `LigerSiLUMulFunction`, `LigerRopeFunction`,
`LigerFusedLinearCrossEntropyFunction`) are Python wrappers that allocate their outputs, saved
buffers and gradient accumulators with torch, then launch Triton kernels on raw pointers. A
Triton launch asks the caching allocator for nothing and writes only into tensors its wrapper
allocated, so the tracer runs liger's own wrappers with every launch a no-op (fake tensors have
no values to write). What the wrappers decide by the device, they decide as an H100 or H200
does: the source of the few functions that test it is run with the tests answered for a CUDA
device of compute capability 9.0 and 132 streaming multiprocessors (the fake tensors stand for
CUDA ones on the CPU device, and CUDA autocast is emulated as CPU autocast,
`cuda_emulation.py`):

- `rms_norm_backward`: the weight gradient's per-SM `[132, width]` fp32 partial sums.
- `_can_use_mm_out`: the fused linear cross-entropy's chunks share one `[chunk, vocab]` logits
  buffer written with `mm(out=)` when the operands' dtype is the one autocast would use.
- `fused_linear_cross_entropy_forward`: the head's weight gradient accumulates with
  `addmm(out=grad_weight)` (no parameter-sized temporary per chunk).

Its backward reads one value, whether the loss's upstream gradient equals one (it scales the
saved gradients in place otherwise, allocating nothing either way): it reads false, as under
`Trainer`, which divides the summed loss by the number of items in the batch; the one-element
tensor it compares with is still made on the device.
"""

from __future__ import annotations

import contextlib
import re

SM90_MULTIPROCESSORS = 132
# (module, function) whose device tests and value reads are answered as on the GPU.
DEVICE_DECIDED = (
    ("liger_kernel.ops.rms_norm", "rms_norm_backward"),
    ("liger_kernel.ops.fused_linear_cross_entropy", "_can_use_mm_out"),
    ("liger_kernel.ops.fused_linear_cross_entropy", "fused_linear_cross_entropy_forward"),
    ("liger_kernel.ops.fused_linear_cross_entropy", "fused_linear_cross_entropy_backward"),
)
# liger's modules loaded before the kernels are replaced: `apply_liger_kernel`'s patches and the
# ops they call.
LOADED = ("liger_kernel.transformers.monkey_patch", *(m for m, _ in DEVICE_DECIDED))
# What each device test of liger 0.8.5's source becomes on the emulated GPU.
ON_THE_GPU = (
    (r'\.device\.type (==|!=) "cuda"', r'.device.type \1 "cpu"'),
    (r"torch\.cuda\.get_device_capability\([^()]*\)", "(9, 0)"),
    (r"torch\.cuda\.get_device_properties\([^()]*\)\.multi_processor_count", str(SM90_MULTIPROCESSORS)),
    (r"torch\.is_autocast_enabled\(\)", 'torch.is_autocast_enabled("cpu")'),
    (r'torch\.get_autocast_dtype\("cuda"\)', 'torch.get_autocast_dtype("cpu")'),
    (r"torch\.equal\(grad_output, (torch\.tensor\([^()]*\))\)", r"(\1 is None)"),
)


class EmulationError(RuntimeError):
    """liger's source no longer has the device test or value read the emulation answers."""


def gpu_source(source: str, name: str) -> str:
    """`source` of liger's function `name` with its device tests and value reads answered as on the GPU."""
    import textwrap

    source = textwrap.dedent(source)
    changed = 0
    for pattern, replacement in ON_THE_GPU:
        source, n = re.subn(pattern, replacement, source)
        changed += n
    if not changed:
        raise EmulationError(f"liger's `{name}` has no device test or value read the tracer knows how to answer")
    return source


class LigerOnTheGpu:
    """liger's kernels as on the GPU, for the life of a `with` block: every Triton kernel of
    liger's ops modules launches nothing, and the device-deciding functions take the GPU's
    branches."""

    def __init__(self):
        self._stack = contextlib.ExitStack()

    def __enter__(self):
        import importlib
        import inspect
        import sys

        from triton.runtime.jit import KernelInterface

        from .trace_trl import _NoOpLaunch

        for module_name in LOADED:
            importlib.import_module(module_name)
        for module_name, module in list(sys.modules.items()):
            if not module_name.startswith("liger_kernel.ops") or module is None:
                continue
            for name, value in list(vars(module).items()):
                if isinstance(value, KernelInterface):
                    self._replace(module, name, _NoOpLaunch())
        for module_name, name in DEVICE_DECIDED:
            module = sys.modules[module_name]
            real = getattr(module, name)
            # Run in a copy of the module's globals (the no-op kernels, the functions rewritten
            # before it), so a function that calls another rewritten one calls the rewritten one.
            namespace = dict(vars(module))
            exec(compile(gpu_source(inspect.getsource(real), name), inspect.getsourcefile(real), "exec"), namespace)
            self._replace(module, name, namespace[name])
        return self

    def _replace(self, module, name: str, value):
        self._stack.callback(setattr, module, name, getattr(module, name))
        setattr(module, name, value)

    def __exit__(self, *exc):
        return self._stack.__exit__(*exc)
