"""Builds the project's CPU kernels: `python -m dlrm.kernels [--output PATH] [--if_missing]`.

`make install` runs it with `--if_missing`, which returns at once when the
library for the current sources and TensorFlow exists. Exit status 1, with the
compiler's output, when the build fails; the model then runs on TensorFlow's ops.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from dlrm import kernels


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--output", type=Path, help=f"the library (default: {kernels.library_path()})"
    )
    parser.add_argument(
        "--if_missing", action="store_true", help="do nothing when the library already exists"
    )
    args = parser.parse_args(argv)
    target = args.output or kernels.library_path()
    if args.if_missing and target.exists():
        print(f"[kernels] up to date: {target}")
        return 0
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    start = time.monotonic()
    try:
        path = kernels.build(args.output)
    except kernels.KernelBuildError as error:
        print(f"[kernels] not built: {error}", file=sys.stderr)
        return 1
    print(f"[kernels] built {path} in {time.monotonic() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
