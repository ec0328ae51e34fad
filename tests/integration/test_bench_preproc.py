"""`benchmarks/preproc.py`: the pipeline run end to end with real Spark, once or
several times in one session (`--runs`), and its figures."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from harness.processes import run

LINES = 3_000  # 3 days; each day has 10 malformed lines (`--malformed_rows_per_day`)


def test_runs_in_one_session_give_the_figures_of_each(tmp_path: Path) -> None:
    output = tmp_path / "figures.json"
    result = run(
        [
            sys.executable,
            "benchmarks/preproc.py",
            f"--rows={LINES}",
            "--driver_memory=1g",
            f"--work_dir={tmp_path}",
            "--runs=2",
            f"--json={output}",
        ],
        timeout=600,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    figures = json.loads(output.read_text())
    assert [later_run["rows"] for later_run in figures["later_runs"]] == [LINES]
    first, later = figures, figures["later_runs"][0]
    for figures_of_run in (first, later):
        stages = figures_of_run["stages"]
        assert list(stages) == ["parse", "vocabulary", "train", "test"]
        assert stages["parse"]["rows"] == LINES
        # 2 train days and 1 test day, less the malformed lines of each.
        assert stages["train"]["rows"] == 2 * (LINES // 3 - 10)
        assert stages["test"]["rows"] == LINES // 3 - 10
        for stage in (*stages.values(), figures_of_run):
            assert stage["seconds"] > 0
            assert stage["rows_per_second"] == stage["rows"] / stage["seconds"]
        assert figures_of_run["peak_rss_bytes"] > 100 * 2**20  # Spark's JVM at least
        assert figures_of_run["cpu_seconds"] > 0
    assert "later_runs" not in later
    assert figures["spark_startup_seconds"] > 0
    assert "run 2 of 2 in this Spark session" in result.stdout
    # The first run's dataset is kept; the later run's, only measured, is removed.
    assert (tmp_path / "dataset" / "feature_spec.yaml").is_file()
    assert not (tmp_path / "dataset_run2").exists()


def test_no_runs_is_a_parser_error() -> None:
    result = run([sys.executable, "benchmarks/preproc.py", "--runs=0"], timeout=60)
    assert result.returncode == 2
    assert "--runs: expected at least 1, got 0" in result.stderr


@pytest.mark.parametrize(("tasks", "kind"), [("python", "Python"), ("jvm", "JVM")])
def test_spark_floor_runs_empty_jobs_in_a_new_session(
    tmp_path: Path, tasks: str, kind: str
) -> None:
    output = tmp_path / "floor.json"
    result = run(
        [
            sys.executable,
            "benchmarks/spark_floor.py",
            f"--tasks={tasks}",
            "--spark_master=local[2]",
            "--driver_memory=1g",
            "--jobs=2",
            f"--json={output}",
        ],
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    figures = json.loads(output.read_text())
    assert figures["tasks"] == tasks
    assert figures["tasks_per_job"] == 2
    assert len(figures["job_seconds"]) == 2
    assert all(seconds > 0 for seconds in figures["job_seconds"])
    assert figures["startup_seconds"] > 0
    assert f"empty job 2 of {kind} tasks (2):" in result.stdout


def test_spark_floor_needs_a_first_and_a_later_job() -> None:
    result = run([sys.executable, "benchmarks/spark_floor.py", "--jobs=1"], timeout=60)
    assert result.returncode == 2
    assert "--jobs: expected at least 2 (the first and a later one), got 1" in result.stderr
