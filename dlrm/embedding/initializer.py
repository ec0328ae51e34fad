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
# Elements hashed per numpy call: bounds the uint64 temporaries (~8 bytes each).
_CHUNK_ELEMENTS = 1 << 22


def _mix(values: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser: a well-mixed 64-bit hash of each uint64."""
    with np.errstate(over="ignore"):
        z = values + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


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
    columns = np.arange(c0, c1, dtype=np.uint64)
    step = max(1, _CHUNK_ELEMENTS // max(c1 - c0, 1))
    for start in range(r0, r1, step):
        stop = min(start + step, r1)
        row_ids = np.arange(start, stop, dtype=np.uint64)[:, None]
        with np.errstate(over="ignore"):
            element = row_ids * np.uint64(dim) + columns[None, :]
            hashed = _mix(element ^ key)
        unit = (hashed >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
        out[start - r0 : stop - r0] = ((2.0 * unit - 1.0) * limit).astype(np.float32)
    return out
