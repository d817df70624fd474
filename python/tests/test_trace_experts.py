"""The per-expert eager loop traced over the routing `headroom estimate` assumes (trace_experts.py)."""

import json
import tempfile
import unittest

from headroom_measure.trace_experts import tokens_per_expert

from .test_trace import TINY, has_torch, run


class TokensPerExpertTest(unittest.TestCase):
    def test_an_even_spread_over_every_expert(self):
        self.assertEqual(tokens_per_expert(16384, 128), [128] * 128)

    def test_fewer_pairs_than_experts_hit_as_many_experts_as_pairs(self):
        self.assertEqual(tokens_per_expert(6, 8), [1] * 6)

    def test_the_busiest_takes_its_factor_and_the_rest_share_what_is_left(self):
        shares = tokens_per_expert(100, 8, 2.0)
        self.assertEqual(shares, [24, 10, 11, 11, 11, 11, 11, 11])
        self.assertEqual(sum(shares), 100)


@unittest.skipUnless(has_torch(), "torch and transformers are not installed")
class EagerLoopTraceTest(unittest.TestCase):
    def test_each_hit_expert_gathers_its_share_of_the_pairs(self):
        from headroom_measure.trace import read_trace

        experts, top_k = 4, 2
        config = {**TINY["model_config"], "model_type": "qwen3_moe", "moe_intermediate_size": 64,
                  "num_experts": experts, "num_experts_per_tok": top_k, "decoder_sparse_step": 1,
                  "mlp_only_layers": []}  # fmt: skip
        spec = {**TINY, "model_config": config, "experts_implementation": "eager",
                "routing": {"max_tokens_per_expert_factor": 1.5}}  # fmt: skip
        with tempfile.TemporaryDirectory() as tmp:
            out = run("trace", "--spec-json", json.dumps(spec), "--out", f"{tmp}/t.json.gz")
            self.assertEqual(out.returncode, 0, out.stderr)
            trace = read_trace(f"{tmp}/t.json.gz")
        pairs = TINY["batch_size"] * TINY["seq_len"] * top_k
        shares = tokens_per_expert(pairs, experts, 1.5)
        self.assertGreater(shares[0], shares[1])
        # Each layer: the hit experts' ids (int64, one column), then each expert's (pair, token) ids.
        per_layer = [experts * 8] + [n * 2 * 8 for n in shares]
        nonzero = [s["bytes"] for s in trace["storages"] if s["op"] == "aten.nonzero.default"]
        layers = config["num_hidden_layers"] * 3  # three steps
        self.assertEqual(nonzero, per_layer * layers)
