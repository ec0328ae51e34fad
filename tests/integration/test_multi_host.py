"""Horovod across hosts: two network-namespace hosts on this machine
(tests/integration/netns_cluster.py), each with its own address, hostname and
sshd. `horovodrun --gloo -H node1:1,node2:1` (over ssh) and `mpirun -H ...` run
one rank on each host; the ranks' weights equal one process's, and a `main.py`
checkpoint written across the hosts resumes on one of them alone like an
uninterrupted run."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from dataloading.synthetic import generate_split_binary
from dlrm.checkpoint import Checkpoint
from tests.integration.conftest import REPO, horovodrun, process_env
from tests.integration.netns_cluster import INTERFACE, NetnsCluster, install_reason
from tests.integration.test_hybrid_main import FLAGS, assert_same_checkpoint
from tests.integration.test_hybrid_parallel import (
    CARDINALITIES,
    GLOBAL_BATCH,
    HOTNESS,
    SCRIPT,
    STEPS,
    assert_ranks_equal_one,
    hybrid_steps,
    load,
)

HOSTS = "node1:1,node2:1"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetnsCluster]:
    reason = install_reason()
    if reason is not None:
        pytest.skip(reason)
    cluster = NetnsCluster(tmp_path_factory.mktemp("cluster")).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("multi_host") / "tables"
    generate_split_binary(path, CARDINALITIES, 3, rows={"train": 2000}, hotness=HOTNESS, seed=4)
    return path


def across_hosts(cluster: NetnsCluster, launcher: str, command: list[str]) -> str:
    """Runs `command` as 2 ranks, one on node1 and one on node2, launched from
    node1 by `launcher`; returns its output."""
    if launcher == "horovodrun":
        launch = [horovodrun(), "--gloo", "-np", "2", "-H", HOSTS]
        launch += ["--network-interface", INTERFACE]
    else:
        launch = ["mpirun", "--allow-run-as-root", "-np", "2", "-H", HOSTS]
        launch += ["--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", INTERFACE]
        launch += ["--mca", "oob_tcp_if_include", INTERFACE]
        launch += [
            arg for name in ("PATH", "PYTHONPATH", "TF_CPP_MIN_LOG_LEVEL") for arg in ("-x", name)
        ]
    result = cluster.run("node1", [*launch, *command], env=process_env(), cwd=REPO, timeout=600)
    output = result.stdout[-3000:] + result.stderr[-3000:]
    assert result.returncode == 0, output
    return output


@pytest.mark.parametrize("launcher", ["horovodrun", "mpirun"])
def test_ranks_on_two_hosts_equal_one_process(
    cluster: NetnsCluster, dataset: Path, tmp_path: Path, launcher: str
) -> None:
    runs = ["mixed:data_parallel:sgd:fp32"]
    if launcher == "horovodrun":  # mpirun takes a minute to start: one run only
        runs.insert(0, "mixed:model_parallel:adam:fp32")
    hybrid_steps(
        1, dataset, tmp_path / "one", [f"local:model_parallel:{o}:fp32" for o in ("adam", "sgd")]
    )
    across_hosts(
        cluster,
        launcher,
        [sys.executable, SCRIPT, str(dataset), str(tmp_path / "two"), STEPS, GLOBAL_BATCH, *runs],
    )
    for run_name in runs:
        kind, _mode, optimizer, variant = run_name.split(":")
        run_dir = tmp_path / "two" / run_name.replace(":", "_")
        assert [str(load(run_dir, r)["hostname"]) for r in range(2)] == ["node1", "node2"]
        reference = tmp_path / "one" / f"local_model_parallel_{optimizer}_fp32"
        assert_ranks_equal_one(reference, run_dir, 2, variant, kind)


def test_a_checkpoint_written_across_hosts_resumes_on_one_host(
    cluster: NetnsCluster, tmp_path: Path
) -> None:
    """main.py on node1 and node2 trains 20 steps and checkpoints; node2 alone
    resumes it for 20 more: the weights of 40 uninterrupted steps on one rank."""
    data = tmp_path / "data"
    generate_split_binary(
        data,
        (50, 200, 1000, 30, 5000, 7, 400, 90),
        5,
        rows={"train": 50_000, "test": 5_000},
        seed=3,
    )
    common = [sys.executable, "main.py", *FLAGS, f"--dataset_path={data}"]
    across = tmp_path / "across"
    across_hosts(
        cluster, "horovodrun", [*common, "--max_steps=20", f"--save_checkpoint_path={across}"]
    )
    start = json.loads((across / "metrics.jsonl").read_text().splitlines()[0])
    assert start["event"] == "start" and start["hosts"] == ["node1", "node2"]
    result = cluster.run(
        "node2",
        [
            *common,
            "--max_steps=40",
            f"--restore_checkpoint_path={across}",
            f"--save_checkpoint_path={across}",
        ],
        env=process_env(),
        cwd=REPO,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    straight = tmp_path / "straight"
    result = cluster.run(
        "node1",
        [*common, "--max_steps=40", f"--save_checkpoint_path={straight}"],
        env=process_env(),
        cwd=REPO,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    resumed, uninterrupted = Checkpoint(across), Checkpoint(straight)
    assert resumed.step == uninterrupted.step == 40
    assert_same_checkpoint(resumed, uninterrupted)
