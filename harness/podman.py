"""Rootful podman with runc on this machine, for the tests that build and run the
project's images (`Dockerfile`, `docker/spark.Dockerfile`).

Everything podman keeps lives in one directory of the test's: the image storage, the
run state and a containers.conf of our own (handed to podman by `CONTAINERS_CONF`,
which replaces the system's files). So no system configuration is read or changed,
images built elsewhere on the machine are neither seen nor touched, and removing
the directory leaves nothing behind.

No image registry is reachable from CI, so the Debian base that the Dockerfiles name
is made here: `debootstrap --variant=minbase` from the Debian mirror that apt already
uses, imported with `podman import` under that name.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from harness import system

# The programs the tests need, and the Debian packages that bring them.
PROGRAMS = {"podman": "podman", "runc": "runc", "debootstrap": "debootstrap"}
# Why each setting: runc, because crun fails on the hybrid cgroup layout of these
# machines; no default ulimits, because podman's default raises limits above what a
# container here may set; cgroupfs and a file events log, because CI machines run no
# systemd (no systemd cgroup manager, no journald); a state directory of our own
# instead of the machine's /run/libpod.
CONTAINERS_CONF = """\
[containers]
default_ulimits = []

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
tmp_dir = "{tmp_dir}"
"""
# The Debian image that Docker Hub's debian:bookworm-slim sets (debootstrap leaves the
# image config empty).
BASE_IMAGE_CHANGES = (
    "ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    'CMD ["bash"]',
)
APT_SOURCE_FILES = (Path("/etc/apt/sources.list"), Path("/etc/apt/sources.list.d"))


class PodmanError(RuntimeError):
    """podman or debootstrap failed; the message holds their output."""


def install_reason() -> str | None:
    """Installs podman, runc and debootstrap with apt-get when missing.

    Returns:
        None when the test can run: root, and the programs are there (now).
        Otherwise why not, for a test skip.

    Raises:
        InstallError: apt-get was possible but failed (never a skip).
    """
    if os.geteuid() != 0:
        # Rootless podman needs subordinate id ranges set up per user, and the tests
        # hand output directories to other users: both need root.
        packages = sorted({PROGRAMS[name] for name in system.missing_programs(list(PROGRAMS))})
        install = f", and `apt-get install {' '.join(packages)}`" if packages else ""
        return f"the container image tests need root (podman as root){install}"
    return system.install_missing(PROGRAMS)


@dataclass(frozen=True)
class AptSource:
    """One `deb` line of apt's configuration: where one suite's components come from."""

    uri: str
    suite: str
    components: tuple[str, ...]

    def line(self) -> str:
        return f"deb {self.uri} {self.suite} {' '.join(self.components)}"


def apt_sources(paths: Sequence[Path] = APT_SOURCE_FILES) -> list[AptSource]:
    """The `deb` sources of this machine's apt, from one-line `.list` files and deb822
    `.sources` files (a directory stands for the files in it), in apt's order."""
    files: list[Path] = []
    for path in paths:
        if path.is_dir():
            files += sorted(p for p in path.iterdir() if p.suffix in (".list", ".sources"))
        elif path.is_file():
            files.append(path)
    sources: list[AptSource] = []
    for file in files:
        text = file.read_text()
        if file.suffix == ".sources":
            sources += _deb822_sources(text)
            continue
        for raw in text.splitlines():
            line = re.sub(r"\[[^\]]*\]", " ", raw.split("#", 1)[0]).split()
            if len(line) >= 3 and line[0] == "deb":
                sources.append(AptSource(line[1], line[2], tuple(line[3:])))
    return sources


def _deb822_sources(text: str) -> list[AptSource]:
    sources = []
    for stanza in re.split(r"\n\s*\n", text):
        fields: dict[str, str] = {}
        key = ""
        for line in stanza.splitlines():
            if line.startswith("#"):
                continue
            if line[:1].isspace() and key:  # a continuation line (e.g. an inline key)
                fields[key] += " " + line.strip()
                continue
            key, _, value = line.partition(":")
            key = key.strip().lower()
            fields[key] = value.strip()
        if "deb" not in fields.get("types", "").split() or fields.get("enabled") == "no":
            continue
        for uri in fields.get("uris", "").split():
            for suite in fields.get("suites", "").split():
                sources.append(AptSource(uri, suite, tuple(fields.get("components", "").split())))
    return sources


def debian_sources(release: str, sources: Sequence[AptSource]) -> list[AptSource]:
    """This machine's sources of Debian `release` (its updates and security suites
    included), the release itself first: debootstrap installs from that one."""
    chosen = [
        s
        for s in sources
        if (s.suite == release or s.suite.startswith(f"{release}-")) and "main" in s.components
    ]
    chosen.sort(key=lambda s: s.suite != release)
    if not chosen or chosen[0].suite != release:
        raise PodmanError(
            f"no apt source of Debian {release} (main) on this machine, in "
            f"{' or '.join(map(str, APT_SOURCE_FILES))}: debootstrap needs a mirror of it"
        )
    return chosen


@dataclass(frozen=True)
class Podman:
    """podman with its storage, run state and configuration under `root`."""

    root: Path

    @classmethod
    def create(cls, parent: Path | None = None) -> Podman:
        """A new, empty root under `parent` (default /var/tmp: images take several GB,
        which a RAM-backed /tmp may not have), readable by every user so that the
        output directories that tests make in it can be handed to other users."""
        root = Path(tempfile.mkdtemp(prefix="dlrm-podman-", dir=parent or "/var/tmp"))
        root.chmod(0o755)
        (root / "containers.conf").write_text(CONTAINERS_CONF.format(tmp_dir=root / "libpod"))
        (root / "tmp").mkdir()
        return cls(root)

    def command(self, *args: str) -> list[str]:
        return [
            "podman",
            "--root",
            str(self.root / "storage"),
            "--runroot",
            str(self.root / "run"),
            "--storage-driver",
            "overlay",
            *args,
        ]

    def env(self) -> dict[str, str]:
        # TMPDIR: where buildah keeps the builds' cache mounts and podman its temporary
        # copies of layers (else /var/tmp, which would outlive the root).
        return dict(
            os.environ,
            CONTAINERS_CONF=str(self.root / "containers.conf"),
            TMPDIR=str(self.root / "tmp"),
        )

    def run(
        self, *args: str, timeout: float, stdin: IO[bytes] | None = None
    ) -> subprocess.CompletedProcess[str]:
        """`podman ARGS`, output captured (stdout and stderr in one, in order)."""
        return subprocess.run(
            self.command(*args),
            env=self.env(),
            stdin=stdin,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            timeout=timeout,
            check=False,
        )

    def check(self, *args: str, timeout: float) -> str:
        """`podman ARGS`; its output, or PodmanError with the output's end."""
        result = self.run(*args, timeout=timeout)
        if result.returncode != 0:
            raise PodmanError(
                f"podman {' '.join(args)}: exit {result.returncode}\n{result.stdout[-6000:]}"
            )
        return result.stdout

    def import_debian_base(self, tag: str, release: str = "bookworm") -> None:
        """Makes a minimal Debian `release` with debootstrap from this machine's
        mirror and imports it as `tag`. Its apt sources are this machine's sources of
        that release (updates and security too), and it keeps no package lists or
        downloaded packages, like the Docker Hub image."""
        sources = debian_sources(release, apt_sources())
        rootfs = self.root / "rootfs"
        try:
            result = subprocess.run(
                [
                    system.which("debootstrap") or "debootstrap",
                    "--variant=minbase",
                    release,
                    str(rootfs),
                    sources[0].uri,
                ],
                capture_output=True,
                text=True,
                timeout=900,
                check=False,
            )
            if result.returncode != 0:
                raise PodmanError(
                    f"debootstrap {release} from {sources[0].uri}: exit {result.returncode}\n"
                    f"{result.stdout[-3000:]}{result.stderr[-3000:]}"
                )
            (rootfs / "etc/apt/sources.list").write_text("".join(f"{s.line()}\n" for s in sources))
            for cache in ("var/lib/apt/lists", "var/cache/apt/archives"):
                for path in (rootfs / cache).glob("*"):
                    if path.is_file():
                        path.unlink()
            changes = [arg for change in BASE_IMAGE_CHANGES for arg in ("--change", change)]
            with subprocess.Popen(
                ["tar", "-C", str(rootfs), "--numeric-owner", "-c", "."], stdout=subprocess.PIPE
            ) as tar:
                imported = self.run("import", *changes, "-", tag, timeout=600, stdin=tar.stdout)
            # Leaving the block closed tar's pipe and waited for it.
            if tar.returncode != 0 or imported.returncode != 0:
                raise PodmanError(
                    f"tar | podman import - {tag}: exit {tar.returncode}, "
                    f"{imported.returncode}\n{imported.stdout[-3000:]}"
                )
        finally:
            shutil.rmtree(rootfs, ignore_errors=True)

    def remove(self) -> None:
        """Stops and removes every container and image of this root, then the root."""
        for args in (("rm", "--all", "--force"), ("rmi", "--all", "--force")):
            # A podman that hangs must not keep the directory: it goes all the same.
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.run(*args, timeout=600)
        shutil.rmtree(self.root, ignore_errors=True)
