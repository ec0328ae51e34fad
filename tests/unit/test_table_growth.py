"""Tables that grow on restore: a checkpoint trained on one day's dataset restored on
the next day's, whose vocabulary extends it (more rows per table). Old rows and
their optimizer slots come back bit for bit, new rows are what a new model would
have, on 1 rank and on 2 (simulated) ranks, where a table changes sharding kind as
it grows; and what must not happen (shrinking, unrelated vocabularies) stops with
an error naming the table and both sizes."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from dataloading.errors import DatasetError
from dataloading.synthetic import generate_split_binary
from dlrm.app.assembly import AssembledRun
from dlrm.app.config import ConfigError
from dlrm.app.modes.training import train
from dlrm.app.records import read_records
from dlrm.app.restore import open_checkpoint
from dlrm.checkpoint.format import CheckpointError, list_checkpoints
from dlrm.checkpoint.reader import Checkpoint
from dlrm.embedding.base import read_rows
from dlrm.embedding.initializer import initial_table_values
from dlrm.embedding.shard import ShardingKind
from dlrm.train.state import restore_training_state
from feature_spec.vocabulary import METADATA_KEY, VocabularyLineage
from harness.assembly import SMALL_MODEL, assembled_run, small_config
from harness.datasets import SMALL_TABLES
from harness.simulated_ranks import SimulatedCollectives, run_ranks

DIM = SMALL_MODEL["embedding_dim"]
BATCH = SMALL_MODEL["batch_size"]
OLD = SMALL_TABLES
# Table 3 crosses the data-parallel threshold below as it grows (780 -> 1,080 elements).
NEW = (31, 7, 11, 180, 9)
THRESHOLD = 1000
SEED = SMALL_MODEL["seed"]


def dataset(root: Path, name: str, cardinalities: tuple[int, ...], **lineage: Any) -> Path:
    """A synthetic dataset whose spec records `lineage` (none when not given)."""
    path = root / name
    generate_split_binary(path, cardinalities, 3, rows={"train": 6 * BATCH, "test": 100}, seed=4)
    if lineage:
        spec_file = path / "feature_spec.yaml"
        raw = yaml.safe_load(spec_file.read_text())
        raw.setdefault("metadata", {})[METADATA_KEY] = VocabularyLineage(**lineage).to_metadata()
        spec_file.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path


@pytest.fixture(scope="module")
def days(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("days")
    return {
        "day1": dataset(root, "day1", OLD, id="aaaa"),
        "day2": dataset(root, "day2", NEW, id="bbbb", extends=("aaaa",)),
        "unrelated": dataset(root, "unrelated", NEW, id="cccc"),
        "no_lineage": dataset(root, "no_lineage", NEW),
    }


# The small model (Adagrad: a slot per table row) for 4 steps, the tables of at most
# THRESHOLD elements replicated.
GROWTH = {"max_steps": 4, "evals_per_epoch": 0, "data_parallel_threshold": THRESHOLD}


def assembled(
    data: Path, collectives: Any = None, log_path: Path | None = None, **overrides: Any
) -> AssembledRun:
    return assembled_run(data, collectives, log_path, **{**GROWTH, **overrides})


@pytest.fixture(scope="module")
def day1_checkpoint(days: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("day1_run")
    train(assembled(days["day1"], save_checkpoint_path=str(root)))
    return list_checkpoints(root)[-1]


def tables_and_slots(s: AssembledRun) -> dict[tuple[int, str | None], dict[Any, np.ndarray]]:
    """(table, slot or None) -> {shard: its values} of this rank."""
    assert s.trainer is not None
    out: dict[tuple[int, str | None], dict[Any, np.ndarray]] = {}
    for shard, variable in s.model.embeddings.local_shards():
        rows = shard.rows[1] - shard.rows[0]
        out.setdefault((shard.table, None), {})[shard] = read_rows(variable, 0, rows)
        for slot, value in s.trainer.optimizer.slots(variable).items():
            out.setdefault((shard.table, slot), {})[shard] = read_rows(value, 0, rows)
    return out


def restored(s: AssembledRun, path: Path) -> AssembledRun:
    assert s.trainer is not None
    restore_training_state(s.trainer, open_checkpoint(s, str(path)))
    return s


def assert_grown(
    s: AssembledRun, fresh: AssembledRun, checkpoint: Checkpoint, rank: str = "one process"
) -> None:
    """Each local shard: rows the checkpoint has equal it bit for bit, the others
    equal a new model's (initial values, initial slots)."""
    new_values = tables_and_slots(fresh)
    for (table, slot), shards in tables_and_slots(s).items():
        old_rows = OLD[table]
        for shard, values in shards.items():
            r0, r1 = shard.rows
            kept = max(0, min(r1, old_rows) - r0)
            what = f"{rank}: {shard.name} {slot or 'weights'}"
            if kept:
                saved = checkpoint.read_table_slice(table, (r0, r0 + kept), shard.columns, slot)
                np.testing.assert_array_equal(values[:kept], saved, err_msg=what)
            expected_new = new_values[(table, slot)][shard][kept:]
            np.testing.assert_array_equal(values[kept:], expected_new, err_msg=what)
            if slot is None and r1 > old_rows:  # the new rows are the initializer's
                init = initial_table_values(
                    table, NEW[table], DIM, SEED, (max(r0, old_rows), r1), shard.columns
                )
                np.testing.assert_array_equal(values[kept:], init, err_msg=what)


def test_old_rows_and_slots_come_back_and_new_rows_start_as_a_new_model(
    days: dict[str, Path], day1_checkpoint: Path
) -> None:
    checkpoint = Checkpoint(day1_checkpoint)
    assert checkpoint.step == 4
    s = restored(assembled(days["day2"]), day1_checkpoint)
    assert_grown(s, assembled(days["day2"]), checkpoint)
    # Trained rows differ from their initial values: the comparison above has teeth.
    trained = checkpoint.read_table_slice(0, (0, OLD[0]), (0, DIM), None)
    assert not np.array_equal(trained, initial_table_values(0, OLD[0], DIM, SEED))


def test_growth_on_two_ranks_where_a_table_changes_sharding_kind(
    days: dict[str, Path], day1_checkpoint: Path
) -> None:
    checkpoint = Checkpoint(day1_checkpoint)

    def rank(collectives: SimulatedCollectives) -> Any:
        s = assembled(days["day2"], collectives)
        fresh = assembled(days["day2"], collectives)
        restored(s, day1_checkpoint)
        assert_grown(s, fresh, checkpoint, f"rank {collectives.rank}")
        assert s.plan is not None
        return s.plan.tables[3].kind

    def plan_on_day1(collectives: SimulatedCollectives) -> Any:
        s = assembled(days["day1"], collectives)
        assert s.plan is not None
        return s.plan.tables[3].kind

    before = run_ranks(2, plan_on_day1)[0]
    after = run_ranks(2, rank)
    assert before == ShardingKind.DATA_PARALLEL
    assert after[0] != ShardingKind.DATA_PARALLEL


def test_row_wise_slots_grow_with_their_tables(days: dict[str, Path], tmp_path: Path) -> None:
    """Row-wise Adagrad's [rows, 1] accumulators: the old rows' come back, the new
    rows' start at the initial value, as element-wise slots do."""
    rowwise = {"optimizer": "rowwise_adagrad"}
    train(assembled(days["day1"], save_checkpoint_path=str(tmp_path), **rowwise))
    checkpoint = Checkpoint(list_checkpoints(tmp_path)[-1])
    s = restored(assembled(days["day2"], **rowwise), checkpoint.path)
    assert_grown(s, assembled(days["day2"], **rowwise), checkpoint)
    slots = tables_and_slots(s)
    for table, rows in enumerate(NEW):
        (accumulator,) = slots[(table, "accumulator")].values()
        assert accumulator.shape == (rows, 1)
        assert (accumulator[OLD[table] :] == np.float32(0.1)).all()


def test_warm_start_trains_the_new_day_from_step_zero(
    days: dict[str, Path], day1_checkpoint: Path, tmp_path: Path
) -> None:
    summary = train(
        assembled(
            days["day2"],
            restore_checkpoint_path=str(day1_checkpoint),
            warm_start=True,
            save_checkpoint_path=str(tmp_path),
            max_steps=3,
            log_path=tmp_path / "metrics.jsonl",
        )
    )
    assert summary["steps"] == 3
    (restore,) = read_records(tmp_path / "metrics.jsonl", "restore")
    assert restore["warm_start"] and restore["saved_step"] == 4 and restore["step"] == 0
    pairs = enumerate(zip(OLD, NEW, strict=True))
    assert restore["grown"] == [{"table": t, "rows": o, "to": n} for t, (o, n) in pairs if o < n]
    final = Checkpoint(list_checkpoints(tmp_path)[-1])
    assert final.step == 3
    assert final.table_shape(3) == (NEW[3], DIM)
    assert final.manifest["vocabulary"] == "bbbb"
    # Without --warm_start the checkpoint's step (4) is where the run continues.
    # (One step more than the checkpoint's: a run with nothing to train is an error.)
    resumed = train(
        assembled(days["day2"], restore_checkpoint_path=str(day1_checkpoint), max_steps=5)
    )
    assert (resumed["steps"], resumed["steps_this_run"]) == (5, 1)


def test_a_checkpoint_with_more_rows_than_the_dataset_is_an_error(
    days: dict[str, Path], tmp_path: Path
) -> None:
    train(assembled(days["day2"], save_checkpoint_path=str(tmp_path), max_steps=1))
    s = assembled(days["day1"])
    with pytest.raises(CheckpointError, match=r"table 0 has 31 rows, this run's dataset 23"):
        open_checkpoint(s, str(tmp_path))


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("unrelated", r"vocabulary is aaaa, and this dataset's \(cccc\) does not extend it"),
        ("no_lineage", r"vocabulary is aaaa, and this dataset records none"),
    ],
)
def test_growth_needs_a_vocabulary_that_extends_the_checkpoints(
    days: dict[str, Path], day1_checkpoint: Path, name: str, why: str
) -> None:
    s = assembled(days[name])
    with pytest.raises(CheckpointError, match=why) as info:
        open_checkpoint(s, str(day1_checkpoint))
    assert "table 0 has 23 rows, this run's dataset 31" in str(info.value)


def test_warm_start_flags_are_checked(days: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="--warm_start: needs --restore_checkpoint_path"):
        small_config(days["day2"], **GROWTH, warm_start=True)
    with pytest.raises(ConfigError, match="--warm_start: expected a --save_checkpoint_path of its"):
        small_config(
            days["day2"],
            **GROWTH,
            warm_start=True,
            restore_checkpoint_path=str(tmp_path / "step_000000004"),
            save_checkpoint_path=str(tmp_path),
        )


def test_a_malformed_vocabulary_record_stops_the_run_at_its_start(
    days: dict[str, Path], tmp_path: Path
) -> None:
    data = tmp_path / "data"
    shutil.copytree(days["day1"], data)
    spec_file = data / "feature_spec.yaml"
    raw = yaml.safe_load(spec_file.read_text())
    raw["metadata"][METADATA_KEY]["extends"] = "aaaa"  # a string, not a list
    spec_file.write_text(yaml.safe_dump(raw, sort_keys=False))
    with pytest.raises(DatasetError, match=r"metadata\.vocabulary\.extends: expected a list"):
        assembled(data)
