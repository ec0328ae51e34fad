"""A real one-node Slurm cluster on localhost, for integration tests.

Debian's `slurm-wlm` and `munge` daemons are started from a private directory: the
munge key and socket, slurm.conf, state, spool, pid and log files all live there,
the ports are free ones picked at start, and every client finds the config through
`SLURM_CONF`. So a test never reads or changes a system configuration, and a
machine that already runs Slurm or munge is left alone.

    python -m tests.integration.slurm_cluster DIR [--check]  # start; Ctrl-C stops
"""

from __future__ import annotations

import argparse
import getpass
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

# The programs a cluster needs; the packages that bring them.
SLURM_PROGRAMS = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "scontrol", "scancel")
APT_PACKAGES = ("slurm-wlm", "munge")
TERMINAL_STATES = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "TIMEOUT",
    }
)


class SlurmClusterError(RuntimeError):
    """The local cluster could not be installed, started or asked about a job."""


def missing_programs() -> list[str]:
    return [name for name in SLURM_PROGRAMS if _which(name) is None]


def _which(name: str) -> str | None:
    # Daemons live in /usr/sbin, which a non-login PATH may lack.
    path = os.environ.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin"
    return shutil.which(name, path=path)


def install_reason() -> str | None:
    """Installs Slurm and munge with apt-get when missing.

    Returns:
        None when the programs are there (now); otherwise why they cannot be
        installed (not root and no password-less sudo), for a test skip.

    Raises:
        SlurmClusterError: apt-get was possible but failed (never a skip).
    """
    if not missing_programs():
        return None
    if os.geteuid() == 0:
        prefix: list[str] = []
    elif shutil.which("sudo") and _quiet(["sudo", "-n", "true"]):
        prefix = ["sudo", "-n"]
    else:
        return (
            f"Slurm is not installed ({', '.join(missing_programs())} missing) and this user "
            f"can neither apt-get as root nor sudo: run `apt-get install {' '.join(APT_PACKAGES)}`"
        )
    if shutil.which("apt-get") is None:
        raise SlurmClusterError(f"{', '.join(missing_programs())} missing and no apt-get here")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    # Waits for a concurrent apt/dpkg (e.g. `make install`) instead of failing at once.
    apt_get = [*prefix, "apt-get", "-o", "DPkg::Lock::Timeout=600"]
    install = [*apt_get, "install", "-y", "-qq", "--no-install-recommends"]
    # The package lists of a fresh image may be empty or stale: update once on failure.
    if not _quiet([*install, *APT_PACKAGES], env=env):
        update = subprocess.run(
            [*apt_get, "update", "-qq"], env=env, capture_output=True, text=True, check=False
        )
        result = subprocess.run(
            [*install, *APT_PACKAGES], env=env, capture_output=True, text=True, check=False
        )
        if result.returncode != 0:
            raise SlurmClusterError(
                f"apt-get install {' '.join(APT_PACKAGES)} failed (exit {result.returncode}):\n"
                f"{update.stderr[-2000:]}{result.stdout[-2000:]}{result.stderr[-2000:]}"
            )
    if missing_programs():
        raise SlurmClusterError(f"installed {APT_PACKAGES} but {missing_programs()} still missing")
    return None


def _quiet(command: Sequence[str], env: dict[str, str] | None = None) -> bool:
    return subprocess.run(command, env=env, capture_output=True, check=False).returncode == 0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def node_name() -> str:
    """The short hostname: slurmd finds its NodeName line by it."""
    return subprocess.run(
        ["hostname", "-s"], capture_output=True, text=True, check=True
    ).stdout.strip()


def slurm_conf(root: Path, node: str, cpus: int, ports: tuple[int, int], user: str) -> str:
    """A minimal slurm.conf: one node, no accounting, no cgroups, every path in `root`.

    The daemons run as the current user (root on CI; another user gets a cluster
    that runs only its own jobs). proctrack/linuxproc and task/none need no cgroup
    mounts (containers have none writable); config_overrides lets the node declare
    `cpus` even where the machine has fewer, so a 2-task job always fits.
    """
    return "\n".join(
        [
            "ClusterName=dlrmtest",
            f"SlurmctldHost={node}",
            f"SlurmctldPort={ports[0]}",
            f"SlurmdPort={ports[1]}",
            # Root here (as on CI); another user runs a cluster that runs only its jobs.
            f"SlurmUser={user}",
            f"SlurmdUser={user}",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={root / 'munge' / 'munge.socket'}",
            f"StateSaveLocation={root / 'state'}",
            f"SlurmdSpoolDir={root / 'spool'}",
            f"SlurmctldPidFile={root / 'run' / 'slurmctld.pid'}",
            f"SlurmdPidFile={root / 'run' / 'slurmd.pid'}",
            f"SlurmctldLogFile={root / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={root / 'log' / 'slurmd.log'}",
            f"PlugStackConfig={root / 'plugstack.conf'}",
            f"TmpFS={root / 'tmp'}",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SlurmdParameters=config_overrides",
            "SchedulerType=sched/backfill",
            "SwitchType=switch/none",
            "MpiDefault=none",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "ReturnToService=2",
            "MailProg=/bin/true",
            "SlurmctldDebug=info",
            "SlurmdDebug=info",
            f"NodeName={node} CPUs={cpus} State=UNKNOWN",
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
            "",
        ]
    )


@dataclass
class SlurmCluster:
    """Daemons started by `start()`; `stop()` ends them (idempotent)."""

    root: Path
    node: str
    cpus: int
    _daemons: list[tuple[str, subprocess.Popen[bytes]]] = field(default_factory=list)

    @property
    def conf(self) -> Path:
        return self.root / "slurm.conf"

    @property
    def env(self) -> dict[str, str]:
        """The environment for Slurm clients (sbatch, srun, scontrol) of this cluster."""
        # A test run inside another Slurm job must not hand that job's SLURM_* on.
        env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
        path = env.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin"
        return dict(env, SLURM_CONF=str(self.conf), PATH=path)

    def start(self, timeout: float = 60.0) -> None:
        """Writes the key and config, starts munged, slurmctld, slurmd; waits for an
        idle node. On any failure the daemons already started are stopped."""
        try:
            self._write_files()
            self._spawn("munged", [*self._munged_command(), "--foreground"])
            self._wait(lambda: (self.root / "munge" / "munge.socket").exists(), timeout, "munged")
            self._spawn("slurmctld", [_program("slurmctld"), "-D", "-c", "-f", str(self.conf)])
            self._spawn("slurmd", [_program("slurmd"), "-D", "-f", str(self.conf)])
            self._wait(lambda: self.node_state() in {"idle", "mixed"}, timeout, "an idle node")
        except BaseException:
            self.stop()
            raise

    def _munged_command(self) -> list[str]:
        munge = self.root / "munge"
        return [
            _program("munged"),
            f"--socket={munge / 'munge.socket'}",
            f"--key-file={munge / 'munge.key'}",
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
        for name in ("munge", "state", "spool", "run", "log", "tmp"):
            (self.root / name).mkdir(mode=0o700, exist_ok=True)
        key = self.root / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        (self.root / "plugstack.conf").write_text("")
        self.conf.write_text(
            slurm_conf(
                self.root, self.node, self.cpus, (_free_port(), _free_port()), getpass.getuser()
            )
        )

    def _spawn(self, name: str, command: list[str]) -> None:
        with open(self.root / "log" / f"{name}.out", "ab") as output:
            process = subprocess.Popen(
                command,
                env=self.env,
                stdout=output,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # a Ctrl-C in the test terminal reaches stop() only
            )
        self._daemons.append((name, process))

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
            time.sleep(0.5)
        raise SlurmClusterError(f"no {what} after {timeout:.0f} s:\n{self.logs()}")

    def node_state(self) -> str:
        result = self.client(["sinfo", "-h", "-n", self.node, "-o", "%T"], check=False)
        return result.stdout.strip().rstrip("*~#") if result.returncode == 0 else ""

    def client(
        self, command: Sequence[str], check: bool = True, timeout: float = 60.0
    ) -> subprocess.CompletedProcess[str]:
        """Runs a Slurm client command against this cluster; output captured."""
        result = subprocess.run(
            list(command),
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
        """Submits a job from `cwd` (its SLURM_SUBMIT_DIR); returns its id.

        Args:
            env: the job's whole environment (sbatch passes it on); default `self.env`.
        """
        result = subprocess.run(
            ["sbatch", "--parsable", *arguments],
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
            time.sleep(2)

    def logs(self, characters: int = 3000) -> str:
        """The end of every daemon log, for failure messages."""
        parts = []
        for path in [*sorted((self.root / "log").glob("*")), self.root / "munge" / "munged.log"]:
            if path.is_file():
                parts.append(f"--- {path.name}\n{path.read_text(errors='replace')[-characters:]}")
        return "\n".join(parts)

    def stop(self, timeout: float = 20.0) -> None:
        """Cancels every job, then ends slurmd, slurmctld and munged (in that order)."""
        if any(name == "slurmctld" and p.poll() is None for name, p in self._daemons):
            self.client(["scancel", "--full", f"--nodelist={self.node}"], check=False)
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


def _program(name: str) -> str:
    found = _which(name)
    if found is None:
        raise SlurmClusterError(f"{name} not found: install {' '.join(APT_PACKAGES)}")
    return found


def tail(path: Path, characters: int = 6000) -> str:
    """The end of a job's output file, or a note that it is missing."""
    if not path.is_file():
        return f"<no output file {path}>"
    text = path.read_text(errors="replace")
    return f"--- {path} (last {characters} characters)\n{text[-characters:]}"


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
