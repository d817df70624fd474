"""Writes the row files of bench/cross-holdout from a device call's results.tar (unpacked into DIR), adding
`versions: {transformers: ...}` to the spec of every row measured under an older release (from env.transformers),
as bench/transformers-older does, so that `headroom validate` estimates it under that release.

    python3 bench/cross-holdout/tools/collect.py DIR [PREFIX]      (PREFIX: `rows` for call 1, `rows-call2` for call 2)
"""
import json
import sys
from pathlib import Path

src, prefix = Path(sys.argv[1]), (sys.argv[2] if len(sys.argv) > 2 else "rows")
here = Path(__file__).resolve().parents[1]
names = {
    "rows-trainers.jsonl": "h200-torch2.11-tf5.17-trl1.16",
    "rows-trainers-4.57.1.jsonl": "h200-torch2.11-tf4.57.1-trl1.16",  # split by hand into -dense and -moe
    "rows-fsdp2-mp.jsonl": "h200-torch2.11-tf5.17-fake8",
    "rows-older-4.55.4.jsonl": "h200-torch2.11-tf4.55.4",
    "rows-older-4.56.2.jsonl": "h200-torch2.11-tf4.56.2",
    "rows-older-4.57.1.jsonl": "h200-torch2.11-tf4.57.1",
}
for name, label in names.items():
    path = src / name
    if not path.exists():
        continue
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for r in rows:
        tf = r["env"].get("transformers")
        if tf and not tf.startswith("5."):
            r["spec"]["versions"] = {"transformers": tf}
    order = {json.loads(l)["id"]: i for f in sorted(here.glob("specs-*.jsonl")) for i, l in enumerate(f.read_text().splitlines())}
    rows.sort(key=lambda r: order.get(r["id"], 0))
    out = here / f"{prefix}-{label}.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{out}: {len(rows)} rows")
