"""QLoRA (`quantization: nf4`) under the tracer (trace_nf4.py, bitsandbytes_emulation.py): the
model loaded as transformers quantizes it on the device, each 4-bit weight's storages as
bitsandbytes allocates them, and the 4-bit matmuls' buffers as its CUDA kernels allocate them."""

import json
import math
import tempfile
import unittest

from .test_trace import TINY, has_torch, run

LORA = {"r": 8, "alpha": 16, "targets": "all-linear", "dropout": 0.05}
NF4 = {**TINY, "quantization": "nf4", "kbit_prepare": True, "gradient_checkpointing": True, "lora": LORA}


def four_bit_weight(n: int) -> list[int]:
    """The bytes a 4-bit weight of `n` elements keeps (nf4, blocks of 64, double quantization): the
    packed weight, its absmax quantized to uint8, the nested fp32 absmax per 256 blocks, the
    offset, the nf4 code and the nested dynamic code."""
    blocks = n // 64
    return [n // 2, blocks, math.ceil(blocks / 256) * 4, 4, 16 * 4, 256 * 4]


@unittest.skipUnless(has_torch("bitsandbytes", "peft"), "torch, transformers, peft and bitsandbytes are not installed")
class Nf4TraceTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        from headroom_measure.trace import read_trace

        with tempfile.TemporaryDirectory() as tmp:
            out = run("trace", "--spec-json", json.dumps(NF4), "--out", f"{tmp}/t.json.gz")
            assert out.returncode == 0, out.stderr
            cls.trace = read_trace(f"{tmp}/t.json.gz")

    def test_the_weights_are_4bit_linears_fp32_norms_embeddings_and_adapters(self):
        cfg = TINY["model_config"]
        h, i, v, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
        kv = h // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
        linears = [(h, h), (h, kv), (h, kv), (h, h), (h, i), (h, i), (i, h)] * layers  # (in, out)
        expected = [v * h * 4, v * h * 4] + [h * 4] * (2 * layers + 1)  # fp32 after k-bit preparation
        for n_in, n_out in linears:
            expected += four_bit_weight(n_in * n_out)
            expected += [LORA["r"] * n_in * 4, n_out * LORA["r"] * 4]
        weights = [s["bytes"] for s in self.trace["storages"] if s["kind"] == "parameter"]
        self.assertEqual(sorted(weights), sorted(expected))

    def test_the_load_warms_the_allocator_then_quantizes_each_bf16_copy_on_the_device(self):
        storages, events = self.trace["storages"], self.trace["events"]
        cfg = TINY["model_config"]
        h, i, v, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
        kv = h // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
        # The bf16 model built, saved and deleted, the cache emptied: then the warm-up, of every
        # weight at its loaded size (4-bit ones at half a byte an element), before any allocation.
        emptied = events.index(["empty_cache"])
        after = events[emptied + 1 :]
        first_alloc = next(k for k, e in enumerate(after) if e[0] == "alloc")
        four_bit = layers * (2 * h * h + 2 * h * kv + 3 * h * i)
        loaded = 2 * (2 * v * h + (2 * layers + 1) * h) + four_bit // 2
        self.assertIn(["caching_allocator_warmup", loaded], after[:first_alloc])
        # Then the checkpoint in key order, each tensor copied to the device in bf16: lm_head, the
        # embedding, layer 0's input norm, then its down_proj, quantized there (absmax, packed data).
        allocs = [storages[e[1]]["bytes"] for e in after if e[0] == "alloc"]
        self.assertEqual(allocs[:6], [2 * v * h, 2 * v * h, 2 * h, 2 * h * i, h * i // 64 * 4, h * i // 2])

    def test_a_model_whose_checkpoint_is_converted_on_load_is_refused_by_name(self):
        config = {**TINY["model_config"], "model_type": "qwen3_moe", "moe_intermediate_size": 64, "num_experts": 4,
                  "num_experts_per_tok": 2}  # fmt: skip
        with tempfile.TemporaryDirectory() as tmp:
            out = run("trace", "--spec-json", json.dumps({**NF4, "model_config": config}), "--out", f"{tmp}/t.json")
        self.assertEqual(out.returncode, 2, out.stderr)
        self.assertIn("`quantization: nf4` of a qwen3_moe model", out.stderr)
        self.assertIn("llama, mistral, qwen2", out.stderr)


if __name__ == "__main__":
    unittest.main()
