"""A Spark session in local mode for the preprocessing tests, started as the
pipeline starts its own (`preproc.spark.start_spark`), without its web UI;
`spark = spark_fixture(...)` makes it a module fixture named `spark`."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from preproc.spark import SparkSettings, start_spark


def spark_fixture(shuffle_partitions: int | None = None) -> Any:
    """A module fixture: a `local[2]` session, stopped at the module's end;
    `shuffle_partitions` when given, else Spark's default."""

    @pytest.fixture(scope="module")
    def spark() -> Iterator[Any]:
        settings = SparkSettings(
            spark_master="local[2]",
            shuffle_partitions=shuffle_partitions,
            spark_conf=(("spark.ui.enabled", "false"),),
        )
        session = start_spark(settings, console=lambda line: None)
        try:
            yield session
        finally:
            session.stop()

    return spark
