"""transformers' own tensor parallelism in the harness (`parallel.framework: transformers`) on the CPU
(torch's fake process group, rank 0 of the world): it builds the config's `base_model_tp_plan` through
`maybe_distribute_model` and runs the three steps; the placements and the gathered logits the estimator's
model rests on hold (bench/tp-hf/README.md); the spec reader refuses what the plan cannot run."""

import json
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

from headroom_measure import spec as specmod

from .test_tp_harness import CONFIG, env, has_torch


def spec(parallel: dict, **extra) -> dict:
    return {
        "model": "tiny-qwen2", "model_config": CONFIG, "precision": "bf16", "optimizer": "adamw-forloop",
        "batch_size": 2, "seq_len": 32, "parallel": parallel, **extra,
    }  # fmt: skip


TP2 = {"strategy": "none", "world_size": 2, "tp": 2, "framework": "transformers"}

# Builds the layout in a fresh process and prints each parameter's placements and local shape, the
# logits' shape, and each gradient's placements after one backward.
PROBE = """
import json, sys, torch, torch.distributed as dist, transformers
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.distributed.tensor import DTensor
from headroom_measure import spec as specmod, dist as hd
raw = json.loads(sys.argv[1])
s = specmod.parse(raw)
dist.init_process_group("fake", rank=0, world_size=s.parallel.world_size, store=FakeStore())
cfg = hd._hf_config(s, raw["model_config"])
model, _ = hd._build_transformers_plan(s, cfg, transformers.AutoModelForCausalLM, torch.bfloat16, torch.device("cpu"))
ids = torch.randint(0, cfg.vocab_size, (2, 32))
out = model(input_ids=ids, labels=ids)
out.loss.backward()
def describe(t):
    if isinstance(t, DTensor):
        return [repr(p) for p in t.placements], list(t.to_local().shape)
    return None, list(t.shape)
params = {n: [describe(p), describe(p.grad)] for n, p in model.named_parameters()}
print(json.dumps({"params": params, "logits": [type(out.logits).__name__, list(out.logits.shape)]}))
"""


class SpecTest(unittest.TestCase):
    def test_refusals_name_the_field(self):
        cases = [
            ({**TP2, "strategy": "fsdp", "world_size": 4}, {}, "parallel.framework"),
            ({**TP2, "world_size": 4}, {}, "parallel.framework"),
            ({**TP2, "sequence_parallel": True}, {}, "parallel.sequence_parallel"),
            (TP2, {"optimizer": "adamw"}, "optimizer"),
            (TP2, {"lora": {"r": 8, "targets": ["q_proj"]}}, "lora"),
        ]
        for parallel, extra, field in cases:
            with self.subTest(parallel=parallel, extra=extra):
                with self.assertRaises(specmod.SpecError) as err:
                    specmod.parse(spec(parallel, **extra))
                self.assertIn(field, str(err.exception))

    def test_the_layout_is_read(self):
        parsed = specmod.parse(spec(TP2))
        self.assertEqual((parsed.parallel.framework, parsed.parallel.tp), ("transformers", 2))


@unittest.skipUnless(has_torch(), "torch and transformers are not installed")
class HarnessTest(unittest.TestCase):
    def test_three_steps(self):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "spec.json"
            path.write_text(json.dumps(spec(TP2)))
            out = Path(tmp) / "rows.jsonl"
            proc = subprocess.run(
                [sys.executable, "-m", "headroom_measure", "dist", str(path), "--out", str(out)],
                capture_output=True, text=True, env=env(2), timeout=600,
            )  # fmt: skip
            self.assertEqual(proc.returncode, 0, proc.stderr[-2000:])
            record = json.loads(out.read_text().splitlines()[0])
        self.assertEqual(record["spec"]["parallel"]["framework"], "transformers")
        self.assertEqual(len(record["measured"]["ranks"][0]["steps"]), 3)
        h, kv, i, v = 128, 64, 256, 512
        layer = (h * h + h) + 2 * (kv * h + kv) + h * h + 3 * h * i + 2 * h
        self.assertEqual(record["measured"]["params"], 2 * v * h + layer + h)

    def test_placements_the_estimate_models(self):
        proc = subprocess.run(
            [sys.executable, "-c", PROBE, json.dumps(spec(TP2))], capture_output=True, text=True, env=env(2),
            timeout=600,
        )  # fmt: skip
        self.assertEqual(proc.returncode, 0, proc.stderr[-2000:])
        probe = json.loads(proc.stdout.strip().splitlines()[-1])
        params = probe["params"]
        # The embedding and the norms are plain tensors of every row, their gradients too.
        self.assertEqual(params["model.embed_tokens.weight"], [[None, [512, 128]], [None, [512, 128]]])
        self.assertEqual(params["model.norm.weight"][0], [None, [128]])
        (placement, local), _ = params["model.layers.0.self_attn.q_proj.weight"]
        self.assertEqual((placement, local), (["Shard(dim=0)"], [64, 128]))
        (placement, local), _ = params["model.layers.0.self_attn.q_proj.bias"]
        self.assertEqual((placement, local), (["Shard(dim=0)"], [64]))
        (placement, local), _ = params["model.layers.0.mlp.down_proj.weight"]
        self.assertEqual((placement, local), (["Shard(dim=1)"], [128, 128]))
        (placement, local), (grad_placement, grad_local) = params["lm_head.weight"]
        self.assertEqual((placement, local, grad_placement, grad_local), (["Shard(dim=0)"], [256, 128]) * 2)
        # The head's logits reach the loss whole: a plain tensor of every vocabulary column.
        self.assertEqual(probe["logits"], ["Tensor", [2, 32, 512]])


if __name__ == "__main__":
    unittest.main()
