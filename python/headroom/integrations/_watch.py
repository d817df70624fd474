"""What the training callbacks share: the estimate of the run, the allocator's peaks of each
phase of each step measured beside it, and what to do on an out-of-memory error.

Phases are those of the estimate (`headroom estimate --json`'s `phases`) and of the measuring
harness (`headroom_measure/trainers.py`): `forward` runs from the model's forward pre-hook to
the start of backward (the loss included), `backward` to the end of the autograd pass (or to
the optimizer step where the loss is not the model's output), `optimizer` from there through
gradient clipping, `optimizer.step()` and `zero_grad()` to the end of the step. Each phase's
peak is `torch.cuda.max_memory_allocated()` / `max_memory_reserved()` after
`reset_peak_memory_stats()` at the phase's start, so the numbers are those the estimate
predicts. Steps past the estimate's last one are set beside its last (the steady state).
"""

from __future__ import annotations

import os
import sys
import time
import warnings
from typing import Any, Callable, Optional

from .. import _api

GIB = 1 << 30


class HeadroomWarning(UserWarning):
    """A measured peak parted from the estimate by more than the threshold."""


def _gib(n: Optional[int]) -> str:
    return "—" if n is None else f"{n / GIB:.2f} GiB"


def _error(measured: int, estimated: Optional[int]) -> Optional[float]:
    if not estimated or measured <= 0:
        return None
    return (estimated - measured) / measured


def _pct(e: Optional[float]) -> str:
    return "—" if e is None else f"{100 * e:+.1f}%"


class Watch:
    """The measurement beside the estimate, for one training run on one device.

    `cuda` is `torch.cuda` (or a stand-in with `max_memory_allocated`, `max_memory_reserved`,
    `reset_peak_memory_stats`, `get_device_name`, `is_available`).
    """

    def __init__(
        self,
        spec: Optional[dict],
        gpu: Optional[str],
        threshold: float,
        cuda: Any,
        out: Callable[[str], None],
        snapshot_dir: Optional[str],
    ):
        if not threshold > 0:
            raise _api.SpecError(
                f"threshold: {threshold!r} is not allowed; use a fraction > 0 (0.05 warns past 5%)",
                field="threshold",
                value=repr(threshold),
                allowed="a fraction > 0",
            )
        self.spec = spec
        self.gpu = gpu
        self.threshold = threshold
        self.cuda = cuda
        self.out = out
        self.snapshot_dir = snapshot_dir
        self.estimate: Optional[dict] = None
        self.step = 0
        self.phase: Optional[str] = None
        # {(step, phase): (peak allocated, peak reserved)} as measured.
        self.measured: dict[tuple[int, str], tuple[int, int]] = {}
        self.rows: list[dict] = []
        self.recording_history = False

    # ------------------------------------------------------------------ the estimate

    def resolve_gpu(self) -> Optional[str]:
        if self.gpu is None and self.cuda is not None and self.cuda.is_available():
            try:
                self.gpu = _api.gpu_of_device(self.cuda.get_device_name())
            except _api.SpecError:
                total = self.cuda.get_device_properties(0).total_memory
                self.gpu = f"{total // (1 << 20)}MiB"
        return self.gpu

    def start(self, spec: Optional[dict] = None) -> None:
        """Estimates the run and prints the estimate and its verdict."""
        if spec is not None:
            self.spec = spec
        if self.spec is None or self.estimate is not None:
            return
        gpu = self.resolve_gpu()
        est = _api.estimate(self.spec, gpu)
        self.estimate = est
        lines = [
            f"headroom: {est['model']}: estimated peak allocated {_gib(est['peak_allocated_bytes'])}, "
            f"reserved {_gib(est['peak_reserved_bytes'])} (step {est['peak_step']}, {est['peak_phase']})"
        ]
        verdict = est.get("gpu")
        if verdict:
            word = "fits" if verdict["fits"] else "does NOT fit"
            lines.append(
                f"headroom: on {verdict['name']} ({_gib(verdict['total_bytes'])}) it {word}: "
                f"{_gib(abs(verdict['headroom_bytes']))} {'to spare' if verdict['fits'] else 'short'}"
            )
            oom = verdict.get("oom")
            if oom:
                lines.append(f"headroom: simulated out of memory in {oom['phase']}: {oom['message'].splitlines()[0]}")
        for w in est.get("assumptions", {}).get("warnings", []):
            lines.append(f"headroom: warning: {w}")
        self.out("\n".join(lines))

    def estimated(self, step: int, phase: str) -> tuple[Optional[int], Optional[int]]:
        if self.estimate is None:
            return None, None
        phases = [p for p in self.estimate["phases"] if p["name"] == phase and p["step"] >= 1]
        if not phases:
            return None, None
        last = max(p["step"] for p in phases)
        for p in phases:
            if p["step"] == min(step, last):
                return p["peak_allocated_bytes"], p["peak_reserved_bytes"]
        return None, None

    # ------------------------------------------------------------------ the phases

    def begin_step(self, step: int) -> None:
        self.step = step
        self.phase = None
        self.cuda.reset_peak_memory_stats()

    def begin(self, phase: Optional[str]) -> None:
        """Closes the phase running (its peaks are kept) and starts `phase` (None: a stretch
        that belongs to no phase, such as moving the batch to the device)."""
        if self.phase is not None:
            key = (self.step, self.phase)
            alloc = self.cuda.max_memory_allocated()
            reserved = self.cuda.max_memory_reserved()
            before = self.measured.get(key, (0, 0))
            # Micro-batches of one step (gradient accumulation) keep their largest peak.
            self.measured[key] = (max(before[0], alloc), max(before[1], reserved))
        self.phase = phase
        self.cuda.reset_peak_memory_stats()

    def end_step(self) -> list[dict]:
        """Closes the step; prints its phases beside the estimate and warns where they part."""
        self.begin(None)
        rows = []
        for phase in ("forward", "backward", "optimizer"):
            got = self.measured.get((self.step, phase))
            if got is None:
                continue
            est_alloc, est_reserved = self.estimated(self.step, phase)
            row = {
                "step": self.step,
                "phase": phase,
                "measured_allocated_bytes": got[0],
                "estimated_allocated_bytes": est_alloc,
                "allocated_error": _error(got[0], est_alloc),
                "measured_reserved_bytes": got[1],
                "estimated_reserved_bytes": est_reserved,
                "reserved_error": _error(got[1], est_reserved),
            }
            rows.append(row)
        self.rows.extend(rows)
        if rows:
            self.out(self.table(rows))
        for r in rows:
            for kind in ("allocated", "reserved"):
                e = r[f"{kind}_error"]
                if e is not None and abs(e) > self.threshold:
                    warnings.warn(
                        HeadroomWarning(
                            f"headroom: step {r['step']} {r['phase']}: measured peak {kind} "
                            f"{_gib(r[f'measured_{kind}_bytes'])} vs estimated {_gib(r[f'estimated_{kind}_bytes'])} "
                            f"({_pct(e)}, past the {100 * self.threshold:.0f}% threshold): the spec may not "
                            f"describe this run (check batch size, sequence length, precision, optimizer)"
                        ),
                        stacklevel=2,
                    )
        return rows

    @staticmethod
    def table(rows: list[dict]) -> str:
        head = (
            f"{'step':>4}  {'phase':<9}  {'allocated':>10}  {'estimate':>10}  {'error':>7}"
            f"  {'reserved':>10}  {'estimate':>10}  {'error':>7}"
        )
        lines = ["headroom: measured peaks beside the estimate", head]
        for r in rows:
            lines.append(
                f"{r['step']:>4}  {r['phase']:<9}  {_gib(r['measured_allocated_bytes']):>10}  "
                f"{_gib(r['estimated_allocated_bytes']):>10}  {_pct(r['allocated_error']):>7}  "
                f"{_gib(r['measured_reserved_bytes']):>10}  {_gib(r['estimated_reserved_bytes']):>10}  "
                f"{_pct(r['reserved_error']):>7}"
            )
        return "\n".join(lines)

    # ------------------------------------------------------------------ out of memory

    def record_history(self, torch: Any, max_entries: int) -> None:
        """Starts recording allocation history, so an out-of-memory error can dump it."""
        torch.cuda.memory._record_memory_history(max_entries=max_entries)
        self.recording_history = True

    def on_oom(self, exc: BaseException, torch: Any) -> dict:
        """Dumps a memory snapshot (when history was recorded), diagnoses the error with the
        spec and prints the ranked remedies. Returns what it found."""
        found: dict = {"snapshot": None, "diagnosis": None}
        if self.recording_history:
            directory = self.snapshot_dir or os.getcwd()
            path = os.path.join(directory, f"headroom-oom-{time.strftime('%Y%m%d-%H%M%S')}.pickle")
            try:
                torch.cuda.memory._dump_snapshot(path)
                found["snapshot"] = path
                self.out(f"headroom: memory snapshot of the out-of-memory error: {path} (headroom snapshot {path})")
            except Exception as e:  # a failed dump must not hide the OOM itself
                self.out(f"headroom: could not dump the memory snapshot: {e}")
        try:
            diagnosis = _api.diagnose(str(exc), self.spec, gpu=self.gpu)
        except _api.HeadroomError as e:
            self.out(f"headroom: could not diagnose the out-of-memory error: {e}")
            return found
        found["diagnosis"] = diagnosis
        self.out(render_diagnosis(diagnosis))
        return found


def render_diagnosis(d: dict) -> str:
    """`diagnose --json`'s answer as the CLI's text says it: the cause, the estimate beside the
    message, and the remedies ranked."""
    lines = []
    diagnosis = d.get("diagnosis")
    if diagnosis:
        lines.append(f"headroom: out of memory: {diagnosis['cause'].replace('_', ' ')}. {diagnosis['summary']}")
        for f in diagnosis.get("findings", []):
            lines.append(f"  - {f.get('text', f) if isinstance(f, dict) else f}")
    est = d.get("estimate")
    if est:
        lines.append(f"headroom: {est['verdict']}")
        if est.get("agreement"):
            lines.append(f"headroom: {est['agreement']}")
    remedies = d.get("remedies") or []
    if remedies:
        lines.append("headroom: remedies, cheapest first among those that fit:")
    for i, r in enumerate(remedies, 1):
        lines.append(
            f"  {i:>2}. {r['title']}: {_gib(r['device_bytes'])} on the device, saves {_gib(r['saving_bytes'])}, "
            f"{'fits' if r['fits'] else 'does not fit'}, step time x{r['slowdown']:.2f}"
        )
        lines.append(f"      {r['how']}")
    return "\n".join(lines)


def default_out(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class CallbackSettings:
    """What every framework's callback is given: the spec (or keys that override the one built
    from the run), the GPU, the threshold, and where snapshots and messages go."""

    def __init__(
        self,
        spec: Optional[Any] = None,
        gpu: Optional[str] = None,
        threshold: float = 0.05,
        *,
        record_history: bool = False,
        history_max_entries: int = 200_000,
        snapshot_dir: Optional[str] = None,
        out: Optional[Callable[[str], None]] = None,
        torch: Any = None,
        **spec_overrides: Any,
    ):
        if torch is None:
            import torch
        self.torch = torch
        self.watch = Watch(spec, gpu, threshold, torch.cuda, out or default_out, snapshot_dir)
        self.spec_overrides = spec_overrides
        self.record_history = record_history
        self.history_max_entries = history_max_entries
