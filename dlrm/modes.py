"""The modes other than training: evaluation (exact AUC over the test split),
inference (prediction throughput and latency) and export (a SavedModel from a
checkpoint)."""

from __future__ import annotations

import itertools
import time
from typing import Any

import numpy as np

from dataloading.errors import DatasetError
from dataloading.split_binary import (
    LastBatch,
    SplitBinaryDataset,
    raise_dataset_errors,
)
from dlrm import metrics
from dlrm.checkpoint import Checkpoint, CheckpointError
from dlrm.config import RunConfig
from dlrm.evaluator import Evaluator
from dlrm.export import export_saved_model
from dlrm.model import Dlrm, ModelConfig
from dlrm.reporting import MetricsLog
from dlrm.session import Session, restore_weights
from dlrm.training_state import (
    restore_model_weights,
)
from feature_spec import TEST_MAPPING


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


def eval_record(result: metrics.EvaluationResult) -> dict[str, Any]:
    return {
        "auc": result.auc,
        "logloss": result.logloss,
        "accuracy": result.accuracy,
        "samples": result.samples,
    }


def run_eval(session: Session) -> dict[str, Any]:
    config = session.config
    if config.restore_checkpoint_path:
        checkpoint = restore_weights(session, config.restore_checkpoint_path)
        session.log.print(f"evaluating {checkpoint.path}")
    else:
        session.log.print("evaluating the untrained model (no --restore_checkpoint_path)")
    start = time.perf_counter()
    result = evaluate(session)
    return {"mode": "eval", **eval_record(result), "wall_time_s": time.perf_counter() - start}


def run_inference(session: Session) -> dict[str, Any]:
    """Prediction throughput and latency over the test split, batch by batch."""
    config = session.config
    if config.restore_checkpoint_path:
        restore_weights(session, config.restore_checkpoint_path)
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
