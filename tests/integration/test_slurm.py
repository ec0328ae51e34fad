"""The `slurm/` batch scripts, submitted to a real one-node Slurm cluster on localhost.

The cluster (munged, slurmctld, slurmd from Debian's slurm-wlm) is started once for
the module in a temporary directory and stopped at the end, whatever the outcome.
Each training script trains 2 ranks: `train_srun.sbatch` straight through, then
both scripts stopped and requeued, ending with the straight job's weights. The
checks read what the jobs wrote (job state, metrics log, checkpoints), and every
failure message carries the end of the job's output file.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dlrm.app.records import read_records
from dlrm.checkpoint.reader import Checkpoint
from feature_spec import FeatureSpec
from harness.checkpoints import assert_identical
from harness.datasets import dataset_fixture
from harness.models import JOB_FLAGS, JOB_TABLES
from harness.processes import run
from harness.slurm import (
    JOB_TIMEOUT,
    SlurmCluster,
    assert_completed,
    install_reason,
    job_summary,
    run_script,
    start_cluster,
    start_script,
    tail,
)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SlurmCluster]:
    reason = install_reason()  # installs slurm-wlm and munge with apt-get if missing
    if reason is not None:
        pytest.skip(reason)
    started = start_cluster(tmp_path_factory.mktemp("slurm"))  # stops its daemons if it fails
    try:
        yield started
    finally:
        started.stop()


dataset = dataset_fixture(JOB_TABLES, 13, {"train": 20_000, "test": 4_000}, seed=0)


def assert_trained_two_ranks(checkpoints: Path, output: Path, steps: int) -> None:
    """What a training script's 2-rank job must leave in `checkpoints`: a summary of
    2 ranks, the last checkpoint at `steps` written by 2 ranks, and a plan of
    replicated and model-parallel (alltoall) tables."""
    summary = job_summary(checkpoints / "metrics.jsonl", output)
    assert summary["world_size"] == 2, f"{summary}\n{tail(output)}"
    written = sorted(checkpoints.glob("step_*"))
    assert written, f"no step_* checkpoint in {checkpoints}\n{tail(output)}"
    manifest = json.loads((written[-1] / "manifest.json").read_text())
    assert (manifest["step"], manifest["world_size"]) == (steps, 2), tail(output)
    kinds = {table["kind"] for table in manifest["plan"]["tables"]}
    assert kinds == {"data_parallel", "table_wise"}, f"{kinds}\n{tail(output)}"


# 39 steps an epoch; each stop lands within a few dozen steps of a start (11-16 seen),
# so the second of two stops still comes well before the end.
REQUEUE_STEPS = 240
REQUEUE_FLAGS = [*JOB_FLAGS, "--epochs=16", f"--max_steps={REQUEUE_STEPS}", "--print_freq=5"]


@pytest.fixture(scope="module")
def straight_run(
    cluster: SlurmCluster, dataset: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Path, Path]:
    """A 2-rank `train_srun.sbatch` job that ran straight through: its checkpoint
    directory and output file. Its last checkpoint is what a requeued job of either
    script must end with, bit for bit (the same 2 ranks)."""
    root = tmp_path_factory.mktemp("straight")
    environment = {"DATASET_PATH": str(dataset), "CHECKPOINT_DIR": str(root / "run")}
    output = root / "job.out"
    assert_completed(
        run_script(cluster, "train_srun.sbatch", output, environment, REQUEUE_FLAGS), output
    )
    return root / "run", output


@pytest.fixture(scope="module")
def straight(straight_run: tuple[Path, Path]) -> Checkpoint:
    return Checkpoint(straight_run[0] / f"step_{REQUEUE_STEPS:09d}")


def test_srun_script_trains_two_ranks_and_checkpoints(straight_run: tuple[Path, Path]) -> None:
    # The horovodrun script's job is checked the same way, once requeued (below).
    assert_trained_two_ranks(*straight_run, REQUEUE_STEPS)


class RequeuedJob:
    """A 2-rank training job of `script`, stopped by the test and started again."""

    def __init__(self, cluster: SlurmCluster, script: str, dataset: Path, directory: Path) -> None:
        self.cluster = cluster
        self.checkpoints, self.output = directory / "requeued", directory / "job.out"
        environment = {"DATASET_PATH": str(dataset), "CHECKPOINT_DIR": str(self.checkpoints)}
        self.job_id = start_script(cluster, script, self.output, environment, REQUEUE_FLAGS)
        self.log = self.checkpoints / "metrics.jsonl"
        self.deadline = time.monotonic() + JOB_TIMEOUT

    def wait_until_training(self, stops: int) -> None:
        """Until the job, stopped `stops` times so far, trains again: a progress
        record after the last stop's record."""
        while True:
            seen = [r["event"] for r in read_records(self.log)]
            last_stop = max((i for i, e in enumerate(seen) if e == "preempted"), default=-1)
            if seen.count("preempted") == stops and "train" in seen[last_stop + 1 :]:
                return
            assert time.monotonic() < self.deadline, tail(self.output)
            state = self.cluster.job(self.job_id).get("JobState")
            assert state in ("PENDING", "RUNNING"), tail(self.output)
            time.sleep(0.2)

    def release_when_requeued(self) -> None:
        # Slurm holds a requeued job for about two minutes before it may start again.
        # Released sooner, it must wait until the node has finished its last run (the
        # node is "completing" until then): else the launch is refused ("Job
        # credential revoked") and the job fails, as seen on a loaded machine.
        # Nor may it start within the second in which the last run was killed: slurmd
        # refuses a credential whose time (whole seconds) is not after the job's
        # revocation (seen: killed at 20:59:02.2, started again at 20:59:02.9), so
        # the release waits for the next whole second after the node is idle again.
        while (
            self.cluster.job(self.job_id).get("JobState") != "PENDING"
            or not self.cluster.all_idle()
        ):
            assert time.monotonic() < self.deadline, tail(self.output)
            time.sleep(0.2)
        time.sleep(1.2 - time.time() % 1)
        self.cluster.client(["scontrol", "update", f"JobId={self.job_id}", "StartTime=now"])

    def assert_ends_like(self, straight: Checkpoint, restarts: int) -> None:
        """Completed after `restarts` requeues, each stop at one step, with the
        weights of the job that ran straight through."""
        job = self.cluster.wait_for_job(self.job_id, timeout=JOB_TIMEOUT)
        assert_completed(job, self.output)
        assert job.get("Restarts") == str(restarts), tail(self.output)
        stops = [r["step"] for r in read_records(self.log, "preempted")]
        assert len(stops) == restarts and stops[0] > 0, tail(self.output)
        assert stops == sorted(set(stops)) and stops[-1] < REQUEUE_STEPS, tail(self.output)
        resumed = job_summary(self.log, self.output)
        expected = (REQUEUE_STEPS, REQUEUE_STEPS - stops[-1])
        assert (resumed["steps"], resumed["steps_this_run"]) == expected, tail(self.output)
        assert_identical(Checkpoint(self.checkpoints / f"step_{REQUEUE_STEPS:09d}"), straight)


def test_a_requeued_job_continues_from_its_checkpoint_like_an_uninterrupted_one(
    cluster: SlurmCluster, dataset: Path, straight: Checkpoint, tmp_path: Path
) -> None:
    """A 2-rank `train_srun.sbatch` job stopped twice: first by `scontrol requeue`
    (Slurm sends every rank SIGTERM), then ahead of its time limit (`sbatch
    --signal=B:USR1@T` signals the batch script; `scancel --batch --signal=USR1`
    does the same at once), where the script passes USR1 on to the ranks and
    requeues the job itself. Each time the ranks stop after one same step with a
    checkpoint, and the job, started again with the same flags, continues from it
    (the script passes --resume) to the weights of a job that ran straight through."""
    job = RequeuedJob(cluster, "train_srun.sbatch", dataset, tmp_path)
    job.wait_until_training(0)
    cluster.client(["scontrol", "requeue", str(job.job_id)])
    job.release_when_requeued()
    job.wait_until_training(1)
    cluster.client(["scancel", "--batch", "--signal=USR1", str(job.job_id)])
    job.release_when_requeued()
    job.assert_ends_like(straight, restarts=2)
    assert "requeueing job" in job.output.read_text(), tail(job.output)


def test_a_horovodrun_job_requeues_itself_ahead_of_its_time_limit(
    cluster: SlurmCluster, dataset: Path, straight: Checkpoint, tmp_path: Path
) -> None:
    """`train_horovodrun.sbatch` signalled as `--signal=B:USR1@T` would: the script
    sends USR1 to the ranks, they stop after one same step with a checkpoint, the
    script requeues the job, and it ends with the weights of the straight run."""
    job = RequeuedJob(cluster, "train_horovodrun.sbatch", dataset, tmp_path)
    job.wait_until_training(0)
    cluster.client(["scancel", "--batch", "--signal=USR1", str(job.job_id)])
    job.release_when_requeued()
    job.assert_ends_like(straight, restarts=1)
    assert_trained_two_ranks(job.checkpoints, job.output, REQUEUE_STEPS)
    text = job.output.read_text()
    assert "train_horovodrun.sbatch: stopped ahead of the time limit" in text, tail(job.output)


def test_preprocess_script_writes_a_dataset(cluster: SlurmCluster, tmp_path: Path) -> None:
    raw, processed, output = tmp_path / "raw", tmp_path / "processed", tmp_path / "job.out"
    rows_per_day = 1500
    run(
        [
            sys.executable,
            "-m",
            "dataloading.criteo_tsv",
            f"--output_dir={raw}",
            "--days=2",
            f"--rows_per_day={rows_per_day}",
        ],
        timeout=300,
        check=True,
    )
    environment = {
        "INPUT_DIR": str(raw),
        "OUTPUT_DIR": str(processed),
        "FREQUENCY_THRESHOLD": "2",
    }
    arguments = ["--spark_conf", "spark.ui.enabled=false", "--shuffle_partitions=2"]
    job = run_script(cluster, "preprocess.sbatch", output, environment, arguments, ("-c", "2"))

    assert_completed(job, output)
    spec = FeatureSpec.load(processed, required_mappings=("train", "test"))
    assert spec.files("train").label.stat().st_size == rows_per_day, tail(output)  # day 0
    assert spec.files("test").label.stat().st_size == rows_per_day, tail(output)  # day 1
    assert len(spec.categorical_features) == 26, tail(output)


@pytest.mark.parametrize(
    ("script", "environment", "message"),
    [
        ("train_srun.sbatch", {}, "DATASET_PATH is not set"),
        ("train_horovodrun.sbatch", {"DATASET_PATH": "/nonexistent"}, "has no feature_spec.yaml"),
        ("preprocess.sbatch", {"INPUT_DIR": "/tmp"}, "OUTPUT_DIR is not set"),
        (
            "train_srun.sbatch",
            {"DATASET_PATH": "/tmp", "DLRM_PYTHON": "/nonexistent/python"},
            "DLRM_PYTHON=/nonexistent/python is not an executable",
        ),
    ],
)
def test_scripts_fail_naming_what_is_missing(
    cluster: SlurmCluster, tmp_path: Path, script: str, environment: dict[str, str], message: str
) -> None:
    output = tmp_path / "job.out"
    job = run_script(cluster, script, output, environment, [], ("--ntasks=1",))
    assert job.get("JobState") == "FAILED" and job.get("ExitCode") == "2:0", tail(output)
    assert message in output.read_text(), tail(output)
