"""Generation's decode layers replayed from the step's first layer (trace_decode.py): the trace is
the one running every layer writes, and a layer built differently runs for real."""

import tempfile
import unittest
from unittest import mock

from .test_trace_trl import has_trl

# Qwen2 with its last two layers on sliding-window attention: their cache layers
# (`DynamicSlidingWindowLayer`) and attention settings differ from the first two.
SPEC = {
    "trainer": "trl-grpo",
    "model": "tiny-qwen2",
    "model_config": {
        "model_type": "qwen2", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 2048,
        "use_sliding_window": True, "sliding_window": 64, "max_window_layers": 2,
    },
    "precision": "bf16", "batch_size": 4, "num_generations": 4, "prompt_len": 16, "completion_len": 8,
    "beta": 0.04, "max_steps": 2,
}  # fmt: skip


@unittest.skipUnless(has_trl(), "torch, transformers and trl are not installed")
class DecodeReplayTest(unittest.TestCase):
    def trace(self):
        from headroom_measure import spec as specmod
        from headroom_measure import trainers
        from headroom_measure.trace import read_trace, trace

        ts = trainers.parse(SPEC)
        with tempfile.TemporaryDirectory() as tmp:
            # the file, not the returned document, whose lists later frees still append to
            trace(ts, specmod.resolve_model_config(ts.base, None), f"{tmp}/t.json")
            return read_trace(f"{tmp}/t.json")

    def test_replayed_layers_write_the_trace_every_layer_run_writes(self):
        from headroom_measure.trace_decode import DecodeLayerReplay

        replayed = []
        real_replay = DecodeLayerReplay._replay

        def counting(self, *args):
            replayed.append(args[0]._headroom_name)
            return real_replay(self, *args)

        with mock.patch.object(DecodeLayerReplay, "_replay", counting):
            fast = self.trace()
        with mock.patch.object(DecodeLayerReplay, "_decode_site", lambda *_: None):
            full = self.trace()
        # each generation's decode steps (every token after the prompt's) replay layer 1, the
        # twin of layer 0; the sliding-window layers 2 and 3 run for real
        steps, tokens = SPEC["max_steps"], SPEC["completion_len"]
        self.assertEqual(set(replayed), {"model.layers.1"})
        self.assertEqual(len(replayed), steps * (tokens - 1))
        for key in ("phases", "storages", "events"):
            self.assertEqual(fast[key], full[key], key)
        self.assertEqual(fast["env"]["scalar_reads"], full["env"]["scalar_reads"])
        layer1 = [s for s in fast["storages"] if s["module"].startswith("model.layers.1.")]
        self.assertTrue(any(s["op"] == "aten.cat.default" for s in layer1))  # its keys and values
