"""The tracer: without torch it says what to install; with torch (and transformers) it traces a
small model under fake tensors and the trace obeys the format (docs/trace-format.md)."""

import json
import os
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

PYTHON_DIR = Path(__file__).resolve().parents[1]
TINY = {
    "model": "tiny-llama",
    "model_config": {
        "model_type": "llama", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000, "max_position_embeddings": 2048,
    },
    "precision": "bf16", "optimizer": "adamw", "batch_size": 2, "seq_len": 128,
}  # fmt: skip


def python_env(env_extra=None) -> dict:
    """This environment with `headroom_measure` importable."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(PYTHON_DIR), os.environ.get("PYTHONPATH", "")]))
    env.update(env_extra or {})
    return env


def run(*args, env_extra=None):
    env = python_env(env_extra)
    return subprocess.run([sys.executable, "-m", "headroom_measure", *args], capture_output=True, text=True, env=env)


def has_torch(*also: str) -> bool:
    """Whether torch, transformers and the modules named in `also` import."""
    import importlib

    try:
        for module in ("torch", "transformers", *also):
            importlib.import_module(module)
    except ImportError:
        return False
    return True


class TraceCliTest(unittest.TestCase):
    def test_without_torch_exits_2_saying_what_to_install(self):
        stub = PYTHON_DIR / "tests" / "no_torch"
        with tempfile.TemporaryDirectory() as tmp:
            out = run(
                "trace", "--spec-json", json.dumps(TINY), "--out", f"{tmp}/t.json",
                env_extra={"PYTHONPATH": f"{stub}{os.pathsep}{PYTHON_DIR}"},
            )  # fmt: skip
            self.assertEqual(out.returncode, 2, out.stderr)
            self.assertIn("pip install torch transformers", out.stderr)
            self.assertNotIn("Traceback", out.stderr)
            self.assertFalse(Path(f"{tmp}/t.json").exists())

    def test_the_eager_experts_loop_in_a_trainer_is_refused_by_name(self):
        with tempfile.TemporaryDirectory() as tmp:
            config = {**TINY["model_config"], "model_type": "qwen3_moe", "moe_intermediate_size": 64,
                      "num_experts": 4, "num_experts_per_tok": 2}  # fmt: skip
            spec = {**TINY, "model_config": config, "experts_implementation": "eager", "trainer": "hf", "max_steps": 1}
            spec.pop("optimizer")
            out = run("trace", "--spec-json", json.dumps(spec), "--out", f"{tmp}/t.json")
            self.assertEqual(out.returncode, 2, out.stderr)
            self.assertIn("`experts_implementation: eager`", out.stderr)
            self.assertIn("max_tokens_per_expert_factor", out.stderr)


@unittest.skipUnless(has_torch(), "torch and transformers are not installed")
class TrainerTraceTest(unittest.TestCase):
    """transformers' `Trainer` itself, traced: its own steps, marked by its callbacks."""

    def test_the_trainers_steps_are_the_phases(self):
        from headroom_measure.trace import read_trace

        spec = {**TINY, "trainer": "hf", "max_steps": 2}
        spec.pop("optimizer")
        with tempfile.TemporaryDirectory() as tmp:
            out = run("trace", "--spec-json", json.dumps(spec), "--out", f"{tmp}/t.json.gz")
            self.assertEqual(out.returncode, 0, out.stderr)
            self.assertIn("tracing step 2 of 2", out.stderr)
            self.assertEqual(out.stdout, "", "the trainer's own printing stays out of stdout")
            trace = read_trace(f"{tmp}/t.json.gz")
        names = [p["name"] for p in trace["phases"]]
        self.assertEqual(names[0], "load")
        for step in (1, 2):
            self.assertEqual(
                [n for n in names if n.startswith(f"step {step} ")],
                [f"step {step} {phase}" for phase in ("forward", "backward", "optimizer", "zero_grad")],
            )
        self.assertEqual(trace["spec"]["trainer"], "hf")
        kinds = {s["kind"] for s in trace["storages"]}
        self.assertTrue({"parameter", "gradient", "optimizer_state"} <= kinds)
        # the trainer's default optimizer is the fused AdamW, whose step counters live on the device
        self.assertNotIn("host", kinds)


@unittest.skipUnless(has_torch(), "torch and transformers are not installed")
class TraceTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        out = run("trace", "--spec-json", json.dumps(TINY), "--out", f"{cls.tmp.name}/t.json.gz")
        assert out.returncode == 0, out.stderr
        from headroom_measure.trace import read_trace

        cls.trace = read_trace(f"{cls.tmp.name}/t.json.gz")

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def test_every_alloc_is_freed_once_and_sizes_are_the_storages(self):
        live = set()
        for event in self.trace["events"]:
            if event[0] == "alloc":
                self.assertNotIn(event[1], live)
                live.add(event[1])
            elif event[0] == "free":
                live.remove(event[1])
        self.assertEqual(live, set(), "the model and optimizer are deleted at the end")

    def test_parameters_are_the_models_bytes(self):
        params = sum(s["bytes"] for s in self.trace["storages"] if s["kind"] == "parameter")
        cfg = TINY["model_config"]
        h, i, v, layers = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"], cfg["num_hidden_layers"]
        kv = h // cfg["num_attention_heads"] * cfg["num_key_value_heads"]
        per_layer = 2 * h * h + 2 * h * kv + 3 * h * i + 2 * h
        self.assertEqual(params, 2 * (2 * v * h + layers * per_layer + h))

    def test_optimizer_states_are_two_fp32_copies_and_step_counters_stay_on_the_host(self):
        kinds = {}
        for s in self.trace["storages"]:
            kinds.setdefault(s["kind"], []).append(s["bytes"])
        params = sum(kinds["parameter"])
        # bf16 parameters: exp_avg and exp_avg_sq in bf16 too (torch.optim keeps the param dtype)
        self.assertEqual(sum(kinds["optimizer_state"]), 2 * params)
        self.assertEqual(len(kinds["host"]), len(kinds["parameter"]))

    def test_phases_and_markers(self):
        names = [p["name"] for p in self.trace["phases"]]
        self.assertEqual(names[0], "load")
        self.assertIn("step 3 optimizer", names)
        kinds = {e[0] for e in self.trace["events"]}
        self.assertTrue({"gemm", "reduce", "attention_backward"} <= kinds)
        # the backward's GEMMs run on the autograd engine's thread
        self.assertEqual({e[2] for e in self.trace["events"] if e[0] == "gemm"}, {0, 1})
        flash = [e for e in self.trace["events"] if e[0] == "attention_backward"]
        self.assertEqual(flash[0][1:], ["flash", 2, 4, 128, 64, True, 2])


@unittest.skipUnless(has_torch(), "torch and transformers are not installed")
class CudaDecisionsTest(unittest.TestCase):
    """Decisions CUDA makes differently from the CPU, which the tracer must take CUDA's way."""

    def trace_of(self, spec):
        from headroom_measure.trace import read_trace

        with tempfile.TemporaryDirectory() as tmp:
            out = run("trace", "--spec-json", json.dumps(spec), "--out", f"{tmp}/t.json.gz")
            self.assertEqual(out.returncode, 0, out.stderr)
            return read_trace(f"{tmp}/t.json.gz")

    def test_lora_dropout_keeps_a_bool_mask(self):
        spec = {**TINY, "lora": {"r": 8, "alpha": 16, "targets": ["q_proj"], "dropout": 0.1}}
        trace = self.trace_of(spec)
        b, s, h = spec["batch_size"], spec["seq_len"], TINY["model_config"]["hidden_size"]
        masks = [x for x in trace["storages"] if x["op"] == "aten.native_dropout.default"]
        # per q_proj call: the output (fp32, as peft casts the input to its fp32 adapters) and its
        # mask (one byte an element)
        self.assertEqual(sorted({x["bytes"] for x in masks}), [b * s * h, 4 * b * s * h])
        self.assertFalse([x for x in trace["storages"] if x["op"] == "aten.bernoulli_.float"])

    def test_a_boolean_mask_becomes_an_additive_one_in_the_querys_dtype(self):
        config = {**TINY["model_config"], "model_type": "mistral", "sliding_window": 64}
        trace = self.trace_of({**TINY, "model_config": config})
        b, s = TINY["batch_size"], TINY["seq_len"]
        additive = [x for x in trace["storages"] if x["op"] == "aten.where.self" and "self_attn" in x["module"]]
        self.assertTrue(additive)
        self.assertEqual({x["bytes"] for x in additive}, {b * s * s * 2})


@unittest.skipUnless(has_torch(), "torch and transformers are not installed")
class CudaKernelsTest(unittest.TestCase):
    """CUDA's kernels where torch's fake implementations differ, in process under `fake_cuda`."""

    def setUp(self):
        sys.path.insert(0, str(PYTHON_DIR))
        self.addCleanup(sys.path.remove, str(PYTHON_DIR))

    def test_grouped_mm_of_fp32_matrices_runs_as_cudas_fallback_does(self):
        import torch

        from headroom_measure.trace import Recorder, fake_cuda

        rec = Recorder()
        with fake_cuda(rec):
            x = torch.randn(64, 32, requires_grad=True)
            w = torch.randn(4, 32, 16, requires_grad=True)
            offs = torch.tensor([16, 32, 48, 64], dtype=torch.int32)
            out = torch._grouped_mm(x, w, offs=offs)
            self.assertEqual((out.shape, out.dtype), (torch.Size([64, 16]), torch.float32))
            out.sum().backward()
            self.assertEqual((x.grad.dtype, w.grad.shape), (torch.float32, w.shape))
            with self.assertRaisesRegex(RuntimeError, "BF16"):
                torch._grouped_mm(x.bfloat16(), w, offs=offs)  # mixed dtypes: CUDA refuses them too
        gemms = [e for e in rec.events if e[0] == "gemm"]
        self.assertEqual(len(gemms), 3, "the forward and the two gradients, each a GEMM")

    def test_torch_rms_norm_is_cudas_fused_kernel(self):
        import torch

        from headroom_measure.trace import Recorder, fake_cuda

        rec = Recorder()
        with fake_cuda(rec):
            norm = torch.nn.RMSNorm(64, dtype=torch.bfloat16)
            x = torch.randn(8, 16, 64, dtype=torch.bfloat16, requires_grad=True)
            first = len(rec.storages)
            out = norm(x)
            # The output in the input's dtype and the fp32 inverse RMS per row; no fp32 copy of the input.
            self.assertEqual(sorted(s["bytes"] for s in rec.storages[first:]), [8 * 16 * 4, 8 * 16 * 64 * 2])
            self.assertEqual(out.dtype, torch.bfloat16)
            first = len(rec.storages)
            out.backward(torch.ones_like(out))
            self.assertEqual((x.grad.dtype, norm.weight.grad.shape), (torch.bfloat16, torch.Size([64])))
            grads = sorted(s["bytes"] for s in rec.storages[first + 1 :])  # after the ones
            self.assertEqual(grads, [64 * 2, 8 * 16 * 64 * 2])

    def test_latent_attentions_narrower_values_take_cudnn(self):
        import torch

        from headroom_measure.cuda_emulation import select_attention_kernel

        def kernel(dtype, qk, v, masked=False):
            q, k = torch.empty(1, 16, 64, qk, dtype=dtype), torch.empty(1, 16, 64, qk, dtype=dtype)
            mask = torch.empty(1, 1, 64, 64, dtype=torch.bool) if masked else None
            return select_attention_kernel(q, k, torch.empty(1, 16, 64, v, dtype=dtype), mask, False)

        self.assertEqual(kernel(torch.bfloat16, 128, 128), "flash")
        self.assertEqual(kernel(torch.bfloat16, 128, 128, masked=True), "cudnn")
        # DeepSeek's MLA: flash needs one head dim; cuDNN takes 192 / 128 on sm90, masked or not
        self.assertEqual(kernel(torch.bfloat16, 192, 128), "cudnn")
        self.assertEqual(kernel(torch.bfloat16, 192, 128, masked=True), "cudnn")
        self.assertEqual(kernel(torch.float32, 192, 128), "efficient")

    def test_bincount_of_topk_indices_has_minlength_bins(self):
        import torch
        from torch._subclasses.fake_tensor import DynamicOutputShapeException

        from headroom_measure.trace import Recorder, fake_cuda

        rec = Recorder()
        with fake_cuda(rec):
            probs = torch.randn(2048, 128).softmax(-1)
            _, chosen = torch.topk(probs, 8, dim=-1)
            first = len(rec.storages)
            counts = torch.bincount(chosen.reshape(-1), minlength=128)
            self.assertEqual((counts.shape, counts.dtype), (torch.Size([128]), torch.long))
            made = [(s["op"], s["bytes"]) for s in rec.storages[first:]]
            self.assertEqual(
                made, [("aten.min.default", 8), ("aten.max.default", 8), ("aten.bincount.default", 128 * 8)]
            )
            with self.assertRaises(DynamicOutputShapeException):
                torch.bincount(chosen.reshape(-1), minlength=64)  # values may reach 127: not bounded by 64
            with self.assertRaises(DynamicOutputShapeException):
                torch.bincount(torch.randint(0, 128, (16,)), minlength=128)  # nothing known of its values
            chosen.add_(1)  # written: the bound no longer holds
            with self.assertRaises(DynamicOutputShapeException):
                torch.bincount(chosen.reshape(-1), minlength=128)
            _, again = torch.topk(probs, 8, dim=-1)
            torch.add(again, 1, out=again)  # written through `out=`
            with self.assertRaises(DynamicOutputShapeException):
                torch.bincount(again.reshape(-1), minlength=128)


@unittest.skipUnless(has_torch(), "torch and transformers are not installed")
class OtherLibrariesAutocastTest(unittest.TestCase):
    """A library that registers CUDA autocast kernels of its own (as torchvision does) changes
    nothing for code that does not call them; calling one under autocast is refused by name."""

    def setUp(self):
        import torch

        sys.path.insert(0, str(PYTHON_DIR))
        self.addCleanup(sys.path.remove, str(PYTHON_DIR))
        self.lib = torch.library.Library("headroom_test_autocast", "DEF")
        self.addCleanup(self.lib._destroy)
        for name in ("cuda_cast", "cpu_cast"):
            self.lib.define(f"{name}(Tensor x) -> Tensor")
            self.lib.impl(name, lambda x: x.clone(), "CompositeExplicitAutograd")
        to_fp32 = lambda x: x.float()  # noqa: E731 - what torchvision's autocast kernels do
        self.lib.impl("cuda_cast", to_fp32, "AutocastCUDA")
        self.lib.impl("cpu_cast", to_fp32, "AutocastCPU")

    def test_only_a_call_under_autocast_is_refused(self):
        import torch

        from headroom_measure.cuda_emulation import CudaEmulation, EmulationError

        ops = torch.ops.headroom_test_autocast
        x = torch.randn(4, 4, dtype=torch.bfloat16)
        with CudaEmulation():
            self.assertEqual(ops.cuda_cast(x).dtype, torch.bfloat16)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                self.assertEqual(torch.mm(x.float(), x.float()).dtype, torch.bfloat16)
                with self.assertRaisesRegex(EmulationError, "headroom_test_autocast::cuda_cast"):
                    ops.cuda_cast(x)
                # no CUDA autocast kernel: CUDA passes it through, whatever the CPU's does
                self.assertEqual(ops.cpu_cast(x).dtype, torch.bfloat16)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            self.assertEqual(ops.cpu_cast(x).dtype, torch.float32, "the library's own kernel is back")


if __name__ == "__main__":
    unittest.main()


class TraceFileTest(unittest.TestCase):
    """Version 2 of the file (`compact`) holds exactly what version 1 does (`expand`)."""

    DOC = {
        "format": "headroom-trace", "version": 1, "spec": {}, "env": {},
        "phases": [{"name": "load", "event": 0}],
        "storages": [
            {"bytes": 4096, "kind": "parameter", "op": "aten.empty", "module": "lm_head"},
            {"bytes": 512, "kind": "temporary", "op": "aten.mm", "module": "", "stream": 2},
            {"bytes": 512, "kind": "temporary", "op": "aten.mm", "module": ""},
        ],
        "events": [["alloc", 0], ["alloc", 2], ["gemm", False, 1], ["alloc", 1], ["free", 1], ["free", 0],
                   ["empty_cache"]],
    }  # fmt: skip

    def test_compact_then_expand_gives_the_trace_back(self):
        from headroom_measure.trace import compact, expand

        small = compact(self.DOC)
        self.assertEqual(small["version"], 2)
        self.assertEqual(small["storages"]["names"]["op"], ["aten.empty", "aten.mm"])
        self.assertEqual(small["storages"]["stream"], [0, 2, 0])
        # storage 2 allocated out of order stays a list; the frees count back from the allocations
        self.assertEqual(small["events"], [0, ["alloc", 2], ["gemm", False, 1], ["alloc", 1], 2, 3, ["empty_cache"]])
        self.assertEqual(expand(small), self.DOC)
        self.assertIs(compact(small), small)
