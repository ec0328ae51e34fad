"""`python main.py` on a dataset with variable-length multi-hot features, as users
run it: it learns the teacher with mean pooling, its checkpoint records the
pooling (a run that pools otherwise is refused), the export serves ragged ids
like the checkpoint, and `horovodrun --gloo -np 2` trains the weights of one
process."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from dlrm.app.records import read_records
from dlrm.checkpoint.reader import Checkpoint
from dlrm.embedding.planner.plan import ShardingPlan
from dlrm.embedding.planner.types import TableSpec
from feature_spec import FeatureSpec
from harness.checkpoints import CROSS_WORLD, assert_close
from harness.datasets import dataset_fixture
from harness.export import assert_export_serves_like_the_checkpoint
from harness.models import ADAM_FLAGS, EIGHT_TABLES
from harness.placements import table_plan
from harness.processes import main_py, output_tail

# Tables 1, 2 and 4: 0 to 6 ids per row (empty rows too); table 6: 3 per row.
HOTNESS = (1, 0, 0, 1, 0, 1, 3, 1)
DIM = 8


dataset = dataset_fixture(
    EIGHT_TABLES,
    5,
    {"train": 80_000, "test": 10_000},
    seed=3,
    hotness=HOTNESS,
    max_variable_hotness=6,
)


def train(ranks: int, *flags: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    """main.py of `ADAM_FLAGS`, then `flags`, on `ranks` ranks (with `check`, it must succeed)."""
    return main_py(ranks, *ADAM_FLAGS, *flags, timeout=400, check=check)


def test_mean_pooling_learns_the_teacher_and_the_export_serves_ragged_ids(
    dataset: Path, tmp_path: Path
) -> None:
    checkpoints, log = tmp_path / "checkpoints", tmp_path / "log.jsonl"
    train(
        1,
        f"--dataset_path={dataset}",
        "--pooling=mean",
        "--evals_per_epoch=2",
        f"--save_checkpoint_path={checkpoints}",
        f"--log_path={log}",
    )
    aucs = [r["auc"] for r in read_records(log, "eval")]
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
    result = train(
        1,
        f"--dataset_path={dataset}",
        "--max_steps=1",
        f"--restore_checkpoint_path={checkpoints}",
        check=False,
    )
    assert result.returncode == 1
    assert "pooling: checkpoint 'mean', this run 'sum'" in output_tail(result)


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
    train(
        1,
        f"--dataset_path={dataset}",
        *PLACEMENT_FLAGS,
        f"--save_checkpoint_path={one}",
    )
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
    specs = [TableSpec(rows, DIM, h or 3) for rows, h in zip(EIGHT_TABLES, HOTNESS, strict=True)]
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
    train(
        2,
        f"--dataset_path={dataset}",
        *PLACEMENT_FLAGS,
        f"--save_checkpoint_path={two}",
        f"--input_mode={input_mode}",
        f"--sharding_plan={plan_path}",
    )
    assert_close(Checkpoint(two), one_process, **CROSS_WORLD)
