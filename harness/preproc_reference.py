"""An independent, pure-Python model of what preprocessing writes, for the Spark
tests to compare against; and a one-step training check on a written dataset.

Only the documented rules are shared with `preproc` (thresholds, id order, the
shuffle key), never its code.
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections import Counter
from collections.abc import Hashable, Iterable, Sequence
from pathlib import Path

import numpy as np

from feature_spec import FeatureSpec


@dataclasses.dataclass(frozen=True)
class Row:
    """A well-formed input line, parsed."""

    file: int  # index of its file in the run's input order
    key: str  # the file's name without compression suffix
    line: int  # 0-based line number in its file
    label: bool
    numerical: tuple[float, ...]  # after the numerical transform
    categorical: tuple[Hashable | None, ...]  # raw values (None: missing)


def build_vocabulary(values: Iterable[Hashable | None], threshold: int) -> dict[Hashable, int]:
    """value -> id: ids 1.. by descending count, ties by ascending value; values
    seen fewer than `threshold` times get none."""
    counts = Counter(v for v in values if v is not None)
    kept = sorted((v for v, c in counts.items() if c >= threshold), key=lambda v: (-counts[v], v))
    return {value: i + 1 for i, value in enumerate(kept)}


def shuffle_key(seed: int, key: str, line: int) -> int:
    """The documented train-order key: 60 bits of sha256("<seed>:<file>:<line>")."""
    return int(hashlib.sha256(f"{seed}:{key}:{line}".encode()).hexdigest()[:15], 16)


def expected_arrays(
    rows: Sequence[Row],
    vocabularies: Sequence[dict[Hashable, int] | None],
    dtypes: Sequence[str],
    shuffle: bool,
    seed: int,
) -> dict[str, np.ndarray]:
    """The file contents of one mapping: label, numerical, cat_<i>."""
    if shuffle:
        ordered = sorted(rows, key=lambda r: (shuffle_key(seed, r.key, r.line), r.file, r.line))
    else:
        ordered = sorted(rows, key=lambda r: (r.file, r.line))
    out = {"label": np.array([r.label for r in ordered], dtype=np.bool_)}
    n_num = len(ordered[0].numerical) if ordered else 0
    numerical = np.array([r.numerical for r in ordered], dtype=np.float64).reshape(-1, n_num)
    out["numerical"] = np.clip(numerical, -65504, 65504).astype(np.float16)
    for i, (vocabulary, dtype) in enumerate(zip(vocabularies, dtypes, strict=True)):
        values = [r.categorical[i] for r in ordered]
        if vocabulary is None:  # ids given in the input
            ids = [0 if v is None else int(v) for v in values]  # type: ignore[call-overload]
        else:
            ids = [vocabulary.get(v, 0) if v is not None else 0 for v in values]
        out[f"cat_{i}"] = np.array(ids, dtype=dtype)
    return out


def read_mapping(dataset_dir: Path, mapping: str) -> dict[str, np.ndarray]:
    """The files of a written mapping as arrays, keyed as `expected_arrays`."""
    spec = FeatureSpec.load(dataset_dir)
    files = spec.files(mapping)
    out = {"label": np.fromfile(files.label, dtype=np.bool_)}
    if files.numerical is not None:
        n_num = len(spec.numerical_features)
        out["numerical"] = np.fromfile(files.numerical, dtype=np.float16).reshape(-1, n_num)
    for i, feature in enumerate(spec.categorical_features):
        out[f"cat_{i}"] = np.fromfile(files.categorical[feature.name], dtype=feature.dtype)
    return out


def train_one_step(dataset_dir: Path, batch_size: int = 64) -> tuple[float, float]:
    """One SGD step of a tiny embeddings + dense model on the first train batch read
    by the project's loader. Returns (loss, largest weight change)."""
    import keras
    import tensorflow as tf

    from dataloading.split_binary import ShardSpec, SplitBinaryDataset

    spec = FeatureSpec.load(dataset_dir, required_mappings=("train",))
    dataset = SplitBinaryDataset(spec, "train", ShardSpec(global_batch_size=batch_size))
    batch = next(iter(dataset.to_tf_dataset()))
    # Seeded: the loss's bound in the tests must not depend on a random start (an
    # unseeded one once gave 2.37 on a CI run).
    keras.utils.set_random_seed(0)
    tables = [keras.layers.Embedding(c, 3) for c in spec.cardinalities]
    dense = keras.layers.Dense(1)

    def logits() -> tf.Tensor:
        looked_up = [t(batch.categorical[:, i]) for i, t in enumerate(tables)]
        return dense(tf.concat([batch.numerical, *looked_up], axis=1))

    logits()  # builds the layers
    variables = [v for layer in (*tables, dense) for v in layer.trainable_variables]
    before = [v.numpy().copy() for v in variables]
    with tf.GradientTape() as tape:
        loss = tf.reduce_mean(
            tf.nn.sigmoid_cross_entropy_with_logits(labels=batch.label, logits=logits())
        )
    gradients = tape.gradient(loss, variables)
    keras.optimizers.SGD(learning_rate=0.5).apply_gradients(zip(gradients, variables, strict=True))
    change = max(float(np.abs(v.numpy() - b).max()) for v, b in zip(variables, before, strict=True))
    return float(loss), change
