"""Running the project's commands as real processes, for tests and benchmarks: the
repository root, the venv's horovodrun, a child's environment, a captured run."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


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


def run(
    args: list[str], timeout: float, env: Mapping[str, str | None] | None = None
) -> subprocess.CompletedProcess[str]:
    """Runs a command from the repo root in `process_env(env)`; output captured."""
    return subprocess.run(
        args,
        cwd=REPO,
        env=process_env(env),
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
