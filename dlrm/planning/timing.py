"""A training step's time on each rank, term by term.

With global batch G on W = H x R ranks (H hosts of R ranks), L = G / W rows per
rank, a the compute and wire bytes (2 under `--amp`, else 4):

- **dense compute**: `dense_training_flops(model) x L / rate`, the rate being the
  device's float32 (TF32 on GPUs that have it) or 16-bit rate times its matmul
  efficiency (`DeviceSpec.matmul_flops_per_s`);
- **lookups and update**: bytes moved through memory over its bandwidth: every
  row a rank gathers is read once forward (G x hotness rows of a shard's columns,
  L x hotness of a replicated table), then read and written by the update, with its
  optimizer slots read and written too (an element slot as wide as the row, a
  row-wise slot one value);
- **alltoall of ids** (`--input_mode data_parallel` only: under model-parallel
  input each rank reads its tables' ids itself), **of vectors** and **of their
  gradients**: a rank sends (W - 1) / W of its buffer, (R - 1) / (W - 1) of it to
  the ranks of its host and the rest to other hosts, over the two links at once
  (the slower sets the time; a rank's receives are costed alike, and the larger
  counts), plus one message's latency per peer, one after another (an upper
  bound), per chunk of the dense part (`--dense_chunk_rows`: the vectors of each
  chunk cross on their own);
- **dense allreduce**: a ring over W ranks, `2 (W - 1) / W x 4 P` bytes (P dense
  parameters, float32 gradients) over the slowest link of the ring (between
  hosts when there are several) plus `2 (W - 1)` latencies;
- **replicated gradients**: the replicated tables' gradient exchanges as the
  planner costs them (`ShardingPlan.gradient_exchange`: bytes a rank sends), over
  the same link, with one ring's latencies for them all (Horovod fuses a step's
  allreduces into one buffer).

Every round of collectives (an alltoall of each chunk, the fused allreduce) also
costs the device's `collective_overhead_us`: Horovod runs a collective at its
background thread's next cycle, after the ranks have negotiated it. The ids' round,
each chunk's vectors and gradients, and the dense allreduce (the replicated
tables' gradients fused into it) each pay it once.

The step is their sum on the slowest rank, with one overlap taken into account:
under `--exchange_ids_ahead` (the default) the next batch's ids cross during this
step's dense part, so only what of the ids' alltoall is longer than the dense compute
stays on the step (`alltoall_ids`; the rest is `alltoall_ids_hidden`). Nothing else
is taken to overlap (the CPU path overlaps a chunk's vectors with another chunk's
compute, so this is an upper bound there).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dlrm.app.config import RunConfig
from dlrm.embedding.planner.plan import ShardingPlan
from dlrm.embedding.planner.types import DATA_PARALLEL, ROW_WISE
from dlrm.model.config import ModelConfig, dense_training_flops
from dlrm.optim.config import optimizer_spec
from dlrm.planning.memory import (
    ID_BYTES,
    compute_bytes,
    dense_chunk_rows,
    dense_parameters,
)
from dlrm.planning.world import World


@dataclasses.dataclass(frozen=True)
class StepTime:
    """Seconds of one step on one rank, by term (see the module's docstring)."""

    rank: int
    dense_compute: float
    lookups_update: float
    alltoall_ids: float
    alltoall_vectors: float
    alltoall_gradients: float
    dense_allreduce: float
    replicated_gradients: float
    # Shares of the alltoalls' bytes that stay within a host and cross hosts.
    intra_host_share: float = 0.0
    inter_host_share: float = 0.0
    # The ids' alltoall behind the dense part (`--exchange_ids_ahead`): not in the step.
    alltoall_ids_hidden: float = 0.0

    TERMS = (
        "dense_compute",
        "lookups_update",
        "alltoall_ids",
        "alltoall_vectors",
        "alltoall_gradients",
        "dense_allreduce",
        "replicated_gradients",
    )

    @property
    def total(self) -> float:
        return sum(getattr(self, term) for term in self.TERMS)

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            **{f"{term}_s": getattr(self, term) for term in self.TERMS},
            "total_s": self.total,
            "alltoall_ids_hidden_s": self.alltoall_ids_hidden,
            "alltoall_intra_host_share": self.intra_host_share,
            "alltoall_inter_host_share": self.inter_host_share,
        }


def _alltoall_seconds(world: World, sent: float, received: float, messages: int) -> float:
    """An alltoall in which a rank sends `sent` and receives `received` bytes in all
    (to and from every rank, itself included), in `messages` rounds."""
    size, per_host = world.size, world.ranks_per_host
    if size == 1 or (sent == 0 and received == 0):
        return 0.0
    intra = (per_host - 1) / size
    inter = (size - per_host) / size
    busiest = max(sent, received)
    seconds = max(
        busiest * intra / world.intra_host.bytes_per_s,
        busiest * inter / world.inter_host.bytes_per_s,
    )
    latency = (per_host - 1) * world.intra_host.latency_s
    latency += (size - per_host) * world.inter_host.latency_s
    return seconds + messages * (latency + world.collective_overhead_s)


def _ring_seconds(world: World, sent_bytes: float) -> float:
    """A ring collective in which a rank sends `sent_bytes` in 2 (W - 1) steps, at
    the ring's slowest link (between hosts when there are several)."""
    size = world.size
    if size == 1:
        return 0.0
    link = world.inter_host if world.hosts > 1 else world.intra_host
    return link.seconds(sent_bytes, 2 * (size - 1))


def step_times(
    plan: ShardingPlan, model: ModelConfig, config: RunConfig, world: World
) -> list[StepTime]:
    """Every rank's step time (the plan is for `world.size` ranks)."""
    batch, size = config.batch_size, world.size
    local = batch // size
    a = compute_bytes(config)
    device = world.rank_device
    optimizer = optimizer_spec(config.optimizer)
    row_slots = len(getattr(optimizer, "row_wise_slots", ()))
    element_slots = len(optimizer.slot_names) - row_slots
    chunks = max(1, -(-local // dense_chunk_rows(config, world)))
    dense = dense_training_flops(model) * local / device.matmul_flops_per_s(config.amp)
    allreduce = _ring_seconds(world, 2 * (size - 1) / size * dense_parameters(model) * 4)
    if size > 1:
        allreduce += world.collective_overhead_s  # the replicated gradients' round too
    replicated_bytes, received, id_bytes = 0, 0.0, 0.0
    moved, sent = [0.0] * size, [0.0] * size
    for table in plan.tables:
        spec = table.spec
        if table.kind == DATA_PARALLEL:
            replicated_bytes += plan.gradient_exchange(table.table).bytes
        else:
            pieces = len(table.shards) if table.kind == ROW_WISE else 1
            received += local * spec.dim * a * pieces
            id_bytes += local * spec.hotness * ID_BYTES
        for shard in table.shards:
            rows = (local if table.kind == DATA_PARALLEL else batch) * spec.hotness
            row_bytes = shard.width * spec.dtype_bytes
            slot_bytes = (element_slots * shard.width + row_slots) * 4
            moved[shard.rank] += rows * (3 * row_bytes + 2 * slot_bytes)
            if table.kind != DATA_PARALLEL:
                sent[shard.rank] += batch * shard.width * a
    # Horovod fuses a step's allreduces into one buffer: one ring's latencies for all.
    replicated = _ring_seconds(world, replicated_bytes) if replicated_bytes else 0.0
    ids = hidden = 0.0
    if config.input_mode == "data_parallel":
        ids = _alltoall_seconds(world, id_bytes, id_bytes, 1)
        if config.exchange_ids_ahead:  # beside the dense part of the step before
            hidden = min(ids, dense)
            ids -= hidden
    per_host = world.ranks_per_host
    intra = (per_host - 1) / (size - 1) if size > 1 else 0.0
    return [
        StepTime(
            rank=r,
            dense_compute=dense,
            lookups_update=moved[r] / (device.memory_bandwidth_gb_s * 1e9),
            alltoall_ids=ids,
            alltoall_vectors=_alltoall_seconds(world, sent[r], received, chunks),
            alltoall_gradients=_alltoall_seconds(world, received, sent[r], chunks),
            dense_allreduce=allreduce,
            replicated_gradients=replicated,
            intra_host_share=intra,
            inter_host_share=1 - intra if size > 1 else 0.0,
            alltoall_ids_hidden=hidden,
        )
        for r in range(size)
    ]
