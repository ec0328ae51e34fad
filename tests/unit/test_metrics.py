"""Exact AUC, logloss and accuracy against computations apart from ours
(`reference_metrics`)."""

from __future__ import annotations

import numpy as np
import pytest

from dlrm.evaluation.metrics import evaluate, roc_auc
from harness.reference_metrics import reference_auc, reference_logloss


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auc_matches_the_reference_on_random_scores(seed: int) -> None:
    rng = np.random.default_rng(seed)
    labels = rng.random(50_001) < 0.27
    scores = rng.normal(size=labels.size) + 0.8 * labels
    assert roc_auc(labels, scores) == pytest.approx(reference_auc(labels, scores), abs=1e-12)


@pytest.mark.parametrize("levels", [2, 7, 100])
def test_auc_matches_the_reference_with_ties(levels: int) -> None:
    rng = np.random.default_rng(levels)
    labels = rng.random(20_000) < 0.3
    # Few distinct scores: most pairs are tied and must count one half.
    scores = np.round(rng.random(labels.size) * (levels - 1) + labels * 0.4) / levels
    assert len(np.unique(scores)) <= levels + 1
    assert roc_auc(labels, scores) == pytest.approx(reference_auc(labels, scores), abs=1e-12)


def test_auc_extremes() -> None:
    labels = np.array([0, 0, 1, 1])
    assert roc_auc(labels, np.array([0.1, 0.2, 0.3, 0.4])) == 1.0
    assert roc_auc(labels, np.array([0.4, 0.3, 0.2, 0.1])) == 0.0
    assert roc_auc(labels, np.zeros(4)) == 0.5


def test_auc_needs_both_classes() -> None:
    with pytest.raises(ValueError, match="both classes; got 0 positives and 3 negatives"):
        roc_auc(np.zeros(3), np.arange(3.0))
    with pytest.raises(ValueError, match="equal lengths"):
        roc_auc(np.zeros(3), np.arange(4.0))


def test_evaluate_matches_the_reference() -> None:
    rng = np.random.default_rng(5)
    labels = (rng.random(10_000) < 0.25).astype(np.float32)
    probabilities = np.clip(rng.random(labels.size) * 0.6 + 0.3 * labels, 0, 1)
    result = evaluate(labels, probabilities)
    assert result.auc == pytest.approx(reference_auc(labels, probabilities), abs=1e-12)
    assert result.logloss == pytest.approx(reference_logloss(labels, probabilities), rel=1e-6)
    assert result.accuracy == pytest.approx(np.mean(labels == (probabilities >= 0.5)))
    assert result.samples == 10_000
    assert result.positive_rate == pytest.approx(labels.mean())


def test_the_reference_counts_pairs_and_halves_ties() -> None:
    """The references themselves, on numbers counted by hand: of the 4 (positive,
    negative) pairs, 0.35 > 0.1, 0.8 > 0.1 and 0.8 > 0.4 are ordered rightly,
    0.35 < 0.4 is not; a tie counts one half."""
    labels = np.array([0, 0, 1, 1])
    assert reference_auc(labels, [0.1, 0.4, 0.35, 0.8]) == 0.75
    assert reference_auc(labels, [0.1, 0.4, 0.4, 0.8]) == 0.875
    expected = -(np.log(0.9) + np.log(0.6) + np.log(0.35) + np.log(0.8)) / 4
    assert reference_logloss(labels, [0.1, 0.4, 0.35, 0.8]) == pytest.approx(expected, rel=1e-12)
