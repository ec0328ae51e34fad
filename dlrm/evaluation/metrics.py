"""Exact evaluation metrics over a whole test split (numpy; no TensorFlow).

ROC AUC is computed exactly from ranks (Mann-Whitney U), with tied scores given
their average rank, so it equals the area under the full ROC curve: no buckets,
no thresholds, as opposed to `tf.keras.metrics.AUC`'s approximation.
"""

from __future__ import annotations

import dataclasses

import numpy as np


@dataclasses.dataclass(frozen=True)
class EvaluationResult:
    auc: float
    logloss: float
    accuracy: float
    samples: int
    positive_rate: float


def roc_auc(labels: np.ndarray, scores: np.ndarray) -> float:
    """Exact ROC AUC of `scores` for binary `labels` (ties count one half).

    Args:
        labels: [N] 0/1 (bool, int or float).
        scores: [N] any monotone score (logits or probabilities).

    Raises:
        ValueError: when shapes differ or only one class is present.
    """
    labels = np.asarray(labels).reshape(-1).astype(bool)
    scores = np.asarray(scores, dtype=np.float64).reshape(-1)
    if labels.shape != scores.shape:
        raise ValueError(
            f"labels and scores: expected equal lengths, got {labels.size} and {scores.size}"
        )
    positives = int(labels.sum())
    negatives = labels.size - positives
    if positives == 0 or negatives == 0:
        raise ValueError(
            f"ROC AUC needs both classes; got {positives} positives and {negatives} negatives"
        )
    order = np.argsort(scores, kind="stable")
    sorted_scores = scores[order]
    # Average 1-based rank of each run of equal scores.
    starts = np.flatnonzero(np.r_[True, sorted_scores[1:] != sorted_scores[:-1]])
    ends = np.r_[starts[1:], scores.size]
    average_rank = (starts + ends + 1) / 2.0
    ranks = np.repeat(average_rank, ends - starts)
    positive_rank_sum = float(ranks[labels[order]].sum())
    u = positive_rank_sum - positives * (positives + 1) / 2.0
    return u / (positives * negatives)


def evaluate(labels: np.ndarray, probabilities: np.ndarray, eps: float = 1e-7) -> EvaluationResult:
    """AUC, mean binary cross-entropy and accuracy (threshold 0.5) of click probabilities."""
    labels = np.asarray(labels).reshape(-1).astype(np.float64)
    probabilities = np.asarray(probabilities, dtype=np.float64).reshape(-1)
    clipped = np.clip(probabilities, eps, 1.0 - eps)
    logloss = -float(np.mean(labels * np.log(clipped) + (1 - labels) * np.log1p(-clipped)))
    accuracy = float(np.mean((probabilities >= 0.5) == (labels >= 0.5)))
    return EvaluationResult(
        auc=roc_auc(labels, probabilities),
        logloss=logloss,
        accuracy=accuracy,
        samples=int(labels.size),
        positive_rate=float(labels.mean()),
    )
