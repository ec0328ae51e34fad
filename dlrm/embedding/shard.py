"""The one description of a piece of an embedding table, from the plan to the
layer to the checkpoint manifest, and the one check that pieces tile a table
(`check_tiling`), which the planner and the checkpoints both use.

Pure Python (standard library only): importing it loads no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping, Sequence
from typing import Any

Range = tuple[int, int]

# A table's rows are streamed in blocks of about this many bytes, wherever they
# move: into its variable when it is created, out to a checkpoint's files and back
# (`dlrm.embedding.base`, `dlrm.checkpoint`), so that no copy of a table is made.
ROW_BLOCK_BYTES = 64 << 20


class ShardingKind(str, enum.Enum):
    """How a table is placed on the ranks.

    - `data_parallel`: replicated; one whole-table shard per rank.
    - `table_wise`: one shard, the whole table, on one rank.
    - `column_wise`: column slices over all rows, on distinct ranks.
    - `row_wise`: row ranges over all columns, on distinct ranks.
    """

    DATA_PARALLEL = "data_parallel"
    TABLE_WISE = "table_wise"
    COLUMN_WISE = "column_wise"
    ROW_WISE = "row_wise"

    def __str__(self) -> str:
        return self.value

    @classmethod
    def parse(cls, value: object, table: int) -> ShardingKind:
        """`value` as a kind; ShardError naming table `table` and the kinds if not one."""
        try:
            return cls(value)
        except ValueError as error:
            kinds = [k.value for k in cls]
            raise ShardError(f"table {table}: kind {value!r} is not one of {kinds}") from error

    @property
    def is_model_parallel(self) -> bool:
        """Its lookups cross the alltoall (every kind but `data_parallel`)."""
        return self is not ShardingKind.DATA_PARALLEL


class ShardError(ValueError):
    """A shard description is invalid (negative or empty ranges, unknown kind)."""


@dataclasses.dataclass(frozen=True)
class TableShard:
    """Rows [r0, r1) x columns [c0, c1) of table `table`, placed as `kind`, held
    by `rank`. A data-parallel table has one whole-table `TableShard` per rank."""

    table: int
    kind: ShardingKind
    rank: int
    rows: Range
    columns: Range

    def __post_init__(self) -> None:
        object.__setattr__(self, "kind", ShardingKind.parse(self.kind, self.table))
        (r0, r1), (c0, c1) = self.rows, self.columns
        if self.table < 0 or self.rank < 0 or not (0 <= r0 < r1 and 0 <= c0 < c1):
            raise ShardError(
                f"invalid shard: table {self.table}, rank {self.rank}, rows {list(self.rows)}, "
                f"columns {list(self.columns)}; expected non-negative table and rank and "
                f"non-empty ranges"
            )

    @property
    def height(self) -> int:
        return self.rows[1] - self.rows[0]

    @property
    def width(self) -> int:
        return self.columns[1] - self.columns[0]

    @property
    def elements(self) -> int:
        return self.height * self.width

    def fits(self, shape: tuple[int, int]) -> bool:
        """Whether it lies inside a table of `shape` [rows, columns]."""
        return self.rows[1] <= shape[0] and self.columns[1] <= shape[1]

    def clip(self, rows: Range, columns: Range) -> TableShard | None:
        """Its part inside rows [r0, r1) x columns [c0, c1), as a shard of the same
        table, kind and rank; None when they do not meet."""
        inside_rows = range_intersection(self.rows, rows)
        inside_columns = range_intersection(self.columns, columns)
        if inside_rows is None or inside_columns is None:
            return None
        return dataclasses.replace(self, rows=inside_rows, columns=inside_columns)

    def describe(self) -> str:
        """`rows [0, 8] x columns [0, 7]`, as error messages name a shard's place."""
        return f"rows {list(self.rows)} x columns {list(self.columns)}"

    @property
    def name(self) -> str:
        """`table_3.rows_0_100.cols_0_8`: unique within a checkpoint or a model."""
        return (
            f"table_{self.table}.rows_{self.rows[0]}_{self.rows[1]}"
            f".cols_{self.columns[0]}_{self.columns[1]}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "table": self.table,
            "kind": self.kind.value,
            "rank": self.rank,
            "rows": list(self.rows),
            "columns": list(self.columns),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], **defaults: Any) -> TableShard:
        """The inverse of `to_dict`; `defaults` fill keys that older files lack
        (a plan's shard entries carry no table or kind: the table entry has them)."""
        values = {**defaults, **data}
        try:
            return cls(
                int(values["table"]),
                ShardingKind(values["kind"]),
                int(values["rank"]),
                _pair(values["rows"]),
                _pair(values["columns"]),
            )
        except (KeyError, TypeError, ValueError) as error:
            if isinstance(error, ShardError):
                raise
            raise ShardError(f"not a table shard: {dict(data)!r} ({error!r})") from error


def range_intersection(a: Range, b: Range) -> Range | None:
    """The common part of [a0, a1) and [b0, b1); None when it is empty."""
    start, stop = max(a[0], b[0]), min(a[1], b[1])
    return (start, stop) if start < stop else None


def check_disjoint(table: int, shape: tuple[int, int], shards: Sequence[TableShard]) -> None:
    """Raises ShardError unless every one of `shards` is a shard of table `table`,
    inside its `shape` [rows, columns], and no two of them overlap."""
    for index, shard in enumerate(shards):
        if shard.table != table:
            raise ShardError(f"table {table} lists {shard.name}, a shard of table {shard.table}")
        if not shard.fits(shape):
            raise ShardError(
                f"table {table} of shape {list(shape)} has a shard {shard.describe()} outside it"
            )
        for other in shards[:index]:
            if shard.clip(other.rows, other.columns) is not None:
                raise ShardError(
                    f"table {table} has overlapping shards {shard.describe()} and "
                    f"{other.describe()}"
                )


def check_covers(table: int, rows: Range, columns: Range, shards: Sequence[TableShard]) -> None:
    """Raises ShardError unless `shards`, disjoint (`check_disjoint`), cover rows
    [r0, r1) x columns [c0, c1) of table `table`: their parts inside it add up to it."""
    parts = (shard.clip(rows, columns) for shard in shards)
    covered = sum(part.elements for part in parts if part is not None)
    expected = (rows[1] - rows[0]) * (columns[1] - columns[0])
    if covered != expected:
        raise ShardError(
            f"the shards of table {table} do not cover rows {list(rows)} x columns "
            f"{list(columns)}: they hold {covered} of its {expected} elements"
        )


def check_tiling(table: int, shape: tuple[int, int], shards: Sequence[TableShard]) -> None:
    """Raises ShardError naming the first fault unless `shards` tile table `table`
    of `shape` [rows, columns] exactly: each inside it, no two overlapping, every
    element in one of them."""
    check_disjoint(table, shape, shards)
    check_covers(table, (0, shape[0]), (0, shape[1]), shards)


def _pair(value: Any) -> Range:
    start, stop = value
    return int(start), int(stop)
