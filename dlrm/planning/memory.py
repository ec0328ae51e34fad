"""Each rank's memory at its peak in training, term by term.

With global batch G on W ranks, L = G / W rows per rank, l rows in the dense part
at a time (`--dense_chunk_rows`, resolved as `dlrm-train` resolves it), a = the
compute dtype's bytes (2 under `--amp`, else 4) and w = the vectors' wire bytes
(the same), a rank holds:

- **tables**: its shards' values, `rows x columns x dtype_bytes` each (replicated
  tables on every rank);
- **optimizer slots**: what the planner counts beyond the values
  (`ShardingPlan.memory_per_rank` minus the values), so that a change to the
  planner's slot costs (a row-wise slot of [rows, 1]) is counted here as it is;
- **dense**: the MLPs' and cross layers' parameters P in float32, with their
  gradient and each optimizer slot: `P x 4 x (2 + slots)`;
- **activations**: `2 x l x a x (sum of the widths the forward pass keeps)`: the
  numerical inputs, each bottom layer's output, the interaction's inputs and
  products (dot: the T + 1 vectors of D and the (T + 1)^2 Gram matrix; cross: per
  layer its projection and its output, d wide) and output, and each top layer's
  output; doubled for their gradients in the backward pass (an upper bound: each
  gradient lives only while its layer's backward runs);
- **lookups**: the rows a rank gathers before pooling, and their gradient: for
  each model-parallel shard `2 x G x hotness x columns x dtype_bytes`, for each
  replicated table the same over L rows;
- **exchange**: the alltoall buffers, forward and backward: the pooled vectors a
  rank's shards send (`G x columns x w` each) and the L rows of every table it
  receives (`L x dim x w`, once per row-wise shard, whose partial sums cross
  apart), both twice (vectors, then their gradients); the ids (8 bytes each: the
  global batch's ids of its tables under model-parallel input, plus its own rows'
  ids of the others when they are exchanged, `--input_mode data_parallel`, and then,
  under `--exchange_ids_ahead`, the next batch's ids of its tables too); the
  replicated tables' gradient exchange (dense: the [rows, dim + 1] sum; sparse:
  the G x hotness rows of dim + 1 values gathered from every rank);
- **runtime**: the device table's baseline (TensorFlow, Horovod, the CUDA
  context; measured for a CPU, where the peak is the process's RSS).

The peak is their sum: every term is taken as alive at once.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from dlrm.app.config import RunConfig
from dlrm.embedding.planner.plan import ShardingPlan
from dlrm.embedding.planner.types import DATA_PARALLEL, ROW_WISE
from dlrm.model.config import ModelConfig
from dlrm.optim.config import optimizer_spec
from dlrm.planning.world import World

# Bytes of one id in the loader's and the exchange's buffers (int64).
ID_BYTES = 8


@dataclasses.dataclass(frozen=True)
class RankMemory:
    """One rank's bytes at its peak, by term (see the module's docstring)."""

    rank: int
    tables: int
    optimizer_slots: int
    dense: int
    activations: int
    lookups: int
    exchange: int
    runtime: int

    TERMS = (
        "tables",
        "optimizer_slots",
        "dense",
        "activations",
        "lookups",
        "exchange",
        "runtime",
    )

    @property
    def peak(self) -> int:
        return sum(getattr(self, term) for term in self.TERMS)

    @property
    def beyond_tables(self) -> int:
        """Everything but the tables and their slots."""
        return self.peak - self.tables - self.optimizer_slots

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, **{t: getattr(self, t) for t in self.TERMS}, "peak": self.peak}


def dense_parameters(model: ModelConfig) -> int:
    """Weights and biases of the bottom MLP, the cross layers and the top MLP."""
    count, width = 0, model.num_numerical
    for out in model.bottom_mlp_dims:
        count += width * out + out
        width = out
    if model.interaction == "cross":
        d, r = model.interaction_width, model.cross_layer_projection_dim
        per_layer = 2 * d * r + d if 0 < r < d else d * d + d
        count += model.num_cross_layers * per_layer
    width = model.interaction_width
    for out in model.top_mlp_dims:
        count += width * out + out
        width = out
    return count


def kept_widths(model: ModelConfig) -> int:
    """Values per row the forward pass keeps for the backward (see the docstring)."""
    kept = model.num_numerical + sum(model.bottom_mlp_dims)
    if model.interaction == "cross":
        d, r = model.interaction_width, model.cross_layer_projection_dim
        kept += d + model.num_cross_layers * ((r if 0 < r < d else d) + d)
    else:
        vectors = len(model.cardinalities) + 1
        kept += vectors * model.embedding_dims[0] + vectors * vectors
    return kept + model.interaction_width + sum(model.top_mlp_dims)


def compute_bytes(config: RunConfig) -> int:
    """Bytes of an activation and of a vector on the wire: 2 under `--amp`."""
    return 2 if config.amp else 4


def on_gpu(world: World) -> bool:
    """GPU devices have figures of their own per rank; CPU servers share a host's."""
    return not world.device.shared_by_host_ranks


def dense_chunk_rows(config: RunConfig, world: World) -> int:
    """Rows the dense part runs at a time on a rank, as `dlrm-train` resolves it."""
    local = config.batch_size // world.size
    rows = config.dense_chunk_rows_for(on_gpu(world), world.size)
    return min(rows, local) if rows else local


def rank_memory(
    plan: ShardingPlan, model: ModelConfig, config: RunConfig, world: World
) -> list[RankMemory]:
    """Every rank's memory at its peak (W = `plan.world_size`, which `world` has)."""
    batch, size = config.batch_size, plan.world_size
    local = batch // size
    a = compute_bytes(config)
    slots = len(optimizer_spec(config.optimizer).slot_names)
    dense = dense_parameters(model) * 4 * (2 + slots)
    activations = 2 * dense_chunk_rows(config, world) * a * kept_widths(model)
    runtime = int(world.device.runtime_baseline_gib * 2**30)
    planned = plan.memory_per_rank()
    values, lookups, exchange = [0] * size, [0] * size, [0] * size
    receive, replicated = 0, 0
    ids_ahead = size > 1 and config.input_mode == "data_parallel" and config.exchange_ids_ahead
    for table in plan.tables:
        spec = table.spec
        if table.kind == DATA_PARALLEL:
            replicated += _replicated_gradient_bytes(plan, table.table, batch)
            replicated += local * spec.hotness * ID_BYTES
        elif size > 1:
            pieces = len(table.shards) if table.kind == ROW_WISE else 1
            receive += 2 * local * spec.dim * a * pieces
            if config.input_mode == "data_parallel":
                receive += local * spec.hotness * ID_BYTES
        for shard in table.shards:
            r = shard.rank
            values[r] += shard.elements * spec.dtype_bytes
            rows = local if table.kind == DATA_PARALLEL else batch
            lookups[r] += 2 * rows * spec.hotness * shard.width * spec.dtype_bytes
            if table.kind != DATA_PARALLEL:
                exchange[r] += batch * spec.hotness * ID_BYTES
                if ids_ahead:  # the next batch's, exchanged during this step
                    exchange[r] += batch * spec.hotness * ID_BYTES
                exchange[r] += 2 * batch * shard.width * a if size > 1 else 0
    return [
        RankMemory(
            rank=r,
            tables=values[r],
            optimizer_slots=planned[r] - values[r],
            dense=dense,
            activations=activations,
            lookups=lookups[r],
            exchange=exchange[r] + receive + replicated,
            runtime=runtime,
        )
        for r in range(size)
    ]


def _replicated_gradient_bytes(plan: ShardingPlan, table: int, batch: int) -> int:
    """The buffer that sums replicated `table`'s gradient over the ranks: the
    [rows, dim + 1] array (dense), or every rank's rows of dim + 1 values (sparse)."""
    spec = plan.tables[table].spec
    method = plan.gradient_exchange(table).method
    if method == "none":
        return 0
    rows = spec.rows if method == "dense" else batch * spec.hotness
    return rows * (spec.dim + 1) * 4
