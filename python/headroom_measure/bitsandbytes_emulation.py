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
"""

from __future__ import annotations

import contextlib


class BitsAndBytesOnTheGpu:
    """bitsandbytes' host work done on the host, for the life of a `with` block."""

    def __init__(self):
        self._stack = contextlib.ExitStack()

    def __enter__(self):
        from bitsandbytes.optim.optimizer import Optimizer1State, Optimizer2State, Optimizer8bit

        self._replace(Optimizer8bit, "fill_qmap", _fill_qmap_on_the_host(Optimizer8bit.fill_qmap))
        for optimizer in (Optimizer1State, Optimizer2State):
            self._replace(optimizer, "init_state", _maps_to_the_device(optimizer.init_state))
        return self

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
