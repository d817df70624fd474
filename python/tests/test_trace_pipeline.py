"""The tracer on pipelines (trace_pipeline.py): several instances of a small model in one process,
phase by phase, with the moves between host and device recorded as CUDA makes them, generation
run to its length, and what cannot be traced refused by instance."""

import importlib.util
import json
import tempfile
import unittest
from collections import Counter

from .test_trace import TINY, has_torch, run
from .test_trace_dist import tiny_parameter_numels, traced

NEW_TOKENS = 8
PIPELINE = {
    "instances": [
        {"name": "actor", **TINY, "precision": "amp-bf16", "gradient_checkpointing": True},
        {"name": "ref", **TINY, "mode": "forward", "optimizer": "none", "home": "cpu"},
        {"name": "scorer", "shares": "actor"},
        {"name": "vllm", "engine": "vllm", **TINY, "mode": "forward", "gpu_memory_utilization": 0.5, "sleep_level": 1},
    ],
    "phases": [
        {"name": "sync", "run": [{"instance": "vllm", "pass": "generate", "new_tokens": NEW_TOKENS}]},
        {"name": "rollout", "run": [{"instance": "actor", "pass": "generate", "new_tokens": NEW_TOKENS}]},
        {"name": "ref_logprob", "run": ["ref"], "offload": [{"instance": "actor", "optimizer": True}]},
        {"name": "score", "run": [{"instance": "scorer", "pass": "forward", "repeat": 2}]},
        {"name": "train", "run": ["actor"]},
    ],
    "iterations": 2,
}  # fmt: skip


def tiny_model_bytes(dtype_bytes: int) -> int:
    """Parameter bytes of TINY's llama (untied embedding and head)."""
    c = TINY["model_config"]
    h, i, heads, kv, layers = (
        c["hidden_size"], c["intermediate_size"], c["num_attention_heads"], c["num_key_value_heads"],
        c["num_hidden_layers"],
    )  # fmt: skip
    head_dim = h // heads
    layer = 2 * h * h + 2 * h * kv * head_dim + 3 * h * i + 2 * h
    return dtype_bytes * (layers * layer + 2 * c["vocab_size"] * h + h)


class RefusalTest(unittest.TestCase):
    def test_an_instance_the_tracer_cannot_run_is_refused_by_name(self):
        raw = json.loads(json.dumps(PIPELINE))
        raw["instances"][0]["parallel"] = {"strategy": "ddp", "world_size": 2, "framework": "megatron"}
        raw["instances"][0]["precision"] = "bf16"
        raw["instances"][0]["gradient_checkpointing"] = False
        with tempfile.TemporaryDirectory() as tmp:
            out = run("trace", "--spec-json", json.dumps(raw), "--out", f"{tmp}/t.json")
        self.assertEqual(out.returncode, 2, out.stderr)
        self.assertIn("instances[0] (actor): `parallel.framework: megatron`", out.stderr)
        self.assertNotIn("Traceback", out.stderr)


def phase_allocations(doc, name, iteration):
    """The storages allocated in the phase `name` of `iteration`, in order."""
    phases = doc["phases"]
    k = next(k for k, p in enumerate(phases) if (p["name"], p.get("iteration")) == (name, iteration))
    end = phases[k + 1]["event"] if k + 1 < len(phases) else len(doc["events"])
    return [doc["storages"][e[1]] for e in doc["events"][phases[k]["event"] : end] if e[0] == "alloc"]


@unittest.skipUnless(has_torch(), "torch and transformers are not installed")
class DdpFsdp1PipelineTest(unittest.TestCase):
    """verl's FSDP1 actor (fp32 under bf16 MixedPrecision) beside an FSDP1 reference under
    CPUOffload, and a DDP policy, rank 0 of 2: each built as run specs trace them."""

    @classmethod
    def setUpClass(cls):
        fsdp1 = {"strategy": "fsdp1", "world_size": 2}
        cls.doc = traced({
            "instances": [
                {"name": "actor", **TINY, "precision": "fp32", "autocast": "bf16",
                 "parallel": {**fsdp1, "mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "fp32"}}},
                {"name": "ref", **TINY, "mode": "forward", "parallel": {**fsdp1, "offload_params": True}},
                {"name": "policy", **TINY, "parallel": {"strategy": "ddp", "world_size": 2}},
            ],
            "phases": [{"name": "ref_logprob", "run": ["ref"]}, {"name": "update_actor", "run": ["actor"]},
                       {"name": "train", "run": ["policy"]}],
            "iterations": 2,
        })  # fmt: skip

    def test_the_reference_shards_live_on_the_host_and_unshard_on_the_device(self):
        layer, _ = tiny_parameter_numels()
        shard = layer * 2 // 2  # a decoder layer's bf16 flat parameter over 2 ranks
        loaded = phase_allocations(self.doc, "load", 0)
        self.assertEqual([s["bytes"] for s in loaded if s["kind"] == "host" and s["op"] == "aten.clone.default"][:2], [shard] * 2)
        unsharded = [s for s in phase_allocations(self.doc, "ref_logprob", 1) if s["op"] == "fsdp1 _alloc_storage"]
        self.assertIn(2 * shard, [s["bytes"] for s in unsharded])
        self.assertTrue(all(s["kind"] != "host" for s in unsharded))

    def test_the_actor_casts_its_shards_on_the_device_without_a_host_copy(self):
        # Offload's copies belong to the reference's handles: the actor's fp32 shards stay put.
        layer, _ = tiny_parameter_numels()
        fp32_shard = layer * 4 // 2
        for it in (0, 1):
            made = phase_allocations(self.doc, "update_actor", it)
            self.assertIn(layer * 2 // 2, [s["bytes"] for s in made if s["op"] == "fsdp1 _alloc_storage"])
            copies = [s for s in made if s["op"] == "aten.clone.default" and s["bytes"] == fp32_shard]
            self.assertEqual(copies, [], f"update_actor {it}")

    def test_the_ddp_policy_has_its_buckets_and_rebuilds_them_in_the_second_step(self):
        model = tiny_model_bytes(2)
        self.assertIn(("gradient", model), [(s["kind"], s["bytes"]) for s in phase_allocations(self.doc, "load", 0)])
        rebuilt = [s["bytes"] for s in phase_allocations(self.doc, "train", 1)
                   if s["kind"] == "gradient" and s["op"] == "aten.empty.memory_format"]  # fmt: skip
        self.assertGreater(len(rebuilt), 1)
        self.assertEqual(sum(rebuilt), model)


@unittest.skipUnless(has_torch("bitsandbytes"), "torch, transformers and bitsandbytes are not installed")
class BitsAndBytesPipelineTest(unittest.TestCase):
    def test_an_8bit_adamw_instance_keeps_one_byte_states(self):
        doc = traced({
            "instances": [{"name": "policy", **TINY, "optimizer": "adamw-8bit"},
                          {"name": "ref", **TINY, "mode": "forward"}],
            "phases": [{"name": "ref_logprob", "run": ["ref"]}, {"name": "train", "run": ["policy"]}],
            "iterations": 1,
        })  # fmt: skip
        h = TINY["model_config"]["hidden_size"]
        states = [s["bytes"] for s in phase_allocations(doc, "train", 0) if s["kind"] == "optimizer_state"]
        self.assertIn(h * h, states, "a q_proj's uint8 state")
        # Two one-byte states per element and their block maxima, where AdamW's are two bf16 ones.
        self.assertLess(sum(states), 3 * tiny_model_bytes(1))


@unittest.skipUnless(has_torch() and importlib.util.find_spec("deepspeed"), "torch or deepspeed is not installed")
class DeepSpeedPipelineTest(unittest.TestCase):
    """A ZeRO-2 policy beside a ZeRO-3 reference whose partitions live on the host (OpenRLHF's
    DPO with `--ref_reward_offload`), each a DeepSpeed engine as the GPU harness builds it."""

    @classmethod
    def setUpClass(cls):
        zero = {**TINY, "precision": "bf16"}
        cls.doc = traced({
            "instances": [
                {"name": "policy", **zero, "parallel": {"strategy": "zero2", "world_size": 1}},
                {"name": "reference", **zero, "mode": "forward",
                 "parallel": {"strategy": "zero3", "world_size": 1, "offload_params": True}},
            ],
            "phases": [{"name": "ref_logprob", "run": ["reference"]}, {"name": "train", "run": ["policy"]}],
            "iterations": 2,
        })  # fmt: skip

    def allocations(self, name, iteration):
        return phase_allocations(self.doc, name, iteration)

    def test_the_policy_flattens_its_parameters_on_the_host_and_moves_them_over(self):
        loaded = self.allocations("load", 0)
        flat = tiny_model_bytes(2)
        self.assertIn(("host", flat), [(s["kind"], s["bytes"]) for s in loaded], "ZeRO-2 flattens on the host")
        self.assertIn(("parameter", flat), [(s["kind"], s["bytes"]) for s in loaded], "then moves it over")

    def test_the_reference_gathers_its_host_partitions_and_the_policy_steps_its_engine(self):
        storages = self.doc["storages"]
        pinned = sum(s["bytes"] for s in storages if s["kind"] == "host" and s["op"] == "aten.empty.memory_format")
        self.assertGreaterEqual(pinned, tiny_model_bytes(2), "every bf16 partition of the reference on the host")
        mlp = 2 * TINY["model_config"]["hidden_size"] * TINY["model_config"]["intermediate_size"]
        gathered = [s for s in self.allocations("ref_logprob", 1) if s["bytes"] == mlp and s["kind"] != "host"]
        self.assertGreaterEqual(len(gathered), 3 * TINY["model_config"]["num_hidden_layers"], "device copies")
        # The engine's Adam states are made in the first train phase and kept.
        first = [s for s in self.allocations("train", 0) if s["op"] == "aten.zeros_like.default"]
        self.assertTrue(first)
        self.assertFalse([s for s in self.allocations("train", 1) if s["op"] == "aten.zeros_like.default"])


@unittest.skipUnless(has_torch(), "torch and transformers are not installed")
class PipelineTraceTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.doc = traced(PIPELINE)

    def phase_events(self, name, iteration):
        phases = self.doc["phases"]
        k = next(k for k, p in enumerate(phases) if (p["name"], p.get("iteration")) == (name, iteration))
        end = phases[k + 1]["event"] if k + 1 < len(phases) else len(self.doc["events"])
        return self.doc["events"][phases[k]["event"] : end]

    def device_allocs(self, events, op):
        storages = self.doc["storages"]
        return [
            storages[e[1]] for e in events if e[0] == "alloc" and storages[e[1]]["op"] == op
            and storages[e[1]]["kind"] != "host"
        ]  # fmt: skip

    def test_phases_are_the_load_then_every_phase_of_every_iteration(self):
        got = [(p["name"], p["iteration"]) for p in self.doc["phases"]]
        names = [p["name"] for p in PIPELINE["phases"]]
        self.assertEqual(got, [("load", 0)] + [(n, it) for it in range(2) for n in names])
        self.assertEqual(self.doc["spec"]["instances"][2], {"name": "scorer", "shares": "actor"})
        self.assertEqual(self.doc["spec"]["instances"][3]["engine"], "vllm")

    def test_every_alloc_is_freed_at_most_once_after_it(self):
        state = {}
        for e in self.doc["events"]:
            if e[0] == "alloc":
                self.assertNotIn(e[1], state)
                state[e[1]] = "live"
            elif e[0] == "free":
                self.assertEqual(state.get(e[1]), "live")
                state[e[1]] = "freed"

    def test_the_host_homed_reference_comes_in_for_its_phase_and_goes_back_out(self):
        # Built on the host: nothing of its build reaches the device.
        load = self.phase_events("load", 0)
        ref = [self.doc["storages"][e[1]] for e in load if e[0] == "alloc"]
        ref = [s for s in ref if s["module"].startswith("ref") or s["kind"] == "host"]
        self.assertTrue(all(s["kind"] == "host" for s in ref if s["op"] != "model.cuda()"))
        for it in range(2):
            events = self.phase_events("ref_logprob", it)
            came_in = self.device_allocs(events, "model.cuda()")
            params = sum(s["bytes"] for s in came_in if s["kind"] == "parameter")
            # The bf16 reference comes in; the fp32 actor, offloaded (parameters by default, its
            # states too), comes back at the phase's end.
            self.assertEqual(params, tiny_model_bytes(2) + tiny_model_bytes(4))
            # `model.cpu()` frees each of them on the device within the phase.
            freed = {e[1] for e in events if e[0] == "free"}
            ref_in = []  # the reference's: the allocations before its pass
            for e in events:
                if e[0] == "alloc" and self.doc["storages"][e[1]]["kind"] != "host":
                    if self.doc["storages"][e[1]]["op"] != "model.cuda()":
                        break
                    ref_in.append(e[1])
            self.assertEqual(len(ref_in), 21 + 2)  # its parameters and rotary buffers
            self.assertTrue(set(ref_in) <= freed)

    def test_optimizer_states_go_out_once_they_exist(self):
        # Iteration 0: the actor has not stepped, it has no states to move.
        self.assertEqual(self.device_allocs(self.phase_events("ref_logprob", 0), "optimizer state .to()"), [])
        back = self.device_allocs(self.phase_events("ref_logprob", 1), "optimizer state .to()")
        self.assertEqual(Counter(s["kind"] for s in back), {"optimizer_state": 2 * len(self.actor_params())})
        self.assertEqual(sum(s["bytes"] for s in back), 2 * tiny_model_bytes(4))

    def actor_params(self):
        return [s for s in self.doc["storages"] if s["kind"] == "parameter" and s["op"] != "model.cuda()"]

    def test_generation_runs_to_its_length(self):
        for it in range(2):
            argmax = [
                s for e in self.phase_events("rollout", it) if e[0] == "alloc"
                for s in [self.doc["storages"][e[1]]] if s["op"] == "aten.argmax.default"
            ]  # fmt: skip
            self.assertEqual(len(argmax), NEW_TOKENS)

    def test_a_rollout_engine_is_listed_and_switched_first_thing_in_a_phase(self):
        self.assertEqual(self.doc["engines"], [{"name": "vllm", "gpu_memory_utilization": 0.5}])
        switches = [e for e in self.doc["events"] if e[0] == "engine"]
        # Created awake after the models, asleep at once; then awake for each `sync` and asleep
        # again for the phase after it.
        self.assertEqual(switches, [["engine", 0, True], ["engine", 0, False]] + [
            ["engine", 0, True], ["engine", 0, False]
        ] * 2)  # fmt: skip
        for it in range(2):
            self.assertEqual(self.phase_events("sync", it)[0], ["engine", 0, True])
            self.assertEqual(self.phase_events("rollout", it)[0], ["engine", 0, False])
            # The engine's phase runs nothing in PyTorch.
            self.assertFalse([e for e in self.phase_events("sync", it) if e[0] == "alloc"])

    def test_each_instances_modules_are_named_under_it(self):
        modules = {s["module"].split(".")[0] for s in self.doc["storages"] if s["module"]}
        self.assertLessEqual({"actor", "ref"}, modules)
        self.assertNotIn("model", modules)


if __name__ == "__main__":
    unittest.main()
