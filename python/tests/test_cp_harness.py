"""The context-parallel harness on the CPU (torch's fake process group, rank 0 of the world): torchtitan's
context_parallel around each step under FSDP2 over dp x cp, alone or with tensor parallelism, runs three steps; and
the spec's checks of the layout.

torch's ring has no handler or sharding rule for the CPU's SDPA op (`_scaled_dot_product_flash_attention_for_cpu`),
so the run stands the CUDA flash op in with it inside the ring (bench/cp/README.md): SDPA is called as
`aten._scaled_dot_product_flash_attention`, which the ring dispatches, and the ring's per-step kernel is the CPU one.
The collectives (the keys' and values' all-gather, their gradients' all-to-all) are torch's own."""

import json
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

from tests.test_tp_harness import env, has_torch

CONFIG = {
    "model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}  # fmt: skip

# Runs `python -m headroom_measure dist ARGS...` with the CPU stand-ins for the ring's flash kernel.
RUN_ON_CPU = '''
import runpy, sys, torch
import torch.nn.functional as F
from torch.distributed.tensor.experimental._context_parallel import _attention as A
aten = torch.ops.aten

def groups(q, k):
    return q.size(1) // k.size(1)

def fwd(q, k, v, is_causal, dropout_p=0.0, scale=None, **_):
    g = groups(q, k)
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(
        q, k.repeat_interleave(g, 1), v.repeat_interleave(g, 1), dropout_p, bool(is_causal), scale=scale)
    seed = torch.empty((), dtype=torch.int64)
    return out, lse, None, None, q.size(2), k.size(2), seed, seed, torch.empty(0, dtype=q.dtype)

def bwd(query, key, value, out, logsumexp, is_causal, grad_out, dropout_p=0.0, scale=None, **_):
    g = groups(query, key)
    dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        grad_out, query, key.repeat_interleave(g, 1), value.repeat_interleave(g, 1), out, logsumexp,
        dropout_p, bool(is_causal), scale=scale)
    b, h, s, d = dk.shape
    return dq, dk.view(b, h // g, g, s, d).sum(2), dv.view(b, h // g, g, s, d).sum(2)

def ring_fwd(mesh, query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None):
    return A._templated_ring_attention(mesh.get_group(), 2, fwd, query=query, key=key, value=value,
                                       is_causal=is_causal, dropout_p=dropout_p, scale=scale)

def ring_bwd(mesh, grad_out, query, key, value, out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, dropout_p,
             is_causal, philox_seed, philox_offset, *, scale=None):
    return A._templated_ring_attention_backward(
        mesh.get_group(), 2, bwd, grad_out=grad_out, grad_out_name="grad_out", query=query, key=key, value=value,
        out=out, logsumexp=logsumexp, is_causal=is_causal, dropout_p=dropout_p, scale=scale)

def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    assert attn_mask is None, "the ring takes no mask"
    return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, False, scale=scale)[0]

A._scaled_dot_product_ring_flash_attention = ring_fwd
A._scaled_dot_product_ring_flash_attention_backward = ring_bwd
F.scaled_dot_product_attention = scaled_dot_product_attention
sys.argv = ["headroom_measure", *sys.argv[1:]]
runpy.run_module("headroom_measure", run_name="__main__")
'''


def spec(parallel: dict, **fields) -> dict:
    return {
        "model": "tiny-llama", "model_config": CONFIG, "precision": "bf16", "optimizer": "adamw",
        "batch_size": 2, "seq_len": 64, "gradient_checkpointing": True, "parallel": parallel, **fields,
    }  # fmt: skip


@unittest.skipUnless(has_torch(), "torch and transformers are not installed")
class ContextParallelHarnessTest(unittest.TestCase):
    def run_steps(self, parallel: dict) -> dict:
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "spec.json"
            path.write_text(json.dumps(spec(parallel)))
            out = Path(tmp) / "rows.jsonl"
            proc = subprocess.run(
                [sys.executable, "-c", RUN_ON_CPU, "dist", str(path), "--out", str(out)],
                capture_output=True, text=True, env=env(parallel["world_size"]), timeout=600,
            )  # fmt: skip
            self.assertEqual(proc.returncode, 0, proc.stderr[-3000:])
            return json.loads(out.read_text().splitlines()[0])

    def test_three_steps_under_fsdp2_over_dp_and_cp(self):
        record = self.run_steps({"strategy": "fsdp", "world_size": 8, "cp": 4})
        self.assertEqual(record["spec"]["parallel"]["cp"], 4)
        # FSDP2 shards over dp x cp: the whole world here.
        self.assertEqual(record["spec"]["parallel"]["shard_size"], 8)
        self.assertEqual(len(record["measured"]["ranks"][0]["steps"]), 3)

    def test_three_steps_with_tensor_and_sequence_parallelism(self):
        record = self.run_steps({"strategy": "fsdp", "world_size": 16, "cp": 2, "tp": 2, "sequence_parallel": True})
        self.assertEqual((record["spec"]["parallel"]["cp"], record["spec"]["parallel"]["tp"]), (2, 2))
        self.assertEqual(record["spec"]["parallel"]["shard_size"], 8)
        self.assertEqual(len(record["measured"]["ranks"][0]["steps"]), 3)


class ContextParallelSpecTest(unittest.TestCase):
    def refused(self, raw: dict, field: str):
        from headroom_measure import spec as specmod

        with self.assertRaises(specmod.SpecError) as caught:
            specmod.parse(raw)
        self.assertIn(field, str(caught.exception))

    def test_bad_layouts_name_the_field(self):
        self.refused(spec({"strategy": "fsdp", "world_size": 6, "cp": 4}), "parallel.cp")
        self.refused(spec({"strategy": "ddp", "world_size": 4, "cp": 2}), "parallel.cp")
        self.refused(spec({"strategy": "fsdp", "world_size": 4, "cp": 4}, seq_len=36), "seq_len")
        self.refused(spec({"strategy": "fsdp", "world_size": 4, "cp": 2}, attention="eager"), "attention")


if __name__ == "__main__":
    unittest.main()
