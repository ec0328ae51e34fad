"""What a preprocessing run pays before its first row: a new Spark session's first jobs.

    python benchmarks/spark_floor.py [--tasks python|jvm] [--spark_master local[2]]
        [--driver_memory 2g] [--jobs 4] [--json FILE]

Starts a Spark session with the pipeline's settings (`preproc.spark.start_spark`)
and runs `--jobs` jobs that read nothing and write nothing, one task per core:
- `--tasks python` (the default): Python tasks, each importing what the pipeline's
  tasks import (numpy, pyarrow) and returning one row through `mapInArrow`, as the
  parse job and the split writers do;
- `--tasks jvm`: tasks that stay in the JVM (counting a range), as a pipeline
  without Python would have.

Prints the seconds of each job. The first job pays for the session: the JVM
loading and compiling Spark's scheduler (and its Arrow code), the Python workers
starting. The later ones show what any further job costs.

Every run of `preproc.criteo` has at least three jobs of Python tasks (parse, the
train split's writers, the test split's), so these seconds are part of the fixed
cost that `benchmarks/suite.py` fits from two log sizes (`fixed_cost`), whatever
the jobs compute.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.common import parser_for, save
from preproc.spark import SparkSettings, start_spark

if TYPE_CHECKING:
    import pyarrow as pa


def _empty_task(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
    import numpy  # noqa: F401 (imported for its cost, as the pipeline's tasks do)
    import pyarrow as pa
    import pyarrow.compute
    import pyarrow.parquet

    rows = sum(batch.num_rows for batch in batches)
    yield pa.RecordBatch.from_pydict({"rows": pa.array([rows], pa.int64())})


def measure(settings: SparkSettings, jobs: int, python: bool = True) -> dict[str, Any]:
    """Starts a session, runs `jobs` empty jobs of Python (or JVM) tasks, stops it."""
    start = time.monotonic()
    spark = start_spark(settings, console=lambda line: None)
    startup = time.monotonic() - start
    try:
        cores = spark.sparkContext.defaultParallelism
        seconds = []
        for _ in range(jobs):
            start = time.monotonic()
            rows = spark.range(0, cores, numPartitions=cores)
            if python:
                counted = sum(
                    r["rows"] for r in rows.mapInArrow(_empty_task, "rows long").collect()
                )
            else:
                counted = rows.count()
            seconds.append(time.monotonic() - start)
            if counted != cores:
                raise RuntimeError(f"the empty jobs saw {counted} rows, expected {cores}")
    finally:
        spark.stop()
    return {
        "tasks": "python" if python else "jvm",
        "startup_seconds": startup,
        "tasks_per_job": cores,
        "job_seconds": seconds,
    }


def main() -> int:
    parser = parser_for(__doc__)
    parser.add_argument("--tasks", choices=("python", "jvm"), default="python")
    parser.add_argument("--spark_master", default="local[2]")
    parser.add_argument("--driver_memory", default="2g")
    parser.add_argument("--jobs", type=int, default=4)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    if args.jobs < 2:
        parser.error(f"--jobs: expected at least 2 (the first and a later one), got {args.jobs}")
    settings = SparkSettings(spark_master=args.spark_master, driver_memory=args.driver_memory)
    figures = measure(settings, args.jobs, python=args.tasks == "python")
    print(f"Spark start-up: {figures['startup_seconds']:.2f} s")
    kind = "Python" if args.tasks == "python" else "JVM"
    for number, seconds in enumerate(figures["job_seconds"], 1):
        print(f"empty job {number} of {kind} tasks ({figures['tasks_per_job']}): {seconds:.2f} s")
    if args.json:
        save(figures, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
