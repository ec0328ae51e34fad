"""The Spark class archive: `python -m preproc.class_archive` writes one from a real
local preprocessing run, and a Spark driver JVM given it maps its classes from it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from harness.processes import run

# A local Spark session in a child process (its own JVM), with the archive required
# (`-Xshare:on` stops the JVM when it cannot map it) and the class loads logged.
USE_ARCHIVE = """
import sys
from pyspark.sql import SparkSession
archive, log = sys.argv[1:]
options = f"-XX:SharedArchiveFile={archive} -Xshare:on -Xlog:class+load=info:file={log}"
spark = (
    SparkSession.builder.master("local[1]")
    .config("spark.ui.enabled", "false")
    .config("spark.driver.extraJavaOptions", options)
    .getOrCreate()
)
print("rows", spark.range(1000).selectExpr("sum(id)").first()[0])
spark.stop()
"""


def build(archive: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return run([sys.executable, "-m", "preproc.class_archive", "--output", str(archive)], 600, env)


def test_archive_is_written_whole_and_maps_sparks_classes(tmp_path: Path) -> None:
    archive = tmp_path / "archive" / "spark-classes.jsa"
    built = build(archive)
    assert built.returncode == 0, built.stderr[-3000:]
    assert f"[class_archive] {archive}:" in built.stdout
    assert archive.stat().st_size > 10_000_000
    assert [p.name for p in archive.parent.iterdir()] == [archive.name]  # no staging left
    assert "[warning][cds]" not in built.stdout + built.stderr  # CDS's own lines are off

    log = tmp_path / "classes.log"
    used = run([sys.executable, "-c", USE_ARCHIVE, str(archive), str(log)], timeout=300, check=True)
    assert "rows 499500" in used.stdout
    lines = log.read_text().splitlines()
    shared = [line for line in lines if "source: shared objects file (top)" in line]
    # Spark's own classes come from the archive (`top`: the archive on top of the
    # JDK's), not from its jars.
    assert any("org.apache.spark.sql.SparkSession " in line for line in shared), lines[:20]
    assert len(shared) > 1000


def test_a_directory_at_the_output_is_refused_before_the_run(tmp_path: Path) -> None:
    archive = tmp_path / "archive.jsa"
    archive.mkdir()
    built = build(archive)
    assert built.returncode == 1
    assert f"[class_archive] no archive written: {archive} is a directory" in built.stderr
    assert archive.is_dir() and not any(archive.iterdir())
    assert [p.name for p in tmp_path.iterdir()] == ["archive.jsa"]  # no staging left


def test_a_failed_build_leaves_the_previous_archive_as_it_was(tmp_path: Path) -> None:
    archive = tmp_path / "spark-classes.jsa"
    archive.write_bytes(b"the previous archive")
    # Every JVM of the build (Spark's launcher first) refuses to start.
    built = build(archive, {"JDK_JAVA_OPTIONS": "-XX:+DlrmNoSuchOption"})
    assert built.returncode == 1
    assert "[class_archive] no archive written:" in built.stderr
    assert archive.read_bytes() == b"the previous archive"
    assert [p.name for p in tmp_path.iterdir()] == [archive.name]  # no staging left
