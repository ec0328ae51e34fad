"""ROC AUC and log loss computed apart from `dlrm.evaluation.metrics`, to check it against and to
score the tests' own models.

The AUC is scipy's Mann-Whitney U of the positives' scores against the negatives',
over the number of such pairs: the share of pairs the scores order rightly, a tie
counting one half, which is the area under the ROC curve. scipy rather than
scikit-learn: Keras imports scikit-learn whenever it is installed, and that made
every process that imports TensorFlow (each rank of each test run) take about a
second longer to start; Keras imports scipy only when used.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from scipy.special import xlogy
from scipy.stats import mannwhitneyu


def reference_auc(labels: Any, scores: Any) -> float:
    """ROC AUC of `scores` (any real numbers) for the 0/1 `labels`."""
    positive = np.asarray(labels).astype(bool)
    values = np.asarray(scores, np.float64)
    ours, theirs = values[positive], values[~positive]
    u = mannwhitneyu(ours, theirs, alternative="two-sided", method="asymptotic").statistic
    return float(u) / (ours.size * theirs.size)


def reference_logloss(labels: Any, probabilities: Any) -> float:
    """Mean binary cross-entropy of `probabilities` in (0, 1) for the 0/1 `labels`."""
    y = np.asarray(labels, np.float64)
    p = np.asarray(probabilities, np.float64)
    return float(-np.mean(xlogy(y, p) + xlogy(1.0 - y, 1.0 - p)))
