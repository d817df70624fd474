"""The tracer on DDP (trace_ddp.py): rank 0 of a fake world running the real
`DistributedDataParallel` and its C++ Reducer on the CPU. The constructor's parameter check makes
its device tensors, the Reducer holds one gradient bucket until the second forward rebuilds the
buckets in gradient-ready order, and the index exchange's host tensors stay out of the trace."""

import unittest

from .test_trace import TINY, has_torch
from .test_trace_dist import traced

WORLD = 2
DDP = {**TINY, "parallel": {"strategy": "ddp", "world_size": WORLD}}
MIB = 1 << 20


def parameter_shapes():
    """TINY's llama parameters, `model.parameters()` order: (numel, dims) each."""
    c = TINY["model_config"]
    h, i, heads, kv, v = (c[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                          "num_key_value_heads", "vocab_size"))  # fmt: skip
    kv_width = h // heads * kv
    layer = [(h * h, 2), (kv_width * h, 2), (kv_width * h, 2), (h * h, 2), (i * h, 2), (i * h, 2), (h * i, 2),
             (h, 1), (h, 1)]  # fmt: skip
    return [(v * h, 2)] + layer * c["num_hidden_layers"] + [(h, 1), (v * h, 2)]


@unittest.skipUnless(has_torch(), "torch and transformers are not installed")
class DdpTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.doc = traced(DDP)
        cls.events = cls.doc["events"]
        cls.storages = cls.doc["storages"]
        cls.phase = {p["name"]: p["event"] for p in cls.doc["phases"]}
        cls.freed_at = {e[1]: i for i, e in enumerate(cls.events) if e[0] == "free"}

    def allocs(self, start, end):
        return [e[1] for e in self.events[start:end] if e[0] == "alloc"]

    def test_the_parameter_check_makes_its_device_tensors_and_frees_them(self):
        # After the model's parameters and buffers: the count's copy, one all-gather output per
        # rank, NCCL's flat all-gather buffer, the sizes-and-strides metadata; all freed.
        expected = [8] * (WORLD + 1) + [8 * WORLD, 8 * sum(2 * dims for _, dims in parameter_shapes())]
        load = self.allocs(0, self.phase["step 1 forward"])
        sizes = [self.storages[sid]["bytes"] for sid in load]
        at = next(k for k in range(len(sizes)) if sizes[k:k + len(expected)] == expected)
        for sid in load[at:at + len(expected)]:
            self.assertEqual(self.storages[sid]["kind"], "temporary")
            self.assertLess(self.freed_at[sid], self.phase["step 1 forward"])

    def gradients_in(self, phase_from, phase_to):
        start, end = self.phase[phase_from], self.phase[phase_to]
        return [sid for sid in self.allocs(start, end) if self.storages[sid]["kind"] == "gradient"]

    def test_one_bucket_holds_every_gradient_until_the_second_forward_rebuilds_them(self):
        total = 2 * sum(numel for numel, _ in parameter_shapes())  # bf16
        first = self.gradients_in("load", "step 1 forward")
        self.assertEqual([self.storages[sid]["bytes"] for sid in first], [total])
        # The rebuild before the second forward: the old bucket freed, then the new ones in
        # gradient-ready order, the first closed at 1 MiB, the rest under 25 MiB.
        rebuilt = self.gradients_in("step 2 forward", "step 2 backward")
        self.assertGreater(self.freed_at[first[0]], self.phase["step 2 forward"])
        self.assertLess(self.freed_at[first[0]], self.events.index(["alloc", rebuilt[0]]))
        sizes = [self.storages[sid]["bytes"] for sid in rebuilt]
        self.assertEqual(sum(sizes), total)
        self.assertGreaterEqual(sizes[0], MIB)
        self.assertTrue(all(size < 25 * MIB for size in sizes[1:]))
        # Before it, the indices exchanged through two device int32 tensors (every parameter's
        # index and the bucket count, then each bucket's size), freed; their host twins are not
        # in the trace.
        exchange = self.allocs(self.phase["step 2 forward"], self.freed_at[first[0]])
        n = len(parameter_shapes())
        self.assertEqual([self.storages[sid]["bytes"] for sid in exchange], [4 * (n + 1), 4 * len(rebuilt)])
        self.assertTrue(all(self.freed_at[sid] < self.freed_at[first[0]] for sid in exchange))
        # The buckets are rebuilt once and live through the last step.
        last = self.phase["step 3 optimizer"]
        self.assertTrue(all(self.freed_at.get(sid, len(self.events)) > last for sid in rebuilt))
        self.assertFalse(self.gradients_in("step 3 forward", "step 3 backward"))

    def test_backward_allocates_the_gradients_and_nothing_for_the_buckets(self):
        # Copies into the buckets and back into `.grad`, the all-reduce in place: each backward's
        # new gradients are as many bytes as the parameters.
        total = 2 * sum(numel for numel, _ in parameter_shapes())
        for step in (1, 2, 3):
            grads = self.gradients_in(f"step {step} backward", f"step {step} optimizer")
            self.assertEqual(sum(self.storages[sid]["bytes"] for sid in grads), total)
