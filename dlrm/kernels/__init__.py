"""The project's own CPU kernels: TensorFlow custom ops in C++, built at install.

TensorFlow's CPU kernels run some of DLRM's ops far below the machine's speed
(docs/performance.md). The kernels here replace them on the CPU:

- `DlrmDotInteraction` / `DlrmDotInteractionGrad` (`dot_interaction.cc`): the
  dot interaction, forward and backward, each sample's pairs computed while its
  vectors stay in cache; float32 and bfloat16.
- `DlrmAllFinite` (`all_finite.cc`): whether a list of tensors holds no NaN or
  infinity, one pass over their bits (the trainer's check of the gradients).
- `DlrmEmbeddingLookup` (`embedding_lookup.cc`): every table's one-hot lookup
  written straight into the [B, sum of D] vectors: no concatenation of 26
  lookups; float32, bfloat16 or float16 tables, widened.
- `DlrmEmbeddingApply` (`embedding_apply.cc`): one SGD, Adagrad, lazy Adam or row-wise Adagrad
  step on the looked-up rows of many tables (row-range shards among them),
  read straight from the gradients of the lookups' outputs, each table's part
  of a gradient a "piece" (`dlrm.embedding.update`): no split of the vectors'
  gradient per table; duplicate ids summed once in float32, the tables and
  their rows shared among threads, copy-on-read as TensorFlow's own sparse
  updates (with its public helpers, `training_op_helpers.h`); a 16-bit table's
  rows updated in float32 and stored with stochastic rounding (`rounding.h`).

`make install` compiles them with the system's g++ against the installed
TensorFlow's headers (`python -m dlrm.kernels`, about 15 s) into
`<venv>/lib/dlrm-kernels/`, under a name that carries a fingerprint of the
sources and of TensorFlow's version: a library built from other sources, or
for another TensorFlow, is never loaded. An installation that did not build
them (`pip install` of the wheel) builds them on first use, once, into the
environment's `lib/` or, where that is read-only, into a per-user cache
(`$XDG_CACHE_HOME/dlrm-hybrid/kernels`); ranks starting together wait for
one build. Where they cannot be built (no compiler, another CPU architecture)
or loaded, one line says so, and the model runs the same computation on
TensorFlow's ops (`dlrm.model.interaction`), slower.

The code is compiled for three CPU levels (AVX-512, AVX2 and baseline x86-64)
and the best one the CPU has is picked when the library is loaded, so a library
built on one machine runs on any x86-64 one. Not used on GPUs. Under XLA
(`--xla`) the dot interaction, inside the compiled dense part, runs on
TensorFlow's ops; the kernels outside it (lookups, finite check, updates) run.
"""

from __future__ import annotations

import fcntl
import functools
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
    for name in (
        "dot_interaction.cc",
        "all_finite.cc",
        "embedding_lookup.cc",
        "embedding_apply.cc",
    )
)
# Included by the sources: part of the fingerprint, not compiled on their own.
HEADERS = (Path(__file__).with_name("bfloat16.h"), Path(__file__).with_name("rounding.h"))
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
# The library for the current sources and TensorFlow, once loaded: what `require()`
# returns without looking for files again (it runs while TensorFlow traces steps).
_current: Any | None = None


class KernelBuildError(RuntimeError):
    """The compiler failed or is missing; the message holds its output's end."""


def tensorflow_version() -> str:
    """The installed TensorFlow distribution and version, without importing it."""
    for name in ("tensorflow-cpu", "tensorflow"):
        try:
            return f"{name} {importlib.metadata.version(name)}"
        except importlib.metadata.PackageNotFoundError:
            continue
    return "none"


def fingerprint() -> str:
    """Of the sources, the build options and the TensorFlow they compile against."""
    return _fingerprint(tensorflow_version())


@functools.cache
def _fingerprint(tensorflow: str) -> str:
    # Hashed once per process: library_path() is asked on every load.
    digest = hashlib.sha256()
    for source in (*SOURCES, *HEADERS):
        digest.update(source.read_bytes())
    digest.update(" ".join(COMPILE_OPTIONS).encode())
    digest.update(tensorflow.encode())
    return digest.hexdigest()[:16]


def library_dirs() -> tuple[Path, ...]:
    """Where libraries are looked for and built, in order: the environment's own
    (`<venv>/lib/dlrm-kernels`), then a per-user cache, for an installation
    whose environment is read-only."""
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return (Path(sys.prefix) / "lib" / "dlrm-kernels", cache / "dlrm-hybrid" / "kernels")


def library_path() -> Path:
    """The library for the current sources and TensorFlow: where it is, else where
    it goes (the first of `library_dirs()` that this user may write)."""
    name = f"dlrm_kernels-{fingerprint()}.so"
    candidates = [directory / name for directory in library_dirs()]
    for candidate in candidates:
        if candidate.exists():
            return candidate
    for candidate in candidates:
        if _writable(candidate.parent):
            return candidate
    return candidates[0]


def _writable(directory: Path) -> bool:
    """Whether `directory` exists writable, or could be created: its nearest
    existing ancestor is writable."""
    for path in (directory, *directory.parents):
        if path.exists():
            return path.is_dir() and os.access(path, os.W_OK | os.X_OK)
    return False


def build(output: Path | None = None) -> Path:
    """Compiles the kernels into `output` (default: `library_path()`).

    The library is written under a temporary name in the same directory and
    renamed when the compiler succeeded, so no half-written library is ever at
    `output`. Libraries of other fingerprints in the default directory, and
    notes of failed builds there, are removed. Raises KernelBuildError when the
    compiler fails or is missing.
    """
    import tensorflow as tf

    target = output or library_path()
    target.parent.mkdir(parents=True, exist_ok=True)
    compiler = os.environ.get(COMPILER_ENV, "g++")
    if shutil.which(compiler) is None:
        raise KernelBuildError(f"no C++ compiler: '{compiler}' (${COMPILER_ENV} or g++) not found")
    handle, staging = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    os.close(handle)
    with tempfile.TemporaryDirectory(prefix=".unity-", dir=target.parent) as scratch:
        try:
            # One translation unit that includes every source: TensorFlow's headers,
            # most of each source's compile time, are parsed once instead of once per
            # source (half the CPU time of separate compiles). EIGEN_USE_THREADS, which
            # embedding_apply.cc needs, comes before any source includes Eigen.
            unity = Path(scratch) / "dlrm_kernels.cc"
            unity.write_text(
                "#define EIGEN_USE_THREADS\n"
                + "".join(f'#include "{source}"\n' for source in SOURCES)
            )
            command = [compiler, *COMPILE_OPTIONS, str(unity), "-o", staging]
            flags = tf.sysconfig.get_compile_flags() + tf.sysconfig.get_link_flags()
            _compile(command + flags, compiler, target)
            os.chmod(staging, 0o755)  # mkstemp's 0600 would hide it from other users
            os.replace(staging, target)
        finally:
            Path(staging).unlink(missing_ok=True)
    if output is None:  # libraries of other fingerprints, and notes of failed builds
        for old in target.parent.glob("dlrm_kernels-*"):
            if old != target:
                old.unlink(missing_ok=True)
    return target


def _compile(command: list[str], compiler: str, target: Path) -> None:
    """Runs the compiler; KernelBuildError with its error lines if it failed."""
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        lines = result.stderr.splitlines()
        errors = [line for line in lines if "error" in line]
        raise KernelBuildError(
            f"{compiler} exited with {result.returncode} building {target.name}:\n"
            + "\n".join(errors[:20] or lines[-20:])
        )


# Why the last `load()` gave None, in words; None after a load that succeeded.
_unavailable: str | None = None


def load(path: Path | None = None) -> Any | None:
    """The kernels' TensorFlow module (`tf.load_op_library`), or None, with the
    reason in `unavailable_reason()`.

    Without `path`: the library for the current sources and TensorFlow, built
    first when missing (`ensure_built`), and kept once loaded: later calls,
    made while TensorFlow traces the model's steps, look for no file. With
    `path`: that file, never built. A library that exists but does not load
    (another architecture, a broken file) gives None too: the model then runs
    on TensorFlow's ops."""
    global _current
    with _lock:
        if path is not None:
            return _load(path)
        if _current is None:
            built = ensure_built()
            _current = None if built is None else _load(built)
        return _current


def _load(path: Path) -> Any | None:
    global _unavailable
    if path in _loaded:
        return _loaded[path]
    if not path.exists():
        _unavailable = f"{path} is missing"
        return None
    import tensorflow as tf

    try:
        module = tf.load_op_library(str(path))
    except (tf.errors.OpError, OSError) as error:
        first_line = str(error).strip().splitlines()[0] if str(error).strip() else ""
        _unavailable = f"{path} did not load: {type(error).__name__}: {first_line}"
        return None
    if not _loaded:
        _register_gradients(module)
    _loaded[path] = module
    _unavailable = None
    return module


def unavailable_reason() -> str | None:
    """Why the last `load()` gave None (one line), or None."""
    return _unavailable


def ensure_built() -> Path | None:
    """The library for the current sources and TensorFlow, compiled now if no
    library is there yet (once: ranks that start together wait on a lock for
    one build, and a failed build leaves a note beside it that later runs read
    instead of compiling again; `python -m dlrm.kernels` retries). None, with
    the reason in `unavailable_reason()`, when it cannot be built."""
    global _unavailable
    target = library_path()
    if target.exists():
        return target
    failed = target.with_name(target.name + ".failed")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        lock = (target.parent / ".build.lock").open("w")
    except OSError as error:
        _unavailable = f"{target.parent} is not writable to build them in ({error.strerror})"
        return None
    with lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if target.exists():  # another process built it meanwhile
            return target
        if failed.exists():
            _unavailable = failed.read_text().strip()
            return None
        print(
            f"[kernels] compiling the CPU kernels for {tensorflow_version()} into "
            f"{target.parent} (once; about 15 s)",
            file=sys.stderr,
            flush=True,
        )
        try:
            return build()
        except KernelBuildError as error:
            reason = str(error).splitlines()[0]
            _unavailable = f"their build failed: {reason} (`python -m dlrm.kernels` retries)"
            failed.write_text(_unavailable + "\n")
            return None


def require() -> Any:
    """The loaded library; RuntimeError naming the reason when there is none."""
    module = load()
    if module is None:
        raise RuntimeError(
            f"the project's CPU kernels are not available for {tensorflow_version()}: "
            f"{unavailable_reason()}; `python -m dlrm.kernels` builds them"
        )
    return module


def _register_gradients(module: Any) -> None:
    import tensorflow as tf

    @tf.RegisterGradient("DlrmDotInteraction")
    def _dot_interaction_gradient(op: Any, gradient: Any) -> Any:
        return module.dlrm_dot_interaction_grad(gradient, op.inputs[0], op.inputs[1])

    @tf.RegisterGradient("DlrmEmbeddingLookup")
    def _embedding_lookup_gradient(op: Any, gradient: Any) -> Any:
        # Each table's rows, as `tf.gather`'s gradient gives them, for callers of
        # tf.GradientTape. The trainer does not differentiate through lookups:
        # the layer's backward hands the undivided gradient to DlrmEmbeddingApply.
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
