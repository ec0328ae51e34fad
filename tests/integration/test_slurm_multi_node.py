"""The `slurm/` training scripts on a real two-node Slurm cluster: `sbatch -N 2`
runs one rank on each node.

The nodes are the hosts node1 and node2 of a `NetnsCluster` (network namespaces
with their own address, hostname and sshd; harness/netns.py);
`MultiNodeSlurmCluster` (harness/slurm.py) runs munged and slurmd on each,
slurmctld and the clients on node1. Both are started once for the module and
stopped at its end, whatever the outcome; the two scripts' jobs run side by side.
The checks read what each job wrote: its end state, the hosts of the ranks in the
metrics log, and the sharding plan, whose model-parallel tables must land on both
ranks, so on both nodes.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from dlrm.app.records import read_records
from harness import netns, slurm
from harness.datasets import dataset_fixture
from harness.models import JOB_FLAGS, JOB_TABLES
from harness.netns import INTERFACE, NetnsCluster, netns_cluster
from harness.slurm import (
    JOB_TIMEOUT,
    SlurmCluster,
    assert_completed,
    job_summary,
    start_multi_node_cluster,
    start_script,
    tail,
)


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetnsCluster]:
    reason = netns.install_reason() or slurm.install_reason()
    if reason is not None:
        pytest.skip(reason)
    # A tag of its own: another module's NetnsCluster in this process defaults to the pid's.
    yield from netns_cluster(tmp_path_factory, tag=f"slurm{os.getpid() % 100000}")


@pytest.fixture(scope="module")
def cluster(
    hosts: NetnsCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SlurmCluster]:
    started = start_multi_node_cluster(tmp_path_factory.mktemp("slurm"), hosts)
    try:
        yield started
    finally:
        started.stop()


dataset = dataset_fixture(JOB_TABLES, 13, {"train": 20_000, "test": 4_000}, seed=5)


SCRIPTS = ("train_horovodrun.sbatch", "train_srun.sbatch")


@pytest.fixture(scope="module")
def jobs(
    cluster: SlurmCluster, dataset: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, tuple[dict[str, str], Path, Path]]:
    """Each training script's 2-node job, submitted together (each takes one CPU of
    each node, so both fit at once): script -> its end state, output file and
    checkpoint directory."""
    started = {}
    for script in SCRIPTS:
        directory = tmp_path_factory.mktemp(script.split(".")[0])
        output, checkpoints = directory / "job.out", directory / "checkpoints"
        environment = {
            "DATASET_PATH": str(dataset),
            "CHECKPOINT_DIR": str(checkpoints),
            # horovodrun: the hosts' link (lo would be chosen otherwise). srun: unused.
            "HOROVODRUN_ARGS": f"--network-interface {INTERFACE}",
        }
        job_id = start_script(
            cluster, script, output, environment, JOB_FLAGS, ("--ntasks-per-node=1",), nodes=2
        )
        started[script] = (job_id, output, checkpoints)
    return {
        script: (cluster.wait_for_job(job_id, timeout=JOB_TIMEOUT), output, checkpoints)
        for script, (job_id, output, checkpoints) in started.items()
    }


@pytest.mark.parametrize("script", SCRIPTS)
def test_two_node_job_runs_a_rank_on_each_node(
    jobs: dict[str, tuple[dict[str, str], Path, Path]], script: str
) -> None:
    job, output, checkpoints = jobs[script]
    assert_completed(job, output)
    assert job.get("NodeList") == "node[1-2]", f"{job}\n{tail(output)}"
    assert job_summary(checkpoints / "metrics.jsonl", output)["world_size"] == 2
    start = read_records(checkpoints / "metrics.jsonl")[0]
    assert start["event"] == "start", f"{start}\n{tail(output)}"
    assert sorted(start["hosts"]) == ["node1", "node2"], f"{start['hosts']}\n{tail(output)}"
    plan = json.loads((checkpoints / "sharding_plan.json").read_text())
    placed = {
        shard["rank"]
        for table in plan["tables"]
        if table["kind"] != "data_parallel"
        for shard in table["shards"]
    }
    # Rank r ran on hosts[r]: model-parallel tables on ranks 0 and 1 are on both nodes.
    assert placed == {0, 1}, f"{json.dumps(plan['tables'])[:3000]}\n{tail(output)}"
