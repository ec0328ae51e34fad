"""`benchmarks/cores.py` (issue 34): which cores a core count takes, and the
speedup it reports; the suite's runner confining a child to given CPUs."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import pytest

from benchmarks.cores import cores_in_order, speedups
from benchmarks.suite import child_env, run_measured


def topology(root: Path, cores: dict[int, int]) -> Path:
    for cpu, core in cores.items():
        base = root / f"cpu{cpu}" / "topology"
        base.mkdir(parents=True)
        (base / "physical_package_id").write_text("0\n")
        (base / "core_id").write_text(f"{core}\n")
    return root


def test_a_core_count_takes_one_cpu_per_physical_core_first(tmp_path: Path) -> None:
    # CPUs 0 and 1 are one core's hyperthreads, 2 and 3 another's.
    root = topology(tmp_path, {0: 0, 1: 0, 2: 1, 3: 1})
    assert cores_in_order(root, [0, 1, 2, 3]) == [0, 2, 1, 3]
    assert cores_in_order(root, [1, 3]) == [1, 3]


def test_without_a_topology_the_cpus_keep_their_order(tmp_path: Path) -> None:
    assert cores_in_order(tmp_path, [3, 1, 2]) == [1, 2, 3]
    assert cores_in_order(tmp_path) == sorted(os.sched_getaffinity(0))


def test_the_speedup_is_the_most_cores_over_the_fewest() -> None:
    def row(variant: str, cores: int, rate: float) -> dict[str, Any]:
        return {"batch_size": 512, "variant": variant, "cores": cores} | {
            "ours": {"samples_per_second": rate}
        }

    rows = [row("fp32", 16, 600.0), row("fp32", 2, 100.0), row("fp32", 8, 350.0)]
    rows.append(row("amp", 2, 50.0))  # one core count only: no speedup
    assert speedups(rows) == [
        {"batch_size": 512, "variant": "fp32", "cores": [2, 16], "speedup": pytest.approx(6.0)}
    ]


def test_a_measured_child_runs_on_the_cpus_given() -> None:
    cpu = min(os.sched_getaffinity(0))
    command = [sys.executable, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"]
    out, _ = run_measured(command, cpus=[cpu])
    assert out.strip() == str([cpu])
    out, _ = run_measured(command)
    assert out.strip() == str(sorted(os.sched_getaffinity(0)))


def test_a_measured_child_keeps_the_callers_python_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PYTHONPATH", "/opt/site")
    path = child_env()["PYTHONPATH"].split(os.pathsep)
    assert path[1:] == ["/opt/site"] and Path(path[0], "main.py").exists()
    monkeypatch.delenv("PYTHONPATH")
    assert child_env()["PYTHONPATH"].split(os.pathsep) == path[:1]
