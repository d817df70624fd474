"""The `headroom` console script of the wheel: the same program as the cargo binary."""

from __future__ import annotations

import os
import sys

from . import _native


def main() -> None:
    # The Rust side writes to the process's own stdout; what Python buffered goes first.
    sys.stdout.flush()
    sys.stderr.flush()
    argv = [os.fsdecode(a) for a in sys.argv]
    argv[0] = "headroom"
    sys.exit(_native.main(argv, sys.executable or "python3"))


if __name__ == "__main__":
    main()
