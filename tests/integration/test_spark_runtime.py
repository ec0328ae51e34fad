"""pyspark as installed by `make install` runs a real local-mode session."""

from __future__ import annotations

from pathlib import Path


def test_spark_local_session_reads_a_criteo_day(tmp_path: Path) -> None:
    from pyspark.sql import SparkSession
    from pyspark.sql import functions as F

    from dataloading.criteo_tsv import generate_criteo_tsv

    report = generate_criteo_tsv(tmp_path / "raw", days=1, rows_per_day=3000, seed=1)
    spark = (
        SparkSession.builder.master("local[1]")
        .appName("install-check")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .getOrCreate()
    )
    try:
        frame = spark.read.csv(str(report.files[0]), sep="\t", header=False)
        rows = frame.count()
        positives = frame.filter(F.col("_c0") == "1").count()
    finally:
        spark.stop()
    assert rows == 3000
    assert positives == report.positives
    assert 0.15 < positives / rows < 0.35
