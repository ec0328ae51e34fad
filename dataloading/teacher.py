"""A fixed random "teacher" click model, and the feature sampler it labels.

Synthetic labels are drawn from the teacher's click probability, so a model
trained on synthetic data has real signal to learn (a test AUC well above 0.5)
instead of coin flips. The teacher uses only what survives preprocessing: per-id
effects of categorical values, pairwise products of two tables' effects (what a
dot interaction can represent) and smooth functions of log-transformed counts.

Per-id effects come from a hash of (table, id), so tables of 40M rows need no
memory. A row with several ids of a table (multi-hot, or variable-length as
`RaggedIds`) has the mean of their effects; a row with none has effect 0. Pure
numpy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from dataloading.files import RaggedIds

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_SQRT3 = float(np.sqrt(3.0))


def splitmix64(values: np.ndarray) -> np.ndarray:
    """A well-mixed 64-bit hash of each value (uint64 in, uint64 out)."""
    with np.errstate(over="ignore"):
        z = values.astype(np.uint64) + _GOLDEN
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def hashed_uniform(values: np.ndarray, key: int) -> np.ndarray:
    """A deterministic value in [-sqrt(3), sqrt(3)) (unit variance) per input value."""
    with np.errstate(over="ignore"):
        mixed = splitmix64(values.astype(np.uint64) ^ np.uint64(key))
    unit = (mixed >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
    return (2.0 * unit - 1.0) * _SQRT3


def power_law_ids(
    rng: np.random.Generator, cardinality: int, size: int | tuple[int, ...], exponent: float
) -> np.ndarray:
    """Ids in [0, cardinality) with P(id = k) roughly proportional to (k + 1)^-exponent.

    Inverse-CDF sampling of the continuous power law on [1, cardinality + 1);
    exponent 0 is uniform. Id 0 is the most frequent, as after preprocessing.
    """
    u = rng.random(size)
    n = float(cardinality)
    if exponent == 0.0:
        x = u * n
    elif exponent == 1.0:
        x = np.exp(u * np.log1p(n)) - 1.0
    else:
        one_minus = 1.0 - exponent
        x = ((np.power(n + 1.0, one_minus) - 1.0) * u + 1.0) ** (1.0 / one_minus) - 1.0
    return np.minimum(x.astype(np.int64), cardinality - 1)


@dataclasses.dataclass(frozen=True)
class FeatureSampler:
    """Samples raw rows: non-negative counts (with some negatives and missing values
    as in Criteo's integer columns) and power-law categorical ids.

    Attributes:
        hotness: ids per row per table; 0 is a variable-length table, whose rows
            have a uniform number of ids in [0, max_variable_hotness] (empty rows
            included).
        max_variable_hotness: the most ids of a row of a variable-length table.
    """

    num_numerical: int
    cardinalities: tuple[int, ...]
    hotness: tuple[int, ...]
    exponent: float = 1.1
    missing_numerical: float = 0.1
    missing_categorical: float = 0.03
    max_variable_hotness: int = 8

    def __post_init__(self) -> None:
        if len(self.hotness) != len(self.cardinalities):
            raise ValueError(
                f"hotness: expected one value per table ({len(self.cardinalities)}), "
                f"got {len(self.hotness)}"
            )
        if any(hot < 0 for hot in self.hotness):
            raise ValueError(f"hotness: expected values >= 0, got {list(self.hotness)}")
        if self.max_variable_hotness < 1:
            raise ValueError(
                f"max_variable_hotness: expected an int >= 1, got {self.max_variable_hotness}"
            )

    def sample(self, rng: np.random.Generator, rows: int) -> RawRows:
        # Counts: a log-normal per column, floored; the second column may go
        # negative by a little, as Criteo's I2 does.
        mu = np.linspace(0.5, 4.0, self.num_numerical)
        counts = np.floor(np.exp(rng.normal(mu, 1.2, size=(rows, self.num_numerical))))
        counts = counts.astype(np.int64)
        if self.num_numerical > 1:
            counts[:, 1] -= rng.integers(0, 3, size=rows) * (rng.random(rows) < 0.1)
        numerical_missing = rng.random((rows, self.num_numerical)) < self.missing_numerical
        ids: list[np.ndarray | RaggedIds] = []
        categorical_missing = []
        for cardinality, hot in zip(self.cardinalities, self.hotness, strict=True):
            if hot == 0:
                lengths = rng.integers(0, self.max_variable_hotness + 1, size=rows)
                values = power_law_ids(rng, cardinality, int(lengths.sum()), self.exponent)
                ids.append(RaggedIds(values, lengths.astype(np.int64)))
            else:
                shape = (rows,) if hot == 1 else (rows, hot)
                ids.append(power_law_ids(rng, cardinality, shape, self.exponent))
            categorical_missing.append(rng.random(rows) < self.missing_categorical)
        return RawRows(counts, numerical_missing, ids, categorical_missing)


@dataclasses.dataclass
class RawRows:
    counts: np.ndarray  # [N, n_num] int64, may be negative
    numerical_missing: np.ndarray  # [N, n_num] bool
    ids: list[np.ndarray | RaggedIds]  # per table [N], [N, hotness] or ragged, int64
    categorical_missing: list[np.ndarray]  # per table [N] bool

    def numerical_features(self) -> np.ndarray:
        """[N, n_num] float32: log(1 + max(count, 0)), 0 when missing (as preproc does)."""
        clamped = np.where(self.numerical_missing, 0, np.maximum(self.counts, 0))
        return np.log1p(clamped).astype(np.float32)


@dataclasses.dataclass(frozen=True)
class Teacher:
    """logit = bias + numerical part + sum_t scale_t * e_t(id) + pairs e_a * e_b."""

    table_keys: tuple[int, ...]
    table_scales: tuple[float, ...]
    pairs: tuple[tuple[int, int, float], ...]
    numerical_weights: tuple[float, ...]
    numerical_centers: tuple[float, ...]
    bias: float = 0.0

    @classmethod
    def create(
        cls,
        num_numerical: int,
        num_tables: int,
        seed: int,
        num_pairs: int = 8,
    ) -> Teacher:
        rng = np.random.default_rng([seed, 0x7EAC4E7])
        keys = tuple(int(k) for k in rng.integers(1, 2**62, size=num_tables))
        scales = tuple(float(s) for s in rng.uniform(0.2, 1.0, size=num_tables))
        pairs = []
        if num_tables >= 2:
            for _ in range(num_pairs):
                a, b = rng.choice(num_tables, size=2, replace=False)
                pairs.append((int(a), int(b), float(rng.uniform(0.3, 0.8))))
        weights = tuple(float(w) for w in rng.normal(0.0, 0.5, size=num_numerical))
        centers = tuple(float(c) for c in rng.uniform(1.0, 3.0, size=num_numerical))
        return cls(keys, scales, tuple(pairs), weights, centers)

    def id_effects(self, table: int, ids: np.ndarray | RaggedIds) -> np.ndarray:
        """[N] effect per row; multi-hot rows ([N, h]) and variable-length rows
        (`RaggedIds` of N rows) average their ids' effects, an empty row is 0."""
        if isinstance(ids, RaggedIds):
            effects = hashed_uniform(ids.values, self.table_keys[table])
            lengths = np.asarray(ids.row_lengths, dtype=np.int64)
            # bincount over each id's row, not reduceat: reduceat would give an
            # empty row the next row's first effect.
            rows = np.repeat(np.arange(len(lengths)), lengths)
            sums = np.bincount(rows, weights=effects, minlength=len(lengths))
            return sums / np.maximum(lengths, 1)
        effects = hashed_uniform(ids, self.table_keys[table])
        return effects if effects.ndim == 1 else effects.mean(axis=1)

    def logits(
        self,
        numerical: np.ndarray,
        ids: Sequence[np.ndarray | RaggedIds],
        categorical_missing: Sequence[np.ndarray] | None = None,
    ) -> np.ndarray:
        """[N] float64 logits for rows of numerical features ([N, n_num], already
        log-transformed) and categorical ids (per table [N], [N, h] or `RaggedIds`
        of N rows); a missing categorical value (`categorical_missing`, per table
        [N] bool) has effect 0."""
        rows = numerical.shape[0]
        out = np.full(rows, self.bias)
        if numerical.shape[1]:
            centered = numerical.astype(np.float64) - np.asarray(self.numerical_centers)
            out += np.tanh(centered) @ np.asarray(self.numerical_weights)
        effects = []
        for table, table_ids in enumerate(ids):
            effect = self.id_effects(table, table_ids)
            if categorical_missing is not None:
                effect = np.where(categorical_missing[table], 0.0, effect)
            effects.append(effect)
            out += self.table_scales[table] * effect
        for a, b, weight in self.pairs:
            out += weight * effects[a] * effects[b]
        return out

    def scaled(self, factor: float) -> Teacher:
        """The teacher with every weight multiplied by `factor` (bias unchanged)."""
        return dataclasses.replace(
            self,
            table_scales=tuple(s * factor for s in self.table_scales),
            pairs=tuple((a, b, w * factor) for a, b, w in self.pairs),
            numerical_weights=tuple(w * factor for w in self.numerical_weights),
        )

    def calibrated(self, logits_without_bias: np.ndarray, positive_rate: float) -> Teacher:
        """The teacher with the bias that gives `positive_rate` on these logits."""
        low, high = -30.0, 30.0
        for _ in range(60):
            mid = 0.5 * (low + high)
            rate = float(np.mean(_sigmoid(logits_without_bias - self.bias + mid)))
            low, high = (mid, high) if rate < positive_rate else (low, mid)
        return dataclasses.replace(self, bias=0.5 * (low + high))

    def sample_labels(self, rng: np.random.Generator, logits: np.ndarray) -> np.ndarray:
        return rng.random(logits.shape[0]) < _sigmoid(logits)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))
