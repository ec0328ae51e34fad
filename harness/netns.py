"""Several "hosts" on this one machine, for multi-host integration tests.

Each host is a Linux network namespace with its own address and, for what runs
in it, its own hostname (a UTS namespace). The hosts are joined by a bridge that
lives in a namespace of its own, so their traffic never touches the machine's
own interfaces; names resolve through `/etc/netns/<namespace>/hosts`, which `ip
netns exec` mounts over `/etc/hosts` for the processes of that namespace only.
Every host runs its own `sshd` (key-only, configured and keyed from a private
directory), as `horovodrun -H` and `mpirun` need; clients find the key and
known-hosts file through an `ssh` wrapper first on PATH, so nothing is written
to the user's `~/.ssh`. The file system is shared by every host, as NFS would be
on a real cluster.

`stop` kills every process left in the namespaces and deletes them, also after
a failed test. Needs root (or password-less sudo is not enough: `ip netns`
runs as root); missing `ip` and `sshd` are installed with apt-get.

    python -m harness.netns DIR [--hosts 2]  # start; Ctrl-C stops
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from harness.system import install_missing

SSHD = "/usr/sbin/sshd"
# Program -> the Debian package that brings it.
PACKAGES = {"ip": "iproute2", SSHD: "openssh-server", "ssh": "openssh-client"}
# The interface name of every host's link, so that one --network-interface fits all.
INTERFACE = "eth0"


class ClusterError(RuntimeError):
    """The namespace cluster could not be set up, or a host did not answer."""


def install_reason() -> str | None:
    """Installs what is missing with apt-get; returns why the cluster cannot run
    here (not root), for a test skip, or None.

    Raises:
        InstallError: apt-get was possible but failed (never a skip).
    """
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    return install_missing(PACKAGES)


@dataclass
class Host:
    name: str  # its hostname, resolvable from every host
    namespace: str
    address: str


@dataclass
class NetnsCluster:
    """`hosts` hosts named `node1`, `node2`, ... at 10.<subnet>.0.1, .2, ...

    Args:
        directory: private files (keys, sshd configs, logs); created.
        hosts: how many.
        tag: distinguishes this cluster's namespaces from another's (default:
            from the process id).
    """

    directory: Path
    hosts: int = 2
    tag: str = ""
    members: list[Host] = field(default_factory=list)
    _daemons: list[subprocess.Popen] = field(default_factory=list)
    _namespaces: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.directory = Path(self.directory).resolve()
        self.tag = self.tag or f"dlrm{os.getpid() % 100000}"
        subnet = 64 + os.getpid() % 128
        self.members = [
            Host(f"node{i + 1}", f"{self.tag}-node{i + 1}", f"10.{subnet}.0.{i + 1}")
            for i in range(self.hosts)
        ]

    # ------------------------------------------------------------------ start

    def start(self) -> NetnsCluster:
        """Creates the namespaces, the bridge and the links, and starts sshd on
        every host; waits until each answers `ssh <host> hostname` with its name.

        Raises:
            ClusterError: naming the step and its output (the cluster is stopped).
        """
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._network()
            self._ssh_keys()
            for host in self.members:
                self._start_sshd(host)
            self._wait_for_ssh()
        except BaseException:
            self.stop()
            raise
        return self

    def _network(self) -> None:
        switch = f"{self.tag}-switch"
        self._add_namespace(switch)
        _run(["ip", "-n", switch, "link", "add", "br0", "type", "bridge"])
        _run(["ip", "-n", switch, "link", "set", "br0", "up"])
        hosts_file = "127.0.0.1 localhost\n" + "".join(
            f"{h.address} {h.name}\n" for h in self.members
        )
        for index, host in enumerate(self.members):
            self._add_namespace(host.namespace)
            port = f"port{index}"
            # The veth pair: one end on the bridge, the other the host's eth0.
            _run(
                ["ip", "-n", switch, "link", "add", port, "type", "veth", "peer", "name",
                 INTERFACE, "netns", host.namespace]
            )  # fmt: skip
            _run(["ip", "-n", switch, "link", "set", port, "master", "br0", "up"])
            _run(
                ["ip", "-n", host.namespace, "addr", "add", f"{host.address}/24", "dev", INTERFACE]
            )
            _run(["ip", "-n", host.namespace, "link", "set", INTERFACE, "up"])
            _run(["ip", "-n", host.namespace, "link", "set", "lo", "up"])
            etc = Path("/etc/netns") / host.namespace
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(hosts_file)

    def _add_namespace(self, name: str) -> None:
        _run(["ip", "netns", "add", name])
        self._namespaces.append(name)

    @property
    def ssh_directory(self) -> Path:
        return self.directory / "ssh"

    @property
    def bin_directory(self) -> Path:
        """Holds the `ssh` wrapper; put it first on PATH (`env`)."""
        return self.directory / "bin"

    def _ssh_keys(self) -> None:
        ssh = self.ssh_directory
        if ssh.exists():
            shutil.rmtree(ssh)
        ssh.mkdir(mode=0o700)
        for key in ("client_key", "host_key"):
            _run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(ssh / key)])
        shutil.copy(ssh / "client_key.pub", ssh / "authorized_keys")
        (ssh / "known_hosts").write_text(
            "".join(
                f"{h.name},{h.address} {(ssh / 'host_key.pub').read_text().split(' ')[0]} "
                f"{(ssh / 'host_key.pub').read_text().split(' ')[1]}\n"
                for h in self.members
            )
        )
        (ssh / "ssh_config").write_text(
            f"Host *\n"
            f"  IdentityFile {ssh / 'client_key'}\n"
            f"  UserKnownHostsFile {ssh / 'known_hosts'}\n"
            f"  StrictHostKeyChecking yes\n"
            f"  BatchMode yes\n"
            f"  LogLevel ERROR\n"
            f"  ConnectTimeout 10\n"
            # A session to a host whose link went down ends within ~10 s, as a
            # cluster's ssh configuration would have it: horovodrun's elastic driver
            # counts that host's ranks as failed only when their ssh exits.
            f"  ServerAliveInterval 3\n"
            f"  ServerAliveCountMax 3\n"
        )
        self.bin_directory.mkdir(exist_ok=True)
        wrapper = self.bin_directory / "ssh"
        wrapper.write_text(f'#!/bin/sh\nexec {shutil.which("ssh")} -F {ssh / "ssh_config"} "$@"\n')
        wrapper.chmod(0o755)
        Path("/run/sshd").mkdir(exist_ok=True)  # sshd's privilege-separation directory

    def _start_sshd(self, host: Host) -> None:
        ssh = self.ssh_directory
        config = ssh / f"sshd_{host.name}.conf"
        config.write_text(
            f"ListenAddress {host.address}\n"
            f"Port 22\n"
            f"HostKey {ssh / 'host_key'}\n"
            f"AuthorizedKeysFile {ssh / 'authorized_keys'}\n"
            f"PidFile {ssh / f'sshd_{host.name}.pid'}\n"
            "PasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\n"
            "PermitRootLogin prohibit-password\n"
            "UsePAM no\n"
            "StrictModes no\n"
            "PrintMotd no\n"
            "LogLevel ERROR\n"
        )
        log = open(self.directory / f"sshd_{host.name}.log", "wb")  # noqa: SIM115 (daemon's)
        self._daemons.append(
            subprocess.Popen(
                self.command(host.name, [SSHD, "-D", "-e", "-f", str(config)]),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        )

    def _wait_for_ssh(self, timeout: float = 30.0) -> None:
        first = self.members[0].name
        for host in self.members:
            deadline = time.monotonic() + timeout
            while True:
                result = self.run(first, ["ssh", host.name, "hostname"], timeout=30)
                if result.returncode == 0 and result.stdout.strip() == host.name:
                    break
                if time.monotonic() > deadline:
                    log = (self.directory / f"sshd_{host.name}.log").read_text()[-2000:]
                    raise ClusterError(
                        f"ssh {host.name} from {first}: expected it to answer its hostname, "
                        f"got exit {result.returncode}: {result.stdout}{result.stderr}\n"
                        f"sshd log: {log}"
                    )
                time.sleep(0.3)

    # ------------------------------------------------------------------- use

    def host(self, name: str) -> Host:
        for host in self.members:
            if host.name == name:
                return host
        raise KeyError(f"no host {name!r}; hosts: {[h.name for h in self.members]}")

    def env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """The environment for commands on the hosts: the ssh wrapper first on PATH."""
        env = {**os.environ, **(extra or {})}
        env["PATH"] = f"{self.bin_directory}{os.pathsep}{env.get('PATH', '')}"
        return env

    def command(self, host: str, command: Sequence[str]) -> list[str]:
        """`command` as run on `host`: in its network namespace, with its hostname."""
        namespace = self.host(host).namespace
        return [
            "ip", "netns", "exec", namespace, "unshare", "--uts", "sh", "-c",
            f'hostname {host} && exec "$@"', "sh", *command,
        ]  # fmt: skip

    def run(
        self,
        host: str,
        command: Sequence[str],
        timeout: float = 300,
        env: Mapping[str, str] | None = None,
        cwd: str | Path | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Runs `command` on `host` and waits (its output captured)."""
        return subprocess.run(
            self.command(host, command),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env(env),
            cwd=cwd,
        )

    def popen(
        self,
        host: str,
        command: Sequence[str],
        env: Mapping[str, str] | None = None,
        **kwargs: object,
    ) -> subprocess.Popen:
        """Starts `command` on `host` in a new session (kill its group to stop it)."""
        return subprocess.Popen(  # type: ignore[call-overload]
            self.command(host, command), env=self.env(env), start_new_session=True, **kwargs
        )

    def processes(self, host: str) -> list[int]:
        """Pids of every process in `host`'s network namespace."""
        result = subprocess.run(
            ["ip", "netns", "pids", self.host(host).namespace], capture_output=True, text=True
        )
        return [int(p) for p in result.stdout.split()]

    def main_py_processes(self, host: str) -> list[int]:
        """Pids of the `main.py` ranks running on `host` (not their launcher)."""
        found = []
        for pid in self.processes(host):
            try:
                command = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"main.py" in command and b"horovodrun" not in b" ".join(command):
                found.append(pid)
        return found

    def kill_host(self, host: str) -> None:
        """Kills every process of `host`, as a machine that loses power."""
        for pid in self.processes(host):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)

    def shape(self, gbit_s: float) -> None:
        """Limits every host's link to `gbit_s` per direction, as a NIC of that
        speed would: a token bucket (`tc tbf`) on what the host sends (its eth0)
        and on what it receives (its port on the bridge). The bucket holds 1 ms
        at the rate (at least 64 KiB: a TCP segment with offloads is that large),
        and queues at most 50 ms before dropping."""
        burst = max(64 * 1024, int(gbit_s * 1e9 / 8 / 1000))
        shaper = ["root", "tbf", "rate", f"{gbit_s}gbit", "burst", str(burst), "latency", "50ms"]
        switch = f"{self.tag}-switch"
        for index, host in enumerate(self.members):
            _run(["ip", "netns", "exec", host.namespace, "tc", "qdisc", "replace", "dev",
                  INTERFACE, *shaper])  # fmt: skip
            _run(["ip", "netns", "exec", switch, "tc", "qdisc", "replace", "dev",
                  f"port{index}", *shaper])  # fmt: skip

    def link(self, host: str, up: bool) -> None:
        """Brings `host`'s link down (cable pulled) or up again."""
        state = "up" if up else "down"
        _run(["ip", "-n", self.host(host).namespace, "link", "set", INTERFACE, state])

    # ------------------------------------------------------------------- stop

    def stop(self) -> None:
        """Kills every process in the namespaces and deletes them (idempotent)."""
        for host in self.members:
            if host.namespace in self._namespaces:
                self.kill_host(host.name)
        for daemon in self._daemons:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(daemon.pid, signal.SIGKILL)
            daemon.wait(timeout=10)
        self._daemons.clear()
        for namespace in reversed(self._namespaces):
            subprocess.run(["ip", "netns", "del", namespace], capture_output=True)
            shutil.rmtree(Path("/etc/netns") / namespace, ignore_errors=True)
        self._namespaces.clear()

    def __enter__(self) -> NetnsCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _run(command: Sequence[str]) -> None:
    result = subprocess.run(command, capture_output=True, text=True, timeout=60)
    if result.returncode != 0:
        raise ClusterError(
            f"{' '.join(command)}: exit {result.returncode}: {result.stderr.strip()}"
        )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("directory", type=Path)
    parser.add_argument("--hosts", type=int, default=2)
    args = parser.parse_args(argv)
    reason = install_reason()
    if reason:
        print(reason, file=sys.stderr)
        return 1
    with NetnsCluster(args.directory, args.hosts) as cluster:
        for host in cluster.members:
            print(f"{host.name}: {host.address} (ip netns exec {host.namespace} ...)")
        print(f"PATH={cluster.bin_directory}:$PATH for ssh; Ctrl-C stops")
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()
    return 0


if __name__ == "__main__":
    sys.exit(main())


def netns_cluster(
    tmp_path_factory: pytest.TempPathFactory, hosts: int = 2, tag: str = ""
) -> Iterator[NetnsCluster]:
    """For a module fixture (`yield from`): a started cluster of `hosts` simulated
    hosts, stopped afterwards; the test is skipped where namespaces need root."""
    reason = install_reason()
    if reason is not None:
        pytest.skip(reason)
    cluster = NetnsCluster(tmp_path_factory.mktemp("cluster"), hosts=hosts, tag=tag).start()
    try:
        yield cluster
    finally:
        cluster.stop()
