"""Running the project's commands as real processes, for tests and benchmarks: the
repository root, the venv's horovodrun and the launch of N ranks on this host, a
child's environment, a run captured (`run`, `main_py`) or in the background
(`started`, `wait_for`), and the ranks' processes found by their rank."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar

REPO = Path(__file__).resolve().parents[1]
T = TypeVar("T")


def horovodrun() -> str:
    """The horovodrun next to this interpreter (the project's venv)."""
    path = Path(sys.executable).parent / "horovodrun"
    found = str(path) if path.exists() else shutil.which("horovodrun")
    if found is None:
        raise RuntimeError("horovodrun not found: run `make install`")
    return found


def process_env(extra: Mapping[str, str | None] | None = None) -> dict[str, str]:
    """The environment of a child process: ours with the venv first on PATH, the repo
    on PYTHONPATH, TensorFlow's C++ logs quiet, and `extra` applied last (a None
    value removes the variable)."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = str(REPO)
    env.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    for name, value in (extra or {}).items():
        if value is None:
            env.pop(name, None)
        else:
            env[name] = value
    return env


# What a user's shell has: no PYTHONPATH, TensorFlow's logging at the product's default
# (for `process_env`).
USER_ENV: dict[str, str | None] = {"PYTHONPATH": None, "TF_CPP_MIN_LOG_LEVEL": None}


def run(
    args: list[str],
    timeout: float,
    env: Mapping[str, str | None] | None = None,
    cwd: Path = REPO,
    check: bool = False,
) -> subprocess.CompletedProcess[str]:
    """Runs a command from `cwd` (the repo root) in `process_env(env)`; output captured.
    With `check`, the test fails with the end of its output unless it succeeded."""
    result = subprocess.run(
        args, cwd=cwd, env=process_env(env), capture_output=True, text=True, timeout=timeout
    )
    assert not check or result.returncode == 0, output_tail(result)
    return result


def on_ranks(ranks: int, command: Sequence[str], launcher: str | None = None) -> list[str]:
    """`command` as `ranks` processes on this host under `horovodrun --gloo -np N -H
    localhost:N` (`launcher`: another horovodrun than the venv's); unchanged for one."""
    if ranks == 1:
        return list(command)
    horovod = [launcher or horovodrun(), "--gloo", "-np", str(ranks), "-H", f"localhost:{ranks}"]
    return [*horovod, *command]


def main_py_command(ranks: int, *flags: str) -> list[str]:
    """`python main.py FLAGS`, launched as `ranks` processes when more than one."""
    return on_ranks(ranks, [sys.executable, "main.py", *flags])


def main_py(
    ranks: int, *flags: str, timeout: float = 300, **options: Any
) -> subprocess.CompletedProcess[str]:
    """Runs `main_py_command(ranks, *flags)`; `options` are `run`'s (env, cwd, check)."""
    return run(main_py_command(ranks, *flags), timeout, **options)


@contextlib.contextmanager
def started(command: list[str], log: Path) -> Iterator[subprocess.Popen[bytes]]:
    """`command` running from the repo root in `process_env()`, its output written to
    `log`; killed when the block ends if it still runs."""
    with log.open("w") as sink:
        process = subprocess.Popen(
            command, cwd=REPO, env=process_env(), stdout=sink, stderr=subprocess.STDOUT
        )
        try:
            yield process
        finally:
            if process.poll() is None:
                process.kill()
                process.wait()


def wait_for(
    found: Callable[[], T], process: subprocess.Popen[Any], timeout: float, log: Path
) -> T:
    """Polls `found` until it returns something true (returned) while `process` runs;
    fails the test with the end of `log` (the process's output) after `timeout` seconds
    or when the process ended first."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and process.poll() is None:
        value = found()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"not found in {timeout:.0f} s; log:\n{log.read_text()[-3000:]}")


def output_tail(result: subprocess.CompletedProcess[str], characters: int = 3000) -> str:
    """The end of a finished command's stdout, then of its stderr: for a failure message."""
    return result.stdout[-characters:] + result.stderr[-characters:]


def rank_pids(rank: int, marker: str) -> list[int]:
    """Pids of the processes of Horovod rank `rank` (HOROVOD_RANK) whose command line
    holds `marker`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:  # gone, or not ours to read
            continue
        if marker in command and f"HOROVOD_RANK={rank}".encode() in environ:
            pids.append(int(entry.name))
    return pids


def has_exited(pid: int) -> bool:
    """Whether process `pid` is gone or a zombie (exited, not yet reaped)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True
