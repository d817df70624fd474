"""TRL's fused LM head under the tracer (trace_trl.py): CUDA's Triton branch with its launches as
no-ops, and the value-dependent mask shapes answered from the batches the harness builds."""

import contextlib
import unittest

from .test_trace import has_torch


def has_trl() -> bool:
    try:
        import trl  # noqa: F401
    except ImportError:
        return False
    return has_torch()


@unittest.skipUnless(has_trl(), "torch, transformers and trl are not installed")
class FusedHeadTest(unittest.TestCase):
    N, H, V, CHUNK = 6, 24, 40, 16

    def run_head(self, triton: bool):
        """Forward and backward of `ChunkedLogProbFunction` on fake bf16 tensors, recorded: the
        storages allocated (op, bytes) and the GEMM markers."""
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode
        from trl.kernels.chunked_logprob import ChunkedLogProbFunction

        from headroom_measure.trace import Recorder
        from headroom_measure.trace_trl import TritonPath

        rec = Recorder()
        with TritonPath(rec) if triton else contextlib.nullcontext(), FakeTensorMode(), rec.mode():
            hidden = torch.empty(self.N, self.H, dtype=torch.bfloat16, requires_grad=True)
            weight = torch.empty(self.V, self.H, dtype=torch.bfloat16, requires_grad=True)
            targets = torch.zeros(self.N, dtype=torch.long)
            start = len(rec.events)
            logprobs, *_ = ChunkedLogProbFunction.apply(hidden, weight, None, targets, 1.0, self.CHUNK, None, 1.0, ("entropy",))
            forward = [rec.storages[e[1]] for e in rec.events[start:] if e[0] == "alloc"]
            start = len(rec.events)
            logprobs.sum().backward()
            backward_events = rec.events[start:]
        backward = [rec.storages[e[1]] for e in backward_events if e[0] == "alloc"]
        gemms = [e for e in backward_events if e[0] == "gemm"]
        return forward, backward, gemms

    def test_the_triton_path_allocates_only_the_wrappers_buffers(self):
        forward, backward, _ = self.run_head(triton=True)
        # the seven per-token fp32 statistics and one bf16 tile, then log_z, log-probs and entropy
        n, tile = self.N * 4, self.N * self.CHUNK * 2
        self.assertEqual(sorted(s["bytes"] for s in forward if s["bytes"] != n), [tile])
        self.assertNotIn("aten._to_copy.default", {s["op"] for s in forward})
        # the fp32 accumulators, the tile, then the casts back to bf16 (plus the sum's gradient)
        sizes = sorted(s["bytes"] for s in backward)
        for expected in (self.N * self.H * 4, self.V * self.H * 4, tile, self.N * self.H * 2, self.V * self.H * 2):
            self.assertIn(expected, sizes)
        self.assertFalse([s for s in backward if s["bytes"] == tile * 2], "an fp32 copy of the tile")

    def test_the_cpu_path_allocates_the_tiles_temporaries(self):
        """What the tracer would see without the Triton branch: the tile folded by torch ops, an
        fp32 copy of it among them."""
        forward, backward, _ = self.run_head(triton=False)
        tile_fp32 = self.N * self.CHUNK * 4
        self.assertIn(tile_fp32, [s["bytes"] for s in forward])
        self.assertIn(tile_fp32, [s["bytes"] for s in backward])

    def test_the_fp32_accumulation_is_a_gemm_that_allocates_nothing(self):
        _, backward, gemms = self.run_head(triton=True)
        chunks = -(-self.V // self.CHUNK)
        # per vocabulary chunk: the tile's GEMM, then the grad-hidden and grad-weight accumulations
        self.assertEqual(len(gemms), 3 * chunks)
        self.assertTrue(all(thread == 1 for _, _, thread in gemms), gemms)


@unittest.skipUnless(has_trl(), "torch, transformers and trl are not installed")
class MaskAnswersTest(unittest.TestCase):
    def recorded(self, answers, body):
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode

        from headroom_measure.trace import Recorder

        rec = Recorder()
        rec.answers = answers
        with FakeTensorMode(), rec.mode():
            out = body(torch)
            shape = tuple(out.shape)
            del out
        return rec, shape

    def test_a_boolean_index_selects_the_known_count_through_nonzero(self):
        from headroom_measure.trace_trl import MaskAnswers

        answers = MaskAnswers()
        answers.learn((3, 7), 12)

        def body(torch):
            hidden = torch.empty(3, 7, 16, dtype=torch.bfloat16)
            mask = torch.empty(3, 7, dtype=torch.bool)
            return hidden[mask]

        rec, shape = self.recorded(answers, body)
        self.assertEqual(shape, (12, 16))
        nonzero = [i for i, s in enumerate(rec.storages) if s["op"] == "aten.nonzero.default"]
        self.assertEqual([rec.storages[i]["bytes"] for i in nonzero], [12 * 2 * 8])
        events = [e for e in rec.events if e[0] in ("alloc", "free")]
        out = next(i for i, s in enumerate(rec.storages) if s["bytes"] == 12 * 16 * 2)
        # the index tensor lives until the gather has allocated its output
        self.assertLess(events.index(["alloc", out]), events.index(["free", nonzero[0]]))

    def test_a_boolean_indexs_gradient_is_scattered_into_its_zeros(self):
        """`IndexBackward0` of a boolean index: `new_zeros` of the input's shape, then the
        gradient put into it in place (out of place only for tensor subclasses)."""
        from headroom_measure.trace_trl import MaskAnswers

        answers = MaskAnswers()
        answers.learn((3, 7), 12)
        full = 3 * 7 * 16 * 2

        def body(torch):
            hidden = torch.empty(3, 7, 16, dtype=torch.bfloat16, requires_grad=True)
            hidden[torch.empty(3, 7, dtype=torch.bool)].sum().backward()
            return hidden.grad

        rec, shape = self.recorded(answers, body)
        self.assertEqual(shape, (3, 7, 16))
        ops = [s["op"] for s in rec.storages if s["bytes"] == full]
        self.assertIn("aten.new_zeros.default", ops)
        self.assertNotIn("aten.index_put.default", ops)

    def test_masked_select_and_index_put_take_the_same_answer(self):
        from headroom_measure.trace_trl import MaskAnswers

        answers = MaskAnswers()
        answers.learn((4,), 0)
        answers.learn((2, 5), 7)

        def selected(torch):
            return torch.empty(2, 5).masked_select(torch.empty(2, 5, dtype=torch.bool))

        self.assertEqual(self.recorded(answers, selected)[1], (7,))

        def put(torch):
            idx = torch.full((4,), 3, dtype=torch.long)
            ended = torch.empty(4, dtype=torch.bool)
            idx[ended] = torch.empty(4, dtype=torch.long)[ended]
            return idx

        self.assertEqual(self.recorded(answers, put)[1], (4,))

    def test_a_mask_of_an_unknown_shape_is_refused_naming_it(self):
        from headroom_measure.trace import TraceError
        from headroom_measure.trace_trl import MaskAnswers

        answers = MaskAnswers()
        answers.learn((3, 7), 12)
        with self.assertRaises(TraceError) as err:
            self.recorded(answers, lambda torch: torch.empty(2, 7)[torch.empty(2, 7, dtype=torch.bool)])
        self.assertIn("[2, 7]", str(err.exception))
        self.assertIn("[3, 7]", str(err.exception))

    def test_the_collators_real_batch_teaches_the_label_masks(self):
        import torch

        from headroom_measure.trace_trl import MaskAnswers, learn_label_masks

        class Trainer:
            pass

        sft = Trainer()
        sft.data_collator = lambda features: {"labels": torch.tensor([[5, 6, -100, -100], [7, 8, 9, 10]])}
        answers = MaskAnswers()
        learn_label_masks(sft, answers)
        sft.data_collator(None)
        self.assertEqual(answers.counts, {(2, 3): 4})

        dpo = Trainer()
        completion = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1], [0, 0, 1, 1], [0, 0, 1, 1]])
        dpo.data_collator = lambda features: {"completion_mask": completion}
        answers = MaskAnswers()
        learn_label_masks(dpo, answers)
        dpo.data_collator(None)
        # chosen (rows 0-1) and rejected (rows 2-3) differ: a half's shape stays unanswered
        self.assertEqual(answers.counts, {(4, 3): 9})
        completion[1, 1] = 0
        dpo.data_collator(None)
        self.assertEqual(answers.counts, {(4, 3): 8, (2, 3): 4})

    def test_grpo_completions_run_to_their_full_length(self):
        from headroom_measure.trace_trl import grpo_masks
        from headroom_measure.trainers import parse

        ts = parse({"trainer": "trl-grpo", "model": "qwen2.5-0.5b", "batch_size": 8, "num_generations": 4,
                    "prompt_len": 32, "completion_len": 16})  # fmt: skip
        rule = grpo_masks(ts).rule
        self.assertEqual(rule((8, 47)), 8 * 16)  # the scored labels: every completion token
        self.assertEqual(rule((16,)), 16)  # one completion's mask keeps every token
        self.assertEqual(rule((8,)), 0)  # no completion ended early
        self.assertIsNone(rule((8, 48)))

    def test_generation_stops_at_its_maximum_length(self):
        from transformers.generation.utils import StopCheck

        from headroom_measure.trace_trl import FullLengthGeneration

        with FullLengthGeneration(48):
            self.assertFalse(StopCheck()(None, None, 47))
            self.assertTrue(StopCheck()(None, None, 48))
        self.assertIsNot(StopCheck.__call__, None)


@unittest.skipUnless(has_trl(), "torch, transformers and trl are not installed")
class TrlTraceTest(unittest.TestCase):
    """The SFT and DPO trainers traced whole: the fused head gathers exactly the valid positions."""

    def trace(self, spec):
        import json
        import tempfile

        from headroom_measure.trace import read_trace

        from .test_trace import run

        with tempfile.TemporaryDirectory() as tmp:
            out = run("trace", "--spec-json", json.dumps(spec), "--out", f"{tmp}/t.json.gz")
            self.assertEqual(out.returncode, 0, out.stderr)
            return read_trace(f"{tmp}/t.json.gz")

    def gathered_hidden_bytes(self, doc):
        return {s["bytes"] for s in doc["storages"] if s["op"] == "aten.index.Tensor"}

    def test_sft_scores_every_next_token(self):
        from .test_trace import TINY

        spec = {**TINY, "trainer": "trl-sft", "max_steps": 1}
        spec.pop("optimizer")
        doc = self.trace(spec)
        hidden, batch, seq = TINY["model_config"]["hidden_size"], TINY["batch_size"], TINY["seq_len"]
        self.assertIn(batch * (seq - 1) * hidden * 2, self.gathered_hidden_bytes(doc))
        self.assertTrue(any(s["op"] == "aten.nonzero.default" for s in doc["storages"]))

    def test_dpo_scores_the_completions_of_chosen_and_rejected(self):
        from .test_trace import TINY

        spec = {**TINY, "trainer": "trl-dpo", "max_steps": 1, "prompt_len": 32}
        spec.pop("optimizer")
        doc = self.trace(spec)
        hidden, batch, seq = TINY["model_config"]["hidden_size"], TINY["batch_size"], TINY["seq_len"]
        self.assertIn(2 * batch * (seq - 32) * hidden * 2, self.gathered_hidden_bytes(doc))

    def test_dpo_precomputes_the_reference_on_the_device_and_hands_the_host_its_values(self):
        from .test_trace import TINY

        spec = {**TINY, "trainer": "trl-dpo", "max_steps": 1, "prompt_len": 32, "precompute_ref_log_probs": True}
        spec.pop("optimizer")
        doc = self.trace(spec)
        names = [p["name"] for p in doc["phases"]]
        self.assertIn("reference precompute", names)
        at = names.index("reference precompute")
        begin, end = doc["phases"][at]["event"], doc["phases"][at + 1]["event"]
        made = [doc["storages"][e[1]] for e in doc["events"][begin:end] if e[0] == "alloc"]
        hidden, batch, seq = TINY["model_config"]["hidden_size"], TINY["batch_size"], TINY["seq_len"]
        batches = 64 // batch  # the harness's 64 rows, at the training batch size
        # each batch copied to the device (ids, attention and completion masks of chosen and
        # rejected rows) and its completions' hidden states gathered by the fused head
        copies = [s for s in made if s["op"] == "aten.clone.default" and s["bytes"] == 2 * batch * seq * 8]
        self.assertEqual(len(copies), 3 * batches)
        completions = 2 * batch * (seq - 32) * hidden * 2
        gathered = [s for s in made if s["op"] == "aten.index.Tensor" and s["bytes"] == completions]
        self.assertEqual(len(gathered), batches)
        # the weights' hash reads them on the host: no fp32 copy of the embedding on the device
        embedding_fp32 = TINY["model_config"]["vocab_size"] * hidden * 4
        casts = [s for s in doc["storages"] if s["op"] == "aten._to_copy.default" and s["bytes"] == embedding_fp32]
        self.assertFalse(casts)


@unittest.skipUnless(has_trl(), "torch, transformers and trl are not installed")
class UniformMaskTest(unittest.TestCase):
    def test_nan_checks_are_false_and_their_negation_selects_everything(self):
        import torch
        from torch._subclasses.fake_tensor import FakeTensorMode

        from headroom_measure.trace import Recorder
        from headroom_measure.trace_trl import MaskAnswers

        rec = Recorder()
        rec.answers = MaskAnswers()
        with FakeTensorMode(), rec.mode():
            rewards = torch.empty(8, 2)
            self.assertFalse(bool(torch.isnan(rewards).all(dim=1).any()))
            self.assertEqual(tuple(rewards[~torch.isnan(rewards)].shape), (16,))
            # a mask of unknown values still reads as the default answer
            self.assertTrue(bool((rewards > 0).any()))
