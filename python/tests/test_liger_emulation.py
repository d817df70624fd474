"""liger-kernel under the tracer (liger_emulation.py): its own wrappers run with the Triton
launches as no-ops and the device tests answered as on an sm90 GPU, so what they allocate is what
liger 0.8.5 allocates on the H100."""

import unittest

from .test_trace import has_torch


@unittest.skipUnless(has_torch("liger_kernel", "triton"), "torch, transformers and liger-kernel are not installed")
class LigerOnTheGpuTest(unittest.TestCase):
    ROWS, WIDTH = 64, 32

    def recorded(self, body):
        """`body(torch)` under the emulation, fake tensors and a recorder: the storages of its
        forward and of its backward, as (op, bytes), and the recorder's events of the backward."""
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode

        from headroom_measure.liger_emulation import LigerOnTheGpu
        from headroom_measure.trace import Recorder

        rec = Recorder()
        with LigerOnTheGpu(), FakeTensorMode(), rec.mode():
            inputs, forward = body(torch)
            start = len(rec.events)
            out = forward()
            first_backward = len(rec.events)
            out.sum().backward()
            del out, inputs
        allocated = lambda events: [rec.storages[e[1]] for e in events if e[0] == "alloc"]  # noqa: E731
        return (
            allocated(rec.events[start:first_backward]),
            allocated(rec.events[first_backward:]),
            rec.events[first_backward:],
        )

    def test_rms_norm_keeps_the_output_and_rstd_and_sums_per_multiprocessor(self):
        from liger_kernel.ops.rms_norm import LigerRMSNormFunction

        from headroom_measure.liger_emulation import SM90_MULTIPROCESSORS

        def body(torch):
            x = torch.empty(self.ROWS, self.WIDTH, dtype=torch.bfloat16, requires_grad=True)
            w = torch.empty(self.WIDTH, dtype=torch.bfloat16, requires_grad=True)
            return (x, w), lambda: LigerRMSNormFunction.apply(x, w, 1e-6)

        forward, backward, _ = self.recorded(body)
        self.assertEqual(sorted(s["bytes"] for s in forward), [self.ROWS * 4, self.ROWS * self.WIDTH * 2])
        sizes = [s["bytes"] for s in backward]
        # the per-SM fp32 partial sums of the weight's gradient, then its sum and cast
        self.assertIn(SM90_MULTIPROCESSORS * self.WIDTH * 4, sizes)
        self.assertIn(self.WIDTH * 2, sizes)
        # the input's gradient is written into the output's (in_place), never a new buffer
        # beyond the sum's own gradient
        self.assertEqual(sizes.count(self.ROWS * self.WIDTH * 2), 1)

    def test_swiglu_makes_one_product_and_writes_the_gradients_in_place(self):
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction

        def body(torch):
            gate = torch.empty(self.ROWS, self.WIDTH, dtype=torch.bfloat16, requires_grad=True)
            up = torch.empty(self.ROWS, self.WIDTH, dtype=torch.bfloat16, requires_grad=True)
            return (gate, up), lambda: LigerSiLUMulFunction.apply(gate, up)

        forward, backward, _ = self.recorded(body)
        self.assertEqual([s["bytes"] for s in forward], [self.ROWS * self.WIDTH * 2])
        # the upstream gradient made contiguous (the sum's is an expanded scalar), and nothing
        # more of the pair's size: their gradients are written into gate and up
        self.assertEqual([s["bytes"] for s in backward].count(self.ROWS * self.WIDTH * 2), 1)

    def test_rope_rotates_q_and_k_in_place(self):
        from liger_kernel.ops.rope import LigerRopeFunction

        b, s, heads, kv, d = 2, 16, 4, 2, 8

        def body(torch):
            q = torch.empty(b, s, heads, d, dtype=torch.bfloat16, requires_grad=True)
            k = torch.empty(b, s, kv, d, dtype=torch.bfloat16, requires_grad=True)
            cos = torch.empty(1, s, d, dtype=torch.bfloat16)
            sin = torch.empty(1, s, d, dtype=torch.bfloat16)

            def forward():
                # as the attention passes them: (b, heads, s, d) views of the projections' outputs
                q_rot, k_rot = LigerRopeFunction.apply((q * 1).transpose(1, 2), (k * 1).transpose(1, 2), cos, sin)
                return q_rot.sum() + k_rot.sum()

            return (q, k, cos, sin), forward

        forward, _, _ = self.recorded(body)
        q_bytes, k_bytes = b * s * heads * d * 2, b * s * kv * d * 2
        # the two `* 1` products, then no copy of either: the rotation is in place
        self.assertEqual(sorted(x["bytes"] for x in forward if x["bytes"] >= k_bytes), [k_bytes, q_bytes])

    def test_fused_linear_cross_entropy_takes_the_gpus_shared_logits_buffer(self):
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

        rows, hidden, vocab = 64, 16, 384  # 16 chunks of 4 rows

        def body(torch):
            x = torch.empty(rows, hidden, dtype=torch.bfloat16, requires_grad=True)
            w = torch.empty(vocab, hidden, dtype=torch.bfloat16, requires_grad=True)
            target = torch.zeros(rows, dtype=torch.long)
            return (x, w, target), lambda: LigerFusedLinearCrossEntropyFunction.apply(x, w, target)[0]

        forward, _, _ = self.recorded(body)
        chunk = 4
        logits = [s for s in forward if s["bytes"] == chunk * vocab * 2]
        # one `[chunk, vocab]` buffer that every chunk's `mm(out=)` writes (the CPU branch makes
        # one per chunk)
        self.assertEqual(len(logits), 1)
        self.assertEqual(logits[0]["op"], "aten.empty.memory_format")
        # the weight's gradient accumulates in place: no `[vocab, hidden]` fp32 product per chunk
        self.assertFalse([s for s in forward if s["bytes"] == vocab * hidden * 4])
        self.assertIn(vocab * hidden * 2, [s["bytes"] for s in forward])

    def test_a_source_without_the_device_tests_is_refused(self):
        from headroom_measure.liger_emulation import EmulationError, gpu_source

        with self.assertRaises(EmulationError):
            gpu_source("def f(x):\n    return x\n", "f")
        rewritten = gpu_source('def f(x):\n    return x.device.type == "cuda"\n', "f")
        self.assertIn('x.device.type == "cpu"', rewritten)


if __name__ == "__main__":
    unittest.main()
