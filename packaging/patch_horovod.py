"""Patches a Horovod 0.28.1 source tree so that it builds against TensorFlow 2.21.

Why, one fix each (the first two are needed by the GPU build,
HOROVOD_GPU_OPERATIONS=NCCL; the CPU build needs the first; the third, fourth and
sixth are for every build's launcher, `horovodrun`; the fifth makes every build
faster):

1. `horovod/tensorflow/xla_mpi_ops.cc` includes TensorFlow's XLA headers under
   `tensorflow/compiler/xla/...` (e.g. `client/xla_builder.h`) whenever
   TENSORFLOW_VERSION >= 2.6. TensorFlow 2.21 no longer ships several of them, so the
   build fails there. The patch disables the whole XLA section (includes and ops) for
   every build: our design keeps collectives out of XLA, and Horovod's XLA ops are
   opt-in (HOROVOD_ENABLE_XLA_OPS) anyway.
2. `horovod/tensorflow/mpi_ops.cc` (GPU code only) gets the CUDA stream of an op via
   `stream_executor::gpu::AsGpuStreamValue(stream)`, declared by Horovod itself; no
   library of TensorFlow 2.21 exports that symbol, so `import horovod.tensorflow` would
   fail at load. The patch replaces each call with what TensorFlow's public header
   offers, `Stream::platform_specific_handle().stream` (a void*, cast to the CUDA/ROCm
   stream type), and drops the forward declaration.
3. `horovod/common/util.py`: `horovodrun` checks which of its extensions were built
   with Gloo or MPI by importing them in a forked child whose output it means to mute
   ("Mutes all stdout/stderr"), but it replaces only Python's `sys.stdout` and
   `sys.stderr`, so TensorFlow's C++ start-up lines, written to file descriptor 2,
   still reach the user's terminal at every launch. The patch points descriptors 1
   and 2 of that child at the same null device.
4. `horovod/runner/launch.py`: when a rank exits non-zero, `horovodrun` raises a
   RuntimeError that says so and lets Python print it with a 20-line traceback of
   Horovod's own launcher, after the rank's own error message. The patch prints
   that RuntimeError's message as one line and exits 1, as before; other errors,
   and any run with `--log-level`, keep their traceback.
5. `setup.py` builds the native library as CMake's `RelWithDebInfo`, which Horovod's
   CMakeLists turns into `-O3 -g`: the same optimised code plus debug information for
   every TensorFlow header it includes, which slows the compile and makes the library
   several times larger. The patch builds `Release` (`-O3`, no `-g`).
6. `horovod/common/util.py` again: at every launch `horovodrun` asks whether Horovod
   was built with Gloo (or MPI) by importing an extension, `horovod.tensorflow`, in a
   forked child, and so imports TensorFlow's Python package there: 4-5 s on 2 cores
   before any rank starts. The patch asks the extension's native library instead,
   loaded with ctypes after TensorFlow's two shared libraries that it links
   (`libtensorflow_framework.so.2`, `libtensorflow_cc.so.2`, from the installed
   package's directory, which is found without importing it): about 1 s. Any failure
   on that way falls back to the import; the other checks (`--check-build`'s
   "available", GPU presence) import as before.

Every patch checks that the code it expects is there and fails loudly otherwise, so a
different Horovod version is not silently mis-patched. It is idempotent: running it on
a patched tree changes nothing.

Usage: python patch_horovod.py HOROVOD_SOURCE_DIR
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

XLA_FILE = Path("horovod", "tensorflow", "xla_mpi_ops.cc")
XLA_ORIGINAL = "#if TENSORFLOW_VERSION >= 2006000000\n"
XLA_PATCHED = "#if 0 && TENSORFLOW_VERSION >= 2006000000  // patched: XLA ops disabled (TF 2.21)\n"

STREAM_FILE = Path("horovod", "tensorflow", "mpi_ops.cc")
STREAM_CALL = "stream_executor::gpu::AsGpuStreamValue("
STREAM_DECLARATION = (
    "// Forward declaration of AsGpuStreamValue\n"
    "namespace stream_executor {\n"
    "namespace gpu {\n"
    "GpuStreamHandle AsGpuStreamValue(Stream* stream);\n"
    "} // namespace stream_executor\n"
    "} // namespace gpu\n"
)
STREAM_MARKER = "// patched: GPU stream handles via Stream::platform_specific_handle()\n"

MUTE_FILE = Path("horovod", "common", "util.py")
MUTE_ORIGINAL = (
    "            sys.stdout = open(os.devnull, 'w')\n"
    "            sys.stderr = open(os.devnull, 'w')\n"
)
MUTE_PATCHED = MUTE_ORIGINAL + (
    "            # patched: native libraries (TensorFlow's C++ logs) write to the descriptors\n"
    "            os.dup2(sys.stdout.fileno(), 1)\n"
    "            os.dup2(sys.stderr.fileno(), 2)\n"
)
SETUP_FILE = Path("setup.py")
SETUP_ORIGINAL = "os.environ.get('HOROVOD_DEBUG') == \"1\" else 'RelWithDebInfo'\n"
SETUP_PATCHED = (
    "os.environ.get('HOROVOD_DEBUG') == \"1\" else 'Release'  # patched: no debug info\n"
)
LIBRARY_ORIGINAL = "            ext = importlib.import_module('.' + ext_base_name, 'horovod')\n"
LIBRARY_PATCHED = (
    "            # patched: TensorFlow's extension asked through its library, not its import\n"
    "            ext = (_library_of(ext_base_name, fn_desc)\n"
    "                   or importlib.import_module('.' + ext_base_name, 'horovod'))\n"
)
LIBRARY_CHECK_ORIGINAL = "def _check_extension_lambda(ext_base_name, fn, fn_desc, verbose):\n"
LIBRARY_HELPER = """def _library_of(ext_base_name, fn_desc):
    \"\"\"patched: for what the TensorFlow extension was built with, its native library,
    loaded without importing TensorFlow's Python package (4-5 s at every horovodrun
    launch): first the two TensorFlow libraries it links, from the installed
    package's directory. None (import the extension instead) for other checks, or
    when it cannot be loaded this way.\"\"\"
    if ext_base_name != 'tensorflow' or not fn_desc.startswith('built with'):
        return None
    try:
        import ctypes
        import importlib.util
        from horovod.common.basics import HorovodBasics
        tensorflow = importlib.util.find_spec('tensorflow')
        directory = list(tensorflow.submodule_search_locations)[0]
        for name in ('libtensorflow_framework.so.2', 'libtensorflow_cc.so.2'):
            ctypes.CDLL(os.path.join(directory, name), mode=ctypes.RTLD_GLOBAL)
        return HorovodBasics(importlib.util.find_spec('horovod.tensorflow').origin, 'mpi_lib')
    except Exception:
        return None


"""
# An argument usable as the left operand of `->` without parentheses.
_POSTFIX_EXPRESSION = re.compile(r"[A-Za-z_][\w:]*(?:(?:->|\.)[A-Za-z_]\w*(?:\(\))?)*")


class PatchError(SystemExit):
    """An expected pattern is missing: not the Horovod source this patch was written for."""


def _fail(path: Path, what: str) -> PatchError:
    return PatchError(f"{path}: {what}; is this Horovod 0.28.1? Refusing to patch.")


def patch_xla(text: str, path: Path) -> tuple[str, str]:
    """xla_mpi_ops.cc: the XLA section behind `#if 0`. Returns (new text, what was done)."""
    if XLA_PATCHED in text:
        return text, "already patched"
    if text.count(XLA_ORIGINAL) != 1:
        raise _fail(
            path,
            f"expected exactly one line {XLA_ORIGINAL.strip()!r} to patch, found "
            f"{text.count(XLA_ORIGINAL)}",
        )
    return text.replace(XLA_ORIGINAL, XLA_PATCHED), "patched (XLA section disabled)"


LAUNCH_FILE = Path("horovod", "runner", "launch.py")
LAUNCH_ORIGINAL = """    if args.log_level:
        logging.addLevelName(logging.NOTSET, 'TRACE')
        logging.basicConfig(level=logging.getLevelName(args.log_level))

    _run(args)
"""
LAUNCH_PATCHED = """    if args.log_level:
        logging.addLevelName(logging.NOTSET, 'TRACE')
        logging.basicConfig(level=logging.getLevelName(args.log_level))

    # patched: a failed rank is reported in one line; the rank's output says why
    try:
        _run(args)
    except RuntimeError as error:
        failed_rank = str(error).startswith(('Horovod detected that one or more processes',
                                             'mpirun failed'))
        if args.log_level or not failed_rank:
            raise
        sys.exit('horovodrun: ' + ' '.join(str(error).split()))
"""


def _replace_once(
    text: str, path: Path, original: str, patched: str, expected: str, done: str
) -> tuple[str, str]:
    """`original`, which must occur once in `text`, replaced by `patched`: (new text,
    `done`); the text as it is when already patched; else PatchError naming `expected`."""
    if patched in text:
        return text, "already patched"
    if text.count(original) != 1:
        raise _fail(path, f"expected exactly one {expected}")
    return text.replace(original, patched), done


def patch_launch(text: str, path: Path) -> tuple[str, str]:
    """runner/launch.py: a rank's non-zero exit ends horovodrun without a traceback."""
    return _replace_once(
        text,
        path,
        LAUNCH_ORIGINAL,
        LAUNCH_PATCHED,
        "call of _run(args) in run_commandline",
        "patched (failed ranks in one line)",
    )


def patch_mute(text: str, path: Path) -> tuple[str, str]:
    """common/util.py: the extension check's child mutes descriptors 1 and 2 too."""
    return _replace_once(
        text,
        path,
        MUTE_ORIGINAL,
        MUTE_PATCHED,
        "place that mutes the extension check's output",
        "patched (extension check muted)",
    )


def patch_setup(text: str, path: Path) -> tuple[str, str]:
    """setup.py: the native library is built as Release, without debug information."""
    return _replace_once(
        text,
        path,
        SETUP_ORIGINAL,
        SETUP_PATCHED,
        "RelWithDebInfo build configuration",
        "patched (Release build, no debug info)",
    )


def patch_library_check(text: str, path: Path) -> tuple[str, str]:
    """common/util.py: what the TensorFlow extension was built with is asked of its
    library, without importing TensorFlow."""
    if LIBRARY_PATCHED in text and LIBRARY_HELPER in text:
        return text, "already patched"
    if text.count(LIBRARY_ORIGINAL) != 1 or text.count(LIBRARY_CHECK_ORIGINAL) != 1:
        raise _fail(path, "expected exactly one import of the extension to check")
    text = text.replace(LIBRARY_ORIGINAL, LIBRARY_PATCHED)
    text = text.replace(LIBRARY_CHECK_ORIGINAL, LIBRARY_HELPER + LIBRARY_CHECK_ORIGINAL)
    return text, "patched (build checks ask the library)"


def _call_end(text: str, start: int, path: Path) -> int:
    """Index just past the `)` closing the call whose `(` is at text[start - 1]."""
    depth = 1
    for index in range(start, len(text)):
        if text[index] == "(":
            depth += 1
        elif text[index] == ")":
            depth -= 1
            if depth == 0:
                return index + 1
    raise _fail(path, f"unbalanced parentheses after {STREAM_CALL!r}")


def patch_stream(text: str, path: Path) -> tuple[str, str]:
    """mpi_ops.cc: AsGpuStreamValue(s) -> s->platform_specific_handle().stream."""
    if STREAM_MARKER in text and "AsGpuStreamValue" not in text:
        return text, "already patched"
    if text.count(STREAM_DECLARATION) != 1:
        raise _fail(path, "expected the forward declaration of AsGpuStreamValue")
    text = text.replace(STREAM_DECLARATION, STREAM_MARKER)
    parts: list[str] = []
    position = calls = 0
    while (found := text.find(STREAM_CALL, position)) >= 0:
        argument_start = found + len(STREAM_CALL)
        end = _call_end(text, argument_start, path)
        argument = " ".join(text[argument_start : end - 1].split())
        if not _POSTFIX_EXPRESSION.fullmatch(argument):
            argument = f"({argument})"
        parts += [
            text[position:found],
            f"static_cast<GpuStreamHandle>({argument}->platform_specific_handle().stream)",
        ]
        position = end
        calls += 1
    text = "".join([*parts, text[position:]])
    if calls == 0:
        raise _fail(path, f"expected calls of {STREAM_CALL[:-1]!r}")
    if "AsGpuStreamValue" in text:
        raise _fail(path, "AsGpuStreamValue is still used in a form this patch does not know")
    return text, f"patched ({calls} AsGpuStreamValue calls -> platform_specific_handle)"


def patch(source_dir: Path) -> str:
    """Applies every patch to the Horovod tree at source_dir; returns what was done.

    All files are checked before any is written, so a failure leaves the tree untouched.
    """
    texts: dict[Path, tuple[str, str]] = {}  # path: (original, patched so far)
    done = []
    for relative, patch_text in [
        (XLA_FILE, patch_xla),
        (STREAM_FILE, patch_stream),
        (MUTE_FILE, patch_mute),
        (LAUNCH_FILE, patch_launch),
        (SETUP_FILE, patch_setup),
        (MUTE_FILE, patch_library_check),
    ]:
        path = source_dir / relative
        if path not in texts:
            if not path.is_file():
                raise _fail(path, "file not found")
            original = path.read_text()
            texts[path] = (original, original)
        original, text = texts[path]
        text, what = patch_text(text, path)
        texts[path] = (original, text)
        done.append(f"{path}: {what}")
    for path, (original, text) in texts.items():
        if text != original:
            path.write_text(text)
    return "\n".join(done)


if __name__ == "__main__":
    if len(sys.argv) != 2:
        raise SystemExit(__doc__)
    print(patch(Path(sys.argv[1])))
