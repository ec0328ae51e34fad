"""Split-binary part files written by Spark tasks, joined in order by the driver.

Runs in Spark's Python workers (numpy and pyarrow). A task receives its rows as
Arrow record batches (`DataFrame.mapInArrow`: columns, no Python object per row),
sorted by (bucket, order); buckets are consecutive ranges of the final order, and
all rows of a bucket are in one task. Each bucket is written to
`<parts>/<bucket>/` (label.bin, numerical.bin, cat_<i>.bin): staged beside it and
renamed into place when complete, so a retried task replaces it whole and a
failed one leaves no part. The driver then concatenates the buckets' files in
bucket order: one file per feature, rows in the final order.

A variable-length feature's part is its ids, one row's after another, and the
row lengths (`cat_<i>.lengths.bin`, int64): a task cannot know how many ids the
buckets before its own hold. The driver turns the lengths into the global row
offsets (`cat_<i>.offsets.bin`, int64 [rows + 1] from 0) as it joins the buckets,
carrying the running id count from one bucket to the next.

A categorical feature with a small vocabulary arrives as its values (text), not
ids: the task looks them up itself (`PartFormat.vocabularies`), with pyarrow's
hash lookup over whole columns, in place of a Spark join per feature; a value
without an id gets its OOV bucket (`vocabulary.oov_bucket`) when there are buckets.

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
from typing import IO

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from feature_spec import offsets_file_name
from feature_spec.criteo import LABEL_FILE, NUMERICAL_FILE, categorical_name
from feature_spec.staged import staged_directory
from preproc.vocabulary import ID_COLUMN, VALUE_COLUMN, oov_bucket_ids

FLOAT16_MAX = float(np.finfo(np.float16).max)
_COPY_BUFFER = 16 << 20


def categorical_file(index: int) -> str:
    return f"{categorical_name(index)}.bin"


def categorical_offsets_file(index: int) -> str:
    """The row offsets of a variable-length feature."""
    return offsets_file_name(categorical_file(index))


def _lengths_file(index: int) -> str:
    return f"{categorical_name(index)}.lengths.bin"


@dataclasses.dataclass(frozen=True)
class PartFormat:
    """What a task writes: where, and the dtype and id range of each column.

    The columns given to `write_partition` are (bucket, label, numerical...,
    categorical...); a variable-length categorical value is a list of ids.

    Attributes:
        variable_length: per categorical feature, whether it is a list of ids;
            empty: none is.
        vocabularies: per categorical feature, the vocabulary directory of the
            feature (`vocabulary.feature_directory`) when its column holds values
            for the task to look up, else None; empty: every column holds ids.
        oov_buckets: per categorical feature, its OOV buckets (ids 1..K): where a
            value looked up has no id, and what `PartStats.bucket_ids` counts;
            empty: none.
        new_ids_from: per categorical feature, the least id `PartStats.new_ids`
            counts (a carried vocabulary's first new id); empty: none is counted.
    """

    parts_dir: str
    num_numerical: int
    categorical_dtypes: tuple[str, ...]
    cardinalities: tuple[int, ...]
    variable_length: tuple[bool, ...] = ()
    vocabularies: tuple[str | None, ...] = ()
    oov_buckets: tuple[int, ...] = ()
    new_ids_from: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("variable_length", "vocabularies", "oov_buckets", "new_ids_from"):
            given = getattr(self, name)
            if given and len(given) != len(self.cardinalities):
                raise ValueError(
                    f"{name}: expected one entry per categorical feature "
                    f"({len(self.cardinalities)}), got {len(given)}"
                )

    def is_variable_length(self, index: int) -> bool:
        return bool(self.variable_length) and self.variable_length[index]

    def buckets(self, index: int) -> int:
        return self.oov_buckets[index] if self.oov_buckets else 0

    @property
    def file_names(self) -> tuple[str, ...]:
        """The files of a bucket part, in the order `_write_batch` fills them."""
        names = [LABEL_FILE]
        if self.num_numerical:
            names.append(NUMERICAL_FILE)
        for index in range(len(self.categorical_dtypes)):
            names.append(categorical_file(index))
            if self.is_variable_length(index):
                names.append(_lengths_file(index))
        return tuple(names)


@dataclasses.dataclass
class PartStats:
    """Counts over the rows a task wrote."""

    rows: int
    positives: int
    zero_ids: list[int]  # per categorical feature: ids 0 (missing, rare, unseen)
    saturated: list[int]  # per numerical feature: values clipped to the float16 range
    ids: list[int]  # per categorical feature: ids written (rows, unless variable-length)
    bucket_ids: list[int]  # per categorical feature: ids 1..K (OOV buckets: rare, unseen)
    new_ids: list[int]  # per categorical feature: ids >= `PartFormat.new_ids_from`

    @classmethod
    def empty(cls, part: PartFormat) -> PartStats:
        features = len(part.cardinalities)
        return cls(
            0,
            0,
            [0] * features,
            [0] * part.num_numerical,
            [0] * features,
            [0] * features,
            [0] * features,
        )

    def add(self, other: PartStats) -> None:
        self.rows += other.rows
        self.positives += other.positives
        self.zero_ids = [a + b for a, b in zip(self.zero_ids, other.zero_ids, strict=True)]
        self.saturated = [a + b for a, b in zip(self.saturated, other.saturated, strict=True)]
        self.ids = [a + b for a, b in zip(self.ids, other.ids, strict=True)]
        self.bucket_ids = [a + b for a, b in zip(self.bucket_ids, other.bucket_ids, strict=True)]
        self.new_ids = [a + b for a, b in zip(self.new_ids, other.new_ids, strict=True)]


@dataclasses.dataclass(frozen=True)
class _Segment:
    """Consecutive rows of one bucket, as arrays.

    Attributes:
        numerical: float64 [rows, num_numerical], or None when there is none.
        categorical: per feature, its ids (int64) and, for a variable-length
            feature, the row lengths (int64 [rows]; None otherwise).
    """

    bucket: int
    label: np.ndarray
    numerical: np.ndarray | None
    categorical: list[tuple[np.ndarray, np.ndarray | None]]


def write_partition(part: PartFormat, batches: Iterable[pa.RecordBatch]) -> Iterator[PartStats]:
    """Writes one task's rows into bucket part directories.

    `batches` hold the columns (bucket, label, numerical..., categorical...) in that
    order, rows sorted by bucket; no value is null (a list may be empty).
    """
    stats = PartStats.empty(part)
    vocabularies = [
        None if directory is None else _vocabulary(directory)
        for directory in part.vocabularies or [None] * len(part.cardinalities)
    ]
    segments = (s for batch in batches for s in _segments(part, batch, vocabularies))
    for bucket, bucket_segments in itertools.groupby(segments, key=lambda s: s.bucket):
        final = Path(part.parts_dir) / f"{bucket:06d}"
        # Staged under a name of its own: another attempt of the same task (a
        # retry, a speculative copy) may be writing this bucket at the same time.
        # A finished earlier attempt is replaced whole.
        with staged_directory(final, overwrite=True, unique=True) as staging:
            _write_bucket(part, staging, bucket_segments, stats)
    yield stats


def write_arrow_partition(
    part: PartFormat, batches: Iterable[pa.RecordBatch]
) -> Iterator[pa.RecordBatch]:
    """`write_partition` for `DataFrame.mapInArrow`: its stats as one row of
    `STATS_SCHEMA`."""
    for stats in write_partition(part, batches):
        yield pa.RecordBatch.from_pydict(
            {field.name: [getattr(stats, field.name)] for field in STATS_SCHEMA},
            schema=STATS_SCHEMA,
        )


# The one row `write_arrow_partition` returns per task (`PartStats`' fields); the
# driver gives Spark the same schema (`pyspark.sql.pandas.types.from_arrow_schema`).
STATS_SCHEMA = pa.schema(
    [
        ("rows", pa.int64()),
        ("positives", pa.int64()),
        ("zero_ids", pa.list_(pa.int64())),
        ("saturated", pa.list_(pa.int64())),
        ("ids", pa.list_(pa.int64())),
        ("bucket_ids", pa.list_(pa.int64())),
        ("new_ids", pa.list_(pa.int64())),
    ]
)


def _segments(
    part: PartFormat, batch: pa.RecordBatch, vocabularies: Sequence[_Vocabulary | None]
) -> Iterator[_Segment]:
    """The rows of `batch` as arrays, cut where the bucket changes; a column with a
    vocabulary as its values' ids."""
    if batch.num_rows == 0:
        return
    bucket = batch.column(0).to_numpy()
    label = batch.column(1).to_numpy(zero_copy_only=False)
    n_num = part.num_numerical
    numerical = None
    if n_num:
        numerical = np.column_stack([batch.column(2 + i).to_numpy() for i in range(n_num)])
    categorical = []
    for i in range(len(part.cardinalities)):
        column = batch.column(2 + n_num + i)
        vocabulary = vocabularies[i]
        if vocabulary is not None:
            column = _look_up(vocabulary, column, part.buckets(i))
        if part.is_variable_length(i):
            offsets = column.offsets.to_numpy().astype(np.int64)
            ids = column.flatten().to_numpy().astype(np.int64)
            categorical.append((ids, np.diff(offsets), offsets - offsets[0]))
        else:
            categorical.append((column.to_numpy().astype(np.int64), None, None))
    cuts = np.flatnonzero(bucket[1:] != bucket[:-1]) + 1
    for start, stop in zip([0, *cuts], [*cuts, len(bucket)], strict=True):
        yield _Segment(
            bucket=int(bucket[start]),
            label=label[start:stop],
            numerical=None if numerical is None else numerical[start:stop],
            categorical=[
                (ids[start:stop], None)
                if offsets is None
                else (ids[offsets[start] : offsets[stop]], lengths[start:stop])
                for ids, lengths, offsets in categorical
            ],
        )


# A vocabulary as the writers use it: its values, and ids with 0 prepended
# (ids[position + 1] is the id of values[position]).
_Vocabulary = tuple[pa.Array, np.ndarray]
# Per worker process (Spark reuses them across tasks and jobs): vocabulary
# directory -> (the identity of its files, the vocabulary).
_VOCABULARIES: dict[str, tuple[tuple[tuple[str, int, int, int], ...], _Vocabulary]] = {}


def _vocabulary(directory: str) -> _Vocabulary:
    """The vocabulary in `directory`, read again only when its files changed (a
    later run in the same Spark session may rewrite the same directory)."""
    path = Path(directory)
    files = sorted(path.glob("*.parquet")) if path.is_dir() else []
    identity = tuple(
        (f.name, s.st_ino, s.st_size, s.st_mtime_ns) for f, s in ((f, f.stat()) for f in files)
    )
    cached = _VOCABULARIES.get(directory)
    if cached is not None and cached[0] == identity:
        return cached[1]
    tables = [pq.read_table(f, columns=[VALUE_COLUMN, ID_COLUMN]) for f in files]
    if tables:
        table = pa.concat_tables(tables)
        values = table.column(VALUE_COLUMN).combine_chunks()
        ids = table.column(ID_COLUMN).to_numpy()
    else:  # no value was kept: every id is 0
        values, ids = pa.array([], pa.string()), np.zeros(0, np.int64)
    vocabulary = (values, np.concatenate([[0], ids]).astype(np.int64))
    _VOCABULARIES[directory] = (identity, vocabulary)
    return vocabulary


def _look_up(vocabulary: _Vocabulary, column: pa.Array, buckets: int = 0) -> pa.Array:
    """The ids of `column`'s values (missing: 0; rare, unseen: their OOV bucket, or 0
    without buckets); a list column's elements one by one, the lists kept."""
    values, ids = vocabulary
    elements = pc.list_flatten(column) if pa.types.is_list(column.type) else column
    if len(values):
        positions = pc.fill_null(pc.index_in(elements, value_set=values), -1).to_numpy()
        found_ids = ids[positions + 1]
    else:
        positions = np.full(len(elements), -1)
        found_ids = np.zeros(len(elements), np.int64)
    if buckets:
        unknown = (positions < 0) & elements.is_valid().to_numpy(zero_copy_only=False)
        if unknown.any():
            found_ids[unknown] = oov_bucket_ids(elements.filter(pa.array(unknown)), buckets)
    found = pa.array(found_ids)
    if not pa.types.is_list(column.type):
        return found
    offsets = column.offsets.to_numpy()
    return pa.ListArray.from_arrays(pa.array(offsets - offsets[0], pa.int32()), found)


def _write_bucket(
    part: PartFormat, directory: Path, segments: Iterator[_Segment], stats: PartStats
) -> None:
    with contextlib.ExitStack() as stack:
        files = [stack.enter_context(open(directory / name, "wb")) for name in part.file_names]
        for segment in segments:
            _write_segment(part, files, segment, stats)


def _write_segment(
    part: PartFormat, files: Sequence[IO[bytes]], segment: _Segment, stats: PartStats
) -> None:
    label = segment.label.astype(np.bool_, copy=False)
    arrays: list[np.ndarray] = [label]
    if segment.numerical is not None:
        values = segment.numerical
        saturated = (np.abs(values) > FLOAT16_MAX).sum(axis=0)
        clipped = np.clip(values, -FLOAT16_MAX, FLOAT16_MAX)
        arrays.append(clipped.astype(np.float16, order="C"))
        stats.saturated = [a + int(b) for a, b in zip(stats.saturated, saturated, strict=True)]
    for i, (ids, lengths) in enumerate(segment.categorical):
        cardinality = part.cardinalities[i]
        if ids.size and (ids.min() < 0 or ids.max() >= cardinality):
            bad = int(ids[(ids < 0) | (ids >= cardinality)][0])
            raise ValueError(
                f"{categorical_name(i)}: expected ids in [0, {cardinality}), got {bad}"
            )
        stats.zero_ids[i] += int(np.count_nonzero(ids == 0))
        stats.ids[i] += int(ids.size)
        if part.buckets(i):
            stats.bucket_ids[i] += int(np.count_nonzero((ids > 0) & (ids <= part.buckets(i))))
        if part.new_ids_from:
            stats.new_ids[i] += int(np.count_nonzero(ids >= part.new_ids_from[i]))
        arrays.append(ids.astype(part.categorical_dtypes[i]))
        if lengths is not None:
            arrays.append(lengths)
    for file, array in zip(files, arrays, strict=True):
        array.tofile(file)
    stats.rows += len(label)
    stats.positives += int(np.count_nonzero(label))


def concatenate_parts(part: PartFormat, output_dir: Path) -> int:
    """Joins the bucket parts into one file per feature in `output_dir`, in bucket
    order, deleting each feature's parts once joined (so the disk holds the split
    about once, not twice); a variable-length feature's row lengths become its
    global row offsets. Returns the number of buckets joined."""
    parts_dir = Path(part.parts_dir)
    buckets = sorted(p for p in parts_dir.iterdir() if p.is_dir() and p.name.isdigit())
    offsets_files = {
        _lengths_file(i): categorical_offsets_file(i)
        for i in range(len(part.cardinalities))
        if part.is_variable_length(i)
    }
    for name in part.file_names:
        if name in offsets_files:
            _join_offsets([bucket / name for bucket in buckets], output_dir / offsets_files[name])
        else:
            with open(output_dir / name, "wb") as out:
                for bucket in buckets:
                    with open(bucket / name, "rb") as source:
                        shutil.copyfileobj(source, out, _COPY_BUFFER)
        for bucket in buckets:  # parts and joined files never both exist whole
            (bucket / name).unlink()
    shutil.rmtree(parts_dir)
    return len(buckets)


def _join_offsets(lengths_files: Sequence[Path], output: Path) -> None:
    """Writes int64 offsets [rows + 1] from 0: the running sum of the row lengths of
    `lengths_files` in order, so each bucket's offsets go on from the ids before it."""
    total = 0
    with open(output, "wb") as out:
        np.zeros(1, dtype=np.int64).tofile(out)
        for path in lengths_files:
            with open(path, "rb") as source:
                while chunk := source.read(_COPY_BUFFER):  # a multiple of 8 bytes
                    offsets = total + np.cumsum(np.frombuffer(chunk, dtype=np.int64))
                    offsets.tofile(out)
                    total = int(offsets[-1])
