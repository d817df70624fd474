"""bitsandbytes under the tracer (bitsandbytes_emulation.py): its 8-bit optimizer's state as the
CUDA run allocates it, its quantization maps built on the host and copied to the device once; its
4-bit weights over fake tensors and its 4-bit matmul's buffers as its CUDA kernel allocates them."""

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


@unittest.skipUnless(has_torch("bitsandbytes"), "torch, transformers and bitsandbytes are not installed")
class FourBitTest(unittest.TestCase):
    def quantized(self, rec, out_features=1024, in_features=1024):
        """A bf16 weight quantized as transformers' loader quantizes it (nf4, double quantization)."""
        import bitsandbytes as bnb
        import torch

        w = torch.empty(out_features, in_features, dtype=torch.bfloat16)
        return bnb.nn.Params4bit(w, requires_grad=False, quant_type="nf4", compress_statistics=True).to(w.device)

    def matmul_allocations(self, rows: int):
        """The storages `matmul_4bit` of `rows` bf16 rows allocates, in order."""
        import bitsandbytes as bnb
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode

        from headroom_measure.bitsandbytes_emulation import BitsAndBytesOnTheGpu
        from headroom_measure.trace import Recorder

        rec = Recorder()
        with BitsAndBytesOnTheGpu(), FakeTensorMode(allow_non_fake_inputs=True), rec.mode():
            weight = self.quantized(rec)
            x = torch.empty(rows, 1024, dtype=torch.bfloat16)
            start = len(rec.events)
            out = bnb.matmul_4bit(x, weight.t(), quant_state=weight.quant_state)
            self.assertEqual(tuple(out.shape), (rows, 1024))
            return [(rec.storages[e[1]]["bytes"], e[0]) for e in rec.events[start:] if e[0] in ("alloc", "free")], [
                e[0] for e in rec.events[start:] if e[0] == "gemm"
            ]

    def test_a_4bit_weight_over_a_fake_tensor_is_a_params4bit_holding_its_packed_bytes(self):
        import bitsandbytes as bnb
        import torch
        from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

        from headroom_measure.bitsandbytes_emulation import BitsAndBytesOnTheGpu
        from headroom_measure.trace import Recorder

        rec = Recorder()
        with BitsAndBytesOnTheGpu(), FakeTensorMode(allow_non_fake_inputs=True), rec.mode():
            weight = self.quantized(rec, 512, 256)
            self.assertIsInstance(weight, bnb.nn.Params4bit)
            self.assertIsInstance(weight, FakeTensor)
            self.assertEqual(type(weight).__name__, "Params4bit")  # what peft's k-bit preparation checks
            self.assertEqual((weight.dtype, weight.untyped_storage().nbytes()), (torch.uint8, 512 * 256 // 2))
            self.assertTrue(weight.bnb_quantized)
            self.assertEqual(tuple(weight.quant_state.shape), (512, 256))
        self.assertNotIsInstance(bnb.nn.Params4bit(torch.empty(4, 4)), FakeTensor)  # the real one outside

    def test_past_1536_rows_the_matmul_dequantizes_then_runs_cublas(self):
        allocations, gemms = self.matmul_allocations(4096)
        blocks = 1024 * 1024 // 64
        self.assertEqual(
            allocations,
            [
                (blocks * 4, "alloc"),  # the absmax dequantized from uint8, fp32
                (blocks * 4, "alloc"),  # plus the offset
                (1024 * 1024 * 2, "alloc"),  # the weight dequantized to bf16
                (4096 * 1024 * 2, "alloc"),  # F.linear's output
                (blocks * 4, "free"),
                (blocks * 4, "free"),
                (1024 * 1024 * 2, "free"),
            ],
        )
        self.assertEqual(gemms, ["gemm"])

    def test_a_few_rows_take_the_fused_kernel_which_allocates_its_output_alone(self):
        allocations, gemms = self.matmul_allocations(4)
        self.assertEqual(allocations, [(4 * 1024 * 2, "alloc")])
        self.assertEqual(gemms, [])


if __name__ == "__main__":
    unittest.main()
