"""bitsandbytes under the tracer (bitsandbytes_emulation.py): its 8-bit optimizer's state as the
CUDA run allocates it, its quantization maps built on the host and copied to the device once."""

import unittest

from .test_trace import has_torch


@unittest.skipUnless(has_torch("bitsandbytes"), "torch, transformers and bitsandbytes are not installed")
class Optimizer8bitTest(unittest.TestCase):
    def step(self):
        """Two steps of `AdamW8bit` over a large and a small bf16 parameter, recorded: the
        storages allocated during the steps (the parameters and gradients left out)."""
        import bitsandbytes as bnb
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode

        from headroom_measure.bitsandbytes_emulation import BitsAndBytesOnTheGpu
        from headroom_measure.trace import Recorder

        rec = Recorder()
        with BitsAndBytesOnTheGpu(), FakeTensorMode(allow_non_fake_inputs=True), rec.mode():
            large = torch.nn.Parameter(torch.empty(8192, dtype=torch.bfloat16))
            small = torch.nn.Parameter(torch.empty(100, dtype=torch.bfloat16))
            optimizer = bnb.optim.AdamW8bit([large, small], lr=1e-5)
            large.grad, small.grad = torch.empty_like(large), torch.empty_like(small)
            start = len(rec.events)
            optimizer.step()
            optimizer.step()
            allocated = [rec.storages[e[1]] for e in rec.events[start:] if e[0] == "alloc"]
        return allocated

    def test_the_state_is_what_the_cuda_optimizer_allocates(self):
        sizes = sorted(s["bytes"] for s in self.step())
        blocks = 8192 // 256
        expected = [
            *[8192] * 2,  # state1 and state2 of the large parameter, uint8
            *[blocks * 4] * 2,  # their per-256 absmax, fp32
            *[256 * 4] * 2,  # the signed and unsigned maps, copied to the device once
            *[100 * 4] * 2,  # the small parameter's fp32 state (under min_8bit_size)
        ]
        self.assertEqual(sizes, sorted(expected))


if __name__ == "__main__":
    unittest.main()
