"""Opening the split-binary files of one mapping: sizes checked against the spec.

Pure numpy (no TensorFlow), so generators, tests and preprocessing checks share it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from dataloading.errors import DatasetError
from feature_spec import Feature, FeatureSpec

# Rows scanned at a time by the id-range check (bounded memory for big tables).
_CHECK_CHUNK_ROWS = 1 << 22


@dataclasses.dataclass(frozen=True)
class BinaryFile:
    """One headerless row-major file: `rows` rows of `row_shape` values of `dtype`."""

    path: Path
    dtype: np.dtype
    row_shape: tuple[int, ...]
    rows: int

    @property
    def row_bytes(self) -> int:
        return int(self.dtype.itemsize * int(np.prod(self.row_shape, dtype=np.int64)))

    def memmap(self) -> np.ndarray:
        """The whole file as a read-only array `[rows, *row_shape]` (no copy)."""
        if self.rows == 0:
            return np.zeros((0, *self.row_shape), dtype=self.dtype)
        return np.memmap(self.path, dtype=self.dtype, mode="r", shape=(self.rows, *self.row_shape))


@dataclasses.dataclass(frozen=True)
class SplitBinaryFiles:
    """The validated files of one mapping (e.g. "train") of a FeatureSpec dataset."""

    mapping: str
    rows: int
    label: BinaryFile
    numerical: BinaryFile | None
    categorical: dict[str, BinaryFile]

    @classmethod
    def open(cls, spec: FeatureSpec, mapping: str) -> SplitBinaryFiles:
        """Checks that every file of `mapping` exists and holds a whole number of
        rows, the same number in every file.

        Raises:
            DatasetError: naming the file, the expected and the actual bytes.
            FeatureSpecError: when the mapping is not in the spec.
        """
        paths = spec.files(mapping)
        label = _open(paths.label, spec.label_feature.dtype, ())
        numerical = None
        if paths.numerical is not None:
            numerical = _open(paths.numerical, "float16", (len(spec.numerical_features),))
        categorical = {
            feature.name: _open(paths.categorical[feature.name], feature.dtype, _row_shape(feature))
            for feature in spec.categorical_features
        }
        every = [label, *([numerical] if numerical else []), *categorical.values()]
        rows = label.rows
        for file in every:
            if file.rows != rows:
                raise DatasetError(
                    f"{file.path}: row count differs from {label.path} in mapping "
                    f"{mapping!r}: expected {rows} rows = {rows * file.row_bytes} bytes "
                    f"({file.row_bytes} bytes/row), got {file.rows} rows = "
                    f"{file.rows * file.row_bytes} bytes"
                )
        return cls(
            mapping=mapping, rows=rows, label=label, numerical=numerical, categorical=categorical
        )

    def check_ids(self, spec: FeatureSpec, features: Sequence[str] | None = None) -> None:
        """Checks that every id of the files lies in [0, cardinality); reads the
        files in chunks (a whole-dataset scan: seconds to minutes on big datasets).

        Raises:
            DatasetError: naming the table, the file, the first bad row, its value
                and the range.
        """
        categorical = spec.categorical_features
        table = {f.name: t for t, f in enumerate(categorical)}
        for name in features if features is not None else list(self.categorical):
            check_ids_in_range(self.categorical[name], categorical[table[name]], table[name])


def check_ids_in_range(file: BinaryFile, feature: Feature, table: int) -> None:
    """Raises DatasetError if any id of `file` is outside [0, feature.cardinality).

    `table` is the feature's index among the categorical features (for the message).
    """
    data = file.memmap()
    for start in range(0, file.rows, _CHECK_CHUNK_ROWS):
        check_id_rows(
            np.asarray(data[start : start + _CHECK_CHUNK_ROWS]), start, file, feature, table
        )


def check_id_rows(
    ids: np.ndarray, first_row: int, file: BinaryFile, feature: Feature, table: int
) -> None:
    """Raises DatasetError if any of `ids` is outside [0, feature.cardinality).

    Costs one min and one max when every id is in range; only then is the first
    bad row located, for the message.

    Args:
        ids: [R] or [R, hotness], rows `first_row` to `first_row + R` of `file`.
        first_row: the index in `file` of the first row of `ids`.
        file: where the ids were read (for the message).
        feature: the categorical feature of `file`.
        table: the feature's index among the categorical features.

    Raises:
        DatasetError: naming the table (index and feature), the file, the first bad
            row, its first bad value and the expected range.
    """
    cardinality = int(feature.cardinality)  # type: ignore[arg-type]
    if ids.size == 0 or (ids.min() >= 0 and ids.max() < cardinality):
        return
    bad = ((ids < 0) | (ids >= cardinality)).reshape(len(ids), -1)
    offset = int(np.flatnonzero(bad.any(axis=1))[0])
    row_ids = ids[offset].reshape(-1)
    value = int(row_ids[bad[offset]][0])
    ids_of_row = f" (ids of the row: {row_ids.tolist()})" if row_ids.size > 1 else ""
    raise DatasetError(
        f"{file.path}: table {table} (feature {feature.name!r}) row {first_row + offset}: "
        f"expected ids in [0, {cardinality}), got {value}{ids_of_row}"
    )


def _row_shape(feature: Feature) -> tuple[int, ...]:
    return () if feature.hotness == 1 else (feature.hotness,)


def _open(path: Path, dtype: str, row_shape: tuple[int, ...]) -> BinaryFile:
    np_dtype = np.dtype(dtype)
    row_bytes = int(np_dtype.itemsize * int(np.prod(row_shape, dtype=np.int64)))
    try:
        size = path.stat().st_size
    except OSError as err:
        raise DatasetError(f"{path}: cannot open data file: {err.strerror}") from err
    rows, remainder = divmod(size, row_bytes)
    if remainder:
        raise DatasetError(
            f"{path}: size is not a whole number of rows: expected a multiple of "
            f"{row_bytes} bytes ({dtype} x {list(row_shape) or 1} per row), got {size} "
            f"bytes ({rows} rows + {remainder} bytes)"
        )
    return BinaryFile(path=path, dtype=np_dtype, row_shape=row_shape, rows=rows)
