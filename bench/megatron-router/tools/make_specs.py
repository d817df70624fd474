"""Writes bench/megatron-router/specs.jsonl: Megatron-core MoE runs with the router settings Megatron-LM's and
slime's MoE recipes use, none measured before: the router in fp32 (`moe_router_dtype`), the Switch load-balancing
loss (`moe_aux_loss_coeff` under `aux_loss` balancing), the whole MoE layer recomputed (`moe_layer_recompute`, or
`recompute_modules` with `moe`), and a dense layer's MLP recomputed (`recompute_modules` with `mlp`). Every line is a
fake-group rank."""
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "megatron" / "tools"))
from rows import DENSE_MODELS, MOE_MODELS, MORE_MODELS, layout_keys, line, recompute_keys  # noqa: E402

MODELS = {**DENSE_MODELS, **MOE_MODELS, **MORE_MODELS}

FP32 = {"moe_router_dtype": "fp32"}
AUX = {"moe_aux_loss_coeff": 1e-3}
# Megatron-LM's examples/post_training/modelopt/conf/qwen/Qwen3-30B-A3B.sh
RECIPE = {**FP32, **AUX, "moe_router_load_balancing_type": "aux_loss", "moe_layer_recompute": True}

# (model, layers, batch, seq, world, {tp, sp, pp, vpp, mb, ep, etp}, distributed optimizer, recompute, router
#  settings, ranks, snapshot of the first rank)
ROWS = [
    ("q30", 4, 2, 2048, 8, {"ep": 8}, True, None, FP32, [0], True),
    ("q30", 4, 2, 2048, 8, {"ep": 8}, True, None, AUX, [0], True),
    ("q30", 4, 2, 2048, 8, {"ep": 8}, True, None, RECIPE, [0], True),
    ("q30", 4, 2, 2048, 16, {"tp": 2, "sp": True, "ep": 8}, True, None, RECIPE, [0], False),
    ("q30", 4, 4, 1024, 8, {"ep": 4, "etp": 2}, False, None, FP32, [0], False),
    ("q30", 4, 4, 1024, 8, {"pp": 2, "mb": 4, "ep": 4}, True, ("selective", None, None),
     {**FP32, "recompute_modules": ["moe"]}, [0, 4], False),
    ("q30", 4, 2, 2048, 8, {"ep": 8}, False, ("selective", None, None), {"recompute_modules": ["moe"]}, [0], False),
    ("q30", 4, 4, 1024, 8, {"pp": 2, "vpp": 2, "mb": 4, "ep": 2}, True, None, {**FP32, **AUX}, [0, 4], False),
    ("mx7", 2, 1, 4096, 8, {"ep": 8}, True, None, {"moe_aux_loss_coeff": 1e-2}, [0], False),
    ("mx7", 2, 1, 4096, 8, {"ep": 4}, False, ("full", "uniform", 1), {**FP32, **AUX}, [0], False),
    ("q235", 2, 1, 4096, 16, {"ep": 16}, True, None, FP32, [0], False),
    ("q3-8b", 4, 2, 2048, 2, {"tp": 2}, False, ("selective", None, None), {"recompute_modules": ["core_attn", "mlp"]},
     [0], False),
    ("l8b", 4, 1, 4096, 1, {}, False, ("selective", None, None), {"recompute_modules": ["mlp"]}, [0], False),
]


# A second call, estimated after the first call's fix: the settings together with tensor, pipeline and expert
# tensor parallelism, Qwen3-235B's experts over a pipeline, a dense MLP recomputed inside a pipeline, and the loss
# recomputed under full block recomputation.
CALL2 = [
    ("mx7", 2, 2, 2048, 16, {"tp": 2, "sp": True, "ep": 8}, True, None,
     {**FP32, "moe_aux_loss_coeff": 1e-2, "moe_layer_recompute": True}, [0], False),
    ("q235", 2, 2, 2048, 32, {"pp": 2, "mb": 2, "ep": 16}, True, None, {**FP32, **AUX}, [0, 16], False),
    ("q30", 4, 4, 1024, 16, {"tp": 2, "sp": True, "pp": 2, "mb": 4, "ep": 4}, True, ("selective", None, None),
     {**FP32, "recompute_modules": ["core_attn", "moe"]}, [0, 8], False),
    ("q30", 4, 2, 2048, 8, {"ep": 2, "etp": 2}, True, None, RECIPE, [0], False),
    ("q3-8b", 4, 2, 2048, 4, {"tp": 2, "pp": 2, "mb": 2}, False, ("selective", None, None),
     {"recompute_modules": ["mlp"]}, [0, 2], False),
    ("q30", 4, 2, 2048, 8, {"ep": 8}, True, ("full", "block", 2), AUX, [0], False),
]


def tag_of(router: dict) -> str:
    parts = []
    if router.get("moe_router_dtype"):
        parts.append("fp32")
    if router.get("moe_aux_loss_coeff"):
        parts.append(f"aux{router['moe_aux_loss_coeff']:g}")
    if router.get("moe_layer_recompute"):
        parts.append("moerc")
    if router.get("recompute_modules"):
        parts.append("+".join(router["recompute_modules"]))
    if router.get("make_vocab_size_divisible_by"):
        parts.append(f"vocab{router['make_vocab_size_divisible_by']}")
    if router.get("optimizer_cpu_offload"):
        parts.append("offload")
    if router.get("overlap_cpu_optimizer_d2h_h2d"):
        parts.append("overlap")
    return "-".join(parts)


def rows(key, layers, b, s, world, lay, dist_opt, recompute, router, ranks, snapshot, prefix="megatron-router"):
    model, config = MODELS[key]
    mega = {"distributed_optimizer": dist_opt}
    rc = recompute_keys(mega, recompute)
    mega.update(router)
    parallel, tag = layout_keys(world, lay, mega)
    tag += "-do" if dist_opt else "-nodo"
    for rank in ranks:
        staged = parallel.get("pp", 1) > 1 or rank != 0
        rid = f"{prefix}/{key}-L{layers}/bs{b}/s{s}/{tag}/{rc}/{tag_of(router)}" + (
            f"/rank{rank}" if staged else "")
        yield line(rid, model, config, layers, b, s, dict(parallel), dict(mega), snapshot and rank == ranks[0],
                   rank=rank)


if __name__ == "__main__":
    for name, table in [("specs.jsonl", ROWS), ("specs-call2.jsonl", CALL2)]:
        out = Path(__file__).resolve().parents[1] / name
        lines = [json.dumps(r) for spec in table for r in rows(*spec)]
        out.write_text("".join(l + "\n" for l in lines))
        print(out, len(lines))
