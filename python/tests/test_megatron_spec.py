"""The Megatron-core harness's spec (`parallel.framework: megatron` and the `megatron` block), checked without
torch or megatron-core: what it measures and what it refuses by name, as the estimator does."""

import unittest

from headroom_measure import spec as specmod
from headroom_measure.megatron import megatron_options, moe_fields, padded_vocab

CONFIG = {
    "model_type": "qwen3", "hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 8,
    "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 1024, "num_hidden_layers": 2,
    "tie_word_embeddings": False,
}  # fmt: skip


def raw(parallel=None, megatron=None, **extra) -> dict:
    out = {
        "model": "m", "model_config": CONFIG, "precision": "bf16", "optimizer": "adamw", "batch_size": 1,
        "seq_len": 64, "parallel": parallel or {"strategy": "ddp", "world_size": 8, "tp": 2, "framework": "megatron"},
        **extra,
    }  # fmt: skip
    if megatron is not None:
        out["megatron"] = megatron
    return out


class MegatronSpecTest(unittest.TestCase):
    def test_the_block_parses_with_megatrons_defaults(self):
        spec = specmod.parse(raw(megatron={"distributed_optimizer": True, "recompute_granularity": "full"}))
        self.assertEqual((spec.parallel.framework, spec.parallel.tp, spec.parallel.shard_size), ("megatron", 2, 4))
        self.assertEqual(
            megatron_options(spec),
            {"expert_model_parallel_size": 1, "expert_tensor_parallel_size": 2, "distributed_optimizer": True, "recompute_granularity": "full",
             "recompute_method": "uniform", "recompute_num_layers": 1, "overlap_p2p_comm": None,
             "eager_nccl_init": False, "recompute_modules": None, "moe_layer_recompute": None,
             "moe_router_dtype": None, "moe_aux_loss_coeff": None, "moe_router_load_balancing_type": None,
             "make_vocab_size_divisible_by": None, "optimizer_cpu_offload": False, "optimizer_offload_fraction": 1.0,
             "overlap_cpu_optimizer_d2h_h2d": False},
        )  # fmt: skip (an unset expert_tensor_parallel_size is tp, as Megatron-LM's arguments make it)
        self.assertEqual(megatron_options(specmod.parse(raw()))["recompute_granularity"], None)
        ep = megatron_options(specmod.parse(raw(megatron={"expert_model_parallel_size": 8})))
        self.assertEqual(ep["expert_model_parallel_size"], 8)
        etp = megatron_options(specmod.parse(raw(megatron={"expert_tensor_parallel_size": 4})))
        self.assertEqual(etp["expert_tensor_parallel_size"], 4)
        interleaved = {"strategy": "ddp", "world_size": 4, "tp": 1, "framework": "megatron", "pp": 2, "vpp": 2,
                       "schedule": "interleaved-1f1b", "microbatches": 2}  # fmt: skip
        overlap = megatron_options(specmod.parse(raw(parallel=interleaved, megatron={"overlap_p2p_comm": True})))
        self.assertIs(overlap["overlap_p2p_comm"], True)
        eager = megatron_options(specmod.parse(raw(megatron={"eager_nccl_init": True})))
        self.assertIs(eager["eager_nccl_init"], True)
        router = megatron_options(specmod.parse(raw(megatron={
            "moe_router_dtype": "fp32", "moe_aux_loss_coeff": 1e-3, "moe_layer_recompute": True,
            "recompute_granularity": "selective", "recompute_modules": ["core_attn", "moe"]})))  # fmt: skip
        self.assertEqual(
            (router["moe_router_dtype"], router["moe_aux_loss_coeff"], router["moe_layer_recompute"],
             router["recompute_modules"]),
            ("fp32", 1e-3, True, ["core_attn", "moe"]),
        )  # fmt: skip

    def test_the_optimizer_offload_runs_as_megatron_lm_runs_it(self):
        options = megatron_options(specmod.parse(raw(megatron={
            "distributed_optimizer": True, "optimizer_cpu_offload": True, "overlap_cpu_optimizer_d2h_h2d": True})))
        self.assertEqual(
            (options["optimizer_cpu_offload"], options["optimizer_offload_fraction"],
             options["overlap_cpu_optimizer_d2h_h2d"]),
            (True, 1.0, True),
        )  # fmt: skip (Megatron-LM's --optimizer-offload-fraction defaults to 1.0)

    def test_the_tracer_refuses_the_offload_by_name(self):
        from headroom_measure.trace import TraceError
        from headroom_measure.trace_megatron import refuse_untraceable_megatron

        offload = specmod.parse(raw(megatron={"distributed_optimizer": True, "optimizer_cpu_offload": True}))
        with self.assertRaises(TraceError) as err:
            refuse_untraceable_megatron(offload)
        self.assertIn("megatron.optimizer_cpu_offload", str(err.exception))
        refuse_untraceable_megatron(specmod.parse(raw(megatron={"distributed_optimizer": True})))

    def test_the_vocabulary_pads_as_megatron_lm_pads_it(self):
        self.assertEqual(padded_vocab(151936, {"make_vocab_size_divisible_by": 128}, 4), 152064)
        self.assertEqual(padded_vocab(128256, {"make_vocab_size_divisible_by": 128}, 8), 129024)
        self.assertEqual(padded_vocab(151936, {"make_vocab_size_divisible_by": None}, 4), 151936)

    def test_moe_configs_map_to_megatrons_experts_in_their_own_names(self):
        qwen3 = {"model_type": "qwen3_moe", "num_experts": 128, "num_experts_per_tok": 8, "moe_intermediate_size": 768,
                 "intermediate_size": 6144}  # fmt: skip
        mixtral = {"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 14336}
        self.assertEqual(moe_fields(qwen3), (128, 8, 768))
        self.assertEqual(moe_fields(mixtral), (8, 2, 14336))
        self.assertIsNone(moe_fields(CONFIG))

    def test_the_row_spec_round_trips(self):
        spec = specmod.parse(raw(parallel={"strategy": "ddp", "world_size": 4, "tp": 1, "framework": "megatron"}))
        out = spec.parallel.to_json()
        self.assertEqual((out["framework"], out["tp"]), ("megatron", 1))
        self.assertEqual(specmod.parse(raw(parallel=out)).parallel.to_json(), out)

    def test_what_is_not_measured_is_refused_by_name(self):
        cases = [
            (raw(megatron={"recompute_granularity": "some"}), "megatron.recompute_granularity"),
            (raw(megatron={"recompute_num_layers": 2}), "megatron.recompute_method"),
            (raw(megatron={"recompute_granularity": "full", "recompute_method": "every"}), "megatron.recompute_method"),
            (raw(megatron={"pipeline_model_parallel_size": 2}), "megatron.pipeline_model_parallel_size"),
            (raw(megatron={"foo": 1}), "megatron.foo"),
            (raw(megatron={"expert_model_parallel_size": 0}), "megatron.expert_model_parallel_size"),
            (raw(megatron={"expert_tensor_parallel_size": 0}), "megatron.expert_tensor_parallel_size"),
            (raw(megatron={"context_parallel_size": 2}), "megatron.context_parallel_size"),
            (raw(megatron={"distributed_optimizer": "yes"}), "megatron.distributed_optimizer"),
            (raw(megatron={"overlap_p2p_comm": "yes"}), "megatron.overlap_p2p_comm"),
            (raw(megatron={"overlap_p2p_comm": True}), "megatron.overlap_p2p_comm"),
            (raw(megatron={"eager_nccl_init": 1}), "megatron.eager_nccl_init"),
            (raw(megatron={"recompute_granularity": "selective", "recompute_modules": ["moe_act"]}),
             "megatron.recompute_modules"),
            (raw(megatron={"recompute_modules": ["moe"]}), "megatron.recompute_modules"),
            (raw(megatron={"moe_router_dtype": "fp64"}), "megatron.moe_router_dtype"),
            (raw(megatron={"moe_aux_loss_coeff": -1}), "megatron.moe_aux_loss_coeff"),
            (raw(megatron={"moe_router_load_balancing_type": "sinkhorn"}), "megatron.moe_router_load_balancing_type"),
            (raw(megatron={"moe_layer_recompute": "yes"}), "megatron.moe_layer_recompute"),
            (raw(megatron={"make_vocab_size_divisible_by": 0}), "megatron.make_vocab_size_divisible_by"),
            (raw(megatron={"optimizer_cpu_offload": True}), "megatron.optimizer_cpu_offload"),
            (raw(megatron={"optimizer_cpu_offload": "yes"}), "megatron.optimizer_cpu_offload"),
            (raw(megatron={"distributed_optimizer": True, "optimizer_cpu_offload": True,
                           "optimizer_offload_fraction": 2}), "megatron.optimizer_offload_fraction"),
            (raw(megatron={"overlap_cpu_optimizer_d2h_h2d": 1}), "megatron.overlap_cpu_optimizer_d2h_h2d"),
            (raw(gradient_checkpointing=True), "gradient_checkpointing"),
            (raw(optimizer="sgd"), "framework megatron"),
        ]
        for r, field in cases:
            with self.subTest(field=field):
                with self.assertRaises(specmod.SpecError) as err:
                    megatron_options(specmod.parse(r))
                self.assertIn(field, str(err.exception))
        with self.assertRaises(specmod.SpecError) as err:
            specmod.parse(raw(parallel={"strategy": "fsdp", "world_size": 8, "tp": 2, "framework": "megatron"}))
        self.assertIn("parallel.strategy", str(err.exception))

    def test_a_pipeline_composes_with_megatrons_ddp_and_round_trips(self):
        par = {"strategy": "ddp", "world_size": 16, "tp": 2, "framework": "megatron", "pp": 4, "microbatches": 2,
               "layers_per_stage": [1, 2, 2, 3]}  # fmt: skip
        spec = specmod.parse(raw(parallel=par))
        # The data-parallel group: world_size / (tp x pp); fewer micro-batches than stages run in Megatron's 1F1B.
        self.assertEqual((spec.parallel.pp, spec.parallel.microbatches, spec.parallel.shard_size), (4, 2, 2))
        out = spec.parallel.to_json()
        self.assertEqual(specmod.parse(raw(parallel=out)).parallel.to_json(), out)
        with self.assertRaises(specmod.SpecError) as err:
            specmod.parse(raw(parallel={**par, "schedule": "gpipe"}))
        self.assertIn("parallel.schedule", str(err.exception))
        with self.assertRaises(specmod.SpecError) as err:
            specmod.parse(raw(parallel={**par, "schedule": "interleaved-1f1b", "vpp": 2}))
        self.assertIn("parallel.layers_per_stage", str(err.exception))

    def test_megatrons_interleaved_schedule_takes_vpp_chunks(self):
        par = {"strategy": "ddp", "world_size": 8, "tp": 1, "framework": "megatron", "pp": 2, "vpp": 3,
               "schedule": "interleaved-1f1b", "microbatches": 4}  # fmt: skip
        spec = specmod.parse(raw(parallel=par))
        self.assertEqual((spec.parallel.pp, spec.parallel.vpp, spec.parallel.schedule), (2, 3, "interleaved-1f1b"))
        out = spec.parallel.to_json()
        self.assertEqual(specmod.parse(raw(parallel=out)).parallel.to_json(), out)


if __name__ == "__main__":
    unittest.main()
