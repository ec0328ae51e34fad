"""Deterministic, sliceable initial values of embedding tables.

Element (row, column) of table t is a hash of (seed, t, row, column) mapped to
uniform(-sqrt(1/rows), sqrt(1/rows)), the reference DLRM's range. Any row or
column slice can be produced on its own, so a rank that owns a shard creates
exactly the values that shard has in a one-process run: N ranks start from the
same weights as 1 rank without ever materialising whole tables.
"""

from __future__ import annotations

import math

import numpy as np

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_MULTIPLIERS = (np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB))
# Elements hashed at a time: three buffers of this many 8-byte values stay in
# the CPU's cache, and in-place passes over them make a table of 2^31 rows
# about 4x faster to initialise than whole-block temporaries did.
_BLOCK_ELEMENTS = 1 << 18


def _mix(values: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: a well-mixed 64-bit hash of each uint64."""
    out = np.array(values, dtype=np.uint64)
    _mix_in_place(out, np.empty_like(out))
    return out


def _mix_in_place(z: np.ndarray, scratch: np.ndarray) -> None:
    """`_mix` of the uint64 array `z`, in place (`scratch`: same shape)."""
    np.add(z, _GOLDEN, out=z)
    for shift, multiplier in zip((30, 27), _MULTIPLIERS, strict=True):
        np.right_shift(z, np.uint64(shift), out=scratch)
        np.bitwise_xor(z, scratch, out=z)
        np.multiply(z, multiplier, out=z)
    np.right_shift(z, np.uint64(31), out=scratch)
    np.bitwise_xor(z, scratch, out=z)


def initial_table_values(
    table: int,
    rows: int,
    dim: int,
    seed: int,
    row_range: tuple[int, int] | None = None,
    column_range: tuple[int, int] | None = None,
) -> np.ndarray:
    """Initial values of rows [r0, r1) x columns [c0, c1) of table `table`.

    Args:
        table: the table's index in the FeatureSpec's categorical order.
        rows, dim: the whole table's shape (the range depends on `rows`).
        seed: the run's seed.
        row_range, column_range: the slice; the whole table by default.

    Returns:
        float32 [r1 - r0, c1 - c0].
    """
    r0, r1 = row_range if row_range is not None else (0, rows)
    c0, c1 = column_range if column_range is not None else (0, dim)
    if not (0 <= r0 <= r1 <= rows and 0 <= c0 <= c1 <= dim):
        raise ValueError(
            f"table {table}: slice rows [{r0}, {r1}) x columns [{c0}, {c1}) is outside "
            f"the table's shape [{rows}, {dim}]"
        )
    limit = math.sqrt(1.0 / rows)
    key = _mix(np.array([seed * 1_000_003 + table], dtype=np.uint64))[0]
    out = np.empty((r1 - r0, c1 - c0), np.float32)
    columns = np.arange(c0, c1, dtype=np.uint64)[None, :]
    step = max(1, _BLOCK_ELEMENTS // max(c1 - c0, 1))
    hashed = np.empty((min(step, r1 - r0), c1 - c0), np.uint64)
    scratch = np.empty_like(hashed)
    unit = np.empty(hashed.shape, np.float64)
    for start in range(r0, r1, step):
        stop = min(start + step, r1)
        z, s, u = hashed[: stop - start], scratch[: stop - start], unit[: stop - start]
        # element = row * dim + column, hashed with the table's key (uint64 wraps).
        np.multiply(np.arange(start, stop, dtype=np.uint64)[:, None], np.uint64(dim), out=z)
        np.add(z, columns, out=z)
        np.bitwise_xor(z, key, out=z)
        _mix_in_place(z, s)
        # The top 53 bits as a uniform in [0, 1), then (2 u - 1) * limit.
        np.right_shift(z, np.uint64(11), out=z)
        u[...] = z
        np.multiply(u, 1.0 / (1 << 53), out=u)
        np.multiply(u, 2.0, out=u)
        np.subtract(u, 1.0, out=u)
        np.multiply(u, limit, out=u)
        out[start - r0 : stop - r0] = u
    return out
