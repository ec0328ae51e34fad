"""Horovod across hosts: two network-namespace hosts on this machine
(harness/netns.py), each with its own address, hostname and
sshd. `horovodrun --gloo -H node1:1,node2:1` (over ssh) and `mpirun -H ...` run
one rank on each host; the ranks' weights equal one process's, and a `main.py`
checkpoint written across the hosts resumes on one of them alone like an
uninterrupted run."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dlrm.app.records import read_records
from dlrm.checkpoint.reader import Checkpoint
from harness.checkpoints import CROSS_WORLD, assert_close, checkpoint_steps
from harness.datasets import dataset_fixture, synthetic_dataset
from harness.models import EIGHT_TABLES, MIXED_PLAN_FLAGS
from harness.netns import INTERFACE, NetnsCluster, install_reason, netns_cluster
from harness.processes import (
    REPO,
    has_exited,
    horovodrun,
    output_tail,
    process_env,
    wait_for,
)
from harness.rank_weights import (
    CARDINALITIES,
    HOTNESS,
    assert_ranks_equal_one,
    hybrid_steps,
    hybrid_steps_command,
    load,
)

HOSTS = "node1:1,node2:1"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetnsCluster]:
    yield from netns_cluster(tmp_path_factory)


dataset = dataset_fixture(CARDINALITIES, 3, {"train": 2000}, seed=4, hotness=HOTNESS)


@pytest.fixture(scope="module")
def one_process(dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One process's weights after the steps of each optimizer: what the ranks on two
    hosts must equal, whichever launcher started them."""
    out = tmp_path_factory.mktemp("one")
    hybrid_steps(1, dataset, out, [f"local:model_parallel:{o}:fp32" for o in ("adam", "sgd")])
    return out


def on_host(cluster: NetnsCluster, host: str, command: list[str], timeout: float = 300) -> str:
    """Runs `command` on `host` from the repo root; it must succeed; its output's end."""
    result = cluster.run(host, command, timeout, process_env(), REPO)
    assert result.returncode == 0, output_tail(result)
    return output_tail(result)


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
    return on_host(cluster, "node1", [*launch, *command], timeout=600)


@pytest.mark.parametrize("launcher", ["horovodrun", "mpirun"])
def test_ranks_on_two_hosts_equal_one_process(
    cluster: NetnsCluster, dataset: Path, one_process: Path, tmp_path: Path, launcher: str
) -> None:
    runs = ["mixed:data_parallel:sgd:fp32"]
    if launcher == "horovodrun":  # mpirun takes a minute to start: one run only
        runs.insert(0, "mixed:model_parallel:adam:fp32")
    across_hosts(cluster, launcher, hybrid_steps_command(dataset, tmp_path / "two", runs))
    for run_name in runs:
        kind, _mode, optimizer, variant = run_name.split(":")
        run_dir = tmp_path / "two" / run_name.replace(":", "_")
        assert [str(load(run_dir, r)["hostname"]) for r in range(2)] == ["node1", "node2"]
        reference = one_process / f"local_model_parallel_{optimizer}_fp32"
        assert_ranks_equal_one(reference, run_dir, 2, variant, kind)


def test_a_checkpoint_written_across_hosts_resumes_on_one_host(
    cluster: NetnsCluster, tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """main.py on node1 and node2 trains 10 steps and checkpoints; node2 alone
    resumes it for 10 more: the weights of 20 uninterrupted steps on one rank (to
    rounding: 20 steps from the first on 2 ranks, at most `CROSS_WORLD_STEPS`)."""
    data = synthetic_dataset(tmp_path_factory, EIGHT_TABLES, 5, {"train": 50_000, "test": 5_000}, 3)
    common = [sys.executable, "main.py", *MIXED_PLAN_FLAGS, f"--dataset_path={data}"]
    across, straight = tmp_path / "across", tmp_path / "straight"
    # The uninterrupted run needs nothing of the others: it runs beside them.
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        uninterrupted_run = pool.submit(
            on_host,
            cluster,
            "node1",
            [*common, "--max_steps=20", f"--save_checkpoint_path={straight}"],
        )
        across_hosts(
            cluster, "horovodrun", [*common, "--max_steps=10", f"--save_checkpoint_path={across}"]
        )
        start = read_records(across / "metrics.jsonl")[0]
        assert start["event"] == "start" and start["hosts"] == ["node1", "node2"]
        resume = [f"--restore_checkpoint_path={across}", f"--save_checkpoint_path={across}"]
        on_host(cluster, "node2", [*common, "--max_steps=20", *resume])
        uninterrupted_run.result()
    resumed, uninterrupted = Checkpoint(across), Checkpoint(straight)
    assert resumed.step == uninterrupted.step == 20
    assert_close(resumed, uninterrupted, **CROSS_WORLD)


# ------------------------------------------------------------- host failures

# A rank must be gone this long after its peer's host failed. Gloo gives up on a
# peer that stopped answering after HOROVOD_GLOO_TIMEOUT_SECONDS (set below).
GLOO_TIMEOUT_S = 20
FAILURE_EXIT_LIMIT_S = 90


@pytest.fixture(scope="module")
def long_dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Rows enough that training outlasts a host failure; both failures read it."""
    reason = install_reason()
    if reason is not None:
        pytest.skip(reason)
    return synthetic_dataset(
        tmp_path_factory, (50, 200, 1000, 30), 5, {"train": 400_000, "test": 2_000}, 3
    )


def checkpoint_and_steps(run: Path) -> int | None:
    """The step of the newest checkpoint in `run` once 5 more steps were logged."""
    steps = checkpoint_steps(run)
    trained = read_records(run / "metrics.jsonl", "train")
    return steps[-1] if steps and trained and trained[-1]["step"] >= steps[-1] + 5 else None


FAILURES = ("link_down", "host_killed")


@dataclasses.dataclass(frozen=True)
class FailedHost:
    """What a run on node1 and node2 left after node2 failed."""

    returncode: int  # horovodrun's
    run: Path  # its checkpoints and metrics log
    saved: int  # the step of its newest checkpoint when node2 failed
    resumed: Path  # that checkpoint resumed on node1 alone for 10 steps


def fail_host(data: Path, directory: Path, failure: str) -> FailedHost:
    """Trains on node1 and node2 of a cluster of its own until a checkpoint, fails
    node2, asserts that the rank on node1 and horovodrun exit within the bound, and
    resumes the last checkpoint on node1 alone."""
    run = directory / "run"
    flags = [
        sys.executable, "main.py", *MIXED_PLAN_FLAGS, f"--dataset_path={data}",
        "--batch_size=256", "--print_freq=1", "--evals_per_epoch=50",
    ]  # fmt: skip
    env = process_env({"HOROVOD_GLOO_TIMEOUT_SECONDS": str(GLOO_TIMEOUT_S)})
    # A cluster of its own (the module's stays up, and so does the other failure's):
    # another tag, or its namespaces would have another cluster's names.
    tag = f"{failure.split('_')[-1]}{os.getpid() % 100000}"
    with NetnsCluster(directory / "cluster", tag=tag) as cluster:
        log = directory / "horovodrun.log"
        launch = [horovodrun(), "--gloo", "-np", "2", "-H", HOSTS, "--network-interface", INTERFACE]
        with log.open("w") as sink:
            launcher = cluster.popen(
                "node1",
                [*launch, *flags, f"--save_checkpoint_path={run}"],
                env=env,
                cwd=REPO,
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
            try:
                saved = wait_for(lambda: checkpoint_and_steps(run), launcher, 300, log)
                survivors = cluster.main_py_processes("node1")
                assert len(survivors) == 1 and len(cluster.main_py_processes("node2")) == 1
                if failure == "link_down":
                    cluster.link("node2", up=False)
                else:
                    cluster.kill_host("node2")
                failed_at = time.monotonic()
                while not all(has_exited(p) for p in survivors):
                    assert time.monotonic() - failed_at < FAILURE_EXIT_LIMIT_S, log.read_text()[
                        -3000:
                    ]
                    time.sleep(0.2)
                survivor_exit = time.monotonic() - failed_at
                # horovodrun too ends within the bound, counted from the failure.
                returncode = launcher.wait(timeout=FAILURE_EXIT_LIMIT_S - survivor_exit)
                launcher_exit = time.monotonic() - failed_at
            finally:
                if launcher.poll() is None:
                    os.killpg(launcher.pid, signal.SIGKILL)
                    launcher.wait()
        print(
            f"{failure}: the rank on node1 exited {survivor_exit:.1f} s and horovodrun "
            f"(exit {returncode}) {launcher_exit:.1f} s after node2 failed"
        )
        if returncode == 0 or read_records(run / "metrics.jsonl", "summary"):
            return FailedHost(returncode, run, saved, directory / "never_resumed")
        # The last complete checkpoint resumes on the surviving host alone.
        resumed = directory / "resumed"
        on_host(
            cluster,
            "node1",
            [*flags, f"--restore_checkpoint_path={run}", f"--max_steps={saved + 10}",
             "--evals_per_epoch=0", f"--save_checkpoint_path={resumed}"],
        )  # fmt: skip
    return FailedHost(returncode, run, saved, resumed)


@pytest.fixture(scope="module")
def failed_hosts(
    long_dataset: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, concurrent.futures.Future[FailedHost]]]:
    """Both failures at once, each on a cluster of its own: a link that went down
    mostly waits (for Gloo's timeout), which the other's training fills. A failure
    that raised raises in its test."""
    with concurrent.futures.ThreadPoolExecutor(len(FAILURES)) as pool:
        yield {
            failure: pool.submit(fail_host, long_dataset, tmp_path_factory.mktemp(failure), failure)
            for failure in FAILURES
        }


@pytest.mark.parametrize("failure", FAILURES)
def test_a_failed_host_stops_the_other_and_the_checkpoint_restores(
    failed_hosts: dict[str, concurrent.futures.Future[FailedHost]], failure: str
) -> None:
    """Training on node1 and node2; node2 loses its link (cable pulled) or all its
    processes (power lost). The rank on node1 exits non-zero within the bound,
    and the last checkpoint resumes on node1 alone."""
    failed = failed_hosts[failure].result()
    assert failed.returncode != 0
    assert not read_records(failed.run / "metrics.jsonl", "summary")
    assert Checkpoint(failed.resumed).step == failed.saved + 10
    assert Checkpoint(failed.run).step >= failed.saved
