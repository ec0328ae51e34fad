"""Flags shared by `preproc.criteo` and `preproc.transcode`, and their error handling."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from feature_spec import FeatureSpecError
from preproc.config import DEFAULT_ROWS_PER_PARTITION, PipelineConfig
from preproc.errors import PreprocessingError
from preproc.lineage import read_parent
from preproc.pipeline import run_pipeline
from preproc.report import format_report
from preproc.spark import LOG_LEVELS, SPARK_UI, SparkSettings, parse_conf_items, start_spark


def add_output_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--output_dir", required=True, help="the dataset directory to write")
    parser.add_argument(
        "--frequency_threshold",
        type=int,
        default=0,
        help="values seen fewer times in the training rows get id 0 (0 or 1: keep all)",
    )
    parser.add_argument(
        "--feature_frequency_threshold",
        action="append",
        default=[],
        metavar="NAME=N[,NAME=N...]",
        help="per-feature thresholds overriding --frequency_threshold (repeatable)",
    )
    parser.add_argument(
        "--vocabulary_from",
        metavar="DIR",
        help="an earlier dataset of this pipeline: its ids are kept, new values get new ids "
        "after them (a model trained on it can go on training on this one)",
    )
    parser.add_argument(
        "--oov_buckets",
        type=int,
        default=0,
        metavar="K",
        help="rare and unseen values get one of the ids 1..K by a hash of the value "
        "(default 0: they get id 0); must equal --vocabulary_from's",
    )
    parser.add_argument("--seed", type=int, default=0, help="seed of the train-row shuffle")
    parser.add_argument(
        "--no_shuffle", action="store_true", help="keep the train rows in input order"
    )
    parser.add_argument(
        "--strict",
        action="store_true",
        help="fail on the first malformed line instead of skipping and counting it",
    )
    parser.add_argument(
        "--keep_intermediate",
        action="store_true",
        help="keep _work/ (parsed rows, vocabularies) after success, for quick reruns",
    )
    parser.add_argument(
        "--overwrite", action="store_true", help="delete an existing output directory first"
    )
    parser.add_argument(
        "--rows_per_partition",
        type=int,
        default=DEFAULT_ROWS_PER_PARTITION,
        help="the most rows one Spark task orders and writes",
    )
    parser.add_argument(
        "--progress_interval",
        type=float,
        default=10.0,
        help="seconds between progress lines while Spark runs (0: none)",
    )


def add_spark_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("Spark")
    group.add_argument("--spark_master", default="local[*]", help="local[*], local[N] or a URL")
    group.add_argument(
        "--spark_conf",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any Spark setting (repeatable); applied last",
    )
    group.add_argument(
        "--spark_log_level",
        choices=LOG_LEVELS,
        default="error",
        help="what Spark itself logs to the console (default: errors only)",
    )
    group.add_argument(
        "--spark_ui",
        choices=SPARK_UI,
        default=SPARK_UI[0],
        help="the Spark UI: on this machine only (reach it through an ssh tunnel), off, or "
        "open on every interface; its kill links are off",
    )
    group.add_argument("--driver_memory", help="spark.driver.memory, e.g. 4g")
    group.add_argument("--executor_memory", help="spark.executor.memory (clusters)")
    group.add_argument("--local_dir", help="spark.local.dir: disk for shuffle and spill files")
    group.add_argument("--shuffle_partitions", type=int, help="spark.sql.shuffle.partitions")
    group.add_argument("--gpu", action="store_true", help="use the RAPIDS Accelerator")
    group.add_argument("--rapids_jar", help="the rapids-4-spark jar (needed by --gpu)")
    group.add_argument("--gpu_discovery_script", help="getGpusResources.sh (cluster masters)")
    group.add_argument("--gpu_pinned_memory", default="2g", help="RAPIDS pinned host memory")


def spark_settings(args: argparse.Namespace) -> SparkSettings:
    return SparkSettings(
        spark_master=args.spark_master,
        driver_memory=args.driver_memory,
        executor_memory=args.executor_memory,
        local_dir=args.local_dir,
        shuffle_partitions=args.shuffle_partitions,
        gpu=args.gpu,
        rapids_jar=args.rapids_jar,
        gpu_discovery_script=args.gpu_discovery_script,
        gpu_pinned_memory=args.gpu_pinned_memory,
        spark_conf=parse_conf_items(args.spark_conf),
        spark_log_level=args.spark_log_level,
        spark_ui=args.spark_ui,
    )


def run_with_spark(config: PipelineConfig, args: argparse.Namespace) -> int:
    """Runs the pipeline in a Spark session built from the Spark flags, stops the
    session whatever happens, and prints the report."""
    if config.vocabulary_from is not None:  # a dataset that does not fit: before Spark starts
        read_parent(config.vocabulary_from, config.layout, config.oov_buckets)
    spark = start_spark(spark_settings(args))
    try:
        report = run_pipeline(config, spark, progress_interval=args.progress_interval)
    finally:
        spark.stop()
    print(format_report(report))
    return 0


def run_cli(body: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None) -> int:
    """Runs a command-line tool: a PreprocessingError or FeatureSpecError is printed
    as one line on stderr (no traceback) and gives exit code 1."""
    try:
        return body(argv)
    except (PreprocessingError, FeatureSpecError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: rerun the same command to resume", file=sys.stderr)
        return 130
