"""Row-wise Adagrad (`--optimizer rowwise_adagrad`): one accumulator a table row.

Its rule on the kernel and on TensorFlow's ops against a NumPy reference, for a
whole table, a row range and a column shard (which averages over its own columns
only); the dense weights' element-wise Adagrad; the planner's bytes; and its
[rows, 1] slot in checkpoints: written per shard, resharded between layouts (row
ranges split and join, column shards merge by the width-weighted mean and split
by copies), restored onto 2 simulated ranks, and refused by another optimizer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from dlrm.app.modes.training import train
from dlrm.app.restore import open_checkpoint
from dlrm.checkpoint.format import MANIFEST, CheckpointError, list_checkpoints
from dlrm.checkpoint.model_state import restore_shard
from dlrm.checkpoint.reader import Checkpoint
from dlrm.checkpoint.writer import CheckpointWriter
from dlrm.embedding.base import read_rows
from dlrm.embedding.planner.cost import shard_memory_bytes
from dlrm.embedding.planner.placement import PlannerConfig, plan_sharding
from dlrm.embedding.planner.plan import ShardingPlan
from dlrm.embedding.planner.types import TableSpec
from dlrm.embedding.shard import Range, ShardingKind, TableShard
from dlrm.embedding.update import GradientPiece, apply_pieces
from dlrm.optim.config import optimizer_spec
from dlrm.optim.optimizers import Adagrad, RowwiseAdagrad, create_optimizer
from dlrm.train.state import restore_training_state
from harness.assembly import assembled_run
from harness.datasets import SMALL_TABLES, synthetic_dataset
from harness.placements import plan_for
from harness.simulated_ranks import SimulatedCollectives, run_ranks

ROWS, DIM = 23, 7
EPSILON, LEARNING_RATE, INITIAL = 1e-7, 0.1, 0.1
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}

# --------------------------------------------------------------- the rule


def test_the_registry_keeps_one_accumulator_a_table_row() -> None:
    spec = optimizer_spec("rowwise_adagrad")
    assert (spec.slot_names, spec.row_wise_slots) == (("accumulator",), ("accumulator",))
    assert (spec.element_slot_count, spec.row_slot_count) == (0, 1)
    optimizer = create_optimizer("rowwise_adagrad")
    table = tf.Variable(tf.zeros([ROWS, DIM]), name="table")
    dense = tf.Variable(tf.zeros([5, 3]), name="kernel")
    optimizer.build([dense], tables=[table])
    accumulators = [optimizer.slots(v)["accumulator"].numpy() for v in (table, dense)]
    np.testing.assert_array_equal(accumulators[0], np.full((ROWS, 1), INITIAL, np.float32))
    np.testing.assert_array_equal(accumulators[1], np.full((5, 3), INITIAL, np.float32))


def test_dense_weights_get_element_wise_adagrad() -> None:
    rng = np.random.default_rng(3)
    initial = rng.normal(size=(5, 3)).astype(np.float32)
    gradients = [rng.normal(size=(5, 3)).astype(np.float32) for _ in range(3)]
    results = []
    for optimizer in (RowwiseAdagrad(), Adagrad()):
        variable = tf.Variable(initial, name="kernel")
        optimizer.build([variable])
        for g in gradients:
            optimizer.apply([tf.constant(g)], [variable], tf.constant(LEARNING_RATE))
        results.append(variable.numpy())
    np.testing.assert_array_equal(results[0], results[1])


def test_a_table_built_as_a_dense_weight_is_refused() -> None:
    optimizer = RowwiseAdagrad()
    table = tf.Variable(tf.zeros([ROWS, DIM]), name="table")
    optimizer.build([table])  # element-wise slots: not a table's
    gradient = tf.IndexedSlices(tf.ones([1, DIM]), tf.constant([2]), tf.constant([ROWS, DIM]))
    with pytest.raises(ValueError, match=r"accumulator of shape \[23, 7\], expected \[23, 1\]"):
        optimizer.apply_rows(table, gradient, 0.1)


# The shards one rank may hold of a 23 x 7 table, each updated on its own.
SHARDS = {
    "table_wise": TableShard(0, ShardingKind.TABLE_WISE, 0, (0, ROWS), (0, DIM)),
    "row_wise": TableShard(0, ShardingKind.ROW_WISE, 0, (8, 19), (0, DIM)),
    "column_wise": TableShard(0, ShardingKind.COLUMN_WISE, 0, (0, ROWS), (3, DIM)),
}
GRADIENT_COLUMN = 2  # the table's columns start here in the lookups' gradient
HOTNESS = 3


def _steps(seed: int) -> list[list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray | None]]]:
    """Two steps of two pieces each: (ids, rows, gradient [B, 11], scale or None);
    a mean-pooled multi-hot piece whose rows repeat an id, and a one-hot piece
    repeating ids of the first (duplicates within a row and across pieces)."""
    rng = np.random.default_rng(seed)
    steps = []
    for _ in range(2):
        multi_hot = rng.integers(0, 20, (6, HOTNESS))
        multi_hot[0] = [4, 4, 12]  # an id twice in a row
        one_hot = np.array([4, 12, 9, 4, 21])
        scale = np.full(6, 1 / HOTNESS, np.float32)
        steps.append(
            [
                (
                    multi_hot.reshape(-1),
                    np.arange(multi_hot.size) // HOTNESS,
                    rng.normal(size=(6, 11)).astype(np.float32),
                    scale,
                ),
                (one_hot, np.arange(5), rng.normal(size=(5, 11)).astype(np.float32), None),
            ]
        )
    return steps


def _reference(shard: TableShard, initial: np.ndarray, steps: Any) -> tuple[np.ndarray, ...]:
    """The rule in float64 on `shard` alone: its rows, its columns' mean of squares."""
    w = initial.astype(np.float64)
    accumulator = np.full((shard.height, 1), INITIAL)
    (r0, r1), (c0, c1) = shard.rows, shard.columns
    for pieces in steps:
        summed: dict[int, np.ndarray] = {}
        for ids, rows, gradient, scale in pieces:
            part = gradient[:, GRADIENT_COLUMN + c0 : GRADIENT_COLUMN + c1].astype(np.float64)
            for i, row in zip(ids, rows, strict=True):
                if r0 <= i < r1:
                    value = part[row] * (1.0 if scale is None else scale[row])
                    summed[i - r0] = summed.get(i - r0, 0.0) + value
        for u, g in summed.items():
            accumulator[u] += np.mean(g * g)
            w[u] -= LEARNING_RATE * g / (np.sqrt(accumulator[u]) + EPSILON)
    return w, accumulator


@pytest.mark.parametrize("use_kernels", [True, False], ids=["kernel", "tensorflow"])
@pytest.mark.parametrize("kind", list(SHARDS))
def test_a_shard_follows_the_numpy_reference(library: Any, kind: str, use_kernels: bool) -> None:
    """The kernel and TensorFlow's ops alike; a column shard's accumulator is the
    mean over its own columns (each column shard is its own table, as in TorchRec)."""
    shard = SHARDS[kind]
    rng = np.random.default_rng(4)
    initial = rng.normal(size=(shard.height, shard.width)).astype(np.float32)
    variable = tf.Variable(initial, name="shard")
    optimizer = RowwiseAdagrad(epsilon=EPSILON)
    optimizer.build([], tables=[variable])
    steps = _steps(5)
    for pieces in steps:
        gradient_pieces = [
            GradientPiece(
                0,
                tf.constant(ids),
                tf.constant(rows, tf.int32),
                tf.constant(gradient),
                GRADIENT_COLUMN + shard.columns[0],
                None if scale is None else tf.constant(scale),
            )
            for ids, rows, gradient, scale in pieces
        ]
        apply_pieces(
            gradient_pieces,
            [(shard, variable)],
            optimizer,
            tf.constant(LEARNING_RATE),
            use_kernels=use_kernels,
        )
    expected_w, expected_accumulator = _reference(shard, initial, steps)
    accumulator = optimizer.slots(variable)["accumulator"].numpy()
    np.testing.assert_allclose(variable.numpy(), expected_w, **TOLERANCE)
    np.testing.assert_allclose(accumulator, expected_accumulator, **TOLERANCE)
    untouched = expected_accumulator[:, 0] == INITIAL
    assert untouched.any() and not untouched.all()
    np.testing.assert_array_equal(variable.numpy()[untouched], initial[untouched])


# ---------------------------------------------------------------- the planner


def test_the_planner_counts_one_value_a_row() -> None:
    spec = TableSpec(1000, 16)
    column = TableShard(0, ShardingKind.COLUMN_WISE, 0, (0, 1000), (0, 8))
    assert shard_memory_bytes(column, spec, 0, 1) == 1000 * 8 * 4 + 1000 * 1 * 4
    assert shard_memory_bytes(column, spec, 1) == 2 * 1000 * 8 * 4  # element-wise Adagrad
    assert spec.memory_bytes(0, 1) == 1000 * 16 * 4 + 1000 * 4
    # Table-wise: a slot value a row; split by columns on 2 ranks: one a row on each.
    whole = PlannerConfig(2, data_parallel_threshold=0, row_slots=1)
    plan = plan_sharding([TableSpec(1000, 16), TableSpec(400, 16)], whole)
    assert sum(plan.memory_per_rank()) == 1400 * 16 * 4 + 1400 * 4
    assert ShardingPlan.from_dict(plan.to_dict()) == plan
    split = PlannerConfig(2, data_parallel_threshold=0, column_slice_threshold=100, row_slots=1)
    plan = plan_sharding([TableSpec(1000, 16)], split)
    assert plan.tables[0].kind == ShardingKind.COLUMN_WISE
    assert plan.memory_per_rank() == [1000 * 8 * 4 + 1000 * 4] * 2
    # The budget counts the row slot: 1000 x 16 fits 68,000 bytes, its Adagrad does not.
    budget = PlannerConfig(world_size=1, memory_budget_bytes=68_000, row_slots=1)
    plan_sharding([TableSpec(1000, 16)], budget)


# ----------------------------------------------------------- the checkpoints

TABLE = np.arange(ROWS * DIM, dtype=np.float32).reshape(ROWS, DIM)
# Per column shard of the layouts below, its own accumulator: distinct per row and shard.
ACCUMULATORS = {c: 1.0 + c + np.arange(ROWS, dtype=np.float32)[:, None] / 8 for c in range(DIM)}
LAYOUTS: dict[str, list[tuple[Range, Range]]] = {
    "whole": [((0, ROWS), (0, DIM))],
    "rows": [((0, 8), (0, DIM)), ((8, 9), (0, DIM)), ((9, ROWS), (0, DIM))],
    "columns": [((0, ROWS), (0, 3)), ((0, ROWS), (3, 4)), ((0, ROWS), (4, DIM))],
}


def _shard(rows: Range, columns: Range, rank: int = 0) -> TableShard:
    if (rows, columns) == ((0, ROWS), (0, DIM)):
        kind = ShardingKind.TABLE_WISE
    else:
        kind = ShardingKind.COLUMN_WISE if rows == (0, ROWS) else ShardingKind.ROW_WISE
    return TableShard(0, kind, rank, rows, columns)


def _write(root: Path, layout: str) -> Checkpoint:
    """TABLE in `layout`, each shard's accumulator [height, 1] that of its first
    column; the 1-column shard says it is row-wise, the others show it."""
    writer = CheckpointWriter(root, 3)
    writer.add_dense({"trainer/step": np.asarray(3)})
    for rank, (rows, columns) in enumerate(LAYOUTS[layout]):
        accumulator = ACCUMULATORS[columns[0]][rows[0] : rows[1]]
        writer.add_table_shard(
            _shard(rows, columns, rank),
            TABLE.shape,
            TABLE[rows[0] : rows[1], columns[0] : columns[1]],
            {"accumulator": lambda a, b, acc=accumulator: acc[a:b]},  # a RowReader
            row_wise_slots=("accumulator",) if columns[1] - columns[0] == 1 else (),
        )
    return Checkpoint(writer.commit({"optimizer": {"name": "rowwise_adagrad"}}))


def test_the_slot_is_stored_per_row(tmp_path: Path) -> None:
    checkpoint = _write(tmp_path, "columns")
    assert checkpoint.is_row_wise_slot(0, "accumulator")
    for stored in checkpoint.tables[0].shards:
        assert stored.row_wise_slots == ("accumulator",)
        header = np.load(checkpoint.path / stored.slots["accumulator"], mmap_mode="r")
        assert header.shape == (stored.shard.height, 1)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_row_ranges_split_and_join_and_column_shards_merge_by_their_widths(
    tmp_path: Path, layout: str
) -> None:
    checkpoint = _write(tmp_path, layout)
    whole = checkpoint.read_table_slice(0, (0, ROWS), (0, DIM), "accumulator")
    if layout == "columns":  # the width-weighted mean: 3/7, 1/7, 3/7
        expected = (3 * ACCUMULATORS[0] + ACCUMULATORS[3] + 3 * ACCUMULATORS[4]) / 7
        np.testing.assert_allclose(whole, expected, rtol=1e-6)
    else:  # row ranges joined, bit for bit
        np.testing.assert_array_equal(whole, ACCUMULATORS[0])
    # A row range of it (2 ranks -> 1 -> 2 by rows): the same rows.
    part = checkpoint.read_table_slice(0, (5, 12), (0, DIM), "accumulator")
    np.testing.assert_array_equal(part, whole[5:12])
    # Column shards cut from the stored ones: a stored shard's own value when one
    # holds all their columns (a copy), else their mean.
    np.testing.assert_array_equal(
        checkpoint.read_table_slice(0, (0, ROWS), (4, 6), "accumulator"),
        ACCUMULATORS[4] if layout == "columns" else ACCUMULATORS[0],
    )


def test_a_slot_of_another_shape_is_refused(tmp_path: Path) -> None:
    checkpoint = _write(tmp_path, "whole")
    shard = _shard((0, ROWS), (0, DIM))
    element_wise = tf.Variable(tf.zeros([ROWS, DIM]))
    with pytest.raises(
        CheckpointError,
        match=r"optimizer slot 'accumulator' of table 0 is stored with one value per row "
        r"\(--optimizer rowwise_adagrad\).*expected \[23, 1\]",
    ):
        restore_shard(checkpoint, shard, element_wise, "accumulator")


# ------------------------------------------------- a trainer's state, resharded


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return synthetic_dataset(tmp_path_factory, SMALL_TABLES, 3, {"train": 6 * 64, "test": 100}, 4)


def _trained(data: Path, root: Path, optimizer: str) -> Checkpoint:
    train(assembled_run(data, None, None, optimizer=optimizer, max_steps=3, evals_per_epoch=0,
                        save_checkpoint_path=str(root)))  # fmt: skip
    return Checkpoint(list_checkpoints(root)[-1])


def test_one_process_state_restores_onto_two_ranks_of_every_kind(
    dataset: Path, tmp_path: Path
) -> None:
    """Row ranges get their rows, column shards a copy of the whole row's."""
    checkpoint = _trained(dataset, tmp_path / "one", "rowwise_adagrad")
    specs = [TableSpec(rows, 6) for rows in SMALL_TABLES]
    plan_file = plan_for("mixed", specs, 2, 64).save(tmp_path / "plan.json")

    def rank(collectives: SimulatedCollectives) -> list[str]:
        s = assembled_run(dataset, collectives, None, optimizer="rowwise_adagrad",
                          sharding_plan=str(plan_file), evals_per_epoch=0)  # fmt: skip
        assert s.trainer is not None
        restore_training_state(s.trainer, open_checkpoint(s, str(checkpoint.path)))
        checked = []
        for shard, variable in s.model.embeddings.local_shards():
            accumulator = s.trainer.optimizer.slots(variable)["accumulator"]
            value = read_rows(accumulator, 0, shard.height)
            whole = checkpoint.read_table_slice(
                shard.table, (0, SMALL_TABLES[shard.table]), (0, 6), "accumulator"
            )
            np.testing.assert_array_equal(value, whole[shard.rows[0] : shard.rows[1]])
            checked.append(shard.kind.value)
        return checked

    kinds = {kind for checked in run_ranks(2, rank) for kind in checked}
    assert kinds == {"data_parallel", "table_wise", "column_wise", "row_wise"}
    trained = checkpoint.read_table_slice(0, (0, SMALL_TABLES[0]), (0, 6), "accumulator")
    assert (trained > INITIAL).any()  # the comparison has teeth


def test_another_optimizers_state_is_refused(dataset: Path, tmp_path: Path) -> None:
    checkpoint = _trained(dataset, tmp_path, "adagrad")
    s = assembled_run(dataset, None, None, optimizer="rowwise_adagrad", evals_per_epoch=0)
    assert s.trainer is not None
    with pytest.raises(
        CheckpointError, match=r"--optimizer adagrad, this run uses --optimizer rowwise_adagrad"
    ):
        restore_training_state(s.trainer, open_checkpoint(s, str(checkpoint.path)))
    assert (checkpoint.path / MANIFEST).exists()
