"""Rewrite saved traces as version 2 of the format (docs/trace-format.md), in place:
`python3 bench/trace/tools/compact.py FILE...`. A version 2 file is left as it is."""

import gzip
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "python"))
from headroom_measure.trace import compact  # noqa: E402


def main(paths):
    for path in paths:
        opener = gzip.open if path.endswith(".gz") else open
        with opener(path, "rt") as f:
            doc = json.load(f)
        if doc.get("version") != 1:
            continue
        before = os.path.getsize(path)
        tmp = path + ".tmp"
        with opener(tmp, "wt") as f:
            json.dump(compact(doc), f, separators=(",", ":"))
        os.replace(tmp, path)
        print(f"{path}: {before} -> {os.path.getsize(path)} bytes")


if __name__ == "__main__":
    main(sys.argv[1:])
