"""A real Slurm cluster on this machine, for integration tests: one node on
localhost (`SlurmCluster`), or a node on each host of a `NetnsCluster`
(`MultiNodeSlurmCluster`: munged and slurmd per host, slurmctld on the first).

Debian's `slurm-wlm` and `munge` daemons are started from a private directory: the
munge key and socket, slurm.conf, state, spool, pid and log files all live there,
the ports are free ones picked at start, and every client finds the config through
`SLURM_CONF`. So a test never reads or changes a system configuration, and a
machine that already runs Slurm or munge is left alone. The project's `slurm/`
batch scripts are submitted to it (`run_script`) with the variables a test gives.

    python -m harness.slurm DIR [--check]  # start; Ctrl-C stops
"""

from __future__ import annotations

import argparse
import getpass
import os
import re
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dlrm.app.records import read_records
from harness import system
from harness.netns import NetnsCluster
from harness.processes import REPO

# The programs a cluster needs, and the Debian packages that bring them.
PACKAGES = {"munged": "munge"} | {
    name: "slurm-wlm" for name in ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel")
}
# srun's listening ports on a multi-node cluster (SrunPortRange): slurmd on each
# node connects back to them, so a firewall between nodes must open this range.
SRUN_PORTS = (60001, 61000)
TERMINAL_STATES = frozenset({
    "BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY",
    "PREEMPTED", "TIMEOUT",
})  # fmt: skip


class SlurmClusterError(RuntimeError):
    """The local cluster could not be installed, started or asked about a job."""


def install_reason() -> str | None:
    """Installs Slurm and munge with apt-get when missing.

    Returns:
        None when the programs are there (now); otherwise why they cannot be
        installed (not root and no password-less sudo), for a test skip.

    Raises:
        InstallError: apt-get was possible but failed (never a skip).
    """
    return system.install_missing(PACKAGES)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def node_name() -> str:
    """The short hostname: slurmd finds its NodeName line by it."""
    return subprocess.run(
        ["hostname", "-s"], capture_output=True, text=True, check=True
    ).stdout.strip()


def slurm_conf(
    root: Path,
    node: str,
    cpus: int,
    ports: tuple[int, int],
    user: str,
    local: Path | None = None,
    addresses: Mapping[str, str] | None = None,
) -> str:
    """A minimal slurm.conf: no accounting, no cgroups, every path in `root`.

    The daemons run as the current user (root on CI; another user gets a cluster
    that runs only its own jobs). proctrack/linuxproc and task/none need no cgroup
    mounts (containers have none writable); config_overrides lets a node declare
    `cpus` even where the machine has fewer, so a 2-task job always fits.

    Args:
        root: slurmctld's files (state, pid, log) and the config.
        node: the node that runs slurmctld; the only node without `addresses`.
        local: the node-local directory as every node sees it: the munge socket,
            slurmd's spool, pid and log, and TmpFS (which Slurm's PMIx plugin
            uses). Default `root`.
        addresses: node name -> address, a slurmd on each (`node` among them);
            srun's listening ports are then confined to SrunPortRange, as on a
            cluster whose firewall opens that range between nodes.
    """
    local = local or root
    if addresses:
        controller = f"{node}({addresses[node]})"
        nodes = [
            f"NodeName={name} NodeAddr={address} CPUs={cpus} State=UNKNOWN"
            for name, address in addresses.items()
        ]
        srun_ports = [f"SrunPortRange={SRUN_PORTS[0]}-{SRUN_PORTS[1]}"]
    else:
        controller, nodes, srun_ports = node, [f"NodeName={node} CPUs={cpus} State=UNKNOWN"], []
    return "\n".join(
        [
            "ClusterName=dlrmtest",
            f"SlurmctldHost={controller}",
            f"SlurmctldPort={ports[0]}",
            f"SlurmdPort={ports[1]}",
            *srun_ports,
            # Root here (as on CI); another user runs a cluster that runs only its jobs.
            f"SlurmUser={user}",
            f"SlurmdUser={user}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={local / 'munge' / 'munge.socket'}",
            f"StateSaveLocation={root / 'state'}",
            f"SlurmdSpoolDir={local / 'spool'}",
            f"SlurmctldPidFile={root / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={local / 'run' / 'slurmd.pid'}",
            f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={local / 'log' / 'slurmd.log'}",
            f"PlugStackConfig={root / 'plugstack.conf'}",
            f"TmpFS={local / 'tmp'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SlurmdParameters=config_overrides",
            "SchedulerType=sched/backfill",
            # A job submitted starts at once: by default slurmctld may hold a batch job
            # up to 3 s (batch_sched_delay) to schedule several together, which on a
            # test cluster is only waiting.
            "SchedulerParameters=batch_sched_delay=0",
            "SwitchType=switch/none",
            "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "ReturnToService=2",
            "MailProg=/bin/true",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            # Job ids of their own: OpenMPI names its shared-memory segments after the
            # job, so two clusters on one machine (test workers side by side) that
            # both ran a "job 2" on a host of the same name had their ranks share them.
            f"FirstJobId={1000 + os.getpid() % 100000 * 100}",
            *nodes,
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
            "",
        ]
    )


@dataclass
class SlurmCluster:
    """Daemons started by `start()`; `stop()` ends them (idempotent).

    One node, `node`, on this machine. `MultiNodeSlurmCluster` puts a node on each
    host of a `NetnsCluster` by overriding `nodes`, `local`, `node_directory` and
    `on`.
    """

    root: Path
    node: str
    cpus: int
    _daemons: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def nodes(self) -> tuple[str, ...]:
        """Every node's name; slurmctld runs on `node`, the first."""
        return (self.node,)

    @property
    def local(self) -> Path:
        """The node-local directory (munge socket, slurmd's files, TmpFS) as the
        daemons on a node see it."""
        return self.root

    def node_directory(self, node: str) -> Path:
        """Where `node`'s `local` lives on this machine's file system."""
        return self.root

    def on(self, node: str, command: Sequence[str]) -> list[str]:
        """`command` as run on `node` (this machine)."""
        return list(command)

    @property
    def env(self) -> dict[str, str]:
        """The environment for Slurm clients (sbatch, srun, scontrol) of this cluster."""
        # A test run inside another Slurm job must not hand that job's SLURM_* on.
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        path = env.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin"
        return dict(env, SLURM_CONF=str(self.conf), PATH=path)

    def start(self, timeout: float = 60.0) -> None:
        """Writes the key and config, starts munged (on every node), slurmctld,
        slurmd (on every node); waits until every node is idle. On any failure the
        daemons already started are stopped."""
        try:
            self._write_files()
            for node in self.nodes:
                self._spawn("munged", [*self._munged_command(), "--foreground"], node)
            for node in self.nodes:
                socket_file = self.node_directory(node) / "munge" / "munge.socket"
                self._wait(socket_file.exists, timeout, f"munged on {node}")
            slurmctld = [_program("slurmctld"), "-D", "-c", "-f", str(self.conf)]
            self._spawn("slurmctld", slurmctld, self.node)
            for node in self.nodes:
                self._spawn("slurmd", [_program("slurmd"), "-D", "-f", str(self.conf)], node)
            self._wait(self.all_idle, timeout, "idle nodes")
        except BaseException:
            self.stop()
            raise

    def all_idle(self) -> bool:
        """Whether every node is up and takes jobs (idle or partly allocated)."""
        result = self.client(["sinfo", "-h", "-N", "-o", "%N %T"], check=False)
        if result.returncode != 0:
            return False
        states = dict(line.split() for line in result.stdout.splitlines() if line.strip())
        return all(states.get(node, "").rstrip("*~#") in {"idle", "mixed"} for node in self.nodes)

    def _munged_command(self) -> list[str]:
        munge = self.local / "munge"
        return [
            _program("munged"),
            f"--socket={munge / 'munge.socket'}",
            # Every node's munged has the same key, as on a real cluster.
            f"--key-file={self.root / 'munge' / 'munge.key'}",
            f"--pid-file={munge / 'munged.pid'}",
            f"--log-file={munge / 'munged.log'}",
            f"--seed-file={munge / 'munged.seed'}",
            # As root munged refuses a key or directories it did not expect to own
            # unless forced; the directory is private (0700) anyway.
            "--force",
        ]

    def _write_files(self) -> None:
        # munged checks that no directory on the way to its files is writable by others.
        self.root.chmod(0o700)
        for name in ("munge", "state", "run", "log"):
            (self.root / name).mkdir(mode=0o700, exist_ok=True)
        for node in self.nodes:
            for name in ("munge", "spool", "run", "log", "tmp"):
                (self.node_directory(node) / name).mkdir(mode=0o700, parents=True, exist_ok=True)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        (self.root / "plugstack.conf").write_text("")
        self.conf.write_text(self._conf_text((_free_port(), _free_port())))

    def _conf_text(self, ports: tuple[int, int]) -> str:
        return slurm_conf(self.root, self.node, self.cpus, ports, getpass.getuser())

    def _spawn(self, name: str, command: list[str], node: str) -> None:
        label = name if len(self.nodes) == 1 else f"{name}-{node}"
        with open(self.root / "log" / f"{label}.out", "ab") as output:
            process = subprocess.Popen(
                self.on(node, command),
                env=self.env,
                stdout=output,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C in the test terminal reaches stop() only
            )
        self._daemons.append((label, process))

    def _wait(self, ready: Callable[[], bool], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for name, process in self._daemons:
                if process.poll() is not None:
                    raise SlurmClusterError(
                        f"{name} exited with {process.returncode} while waiting for {what}:\n"
                        f"{self.logs()}"
                    )
            if ready():
                return
            time.sleep(0.2)
        raise SlurmClusterError(f"no {what} after {timeout:.0f} s:\n{self.logs()}")

    def client(
        self, command: Sequence[str], check: bool = True, timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        """Runs a Slurm client command against this cluster; output captured."""
        result = subprocess.run(
            self.on(self.node, command),
            env=self.env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        if check and result.returncode != 0:
            raise SlurmClusterError(
                f"{' '.join(command)} exited with {result.returncode}:\n"
                f"{result.stdout}{result.stderr}"
            )
        return result

    def sbatch(
        self, arguments: Sequence[str], env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> int:
        """Submits a job on `node` from `cwd` (its SLURM_SUBMIT_DIR); returns its id.

        Args:
            env: the job's whole environment (sbatch passes it on); default `self.env`.
        """
        result = subprocess.run(
            self.on(self.node, ["sbatch", "--parsable", *arguments]),
            env=dict(env if env is not None else self.env, SLURM_CONF=str(self.conf)),
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        if result.returncode != 0:
            raise SlurmClusterError(
                f"sbatch {' '.join(arguments)} exited with {result.returncode}:\n"
                f"{result.stdout}{result.stderr}"
            )
        return int(result.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        """`scontrol show job` as a dict (JobState, ExitCode, StdOut, ...).

        Without accounting this is the only source of a job's end state; slurmctld
        keeps finished jobs for MinJobAge (300 s by default), long enough to read.
        """
        text = self.client(["scontrol", "show", "job", "-o", str(job_id)]).stdout
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait_for_job(self, job_id: int, timeout: float) -> dict[str, str]:
        """Polls until the job ends; cancels it and raises after `timeout` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if job.get("JobState") in TERMINAL_STATES:
                return job
            if time.monotonic() > deadline:
                self.client(["scancel", str(job_id)], check=False)
                raise SlurmClusterError(
                    f"job {job_id} still {job.get('JobState')} after {timeout:.0f} s; "
                    f"cancelled:\n{tail(Path(job.get('StdOut', '')))}"
                )
            time.sleep(0.25)  # scontrol answers in milliseconds; jobs here end in seconds

    def logs(self, characters: int = 3000) -> str:
        """The end of every daemon log, for failure messages."""
        parts = []
        for directory in sorted({self.root, *map(self.node_directory, self.nodes)}):
            for path in [
                *sorted((directory / "log").glob("*")),
                directory / "munge" / "munged.log",
            ]:
                if path.is_file():
                    name = path.relative_to(self.root)
                    parts.append(f"--- {name}\n{path.read_text(errors='replace')[-characters:]}")
        return "\n".join(parts)

    def stop(self, timeout: float = 20.0) -> None:
        """Cancels every job, then ends slurmd, slurmctld and munged (in that order)."""
        if any(name == "slurmctld" and p.poll() is None for name, p in self._daemons):
            self.client(["scancel", "--full", f"--nodelist={','.join(self.nodes)}"], check=False)
            self.client(["scancel", "--user", str(os.geteuid())], check=False)
            time.sleep(1)
        for _, process in reversed(self._daemons):
            if process.poll() is None:
                process.terminate()
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=timeout)
        self._daemons.clear()


@dataclass
class MultiNodeSlurmCluster(SlurmCluster):
    """A node on every host of a `NetnsCluster`: munged and slurmd on each host,
    slurmctld on `node` (the first host, also where clients such as sbatch run, as
    on a cluster's head node).

    Every host sees the one shared file system, but munged and slurmd need a
    node-local directory at the same path on every node (the munge socket that
    slurm.conf names once for all nodes; slurmd's spool; TmpFS, where Slurm's PMIx
    plugin makes per-step directories whose names would collide between nodes).
    So each command run on a host first bind-mounts that host's
    `node_directory` over `local` in its own mount namespace (`ip netns exec`
    makes one per command, and whatever slurmd starts inherits it). Processes that
    a host's sshd starts (horovodrun's remote ranks) do not see `local`; they need
    neither munge nor slurmd's files.

    Each host has its own munged rather than all sharing node1's socket (a
    path-named unix socket is reachable from every network namespace, so that
    would work too): as on a real cluster, every node's daemons and job steps
    check credentials with a local munged that has the cluster's one key.
    """

    hosts: NetnsCluster = field(kw_only=True)

    @property
    def nodes(self) -> tuple[str, ...]:
        return tuple(host.name for host in self.hosts.members)

    @property
    def local(self) -> Path:
        return self.root / "local"

    def node_directory(self, node: str) -> Path:
        return self.root / "nodes" / node

    def on(self, node: str, command: Sequence[str]) -> list[str]:
        """`command` as run on host `node`: with that host's node-local directory
        and this machine's cgroup file system (see `_cgroup_mounts`)."""
        mounts = f'{_cgroup_mounts()} && mount --bind "$1" "$2" && shift 2 && exec "$@"'
        local = [str(self.node_directory(node)), str(self.local)]
        return self.hosts.command(node, ["sh", "-c", mounts, "sh", *local, *command])

    @property
    def env(self) -> dict[str, str]:
        """The clients' environment, also the jobs' (sbatch passes it on): the
        `NetnsCluster`'s ssh wrapper first on PATH, for horovodrun across hosts."""
        env = super().env
        return dict(env, PATH=f"{self.hosts.bin_directory}{os.pathsep}{env['PATH']}")

    def _write_files(self) -> None:
        self.local.mkdir(mode=0o700, parents=True, exist_ok=True)
        super()._write_files()

    def _conf_text(self, ports: tuple[int, int]) -> str:
        addresses = {host.name: host.address for host in self.hosts.members}
        user = getpass.getuser()
        return slurm_conf(self.root, self.node, self.cpus, ports, user, self.local, addresses)


def _cgroup_mounts() -> str:
    """Shell commands that mount, in a host's namespaces, the cgroup file system
    this machine has at /sys/fs/cgroup (`ip netns exec` mounts a fresh /sys, without
    it). slurmd 22.05 looks there to choose its cgroup plugin and fails to start
    when it finds nothing ("No filesystem mounted on /sys/fs/cgroup"), even with
    proctrack/linuxproc and task/none, which create no cgroup."""
    mounts = Path("/proc/self/mounts").read_text().splitlines()
    kinds = {line.split()[1]: line.split()[2] for line in mounts}
    if kinds.get("/sys/fs/cgroup") == "cgroup2":
        return "mount -t cgroup2 cgroup2 /sys/fs/cgroup"
    # cgroup v1 (or hybrid): slurm checks for the systemd hierarchy, which exists
    # already (mounting it again adds no cgroup).
    return (
        "mount -t tmpfs cgroup /sys/fs/cgroup && mkdir /sys/fs/cgroup/systemd && "
        "mount -t cgroup -o none,name=systemd cgroup /sys/fs/cgroup/systemd"
    )


def start_multi_node_cluster(
    root: Path, hosts: NetnsCluster, cpus: int = 2
) -> MultiNodeSlurmCluster:
    """Installs Slurm (if needed) and starts a node on each of `hosts` (started
    already); the caller stops it before `hosts`."""
    reason = install_reason()
    if reason is not None:
        raise SlurmClusterError(reason)
    cluster = MultiNodeSlurmCluster(root=root, node=hosts.members[0].name, cpus=cpus, hosts=hosts)
    cluster.start()
    return cluster


def _program(name: str) -> str:
    found = system.which(name)
    if found is None:
        raise SlurmClusterError(f"{name} not found: install {PACKAGES[name]}")
    return found


def tail(path: Path, characters: int = 6000) -> str:
    """The end of a job's output file, or a note that it is missing."""
    if not path.is_file():
        return f"<no output file {path}>"
    text = path.read_text(errors="replace")
    return f"--- {path} (last {characters} characters)\n{text[-characters:]}"


# The variables the `slurm/` scripts read: a job gets them from the test alone.
SCRIPT_VARIABLES = frozenset({
    "BATCH_SIZE", "CHECKPOINT_DIR", "CONTAINER_IMAGE", "CONTAINER_MOUNTS", "CONTAINER_WORKDIR",
    "DATASET_PATH", "DLRM_HOME", "DLRM_PYTHON", "DRIVER_MEMORY", "EXECUTOR_MEMORY",
    "FREQUENCY_THRESHOLD", "HOROVODRUN", "HOROVODRUN_ARGS", "INPUT_DIR", "OUTPUT_DIR",
    "RESTORE_CHECKPOINT", "SPARK_LOCAL_DIR", "SPARK_MASTER", "SPARK_MASTER_PORT",
    "SPARK_STANDALONE", "SRUN_ARGS", "SRUN_MPI",
})  # fmt: skip
# 2 cores run two TensorFlow processes (each ~10 s to import) and the daemons.
JOB_TIMEOUT = 600.0


def start_script(
    cluster: SlurmCluster,
    script: str,
    output: Path,
    environment: dict[str, str],
    arguments: list[str],
    sbatch_options: tuple[str, ...] = ("--ntasks=2",),
    nodes: int = 1,
) -> int:
    """Submits `slurm/<script>` on `nodes` nodes from the repo root (the default
    DLRM_HOME); the job's id. The scripts' variables come from `environment` alone,
    never from the caller's shell."""
    inherited = {k: v for k, v in cluster.env.items() if k not in SCRIPT_VARIABLES}
    return cluster.sbatch(
        [
            *sbatch_options,
            f"--nodes={nodes}",
            "--time=20",
            f"--output={output}",
            str(REPO / "slurm" / script),
            *arguments,
        ],
        env={**inherited, "DLRM_PYTHON": sys.executable, **environment},
        cwd=REPO,
    )


def run_script(
    cluster: SlurmCluster,
    script: str,
    output: Path,
    environment: dict[str, str],
    arguments: list[str],
    sbatch_options: tuple[str, ...] = ("--ntasks=2",),
    nodes: int = 1,
) -> dict[str, str]:
    """`start_script`, then waits for the end: `scontrol show job`'s fields."""
    job_id = start_script(cluster, script, output, environment, arguments, sbatch_options, nodes)
    return cluster.wait_for_job(job_id, timeout=JOB_TIMEOUT)


def assert_completed(job: dict[str, str], output: Path) -> None:
    assert (job.get("JobState"), job.get("ExitCode")) == ("COMPLETED", "0:0"), (
        f"job {job.get('JobId')}: {job.get('JobState')} exit {job.get('ExitCode')}\n{tail(output)}"
    )


def job_summary(log: Path, output: Path) -> dict[str, Any]:
    """The last summary record of a job's metrics log; failing with the end of its
    output file when there is none."""
    assert log.is_file(), f"no metrics log {log}\n{tail(output)}"
    summaries = read_records(log, "summary")
    assert summaries, f"no summary record in {log}\n{tail(output)}"
    return summaries[-1]


def start_cluster(root: Path, cpus: int = 2) -> SlurmCluster:
    """Installs (if needed) and starts a cluster in `root`; the caller stops it."""
    reason = install_reason()
    if reason is not None:
        raise SlurmClusterError(reason)
    cluster = SlurmCluster(root=root, node=node_name(), cpus=max(cpus, os.cpu_count() or 1))
    cluster.start()
    return cluster


def main(argv: Sequence[str] | None = None) -> int:
    """Starts a cluster in a directory for trying the scripts by hand; stops it on
    Ctrl-C or SIGTERM (or at once with --check)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path, help="where the cluster keeps its files")
    parser.add_argument("--check", action="store_true", help="run srun -n 2, then stop")
    args = parser.parse_args(argv)
    args.directory.mkdir(parents=True, exist_ok=True)
    # `kill PID` stops the cluster as Ctrl-C does (a background job ignores SIGINT).
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    cluster = start_cluster(args.directory)
    try:
        print(cluster.client(["sinfo"]).stdout, end="")
        print(cluster.client(["srun", "-n", "2", "hostname"]).stdout, end="")
        if not args.check:
            print(f"export SLURM_CONF={cluster.conf}  # then sbatch/srun/squeue; Ctrl-C stops")
            while True:
                time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
