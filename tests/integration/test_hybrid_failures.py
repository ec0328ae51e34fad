"""Failures under `horovodrun --gloo -np 2`: every rank stops with a clear error,
within a bounded time, and never hangs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dataloading.synthetic import generate_split_binary
from dlrm.embedding.planner import PlannerConfig, TableSpec, plan_sharding
from tests.integration.conftest import REPO, horovodrun, process_env, run

CARDINALITIES = (40, 300, 7, 1000)
DIM = 8
MODEL = [
    "--optimizer=adagrad",
    "--learning_rate=0.05",
    "--warmup_steps=0",
    "--decay_start_step=0",
    f"--embedding_dim={DIM}",
    f"--bottom_mlp_dims=16,{DIM}",
    "--top_mlp_dims=16,1",
    "--evals_per_epoch=0",
]
# A surviving rank must be gone this long after its peer was killed.
EXIT_LIMIT_S = 60


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "synthetic"
    generate_split_binary(path, CARDINALITIES, 4, rows={"train": 200_000, "test": 2_000}, seed=5)
    return path


def two_ranks(*args: str) -> list[str]:
    return [horovodrun(), "--gloo", "-np", "2", "-H", "localhost:2", sys.executable, *args]


def test_batch_that_does_not_divide_stops_every_rank(dataset: Path) -> None:
    result = run(
        two_ranks("main.py", f"--dataset_path={dataset}", "--batch_size=1025", *MODEL),
        timeout=120,
    )
    assert result.returncode != 0
    output = result.stdout + result.stderr
    message = (
        "--batch_size: the global batch must divide by the number of ranks (2); "
        "got 1025 = 512 * 2 + 1"
    )
    assert output.count(message) == 2, output[-3000:]  # said by both ranks


def test_plan_for_another_world_size_is_refused(dataset: Path, tmp_path: Path) -> None:
    tables = [TableSpec(rows, DIM) for rows in CARDINALITIES]
    plan_file = tmp_path / "plan.json"
    plan_sharding(tables, PlannerConfig(world_size=3)).save(plan_file)
    result = run(
        two_ranks(
            "main.py",
            f"--dataset_path={dataset}",
            "--batch_size=1024",
            f"--sharding_plan={plan_file}",
            *MODEL,
        ),
        timeout=120,
    )
    assert result.returncode != 0
    output = result.stdout + result.stderr
    message = f"--sharding_plan {plan_file}: the sharding plan is for 3 ranks, this run has 2"
    assert output.count(message) == 2, output[-3000:]


def rank_processes(rank: int, marker: str) -> list[int]:
    """Pids of processes with HOROVOD_RANK=`rank` whose command line has `marker`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:  # gone, or not ours to read
            continue
        if marker in command and f"HOROVOD_RANK={rank}".encode() in environ:
            pids.append(int(entry.name))
    return pids


def test_a_killed_rank_makes_the_other_exit(dataset: Path, tmp_path: Path) -> None:
    output = tmp_path / "run"
    log = tmp_path / "horovodrun.log"
    command = two_ranks(
        "main.py",
        f"--dataset_path={dataset}",
        "--batch_size=256",
        "--print_freq=1",
        f"--save_checkpoint_path={output}",
        *MODEL,
    )
    with log.open("w") as sink:
        launcher = subprocess.Popen(
            command, cwd=REPO, env=process_env(), stdout=sink, stderr=subprocess.STDOUT
        )
        try:
            # Wait until both ranks are training: rank 0 has logged a few steps.
            metrics = output / "metrics.jsonl"
            deadline = time.monotonic() + 180
            while time.monotonic() < deadline and launcher.poll() is None:
                if metrics.exists():
                    events = [json.loads(x)["event"] for x in metrics.read_text().splitlines()]
                    if events.count("train") >= 3:
                        break
                time.sleep(0.5)
            else:
                pytest.fail(f"training did not start; log:\n{log.read_text()[-3000:]}")
            survivors = rank_processes(0, str(output))
            victims = rank_processes(1, str(output))
            assert len(survivors) == 1 and len(victims) == 1, (survivors, victims)
            os.kill(victims[0], signal.SIGKILL)
            killed_at = time.monotonic()
            returncode = launcher.wait(timeout=EXIT_LIMIT_S)
            elapsed = time.monotonic() - killed_at
        finally:
            if launcher.poll() is None:
                launcher.kill()
                launcher.wait()
    print(f"horovodrun exited {returncode} {elapsed:.1f} s after rank 1 was killed")
    assert returncode != 0, log.read_text()[-3000:]
    assert elapsed < EXIT_LIMIT_S
    # The surviving rank is gone too, not left hanging in a collective.
    assert not Path(f"/proc/{survivors[0]}").exists() or _is_zombie(survivors[0])
    # Rank 0 never reported success.
    events = [json.loads(x)["event"] for x in (output / "metrics.jsonl").read_text().splitlines()]
    assert "summary" not in events


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True
