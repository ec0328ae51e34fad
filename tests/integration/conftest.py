"""Helpers for tests that run real processes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path

import pytest

from tests.integration.netns_cluster import NetnsCluster, install_reason

REPO = Path(__file__).resolve().parents[2]


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if Path(str(item.fspath)).is_relative_to(Path(__file__).parent):
            item.add_marker(pytest.mark.integration)


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


def netns_cluster(
    tmp_path_factory: pytest.TempPathFactory, hosts: int = 2, tag: str = ""
) -> Iterator[NetnsCluster]:
    """For a module fixture (`yield from`): a started cluster of `hosts` simulated
    hosts, stopped afterwards; the test is skipped where namespaces need root."""
    reason = install_reason()
    if reason is not None:
        pytest.skip(reason)
    cluster = NetnsCluster(tmp_path_factory.mktemp("cluster"), hosts=hosts, tag=tag).start()
    try:
        yield cluster
    finally:
        cluster.stop()
