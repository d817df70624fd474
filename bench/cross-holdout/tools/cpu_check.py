"""CPU check of every line of the spec files named, with the model shrunk (2 layers, narrow, 8 experts, small
vocabulary) so that it runs here: builds what the harness builds and trains 1 step through the same code path.

  trainer lines (`trainer` key): headroom_measure.trainers.build_trainer(..., device="cpu"), 1 step
  fsdp lines (`parallel`):       python -m headroom_measure dist under a fake world of world_size on the CPU
  other lines:                   measure._build / _prepare / one forward, backward and optimizer step

    PYTHONPATH=python:SITE python3 bench/cross-holdout/tools/cpu_check.py SPECS.jsonl...
"""
import json
import os
import subprocess
import sys
import tempfile
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
CAT = json.load(open(os.path.join(REPO, "crates/headroom/data/models.json")))["models"]


def shrink(model, mc):
    c = json.loads(json.dumps(mc or CAT[model]))
    c["num_hidden_layers"] = 2
    if "layer_types" in c:
        c["layer_types"] = c["layer_types"][:2]
    c["hidden_size"] = 128
    c["vocab_size"] = 512
    for k in ("pad_token_id", "eos_token_id", "bos_token_id"):
        if isinstance(c.get(k), int) and c[k] >= 512:
            c[k] = 1
    heads = 4
    kv = c.get("num_key_value_heads", heads)
    c["num_key_value_heads"] = heads if kv == c.get("num_attention_heads") else 2
    c["num_attention_heads"] = heads
    if "head_dim" in c:
        c["head_dim"] = 32
    for k in ("intermediate_size",):
        c[k] = 256
    if "moe_intermediate_size" in c:
        c["moe_intermediate_size"] = 64
    for k in ("num_experts", "num_local_experts", "n_routed_experts"):
        if k in c:
            c[k] = 8
    if "kv_lora_rank" in c:
        c.update(kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16)
    if c.get("model_type") == "gpt_oss":
        c["intermediate_size"] = 128
        c["sliding_window"] = 64
    return c


def trainer_line(line):
    import torch
    from headroom_measure import trainers as tr

    raw = dict(line["spec"])
    raw["model_config"] = shrink(raw["model"], raw.get("model_config"))
    raw["max_steps"] = 1
    ts, fields = tr.resolve(raw, {})
    ckpt = tempfile.mkdtemp()
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tr._hf_config(ts, fields), dtype=torch.bfloat16)
    model.save_pretrained(ckpt)
    tok = tr._tokenizer(int(fields["vocab_size"]), ckpt)
    trainer = tr.build_trainer(ts, fields, ckpt, tok, [], device="cpu")
    trainer.train()
    n = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    return f"trainable {n}, model {type(tr.core_model(trainer.model)).__name__}"


def measure_line(line):
    import torch
    from headroom_measure import measure as m
    from headroom_measure import spec as sp

    raw = dict(line["spec"])
    raw["model_config"] = shrink(raw["model"], raw.get("model_config"))
    spec = sp.parse(raw)
    fields = sp.resolve_model_config(spec, {})
    model = m._build(spec, m._hf_config(spec, fields), device="cpu")
    model = m._prepare(spec, model)
    opt = m._optimizer(spec, [p for p in model.parameters() if p.requires_grad])
    ids = torch.randint(0, 512, (2, 64))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    lora = m.lora_targets_in_use(model)
    n = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return f"trainable {n}, experts {m.experts_implementation_in_use(model)}, lora {json.dumps(lora)[:300]}"


def dist_line(line):
    raw = dict(line["spec"])
    raw["model_config"] = shrink(raw["model"], raw.get("model_config"))
    raw["batch_size"], raw["seq_len"] = 1, 64
    w = raw["parallel"]["world_size"]
    env = dict(os.environ, HEADROOM_DIST_CPU="1", HEADROOM_FAKE_WORLD=str(w), WORLD_SIZE=str(w), RANK="0", LOCAL_RANK="0",
               CUDA_VISIBLE_DEVICES="")
    with tempfile.TemporaryDirectory() as d:
        p = subprocess.run([sys.executable, "-m", "headroom_measure", "dist", "--spec-json", json.dumps(raw),
                            "--out", f"{d}/rows.jsonl", "--id", line["id"]], env=env, capture_output=True, text=True)
        if p.returncode:
            raise RuntimeError(p.stderr[-3000:])
        rec = json.loads(open(f"{d}/rows.jsonl").read().splitlines()[-1])
    return f"process_group {rec['env'].get('process_group')}, params {rec['measured'].get('params')}"


bad = 0
for path in sys.argv[1:]:
    for text in open(path):
        line = json.loads(text)
        try:
            if "trainer" in line["spec"]:
                what = trainer_line(line)
            elif "parallel" in line["spec"]:
                what = dist_line(line)
            else:
                what = measure_line(line)
            print(f"ok   {line['id']}: {what}", flush=True)
        except Exception:  # noqa: BLE001 - report and go on
            bad += 1
            print(f"FAIL {line['id']}:\n{traceback.format_exc()[-3000:]}", flush=True)
sys.exit(1 if bad else 0)
