"""The split writers' tasks: each gets consecutive buckets, equally many, through
Spark's own hash partitioning (a real local session)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from pyspark.sql import functions as F

from harness.spark import spark_fixture
from preproc.encode import BUCKET_COLUMN, bucket_partition, partition_keys, spark_int_hash

spark = spark_fixture()


def test_int_hash_is_sparks(spark: Any) -> None:
    keys = np.concatenate([np.arange(5000), np.random.default_rng(0).integers(0, 2**31, 5000)])
    frame = spark.createDataFrame([(int(k),) for k in keys], "k int")
    rows = frame.select("k", F.hash("k").alias("h")).collect()
    expected = {row.k: row.h for row in rows}
    ours = spark_int_hash(keys)
    assert [expected[int(k)] for k in keys] == ours.tolist()
    assert (ours < 0).any() and (ours > 0).any()  # the signed 32-bit result


@pytest.mark.parametrize(("partitions", "buckets"), [(1, 4), (2, 8), (3, 12), (7, 28), (40, 160)])
def test_each_task_gets_its_own_consecutive_buckets(
    spark: Any, partitions: int, buckets: int
) -> None:
    rows = spark.range(buckets * 20).select(
        (F.col("id") % buckets).cast("int").alias(BUCKET_COLUMN)
    )
    placed = (
        rows.repartition(partitions, bucket_partition(partitions, buckets))
        .select(BUCKET_COLUMN, F.spark_partition_id().alias("task"))
        .collect()
    )
    assert len(placed) == buckets * 20
    for row in placed:
        assert row.task == row[BUCKET_COLUMN] * partitions // buckets, row
    sizes = np.bincount([row.task for row in placed], minlength=partitions)
    assert sizes.tolist() == [buckets // partitions * 20] * partitions


def test_partition_keys_are_distinct_and_least() -> None:
    keys = partition_keys(500)
    assert len(set(keys)) == 500
    targets = spark_int_hash(np.arange(max(keys) + 1)) % 500
    for partition, key in enumerate(keys):
        assert targets[key] == partition
        assert partition not in targets[:key]  # no smaller key lands there
