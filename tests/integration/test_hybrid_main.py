"""`horovodrun --gloo -np 2 python main.py`: hybrid-parallel training end to end,
and checkpoints that move between 1 and 2 ranks."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from dataloading.synthetic import generate_split_binary
from dlrm.checkpoint import Checkpoint
from dlrm.embedding.planner import PlannerConfig, ShardingPlan, TableSpec, plan_sharding
from tests.integration.conftest import horovodrun, run

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


def assert_same_checkpoint(a: Checkpoint, b: Checkpoint) -> None:
    for name, value in a.dense().items():
        np.testing.assert_allclose(b.dense()[name], value, rtol=2e-5, atol=1e-6, err_msg=name)
    for table, rows in enumerate(CARDINALITIES):
        for slot in (None, "accumulator"):
            np.testing.assert_allclose(
                b.read_table_slice(table, (0, rows), (0, 8), slot),
                a.read_table_slice(table, (0, rows), (0, 8), slot),
                rtol=2e-5,
                atol=1e-6,
            )


def test_two_ranks_resume_a_one_rank_checkpoint_like_one_rank(
    dataset: Path, tmp_path: Path
) -> None:
    data = f"--dataset_path={dataset}"
    one, mixed = tmp_path / "one", tmp_path / "mixed"
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
    assert_same_checkpoint(Checkpoint(one / "step_000000040"), written)

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
