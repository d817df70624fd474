"""The pipeline-parallel harness (pp.py) on the CPU under torch's fake process group: each schedule runs its
three steps as the first and as the last rank of the pipeline, the last rank computes the losses, and the
rows round-trip through the spec (bench/pp/README.md)."""

import json
import os
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

from headroom_measure import spec as specmod

PYTHON_DIR = Path(__file__).resolve().parents[1]
CONFIG = {
    "model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256,
    "tie_word_embeddings": False,
}  # fmt: skip


def has_torch() -> bool:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def spec(parallel: dict, gc: bool = False) -> dict:
    return {
        "model": "tiny-llama", "model_config": CONFIG, "precision": "bf16", "optimizer": "adamw",
        "batch_size": 4, "seq_len": 32, "gradient_checkpointing": gc, "parallel": parallel,
    }  # fmt: skip


@unittest.skipUnless(has_torch(), "needs torch and transformers")
class PipelineHarness(unittest.TestCase):
    def run_rank(self, raw: dict, rank: int) -> dict:
        world = raw["parallel"]["world_size"]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(PYTHON_DIR), os.environ.get("PYTHONPATH", "")]))
        env.update(
            HEADROOM_DIST_CPU="1", HEADROOM_FAKE_WORLD=str(world), HEADROOM_FAKE_RANK=str(rank),
            WORLD_SIZE=str(world), RANK="0", LOCAL_RANK="0",
        )  # fmt: skip
        with tempfile.TemporaryDirectory() as d:
            out = Path(d) / "rows.jsonl"
            args = ["-m", "headroom_measure", "dist", "--spec-json", json.dumps(raw), "--out", str(out)]
            done = subprocess.run([sys.executable, *args], env=env, capture_output=True, text=True, timeout=300)
            self.assertEqual(done.returncode, 0, done.stderr[-2000:])
            return json.loads(out.read_text().splitlines()[0])

    def test_every_schedule_runs_as_the_first_and_the_last_rank(self):
        for parallel, gc in [
            ({"strategy": "none", "world_size": 2, "pp": 2, "microbatches": 4}, False),
            ({"strategy": "none", "world_size": 2, "pp": 2, "schedule": "interleaved-1f1b", "microbatches": 2}, True),
            ({"strategy": "none", "world_size": 2, "pp": 2, "schedule": "gpipe", "microbatches": 2,
              "layers_per_stage": [3, 1]}, False),
        ]:  # fmt: skip
            raw = spec(parallel, gc)
            for rank in (0, 1):
                row = self.run_rank(raw, rank)
                measured = row["measured"]["ranks"][0]
                self.assertEqual(measured["rank"], rank)
                self.assertEqual(len(measured["steps"]), 3)
                self.assertTrue(all("step_peak" in s and "opt_peak" in s for s in measured["steps"]))
                # Only the last rank computes a loss. The fake group moves nothing, so the last stage
                # reads its receive buffers as torch.empty left them and its loss may be non-finite
                # (written as None): only the first rank's are None by construction.
                self.assertEqual(len(measured["losses"]), 3)
                if rank == 0:
                    self.assertTrue(all(v is None for v in measured["losses"]), parallel)
                self.assertEqual(row["env"]["process_group"], "fake")
                # The whole model's parameters, whatever the rank holds.
                self.assertEqual(row["measured"]["params"], 4 * 36992 + 2 * 256 * 64 + 64)
                # The row's spec reads back as it was written.
                self.assertEqual(specmod.parse(row["spec"]).parallel.to_json(), row["spec"]["parallel"])

    def test_fsdp_stages_run_as_the_first_and_the_last_pipeline_rank(self):
        """PP x FSDP2 (x TP): a (pp, dp[, tp]) mesh, each stage fully_shard-ed over dp; the first and the last
        rank of the world are the first stage's and the last's (pp outermost)."""
        for parallel in [
            {"strategy": "fsdp", "world_size": 4, "pp": 2, "microbatches": 4, "reshard_after_forward": False},
            {"strategy": "fsdp", "world_size": 4, "pp": 2, "schedule": "interleaved-1f1b", "microbatches": 2,
             "units": "accelerate", "mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"}},
            {"strategy": "fsdp", "world_size": 8, "pp": 2, "tp": 2, "microbatches": 4},
        ]:  # fmt: skip
            raw = spec(parallel)
            if "mixed_precision" in parallel:
                raw["precision"] = "fp32"
            last = parallel["world_size"] - 1
            for rank in (0, last):
                row = self.run_rank(raw, rank)
                measured = row["measured"]["ranks"][0]
                self.assertEqual(len(measured["steps"]), 3)
                self.assertEqual(all(v is not None for v in measured["losses"][:1]), rank == last, parallel)
                self.assertEqual(row["measured"]["params"], 4 * 36992 + 2 * 256 * 64 + 64)
                self.assertEqual(specmod.parse(row["spec"]).parallel.to_json(), row["spec"]["parallel"])


class PipelineSpec(unittest.TestCase):
    def test_bad_layouts_name_the_field(self):
        for parallel, field in [
            ({"strategy": "none", "world_size": 3, "pp": 2}, "parallel.pp"),
            ({"strategy": "ddp", "world_size": 2, "pp": 2}, "parallel.pp"),
            ({"strategy": "none", "world_size": 4, "pp": 2}, "parallel.world_size"),
            ({"strategy": "fsdp", "world_size": 8, "pp": 2, "tp": 2, "sequence_parallel": True},
             "parallel.sequence_parallel"),
            ({"strategy": "none", "world_size": 2, "pp": 2, "schedule": "zb"}, "parallel.schedule"),
            ({"strategy": "none", "world_size": 2, "pp": 2, "microbatches": 1}, "parallel.microbatches"),
            ({"strategy": "none", "world_size": 2, "pp": 2, "vpp": 2}, "parallel.vpp"),
            ({"strategy": "none", "world_size": 2, "pp": 2, "layers_per_stage": [4]}, "parallel.layers_per_stage"),
            ({"strategy": "ddp", "world_size": 2, "microbatches": 2}, "parallel.microbatches"),
        ]:  # fmt: skip
            with self.assertRaises(specmod.SpecError, msg=str(parallel)) as caught:
                specmod.parse(spec(parallel))
            self.assertIn(field, str(caught.exception))


if __name__ == "__main__":
    unittest.main()
