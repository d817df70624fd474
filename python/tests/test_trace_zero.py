"""The tracer on DeepSpeed ZeRO-2 and ZeRO-3 (trace_zero.py): rank 0 of a fake world on DeepSpeed's
CUDA code path. Under ZeRO-2 the bit16 parameters go to the host and come back as one flat buffer,
as on CUDA, and the fp32 partition is rank 0's share of it; under ZeRO-3 each module's parameters
are gathered whole on the all-gather stream and used on the default one (`record_stream`)."""

import importlib.util
import json
import subprocess
import sys
import tempfile
import unittest
from collections import Counter

from .test_trace import TINY, has_torch, python_env
from .test_trace_dist import tiny_parameter_numels, traced

WORLD = 4
ZERO2 = {**TINY, "parallel": {"strategy": "zero2", "world_size": WORLD}}
ZERO3 = {**TINY, "parallel": {"strategy": "zero3", "world_size": 2}}
# Qwen2's q, k and v biases (256 and 128 long) are no multiple of 48: the reduce-scatter pads the
# last ranks' chunks, the gathers' last pieces are short, and a module's parameters gather together.
ZERO3_UNEVEN = {
    **TINY,
    "model_config": {**TINY["model_config"], "model_type": "qwen2"},
    "parallel": {"strategy": "zero3", "world_size": 48},
}  # fmt: skip
ZERO3_PARAM_OFFLOAD = {**TINY, "parallel": {"strategy": "zero3", "world_size": 1, "offload_params": True}}


def padded_numel(world):
    """TINY's parameters flattened and padded to `nccl_start_alignment_factor` (2) times `world`."""
    layer, root = tiny_parameter_numels()
    numel = TINY["model_config"]["num_hidden_layers"] * layer + root
    return -(-numel // (2 * world)) * 2 * world


def allocations(doc, phase_prefix):
    """The storages allocated in the phases whose names start with `phase_prefix`."""
    phases = doc["phases"]
    out = []
    for p, after in zip(phases, [*phases[1:], {"event": len(doc["events"])}]):
        if p["name"].startswith(phase_prefix):
            out += [doc["storages"][e[1]] for e in doc["events"][p["event"] : after["event"]] if e[0] == "alloc"]
    return out


@unittest.skipUnless(has_torch() and importlib.util.find_spec("deepspeed"), "torch or deepspeed is not installed")
class Zero2Test(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.doc = traced(ZERO2)
        layer, root = tiny_parameter_numels()
        numel = TINY["model_config"]["num_hidden_layers"] * layer + root
        alignment = 2 * WORLD  # `nccl_start_alignment_factor` times the data-parallel ranks
        cls.padded = -(-numel // alignment) * alignment
        cls.numel = numel

    def allocated_at(self, sid):
        return self.doc["events"].index(["alloc", sid])

    def test_the_parameters_are_flattened_on_the_host_and_moved_to_the_device_once(self):
        storages = self.doc["storages"]
        host = [s["bytes"] for s in allocations(self.doc, "load") if s["kind"] == "host"]
        # Each bf16 parameter's `.cpu()` copy, and the flat buffer made of them on the host.
        self.assertEqual(sum(host), 2 * self.numel + 2 * self.padded)
        load_end = next(p["event"] for p in self.doc["phases"] if p["name"] == "step 1 forward")
        flat = [
            i for i, s in enumerate(storages)
            if s["bytes"] == 2 * self.padded and s["kind"] != "host" and self.allocated_at(i) < load_end
        ]  # fmt: skip
        self.assertEqual(len(flat), 1)
        # DeepSpeed empties the cache after the device copies go, before the flat buffer comes.
        cleared = self.doc["events"].index(["empty_cache"])
        self.assertLess(cleared, self.allocated_at(flat[0]))

    def test_the_fp32_partition_is_rank_zeros_share(self):
        storages = self.doc["storages"]
        share = [s for s in storages if s["bytes"] == 4 * self.padded // WORLD and s["kind"] != "host"]
        self.assertTrue(share, "no fp32 partition of rank 0's share")


@unittest.skipUnless(has_torch() and importlib.util.find_spec("deepspeed"), "torch or deepspeed is not installed")
class Zero3Test(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.doc = traced(ZERO3)  # three steps: every rank check read back rank 0's own lists

    def test_gathered_parameters_are_made_on_the_all_gather_stream_and_used_on_the_default_one(self):
        events, storages = self.doc["events"], self.doc["storages"]
        phases = {p["name"]: p["event"] for p in self.doc["phases"]}
        forward = events[phases["step 2 forward"] : phases["step 2 backward"]]
        c = TINY["model_config"]
        h, i, layers, vocab = c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], c["vocab_size"]
        mlp, vocabulary = 2 * h * i, 2 * vocab * h  # bf16 weights no tensor of the model's own matches
        # A coalesced gather's wait makes each parameter whole out of the flat buffer (`torch.cat`).
        gathered = [
            e[1] for e in forward
            if e[0] == "alloc"
            and storages[e[1]]["op"] == "aten.cat.default"
            and storages[e[1]]["bytes"] in (mlp, vocabulary)
        ]  # fmt: skip
        sizes = Counter(storages[sid]["bytes"] for sid in gathered)
        self.assertGreaterEqual(sizes[mlp], 3 * layers, "each layer's MLP weights")
        self.assertGreaterEqual(sizes[vocabulary], 2, "the embedding and the head")
        streams = {storages[sid].get("stream", 0) for sid in gathered}
        self.assertEqual(len(streams), 1)
        self.assertNotIn(0, streams)
        used_on_default = {e[1] for e in events if e[0] == "record_stream" and e[2] == 0}
        self.assertLessEqual(set(gathered), used_on_default)

    def test_each_storage_is_recorded_once_per_stream(self):
        uses = [tuple(e[1:]) for e in self.doc["events"] if e[0] == "record_stream"]
        self.assertTrue(uses)
        self.assertEqual(len(uses), len(set(uses)))

    def test_a_stream_uses_a_storage_only_while_it_lives(self):
        live = set()
        for e in self.doc["events"]:
            if e[0] == "alloc":
                live.add(e[1])
            elif e[0] == "free":
                live.discard(e[1])
            elif e[0] == "record_stream":
                self.assertIn(e[1], live)


def traced_with_deepspeeds_rank_views(spec):
    """`traced(spec)` with DeepSpeed's own per-rank loops, `trace_zero_ranks` left out."""
    from headroom_measure.trace import read_trace

    script = (
        "import sys; from headroom_measure import __main__, trace_zero_ranks; "
        "trace_zero_ranks.without_rank_views = lambda stack: None; sys.exit(__main__.main(sys.argv[1:]))"
    )
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            [sys.executable, "-c", script, "trace", "--spec-json", json.dumps(spec), "--out", f"{tmp}/t.json.gz"],
            capture_output=True, text=True, env=python_env(),
        )  # fmt: skip
        if out.returncode:
            raise AssertionError(out.stderr)
        return read_trace(f"{tmp}/t.json.gz")


@unittest.skipUnless(has_torch() and importlib.util.find_spec("deepspeed"), "torch or deepspeed is not installed")
class RankViewsTest(unittest.TestCase):
    def test_leaving_out_the_per_rank_views_changes_no_event(self):
        doc, reference = traced(ZERO3_UNEVEN), traced_with_deepspeeds_rank_views(ZERO3_UNEVEN)
        for key in ("phases", "storages", "events"):
            self.assertEqual(doc[key], reference[key], key)
        # The reduce-scatter pads short chunks, which the comparison covers: each 128-long k or v
        # bias gradient (2 layers, 2 each) in chunks of 3 leaves rank 42 one element short (2
        # bytes) and ranks 43 to 47 three (6 bytes).
        backward = allocations(doc, "step 2 backward")
        padding = Counter(s["bytes"] for s in backward if s["op"] == "aten.empty.memory_format")
        self.assertGreaterEqual(padding[2], 2 * 2)
        self.assertGreaterEqual(padding[6], 2 * 2 * 5)


@unittest.skipUnless(has_torch() and importlib.util.find_spec("deepspeed"), "torch or deepspeed is not installed")
class Zero3ParamOffloadTest(unittest.TestCase):
    def test_partitions_stay_on_the_host_and_each_gather_copies_them_over(self):
        doc = traced(ZERO3_PARAM_OFFLOAD)
        storages, events = doc["storages"], doc["events"]
        layer, root = tiny_parameter_numels()
        numel = TINY["model_config"]["num_hidden_layers"] * layer + root
        host = sum(s["bytes"] for s in storages if s["kind"] == "host" and s["op"] == "aten.empty.memory_format")
        self.assertGreaterEqual(host, 2 * numel, "every bf16 partition pinned on the host")
        phases = {p["name"]: p["event"] for p in doc["phases"]}
        forward = events[phases["step 2 forward"] : phases["step 2 backward"]]
        mlp = 2 * TINY["model_config"]["hidden_size"] * TINY["model_config"]["intermediate_size"]
        copies = [e[1] for e in forward if e[0] == "alloc" and storages[e[1]]["bytes"] == mlp]
        self.assertTrue(copies and all(storages[sid]["kind"] != "host" for sid in copies), "device copies")


@unittest.skipUnless(has_torch() and importlib.util.find_spec("deepspeed"), "torch or deepspeed is not installed")
class OptimizerOffloadTest(unittest.TestCase):
    """`offload_optimizer`: DeepSpeedCPUAdam's Python runs with its C++ step substituted
    (`trace_zero._HostAdam`); the fp32 masters, their gradients and the moments live on the host."""

    def check(self, doc, fp32_partition_bytes):
        storages = doc["storages"]
        host = Counter(s["bytes"] for s in storages if s["kind"] == "host")
        # The master, its gradient buffer and DeepSpeedCPUAdam's two moments.
        self.assertGreaterEqual(host[fp32_partition_bytes], 4)
        device = [s for s in storages if s["kind"] != "host" and s["bytes"] == fp32_partition_bytes]
        self.assertEqual(device, [], "no fp32 partition on the device")
        # The step runs on the host: the device sees norms and (ZeRO-3) the persistent small
        # parameters gathered again, never a master, gradient or moment.
        stepped = [s["bytes"] for s in allocations(doc, "step 2 optimizer") if s["kind"] != "host"]
        self.assertLess(max(stepped, default=0), fp32_partition_bytes // 4)
        self.assertLess(sum(stepped), fp32_partition_bytes)

    # A world of 4: at 2 an fp32 partition has the bytes of the whole bf16 model.
    def test_zero2_keeps_the_fp32_partition_and_its_step_on_the_host(self):
        world = 4
        doc = traced({**TINY, "parallel": {"strategy": "zero2", "world_size": world, "offload_optimizer": True}})
        padded = padded_numel(world)
        self.check(doc, 4 * padded // world)
        # The bf16 parameters stay on the device as one flat buffer; the device staging buffer of
        # the largest parameter (`temp_grad_buffer_for_gpu_offload`) is made beside it.
        loaded = allocations(doc, "load")
        self.assertEqual([s["kind"] for s in loaded if s["bytes"] == 2 * padded], ["host", "parameter"])
        largest = 2 * TINY["model_config"]["vocab_size"] * TINY["model_config"]["hidden_size"]
        staging = [s for s in loaded if s["bytes"] == largest and s["op"] == "aten.zeros.default"]
        self.assertEqual(sorted(s["kind"] for s in staging), ["host", "temporary"])

    def test_zero3_keeps_the_fp32_partition_and_its_step_on_the_host(self):
        world = 4
        doc = traced({**TINY, "parallel": {"strategy": "zero3", "world_size": world, "offload_optimizer": True}})
        layer, root = tiny_parameter_numels()
        numel = TINY["model_config"]["num_hidden_layers"] * layer + root
        # One sub-group: every parameter's partition, flat (ZeRO-3 pads each parameter to `world`).
        fp32 = [s["bytes"] for s in doc["storages"] if s["kind"] == "host" and s["op"] == "aten._to_copy.default"]
        self.assertTrue(fp32 and min(fp32) >= 4 * numel // world, fp32)
        self.check(doc, max(fp32))


if __name__ == "__main__":
    unittest.main()
