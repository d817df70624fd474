"""The training callbacks: phases measured at the right boundaries, set beside the estimate,
warnings past the threshold, and an out-of-memory error diagnosed. CUDA's memory functions are
stand-ins here; bench/callback has a real run on a GPU."""

import importlib.util
import os
import warnings
from types import SimpleNamespace

import pytest

import headroom
from conftest import REPO
from headroom.integrations import HeadroomWarning
from headroom.integrations._watch import Watch

HAS_TORCH = importlib.util.find_spec("torch") is not None
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None
GIB = 1 << 30
SPEC = {"trainer": "hf", "model": "qwen2.5-0.5b", "precision": "bf16", "batch_size": 4, "seq_len": 1024}


class FakeCuda:
    """torch.cuda's memory statistics: `peak` is what max_memory_* report since the last reset,
    and a test raises it to say what a phase allocated."""

    class OutOfMemoryError(RuntimeError):
        pass

    def __init__(self, device="NVIDIA H100 80GB HBM3"):
        self.device = device
        self.current = 0
        self.peak = 0
        self.peak_reserved = 0
        self.resets = 0
        self.memory = SimpleNamespace(_record_memory_history=self._record, _dump_snapshot=self._dump)
        self.recording = False

    def is_available(self):
        return True

    def get_device_name(self, device=None):
        return self.device

    def get_device_properties(self, device=None):
        return SimpleNamespace(total_memory=48 * GIB)

    def reset_peak_memory_stats(self, device=None):
        self.resets += 1
        self.peak = self.current
        self.peak_reserved = self.current

    def max_memory_allocated(self, device=None):
        return self.peak

    def max_memory_reserved(self, device=None):
        return self.peak_reserved

    def reach(self, nbytes, reserved=None):
        self.peak = max(self.peak, nbytes)
        self.peak_reserved = max(self.peak_reserved, nbytes + GIB if reserved is None else reserved)

    def _record(self, max_entries=None, **kwargs):
        self.recording = True

    def _dump(self, path):
        with open(path, "wb") as f:
            f.write(b"snapshot")


def fake_torch(cuda):
    return SimpleNamespace(cuda=cuda, is_grad_enabled=lambda: True)


def quiet(lines):
    return lines.append


def test_phases_beside_the_estimate_and_the_steady_state():
    cuda = FakeCuda()
    lines = []
    w = Watch(SPEC, None, 0.05, cuda, quiet(lines), None)
    w.start()
    assert w.gpu == "h100-80gb"  # from the device's name
    est = headroom.estimate(SPEC, "h100-80gb")
    assert w.estimate == est
    assert "on h100-80gb" in lines[0] and "it fits" in lines[0]
    by_phase = {(p["step"], p["name"]): (p["peak_allocated_bytes"], p["peak_reserved_bytes"]) for p in est["phases"]}
    for step in (1, 2, 3, 4):
        w.begin_step(step)
        for phase in ("forward", "backward", "optimizer"):
            w.begin(phase)
            cuda.reach(*by_phase[(min(step, 3), phase)])
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # measured == estimated: no warning
            rows = w.end_step()
        assert [r["phase"] for r in rows] == ["forward", "backward", "optimizer"]
        assert all(r["allocated_error"] == 0 and r["reserved_error"] == 0 for r in rows)
    assert len(w.rows) == 12
    assert "measured peaks beside the estimate" in lines[-1]


def test_an_unknown_gpu_is_judged_by_its_capacity():
    w = Watch(SPEC, None, 0.05, FakeCuda("Some Future GPU"), quiet([]), None)
    w.start()
    assert w.gpu == "49152MiB"
    assert w.estimate["gpu"]["total_bytes"] == 48 * GIB


def test_a_peak_past_the_threshold_warns():
    cuda = FakeCuda()
    w = Watch(SPEC, "h100-80gb", 0.05, cuda, quiet([]), None)
    w.start()
    w.begin_step(1)
    w.begin("forward")
    alloc, reserved = w.estimated(1, "forward")
    cuda.reach(2 * alloc, reserved)
    with pytest.warns(HeadroomWarning, match="step 1 forward: measured peak allocated"):
        rows = w.end_step()
    assert rows[0]["allocated_error"] == pytest.approx(-0.5)


def test_micro_batches_keep_the_largest_peak():
    cuda = FakeCuda()
    w = Watch(None, "h100-80gb", 0.05, cuda, quiet([]), None)
    w.begin_step(1)
    for nbytes in (5 * GIB, 7 * GIB, 6 * GIB):
        w.begin("forward")
        cuda.reach(nbytes)
        w.begin(None)
    assert w.end_step()[0]["measured_allocated_bytes"] == 7 * GIB


def test_the_threshold_must_be_positive():
    with pytest.raises(headroom.SpecError) as e:
        Watch(SPEC, None, 0, FakeCuda(), print, None)
    assert e.value.field == "threshold"


class FakeTrainer:
    """What `attach` touches of a transformers Trainer: its callbacks and `train`."""

    def __init__(self, error):
        self.callback_handler = SimpleNamespace(callbacks=[])
        self.error = error

    def add_callback(self, cb):
        self.callback_handler.callbacks.append(cb)

    def train(self):
        raise self.error


def test_an_out_of_memory_error_dumps_a_snapshot_and_ranks_remedies(tmp_path):
    from headroom.integrations import HeadroomCallback

    cuda = FakeCuda()
    log = (REPO / "crates/headroom-cli/tests/fixtures/seed003/oom.log").read_text()
    spec = str(REPO / "crates/headroom-cli/tests/fixtures/seed003/train.yaml")
    lines = []
    cb = HeadroomCallback(spec, "h100-80gb", record_history=True, snapshot_dir=str(tmp_path), out=lines.append,
                          torch=fake_torch(cuda))
    trainer = FakeTrainer(FakeCuda.OutOfMemoryError(log))
    cb.attach(trainer)
    assert trainer.callback_handler.callbacks == [cb]
    cb.on_train_begin(None, None, None)  # no model: the spec is given
    assert cuda.recording
    with pytest.raises(FakeCuda.OutOfMemoryError):
        trainer.train()
    text = "\n".join(lines)
    assert "out of memory: shortage" in text
    assert "remedies, cheapest first" in text
    assert "Fused AdamW" in text  # the top remedy of this run, as `headroom diagnose` ranks it
    dumped = [p for p in os.listdir(tmp_path) if p.startswith("headroom-oom-")]
    assert len(dumped) == 1 and f"headroom snapshot {tmp_path / dumped[0]}" in text


def test_other_errors_pass_through_undiagnosed():
    from headroom.integrations import HeadroomCallback

    lines = []
    cb = HeadroomCallback(SPEC, "h100-80gb", out=lines.append, torch=fake_torch(FakeCuda()))
    trainer = FakeTrainer(KeyError("input_ids"))
    cb.attach(trainer)
    with pytest.raises(KeyError):
        trainer.train()
    assert not any("out of memory" in l for l in lines)


def test_data_parallel_in_one_process_is_said_and_not_compared():
    from headroom.integrations import HeadroomCallback

    lines = []
    cb = HeadroomCallback(SPEC, "h100-80gb", out=lines.append, torch=fake_torch(FakeCuda()))
    args = SimpleNamespace(n_gpu=4)
    cb.on_train_begin(args, None, None, model=SimpleNamespace())
    state = SimpleNamespace(global_step=0)
    cb.on_step_begin(args, state, None)
    cb.on_pre_optimizer_step(args, state, None)
    cb.on_step_end(args, state, None)
    assert cb.rows == [] and cb.estimate is None
    assert "DataParallel over 4 GPUs" in lines[0]


def test_lightning_hooks_mark_the_phases():
    from headroom.integrations import HeadroomLightningCallback

    cuda = FakeCuda()
    cb = HeadroomLightningCallback(SPEC, "h100-80gb", threshold=100, out=quiet([]), torch=fake_torch(cuda))
    trainer = SimpleNamespace(global_step=0, precision="bf16-true")
    cb.on_fit_start(trainer, None)
    cb.on_train_batch_start(trainer, None, None, 0)
    cuda.reach(3 * GIB)
    cb.on_before_backward(trainer, None, None)
    cuda.reach(5 * GIB)
    cb.on_after_backward(trainer, None)
    cuda.reach(4 * GIB)
    cb.on_train_batch_end(trainer, None, None, None, 0)
    got = [(r["phase"], r["measured_allocated_bytes"]) for r in cb.rows]
    assert got == [("forward", 3 * GIB), ("backward", 5 * GIB), ("optimizer", 4 * GIB)]


def test_lightning_diagnoses_an_out_of_memory_exception():
    from headroom.integrations import HeadroomLightningCallback

    log = (REPO / "crates/headroom-cli/tests/fixtures/seed003/oom.log").read_text()
    spec = str(REPO / "crates/headroom-cli/tests/fixtures/seed003/train.yaml")
    lines = []
    cb = HeadroomLightningCallback(spec, "h100-80gb", out=lines.append, torch=fake_torch(FakeCuda()))
    cb.on_exception(None, None, FakeCuda.OutOfMemoryError(log))
    cb.on_exception(None, None, KeyError("input_ids"))
    text = "\n".join(lines)
    assert text.count("remedies, cheapest first") == 1 and "Fused AdamW" in text


@pytest.mark.skipif(not (HAS_TORCH and HAS_TRANSFORMERS), reason="needs torch and transformers")
def test_a_real_trainer_run_on_the_cpu_marks_each_phase(tmp_path):
    """A real transformers Trainer (CPU, tiny random model): the callback's phases are the
    forward, the autograd pass and the optimizer, each seen by hooks inside it."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainingArguments

    from headroom.integrations import watch

    fields = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
    config = AutoConfig.for_model("qwen2", **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    cuda = FakeCuda()
    # Each phase's own work raises the stand-in peak to its own value.
    model.model.layers[0].register_forward_hook(lambda *a: cuda.reach(3 * GIB))
    for p in model.parameters():
        p.register_hook(lambda g: cuda.reach(5 * GIB))
    handle = register_optimizer_step_post_hook(lambda *a: cuda.reach(4 * GIB))
    data = [{"input_ids": torch.randint(0, 256, (32,)), "labels": torch.randint(0, 256, (32,))} for _ in range(8)]
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=3, use_cpu=True,
                             report_to=[], save_strategy="no", logging_strategy="no", disable_tqdm=True,
                             optim="adamw_torch", learning_rate=1e-4)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    lines = []
    torch_with_fake_cuda = SimpleNamespace(cuda=cuda, autograd=torch.autograd, is_grad_enabled=torch.is_grad_enabled)
    cb = watch(trainer, gpu="h100-80gb", out=lines.append, torch=torch_with_fake_cuda)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", HeadroomWarning)
            trainer.train()
    finally:
        handle.remove()
    # The spec came from the model, the arguments and the first batch.
    assert cb.watch.spec["batch_size"] == 2 and cb.watch.spec["seq_len"] == 32
    assert cb.watch.spec["model_config"]["hidden_size"] == 64
    assert cb.estimate is not None
    got = [(r["step"], r["phase"], r["measured_allocated_bytes"] // GIB) for r in cb.rows]
    assert got == [(s, p, n) for s in (1, 2, 3) for p, n in (("forward", 3), ("backward", 5), ("optimizer", 4))]
    assert any("measured peaks beside the estimate" in l for l in lines)
