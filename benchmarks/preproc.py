"""Spark preprocessing throughput: rows/s of preproc.criteo on a generated click log.

    python benchmarks/preproc.py [--rows 1000000] [--days 4] [--spark_master local[*]]
        [--driver_memory 4g] [--frequency_threshold 2] [--work_dir DIR] [--json FILE]

Generates a Criteo-format log (`--days` day files, `--rows` lines in all, the last
day the test split), then runs the whole pipeline (parse, vocabularies, train and
test splits, spec and report) in one Spark session and prints the time of each
stage and the rows per second: input lines over the pipeline's wall time (Spark's
start-up not included; it is printed apart).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from dataloading.criteo_tsv import generate_criteo_tsv
from preproc.config import InputFile, NumericalTransform, PipelineConfig
from preproc.layout import criteo_layout
from preproc.pipeline import run_pipeline
from preproc.spark import SparkSettings, start_spark


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--days", type=int, default=4)
    parser.add_argument("--spark_master", default="local[*]")
    parser.add_argument("--driver_memory", default="4g")
    parser.add_argument("--frequency_threshold", type=int, default=2)
    parser.add_argument("--work_dir", type=Path, help="keep the log and dataset here")
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        work = args.work_dir or Path(tmp)
        raw = work / "raw"
        start = time.perf_counter()
        log = generate_criteo_tsv(
            raw,
            days=args.days,
            rows_per_day=args.rows // args.days,
            short_row_fraction=0.01,
            malformed_rows_per_day=10,
            overwrite=True,
        )
        lines = sum(log.rows_per_file)
        size = sum(p.stat().st_size for p in log.files)
        print(
            f"generated {lines:,} lines ({size / 1e6:,.0f} MB) in {args.days} day files "
            f"in {time.perf_counter() - start:.1f} s",
            flush=True,
        )
        layout = criteo_layout()
        config = PipelineConfig(
            layout=layout,
            files=tuple(
                InputFile.of(p, "test" if i == len(log.files) - 1 else "train")
                for i, p in enumerate(log.files)
            ),
            mappings=("train", "test"),
            output_dir=work / "dataset",
            frequency_thresholds=(args.frequency_threshold,) * len(layout.categorical),
            numerical_transform=NumericalTransform.LOG,
            overwrite=True,
        )
        settings = SparkSettings(
            spark_master=args.spark_master,
            driver_memory=args.driver_memory,
            spark_conf=(("spark.ui.enabled", "false"),),
        )
        start = time.perf_counter()
        spark = start_spark(settings)
        startup = time.perf_counter() - start
        try:
            start = time.perf_counter()
            report = run_pipeline(config, spark)
            elapsed = time.perf_counter() - start
            parallelism = spark.sparkContext.defaultParallelism
        finally:
            spark.stop()
    stages = ", ".join(f"{name} {s['seconds']:.1f} s" for name, s in report["stages"].items())
    rows = sum(split["rows"] for split in report["splits"].values())
    print(f"Spark start-up: {startup:.1f} s (master {args.spark_master}, {parallelism} cores)")
    print(f"stages: {stages}")
    print(
        f"preprocessed {lines:,} lines ({rows:,} rows written) in {elapsed:.1f} s: "
        f"{lines / elapsed:,.0f} rows/s"
    )
    if args.json:
        figures = {
            "lines": lines,
            "rows_written": rows,
            "seconds": elapsed,
            "rows_per_second": lines / elapsed,
            "spark_startup_seconds": startup,
            "stage_seconds": {name: s["seconds"] for name, s in report["stages"].items()},
        }
        args.json.write_text(json.dumps(figures, indent=2) + "\n")


if __name__ == "__main__":
    main()
