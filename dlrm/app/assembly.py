"""Assembling a run: the dataset's FeatureSpec, the model (sharded over the
ranks by a plan when there are several), the trainer and the predictor, from a
validated `RunConfig`. Benchmarks and tests build their runs here too, so
what they run is what `dlrm-train` runs.
"""

from __future__ import annotations

import dataclasses

import keras
import tensorflow as tf

from dataloading.errors import DatasetError
from dataloading.split_binary import (
    InputMode,
    ShardSpec,
)
from dlrm import kernels
from dlrm.app.config import ConfigError, RunConfig
from dlrm.app.reporting import MetricsLog
from dlrm.app.sharding import ResolvedSettings, shard_over_ranks, sharded_embeddings
from dlrm.distributed.collectives import Collectives
from dlrm.distributed.devices import GPU_PATH_ON_CPU_ENV, gpu_code_path, has_gpu
from dlrm.embedding.planner.plan import ShardingPlan
from dlrm.evaluation.predictor import Predictor
from dlrm.model.config import ModelConfig
from dlrm.model.dlrm import Dlrm
from dlrm.optim.optimizers import create_optimizer
from dlrm.train.precision import (
    Precision,
    bfloat16_note,
    choose_precision,
    initial_loss_scale,
    matmul_gflops,
)
from dlrm.train.schedule import DlrmSchedule
from dlrm.train.trainer import Trainer
from feature_spec import FeatureSpec, FeatureSpecError
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


def kernels_apply(
    config: RunConfig, model_config: ModelConfig, on_gpu: bool, log: MetricsLog
) -> bool:
    """Whether the model runs on the project's CPU kernels (`dlrm.kernels`): asked
    for (`--use_kernels`), off the GPU code path (`on_gpu`), and built. When only
    the last fails, says so: it costs speed. Each part of the model uses the
    kernels it has: the dot interaction its own (not under `--xla`, which
    compiles the dense part from TensorFlow's ops), the cross interaction none,
    while the lookups, the finite check and the embedding update of every
    optimizer, which run outside the compiled function, use theirs with either
    interaction and with `--xla` too."""
    if not config.use_kernels or on_gpu:
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
    # What this rank resolved for its device (the same on every rank).
    resolved: ResolvedSettings | None = None

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


def assemble_run(
    config: RunConfig, log: MetricsLog, collectives: Collectives | None = None
) -> AssembledRun:
    """Dataset spec, model (sharded when there are several ranks) and trainer."""
    collectives = collectives or Collectives()
    spec, vocabulary = dataset_of(config)
    model_config = model_config_for(spec, config)
    keras.utils.set_random_seed(config.seed)
    resolved = resolve_settings(config, model_config, collectives.world_size, log)
    precision = resolved.precision
    shards = shard_over_ranks(config, model_config, spec, collectives, log, resolved)
    embeddings = None
    if shards.plan is not None:
        embeddings = sharded_embeddings(
            shards.plan, config, model_config, precision, collectives, resolved.use_kernels
        )
    model = Dlrm(
        model_config,
        embeddings=embeddings,
        dtype_policy=precision.dtype_policy,
        seed=config.seed,
        use_xla=config.xla,
        use_kernels=resolved.use_kernels,
        on_gpu=resolved.on_gpu,
        table_dtype=config.embedding_dtype,
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
            dense_chunk_rows=resolved.dense_chunk_rows,
            initial_loss_scale=resolved.initial_loss_scale,
            exchange_ids_ahead=config.exchange_ids_ahead,
        )
    predictor = Predictor(model, use_xla=config.xla, dense_chunk_rows=resolved.dense_chunk_rows)
    # Every rank starts from rank 0's dense weights (tables are initialised as slices).
    collectives.broadcast_variables(model.dense_variables)
    return AssembledRun(
        config, spec, model_config, precision, model, predictor, trainer, log, collectives,
        shards.plan, shards.hosts, vocabulary, resolved,
    )  # fmt: skip


def dataset_of(config: RunConfig) -> tuple[FeatureSpec, VocabularyLineage | None]:
    """The dataset's FeatureSpec, and the vocabulary its ids come from when it
    records one (checked here, not at the first checkpoint)."""
    spec = FeatureSpec.load(config.feature_spec_path)
    try:
        return spec, VocabularyLineage.from_metadata(spec.metadata)
    except FeatureSpecError as error:
        raise DatasetError(f"{config.feature_spec_path}: {error}") from error


def resolve_settings(
    config: RunConfig, model_config: ModelConfig, world_size: int, log: MetricsLog
) -> ResolvedSettings:
    """What the flags mean on this rank's device: the GPU code path (`gpu_code_path`:
    a GPU, or `DLRM_GPU_PATH_ON_CPU=1` on a CPU) or the CPU one decides the
    precision, the dense chunks and the kernels."""
    on_gpu = gpu_code_path()
    emulated = on_gpu and not has_gpu()
    if emulated:
        log.print(
            f"{GPU_PATH_ON_CPU_ENV}=1: the GPU code path runs on this CPU (float16 under "
            "--amp, whole batches, no CPU kernels): for tests, slow"
        )
    precision = precision_for(config, on_gpu, log)
    return ResolvedSettings(
        on_gpu=on_gpu,
        emulated=emulated,
        precision=precision,
        initial_loss_scale=loss_scale_for(precision),
        dense_chunk_rows=config.dense_chunk_rows_for(on_gpu, world_size),
        use_kernels=kernels_apply(config, model_config, on_gpu, log),
    )


def loss_scale_for(precision: Precision) -> float | None:
    """Where float16's loss scale starts (None: no loss scaling)."""
    if not precision.use_loss_scale:
        return None
    try:
        return initial_loss_scale()
    except ValueError as error:
        raise ConfigError(str(error)) from error


def precision_for(config: RunConfig, on_gpu: bool, log: MetricsLog) -> Precision:
    """`--amp`'s precision on this device; on a CPU, what bfloat16 is worth here."""
    precision = choose_precision(config.amp, on_gpu)
    if precision.dtype_policy == "mixed_bfloat16":
        float32, bfloat16 = matmul_gflops(tf.float32), matmul_gflops(tf.bfloat16)
        log.print(bfloat16_note(float32, bfloat16))
        log.write("matmul_gflops", float32=float32, bfloat16=bfloat16)
    return precision
