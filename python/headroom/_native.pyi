from typing import Optional, Sequence

__version__: str

class Failure(Exception):
    """args: (code, message, field, value, allowed)"""

def estimate(
    spec: str, gpu: Optional[str] = None, spec_dir: Optional[str] = None, rank: Optional[int] = None
) -> str: ...
def fit(
    spec: str,
    gpu: str,
    gpus: Optional[int] = None,
    residents: Sequence[str] = ...,
    accelerate_config: Optional[str] = None,
    spec_dir: Optional[str] = None,
) -> str: ...
def diagnose(
    oom: Optional[bytes] = None,
    spec: Optional[str] = None,
    spec_dir: Optional[str] = None,
    residents: Sequence[str] = ...,
    accelerate_config: Optional[str] = None,
    deepspeed_config: Optional[str] = None,
    scripts: Sequence[str] = ...,
    gpu: Optional[str] = None,
    gpus: Optional[int] = None,
) -> str: ...
def snapshot(file: str) -> str: ...
def replay(file: str, alloc_conf: Optional[str] = None, ignore_addresses: bool = False) -> str: ...
def measure(
    spec: str,
    python: str,
    snapshot: Optional[str] = None,
    record: Optional[str] = None,
    spec_dir: Optional[str] = None,
) -> str: ...
def gpu_of_device(device: str) -> str: ...
def main(argv: Sequence[str], host_python: str) -> int: ...
