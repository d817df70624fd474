"""bitsandbytes 0.50 under the tracer, as it runs on a CUDA GPU.

bitsandbytes registers its kernels as torch operators (`bitsandbytes/_ops.py`), with fake
implementations that give each CUDA kernel's outputs; its optimizers' step kernels
(`optimizer_update_8bit_blockwise`, `optimizer_update_32bit`) write their state in place and
allocate nothing. Those run as they are. What does not is host work on values:

- **8-bit optimizers.** `Optimizer8bit.fill_qmap` builds the dynamic quantization maps on the
  host (`create_dynamic_map` computes their values), and `init_state` copies them to the
  parameter's device the first time a state is made. The maps are built outside the fake and
  recording modes, as host tensors, and the copy is a device copy of each (two 256-entry fp32
  maps), shared by every parameter's state as the real optimizer shares them.
- **4-bit weights.** `Params4bit` is made with `Tensor._make_subclass`, which cannot wrap a fake
  tensor (the fake tensor's implementation already belongs to its `FakeTensor` object): over a
  fake tensor it is the fake tensor itself, detached, its class made a subclass of both
  `FakeTensor` and `Params4bit` and its attributes set as `Params4bit.__new__` sets them, so
  bitsandbytes', transformers' and peft's own code (`_quantize`, `isinstance`, the class name
  peft checks) runs on it unchanged. `quantize_blockwise` builds its dynamic map on the host and
  copies it to the device once, as the real call does; `Linear4bit` asks the host CPU for
  AVX512-BF16 only for its CPU inference path, which a GPU run never takes.
- **4-bit kernels.** The CUDA backend's Python (`backends/cuda/ops.py`) runs as the kernels of
  its 4-bit operators, so each allocates what it allocates on the GPU: `gemm_4bit` picks between
  its fused kernel (the output alone) and the dequantize-then-`F.linear` fallback (the fp32
  absmax dequantized, the offset added, the weight dequantized into a buffer, then a cuBLAS GEMM)
  as it does on an sm90 GPU of 132 multiprocessors. Its C calls launch nothing.
"""

from __future__ import annotations

import contextlib
import re

SM90 = (132, 9, 0)  # an H100's or H200's (multiprocessors, major, minor), as `_gpu_dispatch_props` reads them
# The 4-bit operators whose CUDA kernels' Python runs under the tracer.
FOUR_BIT_OPS = (
    "bitsandbytes::gemm_4bit", "bitsandbytes::quantize_4bit", "bitsandbytes::dequantize_4bit",
    "bitsandbytes::dequantize_4bit.out", "bitsandbytes::quantize_blockwise", "bitsandbytes::dequantize_blockwise",
    "bitsandbytes::dequantize_blockwise.out",
)  # fmt: skip
# What the CUDA backend's module imports that a machine without CUDA cannot load (its C library),
# or registers with torch (its kernels, which the emulation keeps to itself).
CUDA_ONLY_IMPORTS = (r"from \.\.\._ops import register_kernel\n", r"from \.\.\.cextension import lib\n")


class EmulationError(RuntimeError):
    """bitsandbytes' CUDA backend no longer has what the emulation replaces."""


class BitsAndBytesOnTheGpu:
    """bitsandbytes' host work done on the host, for the life of a `with` block."""

    def __init__(self):
        self._stack = contextlib.ExitStack()

    def __enter__(self):
        from bitsandbytes.optim.optimizer import Optimizer1State, Optimizer2State, Optimizer8bit

        self._replace(Optimizer8bit, "fill_qmap", _fill_qmap_on_the_host(Optimizer8bit.fill_qmap))
        for optimizer in (Optimizer1State, Optimizer2State):
            self._replace(optimizer, "init_state", _maps_to_the_device(optimizer.init_state))
        self._four_bit()
        return self

    def _four_bit(self):
        import bitsandbytes.functional as F
        from bitsandbytes.nn import modules

        from .trace import PYTHON_KERNELS

        real_new = modules.Params4bit.__new__
        self._replace(modules.Params4bit, "__new__", staticmethod(_params4bit_over_fakes(real_new)))
        self._replace(modules, "has_avx512bf16", lambda: False)
        self._replace(F, "create_dynamic_map", _dynamic_map_to_the_device(F.create_dynamic_map))
        self._stack.callback(F.name2qmap.pop, "dynamic", None)
        F.name2qmap.pop("dynamic", None)
        for op, kernel in cuda_kernels().items():
            PYTHON_KERNELS[op] = kernel
            self._stack.callback(PYTHON_KERNELS.pop, op, None)

    def _replace(self, owner, name: str, value):
        self._stack.callback(setattr, owner, name, getattr(owner, name))
        setattr(owner, name, value)

    def __exit__(self, *exc):
        return self._stack.__exit__(*exc)


def _fill_qmap_on_the_host(fill_qmap):
    def on_the_host(optimizer):
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            fill_qmap(optimizer)

    return on_the_host


def _maps_to_the_device(init_state):
    """`init_state` whose `.to(p.device)` of a host map is a device copy, made where the real
    one makes it: the first 8-bit state (a parameter of `min_8bit_size` elements or more)."""

    def init(optimizer, group, p, gindex, pindex):
        from torch._subclasses.fake_tensor import FakeTensor

        config = optimizer.get_config(gindex, pindex, group)
        if config["optim_bits"] == 8 and p.numel() >= config["min_8bit_size"]:
            maps = optimizer.name2qmap
            for name, qmap in list(maps.items()):
                if not isinstance(qmap, FakeTensor):
                    maps[name] = qmap.clone()  # under the fake mode: a device tensor
        return init_state(optimizer, group, p, gindex, pindex)

    return init


_FAKE_SUBCLASSES: dict = {}


def _params4bit_over_fakes(real_new):
    """`Params4bit.__new__` that, over a fake tensor, makes the fake tensor itself the parameter."""

    def new(cls, data=None, requires_grad=False, quant_state=None, blocksize=None, compress_statistics=True,
            quant_type="fp4", quant_storage=None, module=None, bnb_quantized=False, **kwargs):  # fmt: skip
        import torch
        from torch._subclasses.fake_tensor import FakeTensor

        if not isinstance(data, FakeTensor):
            return real_new(cls, data, requires_grad, quant_state, blocksize, compress_statistics, quant_type,
                            quant_storage or torch.uint8, module, bnb_quantized, **kwargs)  # fmt: skip
        subclass = _FAKE_SUBCLASSES.get(cls)
        if subclass is None:
            subclass = _FAKE_SUBCLASSES[cls] = type(cls.__name__, (FakeTensor, cls), {})
        self = data.detach()
        self.__class__ = subclass
        self.requires_grad_(requires_grad)
        self.blocksize = 64 if blocksize is None else blocksize
        self.compress_statistics = compress_statistics
        self.quant_type = quant_type
        self.quant_state = quant_state
        self.quant_storage = quant_storage or torch.uint8
        self.bnb_quantized = bnb_quantized
        self.module = module
        return self

    return new


def _dynamic_map_to_the_device(create_dynamic_map):
    """`create_dynamic_map()` computes its values on the host; `quantize_blockwise` copies it to the
    device (`.to(A.device)`): one device copy of the host map."""

    def on_the_host_then_copied(*args, **kwargs):
        from torch.utils._python_dispatch import _disable_current_modes

        with _disable_current_modes():
            host = create_dynamic_map(*args, **kwargs)
        return host.clone()  # under the fake mode: a device tensor

    return on_the_host_then_copied


class _NoLaunch:
    """bitsandbytes' C library as the kernels' Python sees it: every function launches nothing."""

    def __getattr__(self, name):
        return _NoLaunchFunction()


class _NoLaunchFunction:
    argtypes = restype = None

    def __call__(self, *args):
        return None


def cuda_kernels() -> dict:
    """The 4-bit operators' CUDA kernels (`register_kernel(op, "cuda")` in `backends/cuda/ops.py`),
    by operator, run from the module's own source with its C library launching nothing and its
    device queries answered as on an sm90 GPU."""
    import importlib.util
    import warnings

    import torch

    path = importlib.util.find_spec("bitsandbytes.backends.cuda.ops").origin
    source = open(path).read()
    for pattern in CUDA_ONLY_IMPORTS:
        source, n = re.subn(pattern, "", source)
        if n != 1:
            raise EmulationError(f"bitsandbytes' CUDA backend ({path}) no longer imports `{pattern}`")
    kernels = {}

    def register_kernel(op, device):
        def register(fn):
            kernels[op] = fn
            return fn

        return register

    namespace = {"__name__": "bitsandbytes.backends.cuda.ops", "register_kernel": register_kernel, "lib": _NoLaunch()}
    exec(compile(source, path, "exec"), namespace)
    if "_gpu_dispatch_props" not in namespace:
        raise EmulationError(f"bitsandbytes' CUDA backend ({path}) no longer reads `_gpu_dispatch_props`")
    namespace["_gpu_dispatch_props"] = lambda device_index: SM90
    namespace["_get_raw_stream"] = lambda device_index: 0
    out = {}
    for name in FOUR_BIT_OPS:
        if name not in kernels:
            raise EmulationError(f"bitsandbytes' CUDA backend ({path}) has no kernel for `{name}`")
        base, _, overload = name.removeprefix("bitsandbytes::").partition(".")
        op = getattr(getattr(torch.ops.bitsandbytes, base), overload or "default")

        def kernel(*args, _kernel=kernels[name], **kwargs):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # fake tensors' data pointers, read for the launch
                return _kernel(*args, **kwargs)

        out[op] = kernel
    return out
