"""What the clusters of the harness (`netns`, `slurm`, `podman`) need from this
machine: programs, found also where a non-login PATH does not look (/usr/sbin), and
installed with apt-get when missing. Each cluster's `install_reason` says whether
it can run here; a test skips, saying why, when it cannot."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path


class InstallError(RuntimeError):
    """apt-get was possible but failed, or did not bring the programs (never a skip)."""


def which(program: str) -> str | None:
    """The path of `program` (a name, or a path that exists), also in /usr/sbin and /sbin."""
    if Path(program).is_absolute():
        return program if Path(program).exists() else None
    return shutil.which(program, path=os.environ.get("PATH", "") + os.pathsep + "/usr/sbin:/sbin")


def missing_programs(programs: Sequence[str]) -> list[str]:
    return [program for program in programs if which(program) is None]


def install_missing(packages: Mapping[str, str]) -> str | None:
    """Installs with apt-get the packages (`packages`: program -> Debian package) whose
    program is missing, as root or with password-less sudo.

    Returns:
        None when every program is there (now); otherwise why they cannot be
        installed, for a test skip.

    Raises:
        InstallError: apt-get was possible but failed.
    """
    missing = missing_programs(list(packages))
    if not missing:
        return None
    names = sorted({packages[program] for program in missing})
    if os.geteuid() == 0:
        prefix: list[str] = []
    elif shutil.which("sudo") and _succeeds(["sudo", "-n", "true"]):
        prefix = ["sudo", "-n"]
    else:
        return (
            f"{', '.join(missing)} missing, and this user can neither apt-get as root nor "
            f"sudo: run `apt-get install {' '.join(names)}`"
        )
    if which("apt-get") is None:
        raise InstallError(f"{', '.join(missing)} missing and no apt-get here")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    # Waits for a concurrent apt/dpkg (another test worker's, `make install`) instead
    # of failing at once; the package lists of a fresh machine may be empty or stale.
    apt_get = [*prefix, "apt-get", "-o", "DPkg::Lock::Timeout=600"]
    install = ["install", "-y", "-qq", "--no-install-recommends", *names]
    for command in ([*apt_get, "update", "-qq"], [*apt_get, *install]):
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=900)
        if result.returncode != 0:
            raise InstallError(
                f"{' '.join(command)} failed (exit {result.returncode}):\n"
                f"{result.stdout[-2000:]}{result.stderr[-2000:]}"
            )
    still = missing_programs(list(packages))
    if still:
        raise InstallError(f"installed {names} but {still} still missing")
    return None


def _succeeds(command: Sequence[str]) -> bool:
    return subprocess.run(command, capture_output=True).returncode == 0
