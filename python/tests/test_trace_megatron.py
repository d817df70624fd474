"""The tracer on Megatron-core (trace_megatron.py): rank 0 of a fake world running the harness's GPTModel,
Megatron's DDP and distributed optimizer on fake CPU tensors that stand for CUDA's. Without megatron-core the
trace is refused saying what to install; with it, Megatron's own buffers are recorded as it makes them."""

import importlib.util
import json
import sys
import tempfile
import unittest
from unittest import mock

from .test_trace import TINY, has_torch, run
from .test_trace_dist import traced

WORLD, TP = 4, 2
MEGATRON = {
    **TINY,
    "parallel": {"strategy": "ddp", "world_size": WORLD, "tp": TP, "framework": "megatron"},
    "megatron": {"distributed_optimizer": True},
}  # fmt: skip


class RefusalTest(unittest.TestCase):
    def test_without_megatron_core_the_trace_says_what_to_install(self):
        from headroom_measure.trace import TraceError
        from headroom_measure.trace_megatron import require_megatron

        with mock.patch.dict(sys.modules, {"megatron": None, "megatron.core": None}):
            with self.assertRaises(TraceError) as caught:
                require_megatron()
        self.assertIn("`parallel.framework: megatron`", str(caught.exception))
        self.assertIn("pip install megatron-core==0.19.0", str(caught.exception))

    def test_a_megatron_pipeline_is_refused_by_name(self):
        spec = {**MEGATRON, "parallel": {**MEGATRON["parallel"], "pp": 2, "microbatches": 2}}
        with tempfile.TemporaryDirectory() as tmp:
            out = run("trace", "--spec-json", json.dumps(spec), "--out", f"{tmp}/t.json")
        self.assertEqual(out.returncode, 2, out.stderr)
        self.assertIn("`parallel.pp: 2` with framework megatron", out.stderr)
        self.assertNotIn("Traceback", out.stderr)

    def test_expert_tensor_parallelism_is_refused_by_name(self):
        spec = {**MEGATRON, "megatron": {"expert_model_parallel_size": 2, "expert_tensor_parallel_size": 2}}
        with tempfile.TemporaryDirectory() as tmp:
            out = run("trace", "--spec-json", json.dumps(spec), "--out", f"{tmp}/t.json")
        self.assertEqual(out.returncode, 2, out.stderr)
        self.assertIn("`megatron.expert_tensor_parallel_size: 2`", out.stderr)

    def test_a_bad_megatron_block_is_refused_by_name(self):
        spec = {**MEGATRON, "megatron": {"recompute_granularity": "some"}}
        with tempfile.TemporaryDirectory() as tmp:
            out = run("trace", "--spec-json", json.dumps(spec), "--out", f"{tmp}/t.json")
        self.assertEqual(out.returncode, 2, out.stderr)
        self.assertIn("`megatron.recompute_granularity`: 'some'", out.stderr)


@unittest.skipUnless(has_torch() and importlib.util.find_spec("megatron"), "torch or megatron-core is not installed")
class MegatronTraceTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.doc = traced(MEGATRON)
        c = TINY["model_config"]
        h, i, heads, kv = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"]
        head_dim = h // heads
        # Rank 0's share: every linear split over tp, the norms whole (Megatron pads no vocabulary itself).
        layer = (h * (heads + 2 * kv) * head_dim + heads * head_dim * h + 3 * h * i) // TP + 2 * h
        cls.numel = c["num_hidden_layers"] * layer + 2 * c["vocab_size"] * h // TP + h

    def phase_storages(self, name):
        phases = self.doc["phases"]
        ends = [p["event"] for p in phases[1:]] + [len(self.doc["events"])]
        for p, end in zip(phases, ends):
            if p["name"] == name:
                return [self.doc["storages"][e[1]] for e in self.doc["events"][p["event"] : end] if e[0] == "alloc"]
        raise AssertionError(name)

    def test_the_phases_are_the_harness_steps(self):
        names = [p["name"] for p in self.doc["phases"]]
        self.assertEqual(names[:4], ["load", "step 1 forward", "step 1 backward", "step 1 optimizer"])
        self.assertEqual(len(names), 1 + 3 * 3)

    def test_the_gradient_buffer_is_fp32_and_the_parameter_buffer_bf16_of_the_same_padded_numel(self):
        load = self.phase_storages("load")
        grads = [s["bytes"] for s in load if s["kind"] == "gradient"]
        params = [s["bytes"] for s in load if s["kind"] == "parameter" and s["bytes"] * 2 in grads]
        self.assertEqual(len(grads), 1, grads)
        self.assertEqual(params, [grads[0] // 2])
        padded = grads[0] // 4
        self.assertGreaterEqual(padded, self.numel)
        self.assertEqual(padded % (WORLD // TP), 0)

    def test_the_distributed_optimizer_keeps_fp32_main_shards_of_a_data_parallel_share(self):
        grads = next(s["bytes"] for s in self.doc["storages"] if s["kind"] == "gradient")
        shards = [s for s in self.phase_storages("load") if s["op"] == "aten._to_copy.default" and s["kind"] != "host"]
        # Each rank's shard is its 1/dp of the buffer, less the padding it owns (and the step's few casts).
        share = grads // (WORLD // TP)
        self.assertAlmostEqual(sum(s["bytes"] for s in shards) / share, 1, delta=0.01)

    def test_the_norms_are_made_on_the_host_and_copied_to_the_device(self):
        h = TINY["model_config"]["hidden_size"]
        host = [s for s in self.phase_storages("load") if s["kind"] == "host" and s["bytes"] == 4 * h]
        self.assertEqual(len(host), 2 * TINY["model_config"]["num_hidden_layers"] + 1)

    def test_dot_product_attention_makes_its_score_matrix(self):
        b, s = TINY["batch_size"], TINY["seq_len"]
        heads = TINY["model_config"]["num_attention_heads"] // TP
        scores = [
            x for x in self.phase_storages("step 1 forward")
            if "core_attention" in x["module"] and x["bytes"] == b * heads * s * s * 2
        ]  # fmt: skip
        self.assertGreaterEqual(len(scores), TINY["model_config"]["num_hidden_layers"])


if __name__ == "__main__":
    unittest.main()
