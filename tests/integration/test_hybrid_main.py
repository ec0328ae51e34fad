"""`horovodrun --gloo -np 2 python main.py`: hybrid-parallel training end to end,
and checkpoints that move between 1 and 2 ranks."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from dataloading.synthetic import generate_split_binary
from dlrm.checkpoint.reader import Checkpoint
from dlrm.distributed.preemption import EXIT_PREEMPTED
from dlrm.embedding.planner.placement import PlannerConfig, plan_sharding
from dlrm.embedding.planner.plan import ShardingPlan
from dlrm.embedding.planner.types import TableSpec
from tests.harness.checkpoints import CROSS_WORLD, assert_close, assert_identical
from tests.harness.processes import REPO, horovodrun, process_env, run

CARDINALITIES = (50, 200, 1000, 30, 5000, 7, 400, 90)
FLAGS = [
    "--batch_size=1024",
    "--optimizer=adagrad",
    "--learning_rate=0.05",
    "--warmup_steps=0",
    "--decay_start_step=0",
    "--embedding_dim=8",
    "--bottom_mlp_dims=32,8",
    "--top_mlp_dims=32,1",
    "--print_freq=10",
    "--evals_per_epoch=0",
    "--data_parallel_threshold=2000",  # a mixed plan: small tables replicated
]


def main_py(ranks: int, *flags: str) -> None:
    command = [sys.executable, "main.py", *FLAGS, *flags]
    if ranks > 1:
        command = [horovodrun(), "--gloo", "-np", str(ranks), "-H", f"localhost:{ranks}", *command]
    result = run(command, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def summary(log: Path) -> dict:
    records = [json.loads(line) for line in log.read_text().splitlines()]
    return [r for r in records if r["event"] == "summary"][-1]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "synthetic"
    generate_split_binary(path, CARDINALITIES, 5, rows={"train": 50_000, "test": 10_000}, seed=3)
    return path


def test_two_ranks_resume_a_one_rank_checkpoint_like_one_rank(
    dataset: Path, tmp_path: Path
) -> None:
    data = f"--dataset_path={dataset}"
    one, mixed = tmp_path / "one", tmp_path / "mixed"
    # 20 steps on one process, then 20 on 2 ranks (at most CROSS_WORLD_STEPS), against
    # 40 on one process.
    main_py(1, data, "--max_steps=40", f"--save_checkpoint_path={one}")
    main_py(1, data, "--max_steps=20", f"--save_checkpoint_path={mixed}")
    # A plan with every kind of placement, given to main.py with --sharding_plan.
    plan = plan_sharding(
        [TableSpec(rows, 8) for rows in CARDINALITIES],
        PlannerConfig(
            world_size=2,
            data_parallel_threshold=2000,
            column_slice_threshold=6000,
            row_slice_threshold=20000,
            global_batch_size=1024,  # the run's --batch_size, which costs a given plan
        ),
    )
    assert {t.kind for t in plan.tables} == {
        "data_parallel",
        "table_wise",
        "column_wise",
        "row_wise",
    }
    plan_file = plan.save(tmp_path / "plan.json")
    # 1 -> 2 ranks: restore the 1-rank checkpoint, reshard, train 20 more steps.
    main_py(
        2,
        data,
        "--max_steps=40",
        f"--save_checkpoint_path={mixed}",
        f"--restore_checkpoint_path={mixed}",
        f"--sharding_plan={plan_file}",
    )
    two_ranks = summary(mixed / "metrics.jsonl")
    assert two_ranks["world_size"] == 2 and two_ranks["steps_this_run"] == 20
    assert two_ranks["auc"] == pytest.approx(summary(one / "metrics.jsonl")["auc"], abs=1e-5)
    written = Checkpoint(mixed / "step_000000040")
    assert written.manifest["world_size"] == 2
    assert written.plan == plan  # the manifest keeps the plan (its shards, once)
    assert ShardingPlan.load(mixed / "sharding_plan.json") == plan  # reusable as is
    assert_close(written, Checkpoint(one / "step_000000040"), **CROSS_WORLD)

    # 2 -> 1: the 2-rank checkpoint evaluates on one process to the same AUC.
    log = tmp_path / "eval.jsonl"
    main_py(1, data, "--mode=eval", f"--restore_checkpoint_path={mixed}", f"--log_path={log}")
    assert summary(log)["auc"] == pytest.approx(two_ranks["auc"], abs=1e-6)
    # ... and exports from one process.
    saved_model = tmp_path / "saved_model"
    main_py(
        1,
        "--mode=export",
        f"--restore_checkpoint_path={mixed}",
        f"--saved_model_output_path={saved_model}",
    )
    assert (saved_model / "saved_model.pb").exists()


def rank_process(rank: int, marker: str) -> psutil.Process:
    """The process of `rank` among those whose command line holds `marker`."""
    for process in psutil.process_iter(["cmdline"]):
        try:
            if marker in " ".join(process.info["cmdline"] or []) and (
                process.environ().get("HOROVOD_RANK") == str(rank)
            ):
                return process
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    raise AssertionError(f"no rank {rank} process running with {marker}")


def logged_steps(log: Path) -> list[int]:
    if not log.exists():
        return []
    lines = log.read_text().splitlines()
    return [json.loads(line)["step"] for line in lines[:-1] if '"event": "train"' in line]


def test_sigterm_to_one_rank_stops_all_at_one_checkpoint_and_resume_ends_like_a_straight_run(
    dataset: Path, tmp_path: Path
) -> None:
    """A scheduler's SIGTERM reaches rank 1 of 3 alone: every rank stops after the
    same step, they write one checkpoint together and exit with the "preempted"
    status; the same command then resumes it (--resume) and ends with the weights
    of the same 3 ranks run straight through, bit for bit. (3 ranks: from 3 on, the
    order of the ranks' sums must not depend on timing, `dlrm.distributed.collectives.packed`.)"""
    ranks, steps = 3, 150  # 65 steps an epoch: the signal lands well before the end
    straight, run_dir = tmp_path / "straight", tmp_path / "run"
    data = f"--dataset_path={dataset}"
    batch = "--batch_size=768"  # divides by 3
    main_py(
        ranks,
        data,
        batch,
        "--epochs=7",
        f"--max_steps={steps}",
        f"--save_checkpoint_path={straight}",
    )
    flags = [
        data,
        batch,
        "--epochs=7",
        f"--max_steps={steps}",
        f"--save_checkpoint_path={run_dir}",
        "--resume",
        "--print_freq=5",
    ]
    command = [horovodrun(), "--gloo", "-np", str(ranks), "-H", f"localhost:{ranks}"]
    command += [sys.executable, "main.py", *FLAGS, *flags]
    launcher = subprocess.Popen(
        command,
        cwd=REPO,
        env=process_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    try:
        deadline = time.monotonic() + 240
        while not logged_steps(run_dir / "metrics.jsonl"):  # the loop runs: handlers are in
            assert launcher.poll() is None and time.monotonic() < deadline, launcher.stdout
            time.sleep(0.05)
        signalled_after = logged_steps(run_dir / "metrics.jsonl")[-1]
        rank_process(1, str(run_dir)).send_signal(signal.SIGTERM)
        output, _ = launcher.communicate(timeout=240)
    finally:
        launcher.kill()
    assert launcher.returncode != 0, output[-3000:]
    # Rank 0 exits first with the status, and horovodrun names it.
    assert f"Exit code: {EXIT_PREEMPTED}" in output, output[-3000:]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    (preempted,) = [r for r in records if r["event"] == "preempted"]
    stop = preempted["step"]
    assert signalled_after < stop < steps
    assert f"stopped at step {stop} by a preemption signal" in output, output[-3000:]
    # One checkpoint, every rank's shards in it: they stopped at the same step.
    written = Checkpoint(run_dir / f"step_{stop:09d}")
    assert written.manifest["world_size"] == ranks and written.step == stop
    assert [p.name for p in run_dir.glob("step_*")] == [written.path.name]

    main_py(ranks, *flags)  # the same command: continues from the checkpoint
    resumed = summary(run_dir / "metrics.jsonl")
    assert resumed["steps"] == steps and resumed["steps_this_run"] == steps - stop
    assert_identical(
        Checkpoint(run_dir / f"step_{steps:09d}"), Checkpoint(straight / f"step_{steps:09d}")
    )
