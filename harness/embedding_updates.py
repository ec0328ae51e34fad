"""A NumPy reference of the embedding update (dlrm/kernels/embedding_apply.cc): a
case of tables, slots and gradient pieces, its expected result in float64
(`reference`), and the kernel applied to it (`apply`), for every optimizer."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import tensorflow as tf

SLOT_NAMES = {
    "sgd": (),
    "adagrad": ("accumulator",),
    "adam": ("m", "v"),
    "rowwise_adagrad": ("accumulator",),
}
OPTIMIZERS = list(SLOT_NAMES)
EPSILON, BETA_1, BETA_2 = 1e-7, 0.9, 0.999
# Adam at its third step: the bias correction is not 1 - beta.
BETA_POWERS = (BETA_1**3, BETA_2**3)
# The kernel works in float32, the reference in float64. bfloat16 gradients are
# compared against the reference on the same bfloat16 values, so no looser.
TOLERANCE = {"rtol": 1e-5, "atol": 1e-6}
Variables = tuple[list[tf.Variable], list[list[tf.Variable]]]  # tables, slots per table


@dataclasses.dataclass(frozen=True)
class Piece:
    """One table's part of one gradient: `ids` [n] global ids, `rows` [n] the
    gradient row of each, the table's columns starting at `column`."""

    table: int
    ids: np.ndarray
    rows: np.ndarray
    gradient: int  # index into the case's gradients
    column: int
    scales: np.ndarray | None = None  # [B] of the gradient, or None for all 1


@dataclasses.dataclass
class Case:
    tables: list[np.ndarray]  # float32 [rows_t, D_t]
    slots: list[list[np.ndarray]]  # per table, in SLOT_NAMES order
    gradients: list[np.ndarray]  # float32 [B, C]
    pieces: list[Piece]
    optimizer: str
    offsets: list[int]
    partial: list[bool]
    learning_rate: float = 0.1
    gradient_scale: float = 1.0


def initial_slots(
    rng: np.random.Generator, shape: tuple[int, ...], optimizer: str
) -> list[np.ndarray]:
    if optimizer == "adagrad":
        return [rng.uniform(0.1, 1.0, shape).astype(np.float32)]
    if optimizer == "rowwise_adagrad":  # one accumulator a row
        return [rng.uniform(0.1, 1.0, (shape[0], 1)).astype(np.float32)]
    if optimizer == "adam":  # m of either sign, v >= 0
        return [
            rng.normal(0, 0.1, shape).astype(np.float32),
            rng.uniform(0, 0.1, shape).astype(np.float32),
        ]
    return []


def tables_case(
    optimizer: str, rows: list[int], widths: list[int], seed: int, **options: Any
) -> tuple[Case, np.random.Generator]:
    """Tables and slots, no pieces yet."""
    rng = np.random.default_rng(seed)
    shapes = list(zip(rows, widths, strict=True))
    case = Case(
        tables=[rng.normal(size=shape).astype(np.float32) for shape in shapes],
        slots=[initial_slots(rng, shape, optimizer) for shape in shapes],
        gradients=[],
        pieces=[],
        optimizer=optimizer,
        offsets=options.pop("offsets", [0] * len(rows)),
        partial=options.pop("partial", [False] * len(rows)),
        **options,
    )
    return case, rng


def two_tables(optimizer: str, seed: int = 0) -> Case:
    """Tables of 23 x 7 and 11 x 5 with every kind of piece: one-hot pieces sharing
    a gradient at column offsets, a multi-hot piece with a mean's row scales, a
    piece whose rows repeat, with row scales; duplicate ids within and across
    pieces."""
    case, rng = tables_case(optimizer, [23, 11], [7, 5], seed, gradient_scale=0.5)
    # Gradient 0 [9, 15]: other features' columns around table 0's [3, 10) and
    # table 1's [10, 15).
    case.gradients.append(rng.normal(size=(9, 15)).astype(np.float32))
    one_hot = np.arange(9)
    case.pieces.append(Piece(0, np.array([4, 17, 4, 0, 22, 9, 4, 13, 17]), one_hot, 0, 3))
    case.pieces.append(Piece(1, np.array([2, 10, 5, 2, 0, 7, 7, 3, 1]), one_hot, 0, 10))
    # Gradient 1 [4, 5]: table 1 multi-hot, 3 ids a sample, mean pooled.
    hotness = 3
    case.gradients.append(rng.normal(size=(4, 5)).astype(np.float32))
    multi_hot = np.array([2, 2, 6, 10, 6, 0, 8, 8, 8, 5, 2, 6])  # never 4 or 9
    case.pieces.append(
        Piece(1, multi_hot, np.arange(12) // hotness, 1, 0, np.full(4, 1 / hotness, np.float32))
    )
    # Gradient 2 [6, 10]: table 0 at column 2, rows in any order and repeated.
    case.gradients.append(rng.normal(size=(6, 10)).astype(np.float32))
    scales = rng.uniform(0.5, 2.0, 6).astype(np.float32)
    case.pieces.append(
        Piece(0, np.array([22, 5, 17, 1, 4]), np.array([5, 0, 2, 2, 1]), 2, 2, scales)
    )
    return case


def scaled_rows(case: Case, gradients: list[np.ndarray], t: int) -> list[tuple[int, np.ndarray]]:
    """(id less table `t`'s row offset, its gradient row scaled, float64) per id of its pieces."""
    width = case.tables[t].shape[1]
    out = []
    for piece in (p for p in case.pieces if p.table == t):
        part = gradients[piece.gradient][:, piece.column : piece.column + width]
        for global_id, row in zip(piece.ids, piece.rows, strict=True):
            scale = 1.0 if piece.scales is None else float(piece.scales[row])
            value = case.gradient_scale * scale * part[row].astype(np.float64)
            out.append((int(global_id) - case.offsets[t], value))
    return out


def reference(case: Case, gradients: list[np.ndarray], beta_powers: tuple[float, float]) -> tuple:
    """The op's semantics in float64: (tables, slots, touched rows per table)."""
    tables = [t.astype(np.float64) for t in case.tables]
    slots = [[s.astype(np.float64) for s in table_slots] for table_slots in case.slots]
    touched = []
    for t, table in enumerate(tables):
        rows = len(table)
        summed: dict[int, np.ndarray] = {}
        for u, value in scaled_rows(case, gradients, t):
            if not 0 <= u < rows:
                assert case.partial[t], "the reference is for valid inputs"
                continue
            summed[u] = summed.get(u, 0.0) + value
        for u, g in summed.items():
            lr = case.learning_rate
            if case.optimizer == "sgd":
                table[u] -= lr * g
            elif case.optimizer == "adagrad":
                slots[t][0][u] += g * g
                table[u] -= lr * g / (np.sqrt(slots[t][0][u]) + EPSILON)
            elif case.optimizer == "rowwise_adagrad":
                slots[t][0][u] += np.mean(g * g)
                table[u] -= lr * g / (np.sqrt(slots[t][0][u]) + EPSILON)
            else:
                m, v = slots[t]
                m[u] = BETA_1 * m[u] + (1 - BETA_1) * g
                v[u] = BETA_2 * v[u] + (1 - BETA_2) * g * g
                step = lr * np.sqrt(1 - beta_powers[1]) / (1 - beta_powers[0])
                table[u] -= step * m[u] / (np.sqrt(v[u]) + EPSILON)
        touched.append(np.isin(np.arange(rows), list(summed)))
    return tables, slots, touched


def variables_of(case: Case) -> Variables:
    tables = [tf.Variable(t) for t in case.tables]
    slots = [[tf.Variable(s) for s in table_slots] for table_slots in case.slots]
    return tables, slots


def apply(
    library: Any,
    case: Case,
    variables: Variables | None = None,
    dtype: tf.DType = tf.float32,
    id_dtype: tf.DType = tf.int32,
) -> Variables:
    """Applies the case to `variables` (new ones of its values by default): (tables, slots)."""
    tables, slots = variables or variables_of(case)
    gradients = [tf.constant(g, dtype) for g in case.gradients]
    empty = np.zeros([0], np.float32)
    library.dlrm_embedding_apply(
        tables=[t.handle for t in tables],
        slots=[s.handle for table_slots in slots for s in table_slots],
        ids=[tf.constant(p.ids, id_dtype) for p in case.pieces],
        rows=[tf.constant(p.rows, tf.int32) for p in case.pieces],
        gradients=[gradients[p.gradient] for p in case.pieces],
        row_scales=[tf.constant(empty if p.scales is None else p.scales) for p in case.pieces],
        learning_rate=tf.constant(case.learning_rate),
        gradient_scale=tf.constant(case.gradient_scale),
        beta_1_power=tf.constant(BETA_POWERS[0], tf.float32),
        beta_2_power=tf.constant(BETA_POWERS[1], tf.float32),
        step=tf.constant(0, tf.int64),
        optimizer=case.optimizer,
        piece_tables=[p.table for p in case.pieces],
        piece_columns=[p.column for p in case.pieces],
        row_offsets=case.offsets,
        partial=case.partial,
        epsilon=EPSILON,
        beta_1=BETA_1,
        beta_2=BETA_2,
    )
    return tables, slots
