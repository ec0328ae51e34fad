"""16-bit embedding tables (`--embedding_dtype bfloat16|float16`): lookups widen,
updates round stochastically (exact in expectation, the same bits in the kernel
and in TensorFlow's ops), checkpoints store 16 bits and convert on restore, and
the planner counts 2 bytes a value."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from dlrm.app.config import EMBEDDING_DTYPE_BYTES
from dlrm.app.restore import restore_for_training
from dlrm.checkpoint.model_state import restore_shard, table_dtype_change
from dlrm.checkpoint.reader import Checkpoint
from dlrm.checkpoint.writer import CheckpointWriter
from dlrm.embedding.local import LocalEmbeddings
from dlrm.embedding.planner.types import TableSpec, state_bytes
from dlrm.embedding.shard import ShardingKind, TableShard
from dlrm.embedding.update import GradientPiece, apply_pieces
from dlrm.optim.optimizers import Adagrad, Adam, Optimizer, RowwiseAdagrad, Sgd
from dlrm.train.state import save_training_state
from harness import embedding_updates as apply_tests
from harness.assembly import SMALL_MODEL, assembled_run, batches
from harness.datasets import SMALL_TABLES, dataset_fixture

DTYPES = [tf.bfloat16, tf.float16]
DTYPE_IDS = ["bfloat16", "float16"]
PATHS = [True, False]
PATH_IDS = ["kernel", "tensorflow"]
# Draws per value: one row each (the hash differs per row).
DRAWS = 20_000
# Values that neither 16-bit type holds: normal ones, and a float16 subnormal.
VALUES = [1.0 + 2.0**-10 / 3, -0.3337, 1e-3 + 1e-7, 3.3e-6]

dataset = dataset_fixture(SMALL_TABLES, 3, {"train": 20 * SMALL_MODEL["batch_size"]}, seed=5)


def widened(values: Any, dtype: tf.DType) -> np.ndarray:
    """float32 `values` rounded to nearest `dtype`, widened back (exact)."""
    return tf.cast(tf.cast(np.asarray(values, np.float32), dtype), tf.float32).numpy()


def neighbours(x: np.ndarray, dtype: tf.DType) -> tuple[np.ndarray, np.ndarray]:
    """The 16-bit values of `dtype` nearest to float32 `x` toward zero and away
    from it (the same where `x` is one), as float32."""
    x = np.asarray(x, np.float32)
    if dtype == tf.bfloat16:
        bits = x.view(np.uint32)
        down = (bits & np.uint32(0xFFFF0000)).view(np.float32)
        up = (down.view(np.uint32) + np.uint32(0x10000)).view(np.float32)
        return down, np.where(bits & np.uint32(0xFFFF), up, down)
    nearest = x.astype(np.float16)
    away = np.abs(nearest.astype(np.float32)) > np.abs(x)
    toward = np.where(away, np.nextafter(nearest, np.float16(0)), nearest)
    other = np.nextafter(toward, np.copysign(np.float16(np.inf), x).astype(np.float16))
    exact = toward.astype(np.float32) == x
    return toward.astype(np.float32), np.where(exact, toward, other).astype(np.float32)


def sgd_to(
    value: float,
    dtype: tf.DType,
    use_kernels: bool,
    rows: int = DRAWS,
    step: int = 0,
    seed: int = 3,
) -> tuple[np.ndarray, np.float32]:
    """`rows` rows of one column, each starting at a 16-bit value, updated by SGD
    (learning rate 1) to about `value`: the stored values (float32), and the
    float32 update they round (start - gradient in float32)."""
    start = widened([value], dtype)[0]
    if start == np.float32(value):  # start elsewhere, so that the update moves
        start = widened([value * 0.5], dtype)[0]
    gradient = np.float32(start) - np.float32(value)
    target = np.float32(start) - gradient
    variable = tf.Variable(tf.fill([rows, 1], tf.cast(start, dtype)))
    optimizer = Sgd()
    optimizer.build([], [variable])
    optimizer.iterations.assign(step)
    piece = GradientPiece(
        0, tf.range(rows), tf.range(rows), tf.fill([rows, 1], tf.constant(gradient)), 0
    )
    shard = TableShard(4, ShardingKind.TABLE_WISE, 0, (0, rows), (0, 1))
    apply_pieces(
        [piece],
        [(shard, variable)],
        optimizer,
        tf.constant(1.0),
        use_kernels=use_kernels,
        seed=seed,
    )
    return np.asarray(tf.cast(variable, tf.float32).numpy()).ravel(), target


@pytest.mark.parametrize("use_kernels", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("value", VALUES)
def test_the_mean_of_rounded_updates_is_the_float32_update(
    library: Any, dtype: tf.DType, use_kernels: bool, value: float
) -> None:
    stored, target = sgd_to(value, dtype, use_kernels)
    down, up = (float(v[0]) for v in neighbours(np.array([target]), dtype))
    assert down != up, "the value must lie between two 16-bit values"
    assert set(np.unique(stored).tolist()) <= {down, up}, np.unique(stored)
    # Bernoulli draws between the two: the mean's standard error from the exact p.
    p = (float(target) - down) / (up - down)
    standard_error = abs(up - down) * np.sqrt(p * (1 - p) / DRAWS)
    assert 0.02 < p < 0.98, p
    assert abs(np.mean(stored, dtype=np.float64) - float(target)) < 5 * standard_error


@pytest.mark.parametrize("use_kernels", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_a_representable_update_is_stored_exactly(
    library: Any, dtype: tf.DType, use_kernels: bool
) -> None:
    for value in (1.5, -0.375, 0.0, 2.0**-20):
        target = widened([value], dtype)[0]
        stored, _ = sgd_to(float(target), dtype, use_kernels, rows=257)
        np.testing.assert_array_equal(stored, target)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_the_bits_repeat_for_a_step_and_change_with_it(library: Any, dtype: tf.DType) -> None:
    def draw(use_kernels: bool = True, step: int = 7, seed: int = 3) -> np.ndarray:
        return sgd_to(VALUES[0], dtype, use_kernels, rows=4096, step=step, seed=seed)[0]

    first = draw()
    np.testing.assert_array_equal(draw(), first)
    # TensorFlow's ops draw the kernel's bits.
    np.testing.assert_array_equal(draw(use_kernels=False), first)
    assert not np.array_equal(draw(step=8), first)
    assert not np.array_equal(draw(seed=4), first)


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_nan_and_infinity_pass_through(library: Any, dtype: tf.DType) -> None:
    variable = tf.Variable(tf.zeros([3, 1], dtype))
    piece = GradientPiece(
        0, tf.range(3), tf.range(3), tf.constant([[np.nan], [np.inf], [-np.inf]], tf.float32), 0
    )
    shard = TableShard(0, ShardingKind.TABLE_WISE, 0, (0, 3), (0, 1))
    optimizer = Sgd()
    optimizer.build([], [variable])
    for use_kernels in PATHS:
        variable.assign(tf.zeros([3, 1], dtype))
        apply_pieces(
            [piece], [(shard, variable)], optimizer, tf.constant(1.0), use_kernels=use_kernels
        )
        stored = tf.cast(variable, tf.float32).numpy().ravel()
        assert np.isnan(stored[0]) and stored[1] == -np.inf and stored[2] == np.inf


@pytest.mark.parametrize("use_kernels", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_lookups_equal_the_widened_tables_in_float32(
    library: Any, dtype: tf.DType, use_kernels: bool
) -> None:
    cardinalities, widths = [23, 11, 5], [7, 3, 16]
    layer = LocalEmbeddings(
        cardinalities, widths, seed=2, use_kernels=use_kernels, table_dtype=dtype
    )
    assert all(table.dtype == dtype for table in layer.tables)
    rng = np.random.default_rng(1)
    ids = np.stack([rng.integers(0, c, 9) for c in cardinalities], axis=1).astype(np.int32)
    vectors = layer(tf.constant(ids)).numpy()
    assert vectors.dtype == np.float32
    expected = np.concatenate(
        [tf.cast(t, tf.float32).numpy()[ids[:, i]] for i, t in enumerate(layer.tables)], axis=1
    )
    np.testing.assert_array_equal(vectors, expected)
    # Multi-hot ids, TensorFlow's gather and pooling: in float32 after the gather.
    hot = tuple(tf.constant(rng.integers(0, c, (9, 2)), tf.int32) for c in cardinalities)
    pooled = layer(hot).numpy()
    expected = np.concatenate(
        [
            tf.cast(t, tf.float32).numpy()[h.numpy()].sum(axis=1)
            for t, h in zip(layer.tables, hot, strict=True)
        ],
        axis=1,
    )
    np.testing.assert_allclose(pooled, expected, rtol=1e-6)


OPTIMIZER_CLASSES: dict[str, type[Optimizer]] = {
    "sgd": Sgd,
    "adagrad": Adagrad,
    "adam": Adam,
    "rowwise_adagrad": RowwiseAdagrad,
}


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("optimizer", apply_tests.OPTIMIZERS)
def test_the_apply_kernel_stores_a_neighbour_of_the_float32_update(
    library: Any, optimizer: str, dtype: tf.DType
) -> None:
    case = apply_tests.two_tables(optimizer)
    case.tables = [widened(t, dtype) for t in case.tables]
    tables = [tf.Variable(tf.cast(t, dtype)) for t in case.tables]
    slots = [[tf.Variable(s) for s in table_slots] for table_slots in case.slots]
    apply_tests.apply(library, case, (tables, slots))
    expected_tables, expected_slots, touched = apply_tests.reference(
        case, case.gradients, apply_tests.BETA_POWERS
    )
    for t, table in enumerate(tables):
        stored = tf.cast(table, tf.float32).numpy()
        reference = expected_tables[t].astype(np.float32)
        down, up = neighbours(reference, dtype)
        # Float32 against the reference's float64: a neighbour within rounding.
        tolerance = 1e-5 * np.abs(reference) + 1e-6
        near = (np.abs(stored - down) <= tolerance) | (np.abs(stored - up) <= tolerance)
        assert near[touched[t]].all(), (optimizer, t)
        assert not np.array_equal(stored[touched[t]], case.tables[t][touched[t]])
        np.testing.assert_array_equal(stored[~touched[t]], case.tables[t][~touched[t]])
        for variable, expected in zip(slots[t], expected_slots[t], strict=True):
            assert variable.dtype == tf.float32
            np.testing.assert_allclose(variable.numpy(), expected, **apply_tests.TOLERANCE)


def _write_table(root: Path, values: np.ndarray, dtype: str) -> Path:
    writer = CheckpointWriter(root, 1)
    writer.add_dense({"w": np.zeros(2, np.float32)})
    shard = TableShard(0, ShardingKind.TABLE_WISE, 0, (0, values.shape[0]), (0, values.shape[1]))
    slot = np.full(values.shape, 0.5, np.float32)
    writer.add_table_shard(shard, values.shape, values, {"accumulator": slot}, dtype=dtype)
    return writer.commit({})


@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
def test_checkpoints_store_16_bits_and_convert_on_restore(tmp_path: Path, dtype: tf.DType) -> None:
    rng = np.random.default_rng(0)
    values = rng.normal(size=(301, 13)).astype(np.float32)
    narrow = widened(values, dtype)
    wide_path = _write_table(tmp_path / "float32", values, "float32")
    narrow_path = _write_table(tmp_path / dtype.name, narrow, dtype.name)
    wide_bytes = (wide_path / "embeddings").glob("*.npy")
    sizes = {p.name: p.stat().st_size for p in wide_bytes}
    narrow_sizes = {p.name: p.stat().st_size for p in (narrow_path / "embeddings").glob("*.npy")}
    values_file = next(name for name in sizes if name.count(".") == 3)
    assert narrow_sizes[values_file] < 0.52 * sizes[values_file]
    slot_file = next(name for name in sizes if "accumulator" in name)
    assert narrow_sizes[slot_file] == sizes[slot_file]  # slots stay float32

    stored = Checkpoint(narrow_path)
    assert stored.manifest["format_version"] == 3
    assert Checkpoint(wide_path).manifest["format_version"] == 2
    assert stored.table_dtype(0) == dtype.name
    np.testing.assert_array_equal(stored.read_table_slice(0, (0, 301), (0, 13)), narrow)
    np.testing.assert_array_equal(stored.read_table_slice(0, (5, 9), (2, 11)), narrow[5:9, 2:11])

    shard = TableShard(0, ShardingKind.ROW_WISE, 0, (100, 301), (0, 13))
    into_narrow = tf.Variable(tf.zeros([201, 13], dtype))
    restore_shard(Checkpoint(wide_path), shard, into_narrow, None)  # rounded to nearest
    np.testing.assert_array_equal(tf.cast(into_narrow, tf.float32).numpy(), narrow[100:])
    into_wide = tf.Variable(tf.zeros([201, 13], tf.float32))
    restore_shard(stored, shard, into_wide, None)  # widened exactly
    np.testing.assert_array_equal(into_wide.numpy(), narrow[100:])
    assert table_dtype_change(Checkpoint(wide_path), dtype.name) == (
        f"checkpoint tables are float32, this run stores {dtype.name}: rounded to nearest "
        "on restore"
    )
    assert table_dtype_change(stored, "float32") == (
        f"checkpoint tables are {dtype.name}, this run stores float32: widened exactly"
    )
    assert table_dtype_change(stored, dtype.name) is None


def test_the_planner_counts_two_bytes_a_value_and_float32_slots() -> None:
    assert EMBEDDING_DTYPE_BYTES == {"float32": 4, "bfloat16": 2, "float16": 2}
    wide, narrow = TableSpec(1000, 16), TableSpec(1000, 16, dtype_bytes=2)
    assert narrow.memory_bytes() * 2 == wide.memory_bytes() == 64_000
    # Adagrad's slot stays 4 bytes a value; row-wise Adagrad's one value a row.
    assert narrow.memory_bytes(optimizer_slots=1) == 1000 * 16 * (2 + 4)
    assert narrow.memory_bytes(row_slots=1) == 1000 * (16 * 2 + 4)
    assert state_bytes(10, 3, 4, 2, 0) == 10 * 3 * 4 * 3


@pytest.mark.parametrize("use_kernels", PATHS, ids=PATH_IDS)
@pytest.mark.parametrize("embedding_dtype", ["bfloat16", "float16"])
def test_sixteen_bit_tables_train(
    library: Any, dataset: Path, embedding_dtype: str, use_kernels: bool
) -> None:
    run = assembled_run(
        dataset,
        optimizer="adagrad",
        learning_rate=0.1,
        embedding_dtype=embedding_dtype,
        use_kernels=use_kernels,
    )
    assert run.trainer is not None
    assert all(v.dtype.name == embedding_dtype for v in run.trainer.embedding_variables)
    data = batches(dataset, 8)
    losses = [np.mean([float(run.trainer.train_step(b)) for b in data]) for _ in range(6)]
    assert losses[-1] < 0.95 * losses[0], losses
    for variable in run.trainer.embedding_variables:
        for slot in run.trainer.optimizer.slots(variable).values():
            assert slot.dtype == tf.float32


def test_a_float32_checkpoint_restores_into_bfloat16_tables_and_says_so(
    library: Any, dataset: Path, tmp_path: Path
) -> None:
    wide = assembled_run(dataset, optimizer="adagrad")
    assert wide.trainer is not None
    for b in batches(dataset, 2):
        wide.trainer.train_step(b)
    path = save_training_state(wide.trainer, tmp_path, {"model": wide.model_config.to_dict()})
    console = io.StringIO()
    narrow = assembled_run(
        dataset,
        console=console,
        optimizer="adagrad",
        embedding_dtype="bfloat16",
        restore_checkpoint_path=str(path),
    )
    assert narrow.trainer is not None
    restore_for_training(narrow)
    assert (
        "checkpoint tables are float32, this run stores bfloat16: rounded to nearest on restore"
        in console.getvalue()
    )
    pairs = zip(wide.trainer.embedding_variables, narrow.trainer.embedding_variables, strict=True)
    for a, b in pairs:
        restored = tf.cast(b, tf.float32).numpy()
        np.testing.assert_array_equal(restored, widened(a.numpy(), tf.bfloat16))


@pytest.mark.parametrize("use_kernels", PATHS, ids=PATH_IDS)
def test_a_resumed_16_bit_run_repeats_the_uninterrupted_one_bit_for_bit(
    library: Any, dataset: Path, tmp_path: Path, use_kernels: bool
) -> None:
    """The rounding's bits come from the optimizer's step, which the checkpoint
    keeps (and from --seed, the same): resuming draws what the uninterrupted
    run drew."""
    settings = {"optimizer": "adagrad", "embedding_dtype": "bfloat16", "use_kernels": use_kernels}
    data = batches(dataset, 6)
    straight = assembled_run(dataset, **settings)
    assert straight.trainer is not None
    for b in data:
        straight.trainer.train_step(b)
    first = assembled_run(dataset, **settings)
    assert first.trainer is not None
    for b in data[:3]:
        first.trainer.train_step(b)
    path = save_training_state(first.trainer, tmp_path, {"model": first.model_config.to_dict()})
    assert Checkpoint(path).table_dtype(0) == "bfloat16"
    resumed = assembled_run(dataset, restore_checkpoint_path=str(path), **settings)
    assert resumed.trainer is not None
    restore_for_training(resumed)
    for b in data[3:]:
        resumed.trainer.train_step(b)
    pairs = zip(
        straight.trainer.embedding_variables, resumed.trainer.embedding_variables, strict=True
    )
    for a, b in pairs:
        np.testing.assert_array_equal(
            tf.cast(b, tf.float32).numpy(), tf.cast(a, tf.float32).numpy()
        )
