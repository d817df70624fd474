"""The tracer on FSDP1 (trace_fsdp1.py): rank 0 of a fake world running the harness's
`FullyShardedDataParallel` on the CPU. Each unit's flat parameter, built whole at construction,
is freed when `shard()` resizes it away; every unshard allocates the whole unit on the unshard
stream; and the flat gradient is concatenated there too, as the autograd engine runs the views'
backward on the stream their forward ran on."""

import unittest

from .test_trace import TINY, has_torch
from .test_trace_dist import tiny_parameter_numels, traced


def fsdp1(use_orig_params):
    return {**TINY, "parallel": {"strategy": "fsdp1", "world_size": 2, "use_orig_params": use_orig_params}}


@unittest.skipUnless(has_torch(), "torch and transformers are not installed")
class Fsdp1Test(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.docs = {flag: traced(fsdp1(flag)) for flag in (True, False)}

    def test_each_units_whole_flat_parameter_is_freed_when_it_is_sharded(self):
        for flag, doc in self.docs.items():
            events, storages = doc["events"], doc["storages"]
            forward = next(p["event"] for p in doc["phases"] if p["name"] == "step 1 forward")
            freed = {e[1]: i for i, e in enumerate(events) if e[0] == "free"}
            built = [e[1] for e in events[:forward] if e[0] == "alloc" and storages[e[1]]["op"] == "aten.cat.default"]
            self.assertEqual(len(built), 3, flag)  # two decoder layers and the root
            self.assertTrue(all(freed.get(sid, len(events)) < forward for sid in built), flag)

    def test_flat_gradients_are_concatenated_on_the_unshard_stream(self):
        for flag, doc in self.docs.items():
            storages = doc["storages"]
            # The unsharded units: allocated by resizing their storage, on the unshard stream.
            unsharded = {(s["bytes"], s.get("stream", 0)) for s in storages if s["op"] == "fsdp1 _alloc_storage"}
            streams = {stream for _, stream in unsharded}
            self.assertEqual(len(streams), 1, flag)
            self.assertNotIn(0, streams)
            sizes = {size for size, _ in unsharded}
            backward = [p for p in doc["phases"] if p["name"].endswith("backward")]
            ends = {p["event"]: doc["phases"][doc["phases"].index(p) + 1]["event"] for p in backward}
            grads = [
                storages[e[1]] for start, end in ends.items() for e in doc["events"][start:end]
                if e[0] == "alloc" and storages[e[1]]["op"] == "aten.cat.default" and storages[e[1]]["bytes"] in sizes
            ]  # fmt: skip
            self.assertEqual(len(grads), 3 * 3, flag)  # three units, three steps
            self.assertEqual({g.get("stream", 0) for g in grads}, streams, flag)


@unittest.skipUnless(has_torch(), "torch and transformers are not installed")
class Fsdp1OffloadTest(unittest.TestCase):
    """`offload_params` under bf16 mixed precision: each unit's fp32 shard lives on the host, each
    unshard copies it to the device in full precision before the cast, and each reduced
    gradient shard goes back to the host, where the optimizer steps."""

    WORLD = 2

    @classmethod
    def setUpClass(cls):
        mixed = {"param_dtype": "bf16", "reduce_dtype": "fp32", "buffer_dtype": None, "cast_forward_inputs": False}
        parallel = {"strategy": "fsdp1", "world_size": cls.WORLD, "offload_params": True, "mixed_precision": mixed}
        cls.doc = traced({**TINY, "precision": "fp32", "parallel": parallel})

    def phase(self, name):
        phases = self.doc["phases"]
        k = next(k for k, p in enumerate(phases) if p["name"] == name)
        end = phases[k + 1]["event"] if k + 1 < len(phases) else len(self.doc["events"])
        return [self.doc["storages"][e[1]] for e in self.doc["events"][phases[k]["event"] : end] if e[0] == "alloc"]

    def test_shards_live_on_the_host_and_each_unshard_copies_one_in_full_precision(self):
        layer, _ = tiny_parameter_numels()
        shard = 4 * layer // self.WORLD  # a decoder layer's fp32 shard (no padding at this size)
        host = [s for s in self.phase("load") if s["kind"] == "host" and s["bytes"] == shard]
        self.assertEqual(len(host), 2, "each layer's shard moved to the host")
        forward = self.phase("step 2 forward")
        copies = [s for s in forward if s["op"] == "aten.clone.default" and s["bytes"] == shard]
        self.assertEqual(len(copies), 2, "one per decoder layer")
        self.assertTrue(all(s["kind"] != "host" for s in copies))
        low = [s for s in forward if s["op"] == "fsdp1 _alloc_storage" and s["bytes"] == shard // 2]
        self.assertEqual(len(low), 2, "the bf16 shards the copies are cast into")

    def test_gradients_and_the_optimizer_step_stay_on_the_host(self):
        stepped = self.phase("step 2 optimizer")
        self.assertTrue(stepped)
        self.assertEqual({s["kind"] for s in stepped}, {"host"})
        # The gradient writeback's `zeros_like` of a host flat parameter is host memory.
        writeback = [s for s in self.doc["storages"] if s["op"] == "aten.zeros_like.default" and s["kind"] != "host"]
        layer, root = tiny_parameter_numels()
        self.assertFalse([s for s in writeback if s["bytes"] in (4 * layer // self.WORLD, 4 * root // self.WORLD)])
