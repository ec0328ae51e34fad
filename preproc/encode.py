"""Encoding one mapping's rows (ids, transformed numericals) and writing them in order.

Order: the train rows by a seeded hash of (file key, line number), a shuffle that
is the same for the same seed and input whatever the Spark partitioning; the other
mappings in input order (file, then line). Rows are spread over `buckets`,
consecutive ranges of that order, with one Spark shuffle (no sampling pass), sorted
within each task, handed to Python as Arrow batches (`mapInArrow`), written as part
files by `partition_writer` and joined in bucket order.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from preproc.config import NumericalTransform
from preproc.layout import (
    LABEL_COLUMN,
    CategoricalKind,
    InputLayout,
    categorical_column,
    numerical_column,
)
from preproc.parse import FILE_COLUMN, LINE_COLUMN
from preproc.partition_writer import (
    STATS_SCHEMA,
    PartFormat,
    PartStats,
    concatenate_parts,
    write_arrow_partition,
)
from preproc.vocabulary import (
    ID_COLUMN,
    VALUE_COLUMN,
    feature_directory,
    oov_bucket_column,
    read_vocabulary,
)

if TYPE_CHECKING:
    from pyspark.sql import Column, DataFrame, SparkSession

# Shuffle keys are the first 15 hex digits (60 bits) of sha256("<seed>:<file key>:<line>").
SHUFFLE_KEY_BITS = 60
ORDER_COLUMN = "_order"
BUCKET_COLUMN = "_bucket"
# Vocabularies up to this many ids are looked up by the binary writers themselves
# (pyarrow builds a hash table of the vocabulary per Arrow batch, so this stays
# near the batch size, `preproc.spark.ARROW_BATCH_ROWS`); up to BROADCAST_VOCABULARY_IDS they are
# broadcast to every task (hash join, no shuffle); bigger ones are joined with a
# shuffle.
WRITER_VOCABULARY_IDS = 1 << 16
BROADCAST_VOCABULARY_IDS = 2_000_000
# Buckets per output partition: task t writes buckets [4t, 4t + 4) (`bucket_partition`).
BUCKETS_PER_PARTITION = 4
# Spark's hash partitioning of a row into n partitions: pmod(hash(key), n), where
# hash is Murmur3 x86 32-bit with this seed (Spark's `hash` function).
_SPARK_HASH_SEED = 42
_UINT32 = np.uint64(0xFFFFFFFF)


@dataclasses.dataclass(frozen=True)
class Ordering:
    """How a mapping's rows are ordered.

    Attributes:
        shuffle: order by the seeded hash (train) instead of input order.
        seed: the shuffle seed.
        file_keys: per input file index, its shuffle name.
        file_offsets: per input file index, the number of lines of the mapping's
            earlier files (input order); files of other mappings are ignored.
        total_lines: lines in the mapping's files.
    """

    shuffle: bool
    seed: int
    file_keys: tuple[str, ...]
    file_offsets: tuple[int, ...]
    total_lines: int


def encode(
    spark: SparkSession,
    rows: DataFrame,
    layout: InputLayout,
    vocabulary_dir: Path | None,
    cardinalities: Sequence[int],
    transform: NumericalTransform,
    oov_buckets: int = 0,
) -> tuple[DataFrame, tuple[str | None, ...]]:
    """Well-formed rows with `_line` -> [_file, _line, _label, _num<i> (double),
    _cat<i> (int, or array<int> for a variable-length feature)], and per
    categorical feature the vocabulary directory the writers look its values up in
    (`PartFormat.vocabularies`): such a `_cat<i>` keeps its values. A value of a
    vocabulary feature without an id gets its OOV bucket (1..`oov_buckets`), as the
    writers' lookup gives it; without buckets, 0."""
    from pyspark.sql import functions as F

    schema = rows.schema
    cat_values: list[Column] = []
    lookups: list[str | None] = [None] * len(layout.categorical)
    for index, column in enumerate(layout.categorical):
        name = categorical_column(index)
        small = cardinalities[index] <= WRITER_VOCABULARY_IDS
        if column.uses_vocabulary and vocabulary_dir is not None and small:
            lookups[index] = str(feature_directory(vocabulary_dir, index))
            cat_values.append(F.col(name))
            continue
        if column.kind == CategoricalKind.ID or vocabulary_dir is None:
            if column.variable_length:
                ids = F.transform(name, lambda value: F.coalesce(value.cast("int"), F.lit(0)))
                cat_values.append(ids.alias(name))
            else:
                cat_values.append(F.coalesce(F.col(name).cast("int"), F.lit(0)).alias(name))
            continue
        value_type = schema[name].dataType
        if column.variable_length:
            value_type = value_type.elementType  # type: ignore[attr-defined]
        vocabulary = read_vocabulary(spark, vocabulary_dir, index, value_type)
        vocabulary = vocabulary.select(
            F.col(VALUE_COLUMN).alias(f"_v{index}"), F.col(ID_COLUMN).alias(f"_id{index}")
        )
        if cardinalities[index] <= BROADCAST_VOCABULARY_IDS:
            vocabulary = F.broadcast(vocabulary)
        if column.variable_length:
            rows = _join_list_ids(rows, index, vocabulary, oov_buckets)
            cat_values.append(F.col(f"_id{index}").alias(name))
            continue
        rows = rows.join(vocabulary, F.col(name) == F.col(f"_v{index}"), "left")
        cat_values.append(_id_or_bucket(F.col(f"_id{index}"), F.col(name), oov_buckets).alias(name))
    num_values = [
        _transform(F.col(numerical_column(i)), transform).alias(numerical_column(i))
        for i in range(len(layout.numerical))
    ]
    encoded = rows.select(FILE_COLUMN, LINE_COLUMN, LABEL_COLUMN, *num_values, *cat_values)
    return encoded, tuple(lookups)


def _id_or_bucket(found: Column, value: Column, oov_buckets: int) -> Column:
    """The id a join found; else the value's OOV bucket, or 0 (missing, no buckets)."""
    from pyspark.sql import functions as F

    if not oov_buckets:
        return F.coalesce(found, F.lit(0))
    return F.coalesce(found, oov_bucket_column(value, oov_buckets), F.lit(0))


def _join_list_ids(
    rows: DataFrame, index: int, vocabulary: DataFrame, oov_buckets: int = 0
) -> DataFrame:
    """`rows` with `_id<index>`: the ids of the list `_cat<index>`, element by element
    through `vocabulary` [_v<index>, _id<index>] (missing: 0; rare, unseen: their OOV
    bucket, or 0).

    The elements are looked up one per row and gathered again by (file, line), which
    names a row of a mapping uniquely; a row with an empty list gets none back.
    """
    from pyspark.sql import functions as F

    value, ids = f"_v{index}", f"_id{index}"
    elements = rows.select(
        FILE_COLUMN,
        LINE_COLUMN,
        F.posexplode(categorical_column(index)).alias("_position", "_element"),
    )
    found = elements.join(vocabulary, F.col("_element") == F.col(value), "left")
    pairs = F.struct(
        "_position", _id_or_bucket(F.col(ids), F.col("_element"), oov_buckets).alias("_id")
    )
    gathered = found.groupBy(FILE_COLUMN, LINE_COLUMN).agg(
        F.sort_array(F.collect_list(pairs)).alias("_pairs")
    )
    lists = gathered.select(
        FILE_COLUMN, LINE_COLUMN, F.transform("_pairs", lambda pair: pair["_id"]).alias(ids)
    )
    joined = rows.join(lists, [FILE_COLUMN, LINE_COLUMN], "left")
    return joined.withColumn(ids, F.coalesce(F.col(ids), F.array().cast("array<int>")))


def _transform(value: Column, transform: NumericalTransform) -> Column:
    from pyspark.sql import functions as F

    value = F.coalesce(value.cast("double"), F.lit(0.0))
    if transform == NumericalTransform.NONE:
        return value
    value = F.greatest(value, F.lit(0.0))
    return F.log1p(value) if transform == NumericalTransform.LOG else value


def order_columns(encoded: DataFrame, ordering: Ordering, buckets: int) -> DataFrame:
    """`encoded` with `_order` (the final position's sort key) and `_bucket`."""
    from pyspark.sql import functions as F

    if ordering.shuffle:
        keys = F.element_at(
            F.array(*[F.lit(k) for k in ordering.file_keys]), F.col(FILE_COLUMN) + 1
        )
        text = F.concat_ws(":", F.lit(str(ordering.seed)), keys, F.col(LINE_COLUMN).cast("string"))
        digits = SHUFFLE_KEY_BITS // 4
        order = F.conv(F.substring(F.sha2(text, 256), 1, digits), 16, 10).cast("long")
        span = float(1 << SHUFFLE_KEY_BITS)
    else:
        offsets = F.element_at(
            F.array(*[F.lit(o).cast("long") for o in ordering.file_offsets]),
            F.col(FILE_COLUMN) + 1,
        )
        order = offsets + F.col(LINE_COLUMN)
        span = float(max(ordering.total_lines, 1))
    bucket = F.least(F.floor(F.col(ORDER_COLUMN) / F.lit(span / buckets)), F.lit(buckets - 1))
    with_order = encoded.withColumn(ORDER_COLUMN, order)
    return with_order.withColumn(BUCKET_COLUMN, bucket.cast("int"))


def write_ordered(
    ordered: DataFrame,
    layout: InputLayout,
    part: PartFormat,
    output_dir: Path,
    partitions: int,
    buckets: int,
) -> PartStats:
    """Writes the rows of `ordered` (with `_order`, `_bucket`) as split binary files."""
    from pyspark.sql.pandas.types import from_arrow_schema

    columns = [
        BUCKET_COLUMN,
        LABEL_COLUMN,
        *(numerical_column(i) for i in range(len(layout.numerical))),
        *(categorical_column(i) for i in range(len(layout.categorical))),
    ]
    tasks = (
        ordered.repartition(partitions, bucket_partition(partitions, buckets))
        # The bucket never decreases with the order, so this is also bucket order;
        # a long first key lets Spark's sort compare 8-byte prefixes.
        .sortWithinPartitions(ORDER_COLUMN, FILE_COLUMN, LINE_COLUMN)
        .select(*columns)
    )
    Path(part.parts_dir).mkdir(parents=True, exist_ok=True)
    write = functools.partial(write_arrow_partition, part)
    total = PartStats.empty(part)
    for row in tasks.mapInArrow(write, from_arrow_schema(STATS_SCHEMA)).collect():
        total.add(PartStats(**row.asDict()))
    concatenate_parts(part, output_dir)
    return total


def bucket_partition(partitions: int, buckets: int) -> Column:
    """The key to hash-partition rows by so that the rows of bucket b go to task
    b * partitions // buckets: consecutive buckets, equally many per task.

    Hashing the bucket itself would put a random number of buckets in each task
    (8 buckets into 2 tasks came out 3 and 5: one task wrote 62% of the rows while
    the other idled). So each task gets a key that Spark's hash sends to it. Were
    Spark to hash otherwise, every bucket would still go to one task whole: the
    output would be the same, only the tasks' sizes uneven.
    """
    from pyspark.sql import functions as F

    keys = partition_keys(partitions)
    per_bucket = ",".join(str(keys[b * partitions // buckets]) for b in range(buckets))
    return F.expr(f"element_at(array({per_bucket}), {BUCKET_COLUMN} + 1)")


def partition_keys(partitions: int) -> list[int]:
    """Per partition p, the least int key >= 0 that Spark's hash partitioning into
    `partitions` partitions sends to p."""
    keys = np.full(partitions, -1, dtype=np.int64)
    start = 0
    while (keys < 0).any():
        candidates = np.arange(start, start + 8 * partitions + 64, dtype=np.int64)
        targets = spark_int_hash(candidates) % partitions
        found, first = np.unique(targets, return_index=True)
        unset = keys[found] < 0
        keys[found[unset]] = candidates[first[unset]]
        start += len(candidates)
    return [int(k) for k in keys]


def spark_int_hash(keys: np.ndarray) -> np.ndarray:
    """Spark's `hash(k)` of int keys in [0, 2^31) (Murmur3 x86 32-bit of the 4-byte
    int, seed 42), as int64 holding the signed 32-bit result."""

    def rotate_left(x: np.ndarray, bits: int) -> np.ndarray:
        return ((x << np.uint64(bits)) | (x >> np.uint64(32 - bits))) & _UINT32

    k = keys.astype(np.uint64)
    k = (k * np.uint64(0xCC9E2D51)) & _UINT32
    k = rotate_left(k, 15)
    k = (k * np.uint64(0x1B873593)) & _UINT32
    h = np.uint64(_SPARK_HASH_SEED) ^ k
    h = rotate_left(h, 13)
    h = (h * np.uint64(5) + np.uint64(0xE6546B64)) & _UINT32
    h ^= np.uint64(4)  # the key's length in bytes
    h ^= h >> np.uint64(16)
    h = (h * np.uint64(0x85EBCA6B)) & _UINT32
    h ^= h >> np.uint64(13)
    h = (h * np.uint64(0xC2B2AE35)) & _UINT32
    h ^= h >> np.uint64(16)
    signed = h.astype(np.int64)
    return np.where(signed >= 1 << 31, signed - (1 << 32), signed)


def plan_partitions(rows: int, parallelism: int, rows_per_partition: int) -> tuple[int, int]:
    """(tasks, buckets) for writing `rows` rows."""
    tasks = max(parallelism, math.ceil(rows / rows_per_partition), 1)
    return tasks, tasks * BUCKETS_PER_PARTITION
