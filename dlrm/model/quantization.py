"""Row-wise int8 embedding tables, for serving (`--mode export --quantize int8`).

Each row of a float32 table [rows, D] becomes D int8 values and two float32
numbers, its `scale` s = (max - min) / 255 and `offset` o = min + 128 s, from
the row's own minimum and maximum (min/max affine quantization):

    q = round((x - min) / s) - 128, in [-128, 127]
    x ~ q * s + o  (one multiply-add), within s / 2 of x, plus float32 rounding

A constant row (an all-zero row too) has s = 0, q = 0 and o = its value: exact.
A table then takes D + 8 bytes a row instead of 4 D: (D + 8) / (4 D) of its
float32 bytes, 26.6 % at D = 128.

The lookups dequantize the rows they gather before pooling, with TensorFlow's
own ops (gather, cast, multiply, add), so a SavedModel that holds such tables
needs nothing from this project to load.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import tensorflow as tf

from dlrm.embedding.base import assign_rows, pool, read_rows
from dlrm.embedding.shard import ROW_BLOCK_BYTES

INT8_LEVELS = 255  # steps between a row's minimum (q = -128) and its maximum (q = 127)
# The bytes a row keeps besides its values: its scale and offset, float32 each.
SCALE_OFFSET_BYTES = 8
_FLOAT32_MAX = float(np.finfo(np.float32).max)


def quantize_rows(values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float32 rows [R, D] -> (int8 [R, D], float32 [R, 2]: each row's scale
    and offset). Computed in float64, so that a row's range may exceed float32's.

    Raises:
        ValueError: a value is not finite, or a row spans nearly all of float32's
            range (its -128 * scale would overflow).
    """
    x = np.asarray(values, dtype=np.float64)
    if not np.isfinite(x).all():
        row = int(np.argwhere(~np.isfinite(x))[0][0])
        raise ValueError(f"quantize_rows: row {row} holds a value that is not finite")
    if x.ndim != 2 or x.shape[1] == 0:
        raise ValueError(f"quantize_rows: expected rows [R, D > 0], got shape {list(x.shape)}")
    low, high = x.min(axis=1), x.max(axis=1)
    # The scale the lookup multiplies by is float32: round with that one.
    scale = ((high - low) / INT8_LEVELS).astype(np.float32).astype(np.float64)
    if (128 * scale > _FLOAT32_MAX).any():
        row = int(np.argmax(128 * scale > _FLOAT32_MAX))
        raise ValueError(
            f"quantize_rows: row {row} spans {low[row]:.4g} to {high[row]:.4g}, more than "
            f"int8 with a float32 scale can hold"
        )
    steps = np.divide(
        x - low[:, None], scale[:, None], out=np.zeros_like(x), where=scale[:, None] > 0
    )
    quantized = (np.clip(np.rint(steps), 0, INT8_LEVELS) - 128).astype(np.int8)
    offset = low + 128 * scale
    return quantized, np.stack([scale, offset], axis=1).astype(np.float32)


def dequantize_rows(quantized: np.ndarray, scale_offset: np.ndarray) -> np.ndarray:
    """The float32 rows [R, D] that `quantize_rows`' result stands for, computed
    as the lookup computes them."""
    scale, offset = scale_offset[:, :1], scale_offset[:, 1:]
    return (quantized.astype(np.float32) * scale + offset).astype(np.float32)


def quantized_bytes(rows: int, dim: int) -> int:
    """The bytes of a [rows, dim] table quantized: int8 values, scale and offset."""
    return rows * (dim + SCALE_OFFSET_BYTES)


class QuantizedTable(tf.Module):
    """One table's int8 rows and their scales and offsets, as variables.

    Attributes:
        values: int8 [rows, D].
        scale_offset: float32 [rows, 2], each row's scale and offset.
    """

    def __init__(self, rows: int, dim: int, name: str | None = None) -> None:
        super().__init__(name=name)
        self.values = tf.Variable(tf.zeros([rows, dim], tf.int8), trainable=False, name="values")
        self.scale_offset = tf.Variable(
            tf.zeros([rows, 2], tf.float32), trainable=False, name="scale_offset"
        )

    @classmethod
    def from_variable(cls, table: Any, name: str | None = None) -> QuantizedTable:
        """The quantized copy of a float32 tf.Variable [rows, D], made in row
        blocks (the table is never read whole)."""
        rows, dim = (int(n) for n in table.shape)
        quantized = cls(rows, dim, name=name)
        # Rows whose float64 working copies (`quantize_rows`) take about a block.
        step = max(1, ROW_BLOCK_BYTES // (16 * dim))
        for start in range(0, rows, step):
            values, scale_offset = quantize_rows(read_rows(table, start, min(rows, start + step)))
            assign_rows(quantized.values, start, values)
            assign_rows(quantized.scale_offset, start, scale_offset)
        return quantized

    @property
    def nbytes(self) -> int:
        rows, dim = (int(n) for n in self.values.shape)
        return quantized_bytes(rows, dim)

    def gather(self, ids: tf.Tensor) -> tf.Tensor:
        """Rows `ids` dequantized: float32 [*ids.shape, D]."""
        scale_offset = tf.gather(self.scale_offset, ids)
        values = tf.cast(tf.gather(self.values, ids), tf.float32)
        return values * scale_offset[..., :1] + scale_offset[..., 1:]

    def pooled_lookup(self, ids: Any, pooling: str = "sum") -> tf.Tensor:
        """float32 [B, D] for ids [B] (one-hot), [B, hotness] or a ragged
        [B, None], pooled as `dlrm.embedding.base.pooled_lookup` pools the float32
        table's rows: each row dequantized first, then summed (or averaged)."""
        if isinstance(ids, tf.RaggedTensor):
            found = self.gather(ids.values)
            sums = tf.math.unsorted_segment_sum(found, ids.value_rowids(), ids.nrows())
        else:
            ids = tf.convert_to_tensor(ids)
            if ids.shape.rank == 1:
                return self.gather(ids)
            sums = tf.reduce_sum(self.gather(ids), axis=1)
        return pool(sums, ids, pooling)
