"""The click log's drift over days (`--drift`): new values, fading ones, and what
that does to a model that is not updated."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from dataloading.criteo_tsv import (
    MAX_ID,
    NUM_CATEGORICAL,
    NUM_INTEGER,
    VocabularyDrift,
    categorical_values,
    generate_criteo_tsv,
    main,
)
from harness.reference_metrics import reference_auc

# Small tables, which a day of a few thousand rows covers, beside one it does not.
CARDINALITIES = (23, 7, 300, 41) + (11,) * 22
SMALL_TABLES = [t for t, c in enumerate(CARDINALITIES) if c <= 41]
DRIFT = 0.2
SEED = 4


class Day:
    """A day file's labels and, per table, its categorical values ([N] uint64,
    0 where missing) and whether each is present."""

    def __init__(self, path: Path) -> None:
        rows = [line.split("\t") for line in path.read_text().splitlines()]
        width = 1 + NUM_INTEGER + NUM_CATEGORICAL
        rows = [fields + [""] * (width - len(fields)) for fields in rows]
        self.labels = np.array([fields[0] == "1" for fields in rows])
        columns = [[fields[1 + NUM_INTEGER + t] for fields in rows] for t in range(NUM_CATEGORICAL)]
        self.values = [np.array([int(v or "0", 16) for v in c], dtype=np.uint64) for c in columns]
        self.present = [np.array([v != "" for v in c]) for c in columns]

    def table(self, t: int) -> np.ndarray:
        return self.values[t][self.present[t]]


def four_days(path: Path, rows_per_day: int, seed: int, drift: float, **options: Any) -> list[Day]:
    """The days of a four-day log without short rows."""
    report = generate_criteo_tsv(
        path,
        days=4,
        rows_per_day=rows_per_day,
        cardinalities=CARDINALITIES,
        short_row_fraction=0.0,
        seed=seed,
        drift=drift,
        **options,
    )
    return [Day(day) for day in report.files]


@pytest.fixture(scope="module")
def drifting_days(tmp_path_factory: pytest.TempPathFactory) -> list[Day]:
    return four_days(tmp_path_factory.mktemp("drift") / "raw", 3000, SEED, DRIFT, chunk_rows=1100)


def generate(path: Path, days: int = 3, seed: int = SEED, **options: float) -> list[bytes]:
    """The day files of a log with short and malformed rows; `drift` given only if in `options`."""
    report = generate_criteo_tsv(
        path,
        days=days,
        rows_per_day=1500,
        cardinalities=CARDINALITIES,
        short_row_fraction=0.05,
        malformed_rows_per_day=5,
        chunk_rows=700,
        seed=seed,
        **options,
    )
    return [p.read_bytes() for p in report.files]


def test_no_drift_is_the_log_without_the_option(tmp_path: Path) -> None:
    without = generate(tmp_path / "without")
    assert generate(tmp_path / "zero", drift=0.0) == without
    # Drift starts on day 1: day 0 is the same whatever the drift.
    drifting = generate(tmp_path / "drift", drift=DRIFT)
    assert drifting[0] == without[0]
    assert drifting[1] != without[1] and drifting[2] != without[2]


def test_drifting_log_is_deterministic_and_a_day_does_not_depend_on_days(tmp_path: Path) -> None:
    # A second run, with more days, repeats the first run's days.
    three = generate(tmp_path / "three", days=3, drift=DRIFT)
    assert generate(tmp_path / "five", days=5, drift=DRIFT)[:3] == three
    assert generate(tmp_path / "two", days=2, drift=DRIFT) == three[:2]
    assert generate(tmp_path / "other_seed", days=2, seed=SEED + 1, drift=DRIFT)[1] != three[1]


def test_each_day_brings_new_values_at_the_requested_share(drifting_days: list[Day]) -> None:
    seen = [set(drifting_days[0].table(t).tolist()) for t in range(NUM_CATEGORICAL)]
    for day in range(1, len(drifting_days)):
        values = [drifting_days[day].table(t) for t in range(NUM_CATEGORICAL)]
        for t in range(NUM_CATEGORICAL):
            unseen = ~np.isin(values[t], np.array(sorted(seen[t]), dtype=np.uint64))
            # A day covers a small table's older values, so what it has not seen
            # is what is new that day.
            if t in SMALL_TABLES:
                assert 0.14 < unseen.mean() < 0.26, (day, t, unseen.mean())
            else:
                assert unseen.mean() > 0.14, (day, t, unseen.mean())
            seen[t].update(values[t].tolist())
        # By construction: the values of the generation born that day.
        born = [
            np.isin(values[t], generation_values(t, day)).mean() for t in range(NUM_CATEGORICAL)
        ]
        assert 0.17 < np.mean(born) < 0.23, (day, born)


def test_old_values_fade(drifting_days: list[Day]) -> None:
    first = drifting_days[0].table(0)
    values, counts = np.unique(first, return_counts=True)
    top = values[np.argsort(-counts)[:5]]
    shares = [np.isin(day.table(0), top).mean() for day in drifting_days]
    assert shares == sorted(shares, reverse=True)
    # (1 - DRIFT)^3 = 0.51 of day 0's share on day 3.
    assert 0.35 < shares[3] / shares[0] < 0.7, shares
    # Day 1's new values fade in turn: DRIFT on day 1, DRIFT * (1 - DRIFT)^2 on day 3.
    born_on_day_1 = [
        np.mean([np.isin(day.table(t), generation_values(t, 1)).mean() for t in SMALL_TABLES])
        for day in drifting_days[1:]
    ]
    assert born_on_day_1 == sorted(born_on_day_1, reverse=True)
    assert 0.1 < born_on_day_1[2] < 0.16, born_on_day_1


def test_labels_keep_their_rate_under_drift(drifting_days: list[Day]) -> None:
    for day in drifting_days:
        assert 0.2 < day.labels.mean() < 0.32


def generation_values(table: int, generation: int) -> np.ndarray:
    ids = VocabularyDrift(DRIFT).generation_ids(CARDINALITIES[table], generation)
    return categorical_values(table, np.array(ids, dtype=np.int64), SEED)


def test_vocabulary_drift_schedule() -> None:
    drift = VocabularyDrift(0.25)
    shares = drift.generation_shares(3)
    np.testing.assert_allclose(shares, [0.75**3, 0.25 * 0.75**2, 0.25 * 0.75, 0.25])
    assert drift.generation_shares(0).tolist() == [1.0]
    # Generations are consecutive ranges of new ids, about rate * C of them.
    assert drift.generation_ids(23, 0) == range(23)
    assert drift.generation_ids(23, 1) == range(23, 29)
    assert drift.generation_ids(23, 2) == range(29, 35)
    assert drift.generation_ids(3, 1) == range(3, 4)  # at least one
    assert VocabularyDrift(1.0).generation_shares(2).tolist() == [0.0, 0.0, 1.0]
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 23, size=10_000)
    assert drift.day_ids(ids, 23, 0, rng, 1.1) is ids
    moved = drift.day_ids(ids, 23, 3, rng, 1.1)
    assert moved.min() >= 0 and moved.max() < 23 + 3 * 6
    kept = moved < 23
    assert np.array_equal(moved[kept], ids[kept])
    assert abs(kept.mean() - 0.75**3) < 0.02
    assert abs((moved >= 35).mean() - 0.25) < 0.02


@pytest.mark.parametrize("rate", [-0.1, 1.5, float("nan")])
def test_vocabulary_drift_refuses_a_share_out_of_range(rate: float) -> None:
    with pytest.raises(ValueError, match=r"drift: expected a share in \[0, 1\]"):
        VocabularyDrift(rate)


def test_vocabulary_drift_keeps_ids_in_the_written_value_range() -> None:
    big = 2**31
    VocabularyDrift(0.4).check_ids_fit([big], days=3)  # last id 2^31 + 2 * 0.4 * 2^31 - 1
    message = rf"C1 \(cardinality {big}\) would reach id .* <= {MAX_ID}"
    with pytest.raises(ValueError, match=message):
        VocabularyDrift(0.6).check_ids_fit([big], days=3)


def test_cli_documents_and_checks_drift(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "--drift F" in capsys.readouterr().out
    with pytest.raises(SystemExit) as exit_info:
        main(["--output_dir", str(tmp_path / "raw"), "--drift", "1.5"])
    assert exit_info.value.code == 2
    assert "error: drift: expected a share in [0, 1], got 1.5" in capsys.readouterr().err
    assert not (tmp_path / "raw").exists()


def target_encoding(days: list[Day]) -> list[dict[int, float]]:
    """Per table, value -> smoothed log-odds of a click: a model with no other parameters."""
    model = []
    for t in range(NUM_CATEGORICAL):
        values = np.concatenate([day.values[t] for day in days])
        labels = np.concatenate([day.labels for day in days])
        keys, inverse, counts = np.unique(values, return_inverse=True, return_counts=True)
        positives = np.bincount(inverse, weights=labels, minlength=len(keys))
        odds = np.log((positives + 1.0) / (counts - positives + 3.0))
        model.append(dict(zip(keys.tolist(), odds.tolist(), strict=True)))
    return model


def auc(model: list[dict[int, float]], day: Day) -> float:
    unknown = float(np.log(1.0 / 3.0))  # the prior's odds, for a value never seen
    scores = np.zeros(len(day.labels))
    for t in range(NUM_CATEGORICAL):
        scores += [model[t].get(v, unknown) for v in day.values[t].tolist()]
    return reference_auc(day.labels, scores)


@pytest.mark.parametrize("drift", [0.0, 0.3])
def test_a_model_not_updated_falls_behind_only_under_drift(tmp_path: Path, drift: float) -> None:
    days = four_days(tmp_path / "raw", rows_per_day=8000, seed=5, drift=drift)
    stale = target_encoding(days[:1])
    stale_auc = [auc(stale, day) for day in days[1:]]
    updated_auc = auc(target_encoding(days[2:3]), days[3])
    if drift:
        assert stale_auc[2] < stale_auc[0] - 0.04, stale_auc
        assert updated_auc > stale_auc[2] + 0.03, (updated_auc, stale_auc)
    else:
        assert max(stale_auc) - min(stale_auc) < 0.02, stale_auc
        assert abs(updated_auc - stale_auc[2]) < 0.02, (updated_auc, stale_auc)
