"""`python -m preproc.criteo` on a Spark standalone cluster across two hosts.

The hosts are node1 and node2 of a `NetnsCluster` (network namespaces with their
own address and hostname; harness/netns.py). A master and a
worker run on node1, a second worker on node2, each bound to its host's address,
with one core and a small heap; the driver runs on node1 and the executors reach
it at node1's address. Every host sees the one file system, as a cluster's NFS.

The output of a cluster run must be byte for byte that of a local-mode run of
the same input (the timings in report.json and the `_SUCCESS` markers aside), also
when node2 dies (every process killed, as a machine losing power) while it runs a
task: Spark then reruns the lost tasks on node1. The Spark event log of each run
says which host ran which task, and which task the kill interrupted.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyspark
import pytest

from dataloading.criteo_tsv import generate_criteo_tsv
from harness.netns import ClusterError, NetnsCluster, netns_cluster
from harness.processes import REPO, process_env, run
from preproc.pipeline import REPORT_FILE, WORK_DIR
from preproc.spark import JIT_OPTIONS
from preproc.stages import SUCCESS

MASTER_PORT = 7077
WORKER_MEMORY = "1g"  # what a worker offers its executors
EXECUTOR_MEMORY = "512m"  # Spark's least is 450m
DRIVER_MEMORY = "512m"
DAEMON_MEMORY = "256m"  # the master's and workers' own heaps
START_TIMEOUT_S = 120
RUN_TIMEOUT_S = 480
CARDINALITIES = (41, 7, 300, 13, 3, 90, 25, 61, 11, 203, 17, 5, 77) * 2
# One train day and one test day: two Python writer tasks per split (one per core).
DAYS = 2
ROWS_PER_DAY = 1000
# JVMs that live a minute compile less with C1 alone: about 40% less time here, the
# machine's 2 cores being the bottleneck. It changes how fast, not what, Spark computes.
JVM_OPTIONS = f"{JIT_OPTIONS} -XX:TieredStopAtLevel=1"
PIPELINE_FLAGS = [
    "--frequency_threshold", "3",
    "--feature_frequency_threshold", "C2=1",
    "--seed", "11",
    "--shuffle_partitions", "3",
    "--spark_conf", f"spark.driver.extraJavaOptions={JVM_OPTIONS}",
    "--spark_conf", f"spark.executor.extraJavaOptions={JVM_OPTIONS}",
    # Both workers run tasks of every stage: jobs start only when both executors have
    # registered (the cores expected are spark.cores.max), and a task goes to the first
    # free executor, not after waiting for the one that holds most of its shuffle
    # input (spark.locality.wait, 3 s, longer than a task here). With the defaults,
    # node1 could run all of a split's writers, leaving none on node2 to be killed in.
    "--spark_conf", "spark.cores.max=2",
    "--spark_conf", "spark.scheduler.minRegisteredResourcesRatio=1.0",
    "--spark_conf", "spark.locality.wait=0",
]  # fmt: skip
# What an executor starts (`python -m pyspark.daemon`) for its first Python task: in
# a split, the binary writers.
PYTHON_DAEMON = b"pyspark.daemon"
# What starts the master and the workers (the pip wheel has no start-master.sh).
SPARK_CLASS = Path(pyspark.__file__).parent / "bin" / "spark-class"


@dataclasses.dataclass
class StandaloneSpark:
    """A Spark standalone master on the first host of `hosts`, a worker on each.

    Master, workers and the executors the workers start are processes of their
    host (its network namespace); `stop` kills them, and `NetnsCluster.stop` kills
    whatever is left. Their logs, work directories and scratch space are under
    `directory`.
    """

    hosts: NetnsCluster
    directory: Path
    daemons: dict[str, subprocess.Popen[bytes]] = dataclasses.field(default_factory=dict)

    @property
    def head(self) -> str:
        return self.hosts.members[0].name

    @property
    def url(self) -> str:
        return f"spark://{self.head}:{MASTER_PORT}"

    def start(self) -> StandaloneSpark:
        """Starts the master and the workers, without waiting for them to register
        (`wait_for_workers`), so that something else can run meanwhile."""
        try:
            self._daemon("master", self.head, "master.Master", "--port", str(MASTER_PORT))
            for host in self.hosts.members:
                work = self.directory / f"work-{host.name}"
                self._daemon(
                    f"worker-{host.name}", host.name, "worker.Worker",
                    "--cores", "1", "--memory", WORKER_MEMORY, "--work-dir", str(work), self.url,
                )  # fmt: skip
        except BaseException:
            self.stop()
            raise
        return self

    def _daemon(self, name: str, host: str, deploy_class: str, *arguments: str) -> None:
        """Starts `org.apache.spark.deploy.<deploy_class>` on `host`, bound to its name."""
        address = self.hosts.host(host).address
        scratch = self.directory / f"local-{name}"
        scratch.mkdir(parents=True, exist_ok=True)
        env = process_env(
            {
                # Binds every socket (the daemon's and its executors') to the host's address.
                "SPARK_LOCAL_IP": address,
                "SPARK_DAEMON_MEMORY": DAEMON_MEMORY,
                "SPARK_DAEMON_JAVA_OPTS": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
                # Executors' shuffle and block files: in the test's directory, not /tmp.
                "SPARK_LOCAL_DIRS": str(scratch),
            }
        )
        command = [str(SPARK_CLASS), f"org.apache.spark.deploy.{deploy_class}", "--host", host]
        with open(self.directory / f"{name}.log", "wb") as log:
            self.daemons[name] = self.hosts.popen(
                host,
                [*command, *arguments],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )

    def wait_for_workers(self) -> None:
        """Returns once every worker has registered with the master (at once when
        they have already); raises if a daemon exited or the time ran out."""
        deadline = time.monotonic() + START_TIMEOUT_S
        workers = [f"worker-{host.name}" for host in self.hosts.members]
        while True:
            for name, daemon in self.daemons.items():
                if daemon.poll() is not None:
                    raise ClusterError(
                        f"Spark {name} exited with {daemon.returncode}:\n{self.logs()}"
                    )
            logs = [
                (self.directory / f"{name}.log").read_text(errors="replace") for name in workers
            ]
            if all("Successfully registered with master" in log for log in logs):
                return
            if time.monotonic() > deadline:
                raise ClusterError(
                    f"Spark workers not registered with {self.url} after {START_TIMEOUT_S} s:\n"
                    f"{self.logs()}"
                )
            time.sleep(0.5)

    def logs(self, characters: int = 2000) -> str:
        return "\n".join(
            f"--- {log.name}:\n{log.read_text(errors='replace')[-characters:]}"
            for log in sorted(self.directory.glob("*.log"))
        )

    def driver_command(self, raw: Path, output_dir: Path, directory: Path) -> list[str]:
        """`python -m preproc.criteo` as a driver on the head host; its event log goes
        to `directory`/events, its scratch files to `directory`/driver-local."""
        events = directory / "events"
        events.mkdir(parents=True)
        return [
            sys.executable, "-m", "preproc.criteo",
            "--input_dir", str(raw), "--output_dir", str(output_dir), *PIPELINE_FLAGS,
            "--spark_master", self.url,
            "--driver_memory", DRIVER_MEMORY,
            "--executor_memory", EXECUTOR_MEMORY,
            "--local_dir", str(directory / "driver-local"),
            # The address the executors on other hosts connect back to.
            "--spark_conf", f"spark.driver.host={self.hosts.host(self.head).address}",
            # Both executors before the first task, so that both hosts get work.
            "--spark_conf", "spark.scheduler.minRegisteredResourcesRatio=1.0",
            "--spark_conf", f"spark.scheduler.maxRegisteredResourcesWaitingTime={START_TIMEOUT_S}s",
            "--spark_conf", "spark.eventLog.enabled=true",
            "--spark_conf", f"spark.eventLog.dir={events}",
            "--spark_conf", "spark.ui.enabled=false",
        ]  # fmt: skip

    @staticmethod
    def driver_env() -> dict[str, str]:
        # Executors run the binary writers with the driver's interpreter (numpy, preproc).
        return process_env({"PYSPARK_PYTHON": sys.executable})

    def stop(self) -> None:
        for daemon in self.daemons.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(daemon.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                daemon.wait(timeout=10)
        self.daemons.clear()


@pytest.fixture(scope="module")
def hosts(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NetnsCluster]:
    """Stopped after the Spark cluster, with whatever else runs on them."""
    # A tag of its own: another module's NetnsCluster in this process defaults to the pid's.
    yield from netns_cluster(tmp_path_factory, tag=f"spark{os.getpid() % 100000}")


@pytest.fixture(scope="module")
def spark_cluster(
    hosts: NetnsCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[StandaloneSpark]:
    """Its daemons still starting: each test waits for the workers first, the first
    test after the local-mode reference has run beside their start."""
    spark = StandaloneSpark(hosts, tmp_path_factory.mktemp("spark")).start()
    yield spark
    spark.stop()


@pytest.fixture(scope="module")
def raw(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("standalone") / "raw"
    generate_criteo_tsv(
        out,
        days=DAYS,
        rows_per_day=ROWS_PER_DAY,
        cardinalities=CARDINALITIES,
        seed=11,
        short_row_fraction=0.05,
        malformed_rows_per_day=3,
    )
    return out


@pytest.fixture(scope="module")
def local_run(raw: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The reference: the same preprocessing in local mode on this machine, with
    its intermediate files kept (the kill test resumes from them)."""
    out = tmp_path_factory.mktemp("standalone") / "local"
    run(
        [
            sys.executable, "-m", "preproc.criteo",
            "--input_dir", str(raw), "--output_dir", str(out), *PIPELINE_FLAGS,
            "--keep_intermediate", "--spark_master", "local[2]",
            "--spark_conf", "spark.ui.enabled=false",
        ],
        timeout=RUN_TIMEOUT_S,
        check=True,
    )  # fmt: skip
    return out


# --------------------------------------------------------------------- checks


def dataset_files(directory: Path) -> list[Path]:
    """The files of a dataset directory (relative), intermediates left out."""
    return sorted(
        path.relative_to(directory)
        for path in directory.rglob("*")
        if path.is_file() and path.relative_to(directory).parts[0] != WORK_DIR
    )


def assert_same_dataset(actual: Path, expected: Path) -> None:
    """Every file of `expected` is in `actual` with the same bytes, but for what
    names the run rather than the data: the stage markers' durations and the
    report's output directory and stage timings."""
    assert dataset_files(actual) == dataset_files(expected)
    for name in dataset_files(expected):
        if name.name == SUCCESS:
            marker, reference = (json.loads((d / name).read_text()) for d in (actual, expected))
            for value in (marker, reference):
                value.pop("seconds")
            assert marker == reference, name
        elif name == Path(REPORT_FILE):
            report, reference = (json.loads((d / name).read_text()) for d in (actual, expected))
            for value in (report, reference):
                value.pop("output_dir")
                value.pop("stages")
            assert report == reference, name
        else:
            assert (actual / name).read_bytes() == (expected / name).read_bytes(), name


@dataclasses.dataclass(frozen=True)
class TaskEnd:
    """One task attempt."""

    job: str | None  # the job description: the pipeline stage ("parse", "train", ...)
    stage: int
    index: int  # the partition: a retry has the same stage and index
    host: str
    reason: str  # "Success", "ExecutorLostFailure", ...


@dataclasses.dataclass(frozen=True)
class EventLog:
    """What the Spark event log of one application says about its tasks and
    executors.

    Attributes:
        tasks: every task attempt, in the order they ended.
        executors_removed: (seconds since the epoch, host) of each executor the
            driver dropped.
    """

    tasks: list[TaskEnd]
    executors_removed: list[tuple[float, str]]

    @classmethod
    def read(cls, directory: Path) -> EventLog:
        """The log of the one application that logged to `directory`."""
        (log,) = directory.iterdir()
        jobs: dict[int, str | None] = {}
        hosts: dict[str, str] = {}
        tasks, removed = [], []
        for line in log.read_text().splitlines():
            event: dict[str, Any] = json.loads(line)
            kind = event["Event"]
            if kind == "SparkListenerJobStart":
                description = (event.get("Properties") or {}).get("spark.job.description")
                jobs.update((stage, description) for stage in event["Stage IDs"])
            elif kind == "SparkListenerExecutorAdded":
                hosts[event["Executor ID"]] = event["Executor Info"]["Host"]
            elif kind == "SparkListenerExecutorRemoved":
                removed.append((event["Timestamp"] / 1000, hosts[event["Executor ID"]]))
            elif kind == "SparkListenerTaskEnd":
                info = event["Task Info"]
                stage = event["Stage ID"]
                reason = event["Task End Reason"]["Reason"]
                tasks.append(TaskEnd(jobs.get(stage), stage, info["Index"], info["Host"], reason))
        return cls(tasks, removed)


# ---------------------------------------------------------------------- tests


def test_cluster_output_equals_local_mode(
    spark_cluster: StandaloneSpark, raw: Path, local_run: Path, tmp_path: Path
) -> None:
    spark_cluster.wait_for_workers()
    out = tmp_path / "dataset"
    result = spark_cluster.hosts.run(
        spark_cluster.head,
        spark_cluster.driver_command(raw, out, tmp_path),
        env=spark_cluster.driver_env(),
        cwd=REPO,
        timeout=RUN_TIMEOUT_S,
    )
    assert result.returncode == 0, result.stderr[-3000:] + spark_cluster.logs()
    assert f"master {spark_cluster.url}" in result.stderr
    assert_same_dataset(out, local_run)
    assert not (out / WORK_DIR).exists()  # intermediates removed after success
    events = EventLog.read(tmp_path / "events")
    assert all(task.reason == "Success" for task in events.tasks)
    assert {task.host for task in events.tasks} == {"node1", "node2"}


def python_workers(hosts: NetnsCluster, host: str) -> set[int]:
    """Pids of the Spark Python workers on `host`."""
    pids = set()
    for pid in hosts.processes(host):
        with contextlib.suppress(OSError):  # gone meanwhile
            if PYTHON_DAEMON in Path(f"/proc/{pid}/cmdline").read_bytes():
                pids.add(pid)
    return pids


def wait_for_python_task(
    hosts: NetnsCluster, host: str, driver: subprocess.Popen[bytes], earlier: set[int]
) -> None:
    """Returns when an executor on `host` has started a Python worker (not among
    `earlier`, those of an application before), which it does for its first
    Python task, so while that task runs: the worker's start alone takes longer
    than this loop's 50 ms."""
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while driver.poll() is None and time.monotonic() < deadline:
        if python_workers(hosts, host) - earlier:
            return
        time.sleep(0.05)
    raise AssertionError(
        f"no Python task ran on {host} before the driver ended (exit {driver.poll()})"
    )


def power_off(hosts: NetnsCluster, host: str) -> None:
    """Kills every process of `host` until none is left (a process forked while
    the first round ran is caught by the next)."""
    for _ in range(20):
        hosts.kill_host(host)
        time.sleep(0.1)
        if not hosts.processes(host):
            return
    raise AssertionError(f"processes left on {host}: {hosts.processes(host)}")


def test_losing_a_worker_mid_stage_reruns_its_tasks_on_the_other(
    spark_cluster: StandaloneSpark, raw: Path, local_run: Path, tmp_path: Path
) -> None:
    """node2 dies while it runs its first Python task of the train split (a binary
    writer); the run ends as if it had not.
    Last in the module: node2 stays down."""
    spark_cluster.wait_for_workers()
    out = tmp_path / "dataset"
    # Resumes after the local run's parse and vocabulary stages, so that the first
    # Python task on node2 belongs to a split.
    shutil.copytree(local_run / WORK_DIR, out / WORK_DIR)
    hosts = spark_cluster.hosts
    earlier = python_workers(hosts, "node2")  # of the previous test's run, if still there
    log_path = tmp_path / "driver.log"
    with open(log_path, "wb") as log:
        driver = hosts.popen(
            spark_cluster.head,
            spark_cluster.driver_command(raw, out, tmp_path),
            env=spark_cluster.driver_env(),
            cwd=REPO,
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
        )
    try:
        wait_for_python_task(hosts, "node2", driver, earlier)
        killed_at = time.time()
        power_off(hosts, "node2")
        returncode = driver.wait(timeout=RUN_TIMEOUT_S)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(driver.pid, signal.SIGKILL)
        driver.wait(timeout=10)
    output = log_path.read_text(errors="replace")
    assert returncode == 0, output[-3000:] + spark_cluster.logs()
    assert "[preproc] parse: done in an earlier run" in output
    assert_same_dataset(out, local_run)
    assert not list(out.rglob("*.partial"))

    events = EventLog.read(tmp_path / "events")
    tasks = events.tasks
    failed = [task for task in tasks if task.reason != "Success"]
    lost = [task for task in failed if task.reason == "ExecutorLostFailure"]
    assert lost, f"the kill interrupted no task; failed tasks: {failed}"
    # Besides the tasks that died with node2, only tasks that read shuffle files
    # from node2 may fail (Spark then recomputes those files on node1).
    assert all(task.reason == "FetchFailed" for task in failed if task not in lost), failed
    for task in lost:
        assert task.host == "node2" and task.job in ("train", "test"), task
        # The same partition of the same Spark stage was then computed on node1.
        assert any(
            (other.stage, other.index, other.host, other.reason)
            == (task.stage, task.index, "node1", "Success")
            for other in tasks
        ), task
    # After the kill, node1 alone ran the rest of the run.
    last_lost = max(tasks.index(task) for task in lost)
    assert {task.host for task in tasks[last_lost + 1 :]} == {"node1"}
    # The driver dropped node2's executor when its connections closed, not after
    # a heartbeat timeout (spark.network.timeout, 120 s).
    ((removed_at, host),) = events.executors_removed
    assert host == "node2" and removed_at - killed_at < 30, (removed_at - killed_at, host)
