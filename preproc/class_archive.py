"""A class-data-sharing archive of the classes Spark's driver JVM loads in a run.

    python -m preproc.class_archive [--output PATH]

A JVM started with `-XX:SharedArchiveFile` maps the archived classes instead of
loading, parsing and verifying them from Spark's jars: in local mode, Spark
started about 1.3 s sooner and the parse stage, the first to touch Parquet, Arrow
and the Python runners, 1-2 s sooner (measured pairs in docs/preprocessing.md). `make install`
writes the archive into the virtual environment (`preproc.spark.class_archive_path`), and
`preproc.spark` uses it for local-mode drivers whenever it is there.

The archive is written by a JVM at its exit (`-XX:ArchiveClassesAtExit`) after a
small preprocessing run, under a hidden name, and renamed into place only when
that JVM exited cleanly: a JVM that maps a truncated archive crashes, one that
finds an archive of another JDK or other jars ignores it.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from preproc.spark import (
    CLASS_ARCHIVE_OPTIONS,
    LOCAL_DRIVER_OPTIONS,
    Console,
    SparkSettings,
    class_archive_path,
    start_spark,
)

JVM_EXIT_TIMEOUT_S = 300  # the JVM writes ~120 MB at its exit: 8 s here


def build(output: Path, console: Console = print) -> None:
    """Runs a small preprocessing job in a fresh local-mode JVM and writes the
    classes it loaded to `output`.

    Raises:
        RuntimeError: the JVM did not exit cleanly or wrote no archive; `output`
            is left as it was.
    """
    from pyspark import SparkContext

    if SparkContext._active_spark_context is not None:
        raise RuntimeError("a Spark session is running in this process; expected none")
    if output.is_dir():  # found now, not after the run (the rename would fail)
        raise RuntimeError(f"{output} is a directory; expected the archive's file path")
    output.parent.mkdir(parents=True, exist_ok=True)
    staging = output.with_name(f".{output.name}.{os.getpid()}.tmp")
    staging.unlink(missing_ok=True)
    start = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="class-archive-") as tmp:
            code = _run_archiving_jvm(Path(tmp), staging)
        if code != 0 or not staging.is_file() or staging.stat().st_size == 0:
            raise RuntimeError(f"the JVM exited with code {code} and wrote no archive")
        os.replace(staging, output)
    finally:
        staging.unlink(missing_ok=True)
    size = output.stat().st_size
    console(
        f"[class_archive] {output}: {size / 1e6:,.0f} MB of Spark's classes "
        f"({time.monotonic() - start:.0f} s)"
    )


def _run_archiving_jvm(tmp: Path, archive: Path) -> int:
    """Preprocesses a small generated log (in `tmp`) in a fresh Spark driver JVM
    that writes its classes to `archive` at its exit; returns the JVM's exit code."""
    from pyspark import SparkContext

    from dataloading.criteo_tsv import generate_criteo_tsv
    from preproc.config import last_day_test_config
    from preproc.pipeline import run_pipeline

    raw = tmp / "raw"
    generate_criteo_tsv(raw, days=2, rows_per_day=2000, seed=0)
    files = sorted(raw.glob("day_*"))
    config = last_day_test_config(files, tmp / "dataset", frequency_threshold=2)
    spark = start_spark(_archiving_settings(archive), console=lambda line: None)
    gateway = SparkContext._gateway
    jvm = gateway.proc  # type: ignore[union-attr]
    try:
        run_pipeline(config, spark, console=lambda line: None)
    finally:
        spark.stop()
        gateway.shutdown()  # type: ignore[union-attr]
        SparkContext._gateway = None
        SparkContext._jvm = None
        jvm.stdin.close()  # Spark's gateway JVM exits at the end of its input
        code: int = jvm.wait(timeout=JVM_EXIT_TIMEOUT_S)
    return code


def _archiving_settings(archive: Path) -> SparkSettings:
    """A local-mode driver whose JVM writes the classes it loaded to `archive`."""
    # CDS lists every class it leaves out (signed jars, generated code) as a
    # warning: hundreds of lines that say nothing is wrong.
    options = f"{LOCAL_DRIVER_OPTIONS} -XX:ArchiveClassesAtExit={archive} {CLASS_ARCHIVE_OPTIONS}"
    return SparkSettings(
        spark_master="local[2]",
        driver_memory="1g",
        use_class_archive=False,
        spark_conf=(
            ("spark.ui.enabled", "false"),
            ("spark.driver.extraJavaOptions", options),
        ),
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--output",
        type=Path,
        default=class_archive_path(),
        help="the archive (default: %(default)s)",
    )
    args = parser.parse_args(argv)
    try:
        build(args.output)
    except Exception as error:
        print(f"[class_archive] no archive written: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
