"""What a user meets in a first week, with real processes: a run that has nothing
to train, a data file cut short while training reads it, a plan that cannot be
made on several ranks, and the Spark UI seen from another host. Each ends with
one clear line and the right exit status, on one process and on 2 ranks."""

from __future__ import annotations

import os
import shutil
import signal
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from feature_spec import FeatureSpec
from harness.datasets import dataset_fixture
from harness.netns import NetnsCluster, netns_cluster
from harness.processes import REPO, main_py, main_py_command, started, wait_for

TABLES = (50, 200, 1000, 30)
FLAGS = [
    "--batch_size=256",
    "--optimizer=adagrad",
    "--learning_rate=0.05",
    "--warmup_steps=0",
    "--decay_start_step=0",
    "--embedding_dim=8",
    "--bottom_mlp_dims=16,8",
    "--top_mlp_dims=16,1",
    "--evals_per_epoch=0",
    "--print_freq=1",
]
# 1,600 steps an epoch: a run goes on long after the first step is logged.
dataset = dataset_fixture(TABLES, 4, rows={"train": 409_600, "test": 2_048}, seed=6)


def lines_saying(output: str, text: str) -> list[str]:
    return [line for line in output.splitlines() if text in line]


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_run_with_nothing_to_train_says_so_once(
    dataset: Path, tmp_path: Path, ranks: int
) -> None:
    """Yesterday's checkpoint at step 12 and a schedule that ends at 8: one line
    naming both and the flags that would train, exit 2. The same run resumed when
    it has finished: one line, exit 0."""
    data, run = f"--dataset_path={dataset}", tmp_path / "run"
    main_py(1, *FLAGS, data, "--max_steps=12", f"--save_checkpoint_path={run}", check=True)
    nothing = main_py(ranks, *FLAGS, data, "--max_steps=8", f"--restore_checkpoint_path={run}")
    output = nothing.stdout + nothing.stderr
    # horovodrun exits 1 whatever its ranks' status, and names rank 0's.
    assert nothing.returncode == (2 if ranks == 1 else 1), output[-3000:]
    assert ranks == 1 or "Exit code: 2" in output, output[-3000:]
    (line,) = lines_saying(output, "nothing to train")
    assert "is at step 12" in line and "--warm_start" in line and "--max_steps 8" in line
    resumed = main_py(ranks, *FLAGS, data, "--max_steps=12", f"--save_checkpoint_path={run}",
                      "--resume")  # fmt: skip
    output = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, output[-3000:]
    assert len(lines_saying(output, "the run has finished")) == 1, output[-3000:]


@pytest.mark.parametrize("ranks", [1, 2])
def test_a_data_file_cut_short_while_training_reads_it_stops_every_rank_naming_it(
    dataset: Path, tmp_path: Path, ranks: int
) -> None:
    copy = tmp_path / "data"
    shutil.copytree(dataset, copy)
    label = FeatureSpec.load(copy).files("train").label
    log, metrics = tmp_path / "run.log", tmp_path / "metrics.jsonl"
    command = main_py_command(ranks, *FLAGS, f"--dataset_path={copy}", f"--log_path={metrics}")
    with started(command, log) as process:
        wait_for(lambda: metrics.exists() and '"train"' in metrics.read_text(), process, 240, log)
        os.truncate(label, label.stat().st_size // 2)  # a copy still in progress
        process.wait(timeout=240)
    output = log.read_text()
    assert process.returncode not in (0, None), output[-3000:]
    assert "Bus error" not in output and "SIGBUS" not in output, output[-3000:]
    named = lines_saying(output, "shrank while it was being read")
    assert named and all(str(label) in line for line in named), output[-3000:]


def test_a_plan_that_cannot_be_made_is_reported_once(dataset: Path) -> None:
    result = main_py(
        2, *FLAGS, f"--dataset_path={dataset}", "--embedding_memory_budget_gib=0.00001"
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output[-3000:]
    assert len(lines_saying(output, "--embedding_memory_budget_gib 1e-05")) == 1, output[-3000:]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetnsCluster]:
    yield from netns_cluster(tmp_path_factory, hosts=2, tag=f"ui{os.getpid() % 100000}")


def test_the_spark_ui_is_not_reachable_from_another_host(
    cluster: NetnsCluster, tmp_path: Path
) -> None:
    """dlrm-preprocess on node1 at its defaults: its Spark UI answers on node1's
    loopback address, and not on node1's address from node2."""
    bin_dir = Path(sys.executable).parent
    raw, log = tmp_path / "raw", tmp_path / "preprocess.log"
    synthetic = cluster.run(
        "node1",
        [str(bin_dir / "dlrm-synthetic"), "clicklog", "--output_dir", str(raw), "--days", "2",
         "--rows_per_day", "300000"],
        cwd=REPO,
    )  # fmt: skip
    assert synthetic.returncode == 0, synthetic.stderr[-3000:]
    command = [str(bin_dir / "dlrm-preprocess"), "--input_dir", str(raw), "--output_dir",
               str(tmp_path / "data"), "--frequency_threshold", "3"]  # fmt: skip
    with log.open("w") as sink:
        process = cluster.popen("node1", command, cwd=REPO, stdout=sink, stderr=sink)
    try:
        line = wait_for(lambda: lines_saying(log.read_text(), "Spark UI at"), process, 180, log)
        port = int(line[0].split("http://127.0.0.1:", 1)[1].split(",", 1)[0])
        probe = [sys.executable, "-c", PROBE, "{address}", str(port)]
        here = cluster.run("node1", [a.replace("{address}", "127.0.0.1") for a in probe])
        there = cluster.run(
            "node2", [a.replace("{address}", cluster.host("node1").address) for a in probe]
        )
        assert process.poll() is None, "the run ended before the UI was probed"
    finally:
        os.killpg(process.pid, signal.SIGKILL)  # the driver's JVM and workers too
        process.wait()
    assert here.stdout.strip() == "open", (here.stdout, here.stderr, log.read_text()[-2000:])
    assert there.stdout.strip() == "refused", (there.stdout, there.stderr)


PROBE = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=5).close()
    print("open")
except OSError:
    print("refused")
"""
