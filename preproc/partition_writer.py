"""Split-binary part files written by Spark tasks, joined in order by the driver.

Runs in Spark's Python workers, so it needs numpy only. A task receives its rows
sorted by (bucket, order); buckets are consecutive ranges of the final order, and
all rows of a bucket are in one task. Each bucket is written to
`<parts>/<bucket>/` (label.bin, numerical.bin, cat_<i>.bin): staged beside it and
renamed into place when complete, so a retried task replaces it whole and a
failed one leaves no part. The driver then concatenates the buckets' files in
bucket order: one file per feature, rows in the final order.

The executors must see the output directory (always true in local mode; on a
cluster, a shared file system).
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
import shutil
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np

from feature_spec.criteo import LABEL_FILE, NUMERICAL_FILE, categorical_name
from feature_spec.staged import staged_directory

FLOAT16_MAX = float(np.finfo(np.float16).max)
_COPY_BUFFER = 16 << 20


def categorical_file(index: int) -> str:
    return f"{categorical_name(index)}.bin"


@dataclasses.dataclass(frozen=True)
class PartFormat:
    """What a task writes: where, and the dtype and id range of each column.

    Rows given to `write_partition` are (bucket, label, numerical..., categorical...).
    """

    parts_dir: str
    num_numerical: int
    categorical_dtypes: tuple[str, ...]
    cardinalities: tuple[int, ...]
    batch_rows: int = 65536

    @property
    def file_names(self) -> tuple[str, ...]:
        names = [LABEL_FILE]
        if self.num_numerical:
            names.append(NUMERICAL_FILE)
        return (*names, *(categorical_file(i) for i in range(len(self.categorical_dtypes))))


@dataclasses.dataclass
class PartStats:
    """Counts over the rows a task wrote."""

    rows: int
    positives: int
    zero_ids: list[int]  # per categorical feature: rows with id 0 (missing, rare, unseen)
    saturated: list[int]  # per numerical feature: values clipped to the float16 range

    @classmethod
    def empty(cls, part: PartFormat) -> PartStats:
        return cls(0, 0, [0] * len(part.cardinalities), [0] * part.num_numerical)

    def add(self, other: PartStats) -> None:
        self.rows += other.rows
        self.positives += other.positives
        self.zero_ids = [a + b for a, b in zip(self.zero_ids, other.zero_ids, strict=True)]
        self.saturated = [a + b for a, b in zip(self.saturated, other.saturated, strict=True)]


def write_partition(part: PartFormat, rows: Iterable[Sequence[Any]]) -> Iterator[PartStats]:
    """Writes one task's rows (sorted by bucket) into bucket part directories."""
    stats = PartStats.empty(part)
    for bucket, bucket_rows in itertools.groupby(rows, key=lambda row: int(row[0])):
        final = Path(part.parts_dir) / f"{bucket:06d}"
        # Staged under a name of its own: another attempt of the same task (a
        # retry, a speculative copy) may be writing this bucket at the same time.
        # A finished earlier attempt is replaced whole.
        with staged_directory(final, overwrite=True, unique=True) as staging:
            _write_bucket(part, staging, bucket_rows, stats)
    yield stats


def _write_bucket(
    part: PartFormat, directory: Path, rows: Iterator[Sequence[Any]], stats: PartStats
) -> None:
    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(open(directory / name, "wb")) for name in part.file_names]
        while batch := list(itertools.islice(rows, part.batch_rows)):
            _write_batch(part, files, batch, stats)


def _write_batch(
    part: PartFormat, files: Sequence[IO[bytes]], batch: list[Sequence[Any]], stats: PartStats
) -> None:
    columns = list(zip(*batch, strict=True))
    label = np.array(columns[1], dtype=np.bool_)
    arrays: list[np.ndarray] = [label]
    n_num = part.num_numerical
    if n_num:
        values = np.array(columns[2 : 2 + n_num], dtype=np.float64).T
        saturated = (np.abs(values) > FLOAT16_MAX).sum(axis=0)
        clipped = np.clip(values, -FLOAT16_MAX, FLOAT16_MAX)
        arrays.append(clipped.astype(np.float16, order="C"))
        stats.saturated = [a + int(b) for a, b in zip(stats.saturated, saturated, strict=True)]
    for i, column in enumerate(columns[2 + n_num :]):
        ids = np.array(column, dtype=np.int64)
        cardinality = part.cardinalities[i]
        if ids.min() < 0 or ids.max() >= cardinality:
            bad = int(ids[(ids < 0) | (ids >= cardinality)][0])
            raise ValueError(
                f"{categorical_name(i)}: expected ids in [0, {cardinality}), got {bad}"
            )
        stats.zero_ids[i] += int(np.count_nonzero(ids == 0))
        arrays.append(ids.astype(part.categorical_dtypes[i]))
    for file, array in zip(files, arrays, strict=True):
        array.tofile(file)
    stats.rows += len(batch)
    stats.positives += int(np.count_nonzero(label))


def concatenate_parts(part: PartFormat, output_dir: Path) -> int:
    """Joins the bucket parts into one file per feature in `output_dir`, in bucket
    order, deleting each feature's parts once joined (so the disk holds the split
    about once, not twice). Returns the number of buckets joined."""
    parts_dir = Path(part.parts_dir)
    buckets = sorted(p for p in parts_dir.iterdir() if p.is_dir() and p.name.isdigit())
    for name in part.file_names:
        with open(output_dir / name, "wb") as out:
            for bucket in buckets:
                with open(bucket / name, "rb") as source:
                    shutil.copyfileobj(source, out, _COPY_BUFFER)
        for bucket in buckets:  # parts and joined files never both exist whole
            (bucket / name).unlink()
    shutil.rmtree(parts_dir)
    return len(buckets)
