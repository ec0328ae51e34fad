"""Evaluation over a whole test split: exact AUC, logloss and accuracy."""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from dataloading.split_binary import SplitBinaryDataset
from dlrm.distributed.collectives import Collectives
from dlrm.evaluation import metrics
from dlrm.evaluation.predictor import Predictor


class Evaluator:
    """Scores every row of a test split on every rank and computes the metrics
    over all of them (each rank predicts its local rows; one allgather per batch
    brings the whole global batch to every rank). Padding rows (weight 0) are
    left out."""

    def __init__(self, predictor: Predictor, collectives: Collectives) -> None:
        self.predictor = predictor
        self.collectives = collectives

    def evaluate(self, test: SplitBinaryDataset) -> metrics.EvaluationResult:
        labels, probabilities = [], []
        for batch in test.batches():
            prediction = self.predictor.predict(batch.numerical, batch.categorical)
            # Every rank's local rows, in rank order: the whole global batch.
            columns = self.collectives.allgather(
                tf.concat([batch.label, prediction, batch.weight], axis=1), name="evaluation"
            ).numpy()
            keep = columns[:, 2] > 0
            labels.append(columns[keep, 0])
            probabilities.append(columns[keep, 1])
        return metrics.evaluate(np.concatenate(labels), np.concatenate(probabilities))
