"""The measurement harness ships in the wheel: `headroom measure` and `headroom.measure` find it
without a checkout, and say what is missing where torch is."""

import importlib.util
import json

import pytest

import headroom
import headroom.measure
from conftest import REPO, run_cli

SPEC = {"model": "qwen2.5-0.5b", "precision": "bf16", "batch_size": 1, "seq_len": 128}


def test_the_harness_is_installed_beside_headroom():
    harness = headroom.measure.harness
    assert not harness.__file__.startswith(str(REPO / "python")), harness.__file__
    from headroom_measure import spec, trace  # noqa: F401  the tracer and the spec reader too


def test_a_bad_spec_is_refused_before_the_harness_runs():
    with pytest.raises(headroom.SpecError) as e:
        headroom.measure.measure(dict(SPEC, precision="fp8"), python="/nonexistent/python")
    assert e.value.field == "precision"


def test_the_harness_reads_specs_without_torch():
    from headroom_measure import spec

    parsed = spec.parse(dict(SPEC))
    assert parsed.seq_len == 128


@pytest.mark.skipif(importlib.util.find_spec("torch") is not None, reason="torch is installed here")
def test_measure_without_torch_says_what_is_missing(tmp_path):
    path = tmp_path / "spec.json"
    path.write_text(json.dumps(SPEC))
    for spec in (path, SPEC):
        with pytest.raises(headroom.SpecError) as e:
            headroom.measure.measure(spec)
        assert "torch" in str(e.value)
    r = run_cli("measure", str(path))
    assert r.returncode == 2
    assert "torch" in r.stderr
