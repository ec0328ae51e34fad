"""Placing the tables: each table's kind and shards from the thresholds and the
memory budget, then ranks for the shards by the strategy."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence

from dlrm.embedding.planner.cost import shard_lookup_bytes, shard_memory_bytes
from dlrm.embedding.planner.plan import ShardingPlan, TablePlan
from dlrm.embedding.planner.types import (
    COLUMN_WISE,
    DATA_PARALLEL,
    DEFAULT_COLUMN_SLICE_THRESHOLD,
    DEFAULT_DATA_PARALLEL_THRESHOLD,
    DEFAULT_GLOBAL_BATCH_SIZE,
    DEFAULT_ROW_SLICE_THRESHOLD,
    ROW_WISE,
    STRATEGIES,
    TABLE_WISE,
    PlanError,
    TableSpec,
    format_bytes,
    state_bytes,
)
from dlrm.embedding.shard import Range, ShardingKind, TableShard


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
        row_slots: optimizer values kept per table row (row-wise Adagrad 1).
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
    row_slots: int = 0

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
        if self.row_slots < 0:
            raise PlanError(f"optimizer row slots: expected >= 0, got {self.row_slots}")


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


Layout = tuple[ShardingKind, list[tuple[Range, Range]]]


def _layout(index: int, spec: TableSpec, config: PlannerConfig, available: int | None) -> Layout:
    """The kind of table `index` and its shards' (rows, columns), ranks not yet chosen.

    `available` is what a rank's budget leaves after the data-parallel tables.
    """
    n, slots, row_slots = config.world_size, config.optimizer_slots, config.row_slots
    whole = (0, spec.rows), (0, spec.dim)

    def bytes_of(rows: int, columns: int) -> int:
        return state_bytes(rows, columns, spec.dtype_bytes, slots, row_slots)

    def fits(rows: int, columns: int) -> bool:
        return available is None or bytes_of(rows, columns) <= available

    if n == 1:
        if not fits(spec.rows, spec.dim):
            raise PlanError(
                f"{spec.describe(index, slots, row_slots)} does not fit the budget of 1 rank: "
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
    largest = bytes_of(math.ceil(spec.rows / parts), spec.dim)
    if not fits(math.ceil(spec.rows / parts), spec.dim):
        raise PlanError(
            f"{spec.describe(index, slots, row_slots)} does not fit {n} ranks x "
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


class _RankLoads:
    """Each rank's memory and lookup bytes so far, as shares of the ideal per-rank
    load, so that bytes of memory and bytes of lookup traffic are comparable."""

    def __init__(self, costs: list[tuple[int, int]], world_size: int, strategy: str) -> None:
        self.costs, self.strategy = costs, strategy
        self.ideal_memory = max(sum(m for m, _ in costs) / world_size, 1.0)
        self.ideal_lookup = max(sum(k for _, k in costs) / world_size, 1.0)
        self.memory, self.lookup = [0] * world_size, [0] * world_size

    def weight(self, i: int) -> tuple[float, int]:
        """Heavier pieces first: their place matters most."""
        if self.strategy == "memory_balanced":
            return -self.costs[i][0], i
        return -max(self.costs[i][0] / self.ideal_memory, self.costs[i][1] / self.ideal_lookup), i

    def score(self, i: int, rank: int) -> tuple[float, float, int]:
        """How loaded `rank` would be with piece `i` (lower is better)."""
        share_memory = (self.memory[rank] + self.costs[i][0]) / self.ideal_memory
        share_lookup = (self.lookup[rank] + self.costs[i][1]) / self.ideal_lookup
        if self.strategy == "memory_balanced":
            return share_memory, share_lookup, rank
        return max(share_memory, share_lookup), share_memory + share_lookup, rank

    def add(self, i: int, rank: int) -> None:
        self.memory[rank] += self.costs[i][0]
        self.lookup[rank] += self.costs[i][1]


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
            shard_memory_bytes(
                shard, tables[shard.table], config.optimizer_slots, config.row_slots
            ),
            shard_lookup_bytes(shard, tables[shard.table]),
        )
        for shard in pieces
    ]
    loads = _RankLoads(costs, n, config.strategy)
    basic = config.strategy == "basic"
    order = range(len(pieces)) if basic else sorted(range(len(pieces)), key=loads.weight)
    ranks = [0] * len(pieces)
    taken: set[tuple[int, int]] = set()  # (table, rank): one shard of a table per rank
    for count, i in enumerate(order):
        table, need = pieces[i].table, costs[i][0]
        allowed = [count % n] if basic else [r for r in range(n) if (table, r) not in taken]
        fitting = [r for r in allowed if available is None or loads.memory[r] + need <= available]
        if not fitting:
            raise _fits_no_rank(pieces[i], need, allowed, loads, available, config.strategy)
        ranks[i] = min(fitting, key=lambda r: loads.score(i, r))
        taken.add((table, ranks[i]))
        loads.add(i, ranks[i])
    return ranks


def _fits_no_rank(
    shard: TableShard,
    need: int,
    allowed: list[int],
    loads: _RankLoads,
    available: int | None,
    strategy: str,
) -> PlanError:
    rank = min(allowed, key=lambda r: loads.memory[r])
    left = available or 0  # only a budget makes a rank not fit
    return PlanError(
        f"table {shard.table} shard rows {shard.rows} columns {shard.columns} "
        f"({format_bytes(need)}) fits no rank ({strategy} strategy): "
        f"rank {rank} would hold {format_bytes(loads.memory[rank] + need)}, "
        f"{format_bytes(loads.memory[rank] + need - left)} over the "
        f"{format_bytes(left)} its budget leaves for model-parallel shards"
    )


def plan_sharding(tables: Sequence[TableSpec], config: PlannerConfig) -> ShardingPlan:
    """Plans where every table lives; see the module docstring and docs/sharding.md.

    Raises:
        PlanError: the data-parallel tables, one table or the whole model does not
            fit the memory budget, or the greedy placement finds no rank for a shard.
    """
    n, slots, budget = config.world_size, config.optimizer_slots, config.memory_budget_bytes
    row_slots = config.row_slots
    replicated = [n > 1 and spec.elements <= config.data_parallel_threshold for spec in tables]
    sizes = [spec.memory_bytes(slots, row_slots) for spec in tables]
    per_rank = sum(size for size, r in zip(sizes, replicated, strict=True) if r)
    needed = n * per_rank + sum(size for size, r in zip(sizes, replicated, strict=True) if not r)
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
        n,
        config.strategy,
        tuple(plans),
        slots,
        config.global_batch_size,
        tuple(notes),
        row_slots,
    )
