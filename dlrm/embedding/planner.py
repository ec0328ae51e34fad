"""The embedding sharding planner: table sizes in, a `ShardingPlan` out.

Pure computation (the standard library, the shard types and `feature_spec.staged`;
importing it loads numpy and yaml, never TensorFlow or Horovod):
`plan_sharding(tables, config)` decides
for every table a kind and its shards, and returns a frozen, JSON-serialisable
`ShardingPlan` that the hybrid-parallel embedding layer, the input pipeline and
the checkpoints read. Kinds:

- `data_parallel`: replicated; one shard per rank, each the whole table.
- `table_wise`: one shard, the whole table, on one rank.
- `column_wise`: column slices over full rows, on distinct ranks.
- `row_wise`: row ranges over full columns, on distinct ranks.

Cost model, per shard of `r` rows and `c` columns: memory is
`r * c * dtype_bytes * (1 + optimizer_slots)`; lookup traffic is
`hotness * c * dtype_bytes` per sample of the global batch (a row shard sends
`c` columns per sample too: it takes part in the reduction). Strategies place
the shards of model-parallel tables: `cost` (greedy on the larger of the memory
and lookup shares), `memory_balanced` (greedy on memory) and `basic` (round
robin, the baseline). See docs/sharding.md for the thresholds and their defaults.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from dlrm.embedding.shard import Range, ShardError, ShardingKind, TableShard, check_tiling
from feature_spec.staged import write_file_atomically

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
    `dtype_bytes` bytes, `hotness` ids per sample (pooled)."""

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

    def memory_bytes(self, optimizer_slots: int = 0) -> int:
        """Bytes of the whole table with its optimizer slots."""
        return self.elements * self.dtype_bytes * (1 + optimizer_slots)


@dataclasses.dataclass(frozen=True)
class GradientExchange:
    """How the gradient of a replicated table is summed over the ranks each step.

    `dense`: the table-sized gradient with a count of lookups per row (so that
    only rows looked up on some rank are updated) in one ring allreduce;
    `sparse`: every rank's looked-up rows (values and ids) allgathered. `bytes`
    is what one rank sends per step, the cheaper of the two.
    """

    method: str
    bytes: int


def replicated_gradient_exchange(
    spec: TableSpec, world_size: int, global_batch_size: int
) -> GradientExchange:
    """The cheaper way to sum a replicated table's gradient over `world_size` ranks.

    A ring allreduce sends 2 (W - 1) / W of the [rows, dim + 1] array per rank;
    an allgather of the sparse gradient sends (W - 1) / W of the global batch's
    `global_batch_size x hotness` rows of dim + 1 values (the id with them).
    The trainer applies this same choice, so the plan's figures are what runs.
    """
    if world_size == 1:
        return GradientExchange("none", 0)
    share = (world_size - 1) / world_size
    row_bytes = (spec.dim + 1) * spec.dtype_bytes
    dense = math.ceil(2 * share * spec.rows * row_bytes)
    sparse = math.ceil(share * global_batch_size * spec.hotness * row_bytes)
    return (
        GradientExchange("dense", dense) if dense <= sparse else GradientExchange("sparse", sparse)
    )


def shard_memory_bytes(shard: TableShard, spec: TableSpec, optimizer_slots: int = 0) -> int:
    """Bytes of `shard`'s values and optimizer slots."""
    return shard.elements * spec.dtype_bytes * (1 + optimizer_slots)


def shard_lookup_bytes(shard: TableShard, spec: TableSpec) -> int:
    """Bytes `shard` gathers per sample of the global batch: `hotness` row slices
    of its width (a row range is asked for every id; those outside it cost a
    comparison, not a gather, but are counted: their share is not known here)."""
    return spec.hotness * shard.width * spec.dtype_bytes


def shard_sent_bytes(shard: TableShard, spec: TableSpec) -> int:
    """Bytes `shard` sends through the alltoall per sample of the global batch:
    its pooled vector slice (a row range its full-width partial sum), forward;
    the backward sends as many."""
    return shard.width * spec.dtype_bytes


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
    Memory summaries count `optimizer_slots` slots per element; gradient
    exchange of replicated tables is costed at `global_batch_size`. `notes` say
    why the planner departed from the thresholds (e.g. to give every rank work).
    """

    world_size: int
    strategy: str
    tables: tuple[TablePlan, ...]
    optimizer_slots: int = 0
    global_batch_size: int = DEFAULT_GLOBAL_BATCH_SIZE
    notes: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if self.world_size < 1 or self.optimizer_slots < 0 or self.global_batch_size < 1:
            raise PlanError(
                f"world size {self.world_size} (expected >= 1), optimizer slots "
                f"{self.optimizer_slots} (expected >= 0), global batch size "
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
                memory[shard.rank] += shard_memory_bytes(shard, table.spec, self.optimizer_slots)
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
        return {
            "world_size": self.world_size,
            "strategy": self.strategy,
            "optimizer_slots": self.optimizer_slots,
            "global_batch_size": self.global_batch_size,
            "notes": list(self.notes),
            "tables": tables,
        }

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

    def format_table(self) -> str:
        """The plan as text: one line per table, then one per rank, then balance."""
        slots = self.optimizer_slots
        lines = [
            f"Sharding plan ({self.strategy}): {len(self.tables)} tables on "
            f"{self.world_size} ranks, {slots} optimizer slot(s) per element, "
            f"costed at a global batch of {self.global_batch_size:,}",
            f"{'table':>5}  {'rows':>13}  {'dim':>4}  {'kind':<13}  {'bytes':>10}  placement",
        ]
        for t in self.tables:
            if t.kind == DATA_PARALLEL:
                exchange = self.gradient_exchange(t.table)
                placement = (
                    f"every rank ({self.world_size}); gradient: {exchange.method} "
                    f"{format_bytes(exchange.bytes)}/step"
                )
            elif t.kind == TABLE_WISE:
                placement = f"rank {t.shards[0].rank}"
            else:
                placement = " ".join(
                    f"r{s.rank}[{s.rows[0]}:{s.rows[1]}, :]"
                    if t.kind == ROW_WISE
                    else f"r{s.rank}[:, {s.columns[0]}:{s.columns[1]}]"
                    for s in sorted(t.shards, key=lambda s: (s.rows, s.columns))
                )
            size = format_bytes(t.spec.memory_bytes(slots))
            shape = f"{t.spec.rows:>13,}  {t.spec.dim:>4}"
            lines.append(f"{t.table:>5}  {shape}  {t.kind.value:<13}  {size:>10}  {placement}")
        memory, lookup = self.memory_per_rank(), self.lookup_bytes_per_rank()
        traffic = self.traffic_bytes_per_rank()
        lines.append(
            f"{'rank':>5}  {'memory':>10}  {'lookup/sample':>13}  {'sent/step':>10}  tables"
        )
        for rank in range(self.world_size):
            tables = ",".join(str(t) for t in self.tables_on(rank)) or "-"
            lines.append(
                f"{rank:>5}  {format_bytes(memory[rank]):>10}  "
                f"{format_bytes(lookup[rank]):>13}  {format_bytes(traffic[rank]):>10}  {tables}"
            )
        lines.append(f"max/mean: memory {_imbalance(memory):.3f}, lookup {_imbalance(lookup):.3f}")
        lines.extend(f"note: {note}" for note in self.notes)
        return "\n".join(lines)


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


def _imbalance(values: Sequence[int]) -> float:
    """max / mean, 1.0 when perfectly balanced (or all zero)."""
    total = sum(values)
    return max(values) * len(values) / total if total else 1.0


# ------------------------------------------------------------------- planner


@dataclasses.dataclass(frozen=True)
class PlannerConfig:
    """How to plan. Thresholds are in elements (rows x dim).

    Attributes:
        world_size: ranks.
        memory_budget_bytes: embedding bytes (values and optimizer slots) each
            rank may hold; None for no limit.
        data_parallel_threshold: tables of at most this many elements are
            replicated (`--data_parallel_threshold`).
        column_slice_threshold: larger tables are sliced by columns
            (`--column_slice_threshold`).
        row_slice_threshold: larger tables are split by rows
            (`--row_slice_threshold`).
        strategy: `cost`, `memory_balanced` or `basic` (`--sharding_strategy`).
        optimizer_slots: optimizer values kept per element (Adagrad 1, Adam 2).
        global_batch_size: the training batch, for the cost of exchanging the
            replicated tables' gradients (`--batch_size`).
    """

    world_size: int
    memory_budget_bytes: int | None = None
    data_parallel_threshold: int = DEFAULT_DATA_PARALLEL_THRESHOLD
    column_slice_threshold: int = DEFAULT_COLUMN_SLICE_THRESHOLD
    row_slice_threshold: int = DEFAULT_ROW_SLICE_THRESHOLD
    strategy: str = "cost"
    optimizer_slots: int = 0
    global_batch_size: int = DEFAULT_GLOBAL_BATCH_SIZE

    def __post_init__(self) -> None:
        if self.global_batch_size < 1:
            raise PlanError(f"--batch_size: expected >= 1, got {self.global_batch_size}")
        if self.world_size < 1:
            raise PlanError(f"world size: expected >= 1, got {self.world_size}")
        if self.memory_budget_bytes is not None and self.memory_budget_bytes < 1:
            raise PlanError(f"memory budget: expected >= 1 byte, got {self.memory_budget_bytes}")
        for name in ("data_parallel_threshold", "column_slice_threshold", "row_slice_threshold"):
            if getattr(self, name) < 0:
                raise PlanError(f"--{name}: expected >= 0, got {getattr(self, name)}")
        if self.strategy not in STRATEGIES:
            raise PlanError(
                f"--sharding_strategy: expected one of {STRATEGIES}, got {self.strategy!r}"
            )
        if self.optimizer_slots < 0:
            raise PlanError(f"optimizer slots: expected >= 0, got {self.optimizer_slots}")


def _split(size: int, parts: int, unit: int = 1) -> list[Range]:
    """[0, size) in `parts` ranges of whole `unit`s (`size` divides by `unit`) whose
    lengths differ by at most one unit, longer ones first."""
    base, extra = divmod(size // unit, parts)
    bounds = [0]
    for part in range(parts):
        bounds.append(bounds[-1] + unit * (base + (1 if part < extra else 0)))
    return list(itertools.pairwise(bounds))


def _widest(ranges: Sequence[Range]) -> int:
    return max(stop - start for start, stop in ranges)


def _column_slices(dim: int, parts: int) -> list[Range]:
    """Column slices whose widths are multiples of 4 where `dim` allows (whole
    16-byte float32 vectors), otherwise as equal as possible."""
    unit = 4 if dim % 4 == 0 and dim // 4 >= parts else 1
    return _split(dim, parts, unit)


def _describe(index: int, spec: TableSpec, slots: int) -> str:
    """`table 3 (40,000,000 x 128, 38.1 GiB with 1 optimizer slot(s))`."""
    with_slots = f" with {slots} optimizer slot(s)" if slots else ""
    size = format_bytes(spec.memory_bytes(slots))
    return f"table {index} ({spec.rows:,} x {spec.dim:,}, {size}{with_slots})"


Layout = tuple[ShardingKind, list[tuple[Range, Range]]]


def _layout(index: int, spec: TableSpec, config: PlannerConfig, available: int | None) -> Layout:
    """The kind of table `index` and its shards' (rows, columns), ranks not yet chosen.

    `available` is what a rank's budget leaves after the data-parallel tables.
    """
    n, slots = config.world_size, config.optimizer_slots
    whole = (0, spec.rows), (0, spec.dim)

    def fits(rows: int, columns: int) -> bool:
        return available is None or rows * columns * spec.dtype_bytes * (1 + slots) <= available

    if n == 1:
        if not fits(spec.rows, spec.dim):
            raise PlanError(
                f"{_describe(index, spec, slots)} does not fit the budget of 1 rank: "
                f"{format_bytes(available or 0)} left after the data-parallel tables"
            )
        return TABLE_WISE, [whole]
    if spec.elements <= config.data_parallel_threshold:
        return DATA_PARALLEL, [whole] * n
    if spec.elements <= config.row_slice_threshold:
        if spec.elements > config.column_slice_threshold and spec.dim >= 2:
            most = min(n, spec.dim)
            parts = min(
                most, max(2, math.ceil(spec.elements / max(config.column_slice_threshold, 1)))
            )
            while parts < most and not fits(spec.rows, _widest(_column_slices(spec.dim, parts))):
                parts += 1
            slices = _column_slices(spec.dim, parts)
            if fits(spec.rows, _widest(slices)):
                return COLUMN_WISE, [((0, spec.rows), c) for c in slices]
        elif fits(spec.rows, spec.dim):
            return TABLE_WISE, [whole]
    # Row-wise: as few row ranges as the threshold and the budget allow, since
    # each one adds a full-width partial sum per sample to the reduction.
    most = min(n, spec.rows)
    parts = min(most, max(2, math.ceil(spec.elements / max(config.row_slice_threshold, 1))))
    while parts < most and not fits(math.ceil(spec.rows / parts), spec.dim):
        parts += 1
    largest = math.ceil(spec.rows / parts) * spec.dim * spec.dtype_bytes * (1 + slots)
    if not fits(math.ceil(spec.rows / parts), spec.dim):
        raise PlanError(
            f"{_describe(index, spec, slots)} does not fit {n} ranks x "
            f"{format_bytes(config.memory_budget_bytes or 0)}: split by rows over {parts} "
            f"ranks, a shard needs {format_bytes(largest)}, and a rank has "
            f"{format_bytes(available or 0)} left after the data-parallel tables"
        )
    if parts == 1:  # a one-row table cannot be split by rows
        return TABLE_WISE, [whole]
    return ROW_WISE, [(r, (0, spec.dim)) for r in _split(spec.rows, parts)]


def _use_every_rank(
    layouts: Sequence[Layout], tables: Sequence[TableSpec], world_size: int
) -> tuple[list[Layout], list[str]]:
    """Slices the largest model-parallel tables further when they have fewer
    shards than there are ranks, so that every rank holds one and none sits idle
    in the lookups and the alltoall. Column slices first (they add no traffic),
    rows once a table has fewer columns than slices. Returns the layouts and a
    note per table changed."""
    parts = {t: len(shards) for t, (kind, shards) in enumerate(layouts) if kind.is_model_parallel}
    before = sum(parts.values())
    if not parts or before >= world_size:
        return list(layouts), []

    def can_split(t: int) -> bool:
        return parts[t] < world_size and parts[t] < max(tables[t].dim, tables[t].rows)

    while sum(parts.values()) < world_size:
        candidates = [t for t in parts if can_split(t)]
        if not candidates:  # every table is split as far as it goes
            break
        largest = max(candidates, key=lambda t: (tables[t].elements / parts[t], -t))
        parts[largest] += 1
    result, notes = list(layouts), []
    for t, count in sorted(parts.items()):
        kind, shards = layouts[t]
        if count == len(shards):
            continue
        spec = tables[t]
        if kind != ROW_WISE and count <= spec.dim:
            new: Layout = (
                COLUMN_WISE,
                [((0, spec.rows), c) for c in _column_slices(spec.dim, count)],
            )
        else:
            new = (ROW_WISE, [(r, (0, spec.dim)) for r in _split(spec.rows, count)])
        result[t] = new
        notes.append(
            f"table {t} ({spec.rows:,} x {spec.dim}) is {new[0].value} in {count} slices, "
            f"not {kind.value} in {len(shards)}: the model-parallel tables had "
            f"{before} shard(s) for {world_size} ranks, and a rank without one sits "
            f"idle in the lookups"
        )
    return result, notes


def _choose_ranks(
    pieces: list[TableShard],
    tables: Sequence[TableSpec],
    config: PlannerConfig,
    available: int | None,
) -> list[int]:
    """The rank of every (table, shard) piece by `config.strategy`, with the cost
    model of the module docstring; PlanError if a piece fits no rank."""
    n = config.world_size
    costs = [
        (
            shard_memory_bytes(shard, tables[shard.table], config.optimizer_slots),
            shard_lookup_bytes(shard, tables[shard.table]),
        )
        for shard in pieces
    ]
    # Normalise by the ideal per-rank load so that bytes of memory and bytes of
    # lookup traffic are comparable.
    ideal_memory = max(sum(m for m, _ in costs) / n, 1.0)
    ideal_lookup = max(sum(k for _, k in costs) / n, 1.0)
    memory, lookup = [0] * n, [0] * n
    taken: set[tuple[int, int]] = set()  # (table, rank): one shard of a table per rank

    def score(i: int, rank: int) -> tuple[float, float, int]:
        share_memory = (memory[rank] + costs[i][0]) / ideal_memory
        share_lookup = (lookup[rank] + costs[i][1]) / ideal_lookup
        if config.strategy == "memory_balanced":
            return share_memory, share_lookup, rank
        return max(share_memory, share_lookup), share_memory + share_lookup, rank

    def weight(i: int) -> tuple[float, int]:
        if config.strategy == "memory_balanced":
            return -costs[i][0], i
        return -max(costs[i][0] / ideal_memory, costs[i][1] / ideal_lookup), i

    order = (
        range(len(pieces)) if config.strategy == "basic" else sorted(range(len(pieces)), key=weight)
    )
    ranks = [0] * len(pieces)
    for count, i in enumerate(order):
        shard = pieces[i]
        table = shard.table
        if config.strategy == "basic":
            allowed = [count % n]
        else:
            allowed = [r for r in range(n) if (table, r) not in taken]
        need = costs[i][0]
        fitting = [r for r in allowed if available is None or memory[r] + need <= available]
        if not fitting:
            rank = min(allowed, key=lambda r: memory[r])
            left = available or 0  # only a budget makes a rank not fit
            raise PlanError(
                f"table {table} shard rows {shard.rows} columns {shard.columns} "
                f"({format_bytes(need)}) fits no rank ({config.strategy} strategy): "
                f"rank {rank} would hold {format_bytes(memory[rank] + need)}, "
                f"{format_bytes(memory[rank] + need - left)} over the "
                f"{format_bytes(left)} its budget leaves for model-parallel shards"
            )
        ranks[i] = min(fitting, key=lambda r: score(i, r))
        taken.add((table, ranks[i]))
        memory[ranks[i]] += need
        lookup[ranks[i]] += costs[i][1]
    return ranks


def plan_sharding(tables: Sequence[TableSpec], config: PlannerConfig) -> ShardingPlan:
    """Plans where every table lives; see the module docstring and docs/sharding.md.

    Raises:
        PlanError: the data-parallel tables, one table or the whole model does not
            fit the memory budget, or the greedy placement finds no rank for a shard.
    """
    n, slots, budget = config.world_size, config.optimizer_slots, config.memory_budget_bytes
    replicated = [n > 1 and spec.elements <= config.data_parallel_threshold for spec in tables]
    per_rank = sum(s.memory_bytes(slots) for s, r in zip(tables, replicated, strict=True) if r)
    needed = n * per_rank + sum(
        s.memory_bytes(slots) for s, r in zip(tables, replicated, strict=True) if not r
    )
    if budget is not None and per_rank > budget:
        raise PlanError(
            f"the data-parallel tables need {format_bytes(per_rank)} on every rank, more "
            f"than the {format_bytes(budget)} budget; lower --data_parallel_threshold"
        )
    if budget is not None and needed > n * budget:
        raise PlanError(
            f"the model needs {format_bytes(needed)} ({format_bytes(per_rank)} of "
            f"data-parallel tables on each of {n} ranks), the budget of {n} ranks is "
            f"{format_bytes(n * budget)} in total ({format_bytes(budget)} per rank)"
        )
    available = None if budget is None else budget - per_rank
    layouts = [_layout(index, spec, config, available) for index, spec in enumerate(tables)]
    layouts, notes = _use_every_rank(layouts, tables, n)
    pieces = [
        TableShard(index, kind, 0, rows, columns)
        for index, (kind, shards) in enumerate(layouts)
        if kind.is_model_parallel
        for rows, columns in shards
    ]
    ranks = iter(_choose_ranks(pieces, tables, config, available))
    plans = []
    for index, (kind, shards) in enumerate(layouts):
        # Data-parallel: shard i (the whole table) is rank i's copy.
        placed = tuple(
            TableShard(index, kind, rank if kind == DATA_PARALLEL else next(ranks), rows, columns)
            for rank, (rows, columns) in enumerate(shards)
        )
        plans.append(TablePlan(index, kind, tables[index], placed))
    return ShardingPlan(
        n, config.strategy, tuple(plans), slots, config.global_batch_size, tuple(notes)
    )
