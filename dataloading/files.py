"""Opening the split-binary files of one mapping: sizes checked against the spec.

Pure numpy (no TensorFlow), so generators, tests and preprocessing checks share it.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import numpy as np

from dataloading.errors import DatasetError
from feature_spec import Feature, FeatureSpec

# Rows scanned at a time by the id-range check (bounded memory for big tables).
_CHECK_CHUNK_ROWS = 1 << 22


class RaggedIds(NamedTuple):
    """A variable-length feature's ids for R rows: row i's ids are
    values[sum(row_lengths[:i]) : sum(row_lengths[:i + 1])]."""

    values: np.ndarray  # [sum of row_lengths]
    row_lengths: np.ndarray  # [R] int64, >= 0

    @classmethod
    def from_offsets(cls, values: np.ndarray, offsets: np.ndarray) -> RaggedIds:
        """From the split-binary form: offsets [R + 1] into `values`, from any start."""
        return cls(np.asarray(values), np.diff(np.asarray(offsets)).astype(np.int64))

    def offsets(self) -> np.ndarray:
        """[R + 1] int64 offsets from 0, as the split-binary offsets file holds them."""
        return np.concatenate([[0], np.cumsum(self.row_lengths, dtype=np.int64)])


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

    def read_rows(self, start: int, count: int) -> np.ndarray:
        """Rows [start, start + count) of the file, fewer past its end, as a new
        array read with positioned reads: a file that shrank since it was opened
        (a copy still in progress, a full disk) is a DatasetError naming it, where
        a memory map would kill the process with SIGBUS."""
        stop = min(start + count, self.rows)
        out = np.empty((max(stop - start, 0), *self.row_shape), self.dtype)
        if out.size == 0:
            return out
        buffer, offset = memoryview(out.data).cast("B"), start * self.row_bytes
        try:
            handle = os.open(self.path, os.O_RDONLY)
        except OSError as error:
            raise DatasetError(f"{self.path}: cannot read data file: {error.strerror}") from error
        try:
            done = 0
            while done < len(buffer):
                got = os.preadv(handle, [buffer[done:]], offset + done)
                if got == 0:
                    raise self._shrank(offset + done)
                done += got
        finally:
            os.close(handle)
        return out

    def _shrank(self, end: int) -> DatasetError:
        expected = self.rows * self.row_bytes
        return DatasetError(
            f"{self.path}: the file ends at byte {end:,}, expected {expected:,} bytes "
            f"({self.rows:,} rows of {self.row_bytes} bytes, as when it was opened): it "
            "shrank while it was being read (a copy still in progress, or a full disk?)"
        )

    def memmap(self) -> np.ndarray:
        """The whole file as a read-only array `[rows, *row_shape]` (no copy), for
        scans before training; training reads with `read_rows`."""
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
    # Variable-length features: int64 [rows + 1] row offsets into their ids.
    offsets: dict[str, BinaryFile] = dataclasses.field(default_factory=dict)

    @classmethod
    def open(cls, spec: FeatureSpec, mapping: str) -> SplitBinaryFiles:
        """Checks that every file of `mapping` exists and holds a whole number of
        rows, the same number in every file; for a variable-length feature, that
        its offsets start at 0 and end at its number of ids.

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
        offsets = {
            name: _open_offsets(path, categorical[name]) for name, path in paths.offsets.items()
        }
        fixed = [c for name, c in categorical.items() if name not in offsets]
        every = [label, *([numerical] if numerical else []), *fixed]
        rows = label.rows
        for file in offsets.values():
            if file.rows - 1 != rows:
                raise DatasetError(
                    f"{file.path}: row count differs from {label.path} in mapping "
                    f"{mapping!r}: expected {rows + 1} int64 offsets = {(rows + 1) * 8} bytes "
                    f"(one more than the rows), got {file.rows} = {file.rows * 8} bytes"
                )
        for file in every:
            if file.rows != rows:
                raise DatasetError(
                    f"{file.path}: row count differs from {label.path} in mapping "
                    f"{mapping!r}: expected {rows} rows = {rows * file.row_bytes} bytes "
                    f"({file.row_bytes} bytes/row), got {file.rows} rows = "
                    f"{file.rows * file.row_bytes} bytes"
                )
        return cls(
            mapping=mapping,
            rows=rows,
            label=label,
            numerical=numerical,
            categorical=categorical,
            offsets=offsets,
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
            feature, index = categorical[table[name]], table[name]
            if name not in self.offsets:
                check_ids_in_range(self.categorical[name], feature, index)
                continue
            # Variable length: rows at a time, so that a bad id's row is named.
            offsets, values = self.offsets[name].memmap(), self.categorical[name].memmap()
            for start in range(0, len(offsets) - 1, _CHECK_CHUNK_ROWS):
                stop = min(start + _CHECK_CHUNK_ROWS, len(offsets) - 1)
                part = np.asarray(offsets[start : stop + 1])
                check_offset_rows(part, start, self.offsets[name])
                ids = RaggedIds.from_offsets(np.asarray(values[part[0] : part[-1]]), part)
                check_ragged_id_rows(ids, start, self.categorical[name], feature, index)


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


def check_ragged_id_rows(
    ids: RaggedIds, first_row: int, file: BinaryFile, feature: Feature, table: int
) -> None:
    """`check_id_rows` for a variable-length table: one min and one max of the
    ids; on a bad id, the row that holds it is named (and its ids listed)."""
    cardinality = int(feature.cardinality)  # type: ignore[arg-type]
    values = ids.values
    if values.size == 0 or (values.min() >= 0 and values.max() < cardinality):
        return
    position = int(np.flatnonzero((values < 0) | (values >= cardinality))[0])
    offsets = ids.offsets()
    row = int(np.searchsorted(offsets, position, side="right")) - 1
    row_ids = values[offsets[row] : offsets[row + 1]]
    raise DatasetError(
        f"{file.path}: table {table} (feature {feature.name!r}) row {first_row + row}: "
        f"expected ids in [0, {cardinality}), got {int(values[position])} "
        f"(ids of the row: {row_ids.tolist()})"
    )


def check_offset_rows(offsets: np.ndarray, first_row: int, file: BinaryFile) -> None:
    """Raises DatasetError if `offsets` (rows `first_row` to `first_row + R` of an
    offsets file, R + 1 values) decrease anywhere: a row would have a negative
    number of ids. One comparison per row when they do not."""
    lengths = np.diff(offsets)
    if lengths.size == 0 or lengths.min() >= 0:
        return
    row = int(np.flatnonzero(lengths < 0)[0])
    raise DatasetError(
        f"{file.path}: offsets of row {first_row + row} decrease: expected "
        f"non-decreasing offsets, got {int(offsets[row])} then {int(offsets[row + 1])}"
    )


def _row_shape(feature: Feature) -> tuple[int, ...]:
    return () if feature.hotness in (0, 1) else (feature.hotness,)


def _open_offsets(path: Path, values: BinaryFile) -> BinaryFile:
    """A variable-length feature's offsets file, its ends checked against `values`."""
    offsets = _open(path, "int64", ())
    if offsets.rows == 0:
        raise DatasetError(
            f"{path}: expected int64 row offsets, at least one value (0), got an empty file"
        )
    data = offsets.memmap()
    first, last = int(data[0]), int(data[-1])
    if first != 0 or last != values.rows:
        raise DatasetError(
            f"{path}: expected offsets from 0 to the number of ids in {values.path} "
            f"({values.rows}), got {first} to {last}"
        )
    return offsets


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
