"""Patches a Horovod 0.28.1 source tree so that it builds against TensorFlow 2.21.

Why: `horovod/tensorflow/xla_mpi_ops.cc` includes TensorFlow's XLA headers under
`tensorflow/compiler/xla/...` whenever TENSORFLOW_VERSION >= 2.6. TensorFlow 2.21
no longer ships those paths, so a CPU build fails there, although everything after
the includes is already inside `#if HAVE_GPU` (the XLA ops serve GPU builds only).
The patch moves the GPU guard in front of the includes. It is idempotent: running it
on a patched tree changes nothing.

Usage: python patch_horovod.py HOROVOD_SOURCE_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path

ORIGINAL = "#if TENSORFLOW_VERSION >= 2006000000\n"
PATCHED = "#if TENSORFLOW_VERSION >= 2006000000 && HAVE_GPU  // patched: XLA ops are GPU-only\n"


def patch(source_dir: Path) -> str:
    path = source_dir / "horovod" / "tensorflow" / "xla_mpi_ops.cc"
    text = path.read_text()
    if PATCHED in text:
        return f"{path}: already patched"
    if text.count(ORIGINAL) != 1:
        raise SystemExit(
            f"{path}: expected exactly one line {ORIGINAL.strip()!r} to patch, found "
            f"{text.count(ORIGINAL)}; is this Horovod 0.28.1?"
        )
    path.write_text(text.replace(ORIGINAL, PATCHED))
    return f"{path}: patched (XLA section guarded by HAVE_GPU)"


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    print(patch(Path(sys.argv[1])))
