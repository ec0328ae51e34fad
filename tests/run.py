"""`make test`: the whole suite on pytest-xdist workers, and the container test beside
them in a pytest process of its own.

    python -m tests.run [PYTEST_ARGS...]        (TEST_WORKERS workers, default 2)

The container test (`BESIDE`) spends its 8-13 minutes mostly waiting: on the Debian
mirror, on pip unpacking wheels into image layers, on podman writing them. As one of
the two workers' files it kept a worker, and so half the machine's test capacity,
tied up for that long; beside them it fills the cores' idle time instead. (A third
worker for every file overloaded 2 cores, docs/testing.md.)

PYTEST_ARGS go to both runs. When they name tests (a path or node id), the suite runs
as one xdist run, as `make test-integration` does. A `--junitxml=FILE` becomes FILE
for the workers and FILE with `.beside` before its suffix for the container test.
The exit status is the first failing run's; a container test deselected by `-k` is no
failure. The container test's output follows the workers'."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BESIDE = "tests/integration/test_container_images.py"
NO_TESTS_COLLECTED = 5  # pytest's exit status when -k or -m leave nothing to run


def xdist_command(workers: int, args: Sequence[str]) -> list[str]:
    """pytest on `workers` workers, a file at a time, in collection order (tests/conftest.py)."""
    return [
        sys.executable, "-m", "pytest", "-n", str(workers), "--dist", "loadfile",
        "--no-loadscope-reorder", *args,
    ]  # fmt: skip


# pytest options whose value is the next argument (some name paths that are no tests to run).
VALUE_OPTIONS = frozenset(
    {"-k", "-m", "-p", "-o", "-c", "--junitxml", "--durations", "--basetemp", "--ignore",
     "--deselect", "--rootdir", "--maxfail", "--tb"}
)  # fmt: skip


def names_tests(args: Sequence[str]) -> bool:
    """Whether `args` name tests to run (a file, a directory or a node id) rather
    than only options."""
    for index, arg in enumerate(args):
        if arg.startswith("-") or (index > 0 and args[index - 1] in VALUE_OPTIONS):
            continue
        if (REPO / arg.split("::")[0]).exists() or Path(arg.split("::")[0]).exists():
            return True
    return False


def beside_args(args: Sequence[str]) -> list[str]:
    """`args` for the container test's run: its own junit file, if any."""
    out = list(args)
    for index, arg in enumerate(out):
        if arg.startswith("--junitxml="):
            path = Path(arg.split("=", 1)[1])
            out[index] = f"--junitxml={path.with_suffix('.beside' + path.suffix)}"
        elif arg == "--junitxml" and index + 1 < len(out):
            path = Path(out[index + 1])
            out[index + 1] = str(path.with_suffix(".beside" + path.suffix))
    return out


def main(args: Sequence[str]) -> int:
    workers = int(os.environ.get("TEST_WORKERS", "2"))
    if workers < 2 or names_tests(args):
        return subprocess.call(xdist_command(workers, args), cwd=REPO)
    with tempfile.TemporaryFile("w+") as log:
        beside = subprocess.Popen(
            [sys.executable, "-m", "pytest", BESIDE, *beside_args(args)],
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            text=True,
        )
        try:
            workers_run = xdist_command(workers, [f"--ignore={BESIDE}", *args])
            status = subprocess.call(workers_run, cwd=REPO)
            beside_status = beside.wait()
        finally:
            if beside.poll() is None:
                beside.kill()
                beside.wait()
        log.seek(0)
        print(f"\n===== {BESIDE}, run beside the workers =====", flush=True)
        sys.stdout.write(log.read())
    if beside_status == NO_TESTS_COLLECTED:
        beside_status = 0
    return status or beside_status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
