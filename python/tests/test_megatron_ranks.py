"""The Megatron-core harness's two worlds on the CPU: a real world (torchrun's ranks; gloo here, NCCL on the GPUs)
gathers every rank's record in rank order and hands the row to rank 0 alone, while one rank of a fake world
(HEADROOM_FAKE_WORLD) keeps its own record and always returns the row (needs torch and megatron-core importable:
`PYTHONPATH=python:<unzipped megatron_core wheel>`)."""

import importlib.util
import json
import os
import socket
import subprocess
import sys
import tempfile
import unittest
from pathlib import Path

HAVE_MEGATRON = importlib.util.find_spec("torch") is not None and importlib.util.find_spec("megatron") is not None
PYTHON_DIR = Path(__file__).resolve().parents[1]

# One rank: its record (its rank and a peak that differs per rank) through `every_rank`, then `finish`.
RANK_SCRIPT = """
import json, os, sys
import torch.distributed as dist
from headroom_measure.megatron import every_rank, fake_group, finish
if fake_group():
    from torch.testing._internal.distributed.fake_pg import FakeStore
    dist.init_process_group("fake", rank=int(os.environ["HEADROOM_FAKE_RANK"]), world_size=4, store=FakeStore())
else:
    dist.init_process_group("gloo")
rank = dist.get_rank()
ranks = every_rank({"rank": rank, "peak_allocated_bytes": 100 * (rank + 1)})
row = finish({"ranks": ranks})
with open(sys.argv[1], "w") as f:
    json.dump({"rank": rank, "row": row}, f)
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@unittest.skipUnless(HAVE_MEGATRON, "needs torch and megatron-core")
class MegatronWorldsTest(unittest.TestCase):
    def run_ranks(self, envs: list) -> list:
        base = dict(os.environ, PYTHONPATH=os.pathsep.join([str(PYTHON_DIR), os.environ.get("PYTHONPATH", "")]))
        base.pop("HEADROOM_FAKE_WORLD", None)
        with tempfile.TemporaryDirectory() as d:
            outs = [Path(d) / f"rank{i}.json" for i in range(len(envs))]
            procs = [
                subprocess.Popen([sys.executable, "-c", RANK_SCRIPT, str(out)], env={**base, **env},
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                for env, out in zip(envs, outs)
            ]  # fmt: skip
            for p in procs:
                _, err = p.communicate(timeout=120)
                self.assertEqual(p.returncode, 0, err[-2000:])
            return [json.loads(out.read_text()) for out in outs]

    def test_a_real_world_gathers_every_rank_and_rank_0_writes_the_row(self):
        port = str(free_port())
        envs = [
            {"RANK": str(r), "LOCAL_RANK": str(r), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": port}
            for r in range(2)
        ]
        results = sorted(self.run_ranks(envs), key=lambda r: r["rank"])
        self.assertEqual(
            results[0]["row"]["ranks"],
            [{"rank": 0, "peak_allocated_bytes": 100}, {"rank": 1, "peak_allocated_bytes": 200}],
        )
        self.assertIsNone(results[1]["row"])

    def test_a_fake_rank_keeps_its_own_record_and_writes_the_row(self):
        (result,) = self.run_ranks([{"HEADROOM_FAKE_WORLD": "4", "HEADROOM_FAKE_RANK": "2"}])
        self.assertEqual(result["row"]["ranks"], [{"rank": 2, "peak_allocated_bytes": 300}])


if __name__ == "__main__":
    unittest.main()
