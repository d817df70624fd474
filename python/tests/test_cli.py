"""The command line without a GPU: bad specs and missing dependencies exit 2 with a message."""

import json
import os
import subprocess
import sys
import unittest
from pathlib import Path

PYTHON_DIR = Path(__file__).resolve().parents[1]


def run(*args, env_extra=None):
    env = dict(os.environ, PYTHONPATH=str(PYTHON_DIR))
    env.update(env_extra or {})
    return subprocess.run(
        [sys.executable, "-m", "headroom_measure", *args], capture_output=True, text=True, env=env
    )


class CliTest(unittest.TestCase):
    def test_bad_spec_exits_2_naming_the_field(self):
        out = run("run", "--spec-json", json.dumps({"model": "qwen2.5-0.5b", "batch_size": 0}))
        self.assertEqual(out.returncode, 2, out.stderr)
        self.assertIn("batch_size", out.stderr)
        self.assertNotIn("Traceback", out.stderr)

    def test_unknown_model_exits_2(self):
        out = run("run", "--spec-json", json.dumps({"model": "not-a-model"}))
        self.assertEqual(out.returncode, 2, out.stderr)
        self.assertIn("not-a-model", out.stderr)

    def test_without_torch_says_what_to_install(self):
        # A `torch` that cannot be imported stands in for a machine without it.
        stub = PYTHON_DIR / "tests" / "no_torch"
        out = run(
            "run", "--spec-json", json.dumps({"model": "qwen2.5-0.5b"}),
            env_extra={"PYTHONPATH": f"{stub}{os.pathsep}{PYTHON_DIR}"},
        )
        self.assertEqual(out.returncode, 2, out.stderr)
        self.assertIn("torch", out.stderr)
        self.assertIn("pip install", out.stderr)
        self.assertNotIn("Traceback", out.stderr)

    def test_run_needs_a_spec(self):
        out = run("run")
        self.assertEqual(out.returncode, 2)


class DistCliTest(unittest.TestCase):
    """`dist` refuses, with exit 2 and a message, what it cannot measure, before touching torch."""

    SPEC = {"model": "qwen2.5-1.5b", "parallel": {"strategy": "fsdp", "world_size": 2}}

    def test_needs_a_parallel_block(self):
        out = run("dist", "--spec-json", json.dumps({"model": "qwen2.5-0.5b"}), "--out", os.devnull)
        self.assertEqual(out.returncode, 2, out.stderr)
        self.assertIn("parallel", out.stderr)
        self.assertNotIn("Traceback", out.stderr)

    def test_bad_parallel_block_names_the_field(self):
        spec = {"model": "qwen2.5-0.5b", "parallel": {"strategy": "tp", "world_size": 2}}
        out = run("dist", "--spec-json", json.dumps(spec), "--out", os.devnull)
        self.assertEqual(out.returncode, 2, out.stderr)
        self.assertIn("parallel.strategy", out.stderr)

    def test_world_size_must_match_the_launcher(self):
        out = run("dist", "--spec-json", json.dumps(self.SPEC), "--out", os.devnull, env_extra={"WORLD_SIZE": "4"})
        self.assertEqual(out.returncode, 2, out.stderr)
        self.assertIn("torchrun --nproc-per-node 2", out.stderr)
        self.assertNotIn("Traceback", out.stderr)

    def test_without_torch_says_what_to_install(self):
        stub = PYTHON_DIR / "tests" / "no_torch"
        out = run(
            "dist", "--spec-json", json.dumps(self.SPEC), "--out", os.devnull,
            env_extra={"PYTHONPATH": f"{stub}{os.pathsep}{PYTHON_DIR}", "WORLD_SIZE": "2"},
        )
        self.assertEqual(out.returncode, 2, out.stderr)
        self.assertIn("torch", out.stderr)
        self.assertIn("pip install", out.stderr)
        self.assertNotIn("Traceback", out.stderr)


if __name__ == "__main__":
    unittest.main()
