"""Assembling a run: the dataset's FeatureSpec, the model (sharded over the
ranks by a plan when there are several), the trainer and the predictor, from a
validated `RunConfig`. Benchmarks and tests build their runs here too, so
what they run is what `dlrm-train` runs.
"""

from __future__ import annotations

import dataclasses
import math
import socket
from typing import Any

import keras
import tensorflow as tf

from dataloading.errors import DatasetError
from dataloading.files import SplitBinaryFiles
from dataloading.split_binary import (
    InputMode,
    ShardSpec,
)
from dlrm import kernels
from dlrm.app.config import ConfigError, RunConfig
from dlrm.app.reporting import MetricsLog
from dlrm.distributed.agreement import check_ranks_agree
from dlrm.distributed.collectives import Collectives
from dlrm.distributed.devices import format_cpus, has_gpu
from dlrm.embedding.planner.placement import PlannerConfig, plan_sharding
from dlrm.embedding.planner.plan import ShardingPlan
from dlrm.embedding.planner.report import format_plan
from dlrm.embedding.planner.types import PlanError, TableSpec
from dlrm.embedding.sharded import ShardedEmbeddings
from dlrm.evaluation.predictor import Predictor
from dlrm.model.config import ModelConfig
from dlrm.model.dlrm import Dlrm
from dlrm.optim.optimizers import create_optimizer, optimizer_class
from dlrm.train.precision import Precision, bfloat16_note, choose_precision, matmul_gflops
from dlrm.train.schedule import DlrmSchedule
from dlrm.train.trainer import Trainer
from feature_spec import TEST_MAPPING, TRAIN_MAPPING, FeatureSpec, FeatureSpecError
from feature_spec.vocabulary import VocabularyLineage


def model_config_for(spec: FeatureSpec, config: RunConfig) -> ModelConfig:
    """The architecture of this run: the flags' model with the dataset's tables."""
    cross = config.interaction == "cross"
    try:
        return ModelConfig(
            num_numerical=len(spec.numerical_features),
            cardinalities=spec.cardinalities,
            hotness=spec.hotness,
            embedding_dim=config.embedding_dim,  # one width, or one per table
            bottom_mlp_dims=config.bottom_mlp_dims,
            top_mlp_dims=config.top_mlp_dims,
            interaction=config.interaction,
            num_cross_layers=config.num_cross_layers if cross else 0,
            cross_layer_projection_dim=config.cross_layer_projection_dim if cross else 0,
            pooling=config.pooling,
        )
    except ValueError as error:
        raise ConfigError(str(error)) from error


def kernels_apply(config: RunConfig, model_config: ModelConfig, log: MetricsLog) -> bool:
    """Whether the model runs on the project's CPU kernels (`dlrm.kernels`): asked
    for (`--use_kernels`), on CPUs, and built. When only the last fails, says so:
    it costs speed. Each part of the model uses the kernels it has: the dot
    interaction its own (not under `--xla`, which compiles the dense part from
    TensorFlow's ops), the cross interaction none, while the lookups, the finite
    check and the embedding update of every optimizer, which run outside the
    compiled function, use theirs with either interaction and with `--xla` too."""
    if not config.use_kernels or has_gpu():
        return False
    if kernels.load() is None:
        log.print(
            f"the CPU kernels are not in use ({kernels.unavailable_reason()}): the "
            f"{model_config.interaction} model runs on TensorFlow's ops, slower"
        )
        return False
    return True


@dataclasses.dataclass
class AssembledRun:
    """What every mode shares: config, dataset spec, model, predictor, and the
    trainer when training."""

    config: RunConfig
    spec: FeatureSpec
    model_config: ModelConfig
    precision: Precision
    model: Dlrm
    predictor: Predictor
    trainer: Trainer | None
    log: MetricsLog
    collectives: Collectives
    plan: ShardingPlan | None
    hosts: list[str] = dataclasses.field(default_factory=list)  # each rank's hostname
    # The vocabulary the dataset's ids come from, when it records one.
    vocabulary: VocabularyLineage | None = None

    def shard(self, global_batch_size: int) -> ShardSpec:
        """What this rank reads of each global batch."""
        world = self.collectives.world_size
        if world == 1:
            return ShardSpec(global_batch_size)
        input_mode = InputMode(self.config.input_mode)
        tables = None
        if input_mode == InputMode.MODEL_PARALLEL:
            tables = self.model.embeddings.input_tables
        return ShardSpec(global_batch_size, self.collectives.rank, world, tables, input_mode)


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
    tables = [
        TableSpec(rows=rows, dim=dim, hotness=hotness)
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
    slots = len(optimizer_class(config.optimizer).slot_names)
    budget = config.embedding_memory_budget_gib
    return plan_sharding(
        tables,
        PlannerConfig(
            world_size=world_size,
            memory_budget_bytes=int(budget * 2**30) if budget > 0 else None,
            data_parallel_threshold=config.data_parallel_threshold,
            column_slice_threshold=config.column_slice_threshold,
            row_slice_threshold=config.row_slice_threshold,
            strategy=config.sharding_strategy,
            optimizer_slots=slots if config.mode == "train" else 0,
            global_batch_size=config.batch_size,
        ),
    )


# Flags that may differ between ranks: paths of inputs each node may mount
# elsewhere (their contents are compared instead) and of rank 0's logs.
_PER_RANK_FLAGS = ("dataset_path", "feature_spec", "sharding_plan", "log_path", "tensorboard_dir")


def agreement_facts(
    config: RunConfig, model_config: ModelConfig, spec: FeatureSpec, plan: ShardingPlan | None
) -> dict[str, Any]:
    """What every rank must hold alike: the plan, the tables, the model, the
    settings that decide which collectives run (steps, batches, logging), and
    the size of each split (else ranks run different numbers of steps)."""
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
    }


def assemble_run(
    config: RunConfig, log: MetricsLog, collectives: Collectives | None = None
) -> AssembledRun:
    """Dataset spec, model (sharded when there are several ranks) and trainer."""
    collectives = collectives or Collectives()
    spec = FeatureSpec.load(config.feature_spec_path)
    try:  # checked here, not at the first checkpoint
        vocabulary = VocabularyLineage.from_metadata(spec.metadata)
    except FeatureSpecError as error:
        raise DatasetError(f"{config.feature_spec_path}: {error}") from error
    model_config = model_config_for(spec, config)
    keras.utils.set_random_seed(config.seed)
    on_gpu = has_gpu()
    precision = choose_precision(config.amp, on_gpu)
    if precision.dtype_policy == "mixed_bfloat16":
        float32, bfloat16 = matmul_gflops(tf.float32), matmul_gflops(tf.bfloat16)
        log.print(bfloat16_note(float32, bfloat16))
        log.write("matmul_gflops", float32=float32, bfloat16=bfloat16)
    dense_chunk_rows = config.dense_chunk_rows_for(on_gpu, collectives.world_size)
    use_kernels = kernels_apply(config, model_config, log)
    plan = None
    embeddings = None
    hosts = [socket.gethostname()]
    if collectives.world_size == 1 and config.sharding_plan:
        # One process needs no plan, but a given one that does not fit is a mistake.
        plan_for(config, model_config, spec, 1)
    if collectives.world_size > 1:
        plan = plan_for(config, model_config, spec, collectives.world_size)
        # Before anything is built from the plan: a rank with another plan file or
        # FeatureSpec would otherwise assemble wrong vectors or hang.
        check_ranks_agree(collectives, agreement_facts(config, model_config, spec, plan))
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
        embeddings = ShardedEmbeddings(
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
        )
    model = Dlrm(
        model_config,
        embeddings=embeddings,
        dtype_policy=precision.dtype_policy,
        seed=config.seed,
        use_xla=config.xla,
        use_kernels=use_kernels,
        on_gpu=on_gpu,
    )
    trainer = None
    if config.mode == "train":
        trainer = Trainer(
            model,
            create_optimizer(config.optimizer),
            DlrmSchedule(config.schedule),
            precision,
            global_batch_size=config.batch_size,
            use_xla=config.xla,
            collectives=collectives,
            dense_chunk_rows=dense_chunk_rows,
        )
    predictor = Predictor(model, use_xla=config.xla, dense_chunk_rows=dense_chunk_rows)
    # Every rank starts from rank 0's dense weights (tables are initialised as slices).
    collectives.broadcast_variables(model.dense_variables)
    return AssembledRun(
        config,
        spec,
        model_config,
        precision,
        model,
        predictor,
        trainer,
        log,
        collectives,
        plan,
        hosts,
        vocabulary,
    )
