"""Mixture-of-experts runs: the spec keys (experts_implementation, routing, lora.target_parameters,
the eager-only gpt_oss), the catalog's MoE entries and the bench/moe batch.

The validation tests need no torch. The CPU smoke tests build tiny models of every MoE family the
catalog has and run a forward and backward through the harness's own config and preparation code
(measure._hf_config, measure._prepare) with each experts implementation and with LoRA on the expert
stacks; they are skipped where torch / transformers (or peft, for LoRA) is missing.
"""

import importlib.util
import json
import re
import unittest
from pathlib import Path

from headroom_measure import spec as specmod
from headroom_measure.__main__ import load_catalog
from headroom_measure.measure import default_id, make_record

REPO = Path(__file__).resolve().parents[2]
MOE_SPECS = REPO / "bench" / "moe" / "specs.jsonl"
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]


def _have(*names: str) -> bool:
    return all(importlib.util.find_spec(n) is not None for n in names)


HAVE_TORCH = _have("torch", "transformers")
HAVE_PEFT = HAVE_TORCH and _have("peft")


def _error(raw: dict, catalog: dict | None = None) -> str:
    """The SpecError message of a spec refused by parse or by resolve_model_config."""
    try:
        s = specmod.parse(raw)
        specmod.resolve_model_config(s, catalog or {})
    except specmod.SpecError as err:
        return str(err)
    raise AssertionError(f"accepted: {raw}")


class ExpertsImplementationTest(unittest.TestCase):
    def test_absent_is_transformers_default(self):
        s = specmod.parse({"model": "m"})
        self.assertIsNone(s.experts_implementation)
        self.assertNotIn("experts_implementation", s.to_json())

    def test_each_value_is_kept_and_recorded(self):
        for impl in ("grouped_mm", "eager", "batched_mm"):
            with self.subTest(impl=impl):
                s = specmod.parse({"model": "m", "experts_implementation": impl})
                self.assertEqual(s.experts_implementation, impl)
                self.assertEqual(s.to_json()["experts_implementation"], impl)
                self.assertEqual(specmod.parse(s.to_json()).to_json(), s.to_json())
                self.assertIn(f"experts_{impl}", default_id(s))

    def test_bad_value_names_field_value_and_choices(self):
        for bad in ("deepgemm", "flash", 3, True):
            with self.subTest(bad=bad):
                msg = _error({"model": "m", "experts_implementation": bad})
                for word in ("experts_implementation", repr(bad), "grouped_mm", "eager", "batched_mm"):
                    self.assertIn(word, msg)

    def test_refused_on_a_dense_model(self):
        catalog = load_catalog(None)
        for key, value in (("experts_implementation", "eager"), ("routing", {"max_tokens_per_expert_factor": 2})):
            with self.subTest(key=key):
                msg = _error({"model": "qwen2.5-0.5b", key: value}, catalog)
                for word in (key, "mixture-of-experts", "qwen2"):
                    self.assertIn(word, msg)
        # an expert count makes an unknown model type a mixture-of-experts one
        s = specmod.parse({"model": "x", "experts_implementation": "eager",
                           "model_config": {"model_type": "some_moe", "num_experts": 8}})
        specmod.resolve_model_config(s, {})
        # a config without model_type is left to transformers
        s = specmod.parse({"model": "x", "experts_implementation": "eager", "model_config": {"hidden_size": 8}})
        specmod.resolve_model_config(s, {})

    def test_accepted_on_every_moe_catalog_entry(self):
        catalog = load_catalog(None)
        moe = [n for n, f in catalog.items() if specmod.is_moe(f)]
        self.assertGreaterEqual(len(moe), 10)
        for name in moe:
            attention = "eager" if catalog[name]["model_type"] == "gpt_oss" else "sdpa"
            s = specmod.parse({"model": name, "experts_implementation": "batched_mm", "attention": attention})
            self.assertEqual(specmod.resolve_model_config(s, catalog), catalog[name])


class RoutingTest(unittest.TestCase):
    def test_recorded_as_a_float(self):
        s = specmod.parse({"model": "m", "routing": {"max_tokens_per_expert_factor": 2}})
        self.assertEqual(s.routing, {"max_tokens_per_expert_factor": 2.0})
        self.assertEqual(s.to_json()["routing"], {"max_tokens_per_expert_factor": 2.0})
        self.assertEqual(specmod.parse(s.to_json()).to_json(), s.to_json())
        self.assertIsNone(specmod.parse({"model": "m"}).routing)
        self.assertEqual(specmod.parse({"model": "m", "routing": {"max_tokens_per_expert_factor": 1.0}})
                         .routing["max_tokens_per_expert_factor"], 1.0)

    def test_bad_values(self):
        cases = [
            ({"max_tokens_per_expert_factor": 0.5}, ["routing.max_tokens_per_expert_factor", "0.5", ">= 1.0"]),
            ({"max_tokens_per_expert_factor": True}, ["routing.max_tokens_per_expert_factor", "True", ">= 1.0"]),
            ({"max_tokens_per_expert_factor": "2"}, ["routing.max_tokens_per_expert_factor", "'2'"]),
            ({"max_tokens_per_expert_factor": float("nan")}, ["routing.max_tokens_per_expert_factor", "nan"]),
            ({"max_tokens_per_expert_factor": 2, "capacity": 1}, ["routing", "capacity", "max_tokens_per_expert_factor"]),
            ({}, ["routing", "max_tokens_per_expert_factor"]),
            ([2], ["routing", "[2]", "max_tokens_per_expert_factor"]),
        ]
        for routing, words in cases:
            with self.subTest(routing=routing):
                msg = _error({"model": "m", "routing": routing})
                for word in words:
                    self.assertIn(word, msg)


class LoraTargetParametersTest(unittest.TestCase):
    def test_parameters_alone_target_no_module(self):
        s = specmod.parse({"model": "m", "lora": {"r": 8, "target_parameters": EXPERTS}})
        self.assertEqual((s.lora.targets, s.lora.target_parameters, s.lora.dropout), ([], EXPERTS, 0.0))
        out = s.to_json()["lora"]
        self.assertEqual((out["targets"], out["target_parameters"]), ([], EXPERTS))
        self.assertEqual(specmod.parse(s.to_json()).to_json(), s.to_json())
        self.assertIn("loraparams", default_id(s))

    def test_with_modules_too(self):
        s = specmod.parse({"model": "m", "lora": {"targets": ["q_proj"], "target_parameters": EXPERTS}})
        self.assertEqual((s.lora.targets, s.lora.target_parameters), (["q_proj"], EXPERTS))
        s = specmod.parse({"model": "m", "lora": {"targets": "all-linear", "target_parameters": EXPERTS[:1]}})
        self.assertEqual(s.lora.targets, "all-linear")

    def test_without_parameters_nothing_changes(self):
        s = specmod.parse({"model": "m", "lora": {"r": 8}})
        self.assertEqual((s.lora.targets, s.lora.target_parameters), ("all-linear", None))
        self.assertNotIn("target_parameters", s.to_json()["lora"])

    def test_bad_values(self):
        cases = [
            ({"target_parameters": EXPERTS, "dropout": 0.05}, ["lora.dropout", "0.05", "target_parameters", "0"]),
            ({"targets": [], "dropout": 0.0}, ["lora.targets", "[]", "target_parameters"]),
            ({"target_parameters": []}, ["lora.target_parameters", "[]", "list of parameter names"]),
            ({"target_parameters": "mlp.experts.down_proj"}, ["lora.target_parameters", "'mlp.experts.down_proj'"]),
            ({"target_parameters": [""]}, ["lora.target_parameters"]),
            ({"target_parameters": [3]}, ["lora.target_parameters", "[3]"]),
            ({"target_params": EXPERTS}, ["lora.target_params", "target_parameters"]),
            ({"dropout": 1.5}, ["lora.dropout", "1.5"]),
            ({"dropout": "x"}, ["lora.dropout", "'x'"]),
        ]
        for lora, words in cases:
            with self.subTest(lora=lora):
                msg = _error({"model": "m", "lora": lora})
                for word in words:
                    self.assertIn(word, msg)


class GptOssAttentionTest(unittest.TestCase):
    def test_sdpa_refused_explicit_or_default(self):
        catalog = load_catalog(None)
        for raw in ({"model": "gpt-oss-20b", "attention": "sdpa"}, {"model": "gpt-oss-120b"}):
            with self.subTest(raw=raw):
                msg = _error(raw, catalog)
                for word in ("attention", "sdpa", "gpt_oss runs eager attention only", "use attention: eager"):
                    self.assertIn(word, msg)
        self.assertIn("(the default)", _error({"model": "gpt-oss-20b"}, catalog))

    def test_eager_accepted_and_inline_config_checked_too(self):
        catalog = load_catalog(None)
        s = specmod.parse({"model": "gpt-oss-20b", "attention": "eager"})
        self.assertEqual(specmod.resolve_model_config(s, catalog)["model_type"], "gpt_oss")
        msg = _error({"model": "x", "model_config": {"model_type": "gpt_oss", "hidden_size": 64}})
        self.assertIn("gpt_oss runs eager attention only", msg)
        # the model type is unknown at resolution: transformers decides
        s = specmod.parse({"model": "x", "model_config": {"hidden_size": 64}})
        specmod.resolve_model_config(s, {})


class RecordTest(unittest.TestCase):
    def test_inline_config_travels_with_the_row(self):
        config = {"model_type": "qwen3_moe", "num_hidden_layers": 2}
        s = specmod.parse({"model": "q", "model_config": config, "experts_implementation": "eager"})
        rec = make_record("r", s, [{"fwd_peak": 1}], peak_reserved=1, context=None, context_nvml=None, params=1,
                          trainable_params=1, weights_loaded=1, env={})
        self.assertEqual(rec["spec"]["model_config"], config)
        self.assertEqual(rec["spec"]["experts_implementation"], "eager")
        rec = make_record("r", specmod.parse({"model": "q"}), [{"fwd_peak": 1}], peak_reserved=1, context=None,
                          context_nvml=None, params=1, trainable_params=1, weights_loaded=1, env={})
        self.assertNotIn("model_config", rec["spec"])


class CatalogTest(unittest.TestCase):
    NEW = {
        "qwen3-30b-a3b": "qwen3_moe", "qwen3-235b-a22b": "qwen3_moe", "qwen2-57b-a14b": "qwen2_moe",
        "mixtral-8x7b": "mixtral", "mixtral-8x22b": "mixtral", "olmoe-1b-7b": "olmoe",
        "deepseek-v2-lite": "deepseek_v2", "deepseek-v3": "deepseek_v3", "gpt-oss-20b": "gpt_oss",
        "gpt-oss-120b": "gpt_oss", "gemma-3-1b": "gemma3_text", "gemma-3-4b": "gemma3_text",
        "olmo-2-1124-7b": "olmo2", "glm-4-9b-0414": "glm4",
    }

    def test_entries_and_their_model_types(self):
        catalog = load_catalog(None)
        for name, model_type in self.NEW.items():
            with self.subTest(name=name):
                self.assertEqual(catalog[name]["model_type"], model_type)
                self.assertEqual(specmod.is_moe(catalog[name]), model_type in specmod.MOE_MODEL_TYPES)
        for name in ("gpt-oss-20b", "gpt-oss-120b"):
            layer_types = catalog[name]["layer_types"]
            self.assertEqual(len(layer_types), catalog[name]["num_hidden_layers"])
            self.assertEqual(layer_types[:2], ["sliding_attention", "full_attention"])


class MoeBatchTest(unittest.TestCase):
    """bench/moe/specs.jsonl: one-GPU runs the harness accepts, inline configs that are whole
    catalog entries with only the depth (and named switches) changed."""

    CHANGEABLE = {"num_hidden_layers", "layer_types", "output_router_logits", "first_k_dense_replace"}

    def rows(self):
        return [json.loads(line) for line in MOE_SPECS.read_text().splitlines() if line.strip()]

    def test_every_spec_parses_and_resolves(self):
        catalog = load_catalog(None)
        rows = self.rows()
        self.assertGreaterEqual(len(rows), 28)
        self.assertEqual(len({r["id"] for r in rows}), len(rows))
        for row in rows:
            with self.subTest(id=row["id"]):
                self.assertEqual(set(row), {"id", "spec"})
                s = specmod.parse(row["spec"])
                self.assertIsNone(s.parallel)
                fields = specmod.resolve_model_config(s, catalog)
                self.assertIn(s.model, catalog)
                self.assertEqual(specmod.parse(s.to_json()).to_json(), s.to_json())
                if fields["model_type"] == "gpt_oss":
                    self.assertEqual(s.attention, "eager")
                layers = re.search(r"/L(\d+)", row["id"])
                self.assertIsNotNone(layers)
                self.assertEqual(int(layers.group(1)), fields["num_hidden_layers"])

    def test_inline_configs_are_complete(self):
        catalog = load_catalog(None)
        for row in self.rows():
            config = row["spec"].get("model_config")
            if config is None:
                continue
            with self.subTest(id=row["id"]):
                entry = catalog[row["spec"]["model"]]
                self.assertEqual(set(config), set(entry) | (set(config) & self.CHANGEABLE))
                changed = {k for k in config if config[k] != entry.get(k)}
                self.assertLessEqual(changed, self.CHANGEABLE)
                if "layer_types" in config:
                    self.assertEqual(config["layer_types"], entry["layer_types"][: config["num_hidden_layers"]])


# Tiny configs of every MoE family: real field names, small widths.
TINY = {
    "qwen3_moe": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
                      num_experts_per_tok=2, norm_topk_prob=True, vocab_size=128),
    "qwen2_moe": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, vocab_size=128),
    "mixtral": dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, vocab_size=128),
    "olmoe": dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=4, num_experts=8, num_experts_per_tok=2, vocab_size=128, eos_token_id=1),
    "deepseek_v2": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=32,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                        n_shared_experts=2, num_experts_per_tok=2, first_k_dense_replace=1, n_group=1,
                        topk_group=1, topk_method="greedy", vocab_size=128),
    "deepseek_v3": dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32,
                        qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=8,
                        n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, n_group=2,
                        topk_group=1, vocab_size=128),
    "gpt_oss": dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2,
                    sliding_window=8, layer_types=["sliding_attention", "full_attention"], vocab_size=128),
}
IMPLS = ("grouped_mm", "eager", "batched_mm")


@unittest.skipUnless(HAVE_TORCH, "torch and transformers are not installed")
class CpuSmokeTest(unittest.TestCase):
    """One forward and backward per family and experts path, on CPU, through the harness's code."""

    def run_spec(self, raw: dict, seq: int = 12):
        """(model, loss, calls, experts forwards, aten ops): builds as measure._build does, on CPU."""
        from unittest import mock

        import torch
        from torch.utils._python_dispatch import TorchDispatchMode
        from transformers.integrations import moe as moemod

        from headroom_measure import measure

        s = specmod.parse(raw)
        fields = specmod.resolve_model_config(s, {})
        cfg = measure._hf_config(s, fields)
        dtype = torch.bfloat16 if s.precision == "bf16" else torch.float32
        torch.manual_seed(0)
        model = measure._auto_class(s).from_config(cfg, dtype=dtype, attn_implementation=s.attention)
        in_use = measure.experts_implementation_in_use(model)
        model = measure._prepare(s, model)
        model.train()

        calls = []

        def spy(key, fn):
            def wrapped(*args, **kwargs):
                calls.append(key)
                return fn(*args, **kwargs)

            return wrapped

        forwards = []
        for name, module in model.named_modules():
            if type(module).__name__.endswith("Experts"):
                module.register_forward_hook(lambda *a, n=name: forwards.append(n))

        ops = set()

        class Ops(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                ops.add(func.overloadpacket.__name__)
                return func(*args, **(kwargs or {}))

        ids = torch.randint(0, fields["vocab_size"], (2, seq))
        patched = {k: spy(k, v) for k, v in moemod.ExpertsInterface._global_mapping.items()}
        with mock.patch.dict(moemod.ExpertsInterface._global_mapping, patched), Ops():
            autocast = torch.autocast("cpu", dtype=torch.bfloat16, enabled=s.precision == "amp-bf16")
            with autocast:
                out = model(input_ids=ids, labels=ids)
            out.loss.backward()
        self.assertTrue(torch.isfinite(out.loss.detach()).item())
        return model, out, in_use, calls, forwards, ops

    def test_every_family_and_experts_path(self):
        for mt, tiny in TINY.items():
            for impl in IMPLS:
                with self.subTest(model_type=mt, impl=impl):
                    raw = {"model": mt, "model_config": {"model_type": mt, **tiny}, "precision": "bf16",
                           "experts_implementation": impl, "attention": "eager" if mt == "gpt_oss" else "sdpa"}
                    model, _, in_use, calls, forwards, ops = self.run_spec(raw)
                    self.assertEqual(in_use, impl)
                    self.assertEqual(model.config._experts_implementation, impl)
                    self.assertTrue(forwards, "no experts module ran")
                    if impl == "eager":
                        self.assertEqual(calls, [])  # the class's own per-expert loop
                        self.assertIn("index_add_", ops)
                    else:
                        self.assertEqual(set(calls), {impl})
                        self.assertEqual(len(calls), len(forwards))
                    self.assertEqual("_grouped_mm" in ops, impl == "grouped_mm")
                    grads = [p.grad for n, p in model.named_parameters() if n.endswith("experts.gate_up_proj")]
                    self.assertTrue(grads and all(g is not None for g in grads))

    def test_default_is_grouped_mm(self):
        mt = "qwen3_moe"
        _, _, in_use, calls, _, _ = self.run_spec({"model": mt, "model_config": {"model_type": mt, **TINY[mt]}})
        self.assertEqual((in_use, set(calls)), ("grouped_mm", {"grouped_mm"}))

    def test_dense_model_has_no_experts_path(self):
        cfg = {"model_type": "qwen3", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 1,
               "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 128}
        _, _, in_use, calls, forwards, _ = self.run_spec({"model": "d", "model_config": cfg})
        self.assertEqual((in_use, calls, forwards), (None, [], []))

    def test_aux_loss_on(self):
        for mt in ("qwen3_moe", "mixtral", "gpt_oss"):
            with self.subTest(model_type=mt):
                config = {"model_type": mt, **TINY[mt], "output_router_logits": True}
                raw = {"model": mt, "model_config": config, "attention": "eager" if mt == "gpt_oss" else "sdpa"}
                _, out, _, _, _, _ = self.run_spec(raw)
                self.assertIsNotNone(out.aux_loss)

    def test_amp_bf16_runs_the_experts_in_fp32(self):
        mt = "mixtral"
        model, _, _, calls, _, _ = self.run_spec(
            {"model": mt, "model_config": {"model_type": mt, **TINY[mt]}, "precision": "amp-bf16"}
        )
        self.assertEqual(set(calls), {"grouped_mm"})
        import torch

        self.assertEqual(model.model.layers[0].mlp.experts.gate_up_proj.grad.dtype, torch.float32)

    @unittest.skipUnless(HAVE_PEFT, "peft is not installed")
    def test_lora_on_the_expert_stacks(self):
        import torch

        r = 4
        for mt, tiny in TINY.items():
            for impl in IMPLS:
                for gc in (False, True):
                    with self.subTest(model_type=mt, impl=impl, gradient_checkpointing=gc):
                        raw = {"model": mt, "model_config": {"model_type": mt, **tiny}, "precision": "bf16",
                               "experts_implementation": impl, "gradient_checkpointing": gc,
                               "attention": "eager" if mt == "gpt_oss" else "sdpa",
                               "lora": {"r": r, "alpha": 8, "target_parameters": EXPERTS}}
                        model, _, _, calls, forwards, _ = self.run_spec(raw)
                        self.assertTrue(forwards)
                        if impl != "eager":
                            self.assertEqual(set(calls), {impl})
                        trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
                        self.assertTrue(trainable)
                        experts = model.get_base_model().model.layers[-1].mlp.experts
                        self.assertEqual(type(experts).__name__, "ParamWrapper")
                        base = experts.get_base_layer()
                        E = base.gate_up_proj.shape[0]
                        H, I2 = fields_hi(tiny, mt)
                        I = I2 // 2
                        last = len(model.get_base_model().model.layers) - 1
                        want = {  # lora_A [r*E, in], lora_B [out, r*E]; the outer wrapper is down_proj
                            f"layers.{last}.mlp.experts.base_layer.lora_A.default.weight": (r * E, H),
                            f"layers.{last}.mlp.experts.base_layer.lora_B.default.weight": (I2, r * E),
                            f"layers.{last}.mlp.experts.lora_A.default.weight": (r * E, I),
                            f"layers.{last}.mlp.experts.lora_B.default.weight": (H, r * E),
                        }
                        got = {re.sub(r"^.*?(layers\.)", r"\1", n): tuple(p.shape) for n, p in trainable.items()
                               if f"layers.{last}." in n}
                        self.assertEqual(got, want)
                        for p in trainable.values():
                            self.assertEqual(p.dtype, torch.float32)  # peft upcasts bf16 adapters
                            self.assertIsNotNone(p.grad)
                        frozen = [p for n, p in model.named_parameters() if not p.requires_grad]
                        self.assertTrue(all(p.grad is None for p in frozen))


def fields_hi(tiny: dict, model_type: str) -> tuple[int, int]:
    """(hidden, 2 x expert width) of a tiny config."""
    width = tiny.get("moe_intermediate_size", tiny.get("intermediate_size"))
    if model_type in ("mixtral", "olmoe", "gpt_oss"):
        width = tiny["intermediate_size"]
    return tiny["hidden_size"], 2 * width


@unittest.skipUnless(HAVE_TORCH, "torch and transformers are not installed")
class MetaBuildTest(unittest.TestCase):
    # transformers 5.17's totals for the catalog entries; the MoE ones are the published sizes
    # (/work/research/moe.md 4.7 worked them out by hand).
    TOTALS = {
        "qwen3-30b-a3b": 30_532_122_624, "qwen3-235b-a22b": 235_093_634_560, "qwen2-57b-a14b": 57_408_658_944,
        "mixtral-8x7b": 46_702_792_704, "mixtral-8x22b": 140_620_634_112, "olmoe-1b-7b": 6_919_161_856,
        "deepseek-v2-lite": 15_706_484_224, "deepseek-v3": 671_026_404_352, "gpt-oss-20b": 20_914_757_184,
        "gpt-oss-120b": 116_829_156_672, "gemma-3-1b": 999_885_952, "gemma-3-4b": 3_880_263_168,
        "olmo-2-1124-7b": 7_298_617_344, "glm-4-9b-0414": 9_400_279_040,
    }

    @staticmethod
    def build(s, fields):
        import torch

        from headroom_measure import measure

        cfg = measure._hf_config(s, fields)
        dtype = torch.bfloat16 if s.precision == "bf16" else torch.float32
        with torch.device("meta"):
            return measure._auto_class(s).from_config(cfg, dtype=dtype, attn_implementation=s.attention)

    def test_catalog_totals(self):
        catalog = load_catalog(None)
        for name, total in self.TOTALS.items():
            with self.subTest(name=name):
                attention = "eager" if catalog[name]["model_type"] == "gpt_oss" else "sdpa"
                s = specmod.parse({"model": name, "attention": attention})
                model = self.build(s, specmod.resolve_model_config(s, catalog))
                self.assertEqual(sum(p.numel() for p in model.parameters()), total)

    def test_every_batch_spec_builds(self):
        from headroom_measure import measure

        catalog = load_catalog(None)
        for line in MOE_SPECS.read_text().splitlines():
            row = json.loads(line)
            with self.subTest(id=row["id"]):
                s = specmod.parse(row["spec"])
                fields = specmod.resolve_model_config(s, catalog)
                model = self.build(s, fields)
                self.assertEqual(model.config._attn_implementation, s.attention)
                if specmod.is_moe(fields):
                    self.assertEqual(measure.experts_implementation_in_use(model),
                                     s.experts_implementation or "grouped_mm")
                if s.lora is not None and HAVE_PEFT:
                    model = measure._prepare(s, model)
                    self.assertGreater(sum(p.numel() for p in model.parameters() if p.requires_grad), 0)


if __name__ == "__main__":
    unittest.main()


@unittest.skipUnless(_have("peft"), "peft is not installed")
class TrainerLoraTest(unittest.TestCase):
    """The trainers' harness hands target_parameters to peft as the loop does."""

    def test_target_parameters_reach_the_lora_config(self):
        from headroom_measure import trainers

        ts = trainers.parse({
            "trainer": "hf", "model": "qwen3-30b-a3b", "experts_implementation": "eager",
            "lora": {"r": 8, "targets": [], "target_parameters": ["mlp.experts.gate_up_proj"]},
        })
        cfg = trainers._lora_config(ts)
        self.assertEqual(set(cfg.target_parameters), {"mlp.experts.gate_up_proj"})
        self.assertEqual(ts.base.experts_implementation, "eager")


class TrainerRecordTest(unittest.TestCase):
    """A trainer row keeps its inline model_config, so the row can be estimated again."""

    def test_model_config_is_recorded(self):
        from headroom_measure import trainers

        config = {"model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 2}
        ts = trainers.parse({"trainer": "hf", "model": "qwen3-30b-a3b", "model_config": config})
        self.assertEqual(ts.to_json()["model_config"], config)
