"""Writes bench/fsdp2-mp/specs.jsonl: FSDP2 with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) over fp32
masters, no autocast, as verl, slime, torchtitan and accelerate configure it (issue 15).

Each line is {id, spec, fake}: `fake: true` runs rank 0 of a world of `world_size` on one GPU under torch's fake
process group (HEADROOM_FAKE_WORLD); `fake: false` is a real one-GPU world under torchrun (NCCL).
"""
import json
from pathlib import Path

MP = {"param_dtype": "bf16", "reduce_dtype": "fp32"}
rows = []


def add(id_, model, batch, seq, world, gc=True, fake=True, shard=None, reshard=True, offload=False, mp=None, snapshot=None):
    parallel = {"strategy": "fsdp", "world_size": world, "mixed_precision": mp or MP}
    if shard:
        parallel["shard_size"] = shard
    if not reshard:
        parallel["reshard_after_forward"] = False
    if offload:
        parallel["offload_params"] = True
    spec = {"model": model, "precision": "fp32", "optimizer": "adamw", "batch_size": batch, "seq_len": seq,
            "gradient_checkpointing": gc, "parallel": parallel}
    line = {"id": id_, "spec": spec, "fake": fake}
    if snapshot:
        line["snapshot"] = snapshot
    rows.append(line)


add("mp/q15/bs4/s2048/gc/w1", "qwen2.5-1.5b", 4, 2048, 1, fake=False, snapshot="mp-q15-bs4-s2048-gc-w1.pickle")
add("mp/q15/bs2/s1024/nogc/w1", "qwen2.5-1.5b", 2, 1024, 1, gc=False, fake=False)
add("mp/q15/bs4/s2048/gc/w8", "qwen2.5-1.5b", 4, 2048, 8, snapshot="mp-q15-bs4-s2048-gc-w8.pickle")
add("mp/q15/bs4/s2048/nogc/w8", "qwen2.5-1.5b", 4, 2048, 8, gc=False)
add("mp/q15/bs4/s2048/gc/w8/noreshard", "qwen2.5-1.5b", 4, 2048, 8, reshard=False)
add("mp/q15/bs4/s2048/gc/w64", "qwen2.5-1.5b", 4, 2048, 64)
add("mp/q15/bs4/s2048/gc/w16/hsdp8", "qwen2.5-1.5b", 4, 2048, 16, shard=8)
add("mp/q15/bs4/s2048/gc/w8/offload", "qwen2.5-1.5b", 4, 2048, 8, offload=True)
add("mp/q3-17/bs2/s4096/gc/w8", "qwen3-1.7b", 2, 4096, 8)
add("mp/q3-17/bs4/s2048/gc/w8/offload", "qwen3-1.7b", 4, 2048, 8, offload=True)
add("mp/q3-17/bs4/s2048/gc/w8/reduce-bf16", "qwen3-1.7b", 4, 2048, 8, mp={"param_dtype": "bf16"})
add("mp/l3b/bs2/s2048/gc/w8", "llama-3.2-3b", 2, 2048, 8)
add("mp/l3b/bs2/s2048/gc/w64", "llama-3.2-3b", 2, 2048, 64)
add("mp/l3b/bs2/s2048/gc/w16/noreshard", "llama-3.2-3b", 2, 2048, 16, reshard=False)
add("mp/q3b/bs4/s1024/nogc/w16", "qwen2.5-3b", 4, 1024, 16, gc=False)
add("mp/q3-4b/bs2/s2048/gc/w8", "qwen3-4b", 2, 2048, 8)
add("mp/q7b/bs2/s2048/gc/w8", "qwen2.5-7b", 2, 2048, 8)
add("mp/q7b/bs1/s4096/gc/w64", "qwen2.5-7b", 1, 4096, 64)
add("mp/q7b/bs2/s2048/gc/w64/hsdp8", "qwen2.5-7b", 2, 2048, 64, shard=8)
add("mp/l8b/bs1/s2048/gc/w8", "llama-3.1-8b", 1, 2048, 8)
add("mp/l8b/bs2/s2048/gc/w32", "llama-3.1-8b", 2, 2048, 32)
add("mp/q3-8b/bs1/s2048/gc/w16", "qwen3-8b", 1, 2048, 16)

out = Path(__file__).resolve().parents[1] / "specs.jsonl"
out.write_text("".join(json.dumps(r) + "\n" for r in rows))
print(f"{out}: {len(rows)} specs")
