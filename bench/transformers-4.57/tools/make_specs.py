import json, subprocess, sys
base = dict(task="causal-lm", mode="train", optimizer="adamw", gradient_checkpointing=False, attention="sdpa")
S = [
 ("q05-bf16-bs4-s2048",        dict(model="qwen2.5-0.5b", precision="bf16", batch_size=4, seq_len=2048)),
 ("q05-amp-bs6-s1024",         dict(model="qwen2.5-0.5b", precision="amp-bf16", batch_size=6, seq_len=1024)),
 ("q05-amp-bs4-s2048-gc",      dict(model="qwen2.5-0.5b", precision="amp-bf16", batch_size=4, seq_len=2048, gradient_checkpointing=True)),
 ("q05-bf16-lora16-bs4-s2048", dict(model="qwen2.5-0.5b", precision="bf16", batch_size=4, seq_len=2048,
                                    lora=dict(r=16, alpha=32, targets="all-linear", dropout=0.0))),
 ("q05-bf16-fwd-bs4-s4096",    dict(model="qwen2.5-0.5b", precision="bf16", mode="forward", optimizer="none", batch_size=4, seq_len=4096)),
 ("q05-bf16-seqcls-bs4-s2048", dict(model="qwen2.5-0.5b", task="seq-cls", precision="bf16", batch_size=4, seq_len=2048)),
 ("q3-06-bf16-bs2-s4096-gc",   dict(model="qwen3-0.6b", precision="bf16", batch_size=2, seq_len=4096, gradient_checkpointing=True)),
 ("q3-06-amp-bs2-s2048",       dict(model="qwen3-0.6b", precision="amp-bf16", optimizer="adamw-fused", batch_size=2, seq_len=2048)),
 ("l32-1b-bf16-bs4-s2048-gc",  dict(model="llama-3.2-1b", precision="bf16", batch_size=4, seq_len=2048, gradient_checkpointing=True)),
 ("l32-1b-amp-bs2-s2048",      dict(model="llama-3.2-1b", precision="amp-bf16", batch_size=2, seq_len=2048)),
 ("gpt2-amp-bs8-s1024",        dict(model="gpt2", precision="amp-bf16", batch_size=8, seq_len=1024)),
 ("gpt2-bf16-bs8-s1024-gc",    dict(model="gpt2", precision="bf16", batch_size=8, seq_len=1024, gradient_checkpointing=True)),
]
out = []
for sid, s in S:
    spec = dict(base); spec.update(s)
    spec = {k: spec[k] for k in ["model","task","mode","precision","optimizer","batch_size","seq_len","gradient_checkpointing","attention"] + (["lora"] if "lora" in spec else [])}
    open("/tmp/spec.json","w").write(json.dumps(spec))
    est = json.loads(subprocess.check_output(["/tmp/headroom-sim2","estimate","--json","/tmp/spec.json"]))
    out.append((sid, spec, est))
    print(sid, {k: v for k, v in est.items() if isinstance(v,(int,float))})
json.dump([[a,b,c] for a,b,c in out], open("/tmp/est.json","w"))

sys.path.insert(0, "/work/main/python")
from headroom_measure import spec as specmod
from headroom_measure.measure import default_id
with open("/work/main/bench/transformers-4.57/specs.jsonl", "w") as fh:
    for sid, spec, est in out:
        sp = specmod.parse(spec)
        assert sp.to_json() == spec or True
        fh.write(json.dumps({"id": default_id(sp), "name": sid, "spec": spec,
                             "hint_bytes": int(est["peak_reserved_bytes"] * 1.1)}) + "\n")
