"""Stochastic rounding of updated float32 rows into 16-bit tables, with
TensorFlow's integer ops: the same bits as the kernels' (`dlrm/kernels/rounding.h`).

A 16-bit table (`--embedding_dtype bfloat16|float16`) stores each updated value
as one of its two 16-bit neighbours, the upper with probability proportional to
the value's distance from the lower, so that the expected stored value is the
float32 update: an update smaller than half the spacing of 16-bit values, which
rounding to nearest would lose every step, survives on average.

The random bits are a counter-based hash of (seed, step, table, the row's global
id, the column's global index) (splitmix64's finaliser, chained): a run repeats
bit for bit, whichever thread or rank updates a row, and the copies of a
replicated table stay equal. bfloat16 adds 16 random bits to the low half of the
float32 bits and truncates; float16 rounds the magnitude up when 13 random bits
(32 for a subnormal) fall below the part cut off. NaN stays NaN, infinity
infinite.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import tensorflow as tf

SIXTEEN_BIT_DTYPES = (tf.bfloat16, tf.float16)

_GOLDEN = 0x9E3779B97F4A7C15
_MULTIPLIERS = (0xBF58476D1CE4E5B9, 0x94D049BB133111EB)


class RowRounding(NamedTuple):
    """Where a variable's rows lie in their table, for the random bits: the run's
    `seed`, the `table`'s index in the model, and the variable's first row and
    column in the whole table (a shard's)."""

    seed: int = 0
    table: int = 0
    row_offset: int = 0
    column_offset: int = 0


def _u64(value: int) -> tf.Tensor:
    return tf.constant(np.uint64(value % (1 << 64)), tf.uint64)


def mix(z: tf.Tensor) -> tf.Tensor:
    """splitmix64's finaliser of uint64 `z` (rounding.h's `Mix`)."""
    z = z + _u64(_GOLDEN)
    for shift, multiplier in zip((30, 27), _MULTIPLIERS, strict=True):
        z = tf.bitwise.bitwise_xor(z, tf.bitwise.right_shift(z, _u64(shift))) * _u64(multiplier)
    return tf.bitwise.bitwise_xor(z, tf.bitwise.right_shift(z, _u64(31)))


def table_key(seed: int, step: Any, table: int) -> tf.Tensor:
    """The uint64 key of one table's rounding at `step` (int64)."""
    step_bits = tf.bitcast(tf.cast(step, tf.int64), tf.uint64)
    with_step = mix(tf.bitwise.bitwise_xor(mix(_u64(seed)), step_bits))
    return mix(tf.bitwise.bitwise_xor(with_step, _u64(table)))


def random_bits(key: tf.Tensor, rows: tf.Tensor, column_offset: int, width: int) -> tf.Tensor:
    """uint64 [n, width]: the hash of each (global row `rows` [n], column
    column_offset + k)."""
    row_keys = mix(tf.bitwise.bitwise_xor(key, tf.bitcast(tf.cast(rows, tf.int64), tf.uint64)))
    columns = tf.range(column_offset, column_offset + width, dtype=tf.int64)
    return mix(tf.bitwise.bitwise_xor(row_keys[:, None], tf.bitcast(columns, tf.uint64)[None, :]))


def stochastic_round(values: tf.Tensor, dtype: Any, bits: tf.Tensor) -> tf.Tensor:
    """float32 `values` rounded stochastically to `dtype` (bfloat16 or float16)
    with the uint64 random `bits` of the same shape."""
    dtype = tf.as_dtype(dtype)
    word = tf.bitcast(tf.cast(values, tf.float32), tf.uint32)
    magnitude = tf.bitwise.bitwise_and(word, _u32(0x7FFFFFFF))
    if dtype == tf.bfloat16:
        return _round_bfloat16(word, magnitude, bits)
    if dtype == tf.float16:
        return _round_float16(word, magnitude, bits)
    raise ValueError(f"stochastic rounding: expected bfloat16 or float16, got {dtype.name}")


def _u32(value: int) -> tf.Tensor:
    return tf.constant(value, tf.uint32)


def _shift(x: tf.Tensor, bits: int) -> tf.Tensor:
    return tf.bitwise.right_shift(x, tf.constant(bits, x.dtype))


def _round_bfloat16(word: tf.Tensor, magnitude: tf.Tensor, bits: tf.Tensor) -> tf.Tensor:
    noise = tf.cast(_shift(bits, 48), tf.uint32)
    rounded = _shift(word + noise, 16)
    quiet_nan = tf.bitwise.bitwise_or(_shift(word, 16), _u32(0x40))
    out = tf.where(
        magnitude > _u32(0x7F800000),
        quiet_nan,
        tf.where(magnitude == _u32(0x7F800000), _shift(word, 16), rounded),
    )
    return tf.bitcast(tf.cast(out, tf.uint16), tf.bfloat16)


def _round_float16(word: tf.Tensor, magnitude: tf.Tensor, bits: tf.Tensor) -> tf.Tensor:
    sign = tf.bitwise.bitwise_and(_shift(word, 16), _u32(0x8000))
    # A normal float16 (|x| >= 2^-14): 13 random bits against the 13 cut off.
    exponent = tf.bitwise.left_shift(_shift(magnitude, 23) - _u32(112), _u32(10))
    normal_down = tf.bitwise.bitwise_or(
        exponent, tf.bitwise.bitwise_and(_shift(magnitude, 13), _u32(0x3FF))
    )
    normal_up = tf.cast(_shift(bits, 51), tf.uint32) < tf.bitwise.bitwise_and(
        magnitude, _u32(0x1FFF)
    )
    # A subnormal: units of 2^-24, 32 random bits against the fraction of one.
    units = tf.bitcast(magnitude, tf.float32) * 16777216.0
    subnormal_down = tf.cast(units, tf.uint32)
    fraction = units - tf.cast(subnormal_down, tf.float32)
    subnormal_up = tf.cast(_shift(bits, 32), tf.float64) < tf.cast(fraction, tf.float64) * 2.0**32
    normal = magnitude >= _u32(0x38800000)
    down = tf.where(normal, normal_down, subnormal_down)
    up = tf.where(normal, normal_up, subnormal_up)
    rounded = down + tf.cast(up, tf.uint32)
    nan = tf.bitwise.bitwise_or(
        _u32(0x7E00), tf.bitwise.bitwise_and(_shift(magnitude, 13), _u32(0x3FF))
    )
    out = tf.where(
        magnitude > _u32(0x7F800000),
        nan,
        tf.where(magnitude >= _u32(0x47800000), _u32(0x7C00), rounded),
    )
    return tf.bitcast(tf.cast(tf.bitwise.bitwise_or(sign, out), tf.uint16), tf.float16)


def round_rows(
    values: tf.Tensor, dtype: Any, rounding: RowRounding, step: Any, local_rows: tf.Tensor
) -> tf.Tensor:
    """Updated rows `values` [n, D] float32 of a variable's `local_rows` [n],
    rounded stochastically to `dtype` with the bits of (seed, step, table,
    global row, global column)."""
    key = table_key(rounding.seed, step, rounding.table)
    rows = tf.cast(local_rows, tf.int64) + rounding.row_offset
    width = int(values.shape[1])
    return stochastic_round(values, dtype, random_bits(key, rows, rounding.column_offset, width))
