"""The `parallel` block of a run spec: defaults, normalised output, and errors that name the field."""

import unittest

from headroom_measure import spec as specmod


def parse(parallel, **extra):
    return specmod.parse({"model": "qwen2.5-1.5b", "parallel": parallel, **extra})


class ParallelSpecTest(unittest.TestCase):
    def test_absent_means_one_gpu(self):
        s = specmod.parse({"model": "m"})
        self.assertIsNone(s.parallel)
        self.assertNotIn("parallel", s.to_json())

    def test_fsdp_defaults_are_full_sharding_without_offload(self):
        p = parse({"strategy": "fsdp", "world_size": 2}).parallel
        self.assertEqual(
            (p.strategy, p.world_size, p.reshard_after_forward, p.shard_size, p.offload_params, p.offload_optimizer),
            ("fsdp", 2, True, 2, False, False),
        )

    def test_to_json_emits_every_key_normalised_and_round_trips(self):
        s = parse({"strategy": "fsdp", "world_size": 4, "reshard_after_forward": False, "shard_size": 2},
                  precision="bf16", gradient_checkpointing=True)
        out = s.to_json()
        self.assertEqual(
            out["parallel"],
            {
                "strategy": "fsdp",
                "world_size": 4,
                "reshard_after_forward": False,
                "shard_size": 2,
                "offload_params": False,
                "offload_optimizer": False,
            },
        )
        self.assertEqual(specmod.parse(out).to_json(), out)
        ddp = parse({"strategy": "ddp", "world_size": 2}).to_json()["parallel"]
        # Every key but the fsdp-only policy and units, written only when set, and the fsdp1-only keys.
        self.assertEqual(
            sorted(ddp),
            sorted(
                set(specmod.PARALLEL_KEYS)
                - {"mixed_precision", "units", "use_orig_params", "backward_prefetch", "tp", "sequence_parallel", "cp",
                   "framework", "pp", "vpp", "microbatches", "schedule", "layers_per_stage", "ep"}
            ),
        )
        self.assertEqual((ddp["shard_size"], ddp["reshard_after_forward"]), (2, True))
        self.assertEqual(specmod.parse({"model": "m", "parallel": ddp}).to_json()["parallel"], ddp)

    def test_each_strategy_parses(self):
        for strategy in specmod.STRATEGIES:
            with self.subTest(strategy=strategy):
                extra = {"precision": "bf16"} if strategy.startswith("zero") else {}
                tp = {"tp": 2, "sequence_parallel": True} if strategy == "none" else {}
                self.assertEqual(
                    parse({"strategy": strategy, "world_size": 2, **tp}, **extra).parallel.strategy, strategy
                )
        z3 = parse({"strategy": "zero3", "world_size": 2, "offload_params": True, "offload_optimizer": True},
                   precision="bf16").parallel
        self.assertEqual((z3.offload_params, z3.offload_optimizer), (True, True))

    def test_bad_values_name_the_field_the_value_and_what_is_allowed(self):
        cases = [
            ("fsdp", ["parallel", "mapping"]),
            ({"world_size": 2}, ["parallel.strategy", "required", "fsdp"]),
            ({"strategy": "tp", "world_size": 2}, ["parallel.strategy", "tp", "zero3"]),
            ({"strategy": "fsdp"}, ["parallel.world_size", "required"]),
            ({"strategy": "fsdp", "world_size": 0}, ["parallel.world_size", "0", ">= 1"]),
            ({"strategy": "fsdp", "world_size": True}, ["parallel.world_size", "True"]),
            ({"strategy": "fsdp", "world_size": 2, "shard_size": 3}, ["parallel.shard_size", "3", "divides"]),
            ({"strategy": "fsdp", "world_size": 2, "shard_size": 0}, ["parallel.shard_size", "0"]),
            ({"strategy": "fsdp", "world_size": 2, "reshard_after_forward": "no"},
             ["parallel.reshard_after_forward", "no", "true or false"]),
            ({"strategy": "ddp", "world_size": 2, "reshard_after_forward": False},
             ["parallel.reshard_after_forward", "fsdp", "ddp"]),
            ({"strategy": "ddp", "world_size": 4, "shard_size": 2}, ["parallel.shard_size", "fsdp", "ddp"]),
            ({"strategy": "ddp", "world_size": 2, "offload_params": True}, ["parallel.offload_params", "zero3"]),
            ({"strategy": "fsdp", "world_size": 2, "offload_optimizer": True},
             ["parallel.offload_optimizer", "zero1", "fsdp"]),
            ({"strategy": "zero2", "world_size": 2, "offload_params": True}, ["parallel.offload_params", "zero2"]),
            ({"strategy": "fsdp", "world_size": 2, "tensor_parallel": 2}, ["parallel.tensor_parallel", "strategy"]),
        ]
        for parallel, words in cases:
            with self.subTest(parallel=parallel):
                with self.assertRaises(specmod.SpecError) as ctx:
                    parse(parallel)
                for word in words:
                    self.assertIn(word, str(ctx.exception))

    def test_combinations_that_are_not_measured_are_refused(self):
        fsdp = {"strategy": "fsdp", "world_size": 2}
        cases = [
            (dict(mode="forward"), ["parallel", "forward", "train"]),
            (dict(lora={"r": 8}), ["parallel", "lora"]),
            (dict(quantization="nf4"), ["parallel", "quantization"]),
        ]
        for extra, words in cases:
            with self.subTest(extra=extra):
                with self.assertRaises(specmod.SpecError) as ctx:
                    parse(fsdp, **extra)
                for word in words:
                    self.assertIn(word, str(ctx.exception))
        with self.assertRaises(specmod.SpecError) as ctx:
            parse({"strategy": "zero2", "world_size": 2}, precision="amp-bf16")
        self.assertIn("precision", str(ctx.exception))
        self.assertIn("bf16", str(ctx.exception))
        with self.assertRaises(specmod.SpecError) as ctx:
            parse({"strategy": "zero3", "world_size": 2}, precision="bf16", optimizer="sgd")
        self.assertIn("optimizer", str(ctx.exception))


class DeepSpeedConfigTest(unittest.TestCase):
    """The DeepSpeed config dist.py hands to deepspeed.initialize (no torch needed to build it)."""

    def test_stages_precision_and_offload(self):
        from headroom_measure.dist import ds_config

        z2 = ds_config(parse({"strategy": "zero2", "world_size": 2}, precision="bf16", batch_size=4))
        self.assertEqual(z2["zero_optimization"], {"stage": 2})
        self.assertEqual(z2["bf16"], {"enabled": True})
        self.assertEqual(z2["train_micro_batch_size_per_gpu"], 4)
        self.assertTrue(z2["optimizer"]["params"]["torch_adam"])
        z1 = ds_config(parse({"strategy": "zero1", "world_size": 2}, precision="fp32"))
        self.assertNotIn("bf16", z1)
        z3 = ds_config(parse({"strategy": "zero3", "world_size": 2, "offload_params": True, "offload_optimizer": True},
                             precision="bf16"))
        self.assertEqual(z3["zero_optimization"]["stage"], 3)
        self.assertEqual(z3["zero_optimization"]["offload_optimizer"]["device"], "cpu")
        self.assertEqual(z3["zero_optimization"]["offload_param"]["device"], "cpu")
        self.assertFalse(z3["optimizer"]["params"]["torch_adam"])  # DeepSpeedCPUAdam


class CommittedRunsTest(unittest.TestCase):
    """bench/distributed/h200x2: every spec parses, and every row carries each rank's phases."""

    def test_specs_and_rows(self):
        import json
        from pathlib import Path

        here = Path(__file__).resolve().parents[2] / "bench" / "distributed" / "h200x2"
        specs = [json.loads(l) for l in (here / "specs.jsonl").read_text().splitlines() if l.strip()]
        for line in specs:
            self.assertIsNotNone(specmod.parse(line["spec"]).parallel, line["id"])
        rows_file = here / "h200x2-torch2.11.jsonl"
        if not rows_file.is_file():
            return
        for line in rows_file.read_text().splitlines():
            row = json.loads(line)
            m = row["measured"]
            spec = specmod.parse(row["spec"])
            self.assertEqual(len(m["ranks"]), spec.parallel.world_size, row["id"])
            self.assertEqual(row["spec"]["parallel"], spec.parallel.to_json())
            self.assertEqual(m["peak_allocated_bytes"], max(r["peak_allocated_bytes"] for r in m["ranks"]))
            for r in m["ranks"]:
                self.assertEqual(len(r["steps"]), 3)
                peaks = [r["load"]["peak_allocated"]] + [v for s in r["steps"] for k, v in s.items() if k.endswith("_peak")]
                self.assertEqual(r["peak_allocated_bytes"], max(peaks))


if __name__ == "__main__":
    unittest.main()


class MixedPrecisionSpecTest(unittest.TestCase):
    def test_fsdp_takes_a_policy_over_fp32_masters_and_round_trips(self):
        raw = {
            "model": "m",
            "precision": "fp32",
            "parallel": {"strategy": "fsdp", "world_size": 8, "mixed_precision": {"reduce_dtype": "fp32"}},
        }
        spec = specmod.parse(raw)
        self.assertEqual(
            spec.parallel.mixed_precision,
            {"param_dtype": "bf16", "reduce_dtype": "fp32", "output_dtype": None, "cast_forward_inputs": True},
        )
        self.assertEqual(specmod.parse(spec.to_json()).to_json(), spec.to_json())

    def test_a_policy_is_refused_off_fsdp_and_with_autocast_precisions(self):
        for parallel, precision, words in [
            ({"strategy": "ddp", "world_size": 2, "mixed_precision": {}}, "fp32", "only to strategy fsdp"),
            ({"strategy": "fsdp", "world_size": 2, "mixed_precision": {}}, "amp-bf16", "use fp32 or bf16"),
            ({"strategy": "fsdp", "world_size": 2, "mixed_precision": {"param_dtype": "fp8"}}, "fp32", "bf16 or fp32"),
        ]:
            with self.subTest(parallel=parallel, precision=precision):
                with self.assertRaises(specmod.SpecError) as err:
                    specmod.parse({"model": "m", "precision": precision, "parallel": parallel})
                self.assertIn(words, str(err.exception))


class UnitsAndAutocastTest(unittest.TestCase):
    def test_units_and_autocast_round_trip(self):
        raw = {
            "model": "m",
            "precision": "fp32",
            "autocast": "bf16",
            "parallel": {"strategy": "fsdp", "world_size": 8, "units": "layers-embedding", "mixed_precision": {}},
        }
        spec = specmod.parse(raw)
        self.assertEqual((spec.parallel.units, spec.autocast), ("layers-embedding", "bf16"))
        self.assertEqual(specmod.parse(spec.to_json()).to_json(), spec.to_json())

    def test_units_and_autocast_are_refused_where_they_do_not_apply(self):
        for raw, words in [
            ({"parallel": {"strategy": "ddp", "world_size": 2, "units": "accelerate"}}, "only to strategy fsdp"),
            ({"parallel": {"strategy": "fsdp", "world_size": 2, "units": "torchtitan"}}, "use one of layers"),
            ({"autocast": "bf16", "parallel": {"strategy": "fsdp", "world_size": 2}}, "without one use"),
            ({"autocast": "fp16", "parallel": {"strategy": "fsdp", "world_size": 2, "mixed_precision": {}}},
             "use bf16 or none"),
        ]:
            with self.subTest(raw=raw):
                with self.assertRaises(specmod.SpecError) as err:
                    specmod.parse({"model": "m", "precision": "fp32", **raw})
                self.assertIn(words, str(err.exception))


class Fsdp1SpecTest(unittest.TestCase):
    """strategy fsdp1 (FSDP1's FullyShardedDataParallel, dist.py `_build_fsdp1`)."""

    def test_defaults_are_full_shard_orig_params_and_backward_pre(self):
        self.assertEqual(parse({"strategy": "fsdp1", "world_size": 1}).parallel.shard_size, 1)  # one GPU: NO_SHARD
        p = parse({"strategy": "fsdp1", "world_size": 8}).parallel
        self.assertEqual(
            (p.strategy, p.reshard_after_forward, p.shard_size, p.offload_params, p.use_orig_params,
             p.backward_prefetch, p.mixed_precision, p.units),
            ("fsdp1", True, 8, False, True, "pre", None, "layers"),
        )
        out = parse({"strategy": "fsdp1", "world_size": 8}).to_json()["parallel"]
        pipeline = {"pp", "vpp", "microbatches", "schedule", "layers_per_stage"}
        self.assertEqual(
            sorted(out),
            sorted(set(specmod.PARALLEL_KEYS) - {"mixed_precision", "units", "tp", "sequence_parallel", "framework", "cp", "ep"} - pipeline),
        )
        self.assertEqual((out["use_orig_params"], out["backward_prefetch"]), (True, "pre"))

    def test_every_option_round_trips(self):
        raw = {
            "model": "m",
            "precision": "fp32",
            "gradient_checkpointing": True,
            "autocast": "bf16",
            "parallel": {
                "strategy": "fsdp1", "world_size": 8, "shard_size": 4, "reshard_after_forward": False,
                "offload_params": True, "use_orig_params": False, "backward_prefetch": "none",
                "mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "bf16", "buffer_dtype": "bf16"},
            },
        }
        spec = specmod.parse(raw)
        p = spec.parallel
        self.assertEqual(
            (p.shard_size, p.reshard_after_forward, p.offload_params, p.use_orig_params, p.backward_prefetch),
            (4, False, True, False, "none"),
        )
        self.assertEqual(
            p.mixed_precision,
            {"param_dtype": "bf16", "reduce_dtype": "bf16", "buffer_dtype": "bf16", "cast_forward_inputs": False},
        )
        self.assertEqual(spec.autocast, "bf16")
        out = spec.to_json()
        self.assertEqual(out["parallel"]["mixed_precision"], p.mixed_precision)
        self.assertEqual(specmod.parse(out).to_json(), out)
        for prefetch in specmod.BACKWARD_PREFETCH:
            with self.subTest(prefetch=prefetch):
                s = parse({"strategy": "fsdp1", "world_size": 2, "backward_prefetch": prefetch})
                self.assertEqual(specmod.parse(s.to_json()).parallel.backward_prefetch, prefetch)

    def test_policy_defaults_follow_fsdp1(self):
        """An empty policy casts parameters to bf16 (as for fsdp); reduce in the parameter dtype,
        buffers left alone and only the root's inputs cast, as FSDP1's MixedPrecision defaults."""
        p = parse({"strategy": "fsdp1", "world_size": 2, "mixed_precision": {}}, precision="bf16").parallel
        self.assertEqual(
            p.mixed_precision,
            {"param_dtype": "bf16", "reduce_dtype": None, "buffer_dtype": None, "cast_forward_inputs": False},
        )
        fsdp2 = parse({"strategy": "fsdp", "world_size": 2, "mixed_precision": {}}, precision="bf16").parallel
        self.assertNotIn("buffer_dtype", fsdp2.mixed_precision)
        self.assertTrue(fsdp2.mixed_precision["cast_forward_inputs"])

    def test_without_a_policy_any_precision(self):
        for precision in specmod.PRECISIONS:
            with self.subTest(precision=precision):
                spec = parse({"strategy": "fsdp1", "world_size": 2}, precision=precision)
                self.assertEqual(spec.precision, precision)

    def test_refusals_name_the_field_the_value_and_what_is_allowed(self):
        fsdp1 = {"strategy": "fsdp1", "world_size": 2}
        cases = [
            ({**fsdp1, "mixed_precision": {"output_dtype": "fp32"}}, {},
             ["parallel.mixed_precision.output_dtype", "'fp32'", "fsdp1", "buffer_dtype"]),
            ({"strategy": "fsdp", "world_size": 2, "mixed_precision": {"buffer_dtype": "bf16"}}, {},
             ["parallel.mixed_precision.buffer_dtype", "'bf16'", "fsdp", "output_dtype"]),
            ({**fsdp1, "mixed_precision": {"buffer_dtype": "fp16"}}, {},
             ["parallel.mixed_precision.buffer_dtype", "fp16", "bf16 or fp32"]),
            ({**fsdp1, "mixed_precision": {"keep_low_precision_grads": True}}, {},
             ["parallel.mixed_precision", "keep_low_precision_grads", "param_dtype, reduce_dtype, buffer_dtype"]),
            ({**fsdp1, "mixed_precision": {"cast_forward_inputs": "yes"}}, {},
             ["parallel.mixed_precision.cast_forward_inputs", "true or false"]),
            ({**fsdp1, "mixed_precision": {}}, {"precision": "amp-bf16"}, ["precision", "amp-bf16", "fp32 or bf16"]),
            ({**fsdp1, "units": "accelerate"}, {}, ["parallel.units", "accelerate", "fsdp1", "layers"]),
            ({**fsdp1, "use_orig_params": "no"}, {}, ["parallel.use_orig_params", "no", "true or false"]),
            ({"strategy": "fsdp", "world_size": 2, "use_orig_params": False},
             {}, ["parallel.use_orig_params", "False", "fsdp1", "not fsdp"]),
            ({**fsdp1, "backward_prefetch": "later"}, {}, ["parallel.backward_prefetch", "later", "pre, post, none"]),
            ({"strategy": "ddp", "world_size": 2, "backward_prefetch": "post"},
             {}, ["parallel.backward_prefetch", "post", "fsdp1", "ddp"]),
            ({**fsdp1, "offload_optimizer": True}, {}, ["parallel.offload_optimizer", "zero1", "fsdp1"]),
            ({**fsdp1, "shard_size": 3}, {}, ["parallel.shard_size", "3", "divides"]),
            ({**fsdp1, "shard_size": 1}, {}, ["parallel.shard_size", "1", "NO_SHARD", ">= 2", "ddp"]),
            (fsdp1, {"autocast": "bf16"}, ["autocast", "mixed_precision"]),
            (fsdp1, {"lora": {"r": 8}}, ["parallel", "lora"]),
            (fsdp1, {"mode": "forward"}, ["parallel", "forward", "train"]),
        ]
        for parallel, extra, words in cases:
            with self.subTest(parallel=parallel, extra=extra):
                with self.assertRaises(specmod.SpecError) as ctx:
                    specmod.parse({"model": "m", "precision": "fp32", **extra, "parallel": parallel})
                for word in words:
                    self.assertIn(word, str(ctx.exception))

    def test_fsdp1_defaults_may_be_written_for_other_strategies(self):
        """to_json writes use_orig_params and backward_prefetch for fsdp1 only, but their defaults
        are accepted anywhere, as every other key's."""
        p = parse({"strategy": "ddp", "world_size": 2, "use_orig_params": True, "backward_prefetch": "pre"}).parallel
        self.assertNotIn("use_orig_params", p.to_json())
        self.assertNotIn("backward_prefetch", p.to_json())
        fsdp = parse({"strategy": "fsdp", "world_size": 4, "shard_size": 2}).to_json()["parallel"]
        self.assertNotIn("use_orig_params", fsdp)


class TensorParallelSpecTest(unittest.TestCase):
    def test_fsdp_shards_the_data_parallel_dimension(self):
        p = parse({"strategy": "fsdp", "world_size": 16, "tp": 4, "sequence_parallel": True}).parallel
        self.assertEqual((p.tp, p.sequence_parallel, p.framework, p.shard_size), (4, True, "torchtitan", 4))
        out = p.to_json()
        self.assertEqual((out["tp"], out["shard_size"]), (4, 4))
        self.assertEqual(specmod.parse({"model": "m", "parallel": out}).parallel.to_json(), out)

    def test_without_tp_no_tensor_keys_are_written(self):
        self.assertNotIn("tp", parse({"strategy": "fsdp", "world_size": 2}).parallel.to_json())

    def test_a_framework_without_tp_is_taken_as_the_estimator_takes_it(self):
        p = parse({"strategy": "fsdp", "world_size": 2, "framework": "torchtitan"}).parallel
        self.assertEqual((p.tp, p.framework), (1, "torchtitan"))

    def test_bad_values_name_the_field(self):
        cases = [
            ({"strategy": "fsdp", "world_size": 6, "tp": 4}, "parallel.tp"),
            ({"strategy": "fsdp", "world_size": 4, "tp": 2, "sequence_parallel": "yes"}, "parallel.sequence_parallel"),
            ({"strategy": "fsdp", "world_size": 4, "tp": 2, "framework": "nemo"}, "parallel.framework"),
            ({"strategy": "ddp", "world_size": 4, "tp": 2}, "parallel.tp"),
            ({"strategy": "none", "world_size": 4, "tp": 2, "sequence_parallel": True}, "parallel.strategy"),
            ({"strategy": "none", "world_size": 2, "tp": 2}, "parallel.sequence_parallel"),
            ({"strategy": "fsdp", "world_size": 2, "sequence_parallel": True}, "parallel.sequence_parallel"),
        ]
        for parallel, field in cases:
            with self.subTest(parallel=parallel):
                with self.assertRaises(specmod.SpecError) as err:
                    parse(parallel)
                self.assertIn(field, str(err.exception))
