"""`ShardingPlan`: where every table lives, validated on construction, with its
per-rank costs and its JSON form (a plan file, a checkpoint manifest)."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dlrm.embedding.planner.cost import (
    GradientExchange,
    replicated_gradient_exchange,
    shard_lookup_bytes,
    shard_memory_bytes,
    shard_sent_bytes,
)
from dlrm.embedding.planner.types import (
    COLUMN_WISE,
    DATA_PARALLEL,
    DEFAULT_GLOBAL_BATCH_SIZE,
    STRATEGIES,
    TABLE_WISE,
    PlanError,
    TableSpec,
)
from dlrm.embedding.shard import ShardError, ShardingKind, TableShard, check_tiling
from feature_spec.staged import write_file_atomically


@dataclasses.dataclass(frozen=True)
class TablePlan:
    """Table `table` (shape and costs in `spec`): its kind and shards.

    A `data_parallel` table has one whole-table shard per rank; `table_wise` one
    whole-table shard; `column_wise` and `row_wise` at least two shards on
    distinct ranks whose column (row) ranges tile the table.
    """

    table: int
    kind: ShardingKind
    spec: TableSpec
    shards: tuple[TableShard, ...]

    def __post_init__(self) -> None:
        try:
            object.__setattr__(self, "kind", ShardingKind.parse(self.kind, self.table))
        except ShardError as error:
            raise PlanError(str(error)) from error
        where = f"table {self.table} ({self.kind})"
        rows, dim = self.spec.rows, self.spec.dim
        for shard in self.shards:
            if (shard.table, shard.kind) != (self.table, self.kind):
                raise PlanError(f"{where}: holds a shard of table {shard.table} ({shard.kind})")
            if not shard.fits((rows, dim)):
                raise PlanError(
                    f"{where}: shard rows {shard.rows} columns {shard.columns} is outside "
                    f"the table's shape [{rows}, {dim}]"
                )
        ranks = [shard.rank for shard in self.shards]
        if len(set(ranks)) != len(ranks):
            raise PlanError(f"{where}: two shards on one rank (ranks {ranks})")
        full_rows = all(shard.rows == (0, rows) for shard in self.shards)
        full_columns = all(shard.columns == (0, dim) for shard in self.shards)
        fault = ""
        if self.kind in (DATA_PARALLEL, TABLE_WISE):
            valid = full_rows and full_columns and bool(self.shards)
            valid = valid and (self.kind == DATA_PARALLEL or len(self.shards) == 1)
        else:
            # Column (row) slices over every row (column) that tile the table.
            spans_table = full_rows if self.kind == COLUMN_WISE else full_columns
            valid = spans_table and len(self.shards) >= 2
            try:
                check_tiling(self.table, (rows, dim), self.shards)
            except ShardError as error:
                valid, fault = False, f": {error}"
        if not valid:
            layout = [(s.rank, s.rows, s.columns) for s in self.shards]
            raise PlanError(
                f"{where}: shards (rank, rows, columns) {layout} do not cover "
                f"[0, {rows}) x [0, {dim}) as a {self.kind} table must{fault}"
            )


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """Where every embedding table lives on `world_size` ranks.

    Validated on construction: tables 0..T-1 each exactly once, in order, every
    shard on a rank in [0, world_size), data-parallel tables on every rank.
    Memory summaries count `optimizer_slots` slots per element and
    `row_slots` per table row (a column shard keeps its own); gradient
    exchange of replicated tables is costed at `global_batch_size`. `notes` say
    why the planner departed from the thresholds (e.g. to give every rank work).
    """

    world_size: int
    strategy: str
    tables: tuple[TablePlan, ...]
    optimizer_slots: int = 0
    global_batch_size: int = DEFAULT_GLOBAL_BATCH_SIZE
    notes: tuple[str, ...] = ()
    row_slots: int = 0

    def __post_init__(self) -> None:
        if (
            self.world_size < 1
            or min(self.optimizer_slots, self.row_slots) < 0
            or self.global_batch_size < 1
        ):
            raise PlanError(
                f"world size {self.world_size} (expected >= 1), optimizer slots "
                f"{self.optimizer_slots} and row slots {self.row_slots} (expected >= 0), "
                f"global batch size "
                f"{self.global_batch_size} (expected >= 1)"
            )
        if self.strategy not in STRATEGIES:
            raise PlanError(f"strategy {self.strategy!r} is not one of {STRATEGIES}")
        for position, table in enumerate(self.tables):
            if table.table != position:
                raise PlanError(f"plan entry {position} is for table {table.table}")
            ranks = sorted(shard.rank for shard in table.shards)
            if ranks and ranks[-1] >= self.world_size:
                raise PlanError(
                    f"table {table.table}: rank {ranks[-1]} is outside a world of "
                    f"{self.world_size} ranks"
                )
            if table.kind == DATA_PARALLEL and ranks != list(range(self.world_size)):
                raise PlanError(
                    f"table {table.table} (data_parallel): on ranks {ranks}, expected "
                    f"all {self.world_size} ranks"
                )

    def validate(self, tables: Sequence[TableSpec], world_size: int) -> None:
        """Raises PlanError unless this plan fits a run of `world_size` ranks over
        `tables` (same count and shapes; hotness and dtype only change costs)."""
        if world_size != self.world_size:
            raise PlanError(
                f"the sharding plan is for {self.world_size} ranks, this run has {world_size}"
            )
        if len(tables) != len(self.tables):
            raise PlanError(
                f"the sharding plan has {len(self.tables)} tables, the model {len(tables)}"
            )
        for entry, spec in zip(self.tables, tables, strict=True):
            if (entry.spec.rows, entry.spec.dim) != (spec.rows, spec.dim):
                raise PlanError(
                    f"table {entry.table}: the sharding plan has shape [{entry.spec.rows}, "
                    f"{entry.spec.dim}], the model [{spec.rows}, {spec.dim}]"
                )

    # ------------------------------------------------------------------ views

    @property
    def shards(self) -> list[TableShard]:
        """Every shard of every table (a data-parallel table: one per rank)."""
        return [shard for table in self.tables for shard in table.shards]

    def local_shards(self, rank: int) -> list[TableShard]:
        """Every shard `rank` holds, data-parallel copies included."""
        return [shard for shard in self.shards if shard.rank == rank]

    def tables_on(self, rank: int) -> list[int]:
        """Model-parallel tables with a shard on `rank`: under model-parallel input
        the rank reads their ids for the global batch. (Data-parallel tables, see
        `data_parallel_tables`, need ids of the local rows on every rank.)"""
        return [
            t.table
            for t in self.tables
            if t.kind.is_model_parallel and any(s.rank == rank for s in t.shards)
        ]

    def data_parallel_tables(self) -> list[int]:
        return [t.table for t in self.tables if t.kind == DATA_PARALLEL]

    def memory_per_rank(self) -> list[int]:
        """Bytes of embedding values and optimizer slots on each rank."""
        memory = [0] * self.world_size
        for table in self.tables:
            for shard in table.shards:
                memory[shard.rank] += shard_memory_bytes(
                    shard, table.spec, self.optimizer_slots, self.row_slots
                )
        return memory

    def lookup_bytes_per_rank(self) -> list[int]:
        """Model-parallel bytes each rank gathers per global-batch sample.
        Data-parallel lookups are local and the same on every rank: not counted."""
        lookup = [0] * self.world_size
        for table in self.tables:
            if table.kind.is_model_parallel:
                for shard in table.shards:
                    lookup[shard.rank] += shard_lookup_bytes(shard, table.spec)
        return lookup

    def gradient_exchange(self, table: int) -> GradientExchange:
        """How the gradient of replicated table `table` is summed (what the trainer does)."""
        entry = self.tables[table]
        if entry.kind != DATA_PARALLEL:
            raise PlanError(f"table {table} is {entry.kind}, not data_parallel")
        return replicated_gradient_exchange(entry.spec, self.world_size, self.global_batch_size)

    def traffic_bytes_per_rank(self) -> list[int]:
        """Bytes each rank sends per step: alltoall of its model-parallel shards'
        vectors (forward and backward: 2 x (W - 1) / W of [G, width]) plus the
        gradient exchange of the replicated tables."""
        share = (self.world_size - 1) / self.world_size
        sent = [0.0] * self.world_size
        replicated = 0
        for table in self.tables:
            if table.kind == DATA_PARALLEL:
                replicated += self.gradient_exchange(table.table).bytes
                continue
            for shard in table.shards:
                per_sample = shard_sent_bytes(shard, table.spec)
                sent[shard.rank] += 2 * share * self.global_batch_size * per_sample
        return [math.ceil(value) + replicated for value in sent]

    # ---------------------------------------------------------- serialisation

    def to_dict(self, with_shards: bool = True) -> dict[str, Any]:
        """The plan as JSON-serialisable data. Shards appear under their table,
        without the table and kind it gives them. `with_shards=False` leaves them
        out, for a checkpoint manifest that lists them once under its own tables
        (`from_dict(..., shards=...)` puts them back)."""
        tables = []
        for t in self.tables:
            entry: dict[str, Any] = {
                "table": t.table,
                "kind": t.kind.value,
                "spec": dataclasses.asdict(t.spec),
            }
            if with_shards:
                entry["shards"] = [
                    {"rank": s.rank, "rows": list(s.rows), "columns": list(s.columns)}
                    for s in t.shards
                ]
            tables.append(entry)
        data: dict[str, Any] = {
            "world_size": self.world_size,
            "strategy": self.strategy,
            "optimizer_slots": self.optimizer_slots,
            "global_batch_size": self.global_batch_size,
            "notes": list(self.notes),
            "tables": tables,
        }
        if self.row_slots:  # absent: none (plans written before row slots existed)
            data["optimizer_row_slots"] = self.row_slots
        return data

    @classmethod
    def from_dict(
        cls, data: Mapping[str, Any], shards: Sequence[TableShard] | None = None
    ) -> ShardingPlan:
        """The inverse of `to_dict`; PlanError if `data` is not a valid plan.

        A table entry without `shards` (`to_dict(with_shards=False)`) takes its
        shards from `shards`: a model-parallel table those of its index, a
        data-parallel one a whole-table copy on every rank (its copies in
        `shards`, if any, are not needed)."""
        try:
            world_size = int(data["world_size"])
            return cls(
                world_size,
                str(data["strategy"]),
                tuple(_table_plan(t, world_size, shards) for t in data["tables"]),
                int(data.get("optimizer_slots", 0)),
                int(data.get("global_batch_size", DEFAULT_GLOBAL_BATCH_SIZE)),
                tuple(str(note) for note in data.get("notes", ())),
                int(data.get("optimizer_row_slots", 0)),
            )
        except PlanError:
            raise
        except (KeyError, TypeError, ValueError) as error:
            detail = str(error) if isinstance(error, ShardError) else repr(error)
            raise PlanError(f"not a sharding plan: {detail}") from error

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1)

    @classmethod
    def from_json(cls, text: str) -> ShardingPlan:
        return cls.from_dict(json.loads(text))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> ShardingPlan:
        """Reads a plan file written by `save` (PlanError naming the file)."""
        try:
            return cls.from_json(Path(path).read_text())
        except OSError as error:
            raise PlanError(f"{path}: cannot read the sharding plan: {error.strerror}") from error
        except (json.JSONDecodeError, PlanError) as error:
            raise PlanError(f"{path}: {error}") from error

    def save(self, path: str | os.PathLike[str]) -> Path:
        """Writes the plan as JSON, through a temporary file (never half-written)."""
        return write_file_atomically(path, self.to_json() + "\n")


def _table_plan(
    data: Mapping[str, Any], world_size: int, shards: Sequence[TableShard] | None
) -> TablePlan:
    """A table entry of `ShardingPlan.to_dict`, with its shards from `shards` when
    it has none (see `ShardingPlan.from_dict`)."""
    table, spec = int(data["table"]), TableSpec(**data["spec"])
    kind = ShardingKind.parse(data["kind"], table)
    if "shards" in data:
        placed = tuple(TableShard.from_dict(s, table=table, kind=kind) for s in data["shards"])
    elif shards is None:
        raise PlanError(f"table {table}: no shards, and none given")
    elif kind == DATA_PARALLEL:
        whole = (0, spec.rows), (0, spec.dim)
        placed = tuple(TableShard(table, kind, rank, *whole) for rank in range(world_size))
    else:
        placed = tuple(shard for shard in shards if shard.table == table)
    return TablePlan(table, kind, spec, placed)
