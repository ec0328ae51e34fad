"""The generated Spark configuration: local defaults, memory flags, the RAPIDS
Accelerator settings for local and cluster masters, errors naming the flag."""

from __future__ import annotations

import math
import site
from pathlib import Path

import pytest

from preproc.errors import PreprocessingError
from preproc.spark import (
    CODE_ROOT,
    LOG_CONFIG,
    RAPIDS_PLUGIN_CLASS,
    SparkSettings,
    spark_conf,
    worker_pythonpath,
)


@pytest.fixture(autouse=True)
def no_class_archive(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """The archive path, with no archive there (`make install` writes one into the
    venv); a test that wants one writes it."""
    archive = tmp_path / "spark-classes.jsa"
    monkeypatch.setattr("preproc.spark.class_archive_path", lambda: archive)
    return archive


def test_local_defaults() -> None:
    conf = spark_conf(SparkSettings())
    assert conf["spark.master"] == "local[*]"
    # Run from the checkout (editable install): the workers import preproc from it.
    assert conf["spark.executorEnv.PYTHONPATH"] == str(CODE_ROOT)
    assert (CODE_ROOT / "preproc" / "partition_writer.py").is_file()
    assert not any(key.startswith("spark.rapids") or key == "spark.plugins" for key in conf)
    assert "spark.driver.memory" not in conf  # Spark's default unless asked
    # The local driver runs the tasks: throughput collector; executors keep G1. Its
    # Spark logs errors only.
    assert conf["spark.driver.extraJavaOptions"].split() == [
        "-XX:-DontCompileHugeMethods",
        "-XX:+UseParallelGC",
        f"-Dlog4j2.configurationFile={LOG_CONFIG}",
        "-Ddlrm.spark.log_level=error",
    ]
    assert LOG_CONFIG.is_file()
    assert conf["spark.executor.extraJavaOptions"] == "-XX:-DontCompileHugeMethods"


def test_memory_local_dir_and_overrides() -> None:
    settings = SparkSettings(
        spark_master="spark://head:7077",
        driver_memory="8g",
        executor_memory="64g",
        local_dir="/scratch/spark",
        shuffle_partitions=2000,
        spark_conf=(("spark.driver.memory", "16g"), ("spark.executor.cores", "8")),
    )
    conf = spark_conf(settings)
    assert conf["spark.master"] == "spark://head:7077"
    assert conf["spark.driver.memory"] == "16g"  # --spark_conf wins
    assert conf["spark.executor.memory"] == "64g"
    assert conf["spark.local.dir"] == "/scratch/spark"
    assert conf["spark.sql.shuffle.partitions"] == "2000"
    # A cluster's driver runs no tasks: HotSpot's default collector.
    assert conf["spark.driver.extraJavaOptions"].split()[0] == "-XX:-DontCompileHugeMethods"
    assert "-XX:+UseParallelGC" not in conf["spark.driver.extraJavaOptions"]


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        (SparkSettings(driver_memory="lots"), "--driver_memory: expected a size such as"),
        (SparkSettings(executor_memory="4 GB"), "--executor_memory: expected a size"),
        (SparkSettings(shuffle_partitions=0), "--shuffle_partitions: expected a positive int"),
        (SparkSettings(spark_log_level="loud"), "--spark_log_level: expected one of error, warn"),
        (SparkSettings(spark_master=""), "--spark_master: expected a Spark master URL"),
        (SparkSettings(gpu=True), "--gpu: the RAPIDS Accelerator jar is required; expected "),
        (SparkSettings(gpu=True, rapids_jar="/no/such.jar"), "--rapids_jar: expected an existing"),
        (SparkSettings(rapids_jar="/x.jar"), "--rapids_jar: given without --gpu"),
    ],
)
def test_flag_errors(settings: SparkSettings, message: str) -> None:
    with pytest.raises(PreprocessingError, match=message):
        spark_conf(settings)


@pytest.fixture
def rapids_jar(tmp_path: Path) -> Path:
    jar = tmp_path / "rapids-4-spark_2.12-24.12.0.jar"
    jar.write_bytes(b"PK")
    return jar


def test_gpu_settings_local(rapids_jar: Path, no_class_archive: Path) -> None:
    no_class_archive.write_bytes(b"archive")  # made without the RAPIDS jar: not used
    conf = spark_conf(SparkSettings(spark_master="local[4]", gpu=True, rapids_jar=str(rapids_jar)))
    assert "SharedArchiveFile" not in conf["spark.driver.extraJavaOptions"]
    assert conf["spark.plugins"] == RAPIDS_PLUGIN_CLASS == "com.nvidia.spark.SQLPlugin"
    assert conf["spark.jars"] == str(rapids_jar.resolve())
    assert conf["spark.driver.extraClassPath"] == str(rapids_jar.resolve())
    assert conf["spark.rapids.sql.enabled"] == "true"
    assert conf["spark.rapids.memory.pinnedPool.size"] == "2g"
    assert conf["spark.rapids.sql.concurrentGpuTasks"] == "2"
    assert "spark.executor.resource.gpu.amount" not in conf  # no resource scheduling locally


def test_gpu_settings_cluster(rapids_jar: Path, tmp_path: Path) -> None:
    script = tmp_path / "getGpusResources.sh"
    script.write_text("#!/bin/sh\n")
    gpu = {"gpu": True, "rapids_jar": str(rapids_jar)}
    settings = SparkSettings(
        spark_master="spark://head:7077",
        gpu_discovery_script=str(script),
        gpu_pinned_memory="8g",
        spark_conf=(("spark.executor.cores", "4"),),
        **gpu,
    )
    conf = spark_conf(settings)
    assert conf["spark.executor.resource.gpu.amount"] == "1"
    assert conf["spark.task.resource.gpu.amount"] == "0.25"  # 4 tasks share an executor's GPU
    assert conf["spark.executor.resource.gpu.discoveryScript"] == str(script.resolve())
    assert conf["spark.rapids.memory.pinnedPool.size"] == "8g"
    assert "spark.driver.extraClassPath" not in conf
    with pytest.raises(PreprocessingError, match="--gpu_discovery_script: expected an existing"):
        spark_conf(SparkSettings(spark_master="yarn", gpu_discovery_script="x", **gpu))
    no_cores = (("spark.executor.cores", "0"),)
    message = r"spark\.executor\.cores: expected a positive int"
    with pytest.raises(PreprocessingError, match=message):
        spark_conf(SparkSettings(spark_master="yarn", spark_conf=no_cores, **gpu))


def test_local_driver_maps_the_class_archive_when_there_is_one(no_class_archive: Path) -> None:
    no_class_archive.write_bytes(b"archive")
    options = spark_conf(SparkSettings()).get("spark.driver.extraJavaOptions", "").split()
    assert options == [
        "-XX:-DontCompileHugeMethods",
        "-XX:+UseParallelGC",
        f"-XX:SharedArchiveFile={no_class_archive}",
        "-Xlog:cds=off,cds+dynamic=off",
        f"-Dlog4j2.configurationFile={LOG_CONFIG}",
        "-Ddlrm.spark.log_level=error",
    ]
    # Not when asked not to, not for a cluster's driver, not with the RAPIDS jar.
    for settings in (
        SparkSettings(use_class_archive=False),
        SparkSettings(spark_master="spark://head:7077"),
    ):
        assert "SharedArchiveFile" not in spark_conf(settings)["spark.driver.extraJavaOptions"]


def test_the_drivers_spark_logs_at_the_level_asked() -> None:
    for master in ("local[*]", "spark://head:7077"):
        options = spark_conf(SparkSettings(spark_master=master, spark_log_level="warn"))
        assert "-Ddlrm.spark.log_level=warn" in options["spark.driver.extraJavaOptions"].split()
    # The configuration reads the level from that property, for the root logger and
    # for the logger whose level pyspark's shell start would otherwise announce.
    config = LOG_CONFIG.read_text()
    assert "rootLogger.level = ${sys:dlrm.spark.log_level:-error}" in config
    assert "logger.shell.level = ${sys:dlrm.spark.log_level:-error}" in config


def test_installed_code_puts_nothing_on_the_workers_path() -> None:
    # Installed into site-packages, preproc is found by the workers' interpreter;
    # a checkout is put on their path.
    site_packages = Path(site.getsitepackages()[0])
    assert worker_pythonpath(site_packages) is None
    assert worker_pythonpath(Path("/srv/checkout")) == "/srv/checkout"


@pytest.mark.parametrize(("ui", "enabled"), [("local", "true"), ("open", "true"), ("off", "false")])
def test_the_spark_ui_has_no_kill_links_and_can_be_turned_off(ui: str, enabled: str) -> None:
    conf = spark_conf(SparkSettings(spark_ui=ui))
    assert conf["spark.ui.killEnabled"] == "false"
    assert conf["spark.ui.enabled"] == enabled
    with pytest.raises(PreprocessingError, match=r"--spark_ui: expected one of local, off, open"):
        spark_conf(SparkSettings(spark_ui="public"))


def _cluster_gpu_conf(rapids_jar: Path, **conf: str) -> dict[str, str]:
    """spark_conf for a standalone master with --gpu; `executor_cores="4"` is
    --spark_conf spark.executor.cores=4."""
    items = tuple((f"spark.{key.replace('_', '.')}", value) for key, value in conf.items())
    settings = SparkSettings(
        spark_master="spark://head:7077",
        gpu=True,
        rapids_jar=str(rapids_jar),
        spark_conf=items,
    )
    return spark_conf(settings)


def test_gpu_on_a_cluster_requires_the_executor_cores(rapids_jar: Path) -> None:
    # Without them the task amount assumed one core: each task held the whole GPU
    # and an executor's Python stages ran one at a time.
    message = (
        r"--gpu with --spark_master spark://head:7077: expected --spark_conf "
        r"spark\.executor\.cores=N"
    )
    with pytest.raises(PreprocessingError, match=message):
        _cluster_gpu_conf(rapids_jar)
    # Unless the task amount itself is given.
    conf = _cluster_gpu_conf(rapids_jar, task_resource_gpu_amount="0.5")
    assert conf["spark.task.resource.gpu.amount"] == "0.5"
    assert conf["spark.executor.resource.gpu.amount"] == "1"


@pytest.mark.parametrize("cores", [1, 2, 3, 6, 7, 11, 12, 16, 24, 31, 48, 64, 96, 128, 255])
def test_the_task_gpu_amount_gives_every_core_a_task(rapids_jar: Path, cores: int) -> None:
    # Spark runs floor(1 / amount) tasks per GPU (ResourceUtils.
    # calculateAmountAndPartsForFraction): 0.1667 for 6 cores ran 5 tasks.
    amount = float(
        _cluster_gpu_conf(rapids_jar, executor_cores=str(cores))["spark.task.resource.gpu.amount"]
    )
    assert math.floor(1 / amount) == cores
    assert amount == 1 or amount <= 0.5  # Spark refuses fractions above 0.5


def test_the_task_gpu_amount_follows_the_cpus_per_task(rapids_jar: Path) -> None:
    conf = _cluster_gpu_conf(rapids_jar, executor_cores="8", task_cpus="2")
    assert conf["spark.task.resource.gpu.amount"] == "0.25"  # 4 tasks at a time
    for items, message in [
        ({"executor_cores": "4", "task_cpus": "8"}, r"spark\.task\.cpus: expected at most "),
        ({"executor_cores": "four"}, r"spark\.executor\.cores: expected a positive int"),
        ({"executor_cores": "4", "task_cpus": "0"}, r"spark\.task\.cpus: expected a positive"),
    ]:
        with pytest.raises(PreprocessingError, match=message):
            _cluster_gpu_conf(rapids_jar, **items)


@pytest.mark.parametrize("master", ["local[*]", "local[8]", "local"])
def test_gpu_in_local_mode_sets_no_task_resources(rapids_jar: Path, master: str) -> None:
    # Spark 3.5's local mode refuses a task GPU amount without executor resources
    # and, given them, never starts a task: its local[N] threads share the GPU.
    conf = spark_conf(SparkSettings(spark_master=master, gpu=True, rapids_jar=str(rapids_jar)))
    assert not any(".resource.gpu." in key for key in conf)
