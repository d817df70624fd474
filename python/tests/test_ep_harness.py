"""The expert-parallel harness on the CPU (torch's fake process group, rank 0 of the world): transformers'
`base_model_ep_plan` through `maybe_distribute_model` runs three steps, each expert stack a `Shard(0)` DTensor of
`num_experts / ep` experts, the count global; LoRA off the experts counts the base model in `params`; and the
spec's checks of the layout (bench/ep/README.md)."""

import json
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

from headroom_measure.spec import SpecError, parse
from tests.test_tp_harness import env, has_torch

CONFIG = {
    "model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
    "num_experts_per_tok": 2, "vocab_size": 512, "max_position_embeddings": 256, "tie_word_embeddings": False,
}  # fmt: skip


def spec(ep: int, **extra) -> dict:
    return {
        "model": "tiny-qwen3-moe", "model_config": CONFIG, "precision": "bf16", "optimizer": "adamw-forloop",
        "batch_size": 2, "seq_len": 32, "parallel": {"strategy": "none", "world_size": ep, "ep": ep}, **extra,
    }  # fmt: skip


def run(value: dict, world: int) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "spec.json"
        path.write_text(json.dumps(value))
        out = Path(tmp) / "rows.jsonl"
        proc = subprocess.run(
            [sys.executable, "-m", "headroom_measure", "dist", str(path), "--out", str(out)],
            capture_output=True, text=True, env=env(world), timeout=600,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        return json.loads(out.read_text().splitlines()[0])


class ExpertParallelSpecTest(unittest.TestCase):
    def test_layouts_it_measures(self):
        self.assertEqual(parse(spec(4)).parallel.ep, 4)
        for bad in (
            {**spec(4), "parallel": {"strategy": "fsdp", "world_size": 4, "ep": 4}},
            {**spec(4), "parallel": {"strategy": "none", "world_size": 8, "ep": 4}},
            {**spec(4), "optimizer": "adamw"},
        ):
            with self.assertRaises(SpecError):
                parse(bad)


@unittest.skipUnless(has_torch(), "torch and transformers are not installed")
class ExpertParallelHarnessTest(unittest.TestCase):
    def test_three_steps_with_a_share_of_the_experts(self):
        record = run(spec(4), 4)
        self.assertEqual(record["env"]["process_group"], "fake")
        self.assertEqual(record["spec"]["parallel"]["ep"], 4)
        self.assertEqual(len(record["measured"]["ranks"][0]["steps"]), 3)
        h, i, e, v = 64, 32, 8, 512
        attention = 4 * 16 * h + 2 * (2 * 16 * h) + h * 4 * 16 + 2 * 16
        layer = attention + e * 3 * h * i + e * h + 2 * h
        self.assertEqual(record["measured"]["params"], 2 * v * h + 2 * layer + h)

    def test_lora_counts_the_base_model(self):
        lora = {"r": 4, "alpha": 8, "targets": ["q_proj"], "dropout": 0.0}
        record = run(spec(2, lora=lora, optimizer="adamw"), 2)
        h, i, e, v = 64, 32, 8, 512
        attention = 4 * 16 * h + 2 * (2 * 16 * h) + h * 4 * 16 + 2 * 16
        layer = attention + e * 3 * h * i + e * h + 2 * h
        self.assertEqual(record["measured"]["params"], 2 * v * h + 2 * layer + h)
        self.assertEqual(record["measured"]["trainable_params"], 2 * 4 * (h + 4 * 16))


if __name__ == "__main__":
    unittest.main()
