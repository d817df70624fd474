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
