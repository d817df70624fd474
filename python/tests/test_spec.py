"""The harness reads the same run spec as `headroom estimate`: defaults, validation, model lookup."""

import json
import tempfile
import unittest
from pathlib import Path

from headroom_measure import spec as specmod
from headroom_measure.__main__ import DEFAULT_CATALOG, load_catalog

REPO = Path(__file__).resolve().parents[2]


class ParseTest(unittest.TestCase):
    def test_defaults_follow_the_calibration_readme(self):
        s = specmod.parse({"model": "qwen2.5-0.5b"})
        self.assertEqual(
            (s.task, s.mode, s.precision, s.optimizer, s.attention, s.gradient_checkpointing),
            ("causal-lm", "train", "amp-bf16", "adamw", "sdpa", False),
        )
        self.assertIsNone(s.lora)
        self.assertFalse(s.expandable_segments)

    def test_forward_mode_has_no_optimizer_unless_given(self):
        self.assertEqual(specmod.parse({"model": "m", "mode": "forward"}).optimizer, "none")
        self.assertEqual(
            specmod.parse({"model": "m", "mode": "forward", "optimizer": "sgd"}).optimizer, "sgd"
        )

    def test_lora_and_quantization(self):
        s = specmod.parse(
            {
                "model": "m",
                "quantization": "nf4",
                "kbit_prepare": True,
                "lora": {"r": 16, "alpha": 32, "targets": ["q_proj", "v_proj"], "dropout": 0.05},
            }
        )
        self.assertEqual((s.lora.r, s.lora.alpha, s.lora.targets), (16, 32.0, ["q_proj", "v_proj"]))
        self.assertEqual((s.quantization, s.kbit_prepare), ("nf4", True))

    def test_bad_values_name_the_field_the_value_and_what_is_allowed(self):
        cases = [
            ({"model": "m", "batch_size": 0}, ["batch_size", "0", ">= 1"]),
            ({"model": "m", "seq_len": -5}, ["seq_len", "-5", ">= 1"]),
            ({"model": "m", "batch_size": True}, ["batch_size", "True"]),
            ({"model": "m", "precision": "fp8"}, ["precision", "fp8", "amp-bf16"]),
            ({"model": "m", "optimizer": "adam"}, ["optimizer", "adam", "adamw-fused"]),
            ({"model": "m", "attention": "flash"}, ["attention", "flash", "sdpa"]),
            ({"model": "m", "quantization": "int8"}, ["quantization", "int8", "nf4"]),
            ({"model": "m", "kbit_prepare": True}, ["kbit_prepare", "nf4"]),
            ({"model": "m", "lora": {"targets": 3}}, ["lora.targets", "3", "all-linear"]),
            ({"model": "m", "allocator": {"garbage": 1}}, ["allocator", "expandable_segments"]),
            ({"model": "m", "gradient_checkpointing": "yes"}, ["gradient_checkpointing", "yes", "true"]),
            ({"model": "m", "batchsize": 2}, ["batchsize", "batch_size"]),
            ({"model": "m", "experts_implementation": "fast"}, ["experts_implementation", "fast", "grouped_mm"]),
            ({"model": "m", "routing": {"max_tokens_per_expert_factor": 0}}, ["routing", "0", ">= 1.0"]),
            (
                {"model": "m", "lora": {"target_parameters": ["mlp.experts.down_proj"], "dropout": 0.1}},
                ["lora.dropout", "0.1", "target_parameters"],
            ),
            ({"model": "m", "lora": {"targets": []}}, ["lora.targets", "[]", "target_parameters"]),
            ({"precision": "bf16"}, ["model"]),
        ]
        for raw, words in cases:
            with self.subTest(raw=raw):
                with self.assertRaises(specmod.SpecError) as ctx:
                    specmod.parse(raw)
                for word in words:
                    self.assertIn(word, str(ctx.exception))

    def test_to_json_round_trips(self):
        raw = {
            "model": "m",
            "precision": "bf16",
            "optimizer": "adamw-8bit",
            "batch_size": 4,
            "seq_len": 2048,
            "gradient_checkpointing": True,
            "lora": {"r": 8, "alpha": 16, "targets": "all-linear", "dropout": 0.0},
            "allocator": {"expandable_segments": True},
        }
        once = specmod.parse(raw).to_json()
        self.assertEqual(specmod.parse(once).to_json(), once)
        self.assertEqual(once["allocator"], {"expandable_segments": True})

    def test_moe_keys_round_trip(self):
        raw = {
            "model": "m",
            "precision": "bf16",
            "experts_implementation": "eager",
            "routing": {"max_tokens_per_expert_factor": 1.5},
            "lora": {"r": 8, "alpha": 16, "targets": [], "target_parameters": ["mlp.experts.gate_up_proj"]},
        }
        once = specmod.parse(raw).to_json()
        self.assertEqual(
            (once["experts_implementation"], once["routing"], once["lora"]["target_parameters"]),
            ("eager", {"max_tokens_per_expert_factor": 1.5}, ["mlp.experts.gate_up_proj"]),
        )
        self.assertEqual(specmod.parse(once).to_json(), once)

    def test_every_committed_corpus_spec_parses(self):
        # The corpus was measured by this harness: its specs must still be accepted.
        for line in (REPO / "bench" / "calibration" / "specs.jsonl").read_text().splitlines():
            row = json.loads(line)
            with self.subTest(id=row["id"]):
                specmod.parse(row["spec"])


class ModelConfigTest(unittest.TestCase):
    def test_catalog_name(self):
        catalog = load_catalog(None)
        self.assertEqual(Path(DEFAULT_CATALOG).name, "models.json")
        fields = specmod.resolve_model_config(specmod.parse({"model": "qwen2.5-0.5b"}), catalog)
        self.assertEqual(fields["hidden_size"], 896)

    def test_inline_config_wins(self):
        s = specmod.parse({"model": "anything", "model_config": {"hidden_size": 64}})
        self.assertEqual(specmod.resolve_model_config(s, {}), {"hidden_size": 64})

    def test_config_file_and_folder(self):
        with tempfile.TemporaryDirectory() as d:
            (Path(d) / "config.json").write_text(json.dumps({"hidden_size": 128}))
            for model in (d, str(Path(d) / "config.json")):
                s = specmod.parse({"model": model})
                self.assertEqual(specmod.resolve_model_config(s, {})["hidden_size"], 128)

    def test_gpt_oss_needs_eager_attention(self):
        catalog = load_catalog(None)
        with self.assertRaises(specmod.SpecError) as ctx:
            specmod.resolve_model_config(specmod.parse({"model": "gpt-oss-20b", "attention": "sdpa"}), catalog)
        self.assertIn("gpt_oss runs eager attention only", str(ctx.exception))
        s = specmod.parse({"model": "gpt-oss-20b", "attention": "eager"})
        self.assertEqual(specmod.resolve_model_config(s, catalog)["num_local_experts"], 32)

    def test_unknown_model(self):
        with self.assertRaises(specmod.SpecError) as ctx:
            specmod.resolve_model_config(specmod.parse({"model": "no-such-model"}), {"a": {}})
        self.assertIn("no-such-model", str(ctx.exception))


if __name__ == "__main__":
    unittest.main()
