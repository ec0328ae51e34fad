"""The planner's vocabulary: the sharding kinds, strategies and default
thresholds, a table as the planner sees it, and its error."""

from __future__ import annotations

import dataclasses

from dlrm.embedding.shard import ShardingKind

DATA_PARALLEL = ShardingKind.DATA_PARALLEL


TABLE_WISE = ShardingKind.TABLE_WISE


COLUMN_WISE = ShardingKind.COLUMN_WISE


ROW_WISE = ShardingKind.ROW_WISE


STRATEGIES = ("cost", "memory_balanced", "basic")


# Defaults, in elements (rows x dim); docs/sharding.md explains them for Criteo.
# Up to 8192 x 128 (4 MiB in float32): cheaper to replicate and allreduce than to
# send every sample's vector through the alltoall.
DEFAULT_DATA_PARALLEL_THRESHOLD = 8192 * 128


# Above 2^30 (4 GiB in float32; at dim 128, Criteo's five tables of 25 M rows and
# more): sliced by columns, which spreads memory and lookups without adding traffic.
DEFAULT_COLUMN_SLICE_THRESHOLD = 2**30


# Above 2^33 (32 GiB in float32, larger than any Criteo table): split by rows.
# Smaller tables go row-wise only when they do not fit a rank's budget otherwise.
DEFAULT_ROW_SLICE_THRESHOLD = 2**33


# Gradient exchange of replicated tables is costed at this global batch when the
# caller gives none (NVIDIA's default --batch_size).
DEFAULT_GLOBAL_BATCH_SIZE = 65536


class PlanError(ValueError):
    """A table or the model does not fit, or a plan is invalid for this run."""

    # True when the ranks agreed on it through a collective (dlrm.distributed.launcher).
    same_on_every_rank = False


def format_bytes(count: float) -> str:
    """`1536` -> `'1.5 KiB'` (binary units)."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(count) < 1024:
            return f"{count:.0f} B" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1024
    return f"{count:.1f} TiB"


@dataclasses.dataclass(frozen=True)
class TableSpec:
    """One embedding table as the planner sees it: `rows` x `dim` elements of
    `dtype_bytes` bytes (4, or 2 for a 16-bit table: `--embedding_dtype`),
    `hotness` ids per sample (pooled). Optimizer slots are float32 whatever
    the table's dtype (`SLOT_BYTES`)."""

    rows: int
    dim: int
    hotness: int = 1
    dtype_bytes: int = 4

    def __post_init__(self) -> None:
        for name in ("rows", "dim", "hotness", "dtype_bytes"):
            if getattr(self, name) < 1:
                raise PlanError(f"table {name}: expected >= 1, got {getattr(self, name)}")

    @property
    def elements(self) -> int:
        return self.rows * self.dim

    def describe(self, index: int, optimizer_slots: int = 0, row_slots: int = 0) -> str:
        """`table 3 (40,000,000 x 128, 38.1 GiB with 1 optimizer slot(s))`."""
        with_slots = f" with {optimizer_slots} optimizer slot(s)" if optimizer_slots else ""
        if row_slots:
            with_slots += f" with {row_slots} optimizer slot(s) per row"
        size = format_bytes(self.memory_bytes(optimizer_slots, row_slots))
        return f"table {index} ({self.rows:,} x {self.dim:,}, {size}{with_slots})"

    def memory_bytes(self, optimizer_slots: int = 0, row_slots: int = 0) -> int:
        """Bytes of the whole table with its optimizer slots."""
        return state_bytes(self.rows, self.dim, self.dtype_bytes, optimizer_slots, row_slots)


# Bytes of an optimizer slot's value: slots stay float32 on 16-bit tables
# (Adagrad's and Adam's small increments would be lost in 16 bits).
SLOT_BYTES = 4

# Bytes of a value that crosses between ranks (the vectors, their gradients, a
# replicated table's gradient): float32 whatever the table's dtype.
WIRE_BYTES = 4


def state_bytes(
    rows: int, columns: int, dtype_bytes: int, optimizer_slots: int = 0, row_slots: int = 0
) -> int:
    """Bytes of `rows` x `columns` values of `dtype_bytes` with `optimizer_slots`
    float32 slots of that shape and `row_slots` of one value per row ([rows, 1],
    row-wise Adagrad's)."""
    return rows * (columns * dtype_bytes + SLOT_BYTES * (columns * optimizer_slots + row_slots))
