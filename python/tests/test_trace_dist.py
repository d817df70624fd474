"""The tracer on sharded runs (trace_dist.py): rank 0 of a fake world under FSDP2, on the CPU.
Each storage is attributed to the stream FSDP2 allocates it on, the unsharded parameters are
freed and allocated again as FSDP2 resizes their storages, and what cannot be traced is refused
by name."""

import json
import tempfile
import unittest
from collections import Counter

from .test_trace import TINY, has_torch, run

WORLD = 8
FSDP_MP = {
    **TINY,
    "precision": "fp32",
    "parallel": {
        "strategy": "fsdp", "world_size": WORLD,
        "mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"},
    },
}  # fmt: skip


def traced(spec):
    from headroom_measure.trace import read_trace

    with tempfile.TemporaryDirectory() as tmp:
        out = run("trace", "--spec-json", json.dumps(spec), "--out", f"{tmp}/t.json.gz")
        if out.returncode:
            raise AssertionError(out.stderr)
        return read_trace(f"{tmp}/t.json.gz")


def tiny_parameter_numels():
    """(numel of each decoder layer's parameters, numel of the root's) of TINY's llama."""
    c = TINY["model_config"]
    h, i, heads, kv = c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"]
    head_dim = h // heads
    layer = h * h * 2 + 2 * h * kv * head_dim + 3 * h * i + 2 * h
    root = 2 * c["vocab_size"] * h + h
    return layer, root


@unittest.skipUnless(has_torch(), "torch and transformers are not installed")
class FsdpStreamsTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.doc = traced(FSDP_MP)

    def storages(self, stream):
        return [s for s in self.doc["storages"] if s.get("stream", 0) == stream]

    def test_all_gather_outputs_are_the_copy_in_streams_and_gradients_the_reduce_scatters(self):
        layer, root = tiny_parameter_numels()
        streams = Counter(s.get("stream", 0) for s in self.doc["storages"])
        self.assertEqual(sorted(streams), [0, 1, 2])
        # Copy-in stream, per unshard (three units, in forward and again in backward, three
        # steps): the unit's shards cast to bf16 together (the all-gather input), and the bf16
        # all-gather output, the world's shards of the unit.
        gathers = Counter(s["bytes"] for s in self.storages(1))
        shards = {layer // WORLD: 12, root // WORLD: 6}
        expected = {2 * numel * n: count for numel, count in shards.items() for n in (1, WORLD)}
        self.assertEqual(gathers, expected)
        # Reduce-scatter stream: the fp32 reduce-scatter output, one per unit and step, whose
        # views are the sharded gradients.
        outputs = Counter((s["bytes"], s["kind"]) for s in self.storages(2))
        self.assertEqual(outputs, {(4 * (layer // WORLD), "gradient"): 6, (4 * (root // WORLD), "gradient"): 3})

    def test_unsharded_parameters_are_allocated_at_each_unshard_and_freed_at_each_reshard(self):
        layer, root = tiny_parameter_numels()
        doc = self.doc
        load_end = doc["phases"][1]["event"]
        allocated_at = {e[1]: i for i, e in enumerate(doc["events"]) if e[0] == "alloc"}
        freed_at = {e[1]: i for i, e in enumerate(doc["events"]) if e[0] == "free"}
        unsharded = [
            i for i, s in enumerate(doc["storages"]) if s["kind"] == "parameter" and allocated_at[i] >= load_end
        ]
        self.assertTrue(all(doc["storages"][i].get("stream", 0) == 0 for i in unsharded))
        # Every unit resharded after forward: gathered in forward and again in backward, in bf16.
        total = sum(doc["storages"][i]["bytes"] for i in unsharded)
        self.assertEqual(total, 2 * 2 * 3 * (2 * layer + root))
        # FSDP2 re-allocates the storage the first unshard made, so most are resizes, and each is
        # freed by the next reshard, within its step.
        resized = [i for i in unsharded if doc["storages"][i]["op"].startswith("fsdp alloc_storage")]
        self.assertGreater(len(resized), len(unsharded) // 2)
        steps = [p["event"] for p in doc["phases"] if p["name"].endswith("forward")] + [len(doc["events"])]
        for i in unsharded:
            step_end = next(s for s in steps if s > allocated_at[i])
            self.assertLess(freed_at[i], step_end + 1, doc["storages"][i])


@unittest.skipUnless(has_torch(), "torch and transformers are not installed")
class FsdpOffloadTest(unittest.TestCase):
    def test_shards_gradients_and_states_stay_on_the_host_and_each_unshard_copies_in(self):
        spec = json.loads(json.dumps(FSDP_MP))
        spec["parallel"]["offload_params"] = True
        doc = traced(spec)
        kinds = Counter(s["kind"] for s in doc["storages"])
        self.assertNotIn("gradient", kinds)
        self.assertNotIn("optimizer_state", kinds)
        # The only device parameters are the unsharded ones each unshard gathers; the shards the
        # load makes stay on the host.
        load_end = doc["phases"][1]["event"]
        loaded = {e[1] for e in doc["events"][:load_end] if e[0] == "alloc"}
        self.assertFalse([i for i in loaded if doc["storages"][i]["kind"] == "parameter"])
        self.assertTrue(any(doc["storages"][i]["kind"] == "host" for i in loaded))
        layer, root = tiny_parameter_numels()
        # The host shard's fp32 device copy, on the copy-in stream, once per parameter and unshard.
        copies = sum(s["bytes"] for s in doc["storages"] if s.get("stream") == 1 and s["op"] == "aten.clone.default")
        self.assertEqual(copies, 4 * 3 * 2 * (2 * (layer // WORLD) + root // WORLD))
