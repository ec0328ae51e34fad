"""`--mode eval`, and the evaluation the training loop runs: exact AUC, logloss
and accuracy over the whole test split."""

from __future__ import annotations

import time
from typing import Any

from dataloading.errors import DatasetError
from dataloading.split_binary import (
    LastBatch,
    SplitBinaryDataset,
)
from dlrm.app.assembly import AssembledRun
from dlrm.app.restore import restore_weights
from dlrm.evaluation import metrics
from dlrm.evaluation.evaluator import Evaluator
from feature_spec import TEST_MAPPING


def evaluate(run: AssembledRun) -> metrics.EvaluationResult:
    """Exact AUC, logloss and accuracy over the whole test split."""
    test = SplitBinaryDataset(
        run.spec,
        TEST_MAPPING,
        run.shard(run.config.eval_batch_size),
        last_batch=LastBatch.PAD,
        check_batch_ids=run.config.check_ids,
    )
    if test.num_batches == 0:
        raise DatasetError(f"{run.config.feature_spec_path}: the test split has no rows")
    return Evaluator(run.predictor, run.collectives).evaluate(test)


def eval_record(result: metrics.EvaluationResult) -> dict[str, Any]:
    return {
        "auc": result.auc,
        "logloss": result.logloss,
        "accuracy": result.accuracy,
        "samples": result.samples,
    }


def run_eval(run: AssembledRun) -> dict[str, Any]:
    config = run.config
    if config.restore_checkpoint_path:
        checkpoint = restore_weights(run, config.restore_checkpoint_path)
        run.log.print(f"evaluating {checkpoint.path}")
    else:
        run.log.print("evaluating the untrained model (no --restore_checkpoint_path)")
    start = time.perf_counter()
    result = evaluate(run)
    return {"mode": "eval", **eval_record(result), "wall_time_s": time.perf_counter() - start}
