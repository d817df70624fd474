"""The tensor-parallel harness on the CPU (torch's fake process group, rank 0 of the world): it
builds torchtitan's plan (optionally under FSDP2 over the data-parallel dimension) and runs the
three steps; and the placements the estimator's model rests on hold (bench/tp/README.md)."""

import json
import os
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

PYTHON_DIR = Path(__file__).resolve().parents[1]
CONFIG = {
    "model_type": "qwen2", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 1,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}  # fmt: skip


def has_torch() -> bool:
    try:
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def spec(parallel: dict) -> dict:
    return {
        "model": "tiny-qwen2", "model_config": CONFIG, "precision": "bf16", "optimizer": "adamw",
        "batch_size": 2, "seq_len": 32, "parallel": parallel,
    }  # fmt: skip


def env(world: int) -> dict:
    out = dict(os.environ, PYTHONPATH=os.pathsep.join([str(PYTHON_DIR), os.environ.get("PYTHONPATH", "")]))
    out.update(HEADROOM_DIST_CPU="1", HEADROOM_FAKE_WORLD=str(world), WORLD_SIZE=str(world), RANK="0", LOCAL_RANK="0")
    return out


# Builds the layout in a fresh process and prints each parameter's placements and local shape, and
# its gradient's after one backward under loss_parallel.
PROBE = """
import json, sys, torch, torch.distributed as dist, transformers
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import loss_parallel
from headroom_measure import spec as specmod, dist as hd
raw = json.loads(sys.argv[1])
s = specmod.parse(raw)
dist.init_process_group("fake", rank=0, world_size=s.parallel.world_size, store=FakeStore())
cfg = hd._hf_config(s, raw["model_config"])
model, _ = hd._build_torchtitan(s, cfg, transformers.AutoModelForCausalLM, torch.bfloat16, torch.device("cpu"))
ids = torch.randint(0, cfg.vocab_size, (2, 32))
with loss_parallel():
    model(input_ids=ids, labels=ids).loss.backward()
def describe(t):
    if isinstance(t, DTensor):
        return [repr(p) for p in t.placements], list(t.to_local().shape)
    return None, list(t.shape)
print(json.dumps({n: [describe(p), describe(p.grad)] for n, p in model.named_parameters()}))
"""


@unittest.skipUnless(has_torch(), "torch and transformers are not installed")
class TensorParallelHarnessTest(unittest.TestCase):
    def test_three_steps_under_fsdp2_and_sequence_parallelism(self):
        parallel = {"strategy": "fsdp", "world_size": 4, "tp": 2, "sequence_parallel": True}
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "spec.json"
            path.write_text(json.dumps(spec(parallel)))
            out = Path(tmp) / "rows.jsonl"
            proc = subprocess.run(
                [sys.executable, "-m", "headroom_measure", "dist", str(path), "--out", str(out)],
                capture_output=True, text=True, env=env(4), timeout=600,
            )  # fmt: skip
            self.assertEqual(proc.returncode, 0, proc.stderr[-2000:])
            record = json.loads(out.read_text().splitlines()[0])
        self.assertEqual(record["env"]["process_group"], "fake")
        self.assertEqual(record["spec"]["parallel"]["tp"], 2)
        self.assertEqual(record["spec"]["parallel"]["shard_size"], 2)
        self.assertEqual(len(record["measured"]["ranks"][0]["steps"]), 3)
        # DTensors count their global size: the model's parameters, not rank 0's shards.
        h, kv, i, v = 128, 64, 256, 512
        attention = (h * h + h) + 2 * (kv * h + kv) + h * h  # q, k, v with biases; o
        layer = attention + 3 * h * i + 2 * h
        self.assertEqual(record["measured"]["params"], 2 * v * h + layer + h)

    def test_placements_the_estimate_models(self):
        parallel = {"strategy": "none", "world_size": 2, "tp": 2, "sequence_parallel": True}
        proc = subprocess.run(
            [sys.executable, "-c", PROBE, json.dumps(spec(parallel))], capture_output=True, text=True, env=env(2),
            timeout=600,
        )  # fmt: skip
        self.assertEqual(proc.returncode, 0, proc.stderr[-2000:])
        params = json.loads(proc.stdout.strip().splitlines()[-1])
        (placement, local), (grad_placement, grad_local) = params["model.embed_tokens.weight"]
        self.assertEqual((placement, local), (["Shard(dim=0)"], [256, 128]))
        # The embedding's gradient is every rank's rows (Replicate): tp times the shard.
        self.assertEqual((grad_placement, grad_local), (["Replicate()"], [512, 128]))
        (placement, local), _ = params["model.layers.0.self_attn.q_proj.weight"]
        self.assertEqual((placement, local), (["Shard(dim=0)"], [64, 128]))
        (placement, local), _ = params["model.layers.0.mlp.down_proj.weight"]
        self.assertEqual((placement, local), (["Shard(dim=1)"], [128, 128]))
        (placement, _), (grad_placement, _) = params["model.layers.0.input_layernorm.weight"]
        self.assertEqual((placement, grad_placement), (["Replicate()"], ["Partial(sum)"]))
        (placement, local), _ = params["lm_head.weight"]
        self.assertEqual((placement, local), (["Shard(dim=0)"], [256, 128]))


if __name__ == "__main__":
    unittest.main()
