"""Writes the spec files of bench/cross-holdout: combinations of features headroom was measured on only
separately (real trainers x mixture-of-experts models, FSDP2 with a MixedPrecisionPolicy on MoE models,
transformers 4.55-4.57 x MoE and x trainers, LoRA on MoE under trainers). Each line is {id, spec} plus,
where it applies, `versions` (the transformers release the run uses; the harness spec carries no `versions`,
headroom's estimate gets it merged in), `fake` (fsdp lines: rank 0 of a fake process group) and `snapshot`.

    python3 bench/cross-holdout/tools/make_specs.py

Files (each run by one harness):
  specs-trainers.jsonl          python -m headroom_measure.trainers (transformers 5.17, TRL 1.16, .whl-trl)
  specs-trainers-4.57.1.jsonl   the same harness under transformers 4.57.1 (TRL 1.16, datasets 4.8.4)
  specs-fsdp2-mp.jsonl          python -m headroom_measure dist, fake process group of 8 (bench/fsdp2-mp/tools/run.sh)
  specs-older-<release>.jsonl   python -m headroom_measure batch under transformers <release>
"""
import json
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
CAT = json.loads((HERE.parents[1] / "crates/headroom/data/models.json").read_text())["models"]
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
LORA_ATTN = {"r": 16, "alpha": 32, "targets": ATTN, "dropout": 0.0}
LORA_ALL = {"r": 16, "alpha": 32, "targets": "all-linear", "dropout": 0.0}
LORA_EXPERTS = {"r": 8, "alpha": 16, "targets": [], "target_parameters": ["mlp.experts.gate_up_proj",
                                                                       "mlp.experts.down_proj"]}
MP = {"param_dtype": "bf16", "reduce_dtype": "fp32"}
FILES: dict[str, list] = {}


def cfg(name, layers):
    """The catalog entry of `name`, field for field, with only the depth changed (as bench/moe does)."""
    c = json.loads(json.dumps(CAT[name]))
    c["num_hidden_layers"] = layers
    if "layer_types" in c:
        c["layer_types"] = c["layer_types"][:layers]
    return c


def add(file, id_, model, layers=None, versions=None, fake=None, snapshot=None, **spec):
    s = {"model": model}
    if "trainer" in spec:
        s = {"trainer": spec.pop("trainer"), **s}
    if layers is not None:
        s["model_config"] = cfg(model, layers)
    s.update(spec)
    line = {"id": id_, "spec": s}
    if versions:
        line["versions"] = {"transformers": versions}
    if fake is not None:
        line["fake"] = fake
    if snapshot:
        line["snapshot"] = snapshot
    FILES.setdefault(file, []).append(line)


# --- real trainers x MoE (transformers 5.17, TRL 1.16) -------------------------------------------------------
T = "specs-trainers.jsonl"
add(T, "x/sft/olmoe/L8/bf16/bs4/s1024/gc", "olmoe-1b-7b", 8, trainer="trl-sft", precision="bf16", batch_size=4,
    seq_len=1024)
add(T, "x/dpo/q3moe/L4/bf16/bs2/s1024/gc/autoref", "qwen3-30b-a3b", 4, trainer="trl-dpo", precision="bf16",
    batch_size=2, seq_len=1024)
add(T, "x/dpo/mixtral/L2/bf16/bs2/s1024/gc/lora16-all-linear/noref", "mixtral-8x7b", 2, trainer="trl-dpo",
    precision="bf16", batch_size=2, seq_len=1024, lora=LORA_ALL)
add(T, "x/grpo/olmoe/L4/bf16/bs8/g8/p256/c256/beta0.04", "olmoe-1b-7b", 4, trainer="trl-grpo", precision="bf16",
    batch_size=8, prompt_len=256, completion_len=256, num_generations=8, beta=0.04)
add(T, "x/grpo/q3moe/L4/bf16/bs8/g4/p128/c256/beta0.04/lora16-attn", "qwen3-30b-a3b", 4, trainer="trl-grpo",
    precision="bf16", batch_size=8, prompt_len=128, completion_len=256, num_generations=4, beta=0.04,
    lora=LORA_ATTN)
add(T, "x/reward/dsv2lite/L4/bf16/bs4/s1024/gc/lora16-all-linear", "deepseek-v2-lite", 4, trainer="trl-reward",
    precision="bf16", batch_size=4, seq_len=1024, lora=LORA_ALL)
add(T, "x/hf/gptoss/L4/eager/bf16/bs1/s2048/gc/lora8-experts", "gpt-oss-20b", 4, trainer="hf", attention="eager",
    precision="bf16", batch_size=1, seq_len=2048, gradient_checkpointing=True, lora=LORA_EXPERTS)
add(T, "x/hf/dsv2lite/L3/bf16/bs2/s2048", "deepseek-v2-lite", 3, trainer="hf", precision="bf16", batch_size=2,
    seq_len=2048)
add(T, "x/sft/mixtral/L2/amp_bf16/bs2/s2048/gc/lora16-attn", "mixtral-8x7b", 2, trainer="trl-sft",
    precision="amp-bf16", batch_size=2, seq_len=2048, lora=LORA_ATTN)

# --- FSDP2 with a MixedPrecisionPolicy on MoE models (rank 0 of a fake process group of 8) ----------------------
F = "specs-fsdp2-mp.jsonl"
add(F, "x/mp/olmoe/L16/fp32/bs2/s2048/gc/w8", "olmoe-1b-7b", None, fake=True, precision="fp32", optimizer="adamw",
    batch_size=2, seq_len=2048, gradient_checkpointing=True,
    parallel={"strategy": "fsdp", "world_size": 8, "mixed_precision": MP})
add(F, "x/mp/mixtral/L4/fp32/bs1/s2048/nogc/w8/reduce-bf16", "mixtral-8x7b", 4, fake=True, precision="fp32",
    optimizer="adamw", batch_size=1, seq_len=2048, gradient_checkpointing=False,
    parallel={"strategy": "fsdp", "world_size": 8, "mixed_precision": {"param_dtype": "bf16"}})
add(F, "x/mp/dsv2lite/L8/fp32/bs2/s2048/gc/w8/verl", "deepseek-v2-lite", 8, fake=True, precision="fp32",
    optimizer="adamw", batch_size=2, seq_len=2048, gradient_checkpointing=True,
    parallel={"strategy": "fsdp", "world_size": 8, "units": "layers-embedding", "mixed_precision": MP},
    autocast="bf16")
add(F, "x/mp/gptoss/L6/fp32/bs1/s2048/gc/w8/accelerate", "gpt-oss-20b", 6, fake=True, attention="eager",
    precision="fp32", optimizer="adamw", batch_size=1, seq_len=2048, gradient_checkpointing=True,
    parallel={"strategy": "fsdp", "world_size": 8, "units": "accelerate",
              "mixed_precision": {"param_dtype": "bf16", "reduce_dtype": "bf16", "output_dtype": "bf16"}})

# --- transformers 4.55-4.57 x MoE (the single-run harness) -----------------------------------------------------
add("specs-older-4.55.4.jsonl", "x/old4.55.4/olmoe/L8/bf16/bs4/s2048/lora16-attn", "olmoe-1b-7b", 8,
    versions="4.55.4", precision="bf16", optimizer="adamw", batch_size=4, seq_len=2048, lora=LORA_ATTN)
add("specs-older-4.56.2.jsonl", "x/old4.56.2/mixtral/L2/bf16/bs2/s2048/adamw", "mixtral-8x7b", 2,
    versions="4.56.2", precision="bf16", optimizer="adamw", batch_size=2, seq_len=2048)
add("specs-older-4.57.1.jsonl", "x/old4.57.1/q3moe/L4/bf16/bs2/s2048/lora16-attn", "qwen3-30b-a3b", 4,
    versions="4.57.1", precision="bf16", optimizer="adamw", batch_size=2, seq_len=2048, lora=LORA_ATTN,
    snapshot="old4.57.1-q3moe-L4-bs2-s2048-lora16-attn.pickle")

# --- transformers 4.57.1 x trainers (TRL 1.16), MoE and dense -------------------------------------------------
O = "specs-trainers-4.57.1.jsonl"
add(O, "x/old4.57.1/sft/q3moe/L4/bf16/bs2/s1024/gc/lora16-attn", "qwen3-30b-a3b", 4, versions="4.57.1",
    trainer="trl-sft", precision="bf16", batch_size=2, seq_len=1024, lora=LORA_ATTN)
add(O, "x/old4.57.1/dpo/olmoe/L4/bf16/bs2/s1024/gc/lora16-all-linear/noref", "olmoe-1b-7b", 4, versions="4.57.1",
    trainer="trl-dpo", precision="bf16", batch_size=2, seq_len=1024, lora=LORA_ALL,
    snapshot="old4.57.1-dpo-olmoe-L4-lora16-all-linear.pickle")
add(O, "x/old4.57.1/hf/llama1b/bf16/bs4/s1024", "llama-3.2-1b", None, versions="4.57.1", trainer="hf",
    precision="bf16", batch_size=4, seq_len=1024)
add(O, "x/old4.57.1/grpo/q05/bf16/bs8/g8/p256/c256/beta0", "qwen2.5-0.5b", None, versions="4.57.1",
    trainer="trl-grpo", precision="bf16", batch_size=8, prompt_len=256, completion_len=256, num_generations=8,
    beta=0.0)

for name, lines in FILES.items():
    (HERE / name).write_text("".join(json.dumps(x) + "\n" for x in lines))
    print(f"{HERE / name}: {len(lines)} specs")

# Device call 2 (written after call 1): the same spec lines again, each with a snapshot, for the rows call 1
# measured off by more than 0.5% allocated or 3% reserved that no call-1 snapshot explains. Same file names
# under tools/call2/, so `SPECDIR=bench/cross-holdout/tools/call2 bash bench/cross-holdout/tools/run.sh` runs them.
CALL2 = {
    "x/sft/mixtral/L2/amp_bf16/bs2/s2048/gc/lora16-attn": "c2-sft-mixtral-amp-lora-attn.pickle",
    "x/reward/dsv2lite/L4/bf16/bs4/s1024/gc/lora16-all-linear": "c2-reward-dsv2lite-lora-all-linear.pickle",
    "x/old4.57.1/sft/q3moe/L4/bf16/bs2/s1024/gc/lora16-attn": "c2-old4.57.1-sft-q3moe-lora-attn.pickle",
    "x/old4.55.4/olmoe/L8/bf16/bs4/s2048/lora16-attn": "c2-old4.55.4-olmoe-L8-lora-attn.pickle",
    "x/mp/dsv2lite/L8/fp32/bs2/s2048/gc/w8/verl": "c2-mp-dsv2lite-verl.pickle",
}
(HERE / "tools/call2").mkdir(exist_ok=True)
for name, lines in FILES.items():
    picked = [dict(x, snapshot=CALL2[x["id"]]) for x in lines if x["id"] in CALL2]
    path = HERE / "tools/call2" / name
    if picked:
        path.write_text("".join(json.dumps(x) + "\n" for x in picked))
        print(f"{path}: {len(picked)} specs")
    elif path.exists():
        path.unlink()
