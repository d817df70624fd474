"""Trainer specs (headroom_measure.trainers): parsing and validation, which need no torch."""

import contextlib
import io
import json
import tempfile
import unittest
from pathlib import Path

from headroom_measure import spec as specmod
from headroom_measure import trainers

REPO = Path(__file__).resolve().parents[2]


class TrainerSpecTest(unittest.TestCase):
    def test_trainer_defaults(self):
        ts = trainers.parse({"trainer": "trl-sft", "model": "qwen2.5-0.5b"})
        self.assertTrue(ts.base.gradient_checkpointing)  # TRL's default
        self.assertEqual(ts.base.optimizer, "adamw-fused")  # TrainingArguments' default
        self.assertEqual((ts.max_steps, ts.gradient_accumulation_steps), (3, 1))
        self.assertFalse(trainers.parse({"trainer": "hf", "model": "m"}).base.gradient_checkpointing)
        self.assertEqual(trainers.parse({"trainer": "trl-reward", "model": "m"}).base.task, "seq-cls")

    def test_dpo_keys(self):
        ts = trainers.parse({"trainer": "trl-dpo", "model": "m", "seq_len": 1024, "reference": {"precision": "bf16"}})
        self.assertEqual((ts.prompt_len, ts.beta, ts.reference_precision), (256, 0.1, "bf16"))
        self.assertEqual(ts.to_json()["reference"], {"precision": "bf16"})
        with self.assertRaisesRegex(specmod.SpecError, "prompt_len"):
            trainers.parse({"trainer": "trl-dpo", "model": "m", "seq_len": 100, "prompt_len": 99})
        with self.assertRaisesRegex(specmod.SpecError, "reference.precision"):
            trainers.parse({"trainer": "trl-dpo", "model": "m", "reference": {"precision": "fp8"}})
        with self.assertRaisesRegex(specmod.SpecError, "choose one"):
            trainers.parse(
                {"trainer": "trl-dpo", "model": "m", "reference": {}, "precompute_ref_log_probs": True}
            )

    def test_grpo_keys(self):
        raw = {"trainer": "trl-grpo", "model": "m", "batch_size": 8, "num_generations": 4, "prompt_len": 64,
               "completion_len": 128}
        ts = trainers.parse(raw)
        self.assertEqual(ts.beta, 0.0)
        self.assertNotIn("seq_len", ts.to_json())
        with self.assertRaisesRegex(specmod.SpecError, "divisible by num_generations"):
            trainers.parse(dict(raw, batch_size=6))
        with self.assertRaisesRegex(specmod.SpecError, "completion_len` is required"):
            trainers.parse({k: v for k, v in raw.items() if k != "completion_len"})
        with self.assertRaisesRegex(specmod.SpecError, "seq_len"):
            trainers.parse(dict(raw, seq_len=512))
        with self.assertRaisesRegex(specmod.SpecError, "num_generations"):
            trainers.parse(dict(raw, num_generations=1))

    def test_keys_of_another_trainer_are_refused(self):
        with self.assertRaisesRegex(specmod.SpecError, "`num_generations` is not a key of trainer trl-dpo"):
            trainers.parse({"trainer": "trl-dpo", "model": "m", "num_generations": 4})
        with self.assertRaisesRegex(specmod.SpecError, "`reference` is not a key of trainer hf"):
            trainers.parse({"trainer": "hf", "model": "m", "reference": {}})
        with self.assertRaisesRegex(specmod.SpecError, "trainer"):
            trainers.parse({"trainer": "ppo", "model": "m"})
        with self.assertRaisesRegex(specmod.SpecError, "not a run-spec key"):
            trainers.parse({"trainer": "hf", "model": "m", "bogus": 1})
        with self.assertRaisesRegex(specmod.SpecError, "precision"):
            trainers.parse({"trainer": "hf", "model": "m", "precision": "amp-fp16"})
        with self.assertRaisesRegex(specmod.SpecError, "quantization"):
            trainers.parse({"trainer": "hf", "model": "m", "quantization": "nf4"})

    def test_ids_are_distinct_and_stable(self):
        a = trainers.default_id(trainers.parse({"trainer": "trl-dpo", "model": "m", "lora": {"r": 8}}))
        b = trainers.default_id(
            trainers.parse({"trainer": "trl-dpo", "model": "m", "lora": {"r": 8}, "reference": {}})
        )
        self.assertEqual(a, "trl-dpo/m/amp_bf16/bs1/s512/gc/lora8/noref")
        self.assertNotEqual(a, b)

    def test_corpus_specs_validate(self):
        specs = REPO / "bench" / "trainers" / "specs.jsonl"
        if not specs.is_file():
            self.skipTest("no bench/trainers/specs.jsonl")
        with contextlib.redirect_stdout(io.StringIO()) as out:
            self.assertEqual(trainers.main(["check", str(specs)]), 0)
        self.assertEqual(out.getvalue().count("ok   "), len(specs.read_text().splitlines()))

    def test_run_exits_2_on_a_bad_spec(self):
        with tempfile.TemporaryDirectory() as d:
            path = Path(d) / "s.json"
            path.write_text(json.dumps({"trainer": "trl-grpo", "model": "qwen2.5-0.5b"}))
            with contextlib.redirect_stderr(io.StringIO()) as err:
                self.assertEqual(trainers.main(["run", str(path)]), 2)
            self.assertIn("prompt_len` is required", err.getvalue())


if __name__ == "__main__":
    unittest.main()
