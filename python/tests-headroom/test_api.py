"""The Python API gives what the CLI prints with --json, for every example, and refuses bad
input with SpecError naming the field, the value and what is allowed."""

import json
import os
import subprocess
import sys

import pytest
import yaml

import headroom
from conftest import EXAMPLES, REPO, run_cli


def cli_json(*args: str) -> dict:
    r = run_cli(*args, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_the_module_is_the_installed_wheel():
    assert not headroom.__file__.startswith(str(REPO / "python")), headroom.__file__
    assert headroom.__version__


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_estimate_of_every_example_is_the_clis(example):
    assert headroom.estimate(example) == cli_json("estimate", str(example))


@pytest.mark.parametrize("example", EXAMPLES, ids=lambda p: p.name)
def test_estimate_with_a_gpu_of_every_example_is_the_clis(example):
    expected = cli_json("estimate", str(example), "--gpu", "h100-80gb")
    assert headroom.estimate(str(example), gpu="h100-80gb") == expected
    # The same spec as a dict and as text, its relative paths resolved from its folder.
    text = example.read_text()
    as_dict = headroom.estimate(yaml.safe_load(text), gpu="h100-80gb", spec_dir=example.parent)
    as_text = headroom.estimate(text, gpu="h100-80gb", spec_dir=example.parent)
    assert as_dict == expected
    assert as_text == expected


def test_estimate_of_one_rank_is_the_clis():
    example = REPO / "examples" / "llama-3.1-70b-megatron-tp8-pp4-64xh100.yaml"
    expected = cli_json("estimate", str(example), "--gpu", "h100-80gb", "--rank", "63")
    assert headroom.estimate(example, gpu="h100-80gb", rank=63) == expected
    assert expected["worst_rank"]["stage"] == 3
    for bad in (64, -1, True, 2**70):
        with pytest.raises(headroom.SpecError) as err:
            headroom.estimate(example, rank=bad)
        assert "rank" in str(err.value)


def test_fit_is_the_clis():
    spec = REPO / "examples" / "llama-3.1-8b-full.yaml"
    expected = cli_json("fit", str(spec), "--gpu", "h100-80gb", "--gpus", "2")
    assert headroom.fit(spec, "h100-80gb", gpus=2) == expected
    assert expected["pareto"], "a full fine-tune of an 8B model fits two H100s somehow"


def test_diagnose_is_the_clis():
    log = REPO / "crates/headroom-cli/tests/fixtures/seed003/oom.log"
    spec = REPO / "crates/headroom-cli/tests/fixtures/seed003/train.yaml"
    expected = cli_json("diagnose", "--oom", str(log), "--spec", str(spec))
    got = headroom.diagnose(log.read_text(), spec)
    # The CLI names the log file; the API was given its text.
    assert expected.pop("oom_source") == str(log)
    assert got.pop("oom_source") == "oom_text"
    assert got == expected
    assert got["diagnosis"]["cause"] == "shortage"
    assert got["remedies"] and got["remedies"][0]["saving_bytes"] > 0


def test_snapshot_and_replay_are_the_clis():
    snap = REPO / "bench/snapshots/q05-bf16-adamw.pickle.gz"
    assert headroom.snapshot(snap) == cli_json("snapshot", str(snap))
    assert headroom.replay(snap) == cli_json("replay", str(snap))
    what_if = headroom.replay(snap, alloc_conf="expandable_segments:True")
    assert what_if == cli_json("replay", str(snap), "--alloc-conf", "expandable_segments:True")
    ddp = REPO / "bench/distributed/h200x2/ddp-q15.pickle.gz"
    placed = headroom.replay(ddp, ignore_addresses=True)
    assert placed["ignore_addresses"] is True
    assert placed == cli_json("replay", str(ddp), "--ignore-addresses")


def test_a_bad_field_is_a_spec_error_with_field_value_and_allowed():
    spec = {"model": "qwen2.5-0.5b", "precision": "fp8", "batch_size": 1, "seq_len": 128}
    with pytest.raises(headroom.SpecError) as e:
        headroom.estimate(spec)
    assert e.value.field == "precision"
    assert e.value.value == '"fp8"'  # as the message shows it
    assert "bf16" in e.value.allowed
    assert isinstance(e.value, ValueError)


def test_an_unknown_model_names_the_model_field():
    with pytest.raises(headroom.SpecError) as e:
        headroom.estimate({"model": "qwen2.5-0.6b", "batch_size": 1, "seq_len": 128})
    assert e.value.field == "model"
    assert e.value.value == "qwen2.5-0.6b"
    assert "qwen2.5-0.5b" in e.value.allowed  # the nearest names are suggested


def test_text_that_does_not_parse_names_the_spec_not_a_temporary_file():
    with pytest.raises(headroom.SpecError) as e:
        headroom.estimate("model: qwen2.5-0.5b\nbatch_size: [1,\n")
    assert str(e.value).startswith("spec:"), str(e.value)
    assert "headroom-" not in str(e.value)


def test_other_bad_input_is_a_spec_error_too():
    with pytest.raises(headroom.SpecError):
        headroom.estimate(REPO / "examples" / "no-such-spec.yaml")
    with pytest.raises(headroom.SpecError) as e:
        headroom.estimate(42)
    assert e.value.field == "spec"
    with pytest.raises(headroom.SpecError) as e:
        headroom.fit(REPO / "examples" / "qwen2.5-7b-lora.yaml", "h100-80gb", gpus=0)
    assert e.value.field == "gpus"
    with pytest.raises(headroom.SpecError) as e:
        headroom.estimate(REPO / "examples" / "qwen2.5-7b-lora.yaml", gpu="h1000")
    assert e.value.field == "gpu"
    with pytest.raises(headroom.SpecError):
        headroom.diagnose("nothing went wrong here")
    with pytest.raises(headroom.SpecError):
        headroom.snapshot(REPO / "README.md")


def test_the_console_script_exits_2_on_bad_input():
    r = run_cli("estimate", str(REPO / "examples" / "no-such-spec.yaml"))
    assert r.returncode == 2
    assert r.stderr.startswith("error: ")


@pytest.mark.skipif(not os.environ.get("HEADROOM_CARGO_BIN"), reason="HEADROOM_CARGO_BIN names no cargo binary")
def test_help_is_the_cargo_binarys():
    cargo = os.environ["HEADROOM_CARGO_BIN"]
    for args in (["--help"], ["--version"], ["estimate", "--help"], ["diagnose", "--help"]):
        ours = run_cli(*args)
        theirs = subprocess.run([cargo, *args], capture_output=True, text=True)
        assert (ours.returncode, ours.stdout, ours.stderr) == (theirs.returncode, theirs.stdout, theirs.stderr), args


def test_threads_run_estimates_side_by_side():
    from concurrent.futures import ThreadPoolExecutor

    spec = REPO / "examples" / "qwen2.5-7b-lora.yaml"
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda _: headroom.estimate(spec)["peak_allocated_bytes"], range(8)))
    assert len(set(results)) == 1
