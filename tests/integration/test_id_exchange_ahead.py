"""`--input_mode data_parallel` under real `horovodrun --gloo` processes: with
`--exchange_ids_ahead` (the default) each step's ids cross between the ranks
during the step before it, and the run writes, bit for bit, the checkpoints of a
run whose steps exchange their own ids (`--noexchange_ids_ahead`), on 2 and 3
ranks, across an epoch's end, an evaluation and checkpoints, and a `--max_steps`
that stops mid-epoch."""

from __future__ import annotations

from pathlib import Path

import pytest

from dlrm.app.records import last_record
from dlrm.checkpoint.reader import Checkpoint
from harness.checkpoints import assert_identical, checkpoint_steps
from harness.datasets import dataset_fixture
from harness.models import EIGHT_TABLES, MIXED_PLAN_FLAGS
from harness.processes import main_py

BATCH = 192  # divides by 2 and 3
EPOCH_STEPS = 3
MAX_STEPS = 5  # the second epoch stops after 2 of its 3 steps
# Some tables multi-hot, one of them replicated (rows <= 2,000 / 8).
HOTNESS = (1, 3, 1, 2, 1, 1, 4, 1)

dataset = dataset_fixture(
    EIGHT_TABLES,
    5,
    {"train": BATCH * EPOCH_STEPS, "test": 2 * BATCH},
    seed=4,
    hotness=HOTNESS,
)


def train(ranks: int, dataset: Path, out: Path, *flags: str) -> dict[str, object]:
    main_py(
        ranks,
        *MIXED_PLAN_FLAGS,
        f"--dataset_path={dataset}",
        f"--batch_size={BATCH}",
        "--input_mode=data_parallel",
        f"--max_steps={MAX_STEPS}",
        "--epochs=2",
        "--evals_per_epoch=1",
        "--checkpoint_every_steps=2",
        "--keep_checkpoints=5",
        f"--save_checkpoint_path={out}",
        *flags,
        check=True,
    )
    return last_record(out / "metrics.jsonl", "summary")


@pytest.mark.parametrize("ranks", [2, 3])
def test_ids_exchanged_a_step_ahead_write_the_checkpoints_of_steps_exchanging_their_own(
    dataset: Path, tmp_path: Path, ranks: int
) -> None:
    ahead = train(ranks, dataset, tmp_path / "ahead")
    own = train(ranks, dataset, tmp_path / "own", "--noexchange_ids_ahead")
    # Each epoch's first step exchanges its ids alone; every other step's crossed
    # during the step before (none past --max_steps).
    assert ahead["ids_exchanged_ahead"] == MAX_STEPS - 2
    assert own["ids_exchanged_ahead"] == 0
    assert ahead["auc"] == own["auc"]
    steps = checkpoint_steps(tmp_path / "own")
    # After steps 2 and 4, at the evaluation after step 3 (the epoch's end), and
    # at the last step.
    assert steps == [2, 3, 4, 5]
    assert checkpoint_steps(tmp_path / "ahead") == steps
    for step in steps:
        name = f"step_{step:09d}"
        assert_identical(Checkpoint(tmp_path / "ahead" / name), Checkpoint(tmp_path / "own" / name))
