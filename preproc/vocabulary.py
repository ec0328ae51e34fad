"""Categorical vocabularies: value -> id, counted on the training rows only.

Per feature, values seen at least `threshold` times in training get ids from the
feature's first id on (1, or K + 1 with K OOV buckets) in descending frequency
(ties by ascending value, so ids are deterministic); id 0 stands for missing
values, and for rare and unseen ones unless there are OOV buckets: then such a
value gets one of the ids 1..K by a hash of its text (`oov_bucket`). A
variable-length feature counts the elements of its lists: each occurrence is one
count. Counting the test rows too would leak their distribution into training;
they are not counted.

A vocabulary carried forward from an earlier dataset (`parent`) keeps every id it
gave; the values it has no id for that pass the threshold get new ids from the
parent's cardinality on, in the same order.

Summed from the value counts the parse tasks wrote per input file: by pyarrow on
the driver when they are few enough (`DRIVER_COUNT_ROWS`), else by Spark. Stored as
Parquet partitioned by feature: [_value, _count, _id], `_feature=<i>/`.
"""

from __future__ import annotations

import hashlib
import shutil
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from preproc.value_counts import (
    COUNT_COLUMN,
    COUNTS_SCHEMA,
    FEATURE_COLUMN,
    FILE_COLUMN,
    VALUE_COLUMN,
)

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa
    from pyspark.sql import Column, DataFrame, SparkSession
    from pyspark.sql.types import DataType

ID_COLUMN = "_id"


# Up to this many count rows ([file, feature, value, count] as the parse tasks wrote
# them), the vocabularies are summed and numbered by pyarrow on the driver: no Spark
# job, whose fixed costs (a cold JVM planning and compiling 3 jobs) would be most of
# the stage's time; beyond, by Spark.
DRIVER_COUNT_ROWS = 4_000_000
# An OOV bucket is 1 + (the first 15 hex digits (60 bits) of sha256(value as UTF-8))
# mod K: the same on the driver, in the writers and in Spark (`sha2`), on any machine.
OOV_HASH_HEX_DIGITS = 15


def build_vocabularies(
    spark: SparkSession,
    counts_dir: Path,
    train_files: Collection[int],
    features: Sequence[int],
    thresholds: Sequence[int],
    output: Path,
    first_ids: Sequence[int] | None = None,
    parent: Path | None = None,
    scratch: Path | None = None,
) -> dict[int, dict[str, int]]:
    """Sums, thresholds and numbers the values of `features` and writes the result.

    Args:
        counts_dir: the value counts of the parse tasks (`value_counts.COUNTS_SCHEMA`:
            [_file, _feature, _value, _count], a value in several rows, one per
            file and task).
        train_files: the input file indices whose counts make the vocabularies.
        features: categorical indices (channel order) that get a vocabulary.
        thresholds: per categorical index, the minimum count to get an id.
        output: the Parquet directory to write (may exist, empty).
        first_ids: per categorical index, the id of the first new value: 1 + the
            OOV buckets, or the parent's cardinality; None: 1 for every feature.
        parent: the vocabulary directory of an earlier dataset (this layout) whose
            ids are kept; its values need not pass the threshold again.
        scratch: a directory Spark may write the summed counts to (deleted after);
            None: beside `output`.

    Returns:
        Per feature: {"distinct": values seen in training, "kept": values with an
        id, "new": ids given by this run (all of them without a parent)}.
    """
    import pyarrow.parquet as pq

    first = list(first_ids) if first_ids is not None else [1] * len(thresholds)
    files = sorted(counts_dir.glob("part-*.parquet"))
    if sum(pq.read_metadata(f).num_rows for f in files) <= DRIVER_COUNT_ROWS:
        return _build_on_driver(files, train_files, features, thresholds, output, first, parent)
    from pyspark.sql import functions as F

    counts = spark.read.parquet(str(counts_dir)).where(F.col(FILE_COLUMN).isin(list(train_files)))
    scratch = scratch if scratch is not None else output.with_name(output.name + "_counts")
    return _build_with_spark(counts, features, thresholds, output, first, parent, scratch)


def _build_on_driver(
    files: Sequence[Path],
    train_files: Collection[int],
    features: Sequence[int],
    thresholds: Sequence[int],
    output: Path,
    first_ids: Sequence[int],
    parent: Path | None,
) -> dict[int, dict[str, int]]:
    """`build_vocabularies` with pyarrow, writing what Spark's `partitionBy` would:
    `_feature=<i>/` with [_value, _count, _id] per feature with a kept value."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    counts = pa.concat_tables([COUNTS_SCHEMA.empty_table(), *(pq.read_table(f) for f in files)])
    train = pa.array(list(train_files), pa.int32())
    counts = counts.filter(pc.is_in(counts[FILE_COLUMN], value_set=train))
    summed = (
        counts.group_by([FEATURE_COLUMN, VALUE_COLUMN])
        .aggregate([(COUNT_COLUMN, "sum")])
        .rename_columns({f"{COUNT_COLUMN}_sum": COUNT_COLUMN})
    )
    output.mkdir(parents=True, exist_ok=True)
    sizes = {}
    for feature in features:
        values = summed.filter(pc.equal(summed[FEATURE_COLUMN], feature))
        values = values.select([VALUE_COLUMN, COUNT_COLUMN])
        kept = values.filter(pc.greater_equal(values[COUNT_COLUMN], thresholds[feature]))
        carried = _carried_on_driver(parent, feature, values)
        if carried.num_rows:
            kept = kept.filter(pc.invert(pc.is_in(kept[VALUE_COLUMN], carried[VALUE_COLUMN])))
        ordered = kept.sort_by([(COUNT_COLUMN, "descending"), (VALUE_COLUMN, "ascending")])
        ids = np.arange(first_ids[feature], first_ids[feature] + kept.num_rows, dtype=np.int32)
        table = pa.concat_tables([carried, ordered.append_column(ID_COLUMN, pa.array(ids))])
        sizes[feature] = {
            "distinct": values.num_rows,
            "kept": table.num_rows,
            "new": kept.num_rows,
        }
        if not table.num_rows:
            continue
        directory = feature_directory(output, feature)
        directory.mkdir()
        pq.write_table(table, directory / "part-00000.parquet")
    return sizes


def _carried_on_driver(parent: Path | None, feature: int, values: pa.Table) -> pa.Table:
    """The parent's [_value, _count, _id] of `feature` in id order, with the counts of
    this run's training (`values`: [_value, _count]; 0 for a value not seen again)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    schema = pa.schema(
        [(VALUE_COLUMN, pa.string()), (COUNT_COLUMN, pa.int64()), (ID_COLUMN, pa.int32())]
    )
    directory = None if parent is None else feature_directory(parent, feature)
    if directory is None or not directory.is_dir():
        return schema.empty_table()
    tables = [
        pq.read_table(f, columns=[VALUE_COLUMN, ID_COLUMN])
        for f in sorted(directory.glob("*.parquet"))
        if not f.name.startswith((".", "_"))
    ]
    if not tables:
        return schema.empty_table()
    old = pa.concat_tables(tables).sort_by(ID_COLUMN)
    positions = pc.fill_null(pc.index_in(old[VALUE_COLUMN], values[VALUE_COLUMN]), -1).to_numpy()
    new_counts = np.concatenate([[0], values[COUNT_COLUMN].to_numpy()])[positions + 1]
    return pa.table(
        [old[VALUE_COLUMN], pa.array(new_counts, pa.int64()), old[ID_COLUMN].cast(pa.int32())],
        schema=schema,
    )


def _build_with_spark(
    train_counts: DataFrame,
    features: Sequence[int],
    thresholds: Sequence[int],
    output: Path,
    first_ids: Sequence[int],
    parent: Path | None,
    scratch: Path,
) -> dict[int, dict[str, int]]:
    """`build_vocabularies` as Spark jobs, for counts too many for the driver."""
    from pyspark.sql import functions as F

    counts = _summed_counts(train_counts, features, scratch)
    first = _per_feature(first_ids)
    kept = counts.where(F.col(COUNT_COLUMN) >= _per_feature(thresholds))
    old = _parent_with_spark(train_counts.sparkSession, parent, features)
    if old is not None:
        keys = [FEATURE_COLUMN, VALUE_COLUMN]
        kept = kept.join(old.select(*keys), keys, "left_anti")
    numbered = _numbered_with_spark(kept, first)
    if old is not None:
        numbered = numbered.unionByName(_carried_with_spark(old, counts))
    # `output` may exist (a stage's staging directory), empty.
    numbered.write.mode("append").partitionBy(FEATURE_COLUMN).parquet(str(output))
    sizes = _sizes_with_spark(counts, output, features, first)
    shutil.rmtree(scratch)
    return sizes


def _summed_counts(train_counts: DataFrame, features: Sequence[int], scratch: Path) -> DataFrame:
    """[_feature, _value, _count] of `features`, summed over the files. Used twice,
    they are written to `scratch` (not cached), so that adaptive execution sizes the
    tasks that read them; the caller deletes it."""
    from pyspark.sql import functions as F

    shutil.rmtree(scratch, ignore_errors=True)  # an interrupted run's
    (
        train_counts.where(F.col(FEATURE_COLUMN).isin(list(features)))
        .groupBy(FEATURE_COLUMN, VALUE_COLUMN)
        .agg(F.sum(COUNT_COLUMN).alias(COUNT_COLUMN))
        .write.parquet(str(scratch))
    )
    return train_counts.sparkSession.read.parquet(str(scratch))


def _per_feature(values: Sequence[int]) -> Column:
    """The value of `values` at each row's feature (its categorical index)."""
    from pyspark.sql import functions as F

    return F.element_at(F.array(*[F.lit(int(v)) for v in values]), F.col(FEATURE_COLUMN) + 1)


def _parent_with_spark(
    spark: SparkSession, parent: Path | None, features: Sequence[int]
) -> DataFrame | None:
    """The parent's [_value, _count, _id, _feature] rows of `features`; None where
    it has none."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import StringType

    if parent is None or not any(feature_directory(parent, i).is_dir() for i in features):
        return None
    old = read_vocabularies(spark, parent, StringType())
    return old.where(F.col(FEATURE_COLUMN).isin(list(features)))


def _carried_with_spark(old: DataFrame, counts: DataFrame) -> DataFrame:
    """The parent's ids (`old`) with the counts of this run's training (`counts`;
    0 for a value not seen again): [_value, _count, _id, _feature]."""
    from pyspark.sql import functions as F

    keys = [FEATURE_COLUMN, VALUE_COLUMN]
    return (
        old.select(*keys, ID_COLUMN)
        .join(counts, keys, "left")
        .select(
            VALUE_COLUMN,
            F.coalesce(F.col(COUNT_COLUMN), F.lit(0)).cast("long").alias(COUNT_COLUMN),
            ID_COLUMN,
            FEATURE_COLUMN,
        )
    )


def _numbered_with_spark(kept: DataFrame, first: Column) -> DataFrame:
    """`kept` values numbered per feature from its `first` id on, in descending
    count (ties by ascending value): [_value, _count, _id, _feature]."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    order = Window.partitionBy(FEATURE_COLUMN).orderBy(F.desc(COUNT_COLUMN), F.asc(VALUE_COLUMN))
    return kept.select(
        VALUE_COLUMN,
        F.col(COUNT_COLUMN).cast("long").alias(COUNT_COLUMN),
        (F.row_number().over(order) + first - 1).cast("int").alias(ID_COLUMN),
        FEATURE_COLUMN,
    )


def _sizes_with_spark(
    counts: DataFrame, output: Path, features: Sequence[int], first: Column
) -> dict[int, dict[str, int]]:
    """Per feature: values seen in training, values with an id, and ids given by
    this run (those from the feature's `first` id on)."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import StringType

    distinct = counts.groupBy(FEATURE_COLUMN).agg(F.count(F.lit(1)).alias("distinct")).collect()
    written = (
        read_vocabularies(counts.sparkSession, output, StringType())
        .groupBy(FEATURE_COLUMN)
        .agg(
            F.count(F.lit(1)).alias("kept"),
            F.sum((F.col(ID_COLUMN) >= first).cast("long")).alias("new"),
        )
        .collect()
    )
    found = {int(r[FEATURE_COLUMN]): int(r["distinct"]) for r in distinct}
    ids = {int(r[FEATURE_COLUMN]): (int(r["kept"]), int(r["new"])) for r in written}
    return {
        i: {
            "distinct": found.get(i, 0),
            "kept": ids.get(i, (0, 0))[0],
            "new": ids.get(i, (0, 0))[1],
        }
        for i in features
    }


def feature_directory(directory: Path, feature: int) -> Path:
    """Where `build_vocabularies` put the values of one feature (absent: none kept)."""
    return directory / f"{FEATURE_COLUMN}={feature}"


def read_vocabularies(spark: SparkSession, directory: Path, value_type: DataType) -> DataFrame:
    """Every feature's [_value, _count, _id, _feature] rows of a vocabulary directory."""
    from pyspark.sql.types import IntegerType, LongType, StructField, StructType

    schema = StructType(
        [
            StructField(VALUE_COLUMN, value_type),
            StructField(COUNT_COLUMN, LongType()),
            StructField(ID_COLUMN, IntegerType()),
            StructField(FEATURE_COLUMN, IntegerType()),
        ]
    )
    return spark.read.schema(schema).parquet(str(directory))


def read_vocabulary(
    spark: SparkSession, directory: Path, feature: int, value_type: DataType
) -> DataFrame:
    """The [_value, _id] pairs of one feature (empty when no value was kept)."""
    from pyspark.sql import functions as F

    table = read_vocabularies(spark, directory, value_type)
    return table.where(F.col(FEATURE_COLUMN) == feature).select(VALUE_COLUMN, ID_COLUMN)


def oov_bucket(value: str, buckets: int) -> int:
    """The OOV bucket (1..`buckets`) of a value without an id of its own."""
    digest = hashlib.sha256(value.encode("utf-8")).hexdigest()
    return 1 + int(digest[:OOV_HASH_HEX_DIGITS], 16) % buckets


def oov_bucket_ids(values: pa.Array, buckets: int) -> np.ndarray:
    """`oov_bucket` of each of `values` (strings), hashing each distinct value
    once; a null gets 0. int64 [len(values)]."""
    import numpy as np
    import pyarrow.compute as pc

    distinct = pc.unique(values)
    ids = np.array(
        [0] + [0 if v is None else oov_bucket(v, buckets) for v in distinct.to_pylist()],
        dtype=np.int64,
    )
    positions = pc.fill_null(pc.index_in(values, value_set=distinct), -1).to_numpy()
    result: np.ndarray = ids[positions + 1]
    return result


def oov_bucket_column(value: Column, buckets: int) -> Column:
    """`oov_bucket` as a Spark expression of a string column (null stays null)."""
    from pyspark.sql import functions as F

    digits = F.substring(F.sha2(value, 256), 1, OOV_HASH_HEX_DIGITS)
    hashed = F.conv(digits, 16, 10).cast("long")
    return (F.pmod(hashed, F.lit(buckets)) + F.lit(1)).cast("int")
