"""packaging/patch_horovod.py on small synthetic copies of the five Horovod 0.28.1 sources
it patches (the lines it looks for, copied from the sdist): every fix applied, a second
run a no-op, and a loud failure, with nothing written, when an expected pattern is
missing (another Horovod version)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

from harness.processes import REPO, run

SCRIPT = REPO / "packaging" / "patch_horovod.py"
_spec = importlib.util.spec_from_file_location("patch_horovod", SCRIPT)
assert _spec is not None and _spec.loader is not None
patch_horovod = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(patch_horovod)

XLA_SOURCE = """\
#include <memory>

#if TENSORFLOW_VERSION >= 2006000000

#include "tensorflow/compiler/tf2xla/xla_op_kernel.h"
#include "tensorflow/compiler/xla/client/xla_builder.h"

#if HAVE_GPU
#include "../common/common.h"
#endif // HAVE_GPU
#endif // TENSORFLOW_VERSION >= 2006000000"""

MPI_OPS_SOURCE = """\
#if HAVE_GPU
using GpuStreamHandle = cudaStream_t;

// Forward declaration of AsGpuStreamValue
namespace stream_executor {
namespace gpu {
GpuStreamHandle AsGpuStreamValue(Stream* stream);
} // namespace stream_executor
} // namespace gpu
#if TENSORFLOW_VERSION >= 2011000000
#include "tensorflow/compiler/xla/stream_executor/stream.h"
#endif // TENSORFLOW_VERSION >= 2011000000
#endif // HAVE_GPU

void Record() {
  auto stream = stream_executor::gpu::AsGpuStreamValue(device_context->stream());
}
void Zero() {
    auto stream = (device_context != nullptr) ? ZERO_CALL : 0;
}
void Wait() {
              auto stream = stream_executor::gpu::AsGpuStreamValue(
                  device_context->stream());
}
""".replace("ZERO_CALL", "stream_executor::gpu::AsGpuStreamValue(device_context->stream())")

UTIL_SOURCE = """\
def _check_extension_lambda(ext_base_name, fn, fn_desc, verbose):
    def _target_fn(ext_base_name, fn, fn_desc, queue, verbose):
        if verbose:
            print('Checking whether extension {ext_base_name} was {fn_desc}.'.format(
                ext_base_name=ext_base_name, fn_desc=fn_desc))
        else:
            # Suppress output
            sys.stdout = open(os.devnull, 'w')
            sys.stderr = open(os.devnull, 'w')

        try:
            ext = importlib.import_module('.' + ext_base_name, 'horovod')
            result = fn(ext)
        except:
            result = None
"""

LAUNCH_SOURCE = """\
def run_commandline():
    args = parse_args()

    if args.log_level:
        logging.addLevelName(logging.NOTSET, 'TRACE')
        logging.basicConfig(level=logging.getLevelName(args.log_level))

    _run(args)


if __name__ == '__main__':
    run_commandline()
"""

SETUP_SOURCE = """\
    def build_extensions(self):
        cmake_bin = get_cmake_bin()

        config = 'Debug' if self.debug or CONFIG

        ext_name = self.extensions[0].name
""".replace("CONFIG", """os.environ.get('HOROVOD_DEBUG') == "1" else 'RelWithDebInfo'""")

HANDLE = "static_cast<GpuStreamHandle>(device_context->stream()->platform_specific_handle().stream)"


SOURCES = {
    patch_horovod.XLA_FILE: XLA_SOURCE,
    patch_horovod.STREAM_FILE: MPI_OPS_SOURCE,
    patch_horovod.MUTE_FILE: UTIL_SOURCE,
    patch_horovod.LAUNCH_FILE: LAUNCH_SOURCE,
    patch_horovod.SETUP_FILE: SETUP_SOURCE,
}


def make_tree(root: Path, changes: dict[Path, str] | None = None) -> Path:
    """The five sources under `root`, as in the sdist unless `changes` gives one."""
    for name, text in (SOURCES | (changes or {})).items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root


def read_tree(root: Path) -> dict[Path, str]:
    return {name: (root / name).read_text() for name in SOURCES}


def patched(root: Path, name: Path, changes: dict[Path, str] | None = None) -> str:
    """The text of `name` after patching the tree."""
    patch_horovod.patch(make_tree(root, changes))
    return (root / name).read_text()


def test_disables_the_xla_section(tmp_path: Path) -> None:
    xla = patched(tmp_path, patch_horovod.XLA_FILE)
    assert xla.startswith("#include <memory>\n\n#if 0 && TENSORFLOW_VERSION >= 2006000000  //")
    assert xla.count("#if 0") == 1
    # Only that line changed; the closing #endif is untouched.
    assert xla.splitlines()[3:] == XLA_SOURCE.splitlines()[3:]


def test_replaces_every_as_gpu_stream_value_call(tmp_path: Path) -> None:
    mpi_ops = patched(tmp_path, patch_horovod.STREAM_FILE)
    assert "AsGpuStreamValue" not in mpi_ops
    assert "namespace stream_executor {" not in mpi_ops
    assert mpi_ops.count(HANDLE) == 3
    assert f"  auto stream = {HANDLE};\n" in mpi_ops
    assert f"(device_context != nullptr) ? {HANDLE} : 0;" in mpi_ops
    assert f"              auto stream = {HANDLE};\n}}" in mpi_ops  # call split over lines
    assert '#include "tensorflow/compiler/xla/stream_executor/stream.h"' in mpi_ops


def test_mutes_the_descriptors_of_the_extension_check(tmp_path: Path) -> None:
    util = patched(tmp_path, patch_horovod.MUTE_FILE)
    lines = util.splitlines()
    muted = lines.index("            sys.stderr = open(os.devnull, 'w')")
    assert lines[muted + 2 : muted + 4] == [
        "            os.dup2(sys.stdout.fileno(), 1)",
        "            os.dup2(sys.stderr.fileno(), 2)",
    ]
    unpatched = (
        util.replace(patch_horovod.MUTE_PATCHED, patch_horovod.MUTE_ORIGINAL)
        .replace(patch_horovod.LIBRARY_PATCHED, patch_horovod.LIBRARY_ORIGINAL)
        .replace(patch_horovod.LIBRARY_HELPER, "")
    )
    assert unpatched == UTIL_SOURCE
    compile(util, "util.py", "exec")  # both patches are valid Python where they go


def test_wraps_a_non_postfix_argument_in_parentheses(tmp_path: Path) -> None:
    source = MPI_OPS_SOURCE + "auto s = stream_executor::gpu::AsGpuStreamValue(a ? b : c);\n"
    mpi_ops = patched(tmp_path, patch_horovod.STREAM_FILE, {patch_horovod.STREAM_FILE: source})
    wrapped = "static_cast<GpuStreamHandle>((a ? b : c)->platform_specific_handle().stream)"
    assert wrapped in mpi_ops


def test_second_run_changes_nothing(tmp_path: Path) -> None:
    tree = make_tree(tmp_path)
    first = patch_horovod.patch(tree)
    assert "already patched" not in first
    once = read_tree(tree)
    second = patch_horovod.patch(tree)
    assert read_tree(tree) == once
    names = [*SOURCES, patch_horovod.MUTE_FILE]  # util.py twice: two patches
    assert second.splitlines() == [f"{tree / name}: already patched" for name in names]


def test_command_line_prints_what_it_patched(tmp_path: Path) -> None:
    tree = make_tree(tmp_path)
    stdout = run([sys.executable, str(SCRIPT), str(tree)], timeout=60, check=True).stdout
    assert "xla_mpi_ops.cc: patched (XLA section disabled)" in stdout
    assert "mpi_ops.cc: patched (3 AsGpuStreamValue calls" in stdout
    assert "util.py: patched (extension check muted)" in stdout
    assert "launch.py: patched (failed ranks in one line)" in stdout
    assert "setup.py: patched (Release build, no debug info)" in stdout
    assert "util.py: patched (build checks ask the library)" in stdout


BROKEN = {
    "xla-guard-changed": (
        patch_horovod.XLA_FILE,
        XLA_SOURCE.replace("2006000000\n", "2007000000\n"),
        "expected exactly one line",
    ),
    "declaration-changed": (
        patch_horovod.STREAM_FILE,
        MPI_OPS_SOURCE.replace("// Forward declaration of AsGpuStreamValue\n", ""),
        "forward declaration",
    ),
    "no-calls": (
        patch_horovod.STREAM_FILE,
        MPI_OPS_SOURCE.replace("stream_executor::gpu::AsGpuStreamValue(", "Other("),
        "expected calls",
    ),
    "unknown-use": (
        patch_horovod.STREAM_FILE,
        MPI_OPS_SOURCE + "using stream_executor::gpu::AsGpuStreamValue;\n",
        "still used",
    ),
    "unbalanced": (
        patch_horovod.STREAM_FILE,
        MPI_OPS_SOURCE + "x = stream_executor::gpu::AsGpuStreamValue(s;\n",
        "unbalanced",
    ),
    "extension-check-changed": (
        patch_horovod.MUTE_FILE,
        UTIL_SOURCE.replace("sys.stderr = open(os.devnull, 'w')", "sys.stderr = None"),
        "mutes the extension check's output",
    ),
    "launcher-changed": (
        patch_horovod.LAUNCH_FILE,
        LAUNCH_SOURCE.replace("    _run(args)\n", "    return _run(args)\n"),
        "expected exactly one call of _run",
    ),
    "build-configuration-changed": (
        patch_horovod.SETUP_FILE,
        SETUP_SOURCE.replace("'RelWithDebInfo'", "'Release'"),
        "expected exactly one RelWithDebInfo",
    ),
    "extension-import-changed": (
        patch_horovod.MUTE_FILE,
        UTIL_SOURCE.replace("importlib.import_module(", "importlib.__import__("),
        "expected exactly one import of the extension",
    ),
}


@pytest.mark.parametrize(("name", "source", "message"), BROKEN.values(), ids=list(BROKEN))
def test_fails_loudly_and_writes_nothing(
    tmp_path: Path, name: Path, source: str, message: str
) -> None:
    tree = make_tree(tmp_path, {name: source})
    with pytest.raises(SystemExit, match=message) as failure:
        patch_horovod.patch(tree)
    assert "Refusing to patch" in str(failure.value)
    assert read_tree(tree) == SOURCES | {name: source}  # not even another file's patch


def test_fails_loudly_on_a_missing_file(tmp_path: Path) -> None:
    tree = make_tree(tmp_path)
    (tree / patch_horovod.STREAM_FILE).unlink()
    with pytest.raises(SystemExit, match="file not found"):
        patch_horovod.patch(tree)
    assert (tree / patch_horovod.XLA_FILE).read_text() == XLA_SOURCE


def test_command_line_exits_non_zero_on_failure(tmp_path: Path) -> None:
    tree = make_tree(tmp_path, {patch_horovod.XLA_FILE: "// nothing to patch\n"})
    result = run([sys.executable, str(SCRIPT), str(tree)], timeout=60)
    assert result.returncode != 0
    assert "Refusing to patch" in result.stderr


def _run_patched_launcher(tmp_path: Path, error: str, log_level: str | None) -> tuple[int, str]:
    """Runs the patched run_commandline with a _run that raises RuntimeError(error)."""
    program = (
        "import logging, sys, types\n"
        f"def parse_args(): return types.SimpleNamespace(log_level={log_level!r})\n"
        f"def _run(args): raise RuntimeError({error!r})\n"
        + patched(tmp_path, patch_horovod.LAUNCH_FILE)
    )
    result = run([sys.executable, "-c", program], timeout=60)
    return result.returncode, result.stderr


def test_a_failed_rank_ends_horovodrun_in_one_line(tmp_path: Path) -> None:
    failed = (
        "Horovod detected that one or more processes exited with non-zero status, thus "
        "causing the job to be terminated. The first process to do so was:\n"
        "Process name: 1\nExit code: 2\n"
    )
    code, stderr = _run_patched_launcher(tmp_path / "a", failed, None)
    assert code == 1
    assert stderr.splitlines() == [
        "horovodrun: Horovod detected that one or more processes exited with non-zero status, "
        "thus causing the job to be terminated. The first process to do so was: Process name: "
        "1 Exit code: 2"
    ]
    # Asked for logs, or another error: the traceback stays.
    code, stderr = _run_patched_launcher(tmp_path / "b", failed, "DEBUG")
    assert code == 1 and "Traceback" in stderr
    code, stderr = _run_patched_launcher(tmp_path / "c", "could not reach host", None)
    assert code == 1 and "Traceback" in stderr and "could not reach host" in stderr


def test_builds_release_without_debug_info(tmp_path: Path) -> None:
    setup = patched(tmp_path, patch_horovod.SETUP_FILE)
    assert "RelWithDebInfo" not in setup
    assert """os.environ.get('HOROVOD_DEBUG') == "1" else 'Release'""" in setup
    # Debug builds on request stay as they were.
    assert "config = 'Debug' if self.debug or" in setup


def test_build_checks_ask_the_library_before_importing(tmp_path: Path) -> None:
    util = patched(tmp_path, patch_horovod.MUTE_FILE)
    # Both util.py patches, each once: the muted descriptors and the library check.
    assert util.count("os.dup2(") == 2 and util.count("def _library_of(") == 1
    assert util.index("def _library_of(") < util.index("def _check_extension_lambda(")
    assert "ext = (_library_of(ext_base_name, fn_desc)\n" in util
    assert "or importlib.import_module('.' + ext_base_name, 'horovod'))" in util
    # What the helper answers (the library itself is asked in test_horovod_runtime.py):
    # nothing but the TensorFlow extension's "built with" checks.
    namespace: dict = {"os": __import__("os")}
    start = util.index("def _library_of(")
    exec(util[start : util.index("def _check_extension_lambda(")], namespace)
    assert namespace["_library_of"]("torch", "built with Gloo") is None
    assert namespace["_library_of"]("tensorflow", "built") is None
    assert namespace["_library_of"]("tensorflow", "running with GPU") is None
