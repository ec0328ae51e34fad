"""`--optimizer rowwise_adagrad` under real `horovodrun --gloo` processes: its
[rows, 1] accumulators survive a reshard from 2 ranks to 1. (That N ranks train as
one process does is checked in test_hybrid_parallel.py, whose launches its runs
share.)

Plans without column-wise tables only: a column shard keeps its own row
accumulators (the mean over its own columns, as TorchRec's column shards do), so
a table split by columns trains differently from the whole table on one process
(tests/unit/test_rowwise_adagrad.py checks a column shard against its own
reference)."""

from __future__ import annotations

from pathlib import Path

from dlrm.checkpoint.reader import Checkpoint
from harness.checkpoints import CROSS_WORLD, assert_close
from harness.datasets import dataset_fixture
from harness.models import EIGHT_TABLES, MIXED_PLAN_FLAGS
from harness.processes import main_py

dataset = dataset_fixture(EIGHT_TABLES, 5, {"train": 24_000, "test": 2_000}, seed=3)


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
