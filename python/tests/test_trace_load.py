"""The tracer's `from_pretrained` (trace_load.py) of a model whose checkpoint transformers converts on
load: the checkpoint holds each expert's weights apart, and the load copies each of them to the device
and fuses them with transformers' own conversion ops."""

import unittest

from .test_trace import has_torch

MOE = {
    "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
    "num_experts": 4, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100,
}  # fmt: skip


class Warmup:
    def caching_allocator_warmup(self, weight_bytes):
        self.weight_bytes = weight_bytes


@unittest.skipUnless(has_torch(), "torch and transformers are not installed")
class ConvertedLoadTest(unittest.TestCase):
    def model(self):
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM

        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(AutoConfig.for_model("qwen3_moe", **MOE))

    def test_the_checkpoint_holds_each_expert_apart(self):
        from headroom_measure.trace_load import checkpoint_of

        checkpoint = checkpoint_of(self.model())
        self.assertNotIn("model.layers.0.mlp.experts.gate_up_proj", checkpoint)
        self.assertEqual(checkpoint["model.layers.1.mlp.experts.3.up_proj.weight"][0], (32, 64))
        self.assertEqual(sum(".experts." in name for name in checkpoint), 2 * 4 * 3)

    def test_each_fused_tensor_is_stacked_from_its_experts_copies_once_they_are_in(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        from headroom_measure.trace_load import checkpoint_of, load_on_device

        model = self.model()
        checkpoint = checkpoint_of(model)
        ops = []

        class Log(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                ops.append((func.__name__, tuple(out.shape) if isinstance(out, torch.Tensor) else None))
                return out

        with Log():
            load_on_device(Warmup(), model, checkpoint)
        for name, param in model.named_parameters():
            self.assertNotEqual(param.device.type, "meta", name)
        self.assertEqual(tuple(model.model.layers[0].mlp.experts.gate_up_proj.shape), (4, 64, 64))
        from transformers.core_model_loading import dot_natural_key

        names = sorted(checkpoint, key=dot_natural_key)
        copies = [i for i, (op, _) in enumerate(ops) if op.startswith("empty")][: len(names)]
        fused = [i for i, (op, shape) in enumerate(ops) if op.startswith("cat") and shape == (4, 64, 64)]
        self.assertEqual(len(fused), 2)  # each layer's gate_up, right after its last expert's copy
        last_expert = max(i for i, name in enumerate(names) if ".layers.0.mlp.experts." in name)
        self.assertTrue(copies[last_expert] < fused[0] < copies[last_expert + 1])
