"""The cost model: a shard's memory, its lookup and alltoall bytes per sample,
and the cheaper way to sum a replicated table's gradient."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from dlrm.embedding.planner.types import WIRE_BYTES, TableSpec, state_bytes
from dlrm.embedding.shard import TableShard


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
    row_bytes = (spec.dim + 1) * WIRE_BYTES
    dense = math.ceil(2 * share * spec.rows * row_bytes)
    sparse = math.ceil(share * global_batch_size * spec.hotness * row_bytes)
    return (
        GradientExchange("dense", dense) if dense <= sparse else GradientExchange("sparse", sparse)
    )


def shard_memory_bytes(
    shard: TableShard, spec: TableSpec, optimizer_slots: int = 0, row_slots: int = 0
) -> int:
    """Bytes of `shard`'s values and optimizer slots: `optimizer_slots` of its
    shape, `row_slots` of one value per row (a column shard keeps its own)."""
    return state_bytes(shard.height, shard.width, spec.dtype_bytes, optimizer_slots, row_slots)


def shard_lookup_bytes(shard: TableShard, spec: TableSpec) -> int:
    """Bytes `shard` gathers per sample of the global batch: `hotness` row slices
    of its width (a row range is asked for every id; those outside it cost a
    comparison, not a gather, but are counted: their share is not known here)."""
    return spec.hotness * shard.width * spec.dtype_bytes


def shard_sent_bytes(shard: TableShard, spec: TableSpec) -> int:
    """Bytes `shard` sends through the alltoall per sample of the global batch:
    its pooled vector slice (a row range its full-width partial sum), forward;
    the backward sends as many, in float32 (the planner counts no --amp)."""
    return shard.width * WIRE_BYTES


def imbalance(values: Sequence[int]) -> float:
    """max / mean, 1.0 when perfectly balanced (or all zero)."""
    total = sum(values)
    return max(values) * len(values) / total if total else 1.0
