"""A run's tables over its ranks: the sharding plan (planned, or read from
`--sharding_plan` and checked), with each variable-length table's hotness
probed from the dataset; what every rank must hold alike before anything is
built from the plan; and the sharded embeddings layer that executes it."""

from __future__ import annotations

import dataclasses
import math
import socket
from typing import Any

from dataloading.errors import DatasetError
from dataloading.files import SplitBinaryFiles
from dlrm.app.config import EMBEDDING_DTYPE_BYTES, RunConfig
from dlrm.app.reporting import MetricsLog
from dlrm.distributed.agreement import check_ranks_agree
from dlrm.distributed.collectives import Collectives
from dlrm.distributed.devices import format_cpus
from dlrm.embedding.planner.placement import PlannerConfig, plan_sharding
from dlrm.embedding.planner.plan import ShardingPlan
from dlrm.embedding.planner.report import format_plan
from dlrm.embedding.planner.types import PlanError, TableSpec
from dlrm.embedding.sharded import ShardedEmbeddings
from dlrm.model.config import ModelConfig
from dlrm.optim.config import optimizer_spec
from dlrm.train.precision import Precision
from feature_spec import TEST_MAPPING, TRAIN_MAPPING, FeatureSpec, FeatureSpecError


def planning_hotness(spec: FeatureSpec) -> tuple[int, ...]:
    """Ids per row per table as the planner costs them: a variable-length
    table's mean over the first split that opens (train, else test), rounded up."""
    hotness = spec.hotness
    if all(hotness):
        return hotness
    files = None
    for mapping in (TRAIN_MAPPING, TEST_MAPPING, *spec.mappings):
        try:
            files = SplitBinaryFiles.open(spec, mapping)
            break
        except (DatasetError, FeatureSpecError):
            continue
    out = []
    for feature, hot in zip(spec.categorical_features, hotness, strict=True):
        if hot == 0 and files is not None and files.rows:
            ids = files.offsets[feature.name].memmap()[-1]
            hot = math.ceil(int(ids) / files.rows)
        out.append(max(hot, 1))
    return tuple(out)


def plan_for(
    config: RunConfig, model_config: ModelConfig, spec: FeatureSpec, world_size: int
) -> ShardingPlan:
    """The sharding plan of this run's tables over `world_size` ranks: planned, or
    read from `--sharding_plan` and checked against this run."""
    bytes_per_value = EMBEDDING_DTYPE_BYTES[config.embedding_dtype]
    tables = [
        TableSpec(rows=rows, dim=dim, hotness=hotness, dtype_bytes=bytes_per_value)
        for rows, dim, hotness in zip(
            model_config.cardinalities,
            model_config.embedding_dims,
            planning_hotness(spec),
            strict=True,
        )
    ]
    if config.sharding_plan:
        plan = ShardingPlan.load(config.sharding_plan)
        try:
            plan.validate(tables, world_size)
        except PlanError as error:
            raise PlanError(f"--sharding_plan {config.sharding_plan}: {error}") from error
        # Gradient exchange is costed (and chosen) at this run's batch.
        return dataclasses.replace(plan, global_batch_size=config.batch_size)
    optimizer = optimizer_spec(config.optimizer)
    training = config.mode == "train"
    budget = config.embedding_memory_budget_gib
    planner = PlannerConfig(
        world_size=world_size,
        memory_budget_bytes=int(budget * 2**30) if budget > 0 else None,
        data_parallel_threshold=config.data_parallel_threshold,
        column_slice_threshold=config.column_slice_threshold,
        row_slice_threshold=config.row_slice_threshold,
        strategy=config.sharding_strategy,
        optimizer_slots=optimizer.element_slot_count if training else 0,
        global_batch_size=config.batch_size,
        row_slots=optimizer.row_slot_count if training else 0,
    )
    try:
        return plan_sharding(tables, planner)
    except PlanError as error:
        if planner.memory_budget_bytes is None:
            raise
        raise PlanError(
            f"{error} (the budget: --embedding_memory_budget_gib {budget:g} on each of "
            f"{world_size} ranks; more ranks, a larger budget or smaller tables fit)"
        ) from error


@dataclasses.dataclass(frozen=True)
class ResolvedSettings:
    """What a rank made of the flags on its device. Ranks that resolve differently
    (one sees no GPU) exchange vectors of different dtypes, or run different
    numbers of collectives: a Horovod error or a hang, so every rank compares them
    (`agreement_facts`) before building anything."""

    on_gpu: bool  # the GPU code path (`dlrm.distributed.devices.gpu_code_path`)
    emulated: bool  # ... run on a CPU (DLRM_GPU_PATH_ON_CPU=1)
    precision: Precision
    initial_loss_scale: float | None  # None: no loss scaling
    dense_chunk_rows: int  # 0: the whole batch
    use_kernels: bool

    def to_dict(self) -> dict[str, Any]:
        """As facts compared between ranks, the code path first (keys sort)."""
        code_path = "gpu" if self.on_gpu else "cpu"
        if self.emulated:
            code_path = "gpu, emulated on a CPU (DLRM_GPU_PATH_ON_CPU=1)"
        return {
            "code_path": code_path,
            "dtype_policy": self.precision.dtype_policy,
            "use_loss_scale": self.precision.use_loss_scale,
            "initial_loss_scale": self.initial_loss_scale,
            "dense_chunk_rows": self.dense_chunk_rows,
            "use_kernels": self.use_kernels,
            "wire_dtype": self.precision.compute_dtype.name,
        }


# What a rank that resolved differently (`ResolvedSettings`) is told.
RESOLVED_HINT = (
    "Every rank must run the same code path: a GPU on every rank or on none, the "
    "CPU kernels built on every host, and DLRM_GPU_PATH_ON_CPU and "
    "DLRM_INITIAL_LOSS_SCALE set alike"
)


# Flags that may differ between ranks: paths of inputs each node may mount
# elsewhere (their contents are compared instead) and of rank 0's logs.
_PER_RANK_FLAGS = ("dataset_path", "feature_spec", "sharding_plan", "log_path", "tensorboard_dir")


def agreement_facts(
    config: RunConfig,
    model_config: ModelConfig,
    spec: FeatureSpec,
    plan: ShardingPlan | None,
    resolved: ResolvedSettings,
) -> dict[str, Any]:
    """What every rank must hold alike: the plan, the tables, the model, the
    settings that decide which collectives run (steps, batches, logging), the
    size of each split (else ranks run different numbers of steps), and what
    each rank resolved for its device (`ResolvedSettings`)."""
    rows: dict[str, int | str] = {}
    for mapping in (TRAIN_MAPPING, TEST_MAPPING):
        try:
            rows[mapping] = SplitBinaryFiles.open(spec, mapping).rows
        except (DatasetError, FeatureSpecError, KeyError) as error:
            rows[mapping] = f"unreadable: {error}"
    flags = {k: v for k, v in config.to_dict().items() if k not in _PER_RANK_FLAGS}
    return {
        "plan": plan.to_dict() if plan is not None else None,
        "model": model_config.to_dict(),
        "flags": flags,
        "rows": rows,
        "resolved": resolved.to_dict(),
    }


@dataclasses.dataclass(frozen=True)
class RankShards:
    """The plan of a run over its ranks (None on one process), and each rank's host."""

    plan: ShardingPlan | None
    hosts: list[str]


def agreed_plan(
    config: RunConfig, model_config: ModelConfig, spec: FeatureSpec, collectives: Collectives
) -> ShardingPlan:
    """`plan_for` on every rank, whose outcome every rank shares (one allgather): a
    plan that cannot be made raises the same `PlanError` on every rank, which is
    reported once, naming the rank where ranks failed differently."""
    plan, error = None, None
    try:
        plan = plan_for(config, model_config, spec, collectives.world_size)
    except PlanError as caught:
        error = caught
    messages = collectives.allgather_object(None if error is None else str(error), name="plan")
    failed = [(rank, message) for rank, message in enumerate(messages) if message is not None]
    if failed:
        rank, message = failed[0]
        if len(failed) < len(messages) or any(m != message for _, m in failed):
            message = f"on rank {rank}: {message}"
        agreed = PlanError(message)
        agreed.same_on_every_rank = True  # from one allgather (dlrm.distributed.launcher)
        raise agreed from error
    assert plan is not None
    return plan


def shard_over_ranks(
    config: RunConfig,
    model_config: ModelConfig,
    spec: FeatureSpec,
    collectives: Collectives,
    log: MetricsLog,
    resolved: ResolvedSettings,
) -> RankShards:
    """The plan for this world, agreed by every rank before anything is built from
    it (a rank with another plan file or FeatureSpec would otherwise assemble wrong
    vectors, or hang), and said: the ranks' hosts, their CPUs, the plan."""
    if collectives.world_size == 1:
        if config.sharding_plan:  # needs none, but a given one that does not fit is a mistake
            plan_for(config, model_config, spec, 1)
        return RankShards(None, [socket.gethostname()])
    plan = agreed_plan(config, model_config, spec, collectives)
    facts = agreement_facts(config, model_config, spec, plan, resolved)
    check_ranks_agree(collectives, facts, {"resolved": RESOLVED_HINT})
    hosts = collectives.allgather_object(socket.gethostname(), name="hostnames")
    log.print(
        f"{collectives.world_size} ranks on {len(set(hosts))} hosts: "
        + ", ".join(f"{rank} {host}" for rank, host in enumerate(hosts))
    )
    if collectives.bound_cpus is not None:
        log.print(
            f"each rank on this host runs on CPUs of its own (rank {collectives.rank}: "
            f"{format_cpus(collectives.bound_cpus)}; --nobind_cpus to share them)"
        )
    if collectives.intra_op_threads is not None:
        log.print(
            f"{collectives.intra_op_threads} intra-op thread(s) per rank: this host's "
            "CPUs shared by its ranks (TF_NUM_INTRAOP_THREADS overrides)"
        )
    log.print(format_plan(plan))
    return RankShards(plan, hosts)


def sharded_embeddings(
    plan: ShardingPlan,
    config: RunConfig,
    model_config: ModelConfig,
    precision: Precision,
    collectives: Collectives,
    use_kernels: bool,
) -> ShardedEmbeddings:
    """The embedding layer that executes `plan` on this rank."""
    return ShardedEmbeddings(
        plan,
        collectives,
        seed=config.seed,
        data_parallel_input=config.input_mode == "data_parallel",
        # Under --amp the vectors and their gradients cross in 16 bits.
        wire_dtype=precision.compute_dtype,
        output_dtype=precision.compute_dtype,
        hotness=model_config.hotness,
        pooling=model_config.poolings,
        use_kernels=use_kernels,
        table_dtype=config.embedding_dtype,
    )
