"""Tests of the installed `headroom` wheel (run from a venv the wheel is installed in; the
source tree's python/headroom is not on the path). Fixtures come from the repository."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def headroom_command() -> str:
    """The console script the wheel installed beside this interpreter."""
    here = Path(sys.executable).parent / ("headroom.exe" if os.name == "nt" else "headroom")
    found = str(here) if here.exists() else shutil.which("headroom")
    assert found, "the wheel's `headroom` command is not installed"
    return found


def run_cli(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([headroom_command(), *args], capture_output=True, text=True, cwd=cwd)


@pytest.fixture(scope="session")
def repo() -> Path:
    return REPO
