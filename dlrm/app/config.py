"""The run configuration: one frozen value built from the flags, validated once.

Errors name the flag (`--batch_size: ...`), the expected and the actual value.
Dataset facts (cardinalities, feature counts) are not here: they come from the
FeatureSpec. This module imports no TensorFlow, so `main.py` can validate flags
before paying for (or configuring) the TensorFlow import.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from dlrm.distributed.preemption import parse_signal
from dlrm.embedding.planner.types import (
    DEFAULT_COLUMN_SLICE_THRESHOLD,
    DEFAULT_DATA_PARALLEL_THRESHOLD,
    DEFAULT_ROW_SLICE_THRESHOLD,
    STRATEGIES,
)
from dlrm.model.config import (
    DEFAULT_BOTTOM_MLP_DIMS,
    DEFAULT_EMBEDDING_DIM,
    DEFAULT_TOP_MLP_DIMS,
    INTERACTIONS,
    POOLINGS,
)
from dlrm.optim.config import OPTIMIZERS, SGD
from dlrm.train.config import (
    DEFAULT_CPU_DENSE_CHUNK_ROWS,
    MIN_PIPELINED_CHUNK_ROWS,
    PIPELINED_CHUNKS,
    ScheduleConfig,
)
from feature_spec.staged import write_file_atomically

MODES = ("train", "eval", "inference", "export")
SCHEDULE_FROM = ("checkpoint", "zero")
# How --mode export stores the tables (dlrm.model.export.QUANTIZATIONS, which a
# test keeps equal: this module imports no TensorFlow).
QUANTIZATIONS = ("none", "int8")


INPUT_MODES = ("model_parallel", "data_parallel")
# What the embedding tables store (--embedding_dtype); slots stay float32.
EMBEDDING_DTYPES = ("float32", "bfloat16", "float16")
# Bytes of one table value in each (the planner's `TableSpec.dtype_bytes`).
EMBEDDING_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


class ConfigError(ValueError):
    """A flag value, or a combination of them, is invalid."""

    # Every rank checks the same flags (dlrm.launch.same_on_every_rank).
    same_on_every_rank = True


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Every setting of a run. Field names are the flag names."""

    mode: str = "train"
    dataset_path: str | None = None
    feature_spec: str = "feature_spec.yaml"
    check_ids: bool = True  # ids in [0, cardinality), per batch in the loader
    # Optimisation
    batch_size: int = 65536
    valid_batch_size: int | None = None
    optimizer: str = SGD.name
    learning_rate: float = 24.0
    warmup_steps: int = 8000
    decay_start_step: int = 48000
    decay_steps: int = 24000
    decay_power: float = 2.0
    decay_end_lr: float = 0.0
    epochs: int = 1
    max_steps: int = -1
    seed: int = 12345
    # Model
    # One width, or one per table (cross only).
    embedding_dim: tuple[int, ...] = (DEFAULT_EMBEDDING_DIM,)
    embedding_dtype: str = EMBEDDING_DTYPES[0]
    bottom_mlp_dims: tuple[int, ...] = DEFAULT_BOTTOM_MLP_DIMS
    top_mlp_dims: tuple[int, ...] = DEFAULT_TOP_MLP_DIMS
    interaction: str = INTERACTIONS[0]
    num_cross_layers: int = 3
    cross_layer_projection_dim: int = 512  # 0: full rank
    pooling: tuple[str, ...] = POOLINGS[:1]  # of multi-hot rows: one, or one per table
    # Hybrid parallelism (under horovodrun); thresholds in elements (rows x dim)
    sharding_strategy: str = "cost"
    data_parallel_threshold: int = DEFAULT_DATA_PARALLEL_THRESHOLD
    column_slice_threshold: int = DEFAULT_COLUMN_SLICE_THRESHOLD
    row_slice_threshold: int = DEFAULT_ROW_SLICE_THRESHOLD
    embedding_memory_budget_gib: float = 0.0  # per rank; 0: no limit
    bind_cpus: bool = True  # ranks sharing a host each on their own CPUs (dist.share_cpus)
    input_mode: str = "model_parallel"
    # Under data-parallel input, the next batch's ids cross during this step
    # (Trainer.train_step_agreeing); the same results either way.
    exchange_ids_ahead: bool = True
    sharding_plan: str | None = None  # a plan JSON to use instead of planning
    # Precision and compilation
    amp: bool = False
    xla: bool = False
    use_kernels: bool = True  # the project's CPU kernels (dlrm.kernels) where they apply
    # Rows of a rank's batch the dense part runs at a time, their gradients summed:
    # None: dense_chunk_rows_for's default (CPUs), the whole batch on GPUs; 0: whole.
    dense_chunk_rows: int | None = None
    # Evaluation, logging
    evals_per_epoch: int = 1
    print_freq: int = 100
    log_path: str | None = None
    tensorboard_dir: str | None = None
    # Checkpoints and export
    save_checkpoint_path: str | None = None
    restore_checkpoint_path: str | None = None
    keep_checkpoints: int = 3
    # Checkpoints while training, besides those after evaluations (0: none).
    checkpoint_every_steps: int = 0
    checkpoint_every_seconds: float = 0.0
    # Continue from the newest checkpoint in save_checkpoint_path when it has one.
    resume: bool = False
    # Start from restore_checkpoint_path's weights and optimizer state, at step 0
    # of this run's data (a new day's data), not at its step.
    warm_start: bool = False
    # Where a warm start's learning-rate schedule stands: where the checkpoint's was
    # (warmup not repeated, decay going on), or at its start again.
    schedule_from: str = SCHEDULE_FROM[0]
    # Besides SIGTERM, a signal that stops training at a checkpoint (dlrm.preemption).
    preemption_signal: str | None = None
    saved_model_output_path: str | None = None
    # The exported tables: float32 as trained ("none"), or row-wise int8.
    quantize: str = QUANTIZATIONS[0]
    # Inference benchmark
    benchmark_warmup_steps: int = 10

    def __post_init__(self) -> None:
        if isinstance(self.embedding_dim, int):  # one width, given as a number
            object.__setattr__(self, "embedding_dim", (self.embedding_dim,))
        pooling = (self.pooling,) if isinstance(self.pooling, str) else tuple(self.pooling)
        object.__setattr__(self, "pooling", pooling)  # a list from the flags, too
        _validate(self)

    # ------------------------------------------------------------------ derived

    def dense_chunk_rows_for(self, on_gpu: bool, world_size: int = 1) -> int:
        """`dense_chunk_rows` resolved for the device and the ranks: 0 means the
        whole batch. On CPUs, several ranks cut their batch into at least
        PIPELINED_CHUNKS chunks where it has the rows (see above)."""
        if self.dense_chunk_rows is not None:
            return self.dense_chunk_rows
        if on_gpu:
            return 0
        if world_size == 1:
            return DEFAULT_CPU_DENSE_CHUNK_ROWS
        pipelined = -(-self.batch_size // world_size // PIPELINED_CHUNKS)
        return min(DEFAULT_CPU_DENSE_CHUNK_ROWS, max(MIN_PIPELINED_CHUNK_ROWS, pipelined))

    @property
    def eval_batch_size(self) -> int:
        return self.valid_batch_size or self.batch_size

    @property
    def schedule(self) -> ScheduleConfig:
        return ScheduleConfig(
            learning_rate=self.learning_rate,
            warmup_steps=self.warmup_steps,
            decay_start_step=self.decay_start_step,
            decay_steps=self.decay_steps,
            decay_power=self.decay_power,
            end_learning_rate=self.decay_end_lr,
        )

    @property
    def feature_spec_path(self) -> Path:
        if self.dataset_path is None:
            raise ConfigError("--dataset_path: required for this mode, got none")
        return Path(self.dataset_path) / self.feature_spec

    @property
    def metrics_log_path(self) -> Path | None:
        """`--log_path`, else metrics.jsonl in `--save_checkpoint_path`, else none."""
        if self.log_path:
            return Path(self.log_path)
        if self.save_checkpoint_path:
            return Path(self.save_checkpoint_path) / "metrics.jsonl"
        return None

    @property
    def tensorboard_path(self) -> Path | None:
        if self.tensorboard_dir:
            return Path(self.tensorboard_dir)
        if self.save_checkpoint_path:
            return Path(self.save_checkpoint_path) / "tensorboard"
        return None

    @classmethod
    def default(cls, name: str) -> Any:
        """The default value of field `name` (for flag definitions)."""
        return cls.__dataclass_fields__[name].default

    def to_dict(self) -> dict[str, Any]:
        values = dataclasses.asdict(self)
        return {k: list(v) if isinstance(v, tuple) else v for k, v in values.items()}

    def write(self, directory: str | os.PathLike[str]) -> Path:
        """Writes the resolved config as `config.json` in `directory` (atomically)."""
        text = json.dumps(self.to_dict(), indent=2, sort_keys=True) + "\n"
        return write_file_atomically(Path(directory) / "config.json", text)


def _same_directory(a: str | None, b: str | None) -> bool:
    """Whether checkpoint directory `b` (a run's directory or a step_* in it) is, or is
    in, directory `a`."""
    if a is None or b is None:
        return False
    outer, inner = os.path.abspath(a), os.path.abspath(b)
    return inner == outer or os.path.dirname(inner) == outer


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _validate(c: RunConfig) -> None:
    """Raises `ConfigError` naming the first flag that is wrong."""
    for check in (
        _check_choices,
        _check_sizes,
        _check_checkpoints,
        _check_model,
        _check_schedule,
        _check_mode_inputs,
    ):
        check(c)


def _check_choices(c: RunConfig) -> None:
    """Each flag that names one of a few choices names one of them."""
    _require(c.mode in MODES, f"--mode: expected one of {', '.join(MODES)}, got {c.mode!r}")
    _require(
        c.optimizer in OPTIMIZERS,
        f"--optimizer: expected one of {', '.join(OPTIMIZERS)}, got {c.optimizer!r}",
    )
    _require(
        c.sharding_strategy in STRATEGIES,
        f"--sharding_strategy: expected one of {', '.join(STRATEGIES)}, "
        f"got {c.sharding_strategy!r}",
    )
    _require(
        c.schedule_from in SCHEDULE_FROM,
        f"--schedule_from: expected one of {', '.join(SCHEDULE_FROM)}, got {c.schedule_from!r}",
    )
    _require(
        c.input_mode in INPUT_MODES,
        f"--input_mode: expected one of {', '.join(INPUT_MODES)}, got {c.input_mode!r}",
    )
    _require(
        c.embedding_dtype in EMBEDDING_DTYPES,
        f"--embedding_dtype: expected one of {', '.join(EMBEDDING_DTYPES)}, "
        f"got {c.embedding_dtype!r}",
    )
    _require(
        c.quantize in QUANTIZATIONS,
        f"--quantize: expected one of {', '.join(QUANTIZATIONS)}, got {c.quantize!r}",
    )
    _require(
        len(c.pooling) > 0 and all(p in POOLINGS for p in c.pooling),
        f"--pooling: expected {' or '.join(POOLINGS)}, one for every table or one per table, "
        f"got {','.join(c.pooling)!r}",
    )
    if c.preemption_signal is not None:
        try:
            parse_signal(c.preemption_signal)
        except ValueError as error:
            raise ConfigError(str(error)) from None


def _check_sizes(c: RunConfig) -> None:
    """Sizes, counts and thresholds in their ranges."""
    _require(c.batch_size > 0, f"--batch_size: expected > 0, got {c.batch_size}")
    for flag in ("data_parallel_threshold", "column_slice_threshold", "row_slice_threshold"):
        _require(getattr(c, flag) >= 0, f"--{flag}: expected >= 0, got {getattr(c, flag)}")
    _require(
        c.embedding_memory_budget_gib >= 0,
        f"--embedding_memory_budget_gib: expected >= 0 (0: no limit), "
        f"got {c.embedding_memory_budget_gib}",
    )
    _require(
        c.valid_batch_size is None or c.valid_batch_size > 0,
        f"--valid_batch_size: expected > 0, got {c.valid_batch_size}",
    )
    _require(
        c.dense_chunk_rows is None or c.dense_chunk_rows >= 0,
        f"--dense_chunk_rows: expected >= 0 (0: the whole batch at once), got {c.dense_chunk_rows}",
    )
    _require(c.epochs >= 1, f"--epochs: expected >= 1, got {c.epochs}")
    _require(
        c.max_steps == -1 or c.max_steps >= 1,
        f"--max_steps: expected -1 (no limit) or >= 1, got {c.max_steps}",
    )
    _require(c.evals_per_epoch >= 0, f"--evals_per_epoch: expected >= 0, got {c.evals_per_epoch}")
    _require(c.print_freq >= 1, f"--print_freq: expected >= 1, got {c.print_freq}")
    _require(
        c.benchmark_warmup_steps >= 0,
        f"--benchmark_warmup_steps: expected >= 0, got {c.benchmark_warmup_steps}",
    )


def _check_checkpoints(c: RunConfig) -> None:
    """What the checkpoint flags need of each other."""
    _require(
        c.keep_checkpoints >= 1, f"--keep_checkpoints: expected >= 1, got {c.keep_checkpoints}"
    )
    for flag in ("checkpoint_every_steps", "checkpoint_every_seconds"):
        _require(
            getattr(c, flag) >= 0, f"--{flag}: expected >= 0 (0: never), got {getattr(c, flag)}"
        )
        _require(
            not getattr(c, flag) or c.save_checkpoint_path is not None,
            f"--{flag}: needs --save_checkpoint_path (where to write them)",
        )
    _require(
        not c.resume or c.save_checkpoint_path is not None,
        "--resume: needs --save_checkpoint_path (the directory to continue from)",
    )
    _require(
        not c.warm_start or c.restore_checkpoint_path is not None,
        "--warm_start: needs --restore_checkpoint_path (the checkpoint to start from)",
    )
    _require(
        not (c.warm_start and _same_directory(c.save_checkpoint_path, c.restore_checkpoint_path)),
        f"--warm_start: expected a --save_checkpoint_path of its own, got "
        f"{c.save_checkpoint_path}, which holds --restore_checkpoint_path "
        f"{c.restore_checkpoint_path}: this run's checkpoints start again at step 1, and "
        f"--resume or --keep_checkpoints would mistake the two runs' checkpoints",
    )


def _check_model(c: RunConfig) -> None:
    """The architecture's widths, and what the interaction asks of them."""
    for flag in ("embedding_dim", "bottom_mlp_dims", "top_mlp_dims"):
        dims = getattr(c, flag)
        _require(
            len(dims) > 0 and all(isinstance(d, int) and d > 0 for d in dims),
            f"--{flag}: expected a comma-separated list of positive widths, got {list(dims)}",
        )
    check_interaction(
        c.interaction,
        c.embedding_dim,
        c.bottom_mlp_dims[-1],
        c.num_cross_layers,
        c.cross_layer_projection_dim,
    )
    _require(
        c.top_mlp_dims[-1] == 1,
        f"--top_mlp_dims: the last width must be 1 (the click logit), got {c.top_mlp_dims[-1]}",
    )


def _check_schedule(c: RunConfig) -> None:
    """The learning-rate schedule's flags (`ScheduleConfig`)."""
    try:
        c.schedule  # noqa: B018  (validates the schedule flags)
    except ValueError as error:
        raise ConfigError(str(error)) from error


def _check_mode_inputs(c: RunConfig) -> None:
    """What the mode reads and writes is given."""
    if c.mode in ("train", "eval", "inference"):
        _require(c.dataset_path is not None, f"--dataset_path: required for --mode {c.mode}")
    if c.mode == "export":
        _require(
            c.restore_checkpoint_path is not None,
            "--restore_checkpoint_path: required for --mode export (the checkpoint to export)",
        )
        _require(
            c.saved_model_output_path is not None,
            "--saved_model_output_path: required for --mode export (where to write it)",
        )
    _require(
        c.quantize == QUANTIZATIONS[0] or c.mode == "export",
        f"--quantize {c.quantize}: only with --mode export (it stores the exported "
        f"SavedModel's tables), got --mode {c.mode}",
    )


def check_interaction(
    interaction: str,
    widths: Sequence[int],
    bottom_width: int | None,
    num_cross_layers: int,
    cross_layer_projection_dim: int,
) -> None:
    """What the interaction asks of the model's widths, for the flags and for
    `ModelConfig` alike. `widths`: the one embedding width, or each table's;
    `bottom_width`: the bottom MLP's last width (None: no bottom MLP).

    Raises:
        ConfigError: naming the flag, the expected and the actual value.
    """
    _require(
        interaction in INTERACTIONS,
        f"--interaction: expected one of {', '.join(INTERACTIONS)}, got {interaction!r}",
    )
    if interaction == "dot":
        _require(
            len(set(widths)) <= 1,
            f"--embedding_dim: the dot interaction needs one width for every table, got "
            f"{','.join(map(str, widths))}; per-table widths need --interaction cross",
        )
        _require(
            bottom_width is None or not widths or bottom_width == widths[0],
            f"--bottom_mlp_dims: the last width must equal --embedding_dim "
            f"({widths[0] if widths else None}) for the dot interaction, got {bottom_width}",
        )
    else:
        _require(
            num_cross_layers >= 1,
            f"--num_cross_layers: expected >= 1 for --interaction cross, got {num_cross_layers}",
        )
        _require(
            cross_layer_projection_dim >= 0,
            f"--cross_layer_projection_dim: expected >= 0 (0: full rank), "
            f"got {cross_layer_projection_dim}",
        )


def check_world_size(config: RunConfig, world_size: int) -> None:
    """The global batch sizes must divide by the number of ranks."""
    for flag, value in (
        ("--batch_size", config.batch_size),
        ("--valid_batch_size", config.eval_batch_size),
    ):
        if value % world_size:
            raise ConfigError(
                f"{flag}: the global batch must divide by the number of ranks ({world_size}); "
                f"got {value} = {value // world_size} * {world_size} + {value % world_size}"
            )
