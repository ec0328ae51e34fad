"""DlrmEmbeddingApply (dlrm/kernels/embedding_apply.cc) against a numpy reference of
its semantics, and against dlrm/optim/optimizers.py's TensorFlow path, for every
optimizer (row-wise Adagrad's one accumulator a row among them)."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import tensorflow as tf

from dlrm.optim.optimizers import Adagrad, Adam, Optimizer, RowwiseAdagrad, Sgd
from harness.embedding_updates import (
    BETA_1,
    BETA_2,
    BETA_POWERS,
    EPSILON,
    OPTIMIZERS,
    SLOT_NAMES,
    TOLERANCE,
    Case,
    Piece,
    apply,
    reference,
    scaled_rows,
    tables_case,
    two_tables,
    variables_of,
)


def _check_against_reference(
    library: Any, case: Case, dtype: tf.DType = tf.float32, id_dtype: tf.DType = tf.int32
) -> None:
    tables, slots = apply(library, case, dtype=dtype, id_dtype=id_dtype)
    values = case.gradients
    if dtype == tf.bfloat16:  # the values the kernel gets: rounded to bfloat16
        values = [tf.cast(tf.cast(g, dtype), tf.float32).numpy() for g in values]
    expected_tables, expected_slots, touched = reference(case, values, BETA_POWERS)
    slot_names = SLOT_NAMES[case.optimizer]
    for t, table in enumerate(tables):
        assert touched[t].any() and not touched[t].all(), "the case leaves rows untouched"
        pairs = [("table", table, case.tables[t], expected_tables[t])]
        pairs += zip(slot_names, slots[t], case.slots[t], expected_slots[t], strict=True)
        for name, variable, initial, expected in pairs:
            value = variable.numpy()
            message = f"{name} of table {t}"
            np.testing.assert_allclose(
                value[touched[t]], expected[touched[t]], err_msg=message, **TOLERANCE
            )
            # Rows no id reached: bit for bit as they were.
            np.testing.assert_array_equal(value[~touched[t]], initial[~touched[t]], message)
            assert not np.array_equal(value[touched[t]], initial[touched[t]]), message


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("id_dtype", [tf.int32, tf.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("dtype", [tf.float32, tf.bfloat16], ids=["float32", "bfloat16"])
def test_matches_the_reference(
    library: Any, optimizer: str, dtype: tf.DType, id_dtype: tf.DType
) -> None:
    _check_against_reference(library, two_tables(optimizer), dtype, id_dtype)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_a_partial_table_skips_the_ids_of_other_shards(library: Any, optimizer: str) -> None:
    """Table 1 holds global rows [11, 22) of a 33-row table; table 0 rows [0, 23)."""
    case, rng = tables_case(optimizer, [23, 11], [7, 5], 1, offsets=[0, 11], partial=[True, True])
    case.gradients.append(rng.normal(size=(40, 12)).astype(np.float32))
    rows = np.arange(40)
    # Some rows of each table stay untouched: 20 .. 22 of table 0, 15 of table 1.
    case.pieces.append(Piece(0, rng.integers(0, 20, 40), rows, 0, 0))
    case.pieces.append(Piece(1, rng.choice(np.setdiff1d(np.arange(33), [15]), 40), rows, 0, 7))
    assert (case.pieces[1].ids < 11).any() and (case.pieces[1].ids >= 22).any()
    _check_against_reference(library, case)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_a_large_multi_hot_table_shared_among_threads(library: Any, optimizer: str) -> None:
    """More ids than one thread's share: the table's rows are split among threads
    (SGD's too, grouped first)."""
    case, rng = tables_case(optimizer, [997, 23], [19, 7], 2, gradient_scale=0.25)
    hotness = 5
    case.gradients.append(rng.normal(size=(800, 26)).astype(np.float32))
    ids = rng.integers(0, 900, 800 * hotness)
    scales = rng.uniform(0.1, 1, 800).astype(np.float32)
    case.pieces.append(Piece(0, ids, np.arange(800 * hotness) // hotness, 0, 7, scales))
    case.pieces.append(Piece(1, rng.integers(0, 20, 800), np.arange(800), 0, 0))
    _check_against_reference(library, case)


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_a_table_far_larger_than_its_ids(library: Any, optimizer: str) -> None:
    """Over 16 rows an id: the rows are grouped by hashing, not counted over the
    whole table."""
    case, rng = tables_case(optimizer, [2003, 23], [3, 7], 8, partial=[True, False])
    ids = np.concatenate([rng.integers(0, 2500, 40), [17, 1999, 17, 2002, 17]])
    case.gradients.append(rng.normal(size=(ids.size, 10)).astype(np.float32))
    case.pieces.append(Piece(0, ids, np.arange(ids.size), 0, 7))
    case.pieces.append(Piece(1, np.array([0, 22, 0]), np.array([3, 0, 3]), 0, 0))
    _check_against_reference(library, case)


def test_duplicates_are_summed_before_one_update(library: Any) -> None:
    """Adagrad of the summed gradient: not three updates of its parts."""
    case, _ = tables_case("adagrad", [11], [5], 3)
    case.gradients = [np.ones((3, 5), np.float32), np.full((1, 5), 2.0, np.float32)]
    case.pieces = [
        Piece(0, np.array([3, 3, 7]), np.arange(3), 0, 0),
        Piece(0, np.array([3]), np.array([0]), 1, 0),
    ]
    tables, slots = apply(library, case)
    accumulator = case.slots[0][0][3] + 4.0**2  # 1 + 1 + 2, squared once
    np.testing.assert_allclose(slots[0][0].numpy()[3], accumulator, rtol=1e-6)
    want = case.tables[0][3] - 0.1 * 4.0 / (np.sqrt(accumulator) + EPSILON)
    np.testing.assert_allclose(tables[0].numpy()[3], want, rtol=1e-6)


def test_a_row_with_a_zero_gradient_is_still_updated(library: Any) -> None:
    """Lazy Adam decays the moments of every row looked up, whatever its gradient."""
    case, _ = tables_case("adam", [11], [5], 4)
    case.gradients = [np.zeros((1, 5), np.float32)]
    case.pieces = [Piece(0, np.array([6]), np.array([0]), 0, 0)]
    tables, slots = apply(library, case)
    np.testing.assert_allclose(slots[0][0].numpy()[6], BETA_1 * case.slots[0][0][6], rtol=1e-6)
    np.testing.assert_allclose(slots[0][1].numpy()[6], BETA_2 * case.slots[0][1][6], rtol=1e-6)
    assert not np.array_equal(tables[0].numpy()[6], case.tables[0][6])


def test_adams_one_minus_beta_is_the_decimals(library: Any) -> None:
    """1 - 0.999, as dlrm/optim/optimizers.py computes it, not 1 - 0.999 rounded to float32
    (0.99999871e-3, 1.3e-5 off, which a few training steps showed)."""
    case, _ = tables_case("adam", [11], [5], 9)
    case.slots = [[np.zeros((11, 5), np.float32), np.zeros((11, 5), np.float32)]]
    case.gradients = [np.full((1, 5), 3.0, np.float32)]
    case.pieces = [Piece(0, np.array([2]), np.array([0]), 0, 0)]
    _, slots = apply(library, case)
    np.testing.assert_allclose(slots[0][0].numpy()[2], np.float32(1 - BETA_1) * 3.0, rtol=1e-6)
    np.testing.assert_allclose(slots[0][1].numpy()[2], np.float32(1 - BETA_2) * 9.0, rtol=1e-6)


def test_no_pieces_change_nothing(library: Any) -> None:
    case, _ = tables_case("adam", [23], [7], 5)
    tables, slots = apply(library, case)
    np.testing.assert_array_equal(tables[0].numpy(), case.tables[0])
    np.testing.assert_array_equal(slots[0][1].numpy(), case.slots[0][1])


def _tensorflow_path(optimizer: Optimizer, case: Case) -> list[tf.Variable]:
    """dlrm/optim/optimizers.py's `_apply_sparse` of each table's IndexedSlices."""
    tables = [tf.Variable(t, name=f"table{i}") for i, t in enumerate(case.tables)]
    optimizer.build([], tables=tables)
    optimizer.iterations.assign(2)  # Adam's third step: BETA_POWERS
    for t, table in enumerate(tables):
        slots = optimizer.slots(table)
        for name, initial in zip(SLOT_NAMES[case.optimizer], case.slots[t], strict=True):
            slots[name].assign(initial)
        indices, values = zip(*scaled_rows(case, case.gradients, t), strict=True)
        gradient = tf.IndexedSlices(
            tf.constant(np.stack(values), tf.float32),
            tf.constant(indices, tf.int64),
            tf.constant(case.tables[t].shape, tf.int64),
        )
        optimizer._apply_sparse(table, gradient, tf.constant(case.learning_rate), slots)
    return tables


@pytest.mark.parametrize(
    ("optimizer", "make"),
    [
        ("sgd", Sgd),
        ("adagrad", Adagrad),
        ("adam", lambda: Adam(BETA_1, BETA_2, EPSILON)),
        ("rowwise_adagrad", RowwiseAdagrad),
    ],
)
def test_agrees_with_the_optimizers_tensorflow_path(
    library: Any, optimizer: str, make: Any
) -> None:
    case = two_tables(optimizer, seed=6)
    reference_optimizer = make()
    assert reference_optimizer.name == optimizer
    expected = _tensorflow_path(reference_optimizer, case)
    tables, slots = apply(library, case)
    for t, table in enumerate(tables):
        np.testing.assert_allclose(table.numpy(), expected[t].numpy(), rtol=1e-5, atol=1e-6)
        for name, slot in zip(SLOT_NAMES[optimizer], slots[t], strict=True):
            theirs = reference_optimizer.slots(expected[t])[name].numpy()
            np.testing.assert_allclose(slot.numpy(), theirs, rtol=1e-5, atol=1e-6)


def test_a_value_read_before_keeps_what_it_read(library: Any) -> None:
    """Copy-on-read, as TensorFlow's sparse updates: the update never changes a
    tensor a reader holds, of a table or of a slot."""
    case = two_tables("adagrad")
    tables, slots = variables_of(case)
    table_before = tables[0].read_value()  # shares the variable's buffer
    slot_before = slots[1][0].read_value()
    apply(library, case, (tables, slots))
    np.testing.assert_array_equal(table_before.numpy(), case.tables[0])
    np.testing.assert_array_equal(slot_before.numpy(), case.slots[1][0])
    assert not np.array_equal(tables[0].numpy(), case.tables[0])
    assert not np.array_equal(slots[1][0].numpy(), case.slots[1][0])


# ----------------------------------------------------------------------- errors


def _error_inputs() -> tuple[dict[str, Any], tf.Variable, tf.Variable]:
    """A valid call on a 23 x 7 table with Adagrad: (arguments, table, accumulator)."""
    rng = np.random.default_rng(7)
    table = tf.Variable(rng.normal(size=(23, 7)).astype(np.float32))
    accumulator = tf.Variable(np.full((23, 7), 0.1, np.float32))
    arguments = {
        "tables": [table.handle],
        "slots": [accumulator.handle],
        "ids": [tf.constant([3, 22])],
        "rows": [tf.constant([0, 3])],
        "gradients": [tf.ones([4, 7])],
        "row_scales": [tf.zeros([0])],
        "learning_rate": tf.constant(0.1),
        "gradient_scale": tf.constant(1.0),
        "beta_1_power": tf.constant(0.9),
        "beta_2_power": tf.constant(0.999),
        "step": tf.constant(0, tf.int64),
        "optimizer": "adagrad",
        "piece_tables": [0],
        "piece_columns": [0],
        "row_offsets": [0],
        "partial": [False],
    }
    return arguments, table, accumulator


def _kept(alive: list[tf.Variable], value: tf.Tensor) -> tf.Variable:
    """A new variable, alive as long as `alive` (a variable's resource goes with it)."""
    alive.append(tf.Variable(value))
    return alive[-1]


# name -> (the arguments that change, given the table and a list that keeps the
# variables they make alive; the message expected)
ERRORS: dict[str, tuple[Callable[[tf.Variable, list[tf.Variable]], dict[str, Any]], str]] = {
    "an id out of a whole table": (
        lambda table, alive: {"ids": [tf.constant([3, 23])]},
        r"ids\[0\]\[1\] = 23 \(piece 0 of table 0\) is not in the table's rows \[0, 23\) "
        r"and the table is not partial",
    ),
    "a negative id": (
        lambda table, alive: {"ids": [tf.constant([-1, 3], tf.int64)]},
        r"ids\[0\]\[0\] = -1 \(piece 0 of table 0\) is not in the table's rows \[0, 23\)",
    ),
    "an id of another shard": (
        lambda table, alive: {"row_offsets": [10]},
        r"ids\[0\]\[0\] = 3 \(piece 0 of table 0\) is not in the table's rows \[10, 33\)",
    ),
    "rows shorter than ids": (
        lambda table, alive: {"rows": [tf.constant([0])]},
        r"rows\[0\] is \[1\]: expected ids\[0\]'s shape \[2\]",
    ),
    "a row out of the gradient": (
        lambda table, alive: {"rows": [tf.constant([0, 4])]},
        r"rows\[0\]\[1\] = 4 is not a row of gradients\[0\] \(expected \[0, 4\)\)",
    ),
    "row scales of another length": (
        lambda table, alive: {"row_scales": [tf.ones([3])]},
        r"row_scales\[0\] is \[3\]: expected \[4\] \(one per row of gradients\[0\]\) or \[0\]",
    ),
    "columns past the gradient's": (
        lambda table, alive: {"piece_columns": [2]},
        r"piece 0 of table 0: its columns \[2, 9\) are not inside gradients\[0\]'s 7 columns",
    ),
    "a gradient that is no matrix": (
        lambda table, alive: {"gradients": [tf.ones([4, 7, 1])]},
        r"gradients\[0\] is \[4,7,1\]: expected a matrix \[B, C\]",
    ),
    "the wrong slot count": (
        lambda table, alive: {"slots": []},
        r"optimizer 'adagrad' keeps 1 slot variable\(s\) per table \(accumulator\): "
        r"expected 1 slots for 1 table\(s\), got 0",
    ),
    "a slot of another shape": (
        lambda table, alive: {"slots": [_kept(alive, tf.zeros([23, 6])).handle]},
        r"slots\[0\] \(accumulator of table 0\) is \[23,6\]: expected its table's shape \[23,7\]",
    ),
    "a row-wise slot of its table's shape": (
        lambda table, alive: {"optimizer": "rowwise_adagrad"},
        r"slots\[0\] \(accumulator of table 0\) is \[23,7\]: expected one value per row of its "
        r"table \[23,1\]",
    ),
    "a float64 table": (
        lambda table, alive: {"tables": [_kept(alive, tf.zeros([23, 7], tf.float64)).handle]},
        r"tables\[0\] is double: expected float32",
    ),
    "a table as its own slot": (
        lambda table, alive: {"slots": [table.handle]},
        r"tables\[0\] and slots\[0\] \(accumulator of table 0\) are the same variable",
    ),
    "a piece of no table": (
        lambda table, alive: {"piece_tables": [1]},
        r"piece_tables\[0\] = 1 is not a table \(expected \[0, 1\)\)",
    ),
    "row offsets of two tables": (
        lambda table, alive: {"row_offsets": [0, 0]},
        r"row_offsets has 2 entries: expected one per table \(1\)",
    ),
    "a learning rate that is no scalar": (
        lambda table, alive: {"learning_rate": tf.constant([0.1])},
        r"expected a scalar learning_rate, got shape \[1\]",
    ),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_rejects_bad_inputs_and_changes_nothing(library: Any, name: str) -> None:
    changes, message = ERRORS[name]
    arguments, table, accumulator = _error_inputs()
    initial = table.numpy()
    alive: list[tf.Variable] = []
    with pytest.raises(tf.errors.InvalidArgumentError, match=message):
        library.dlrm_embedding_apply(**{**arguments, **changes(table, alive)})
    np.testing.assert_array_equal(table.numpy(), initial)
    np.testing.assert_array_equal(accumulator.numpy(), np.full((23, 7), 0.1, np.float32))


def test_an_error_in_one_table_leaves_every_table_unchanged(library: Any) -> None:
    """All ids are checked before any row changes, the other tables' too."""
    case = two_tables("adam")
    case.pieces[-1] = dataclasses.replace(case.pieces[-1], ids=np.array([22, 5, 23, 1, 4]))
    tables, slots = variables_of(case)
    with pytest.raises(
        tf.errors.InvalidArgumentError, match=r"ids\[3\]\[2\] = 23 \(piece 3 of table 0\)"
    ):
        apply(library, case, (tables, slots))
    for t, table in enumerate(tables):
        np.testing.assert_array_equal(table.numpy(), case.tables[t])
        for slot, initial in zip(slots[t], case.slots[t], strict=True):
            np.testing.assert_array_equal(slot.numpy(), initial)


def test_graph_construction_rejects_the_wrong_slot_count(library: Any) -> None:
    arguments, _, _ = _error_inputs()
    arguments["optimizer"] = "adam"

    @tf.function
    def step() -> None:
        library.dlrm_embedding_apply(**arguments)

    with pytest.raises((ValueError, tf.errors.InvalidArgumentError), match=r"expected 2 slots"):
        step()
