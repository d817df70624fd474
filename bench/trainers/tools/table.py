"""Markdown table of the trainer rows: python3 tools/table.py ROWS.jsonl"""
import json
import sys

print("| id | trainer | peak allocated | peak reserved | peak in | weights after init | forwards (model, grad, input_ids) | generate |")
print("|---|---|---:|---:|---|---:|---|---|")
for line in open(sys.argv[1]):
    r = json.loads(line)
    m = r["measured"]
    fw = sorted({(f["model"], f["grad"], tuple(f["inputs"].get("input_ids", [[None]])[0])) for f in m["forwards"]},
                key=str)
    fw = ", ".join(f"{a}{'' if g else ' no-grad'} {list(s)}" for a, g, s in fw)
    gen = {(tuple(g["output"]), g["forward_calls"]) for g in m["generations"]}
    gen = ", ".join(f"{list(o)} in {n} calls" for o, n in gen)
    print(f"| `{r['id']}` | {r['spec']['trainer']} | {m['peak_allocated_bytes']:,} | {m['peak_reserved_bytes']:,} "
          f"| {m['peak_segment']} | {m['weights_loaded_bytes']:,} | {fw} | {gen} |")
