"""The harness's sequence-parallel norm for Megatron-core's local layer spec, built on the CPU under the fake process
group (needs torch and megatron-core importable: `PYTHONPATH=python:<unzipped megatron_core wheel>`)."""

import importlib.util
import unittest

HAVE_MEGATRON = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("megatron") is not None


@unittest.skipUnless(HAVE_MEGATRON, "needs torch and megatron-core")
class SequenceParallelNormTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        import torch.distributed as dist
        from megatron.core import parallel_state
        from torch.testing._internal.distributed.fake_pg import FakeStore

        dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=2, create_gloo_process_groups=False)

    @classmethod
    def tearDownClass(cls):
        import torch.distributed as dist
        from megatron.core import parallel_state

        parallel_state.destroy_model_parallel()
        dist.destroy_process_group()

    def config(self, sequence_parallel=True):
        import torch
        import torch.nn.functional as F
        from megatron.core.transformer.transformer_config import TransformerConfig

        return TransformerConfig(
            num_layers=2, hidden_size=64, ffn_hidden_size=128, num_attention_heads=4, num_query_groups=2,
            kv_channels=16, normalization="RMSNorm", gated_linear_unit=True, activation_func=F.silu,
            add_bias_linear=False, qk_layernorm=True, tensor_model_parallel_size=2,
            sequence_parallel=sequence_parallel, use_cpu_initialization=True, params_dtype=torch.float32,
        )  # fmt: skip

    def model(self, config, layer_spec):
        from megatron.core.models.gpt import GPTModel

        return GPTModel(config, layer_spec, vocab_size=128, max_sequence_length=32, position_embedding_type="rope")

    def test_every_norm_is_torchs_rmsnorm_marked_sequence_parallel(self):
        import torch
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.identity_op import IdentityOp

        from headroom_measure.megatron import sequence_parallel_block

        config = self.config()
        block = sequence_parallel_block(config, get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=True))
        model = self.model(config, block)
        norms = {n: m for n, m in model.named_modules() if n.endswith("layernorm") and not isinstance(m, IdentityOp)}
        self.assertEqual(len(norms), 2 * 4 + 1)
        self.assertTrue(all(type(m) is torch.nn.RMSNorm for m in norms.values()))
        marked = {n for n, p in model.named_parameters() if getattr(p, "sequence_parallel", False)}
        self.assertEqual(marked, {f"{n}.weight" for n in norms})

    def test_the_local_spec_alone_still_refuses_sequence_parallelism(self):
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        with self.assertRaisesRegex(AssertionError, "sequence parallel"):
            self.model(self.config(), get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=True))


if __name__ == "__main__":
    unittest.main()
