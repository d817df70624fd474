"""Writes bench/cp/specs.jsonl: context-parallel layouts (torchtitan's: ring attention over SDPA, FSDP2 over
dp x cp, optionally tensor parallelism with or without sequence parallelism) of three 7-8B models cut to 4 layers at
their real widths, at 16k to 64k tokens, each measured as rank 0 of its world under torch's fake process group."""

import importlib.util
import json
from pathlib import Path

# bench/tp's specs: the same three models at their real widths, cut to 4 layers.
_tp = importlib.util.spec_from_file_location("tp_make_specs", Path(__file__).resolve().parents[2] / "tp/tools/make_specs.py")
tp_make_specs = importlib.util.module_from_spec(_tp)
_tp.loader.exec_module(tp_make_specs)
MP = tp_make_specs.MP

# model, world, cp, tp, sp, batch, seq, checkpointing, FSDP2 mixed-precision policy (fp32 masters)
LAYOUTS = [
    ("l8b", 4, 2, 1, False, 1, 16384, True, False),
    ("l8b", 8, 4, 1, False, 1, 32768, True, False),
    ("l8b", 8, 8, 1, False, 1, 65536, True, False),
    ("l8b", 16, 4, 2, True, 1, 32768, True, False),
    ("l8b", 8, 4, 1, False, 2, 16384, True, True),
    ("q7b", 8, 2, 2, False, 1, 16384, False, False),
    ("q3-8b", 32, 8, 4, True, 1, 65536, True, False),
    ("q3-8b", 16, 8, 1, False, 1, 32768, False, False),
]
SNAPSHOTS = (1, 3, 5)  # rows that keep a memory history


def line_of(key, world, cp, tp, sp, batch, seq, gc, mp):
    """bench/tp's spec of the model and the step, with this layout."""
    spec = tp_make_specs.line_of(key, "fsdp", world, tp, sp, batch, seq, gc, mp)["spec"]
    parallel = {"strategy": "fsdp", "world_size": world, "cp": cp}
    if tp > 1:
        parallel.update({"tp": tp, "sequence_parallel": sp})
    if mp:
        parallel["mixed_precision"] = MP
    spec["parallel"] = parallel
    layout = f"w{world}-cp{cp}" + (f"-tp{tp}" if tp > 1 else "") + ("-sp" if sp else "")
    row_id = f"cp/{key}-L4/bs{batch}/s{seq}/{'gc' if gc else 'nogc'}/{layout}/fsdp" + ("-mp" if mp else "")
    return {"id": row_id, "spec": spec, "fake": True}


def main():
    lines = [line_of(*layout) for layout in LAYOUTS]
    for i in SNAPSHOTS:
        lines[i]["snapshot"] = lines[i]["id"].replace("/", "-") + ".pickle"
    here = Path(__file__).resolve().parent
    here.parent.joinpath("specs.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


if __name__ == "__main__":
    main()
