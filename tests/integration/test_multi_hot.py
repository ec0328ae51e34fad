"""`python main.py` on a dataset with variable-length multi-hot features, as users
run it: it learns the teacher with mean pooling, its checkpoint records the
pooling (a run that pools otherwise is refused), the export serves ragged ids
like the checkpoint, and `horovodrun --gloo -np 2` trains the weights of one
process."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from dataloading.synthetic import generate_split_binary
from dlrm.checkpoint.reader import Checkpoint
from dlrm.embedding.planner.plan import ShardingPlan
from dlrm.embedding.planner.types import TableSpec
from feature_spec import FeatureSpec
from tests.harness.checkpoints import CROSS_WORLD, assert_close
from tests.harness.processes import horovodrun, run
from tests.integration.scripts.hybrid_steps import table_plan
from tests.integration.test_training import (
    assert_export_serves_like_the_checkpoint,
    records,
)

CARDINALITIES = (50, 200, 1000, 30, 5000, 7, 400, 90)
# Tables 1, 2 and 4: 0 to 6 ids per row (empty rows too); table 6: 3 per row.
HOTNESS = (1, 0, 0, 1, 0, 1, 3, 1)
DIM = 8
FLAGS = [
    "--batch_size=1024",
    "--optimizer=adam",
    "--learning_rate=0.01",
    "--warmup_steps=0",
    "--decay_start_step=0",
    f"--embedding_dim={DIM}",
    "--bottom_mlp_dims=32,8",
    "--top_mlp_dims=32,1",
    "--print_freq=20",
]


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "variable_length"
    generate_split_binary(
        path,
        CARDINALITIES,
        5,
        rows={"train": 80_000, "test": 10_000},
        hotness=HOTNESS,
        max_variable_hotness=6,
        seed=3,
    )
    return path


def main_py(ranks: int, *flags: str) -> tuple[int, str]:
    command = [sys.executable, "main.py", *FLAGS, *flags]
    if ranks > 1:
        command = [horovodrun(), "--gloo", "-np", str(ranks), "-H", f"localhost:{ranks}", *command]
    result = run(command, timeout=400)
    return result.returncode, result.stdout[-3000:] + result.stderr[-3000:]


def test_mean_pooling_learns_the_teacher_and_the_export_serves_ragged_ids(
    dataset: Path, tmp_path: Path
) -> None:
    checkpoints, log = tmp_path / "checkpoints", tmp_path / "log.jsonl"
    code, output = main_py(
        1,
        f"--dataset_path={dataset}",
        "--pooling=mean",
        "--evals_per_epoch=2",
        f"--save_checkpoint_path={checkpoints}",
        f"--log_path={log}",
    )
    assert code == 0, output
    aucs = [r["auc"] for r in records(log) if r["event"] == "eval"]
    assert len(aucs) == 2
    # The teacher averages the effects of a row's ids (its own AUC is about
    # 0.85); untrained, the model scores about 0.5.
    assert aucs[-1] > 0.75, aucs
    manifest = Checkpoint(checkpoints).manifest["model"]
    assert manifest["pooling"] == "mean"
    assert manifest["hotness"] == list(HOTNESS)
    served = assert_export_serves_like_the_checkpoint(checkpoints, dataset, tmp_path, rows=300)
    assert float(served.std()) > 0.05
    # Restoring it into a model that sums the rows is refused, naming the field.
    code, output = main_py(
        1,
        f"--dataset_path={dataset}",
        "--max_steps=1",
        f"--restore_checkpoint_path={checkpoints}",
    )
    assert code == 1
    assert "pooling: checkpoint 'mean', this run 'sum'" in output


# The placement test's flags, for the one-process reference and the 2-rank runs
# (steps: at most `CROSS_WORLD_STEPS`).
PLACEMENT_FLAGS = [
    "--pooling=sum,mean,mean,sum,mean,sum,mean,sum",
    "--max_steps=20",
    "--evals_per_epoch=0",
]


@pytest.fixture(scope="module")
def one_process(dataset: Path, tmp_path_factory: pytest.TempPathFactory) -> Checkpoint:
    """What the 2-rank runs of both input modes are compared with, run once."""
    one = tmp_path_factory.mktemp("one_process") / "run"
    code, output = main_py(
        1,
        f"--dataset_path={dataset}",
        *PLACEMENT_FLAGS,
        f"--save_checkpoint_path={one}",
    )
    assert code == 0, output
    return Checkpoint(one)


@pytest.mark.parametrize("input_mode", ["model_parallel", "data_parallel"])
def test_two_ranks_train_variable_length_tables_like_one(
    dataset: Path, one_process: Checkpoint, tmp_path: Path, input_mode: str
) -> None:
    """Per-table pooling and a plan that places the variable-length tables each
    another way (table 1 whole on rank 1, table 2 column-wise, table 4
    row-wise), through main.py; the plan is checked against the tables with the
    planner's estimate of their ids per row."""
    spec = FeatureSpec.load(dataset)
    assert [f.is_variable_length for f in spec.categorical_features] == [h == 0 for h in HOTNESS]
    kinds = {1: "table_wise", 2: "column_wise", 4: "row_wise"}
    specs = [TableSpec(rows, DIM, h or 3) for rows, h in zip(CARDINALITIES, HOTNESS, strict=True)]
    plan = ShardingPlan(
        2,
        "basic",
        tuple(
            table_plan(t, s, kinds.get(t, "data_parallel"), 2, rank=1) for t, s in enumerate(specs)
        ),
        global_batch_size=1024,
    )
    plan_path = plan.save(tmp_path / "plan.json")
    two = tmp_path / "two"
    code, output = main_py(
        2,
        f"--dataset_path={dataset}",
        *PLACEMENT_FLAGS,
        f"--save_checkpoint_path={two}",
        f"--input_mode={input_mode}",
        f"--sharding_plan={plan_path}",
    )
    assert code == 0, output
    assert_close(Checkpoint(two), one_process, **CROSS_WORLD)
