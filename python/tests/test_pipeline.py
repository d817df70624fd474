"""Pipeline specs the harness measures (bench/pipelines/*, examples/seed00*.yaml): parsing and
validation, without torch."""

import json
import unittest
from pathlib import Path

from headroom_measure.pipeline import PLACEMENTS, is_pipeline, load_pipeline, parse_pipeline
from headroom_measure.spec import SpecError

REPO = Path(__file__).resolve().parents[2]
POLICY = {"model": "qwen2.5-1.5b", "precision": "amp-bf16", "batch_size": 4, "seq_len": 1024}
REFERENCE = {"model": "qwen2.5-1.5b", "precision": "bf16", "batch_size": 4, "seq_len": 1024}

try:
    import yaml  # noqa: F401

    HAVE_YAML = True
except ImportError:
    HAVE_YAML = False


def general(**over):
    raw = {
        "instances": [
            {"name": "actor", **POLICY, "gradient_checkpointing": True},
            {"name": "ref", **REFERENCE, "mode": "forward", "home": "cpu"},
            {"name": "scorer", "shares": "actor"},
        ],
        "phases": [
            {"name": "rollout", "run": [{"instance": "actor", "pass": "generate", "new_tokens": 256}]},
            {"name": "ref_logprob", "run": ["ref"], "offload": ["actor"]},
            {"name": "score", "run": [{"instance": "scorer", "pass": "forward", "repeat": 2}]},
            {"name": "train", "run": ["actor"]},
        ],
    }
    raw.update(over)
    return raw


class DeepSpeedInstancesTest(unittest.TestCase):
    def test_zero_engines_train_and_a_zero3_reference_infers(self):
        raw = general()
        raw["instances"][0].update(precision="bf16", parallel={"strategy": "zero2", "world_size": 2})
        raw["instances"][1].update(home="gpu", parallel={"strategy": "zero3", "world_size": 2, "offload_params": True})
        pipe = parse_pipeline(raw)
        self.assertEqual(pipe.world_size, 2)
        self.assertEqual([i.spec.parallel.strategy for i in pipe.instances], ["zero2", "zero3"])
        self.assertTrue(pipe.instances[1].spec.parallel.offload_params)


class LegacyFormTest(unittest.TestCase):
    def test_committed_specs_parse(self):
        files = sorted((REPO / "bench" / "pipelines").glob("*.json"))
        self.assertGreaterEqual(len(files), 5)
        for f in files:
            with self.subTest(file=f.name):
                pipe = parse_pipeline(json.loads(f.read_text()))
                self.assertIn(pipe.placement, PLACEMENTS)
                self.assertEqual([i.name for i in pipe.instances], ["policy", "reference"])
                self.assertEqual(pipe.instances[1].spec.mode, "forward")
                self.assertEqual(pipe.instances[1].spec.optimizer, "none")
                self.assertEqual([p.name for p in pipe.phases], ["ref_logprob", "train"])

    def test_defaults(self):
        pipe = parse_pipeline({"policy": POLICY, "reference": REFERENCE})
        self.assertEqual((pipe.placement, pipe.iterations, pipe.world_size), ("resident", 3, 0))
        self.assertEqual(pipe.instances[1].home, "gpu")
        self.assertEqual(pipe.phases[0].offload, [])

    def test_placements(self):
        manual = parse_pipeline({"policy": POLICY, "reference": REFERENCE, "placement": "manual-offload"})
        self.assertEqual(manual.instances[1].home, "cpu")
        self.assertEqual(manual.phases[0].offload, [0])
        fsdp = parse_pipeline({"policy": POLICY, "reference": REFERENCE, "placement": "fsdp2-offload"})
        ref = fsdp.instances[1]
        self.assertTrue(ref.host_fsdp)
        self.assertEqual((ref.world_size, fsdp.world_size), (0, 0))  # its own group, no torchrun
        self.assertEqual(fsdp.phases[0].offload, [])

    def test_bad_values(self):
        cases = [
            ({"reference": REFERENCE}, "policy"),
            ({"policy": POLICY, "reference": REFERENCE, "placement": "disk"}, "placement"),
            ({"policy": POLICY, "reference": REFERENCE, "iterations": 0}, "iterations"),
            ({"policy": POLICY, "reference": dict(REFERENCE, seq_len=512)}, "seq_len"),
            ({"policy": dict(POLICY, batch_size=0), "reference": REFERENCE}, "policy.batch_size"),
            ({"policy": dict(POLICY, mode="forward"), "reference": REFERENCE}, "policy.mode"),
            ({"policy": POLICY, "reference": REFERENCE, "phases": []}, "phases"),
        ]
        for raw, word in cases:
            with self.subTest(word=word):
                with self.assertRaises(SpecError) as ctx:
                    parse_pipeline(raw)
                self.assertIn(word, str(ctx.exception))


class GeneralFormTest(unittest.TestCase):
    def test_parses(self):
        pipe = parse_pipeline(general())
        self.assertEqual([i.name for i in pipe.instances], ["actor", "ref"])
        self.assertEqual(pipe.instances[0].aliases, ["scorer"])
        self.assertEqual(pipe.instances[1].home, "cpu")
        self.assertEqual(pipe.instances[1].spec.optimizer, "none")
        rollout, ref, score, train = pipe.phases
        self.assertEqual((rollout.passes[0].kind, rollout.passes[0].new_tokens), ("generate", 256))
        self.assertEqual((ref.passes[0].kind, ref.offload), ("forward", [0]))  # default: the mode
        self.assertEqual((score.passes[0].instance, score.passes[0].repeat, score.passes[0].name), (0, 2, "scorer"))
        self.assertEqual(train.passes[0].kind, "train")
        self.assertEqual((pipe.iterations, pipe.world_size), (3, 0))

    def test_sharded_instances_need_one_world(self):
        raw = general()
        raw["instances"][0]["parallel"] = {"strategy": "fsdp", "world_size": 2}
        raw["instances"][1]["home"] = "gpu"
        self.assertEqual(parse_pipeline(raw).world_size, 2)
        # A forward-only instance may be sharded too (a single run may not).
        raw["instances"][1]["parallel"] = {"strategy": "ddp", "world_size": 4}
        with self.assertRaises(SpecError) as ctx:
            parse_pipeline(raw)
        self.assertIn("instances[1].parallel.world_size", str(ctx.exception))
        raw["instances"][1]["parallel"] = {"strategy": "ddp", "world_size": 2}
        self.assertEqual(parse_pipeline(raw).world_size, 2)

    def assertRejects(self, raw, *words):
        with self.assertRaises(SpecError) as ctx:
            parse_pipeline(raw)
        for word in words:
            self.assertIn(word, str(ctx.exception))

    def test_errors_name_field_value_and_allowed(self):
        g = general
        runs = lambda *r: [{"name": "p", "run": list(r)}]  # noqa: E731
        ref_cpu_sharded = general()
        ref_cpu_sharded["instances"][1]["parallel"] = {"strategy": "fsdp", "world_size": 2}
        zero2_ref = general()
        zero2_ref["instances"][1].update(home="gpu", parallel={"strategy": "zero2", "world_size": 2})
        nf4_cpu = general()
        nf4_cpu["instances"][1].update(quantization="nf4")
        cases = [
            (g(stages=[]), ["`stages`", "instances, phases, iterations"]),
            (g(instances=[]), ["`instances`", "non-empty list"]),
            (g(phases="train"), ["`phases`", "'train'"]),
            (g(iterations=0), ["`iterations`", "0", "1 to 100"]),
            (g(instances=[{"model": "qwen2.5-0.5b"}]), ["instances[0].name", "None"]),
            (g(instances=[{"name": "a", **POLICY}, {"name": "a", **POLICY}]), ["instances[1].name", "'a'", "different"]),
            (g(instances=[{"name": "a", "shares": "b"}]), ["instances[0].shares", "'b'", "listed before"]),
            (g(instances=[{"name": "a", **POLICY}, {"name": "b", "shares": "a", "seq_len": 8}]), ["instances[1].seq_len"]),
            (g(instances=[{"name": "a", **POLICY, "home": "disk"}]), ["instances[0].home", "'disk'", "gpu or cpu"]),
            (g(instances=[{"name": "a", **dict(POLICY, batch_size=0)}]), ["instances[0].batch_size", "0"]),
            (g(instances=[{"name": "a", **POLICY, "colour": 1}]), ["instances[0].colour"]),
            (ref_cpu_sharded, ["instances[1].home", "'cpu'", "home: gpu"]),
            (zero2_ref, ["instances[1].parallel.strategy", "'zero2'", "leave parallel out", "zero3"]),
            (nf4_cpu, ["instances[1].home", "4-bit"]),
            (g(phases=runs("nobody")), ["phases[0].run[0]", "'nobody'", "actor, scorer, ref"]),
            (g(phases=runs({"instance": "nobody"})), ["phases[0].run[0].instance", "'nobody'"]),
            (g(phases=runs({"instance": "ref", "pass": "train"})), ["phases[0].run[0].pass", "'train'", "mode: forward"]),
            (g(phases=runs({"instance": "actor", "pass": "sample"})), ["phases[0].run[0].pass", "'sample'", "train, forward, generate"]),
            (g(phases=runs({"instance": "actor", "pass": "generate"})), ["phases[0].run[0].new_tokens", "None", ">= 1"]),
            (g(phases=runs({"instance": "actor", "pass": "generate", "new_tokens": 0})), ["new_tokens", "0"]),
            (g(phases=runs({"instance": "actor", "pass": "generate", "new_tokens": 1024})), ["new_tokens", "1024", "fewer than 1024"]),
            (g(phases=runs({"instance": "actor", "pass": "forward", "new_tokens": 8})), ["new_tokens", "8", "pass: generate"]),
            (g(phases=runs({"instance": "actor", "repeat": 0})), ["phases[0].run[0].repeat", "0", "1 to 64"]),
            (g(phases=runs({"instance": "actor", "times": 2})), ["phases[0].run[0].times", "instance, pass, repeat, new_tokens"]),
            (g(phases=runs(3)), ["phases[0].run[0]", "3"]),
            (g(phases=[{"name": "load", "run": []}]), ["phases[0].name", "'load'"]),
            (g(phases=[{"name": "p"}]), ["phases[0].run", "None"]),
            (g(phases=[{"name": "p", "run": ["actor"], "offload": ["actor"]}]), ["phases[0].offload[0]", "'actor'", "cannot be offloaded"]),
            (g(phases=[{"name": "p", "run": ["scorer"], "offload": ["actor"]}]), ["phases[0].offload[0]", "cannot be offloaded"]),
            (g(phases=[{"name": "p", "run": ["actor"], "offload": ["ghost"]}]), ["phases[0].offload[0]", "'ghost'"]),
            (g(phases=[{"name": "p", "run": ["actor"], "when": 1}]), ["phases[0].when", "name, run, offload"]),
            (g(instances=[{"name": "a", **POLICY, "engine": "vllm"}]), ["instances[0].engine", "'vllm'", "not measured"]),
        ]
        for raw, words in cases:
            with self.subTest(words=words):
                self.assertRejects(raw, *words)

    @unittest.skipUnless(HAVE_YAML, "pyyaml is not installed")
    def test_example_and_bench_yaml_parse(self):
        import yaml

        files = sorted((REPO / "examples").glob("*.yaml")) + sorted((REPO / "bench" / "pipelines").glob("*.yaml"))
        files = [f for f in files if is_pipeline(yaml.safe_load(f.read_text()))]
        self.assertGreaterEqual(len(files), 4)
        for f in files:
            with self.subTest(file=f.name):
                try:
                    raw, pipe = load_pipeline(str(f))
                except SpecError as err:  # a rollout engine (vLLM) is estimated, not measured
                    self.assertIn(".engine`", str(err))
                    continue
                self.assertTrue(pipe.phases)
        raw, pipe = load_pipeline(str(REPO / "examples" / "seed000-reuse.yaml"))
        self.assertEqual((pipe.world_size, pipe.instances[0].aliases), (2, ["mi_model"]))
        for f in sorted((REPO / "bench" / "pipelines" / "frameworks").glob("*.yaml")):
            with self.subTest(file=f.name):
                raw, pipe = load_pipeline(str(f))
                self.assertEqual(pipe.world_size, 8)
        worlds = {"verl-fsdp1-q7b-w8": 8, "dpo-ddp-q1.5b-w4": 4, "dpo-ddp-8bit-q1.5b-w2": 2, "dpo-qlora-q3b": 0}
        for name, world in worlds.items():
            with self.subTest(file=name):
                raw, pipe = load_pipeline(str(REPO / "bench" / "pipelines" / "ddp-fsdp1" / f"{name}.yaml"))
                self.assertEqual(pipe.world_size, world)

    def test_offload_items_move_parameters_optimizer_states_or_both(self):
        def phases(*items):
            raw = {
                "instances": [
                    {"name": "actor", "model": "m", "batch_size": 1, "seq_len": 64},
                    {"name": "ref", "model": "m", "mode": "forward", "batch_size": 1, "seq_len": 64},
                ],
                "phases": [{"name": "score", "run": ["ref"], "offload": list(items)}],
            }
            return parse_pipeline(raw).phases[0]

        both = phases({"instance": "actor", "optimizer": True})
        self.assertEqual((both.offload, both.offload_optimizer), ([0], [0]))
        states = phases({"instance": "actor", "params": False, "optimizer": True})
        self.assertEqual((states.offload, states.offload_optimizer), ([], [0]))
        for item, words in [
            ({"instance": "actor", "params": False}, "or both"),
            ({"instance": "actor", "grads": True}, "grads"),
            ({"instance": "actor", "optimizer": "yes"}, "true or false"),
        ]:
            with self.subTest(item=item):
                with self.assertRaises(SpecError) as ctx:
                    phases(item)
                self.assertIn(words, str(ctx.exception))

def has_torch() -> bool:
    import importlib.util

    return importlib.util.find_spec("torch") is not None


@unittest.skipUnless(has_torch(), "torch is not installed")
class FakeGroupDdpTest(unittest.TestCase):
    def test_ddp_steps_under_the_fake_group_with_the_bucket_as_its_reduction(self):
        import torch
        import torch.distributed as dist
        from torch.testing._internal.distributed.fake_pg import FakeStore

        from headroom_measure.pipeline import _bucket_as_reduced

        dist.init_process_group("fake", rank=0, world_size=4, store=FakeStore())
        self.addCleanup(dist.destroy_process_group)
        plain = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
        with self.assertRaises(RuntimeError):  # the fake group's work holds no reduced bucket
            plain(torch.randn(2, 8)).sum().backward()
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(8, 8))
        model.register_comm_hook(None, _bucket_as_reduced)
        x = torch.randn(2, 8)
        for _ in range(2):  # the second backward runs on the rebuilt buckets
            model.zero_grad()
            model(x).sum().backward()
        expected = torch.ones(8, 1) * x.sum(0)  # each rank's own gradient: nothing is averaged
        torch.testing.assert_close(model.module.weight.grad, expected)


if __name__ == "__main__":
    unittest.main()
