"""Horovod Elastic on three network-namespace hosts (harness/netns.py),
one rank each: `horovodrun --gloo --host-discovery-script ... --min-np M` runs
main.py, and node3 fails mid-epoch. The survivors continue from the newest
checkpoint on 2 ranks, node3 joins again when the discovery script lists it after
its cooldown. Each world ends with the checkpoints, bit for bit, of runs that never
failed on the same hosts from the same checkpoint (the first world's are those of
the job run uninterrupted on 3 ranks), and the job's extra work is exactly the
rolled-back steps. With --min-np 3 the job ends instead, within a bound, naming
the host and the checkpoint to continue from."""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dlrm.checkpoint.format import list_checkpoints
from dlrm.checkpoint.reader import Checkpoint
from harness.checkpoints import assert_identical
from harness.datasets import dataset_fixture
from harness.elastic_job import ElasticJob
from harness.models import MIXED_PLAN_FLAGS
from harness.netns import NetnsCluster, netns_cluster

HOSTS = ("node1", "node2", "node3")
CARDINALITIES = (50, 200, 1000, 30, 5000, 7)
# 12 checkpoints: a failure after the first or second, and (for the host that comes
# back) enough checkpoints left for horovodrun to list it again before the end: 100
# steps on 2 ranks can take 4.6 s, less than node3 needs to come back.
STEPS, EVERY, BATCH = 240, 20, 768  # the batch divides by 3 and 2 ranks
# Tables 2 and 4 model-parallel, resharded per world. Every checkpoint is kept: each
# world's are compared.
FLAGS = [
    *MIXED_PLAN_FLAGS,
    f"--batch_size={BATCH}",
    "--print_freq=5",
    f"--max_steps={STEPS}",
    f"--checkpoint_every_steps={EVERY}",
    f"--keep_checkpoints={STEPS // EVERY}",
]
# Gloo gives up on a silent peer (link down) after this; a closed connection fails at once.
GLOO_TIMEOUT_S = 10
# It also bounds how long the ranks of a growing job wait for the new host's rank to
# start (import TensorFlow, join): on 2 cores shared with other tests, more than 10 s.
GROWING_GLOO_TIMEOUT_S = 60
# From node3's failure to horovodrun's exit when fewer than --min-np ranks are left:
# the Gloo timeout, --elastic-timeout (10 s below) and the processes' shutdown.
MIN_NP_EXIT_LIMIT_S = 120


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetnsCluster]:
    yield from netns_cluster(tmp_path_factory, hosts=3, tag=f"elastic{os.getpid() % 100000}")


dataset = dataset_fixture(CARDINALITIES, 5, {"train": 200_000, "test": 6_000}, seed=3)


def elastic_job(
    cluster: NetnsCluster,
    directory: Path,
    dataset: Path,
    gloo_timeout_s: int = GLOO_TIMEOUT_S,
    flags: tuple[str, ...] = (),
) -> ElasticJob:
    """`FLAGS`, then `flags` (which win)."""
    return ElasticJob(cluster, directory, dataset, [*FLAGS, *flags], HOSTS, gloo_timeout_s)


def run_uninterrupted(job: ElasticJob, *hosts: str) -> ElasticJob:
    job.list_hosts(*hosts)
    job.start(len(hosts), 2)
    assert job.wait() == 0, job.output()
    assert job.records("summary")[-1]["elastic"]["worlds"] == [len(hosts)], job.output()
    return job


@pytest.fixture(scope="module")
def uninterrupted(
    cluster: NetnsCluster, dataset: Path, tmp_path_factory: pytest.TempPathFactory
) -> ElasticJob:
    """The same launch with no failure: 3 ranks throughout."""
    job = elastic_job(cluster, tmp_path_factory.mktemp("uninterrupted"), dataset)
    return run_uninterrupted(job, *HOSTS)


@pytest.fixture(scope="module")
def straight_runs() -> dict[tuple[tuple[str, ...], int, int], ElasticJob]:
    """The runs that never failed, by (hosts, the checkpoint continued from, the
    last step): two jobs whose worlds continued from the same checkpoint on the
    same hosts (the killed rank and the link down, usually) share one."""
    return {}


def straight_run(
    runs: dict[tuple[tuple[str, ...], int, int], ElasticJob],
    job: ElasticJob,
    hosts: tuple[str, ...],
    start: int,
    end: int,
) -> ElasticJob:
    """A launch on `hosts` that continues from `job`'s checkpoint at `start` to
    `end` without failing: one run per (hosts, start, end) in the module."""
    key = (hosts, start, end)
    if key not in runs:
        directory = job.directory.parent / f"straight_{len(runs)}"
        straight = elastic_job(job.cluster, directory, job.dataset, flags=(f"--max_steps={end}",))
        source = step_checkpoint(job, start).path
        shutil.copytree(source, straight.run / source.name)
        runs[key] = run_uninterrupted(straight, *hosts)
    return runs[key]


def step_checkpoint(job: ElasticJob, step: int) -> Checkpoint:
    return Checkpoint(job.run / f"step_{step:09d}")


def assert_each_world_like_a_straight_run(
    job: ElasticJob,
    uninterrupted: ElasticJob,
    runs: dict[tuple[tuple[str, ...], int, int], ElasticJob],
) -> None:
    """`job`'s first world wrote the uninterrupted run's checkpoints; each later
    world, from the checkpoint it continued from to the next world's (or the end),
    wrote those of a new launch that continues from that checkpoint on the same
    hosts without failing. Like with like, bit for bit: the same world size over
    the same steps (docs/testing.md); so the job ends with the weights and AUC of
    a run that changed its world at those steps and lost nothing."""
    resets = job.records("elastic_reset")
    starts = [r["step"] for r in resets]  # the checkpoint each later world continued from
    for step in range(EVERY, starts[0] + 1, EVERY):
        assert_identical(step_checkpoint(job, step), step_checkpoint(uninterrupted, step))
    ends = [*starts[1:], STEPS]
    for reset, start, end in zip(resets, starts, ends, strict=True):
        straight = straight_run(runs, job, tuple(reset["hosts"]), start, end)
        for step in range(start + EVERY, end + 1, EVERY):
            assert_identical(step_checkpoint(job, step), step_checkpoint(straight, step))
    summary = job.records("summary")[-1]
    assert summary["auc"] == straight.records("summary")[-1]["auc"], summary


def assert_rolled_back_once(job: ElasticJob, uninterrupted: ElasticJob, worlds: list[int]) -> None:
    """The job ended on the worlds named, after one lost rank, having trained
    exactly the rolled-back steps more than the uninterrupted run."""
    summary = job.records("summary")[-1]
    reference = uninterrupted.records("summary")[-1]
    assert summary["elastic"]["worlds"] == worlds, job.output()
    assert summary["world_size"] == worlds[-1]
    resets = job.records("elastic_reset")
    lost = [r for r in resets if r["reason"] == "a rank was lost"]
    assert len(lost) == 1, resets
    # The steps trained on the failed world after its newest checkpoint.
    rolled_back = lost[0]["ended_at_step"] - lost[0]["step"]
    assert rolled_back >= 1 and lost[0]["step"] % EVERY == 0, lost
    assert summary["elastic"]["rolled_back_steps"] == rolled_back
    # Samples trained: the uninterrupted run's, and the rolled-back steps' again.
    assert reference["elastic"]["steps_trained"] == STEPS
    trained = summary["elastic"]["steps_trained"]
    assert trained * BATCH == STEPS * BATCH + rolled_back * BATCH, summary["elastic"]


def test_a_host_killed_mid_epoch_then_listed_again_shrinks_the_job_and_grows_it_back(
    cluster: NetnsCluster,
    dataset: Path,
    uninterrupted: ElasticJob,
    straight_runs: dict[tuple[tuple[str, ...], int, int], ElasticJob],
    tmp_path: Path,
) -> None:
    """node3's rank is killed (power lost) after the checkpoint at step 20 and a few
    steps: the job goes on with node1 and node2 from that checkpoint. node3 stays in
    the discovery script's list, so after horovodrun's cooldown (1-2 s) it joins at
    the next checkpoint, and the job ends on 3 ranks."""
    job = elastic_job(cluster, tmp_path / "job", dataset, GROWING_GLOO_TIMEOUT_S)
    job.start(3, 2, "--blacklist-cooldown-range", "1", "2")
    at = job.wait_for_step(EVERY + 5, "node3")
    failed_at = job.kill_ranks("node3")
    assert job.wait() == 0, job.output()
    assert_rolled_back_once(job, uninterrupted, [3, 2, 3])
    lost, joined = job.records("elastic_reset")
    assert lost["lost"] == ["node3"] and lost["ended_at_step"] >= at, lost
    assert joined["reason"] == "the hosts changed" and joined["joined"] == ["node3"], joined
    assert joined["step"] % EVERY == 0 and joined["step"] > lost["step"], joined
    recovered = job.records("elastic_recovered")[0]["time"] - failed_at
    print(f"killed, then back: first step on 2 ranks {recovered:.1f} s after the kill")
    assert_each_world_like_a_straight_run(job, uninterrupted, straight_runs)


@pytest.mark.parametrize("failure", ["rank_killed", "link_down"])
def test_a_failed_host_leaves_the_job_on_two_ranks(
    cluster: NetnsCluster,
    dataset: Path,
    uninterrupted: ElasticJob,
    straight_runs: dict[tuple[tuple[str, ...], int, int], ElasticJob],
    tmp_path: Path,
    failure: str,
) -> None:
    """node3's rank is killed, or its link goes down (its rank lives on, cut off),
    mid-epoch: the job finishes on node1 and node2. node3 stays listed, but a host
    that failed does not join again without --blacklist-cooldown-range. (Taking a
    host whose link is down off the list would make horovodrun tell rank 0, and when
    rank 0 is on that host, the call waits on the dead link for about a minute.)"""
    job = elastic_job(cluster, tmp_path / "job", dataset)
    job.start(3, 2)
    at = job.wait_for_step(2 * EVERY + 5, "node3")
    try:
        if failure == "rank_killed":
            failed_at = job.kill_ranks("node3")
        else:
            cluster.link("node3", up=False)
            failed_at = time.time()
        assert job.wait() == 0, job.output()
    finally:
        cluster.link("node3", up=True)
        job.kill_ranks("node3")  # the cut-off rank, should it still run
    assert_rolled_back_once(job, uninterrupted, [3, 2])
    (lost,) = job.records("elastic_reset")
    assert lost["lost"] == ["node3"] and lost["ended_at_step"] >= at, lost
    recovered = job.records("elastic_recovered")[0]["time"] - failed_at
    print(f"{failure}: first step on 2 ranks {recovered:.1f} s after node3 failed")
    assert_each_world_like_a_straight_run(job, uninterrupted, straight_runs)


def test_fewer_ranks_than_min_np_end_the_job_within_a_bound_naming_host_and_checkpoint(
    cluster: NetnsCluster, dataset: Path, tmp_path: Path
) -> None:
    job = elastic_job(cluster, tmp_path, dataset)
    job.start(3, 3, "--elastic-timeout", "10")
    job.wait_for_step(EVERY + 5, "node3")
    failed_at = job.kill_ranks("node3")  # and it never joins again (no cooldown range)
    returncode = job.wait(timeout=MIN_NP_EXIT_LIMIT_S)
    ended = time.time() - failed_at
    output = job.output()
    print(f"fewer than --min-np: horovodrun exited {returncode} {ended:.1f} s after the kill")
    assert returncode != 0, output
    assert ended < MIN_NP_EXIT_LIMIT_S, output
    newest = list_checkpoints(job.run)[-1]
    # horovodrun names the failed host; the survivors, the checkpoint to continue from.
    assert "node3" in output and f"continuing from {newest}" in output, output
    assert not job.records("summary")
    Checkpoint(newest).verify()  # complete, and kept
    deadline = time.monotonic() + 20  # horovodrun terminates the ranks as it exits
    while any(cluster.main_py_processes(host) for host in HOSTS):
        assert time.monotonic() < deadline, "a rank outlived the job"
        time.sleep(0.5)
