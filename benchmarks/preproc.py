"""Spark preprocessing throughput and memory: preproc.criteo on a generated click log.

    python benchmarks/preproc.py [--rows 1020000] [--days 3] [--spark_master local[2]]
        [--driver_memory 4g] [--frequency_threshold 3] [--work_dir DIR] [--reuse_log]
        [--spark_conf KEY=VALUE ...] [--runs 1] [--json FILE]

Generates a Criteo-format log (`--days` day files, `--rows` lines in all, the last
day the test split), then runs the whole pipeline (parse, vocabularies, train and
test splits, spec and report) in one Spark session and prints, per stage and in
all, the time, the rows per second, the CPU seconds and the peak resident memory
of the process tree (this Python process, Spark's JVM and its Python workers;
memory sampled every 0.1 s). Rows per second: input lines over the pipeline's wall time for the
whole run and the parse stage, the rows the stage reads for the others (train
lines for the vocabulary, the split's rows for a split). Spark's start-up is not
included; it is printed apart.

`--runs N` runs the pipeline N times in the same Spark session, each into a
dataset of its own. The first run is what a user's run costs. The later ones
show the pipeline without the warm-up every new session pays (the JIT compiling
Spark's code and the generated code of the queries, the Python workers
starting). The JSON holds the first run's figures, and the later runs' under
`later_runs`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.common import parser_for, run_checked, save, work_directory
from benchmarks.process_tree import tree_cpu_seconds, tree_rss
from preproc.config import PipelineConfig, last_day_test_config
from preproc.pipeline import run_pipeline
from preproc.spark import SparkSettings, parse_conf_items, print_to_stderr, start_spark

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

SAMPLE_SECONDS = 0.1


class PeakMemory:
    """Samples the resident memory of this process and all its descendants, and
    keeps the peak per phase (the phase is set by `enter`; `None`: not counted).
    Also the CPU seconds of the tree per phase (less sensitive than wall time to
    other work on the machine)."""

    def __init__(self) -> None:
        self.phase: str | None = None
        self.peaks: dict[str, int] = {}
        self.cpu: dict[str, float] = {}
        self.overall = 0
        self._cpu_mark = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, name="peak-memory", daemon=True)

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def enter(self, phase: str | None) -> None:
        now = tree_cpu_seconds(psutil.Process(os.getpid()))
        if self.phase is not None:
            self.cpu[self.phase] = self.cpu.get(self.phase, 0.0) + now - self._cpu_mark
        self.phase, self._cpu_mark = phase, now

    def _sample(self) -> None:
        root = psutil.Process(os.getpid())
        while not self._stop.wait(SAMPLE_SECONDS):
            total = tree_rss(root)
            phase = self.phase
            if phase is not None:
                self.peaks[phase] = max(self.peaks.get(phase, 0), total)
                self.overall = max(self.overall, total)


def parse_args() -> argparse.Namespace:
    parser = parser_for(__doc__)
    parser.add_argument("--rows", type=int, default=1_020_000)
    parser.add_argument("--days", type=int, default=3)
    parser.add_argument("--spark_master", default="local[2]")
    parser.add_argument("--driver_memory", default="4g")
    parser.add_argument("--frequency_threshold", type=int, default=3)
    parser.add_argument("--work_dir", type=Path, help="keep the log and dataset here")
    parser.add_argument(
        "--reuse_log", action="store_true", help="use the log already in --work_dir/raw"
    )
    parser.add_argument(
        "--spark_conf", action="append", default=[], help="KEY=VALUE, repeatable (Spark setting)"
    )
    parser.add_argument(
        "--runs", type=int, default=1, help="pipeline runs in one Spark session (default 1)"
    )
    parser.add_argument("--json", type=Path, help="also write the figures to this file")
    args = parser.parse_args()
    if args.runs < 1:
        parser.error(f"--runs: expected at least 1, got {args.runs}")
    return args


def main() -> None:
    args = parse_args()
    with work_directory("bench_preproc_") as tmp:
        work = args.work_dir or tmp
        files = click_log(work / "raw", args)
        settings = SparkSettings(
            spark_master=args.spark_master,
            driver_memory=args.driver_memory,
            spark_conf=(("spark.ui.enabled", "false"), *parse_conf_items(args.spark_conf)),
        )
        start = time.perf_counter()
        spark = start_spark(settings)
        startup = time.perf_counter() - start
        runs = []
        try:
            parallelism = spark.sparkContext.defaultParallelism
            for run in range(args.runs):
                dataset = work / ("dataset" if run == 0 else f"dataset_run{run + 1}")
                config = last_day_test_config(
                    files, dataset, args.frequency_threshold, overwrite=True
                )
                runs.append(_measured_run(config, spark))
                if run > 0:  # only its figures are wanted
                    shutil.rmtree(dataset)
        finally:
            spark.stop()
    print(f"Spark start-up: {startup:.1f} s (master {args.spark_master}, {parallelism} cores)")
    for number, figures in enumerate(runs, 1):
        if args.runs > 1:
            print(f"run {number} of {args.runs} in this Spark session")
        _print_stages(figures)
    figures = {**runs[0], "spark_startup_seconds": startup}
    if args.runs > 1:
        figures["later_runs"] = runs[1:]
    if args.json:
        save(figures, args.json)


def click_log(raw: Path, args: argparse.Namespace) -> list[Path]:
    """The day files of a generated Criteo-format log in `raw` (kept with
    `--reuse_log` where there is one), in day order."""
    start = time.perf_counter()
    if not (args.reuse_log and raw.is_dir()):
        # In a process of its own: the generator's memory is not the pipeline's.
        command = [sys.executable, "-m", "dataloading.criteo_tsv", f"--output_dir={raw}"]
        command += [f"--days={args.days}", f"--rows_per_day={args.rows // args.days}"]
        command += ["--short_row_fraction=0.01", "--malformed_rows_per_day=10", "--overwrite"]
        run_checked(command)
    files = sorted(raw.glob("day_*"), key=lambda p: int(p.name.split("_")[1]))
    size = sum(p.stat().st_size for p in files)
    print(
        f"log: {len(files)} day files, {size / 1e6:,.0f} MB ({time.perf_counter() - start:.1f} s)",
        flush=True,
    )
    return files


def _measured_run(config: PipelineConfig, spark: SparkSession) -> dict[str, Any]:
    """Runs the pipeline once; its figures (`_figures`)."""
    with PeakMemory() as memory:

        def console(line: str) -> None:
            # "[preproc] <stage>: started" opens a stage's sampling window.
            words = line.split()
            if len(words) == 3 and words[0] == "[preproc]" and words[2] == "started":
                memory.enter(words[1].rstrip(":"))
            print_to_stderr(line)

        start = time.perf_counter()
        try:
            report = run_pipeline(config, spark, console)
        finally:
            memory.enter(None)
        elapsed = time.perf_counter() - start
    return _figures(report, elapsed, memory)


def _print_stages(figures: dict[str, Any]) -> None:
    print(f"{'stage':<12}{'rows':>12}{'seconds':>10}{'rows/s':>10}{'CPU s':>8}{'peak RSS':>12}")
    for name, stage in [*figures["stages"].items(), ("total", figures)]:
        print(
            f"{name:<12}{stage['rows']:>12,}{stage['seconds']:>10.1f}"
            f"{stage['rows_per_second']:>10,.0f}{stage['cpu_seconds']:>8.1f}"
            f"{stage['peak_rss_bytes'] / 2**30:>8.2f} GiB"
        )


def _figures(report: dict[str, Any], elapsed: float, memory: PeakMemory) -> dict[str, Any]:
    """Per stage and in all: rows, seconds, rows/s, CPU seconds, peak RSS bytes."""
    files = report["files"]
    lines = sum(f["lines"] for f in files)
    train_lines = sum(f["lines"] for f in files if f["mapping"] == "train")
    rows = {"parse": lines, "vocabulary": train_lines}
    rows.update({name: split["rows"] for name, split in report["splits"].items()})
    stages = {}
    for name, timing in report["stages"].items():
        if name not in rows:
            continue
        seconds = timing["seconds"]
        stages[name] = {
            "rows": rows[name],
            "seconds": seconds,
            "rows_per_second": rows[name] / seconds,
            "peak_rss_bytes": memory.peaks.get(name, 0),
            "cpu_seconds": memory.cpu.get(name, 0.0),
        }
    return {
        "rows": lines,
        "seconds": elapsed,
        "rows_per_second": lines / elapsed,
        "peak_rss_bytes": memory.overall,
        "cpu_seconds": sum(memory.cpu.values()),
        "stages": stages,
    }


if __name__ == "__main__":
    main()
