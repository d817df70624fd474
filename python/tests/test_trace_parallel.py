"""The tracer on pipeline, context and expert parallelism (trace_dist.py): one rank of a fake world on
the CPU, built and stepped by the GPU harness's own code (pp.py, dist.py). A pipeline rank holds its
stage and receives every micro-batch into buffers of its own; context parallelism runs torch's ring
(its collectives allocate their outputs, each step's flash backward says how many key rows it saw);
expert parallelism keeps its rank's experts; a rank outside the world is refused by name."""

import json
import tempfile
import unittest
from collections import Counter

from .test_trace import has_torch, run
from .test_trace_dist import traced

LLAMA = {
    "model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 4,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 512,
    "tie_word_embeddings": False,
}  # fmt: skip
BATCH, SEQ, MICROBATCHES = 4, 64, 4
PP = {
    "model": "tiny-llama", "model_config": LLAMA, "precision": "bf16", "optimizer": "adamw",
    "batch_size": BATCH, "seq_len": SEQ,
    "parallel": {"strategy": "none", "world_size": 2, "pp": 2, "schedule": "1f1b", "microbatches": MICROBATCHES},
}  # fmt: skip
CP = {
    "model": "tiny-llama", "model_config": LLAMA, "precision": "bf16", "optimizer": "adamw", "batch_size": 1,
    "seq_len": 128, "gradient_checkpointing": True, "parallel": {"strategy": "fsdp", "world_size": 4, "cp": 2},
}  # fmt: skip
MOE = {
    "model_type": "qwen3_moe", "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "num_experts": 8,
    "num_experts_per_tok": 2, "vocab_size": 512, "max_position_embeddings": 256, "tie_word_embeddings": False,
}  # fmt: skip
EP = {
    "model": "tiny-qwen3-moe", "model_config": MOE, "precision": "bf16", "optimizer": "adamw-forloop",
    "batch_size": 2, "seq_len": 32, "parallel": {"strategy": "none", "world_size": 2, "ep": 2},
}  # fmt: skip
BF16 = 2


def traced_rank(spec: dict, rank: int) -> dict:
    from headroom_measure.trace import read_trace

    with tempfile.TemporaryDirectory() as tmp:
        out = run("trace", "--spec-json", json.dumps(spec), "--out", f"{tmp}/t.json.gz", "--rank", str(rank))
        if out.returncode:
            raise AssertionError(out.stderr)
        return read_trace(f"{tmp}/t.json.gz")


def parameter_bytes(doc: dict) -> int:
    return sum(s["bytes"] for s in doc["storages"] if s["kind"] == "parameter")


@unittest.skipUnless(has_torch(), "torch and transformers are not installed")
class PipelineTraceTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.first, cls.last = traced_rank(PP, 0), traced_rank(PP, 1)

    def test_the_trace_says_its_rank_and_the_schedules_phases(self):
        self.assertEqual((self.first["env"]["rank"], self.last["env"]["rank"]), (0, 1))
        names = [p["name"] for p in self.last["phases"]]
        self.assertEqual(names[:3], ["load", "step 1 schedule", "step 1 optimizer"])
        self.assertEqual(len(names), 7)

    def test_each_rank_holds_its_stage(self):
        h, i, v = LLAMA["hidden_size"], LLAMA["intermediate_size"], LLAMA["vocab_size"]
        head_dim = h // LLAMA["num_attention_heads"]
        kv = LLAMA["num_key_value_heads"] * head_dim
        layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
        self.assertEqual(parameter_bytes(self.first), BF16 * (v * h + 2 * layer))
        self.assertEqual(parameter_bytes(self.last), BF16 * (2 * layer + h + v * h))

    def test_the_later_stage_receives_every_micro_batch_into_its_own_buffer(self):
        """`PipelineStage` makes one receive buffer per micro-batch when the schedule first runs
        (`_prepare_forward_infra`) and reuses them every step."""
        hidden = BF16 * (BATCH // MICROBATCHES) * SEQ * LLAMA["hidden_size"]
        doc = self.last
        step_2 = doc["phases"][3]["event"]
        received = [
            (i, e[1]) for i, e in enumerate(doc["events"])
            if e[0] == "alloc" and doc["storages"][e[1]]["op"] == "aten.empty.memory_format"
            and doc["storages"][e[1]]["bytes"] == hidden
        ]  # fmt: skip
        self.assertEqual(len(received), MICROBATCHES)
        self.assertTrue(all(doc["phases"][1]["event"] <= i < step_2 for i, _ in received))
        # Held to the end of the run, not freed between steps.
        frees = {e[1]: i for i, e in enumerate(doc["events"]) if e[0] == "free"}
        self.assertTrue(all(frees.get(sid, len(doc["events"])) >= doc["phases"][-1]["event"] for _, sid in received))


@unittest.skipUnless(has_torch(), "torch and transformers are not installed")
class ContextParallelTraceTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.doc = traced(CP)

    def test_the_ring_gathers_keys_and_values_and_sends_their_gradients_on(self):
        cp, local = 2, CP["seq_len"] // 2
        kv_heads, head_dim = LLAMA["num_key_value_heads"], LLAMA["hidden_size"] // LLAMA["num_attention_heads"]
        ops = Counter((s["op"], s["bytes"]) for s in self.doc["storages"])
        kv = BF16 * kv_heads * local * head_dim
        # `all_gather_tensor(cat([k, v]))`: every rank's keys and values, once per layer and pass.
        gathered = ops[("_c10d_functional.all_gather_into_tensor.default", cp * 2 * kv)]
        self.assertGreater(gathered, 0)
        self.assertGreater(sum(n for (op, _), n in ops.items() if "all_to_all" in op), 0)

    def test_each_ring_step_names_the_key_rows_its_backward_saw(self):
        local = CP["seq_len"] // 2
        steps = [e for e in self.doc["events"] if e[0] == "attention_backward"]
        whole = [e for e in steps if e[4] == local and len(e) == 8]
        # Rank 0 attends the second half of its queries to the other rank's whole chunk.
        partial = [e for e in steps if e[4] == local // 2]
        self.assertTrue(whole and partial)
        self.assertEqual(len(whole), len(partial))
        self.assertTrue(all(e[8] == local for e in partial), partial[:2])


@unittest.skipUnless(has_torch(), "torch and transformers are not installed")
class ExpertParallelTraceTest(unittest.TestCase):
    def test_rank_zero_holds_its_share_of_the_experts(self):
        doc = traced(EP)
        h, moe, experts = MOE["hidden_size"], MOE["moe_intermediate_size"], MOE["num_experts"]
        # Each fused stack (gate_up, down) is a Shard(0) DTensor of experts / ep experts.
        stacks = Counter(s["bytes"] for s in doc["storages"] if s["kind"] == "parameter")
        local = experts // 2
        self.assertEqual(stacks[BF16 * local * 2 * moe * h], MOE["num_hidden_layers"])
        self.assertEqual(stacks[BF16 * local * moe * h], MOE["num_hidden_layers"])
        heads, kv_heads, head_dim = MOE["num_attention_heads"], MOE["num_key_value_heads"], MOE["head_dim"]
        attention = 2 * h * heads * head_dim + 2 * h * kv_heads * head_dim + 2 * head_dim
        layer = attention + 2 * h + experts * h + local * 3 * moe * h  # norms, router, local experts
        whole = 2 * MOE["vocab_size"] * h + h + MOE["num_hidden_layers"] * layer
        self.assertEqual(parameter_bytes(doc), BF16 * whole)

    def test_a_rank_outside_the_world_is_refused_by_name(self):
        with tempfile.TemporaryDirectory() as tmp:
            out = run("trace", "--spec-json", json.dumps(EP), "--out", f"{tmp}/t.json", "--rank", "2")
        self.assertEqual(out.returncode, 2, out.stderr)
        self.assertIn("`--rank 2`", out.stderr)
        self.assertIn("ranks 0 to 1", out.stderr)
        self.assertNotIn("Traceback", out.stderr)


if __name__ == "__main__":
    unittest.main()
