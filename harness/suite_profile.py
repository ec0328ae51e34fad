"""Where the suite's time goes: a pytest plugin that records, per test, its wall
seconds, the CPU-seconds of the worker and every process it started, and how many
processes it started.

Enabled by `-p harness.suite_profile` with `SUITE_PROFILE_DIR=DIR`; each pytest
process (each xdist worker) writes `DIR/<worker>.jsonl`, one record per test phase
(setup, call, teardown), so a module fixture's cost lands on the test that set it
up. `python -m harness.suite_profile DIR` sums the records per file.

CPU comes from a cpuacct cgroup (v1) of the worker's own, which every process the
test starts inherits, daemons (Slurm's, Spark's) and grandchildren included, whether
or not anyone waits for them. Processes are counted by polling the cgroup's member
list every 0.2 s: a process that lives under 0.2 s may be missed, but a process
that imports TensorFlow lives seconds. Without cgroup v1 (or root) CPU falls back
to the worker's own time and its reaped children's (getrusage).
"""

from __future__ import annotations

import json
import os
import resource
import sys
import threading
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

CPUACCT = Path("/sys/fs/cgroup/cpuacct")
POLL_S = 0.2


class _Cgroup:
    """The worker's own cpuacct cgroup, or None where it cannot be made."""

    def __init__(self, name: str) -> None:
        self.path: Path | None = None
        directory = CPUACCT / name
        try:
            directory.mkdir(exist_ok=True)
            (directory / "cgroup.procs").write_text(str(os.getpid()))
            self.path = directory
        except OSError:
            self.path = None

    def cpu_seconds(self) -> float:
        if self.path is None:
            own = resource.getrusage(resource.RUSAGE_SELF)
            children = resource.getrusage(resource.RUSAGE_CHILDREN)
            return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime
        return int((self.path / "cpuacct.usage").read_text()) / 1e9

    def members(self) -> list[int]:
        if self.path is not None:
            text = (self.path / "cgroup.procs").read_text()
            return [int(pid) for pid in text.split()]
        return _descendants(os.getpid())


def _descendants(root: int) -> list[int]:
    children: dict[int, list[int]] = defaultdict(list)
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                stat = Path(f"/proc/{entry}/stat").read_text()
            except OSError:
                continue
            parent = int(stat.rsplit(")", 1)[1].split()[1])
            children[parent].append(int(entry))
    found, stack = [], [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.append(child)
            stack.append(child)
    return found


def _identity(pid: int) -> tuple[tuple[int, int], str] | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return None
    start = int(stat.rsplit(")", 1)[1].split()[19])
    return (pid, start), command.strip()


class _Watcher:
    """Polls the cgroup and keeps every process seen, by (pid, start time)."""

    def __init__(self, cgroup: _Cgroup) -> None:
        self.cgroup = cgroup
        self.seen: dict[tuple[int, int], str] = {}
        self.lock = threading.Lock()
        self.worker = os.getpid()
        thread = threading.Thread(target=self._run, daemon=True, name="suite-profile")
        thread.start()

    def _run(self) -> None:
        while True:
            try:
                pids = self.cgroup.members()
            except OSError:
                pids = []
            for pid in pids:
                if pid == self.worker:
                    continue
                found = _identity(pid)
                if found is not None:
                    with self.lock:
                        self.seen.setdefault(found[0], found[1])
            time.sleep(POLL_S)

    def take(self) -> dict[tuple[int, int], str]:
        with self.lock:
            taken, self.seen = self.seen, {}
        return taken


def _kind(command: str) -> str:
    if "horovodrun" in command:
        return "horovodrun"
    if "python" in command:
        return "python"
    return "other"


class SuiteProfile:
    def __init__(self, directory: Path) -> None:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
        directory.mkdir(parents=True, exist_ok=True)
        self.out = (directory / f"{worker}.jsonl").open("a", buffering=1)
        self.cgroup = _Cgroup(f"suite-profile-{os.getpid()}")
        self.watcher = _Watcher(self.cgroup)

    def record(self, nodeid: str, phase: str, wall: float, cpu: float) -> None:
        counts: dict[str, int] = defaultdict(int)
        for command in self.watcher.take().values():
            counts[_kind(command)] += 1
        self.out.write(
            json.dumps(
                {
                    "nodeid": nodeid,
                    "phase": phase,
                    "wall_s": round(wall, 3),
                    "cpu_s": round(cpu, 3),
                    "processes": dict(counts),
                    "end": round(time.time(), 3),
                }
            )
            + "\n"
        )


_profile: SuiteProfile | None = None


def pytest_configure(config: Any) -> None:
    global _profile
    directory = os.environ.get("SUITE_PROFILE_DIR")
    if directory:
        _profile = SuiteProfile(Path(directory))


def pytest_unconfigure(config: Any) -> None:
    if _profile is not None and _profile.cgroup.path is not None:
        try:  # back to the root group, then drop the worker's (fails while a daemon lives)
            (CPUACCT / "cgroup.procs").write_text(str(os.getpid()))
            _profile.cgroup.path.rmdir()
        except OSError:
            pass


def _measure(nodeid: str, phase: str) -> Any:
    profile = _profile
    start_wall, start_cpu = time.monotonic(), profile.cgroup.cpu_seconds() if profile else 0.0

    def done() -> None:
        if profile is not None:
            profile.record(
                nodeid,
                phase,
                time.monotonic() - start_wall,
                profile.cgroup.cpu_seconds() - start_cpu,
            )

    return done


def _hook(phase: str) -> Any:
    import pytest

    @pytest.hookimpl(hookwrapper=True)
    def hook(item: Any, *args: Any, **kwargs: Any) -> Any:
        done = _measure(item.nodeid, phase) if _profile else None
        yield
        if done is not None:
            done()

    return hook


pytest_runtest_setup = _hook("setup")
pytest_runtest_call = _hook("call")
pytest_runtest_teardown = _hook("teardown")


def summarise(directory: Path, top: int = 60) -> str:
    """Per file: wall, CPU, CPU/wall, processes started, tests; slowest first."""
    files: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    for path in sorted(directory.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            entry = files[row["nodeid"].split("::")[0]]
            entry["wall_s"] += row["wall_s"]
            entry["cpu_s"] += row["cpu_s"]
            entry["tests"] += row["phase"] == "call"
            for kind, count in row["processes"].items():
                entry[kind] += count
    lines = [
        f"{'file':58} {'wall s':>8} {'cpu s':>8} {'cpu/wall':>8} {'python':>6} "
        f"{'hvdrun':>6} {'other':>6} {'tests':>5}"
    ]
    total: dict[str, float] = defaultdict(float)
    for name, entry in sorted(files.items(), key=lambda kv: -kv[1]["wall_s"]):
        for key, value in entry.items():
            total[key] += value
        if len(lines) <= top:
            lines.append(_line(name, entry))
    lines.append(_line("total", total))
    return "\n".join(lines)


def _line(name: str, entry: dict[str, float]) -> str:
    wall = entry["wall_s"]
    ratio = entry["cpu_s"] / wall if wall else 0.0
    return (
        f"{name:58} {wall:8.1f} {entry['cpu_s']:8.1f} {ratio:8.2f} "
        f"{int(entry['python']):6d} {int(entry['horovodrun']):6d} "
        f"{int(entry['other']):6d} {int(entry['tests']):5d}"
    )


if __name__ == "__main__":
    print(summarise(Path(sys.argv[1])))
