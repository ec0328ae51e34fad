"""One Horovod Elastic launch of `main.py` on network-namespace hosts, for the
elastic tests (tests/integration/test_elastic.py) and the recovery benchmark
(benchmarks/recovery.py): `horovodrun --gloo --host-discovery-script` from node1,
the hosts listed by a file that the caller edits (the discovery script prints it),
the ranks' metrics log read back, a host's ranks killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dlrm.app.records import read_records
from harness.netns import INTERFACE, NetnsCluster
from harness.processes import REPO, process_env

RUN_TIMEOUT_S = 420
# horovodrun's code, started from `-c` rather than its script: the elastic driver runs
# the discovery script every second through a middleman process started with
# multiprocessing's "spawn", which imports the parent's main script again (0.24 s of
# CPU a poll from the script, 0.08 from `-c`; a 4-minute job polls about 240 times).
# Its command line still names horovodrun, which `NetnsCluster.main_py_processes` skips.
HOROVODRUN = (
    "import sys; from horovod.runner.launch import run_commandline; "
    "sys.argv[0] = 'horovodrun'; sys.exit(run_commandline())"
)


class ElasticJob:
    """`main.py FLAGS --dataset_path ... --save_checkpoint_path DIRECTORY/run` under
    horovodrun's elastic mode, its output in DIRECTORY/horovodrun.log.

    Args:
        hosts: listed by the discovery script at the start, one slot each.
        gloo_timeout_s: HOROVOD_GLOO_TIMEOUT_SECONDS, how long a silent peer is waited for.
    """

    def __init__(
        self,
        cluster: NetnsCluster,
        directory: Path,
        dataset: Path,
        flags: Sequence[str],
        hosts: Sequence[str],
        gloo_timeout_s: int,
    ) -> None:
        self.cluster = cluster
        self.directory = directory
        self.run = directory / "run"
        self.log = directory / "horovodrun.log"
        self.hosts_file = directory / "hosts"
        self.script = directory / "discover.sh"
        self.dataset = dataset
        self.flags = list(flags)
        self.gloo_timeout_s = gloo_timeout_s
        directory.mkdir(parents=True, exist_ok=True)
        self.list_hosts(*hosts)
        self.script.write_text(f"#!/bin/sh\ncat {self.hosts_file}\n")
        self.script.chmod(0o755)
        self.launcher: subprocess.Popen | None = None

    def list_hosts(self, *hosts: str) -> None:
        """What the discovery script prints from now on."""
        self.hosts_file.write_text("".join(f"{h}:1\n" for h in hosts))

    def start(self, np: int, min_np: int, *horovodrun_flags: str) -> None:
        command = [
            sys.executable, "-c", HOROVODRUN, "--gloo", "-np", str(np), "--min-np", str(min_np),
            "--host-discovery-script", str(self.script), "--network-interface", INTERFACE,
            *horovodrun_flags,
            sys.executable, "main.py", *self.flags, f"--dataset_path={self.dataset}",
            f"--save_checkpoint_path={self.run}",
        ]  # fmt: skip
        env = process_env({"HOROVOD_GLOO_TIMEOUT_SECONDS": str(self.gloo_timeout_s)})
        with self.log.open("w") as sink:
            self.launcher = self.cluster.popen(
                "node1", command, env=env, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT
            )

    def records(self, event: str) -> list[dict[str, Any]]:
        """Rank 0's metrics records of `event`, in order."""
        return read_records(self.run / "metrics.jsonl", event)

    def wait_for_step(self, step: int, host: str) -> int:
        """Waits until rank 0 logged a step at or past `step` with a rank running
        on `host`; returns the step logged."""
        assert self.launcher is not None
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while time.monotonic() < deadline and self.launcher.poll() is None:
            trained = self.records("train")
            if trained and trained[-1]["step"] >= step:
                if not self.cluster.main_py_processes(host):
                    raise RuntimeError(f"no rank runs on {host}:\n{self.output()}")
                return int(trained[-1]["step"])
            time.sleep(0.2)
        raise RuntimeError(f"step {step} was not reached:\n{self.output()}")

    def wait(self, timeout: float = RUN_TIMEOUT_S) -> int:
        """horovodrun's exit status (killed after `timeout` seconds)."""
        assert self.launcher is not None
        try:
            return self.launcher.wait(timeout=timeout)
        finally:
            if self.launcher.poll() is None:
                os.killpg(self.launcher.pid, signal.SIGKILL)
                self.launcher.wait()

    def output(self) -> str:
        return self.log.read_text()[-6000:] if self.log.exists() else ""

    def kill_ranks(self, host: str) -> float:
        """Kills `host`'s rank, as a host that loses power would, but leaves its
        sshd (the host can serve again); returns the time (time.time())."""
        for pid in self.cluster.main_py_processes(host):
            os.kill(pid, signal.SIGKILL)
        return time.time()
