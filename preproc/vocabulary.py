"""Categorical vocabularies: value -> id, counted on the training rows only.

Per feature, values seen at least `threshold` times in training get ids 1, 2, ...
in descending frequency (ties by ascending value, so ids are deterministic); id 0
stands for missing, rare and unseen values. A variable-length feature counts the
elements of its lists: each occurrence is one count. Counting the test rows too
would leak their distribution into training; they are not counted.

Stored as Parquet partitioned by feature: [_value, _count, _id], `_feature=<i>/`.
"""

from __future__ import annotations

import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pyspark.sql import DataFrame, SparkSession
    from pyspark.sql.types import DataType

FEATURE_COLUMN = "_feature"
VALUE_COLUMN = "_value"
COUNT_COLUMN = "_count"
ID_COLUMN = "_id"


def build_vocabularies(
    train_counts: DataFrame,
    features: Sequence[int],
    thresholds: Sequence[int],
    output: Path,
) -> dict[int, dict[str, int]]:
    """Sums, thresholds and numbers the values of `features` and writes the result.

    Args:
        train_counts: value counts of the training files, in parts
            [_feature, _value, _count, ...] (`line_parser.COUNTS_SCHEMA`: a value
            may have several rows, one per file and parse task).
        features: categorical indices (channel order) that get a vocabulary.
        thresholds: per categorical index, the minimum count to get an id.
        output: the Parquet directory to write.

    Returns:
        Per feature: {"distinct": values seen in training, "kept": values with an id}.
    """
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
