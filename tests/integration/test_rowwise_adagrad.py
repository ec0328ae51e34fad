"""`--optimizer rowwise_adagrad` under real `horovodrun --gloo` processes: N ranks
train as one process does, and its [rows, 1] accumulators survive a reshard from
2 ranks to 1.

Plans without column-wise tables only: a column shard keeps its own row
accumulators (the mean over its own columns, as TorchRec's column shards do), so
a table split by columns trains differently from the whole table on one process
(tests/unit/test_rowwise_adagrad.py checks a column shard against its own
reference)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dlrm.checkpoint.reader import Checkpoint
from harness.checkpoints import CROSS_WORLD, assert_close
from harness.datasets import dataset_fixture, synthetic_dataset
from harness.models import EIGHT_TABLES, MIXED_PLAN_FLAGS
from harness.processes import main_py
from harness.rank_weights import CARDINALITIES, HOTNESS, assert_ranks_equal_one, hybrid_steps

# Row ranges beside whole tables, and every table replicated (its gradient
# exchanged dense for the smallest tables, sparse for the others).
RUNS = {
    2: ["row_wise_rank:model_parallel", "data_parallel:data_parallel"],
    3: ["row_wise_rank:data_parallel"],
}
REFERENCE = "local:model_parallel:rowwise_adagrad:fp32"

dataset = dataset_fixture(EIGHT_TABLES, 5, {"train": 24_000, "test": 2_000}, seed=3)


@pytest.fixture(scope="module")
def tables(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = synthetic_dataset(
        tmp_path_factory, CARDINALITIES, 3, {"train": 2000}, 4, hotness=HOTNESS
    )
    hybrid_steps(1, path, path / "out_1", [REFERENCE])
    return path


@pytest.mark.parametrize("ranks", list(RUNS))
def test_ranks_equal_one(tables: Path, ranks: int) -> None:
    runs = [f"{run}:rowwise_adagrad:fp32" for run in RUNS[ranks]]
    hybrid_steps(ranks, tables, tables / f"out_{ranks}", runs)
    reference = tables / "out_1" / REFERENCE.replace(":", "_")
    for run in runs:
        kind = run.split(":")[0]
        assert_ranks_equal_one(reference, tables / f"out_{ranks}" / run.replace(":", "_"),
                               ranks, "fp32", kind)  # fmt: skip


def test_two_ranks_state_resumes_on_one_like_a_straight_run(dataset: Path, tmp_path: Path) -> None:
    """10 steps on 2 ranks (row ranges, whole tables, replicated ones), 10 more on
    one process, against 20 on one process."""
    flags = [
        *MIXED_PLAN_FLAGS,
        f"--dataset_path={dataset}",
        "--optimizer=rowwise_adagrad",
        "--row_slice_threshold=20000",  # the 5,000 x 8 table: row ranges on 2 ranks
    ]
    straight, moved = tmp_path / "straight", tmp_path / "moved"
    main_py(1, *flags, "--max_steps=20", f"--save_checkpoint_path={straight}", check=True)
    main_py(2, *flags, "--max_steps=10", f"--save_checkpoint_path={moved}", check=True)
    two_ranks = Checkpoint(moved / "step_000000010")
    assert {s.shard.kind.value for t in two_ranks.tables.values() for s in t.shards} == {
        "data_parallel",
        "table_wise",
        "row_wise",
    }
    assert two_ranks.is_row_wise_slot(4, "accumulator")
    main_py(
        1,
        *flags,
        "--max_steps=20",
        f"--save_checkpoint_path={moved}",
        f"--restore_checkpoint_path={moved}",
        check=True,
    )
    assert_close(Checkpoint(moved / "step_000000020"), Checkpoint(straight / "step_000000020"),
                 **CROSS_WORLD)  # fmt: skip
