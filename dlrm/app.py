"""The application behind `main.py`: train, eval, inference and export modes.

Takes a validated `RunConfig`; builds the dataset readers, the model and the
trainer from it and the dataset's FeatureSpec; reports through `MetricsLog`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import socket
import time
from pathlib import Path
from typing import Any, TextIO

import keras
import numpy as np
import tensorflow as tf

from dataloading.errors import DatasetError
from dataloading.files import SplitBinaryFiles
from dataloading.split_binary import (
    InputMode,
    LastBatch,
    ShardSpec,
    SplitBinaryDataset,
    raise_dataset_errors,
)
from dlrm import kernels, metrics
from dlrm.checkpoint import Checkpoint, CheckpointError
from dlrm.config import ConfigError, RunConfig, check_world_size
from dlrm.dist import (
    Collectives,
    check_ranks_agree,
    create_collectives,
    format_cpus,
)
from dlrm.embedding.planner import (
    PlanError,
    PlannerConfig,
    ShardingPlan,
    TableSpec,
    plan_sharding,
)
from dlrm.embedding.sharded import ShardedEmbeddings
from dlrm.evaluator import Evaluator
from dlrm.export import export_saved_model
from dlrm.launch import launched_by_horovod
from dlrm.model import Dlrm, ModelConfig
from dlrm.optimizers import create_optimizer
from dlrm.precision import Precision, bfloat16_note, choose_precision, matmul_gflops
from dlrm.predictor import Predictor
from dlrm.reporting import MetricsLog, Throughput, format_duration
from dlrm.schedule import DlrmSchedule
from dlrm.trainer import Trainer
from dlrm.training_state import (
    check_model_matches,
    restore_model_weights,
    restore_on_every_rank,
    restore_training_state,
    save_training_state,
)
from feature_spec import TEST_MAPPING, TRAIN_MAPPING, FeatureSpec, FeatureSpecError


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


def has_gpu() -> bool:
    return bool(tf.config.list_physical_devices("GPU"))


def kernels_apply(config: RunConfig, model_config: ModelConfig, log: MetricsLog) -> bool:
    """Whether the model runs on the project's CPU kernels (`dlrm.kernels`): asked
    for (`--use_kernels`), on CPUs, and built. When only the last fails, says so:
    it costs speed. Each part of the model uses the kernels it has: the dot
    interaction its own (not under `--xla`, which compiles the dense part from
    TensorFlow's ops), the cross interaction none, while the lookups, the finite
    check and SGD's updates, which run outside the compiled function, use theirs
    with either interaction and with `--xla` too."""
    if not config.use_kernels or has_gpu():
        return False
    if kernels.load() is None:
        log.print(
            f"the CPU kernels are not in use ({kernels.unavailable_reason()}): the "
            f"{model_config.interaction} model runs on TensorFlow's ops, slower"
        )
        return False
    return True


def eval_steps(steps_per_epoch: int, epochs: int, evals_per_epoch: int) -> list[int]:
    """Global step counts after which to evaluate: evenly spaced in each epoch."""
    points = []
    for epoch in range(epochs):
        for k in range(1, evals_per_epoch + 1):
            points.append(epoch * steps_per_epoch + round(k * steps_per_epoch / evals_per_epoch))
    return sorted(set(p for p in points if p > 0))


@dataclasses.dataclass
class Session:
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
    slots = {"sgd": 0, "adagrad": 1, "adam": 2}[config.optimizer]
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


def build_session(
    config: RunConfig, log: MetricsLog, collectives: Collectives | None = None
) -> Session:
    """Dataset spec, model (sharded when there are several ranks) and trainer."""
    collectives = collectives or Collectives()
    spec = FeatureSpec.load(config.feature_spec_path)
    model_config = model_config_for(spec, config)
    keras.utils.set_random_seed(config.seed)
    on_gpu = has_gpu()
    precision = choose_precision(config.amp, on_gpu)
    if precision.dtype_policy == "mixed_bfloat16":
        float32, bfloat16 = matmul_gflops(tf.float32), matmul_gflops(tf.bfloat16)
        log.print(bfloat16_note(float32, bfloat16))
        log.write("matmul_gflops", float32=float32, bfloat16=bfloat16)
    dense_chunk_rows = config.dense_chunk_rows_for(on_gpu, collectives.world_size)
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
        log.print(plan.format_table())
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
        )
    model = Dlrm(
        model_config,
        embeddings=embeddings,
        dtype_policy=precision.dtype_policy,
        seed=config.seed,
        use_xla=config.xla,
        use_kernels=kernels_apply(config, model_config, log),
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
    return Session(
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
    )


def _open_checkpoint(path: str, model_config: ModelConfig) -> Checkpoint:
    checkpoint = Checkpoint(path)
    check_model_matches(checkpoint, model_config.to_dict())
    return checkpoint


# ---------------------------------------------------------------- evaluation


def evaluate(session: Session) -> metrics.EvaluationResult:
    """Exact AUC, logloss and accuracy over the whole test split."""
    test = SplitBinaryDataset(
        session.spec,
        TEST_MAPPING,
        session.shard(session.config.eval_batch_size),
        last_batch=LastBatch.PAD,
        check_batch_ids=session.config.check_ids,
    )
    if test.num_batches == 0:
        raise DatasetError(f"{session.config.feature_spec_path}: the test split has no rows")
    return Evaluator(session.predictor, session.collectives).evaluate(test)


def _eval_record(result: metrics.EvaluationResult) -> dict[str, Any]:
    return {
        "auc": result.auc,
        "logloss": result.logloss,
        "accuracy": result.accuracy,
        "samples": result.samples,
    }


# ------------------------------------------------------------------ training


def train(session: Session) -> dict[str, Any]:
    config, log = session.config, session.log
    trainer = session.trainer
    assert trainer is not None
    train_data = SplitBinaryDataset(
        session.spec,
        TRAIN_MAPPING,
        session.shard(config.batch_size),
        check_batch_ids=config.check_ids,
    )
    steps_per_epoch = train_data.num_batches
    if steps_per_epoch == 0:
        raise DatasetError(
            f"{config.feature_spec_path}: the train split has {train_data.rows} rows, fewer "
            f"than one global batch (--batch_size {config.batch_size})"
        )
    total_steps = config.epochs * steps_per_epoch
    if config.max_steps > 0:
        total_steps = min(total_steps, config.max_steps)
    start_step = 0
    if config.restore_checkpoint_path:
        path = config.restore_checkpoint_path

        def restore() -> tuple[Checkpoint, int]:
            checkpoint = _open_checkpoint(path, session.model_config)
            return checkpoint, restore_training_state(trainer, checkpoint)

        checkpoint, start_step = restore_on_every_rank(session.collectives, path, restore)
        log.print(f"restored {checkpoint.path} at step {start_step}")
    if config.save_checkpoint_path and session.collectives.rank == 0:
        config.write(config.save_checkpoint_path)
        if session.plan is not None:  # reusable with --sharding_plan
            session.plan.save(Path(config.save_checkpoint_path) / "sharding_plan.json")
    evals = [
        s
        for s in eval_steps(steps_per_epoch, config.epochs, config.evals_per_epoch)
        if start_step < s <= total_steps
    ]
    if not evals or evals[-1] != total_steps:
        evals.append(total_steps)
    log.print(
        f"training: {train_data.rows:,} rows, {steps_per_epoch:,} steps per epoch of "
        f"{config.batch_size:,}; steps {start_step:,} -> {total_steps:,}; "
        f"precision {session.precision.dtype_policy}, xla {config.xla}, "
        f"optimizer {config.optimizer}"
    )
    log.write(
        "start",
        step=start_step,
        total_steps=total_steps,
        config=config.to_dict(),
        hosts=session.hosts,  # rank r ran on hosts[r]
    )
    throughput = Throughput(config.batch_size, start_step, total_steps)
    wall_start = time.perf_counter()
    train_seconds = 0.0
    last_result: metrics.EvaluationResult | None = None
    checkpoint_path: Path | None = None
    step = start_step
    loss = float("nan")
    while step < total_steps:
        epoch, position = divmod(step, steps_per_epoch)
        segment_start = time.perf_counter()
        for batch in train_data.batches(start=position):
            loss_tensor = trainer.train_step(batch)
            step += 1
            report = step % config.print_freq == 0
            if report or step in evals or step == total_steps:
                # Each rank's loss is its share of the global mean: their sum is it.
                loss = float(session.collectives.allreduce_sum([loss_tensor], ["loss"])[0].numpy())
                trainer.check_finite()
            if report:
                samples_per_second, eta = throughput.mark(step)
                lr = float(trainer.learning_rate(tf.constant(step - 1, tf.int64)))
                log.print(
                    f"epoch {epoch} step {step:,}/{total_steps:,} | loss {loss:.5f} | "
                    f"lr {lr:.4g} | {samples_per_second:,.0f} samples/s | "
                    f"ETA {format_duration(eta)}"
                )
                log.write(
                    "train",
                    step=step,
                    epoch=epoch,
                    loss=loss,
                    learning_rate=lr,
                    samples_per_second=samples_per_second,
                )
            if step in evals:
                train_seconds += time.perf_counter() - segment_start
                last_result = evaluate(session)
                log.print(
                    f"eval at step {step:,}: AUC {last_result.auc:.5f} | logloss "
                    f"{last_result.logloss:.5f} | accuracy {last_result.accuracy:.4f} "
                    f"({last_result.samples:,} samples)"
                )
                log.write("eval", step=step, epoch=epoch, **_eval_record(last_result))
                if config.save_checkpoint_path:
                    checkpoint_path = save_training_state(
                        trainer,
                        config.save_checkpoint_path,
                        _manifest_fields(session),
                        keep=config.keep_checkpoints,
                    )
                    log.print(f"checkpoint: {checkpoint_path}")
                throughput.mark(step)
                segment_start = time.perf_counter()
            if step >= total_steps:
                break
        train_seconds += time.perf_counter() - segment_start
    trainer.check_finite()
    if last_result is None:  # resumed at or past the end: evaluate what was restored
        last_result = evaluate(session)
    trained = step - start_step
    summary = {
        "mode": "train",
        "steps": step,
        "steps_this_run": trained,
        "final_loss": loss,
        "train_samples_per_second": trained * config.batch_size / train_seconds
        if train_seconds > 0
        else 0.0,
        "wall_time_s": time.perf_counter() - wall_start,
        **_eval_record(last_result),
        "checkpoint": str(checkpoint_path) if checkpoint_path else None,
        "world_size": session.collectives.world_size,
    }
    return summary


def _manifest_fields(session: Session) -> dict[str, Any]:
    return {
        "config": session.config.to_dict(),
        "model": session.model_config.to_dict(),
        "precision": session.precision.dtype_policy,
        "world_size": session.collectives.world_size,
        "plan": session.plan.to_dict() if session.plan is not None else None,
    }


# ------------------------------------------------------------- other modes


def _restore_weights(session: Session, path: str) -> Checkpoint:
    def restore() -> Checkpoint:
        checkpoint = _open_checkpoint(path, session.model_config)
        restore_model_weights(session.model, checkpoint)
        return checkpoint

    checkpoint: Checkpoint = restore_on_every_rank(session.collectives, path, restore)
    return checkpoint


def run_eval(session: Session) -> dict[str, Any]:
    config = session.config
    if config.restore_checkpoint_path:
        checkpoint = _restore_weights(session, config.restore_checkpoint_path)
        session.log.print(f"evaluating {checkpoint.path}")
    else:
        session.log.print("evaluating the untrained model (no --restore_checkpoint_path)")
    start = time.perf_counter()
    result = evaluate(session)
    return {"mode": "eval", **_eval_record(result), "wall_time_s": time.perf_counter() - start}


def run_inference(session: Session) -> dict[str, Any]:
    """Prediction throughput and latency over the test split, batch by batch."""
    config = session.config
    if config.restore_checkpoint_path:
        _restore_weights(session, config.restore_checkpoint_path)
    test = SplitBinaryDataset(
        session.spec,
        TEST_MAPPING,
        session.shard(config.eval_batch_size),
        last_batch=LastBatch.PAD,
        check_batch_ids=config.check_ids,
    )
    steps = config.max_steps if config.max_steps > 0 else test.num_batches
    warmup = config.benchmark_warmup_steps
    latencies = []
    dataset = raise_dataset_errors(test.to_tf_dataset().repeat())
    for index, batch in enumerate(itertools.islice(dataset, steps + warmup)):
        start = time.perf_counter()
        session.predictor.predict(batch.numerical, batch.categorical).numpy()
        if index >= warmup:
            latencies.append(time.perf_counter() - start)
        if index % config.print_freq == 0:
            session.log.print(f"inference batch {index:,}/{steps + warmup:,}")
    seconds = np.asarray(latencies)
    return {
        "mode": "inference",
        "batch_size": config.eval_batch_size,
        "steps": len(latencies),
        "samples_per_second": config.eval_batch_size / float(seconds.mean()),
        "latency_mean_ms": 1000 * float(seconds.mean()),
        "latency_p50_ms": 1000 * float(np.percentile(seconds, 50)),
        "latency_p90_ms": 1000 * float(np.percentile(seconds, 90)),
        "latency_p99_ms": 1000 * float(np.percentile(seconds, 99)),
    }


def run_export(config: RunConfig, log: MetricsLog) -> dict[str, Any]:
    """SavedModel from a checkpoint; needs no dataset (the manifest has the model)."""
    assert config.restore_checkpoint_path and config.saved_model_output_path
    checkpoint = Checkpoint(config.restore_checkpoint_path)
    model_values = checkpoint.manifest.get("model")
    if not isinstance(model_values, dict):
        raise CheckpointError(f"{checkpoint.path}: the manifest has no model config")
    model_config = ModelConfig.from_dict(model_values)
    model = Dlrm(model_config, dtype_policy="float32")
    restore_model_weights(model, checkpoint)
    output = export_saved_model(model, config.saved_model_output_path)
    log.print(f"exported {checkpoint.path} (step {checkpoint.step}) to {output}")
    return {"mode": "export", "checkpoint": str(checkpoint.path), "saved_model": str(output)}


def run(config: RunConfig, console: TextIO | None = None) -> dict[str, Any]:
    """Runs `config.mode`; returns the summary record (also logged by rank 0)."""
    if config.mode == "export" and launched_by_horovod():
        raise ConfigError(
            "--mode export: run it as one process (python main.py ...), not under "
            "horovodrun/srun/mpirun: every rank would write the same SavedModel"
        )
    collectives = create_collectives(config.bind_cpus) if config.mode != "export" else Collectives()
    check_world_size(config, collectives.world_size)
    log = MetricsLog(
        config.metrics_log_path,
        config.tensorboard_path,
        enabled=collectives.rank == 0,
        console=console,
    )
    try:
        if config.mode == "export":
            summary = run_export(config, log)
        else:
            session = build_session(config, log, collectives)
            if config.mode == "train":
                summary = train(session)
            elif config.mode == "eval":
                summary = run_eval(session)
            else:
                summary = run_inference(session)
        log.write("summary", **summary)
        log.print(
            "summary: "
            + ", ".join(
                f"{key} {value:.5g}" if isinstance(value, float) else f"{key} {value}"
                for key, value in summary.items()
            )
            + (
                f" (wall {format_duration(summary['wall_time_s'])})"
                if "wall_time_s" in summary
                else ""
            )
        )
        return summary
    finally:
        log.close()
