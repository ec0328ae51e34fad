"""The one description of a piece of an embedding table, from the plan to the
layer to the checkpoint manifest.

Pure Python (standard library only): importing it loads no TensorFlow.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from typing import Any

Range = tuple[int, int]


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


def _pair(value: Any) -> Range:
    start, stop = value
    return int(start), int(stop)
