"""`horovodrun --gloo -np 2 python main.py`: hybrid-parallel training end to end,
and checkpoints that move between 1 and 2 ranks."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest

from dlrm.app.records import last_record, read_records
from dlrm.checkpoint.reader import Checkpoint
from dlrm.distributed.preemption import EXIT_PREEMPTED
from dlrm.embedding.planner.placement import PlannerConfig, plan_sharding
from dlrm.embedding.planner.plan import ShardingPlan
from dlrm.embedding.planner.types import TableSpec
from harness.checkpoints import CROSS_WORLD, assert_close, assert_identical
from harness.datasets import dataset_fixture
from harness.models import EIGHT_TABLES, MIXED_PLAN_FLAGS
from harness.processes import (
    main_py,
    main_py_command,
    rank_pids,
    started,
    wait_for,
)

dataset = dataset_fixture(EIGHT_TABLES, 5, {"train": 50_000, "test": 10_000}, seed=3)


def train(ranks: int, *flags: str) -> None:
    """main.py of `MIXED_PLAN_FLAGS`, then `flags`, on `ranks` ranks; it must succeed."""
    main_py(ranks, *MIXED_PLAN_FLAGS, *flags, check=True)


def test_two_ranks_resume_a_one_rank_checkpoint_like_one_rank(
    dataset: Path, tmp_path: Path
) -> None:
    data = f"--dataset_path={dataset}"
    one, mixed = tmp_path / "one", tmp_path / "mixed"
    # 20 steps on one process, then 20 on 2 ranks (at most CROSS_WORLD_STEPS), against
    # 40 on one process: the 2 ranks start from that run's checkpoint of step 20 (a
    # run of 20 steps would write the same).
    train(1, data, "--max_steps=40", "--checkpoint_every_steps=20", f"--save_checkpoint_path={one}")
    assert Checkpoint(one / "step_000000020").step == 20
    # A plan with every kind of placement, given to main.py with --sharding_plan.
    plan = plan_sharding(
        [TableSpec(rows, 8) for rows in EIGHT_TABLES],
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
    train(
        2,
        data,
        "--max_steps=40",
        f"--save_checkpoint_path={mixed}",
        f"--restore_checkpoint_path={one / 'step_000000020'}",
        f"--sharding_plan={plan_file}",
    )
    two_ranks = last_record(mixed / "metrics.jsonl", "summary")
    assert two_ranks["world_size"] == 2 and two_ranks["steps_this_run"] == 20
    assert two_ranks["auc"] == pytest.approx(
        last_record(one / "metrics.jsonl", "summary")["auc"], abs=1e-5
    )
    written = Checkpoint(mixed / "step_000000040")
    assert written.manifest["world_size"] == 2
    assert written.plan == plan  # the manifest keeps the plan (its shards, once)
    assert ShardingPlan.load(mixed / "sharding_plan.json") == plan  # reusable as is
    assert_close(written, Checkpoint(one / "step_000000040"), **CROSS_WORLD)

    # 2 -> 1: the 2-rank checkpoint evaluates on one process to the same AUC.
    log = tmp_path / "eval.jsonl"
    train(1, data, "--mode=eval", f"--restore_checkpoint_path={mixed}", f"--log_path={log}")
    assert last_record(log, "summary")["auc"] == pytest.approx(two_ranks["auc"], abs=1e-6)
    # ... and exports from one process.
    saved_model = tmp_path / "saved_model"
    train(
        1,
        "--mode=export",
        f"--restore_checkpoint_path={mixed}",
        f"--saved_model_output_path={saved_model}",
    )
    assert (saved_model / "saved_model.pb").exists()


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
    train(
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
    log, metrics = tmp_path / "horovodrun.log", run_dir / "metrics.jsonl"
    with started(main_py_command(ranks, *MIXED_PLAN_FLAGS, *flags), log) as launcher:
        # A step logged: the loop runs, its signal handlers are in.
        trained = wait_for(lambda: read_records(metrics, "train"), launcher, 240, log)
        signalled_after = trained[-1]["step"]
        victims = rank_pids(1, str(run_dir))
        assert victims, f"no rank 1 process running with {run_dir}"
        os.kill(victims[0], signal.SIGTERM)
        launcher.wait(timeout=240)
    output = log.read_text()
    assert launcher.returncode != 0, output[-3000:]
    # Rank 0 exits first with the status, and horovodrun names it.
    assert f"Exit code: {EXIT_PREEMPTED}" in output, output[-3000:]
    (preempted,) = read_records(run_dir / "metrics.jsonl", "preempted")
    stop = preempted["step"]
    assert signalled_after < stop < steps
    assert f"stopped at step {stop} by a preemption signal" in output, output[-3000:]
    # One checkpoint, every rank's shards in it: they stopped at the same step.
    written = Checkpoint(run_dir / f"step_{stop:09d}")
    assert written.manifest["world_size"] == ranks and written.step == stop
    assert [p.name for p in run_dir.glob("step_*")] == [written.path.name]

    train(ranks, *flags)  # the same command: continues from the checkpoint
    resumed = last_record(run_dir / "metrics.jsonl", "summary")
    assert resumed["steps"] == steps and resumed["steps_this_run"] == steps - stop
    assert_identical(
        Checkpoint(run_dir / f"step_{steps:09d}"), Checkpoint(straight / f"step_{steps:09d}")
    )
