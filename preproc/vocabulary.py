"""Categorical vocabularies: value -> id, counted on the training rows only.

Per feature, values seen at least `threshold` times in training get ids 1, 2, ...
in descending frequency (ties by ascending value, so ids are deterministic); id 0
stands for missing, rare and unseen values. A variable-length feature counts the
elements of its lists: each occurrence is one count. Counting the test rows too
would leak their distribution into training; they are not counted.

Summed from the value counts the parse tasks wrote per input file: by pyarrow on
the driver when they are few enough (`DRIVER_COUNT_ROWS`), else by Spark. Stored as
Parquet partitioned by feature: [_value, _count, _id], `_feature=<i>/`.
"""

from __future__ import annotations

import shutil
from collections.abc import Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.types import DataType

FEATURE_COLUMN = "_feature"
VALUE_COLUMN = "_value"
COUNT_COLUMN = "_count"
ID_COLUMN = "_id"


# Up to this many count rows ([file, feature, value, count] as the parse tasks wrote
# them), the vocabularies are summed and numbered by pyarrow on the driver: no Spark
# job, whose fixed costs (a cold JVM planning and compiling 3 jobs) would be most of
# the stage's time; beyond, by Spark.
DRIVER_COUNT_ROWS = 4_000_000


def build_vocabularies(
    spark: SparkSession,
    counts_dir: Path,
    train_files: Collection[int],
    features: Sequence[int],
    thresholds: Sequence[int],
    output: Path,
) -> dict[int, dict[str, int]]:
    """Sums, thresholds and numbers the values of `features` and writes the result.

    Args:
        counts_dir: the value counts of the parse tasks (`line_parser.COUNTS_SCHEMA`:
            [_file, _feature, _value, _count], a value in several rows, one per
            file and task).
        train_files: the input file indices whose counts make the vocabularies.
        features: categorical indices (channel order) that get a vocabulary.
        thresholds: per categorical index, the minimum count to get an id.
        output: the Parquet directory to write.

    Returns:
        Per feature: {"distinct": values seen in training, "kept": values with an id}.
    """
    import pyarrow.parquet as pq

    from preproc.line_parser import FILE_COLUMN  # imports this module

    files = sorted(counts_dir.glob("part-*.parquet"))
    if sum(pq.read_metadata(f).num_rows for f in files) <= DRIVER_COUNT_ROWS:
        return _build_on_driver(files, train_files, features, thresholds, output)
    from pyspark.sql import functions as F

    counts = spark.read.parquet(str(counts_dir)).where(F.col(FILE_COLUMN).isin(list(train_files)))
    return _build_with_spark(counts, features, thresholds, output)


def _build_on_driver(
    files: Sequence[Path],
    train_files: Collection[int],
    features: Sequence[int],
    thresholds: Sequence[int],
    output: Path,
) -> dict[int, dict[str, int]]:
    """`build_vocabularies` with pyarrow, writing what Spark's `partitionBy` would:
    `_feature=<i>/` with [_value, _count, _id] per feature with a kept value."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    from preproc.line_parser import FILE_COLUMN  # imports this module

    counts = pa.concat_tables([pq.read_table(f) for f in files])
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
        kept = values.filter(pc.greater_equal(values[COUNT_COLUMN], thresholds[feature]))
        sizes[feature] = {"distinct": values.num_rows, "kept": kept.num_rows}
        if not kept.num_rows:
            continue
        ordered = kept.sort_by([(COUNT_COLUMN, "descending"), (VALUE_COLUMN, "ascending")])
        ids = pa.array(np.arange(1, kept.num_rows + 1, dtype=np.int32))
        table = ordered.select([VALUE_COLUMN, COUNT_COLUMN]).append_column(ID_COLUMN, ids)
        directory = feature_directory(output, feature)
        directory.mkdir()
        pq.write_table(table, directory / "part-00000.parquet")
    return sizes


def _build_with_spark(
    train_counts: DataFrame,
    features: Sequence[int],
    thresholds: Sequence[int],
    output: Path,
) -> dict[int, dict[str, int]]:
    """`build_vocabularies` as Spark jobs, for counts too many for the driver."""
    from pyspark.sql import Window
    from pyspark.sql import functions as F

    # The counts are used twice; written once (not cached) so that adaptive execution
    # sizes the tasks, and deleted after.
    counts_dir = output.with_name(output.name + "_counts")
    (
        train_counts.where(F.col(FEATURE_COLUMN).isin(list(features)))
        .groupBy(FEATURE_COLUMN, VALUE_COLUMN)
        .agg(F.sum(COUNT_COLUMN).alias(COUNT_COLUMN))
        .write.parquet(str(counts_dir))
    )
    counts = train_counts.sparkSession.read.parquet(str(counts_dir))
    minimum = F.element_at(F.array(*[F.lit(int(t)) for t in thresholds]), F.col(FEATURE_COLUMN) + 1)
    kept = counts.where(F.col(COUNT_COLUMN) >= minimum)
    order = Window.partitionBy(FEATURE_COLUMN).orderBy(F.desc(COUNT_COLUMN), F.asc(VALUE_COLUMN))
    numbered = kept.withColumn(ID_COLUMN, F.row_number().over(order))
    numbered.write.partitionBy(FEATURE_COLUMN).parquet(str(output))
    sizes = (
        counts.groupBy(FEATURE_COLUMN)
        .agg(
            F.count(F.lit(1)).alias("distinct"),
            F.sum((F.col(COUNT_COLUMN) >= minimum).cast("long")).alias("kept"),
        )
        .collect()
    )
    shutil.rmtree(counts_dir)
    found = {int(r[FEATURE_COLUMN]): (int(r["distinct"]), int(r["kept"])) for r in sizes}
    return {
        i: {"distinct": found.get(i, (0, 0))[0], "kept": found.get(i, (0, 0))[1]} for i in features
    }


def feature_directory(directory: Path, feature: int) -> Path:
    """Where `build_vocabularies` put the values of one feature (absent: none kept)."""
    return directory / f"{FEATURE_COLUMN}={feature}"


def read_vocabulary(
    spark: SparkSession, directory: Path, feature: int, value_type: DataType
) -> DataFrame:
    """The [_value, _id] pairs of one feature (empty when no value was kept)."""
    from pyspark.sql import functions as F
    from pyspark.sql.types import IntegerType, LongType, StructField, StructType

    schema = StructType(
        [
            StructField(VALUE_COLUMN, value_type),
            StructField(COUNT_COLUMN, LongType()),
            StructField(ID_COLUMN, IntegerType()),
            StructField(FEATURE_COLUMN, IntegerType()),
        ]
    )
    table = spark.read.schema(schema).parquet(str(directory))
    return table.where(F.col(FEATURE_COLUMN) == feature).select(VALUE_COLUMN, ID_COLUMN)
