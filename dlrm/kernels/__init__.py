"""The project's own CPU kernels: TensorFlow custom ops in C++, built at install.

TensorFlow's CPU kernels run some of DLRM's ops far below the machine's speed
(docs/performance.md). The kernels here replace them on the CPU:

- `DlrmDotInteraction` / `DlrmDotInteractionGrad` (`dot_interaction.cc`): the
  dot interaction, forward and backward, each sample's pairs computed while its
  vectors stay in cache; float32 and bfloat16.
- `DlrmAllFinite` (`all_finite.cc`): whether a list of tensors holds no NaN or
  infinity, one pass over their bits (the trainer's check of the gradients).
- `DlrmSparseSgd` (`sparse_sgd.cc`): SGD on the looked-up rows of all tables
  in one op, the tables shared among threads, each row updated in place.
- `DlrmEmbeddingLookup` (`embedding_lookup.cc`) and `DlrmEmbeddingSgd`
  (`sparse_sgd.cc`): every table's one-hot lookup written straight into the
  [B, sum of D] vectors, and SGD on those rows from the vectors' undivided
  gradient: no concatenation of 26 lookups, no split of their gradient.

`make install` compiles them with the system's g++ against the installed
TensorFlow's headers (`python -m dlrm.kernels`, a few seconds) into
`<venv>/lib/dlrm-kernels/`, under a name that carries a fingerprint of the
sources and of TensorFlow's version: a library built from other sources, or
for another TensorFlow, is never loaded. Without a library the model runs the
same computation on TensorFlow's ops (`dlrm.interaction`), slower.

The code is compiled for three CPU levels (AVX-512, AVX2 and baseline x86-64)
and the best one the CPU has is picked when the library is loaded, so a library
built on one machine runs on any x86-64 one. Not used on GPUs. Under XLA
(`--xla`) the dot interaction, inside the compiled dense part, runs on
TensorFlow's ops; the kernels outside it (lookups, finite check, updates) run.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

SOURCES = tuple(
    Path(__file__).with_name(name)
    for name in ("dot_interaction.cc", "all_finite.cc", "sparse_sgd.cc", "embedding_lookup.cc")
)
# Included by the sources: part of the fingerprint, not compiled on their own.
HEADERS = (Path(__file__).with_name("bfloat16.h"),)
# The C++ compiler: $CXX, else g++.
COMPILER_ENV = "CXX"
# -O3: the kernels' SIMD arithmetic is written with GCC vector types. The warnings
# left out are about TensorFlow's and Eigen's headers, and -Wno-psabi about
# passing vector types between the target clones.
COMPILE_OPTIONS = (
    "-O3",
    "-shared",
    "-fPIC",
    "-Wno-deprecated-declarations",
    "-Wno-psabi",
    "-Wno-interference-size",
)

_lock = threading.Lock()
_loaded: dict[Path, Any] = {}


class KernelBuildError(RuntimeError):
    """The compiler failed or is missing; the message holds its output's end."""


def tensorflow_version() -> str:
    """The installed TensorFlow distribution's version, without importing it."""
    for name in ("tensorflow-cpu", "tensorflow"):
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return "none"


def fingerprint() -> str:
    """Of the sources, the build options and the TensorFlow they compile against."""
    digest = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        digest.update(source.read_bytes())
    digest.update(" ".join(COMPILE_OPTIONS).encode())
    digest.update(tensorflow_version().encode())
    return digest.hexdigest()[:16]


def library_dir() -> Path:
    return Path(sys.prefix) / "lib" / "dlrm-kernels"


def library_path() -> Path:
    """Where the library for the current sources and TensorFlow is (or goes)."""
    return library_dir() / f"dlrm_kernels-{fingerprint()}.so"


def build(output: Path | None = None) -> Path:
    """Compiles the kernels into `output` (default: `library_path()`).

    The library is written under a temporary name in the same directory and
    renamed when the compiler succeeded, so no half-written library is ever at
    `output`. Libraries of other fingerprints in the default directory are
    removed. Raises KernelBuildError when the compiler fails or is missing.
    """
    import tensorflow as tf

    target = output or library_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    compiler = os.environ.get(COMPILER_ENV, "g++")
    if shutil.which(compiler) is None:
        raise KernelBuildError(f"no C++ compiler: '{compiler}' (${COMPILER_ENV} or g++) not found")
    handle, staging = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    os.close(handle)
    with tempfile.TemporaryDirectory(prefix=".objects-", dir=target.parent) as objects:
        try:
            # One compiler per source, side by side, then one link.
            compiles = []
            for source in SOURCES:
                obj = str(Path(objects) / f"{source.stem}.o")
                command = [compiler, *COMPILE_OPTIONS, "-c", str(source), "-o", obj]
                compiles.append((obj, _start(command + tf.sysconfig.get_compile_flags())))
            try:
                for _, process in compiles:
                    _finish(process, compiler, target)
            finally:
                for _, process in compiles:  # the others, when one failed
                    process.kill()
                    process.wait()
            link = [compiler, *COMPILE_OPTIONS, *(obj for obj, _ in compiles), "-o", staging]
            _finish(_start(link + tf.sysconfig.get_link_flags()), compiler, target)
            os.chmod(staging, 0o755)  # mkstemp's 0600 would hide it from other users
            os.replace(staging, target)
        finally:
            Path(staging).unlink(missing_ok=True)
    if output is None:
        for old in target.parent.glob("dlrm_kernels-*.so"):
            if old != target:
                old.unlink(missing_ok=True)
    return target


def _start(command: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(process: subprocess.Popen[str], compiler: str, target: Path) -> None:
    """Waits for a compiler; KernelBuildError with its error lines if it failed."""
    _, stderr = process.communicate()
    if process.returncode != 0:
        errors = [line for line in stderr.splitlines() if "error" in line]
        raise KernelBuildError(
            f"{compiler} exited with {process.returncode} building {target.name}:\n"
            + "\n".join(errors[:20] or stderr.splitlines()[-20:])
        )


def load(path: Path | None = None) -> Any | None:
    """The kernels' TensorFlow module (`tf.load_op_library`), or None when no
    library was built for the current sources and TensorFlow."""
    path = path or library_path()
    with _lock:
        if path in _loaded:
            return _loaded[path]
        if not path.exists():
            return None
        import tensorflow as tf

        module = tf.load_op_library(str(path))
        if not _loaded:
            _register_gradients(module)
        _loaded[path] = module
        return module


def require() -> Any:
    """The loaded library; RuntimeError naming the fix when it was not built."""
    module = load()
    if module is None:
        raise RuntimeError(
            f"the project's CPU kernels are not built for these sources and TensorFlow "
            f"{tensorflow_version()} (expected {library_path()}): run `make install` or "
            "`python -m dlrm.kernels`"
        )
    return module


def _register_gradients(module: Any) -> None:
    import tensorflow as tf

    @tf.RegisterGradient("DlrmDotInteraction")
    def _dot_interaction_gradient(op: Any, gradient: Any) -> Any:
        return module.dlrm_dot_interaction_grad(gradient, op.inputs[0], op.inputs[1])

    @tf.RegisterGradient("DlrmEmbeddingLookup")
    def _embedding_lookup_gradient(op: Any, gradient: Any) -> Any:
        # Each table's rows, as `tf.gather`'s gradient gives them. The trainer's
        # SGD skips this (DlrmEmbeddingSgd reads the undivided gradient); other
        # optimizers and callers of tf.GradientTape get it.
        widths = op.get_attr("widths")
        ids = op.inputs[len(widths)]
        pieces = tf.split(tf.cast(gradient, tf.float32), widths, axis=1)
        slices = [
            tf.IndexedSlices(
                piece, ids[:, t], tf.raw_ops.VariableShape(input=op.inputs[t], out_type=tf.int64)
            )
            for t, piece in enumerate(pieces)
        ]
        return [*slices, None]
