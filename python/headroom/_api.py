"""The CLI's commands as functions: each returns the dict that the command prints with `--json`.

A spec is a dict, YAML or JSON text, or the path of a spec file. Relative model paths in a spec
file resolve against its folder (as the CLI resolves them); in a dict or text, against
`spec_dir`, by default the working directory.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Optional, Union

from . import _native

SpecLike = Union[Mapping[str, Any], str, "os.PathLike[str]"]
PathLike = Union[str, "os.PathLike[str]"]

# A spec given as text is written to this file name, which errors then name.
_SPEC_NAME = "spec.yaml"


class HeadroomError(Exception):
    """A command failed for a reason other than its input (the CLI's exit code 1)."""

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class SpecError(HeadroomError, ValueError):
    """Bad input (the CLI's exit code 2): `field` holds `value`, and `allowed` says what may.

    `field`, `value` and `allowed` are None where the error is not about one field (a file
    that cannot be read, YAML that does not parse); the message says what is wrong.
    """

    def __init__(
        self,
        message: str,
        field: Optional[str] = None,
        value: Optional[str] = None,
        allowed: Optional[str] = None,
    ):
        super().__init__(message)
        self.field = field
        self.value = value
        self.allowed = allowed


def _is_spec_text(spec: str) -> bool:
    """Text of a spec rather than a file name: several lines, or a mapping on one line."""
    return "\n" in spec or spec.lstrip().startswith("{") or (
        ": " in spec and not os.path.exists(spec)
    )


@contextlib.contextmanager
def _spec_file(spec: SpecLike, spec_dir: Optional[PathLike]) -> Iterator[tuple[str, Optional[str]]]:
    """The spec as a file the native code reads, and where its relative paths resolve."""
    if isinstance(spec, os.PathLike) or (isinstance(spec, str) and not _is_spec_text(spec)):
        yield os.fspath(spec), (os.fspath(spec_dir) if spec_dir is not None else None)
        return
    if isinstance(spec, Mapping):
        text = json.dumps(spec)
    elif isinstance(spec, str):
        text = spec
    else:
        raise SpecError(
            f"spec: a {type(spec).__name__} is not a spec; give a dict, YAML or JSON text, or a path",
            field="spec",
            value=type(spec).__name__,
            allowed="a dict, YAML or JSON text, or the path of a spec file",
        )
    with tempfile.TemporaryDirectory(prefix="headroom-") as tmp:
        path = os.path.join(tmp, _SPEC_NAME)
        with open(path, "w", encoding="utf-8") as f:
            f.write(text)
        base = os.fspath(spec_dir) if spec_dir is not None else os.getcwd()
        try:
            yield path, base
        except SpecError as e:
            # Errors name the temporary file; the user gave no file.
            e.args = (e.message.replace(path, "spec"),)
            e.message = e.args[0]
            raise


def _raised(failure: _native.Failure) -> HeadroomError:
    code, message, field, value, allowed = failure.args
    if code == 2:
        return SpecError(message, field, value, allowed)
    return HeadroomError(message)


def _call(native, *args, **kwargs) -> dict:
    try:
        text = native(*args, **kwargs)
    except _native.Failure as failure:
        raise _raised(failure) from None
    return json.loads(text)


def _paths(items: Sequence[PathLike]) -> list[str]:
    return [os.fspath(p) for p in items]


def _optional_path(path: Optional[PathLike]) -> Optional[str]:
    return os.fspath(path) if path is not None else None


def _gpus(gpus: Optional[int]) -> Optional[int]:
    if gpus is not None and (isinstance(gpus, bool) or not isinstance(gpus, int) or not 1 <= gpus <= 65536):
        raise SpecError(
            f"gpus: {gpus!r} is not allowed; use 1 to 65536",
            field="gpus",
            value=repr(gpus),
            allowed="1 to 65536",
        )
    return gpus


def estimate(
    spec: SpecLike, gpu: Optional[str] = None, *, spec_dir: Optional[PathLike] = None, rank: Optional[int] = None
) -> dict:
    """`headroom estimate SPEC [--gpu GPU] [--rank N] --json`: peak allocated and reserved bytes, the
    breakdown at the peak, each phase's peaks, and with `gpu` a fit verdict (`gpu` key). A sharded spec's
    numbers are its worst rank's; `rank` names a global rank to answer for instead."""
    if rank is not None and (isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < 2**64):
        raise SpecError(
            f"rank: {rank!r} is not allowed; use a rank of the spec's world (0 or more)",
            field="rank",
            value=repr(rank),
            allowed="0 to world_size - 1",
        )
    with _spec_file(spec, spec_dir) as (path, base):
        return _call(_native.estimate, path, gpu, base, rank)


def fit(
    spec: SpecLike,
    gpu: str,
    gpus: Optional[int] = None,
    *,
    residents: Sequence[PathLike] = (),
    accelerate_config: Optional[PathLike] = None,
    spec_dir: Optional[PathLike] = None,
) -> dict:
    """`headroom fit SPEC --gpu GPU [--gpus N] --json`: the largest micro-batch and sequence that
    fit, and the configurations that do. `gpus` defaults as the CLI's does: the spec's
    `parallel.world_size`, else 1."""
    with _spec_file(spec, spec_dir) as (path, base):
        return _call(
            _native.fit,
            path,
            gpu,
            _gpus(gpus),
            _paths(residents),
            _optional_path(accelerate_config),
            base,
        )


def diagnose(
    oom_text: Optional[Union[str, bytes]] = None,
    spec: Optional[SpecLike] = None,
    *,
    gpu: Optional[str] = None,
    gpus: Optional[int] = None,
    residents: Sequence[PathLike] = (),
    accelerate_config: Optional[PathLike] = None,
    deepspeed_config: Optional[PathLike] = None,
    scripts: Sequence[PathLike] = (),
    spec_dir: Optional[PathLike] = None,
) -> dict:
    """`headroom diagnose --oom LOG [--spec SPEC] --json`: what the out-of-memory message says
    (shortage, fragmentation, another process), and with the spec the remedies ranked by what
    the estimator says they save (`check.remedies`). `oom_text` is the error's text, a log or
    a traceback holding it (`str(exc)` of a `torch.cuda.OutOfMemoryError` will do)."""
    if oom_text is None and spec is None and accelerate_config is None and deepspeed_config is None and not scripts:
        raise SpecError(
            "nothing to diagnose: give oom_text (the error's text), and/or spec, "
            "accelerate_config, deepspeed_config, scripts",
        )
    if spec is None and residents:
        raise SpecError("residents need a spec: residents add to the run the spec describes", field="residents")
    oom = oom_text.encode("utf-8") if isinstance(oom_text, str) else oom_text
    args = dict(
        oom=oom,
        residents=_paths(residents),
        accelerate_config=_optional_path(accelerate_config),
        deepspeed_config=_optional_path(deepspeed_config),
        scripts=_paths(scripts),
        gpu=gpu,
        gpus=_gpus(gpus),
    )
    if spec is None:
        return _call(_native.diagnose, spec=None, spec_dir=None, **args)
    with _spec_file(spec, spec_dir) as (path, base):
        return _call(_native.diagnose, spec=path, spec_dir=base, **args)


def snapshot(path: PathLike) -> dict:
    """`headroom snapshot FILE --json`: a `torch.cuda.memory._dump_snapshot` file summarised:
    reserved, allocated, fragmentation, the peak and who held it."""
    return _call(_native.snapshot, os.fspath(path))


def replay(path: PathLike, alloc_conf: Optional[str] = None, ignore_addresses: bool = False) -> dict:
    """`headroom replay FILE [--alloc-conf STR] [--ignore-addresses] --json`: a snapshot's (or a
    `headroom trace` file's) allocations through the allocator simulator, under its own or
    another allocator setting (`"expandable_segments:True"`); `ignore_addresses` places new
    segments as an estimate does instead of at the snapshot's recorded addresses."""
    return _call(_native.replay, os.fspath(path), alloc_conf, ignore_addresses)


def gpu_of_device(device_name: str) -> str:
    """The GPU name headroom knows for `torch.cuda.get_device_name()`'s answer."""
    try:
        return _native.gpu_of_device(device_name)
    except _native.Failure as failure:
        raise _raised(failure) from None


def _python() -> str:
    return sys.executable or "python3"


def _measure(
    spec: SpecLike,
    python: Optional[str],
    snapshot: Optional[PathLike],
    record: Optional[PathLike],
    spec_dir: Optional[PathLike],
) -> dict:
    with _spec_file(spec, spec_dir) as (path, base):
        return _call(
            _native.measure,
            path,
            python or os.environ.get("HEADROOM_PYTHON") or _python(),
            _optional_path(snapshot),
            _optional_path(record),
            base,
        )
