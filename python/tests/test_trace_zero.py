"""The tracer on DeepSpeed ZeRO-2 (trace_zero.py): rank 0 of a fake world on DeepSpeed's CUDA code
path. The bit16 parameters go to the host and come back as one flat buffer, as on CUDA, and the
fp32 partition is rank 0's share of it."""

import importlib.util
import unittest

from .test_trace import TINY, has_torch
from .test_trace_dist import tiny_parameter_numels, traced

WORLD = 4
ZERO2 = {**TINY, "parallel": {"strategy": "zero2", "world_size": WORLD}}


@unittest.skipUnless(has_torch() and importlib.util.find_spec("deepspeed"), "torch or deepspeed is not installed")
class Zero2Test(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.doc = traced(ZERO2)
        layer, root = tiny_parameter_numels()
        numel = TINY["model_config"]["num_hidden_layers"] * layer + root
        alignment = 2 * WORLD  # `nccl_start_alignment_factor` times the data-parallel ranks
        cls.padded = -(-numel // alignment) * alignment
        cls.numel = numel

    def allocated_at(self, sid):
        return self.doc["events"].index(["alloc", sid])

    def test_the_parameters_are_flattened_on_the_host_and_moved_to_the_device_once(self):
        storages = self.doc["storages"]
        host = [s["bytes"] for s in storages if s["kind"] == "host"]
        # Each bf16 parameter's `.cpu()` copy, and the flat buffer made of them on the host.
        self.assertEqual(sum(host), 2 * self.numel + 2 * self.padded)
        load_end = next(p["event"] for p in self.doc["phases"] if p["name"] == "step 1 forward")
        flat = [
            i for i, s in enumerate(storages)
            if s["bytes"] == 2 * self.padded and s["kind"] != "host" and self.allocated_at(i) < load_end
        ]  # fmt: skip
        self.assertEqual(len(flat), 1)
        # DeepSpeed empties the cache after the device copies go, before the flat buffer comes.
        cleared = self.doc["events"].index(["empty_cache"])
        self.assertLess(cleared, self.allocated_at(flat[0]))

    def test_the_fp32_partition_is_rank_zeros_share(self):
        storages = self.doc["storages"]
        share = [s for s in storages if s["bytes"] == 4 * self.padded // WORLD and s["kind"] != "host"]
        self.assertTrue(share, "no fp32 partition of rank 0's share")


if __name__ == "__main__":
    unittest.main()
