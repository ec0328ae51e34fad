"""The Spark session of a preprocessing run: its configuration (local, cluster, GPU)
and a console progress reporter.

`spark_conf` is pure: it turns `SparkSettings` into the key/value configuration,
so the GPU (RAPIDS Accelerator) settings are tested without a GPU or Spark.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import re
import site
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from preproc.errors import PreprocessingError

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

Console = Callable[[str], None]

# The directory the driver imported preproc from: a checkout, or site-packages.
CODE_ROOT = Path(__file__).resolve().parents[1]
RAPIDS_PLUGIN_CLASS = "com.nvidia.spark.SQLPlugin"
JIT_OPTIONS = "-XX:-DontCompileHugeMethods"
# In local mode the driver's JVM also runs every task. HotSpot's throughput
# collector made the whole pipeline 7% faster there than its default G1 (same
# peak memory); cluster executors keep G1, whose pauses stay short on large heaps.
LOCAL_DRIVER_OPTIONS = f"{JIT_OPTIONS} -XX:+UseParallelGC"
# The driver's logging configuration (read by log4j2 as the JVM starts) and its levels.
LOG_CONFIG = Path(__file__).resolve().with_name("log4j2.properties")
LOG_LEVELS = ("error", "warn", "info", "debug")
# The Spark UI: on this machine only (the default), off, or on every interface.
SPARK_UI = ("local", "off", "open")
# The driver JVM maps Spark's classes from this archive when it exists
# (`preproc.class_archive`, written by `make install`); CDS's own messages are off:
# an archive of another JDK or other jars is ignored, without a warning per run.
CLASS_ARCHIVE_NAME = "spark-classes.jsa"
CLASS_ARCHIVE_OPTIONS = "-Xlog:cds=off,cds+dynamic=off"
ARROW_BATCH_ROWS = 1 << 16
_MEMORY = re.compile(r"^[1-9][0-9]*[kmgtp]?$", re.IGNORECASE)


def print_to_stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


@dataclasses.dataclass(frozen=True)
class SparkSettings:
    """How to run Spark. Every field but `use_class_archive` maps to a command-line
    flag of the same name.

    Attributes:
        spark_master: `local[*]` (all cores of this machine), `local[N]`, or a
            cluster URL (`spark://host:7077`, `yarn`, `k8s://...`).
        driver_memory: JVM heap of the driver (`spark.driver.memory`); in local
            mode the driver runs every task, so this is all the memory Spark gets.
        executor_memory: heap per executor on a cluster (`spark.executor.memory`).
        local_dir: disk for shuffle and spill files (`spark.local.dir`); needs
            room for about twice the input size.
        shuffle_partitions: `spark.sql.shuffle.partitions` (Spark's default 200).
        gpu: add the RAPIDS Accelerator settings (needs `rapids_jar`).
        rapids_jar: path of the rapids-4-spark jar.
        gpu_discovery_script: Spark's `getGpusResources.sh`, for cluster masters.
        gpu_pinned_memory: host pinned memory pool of the RAPIDS Accelerator.
        spark_conf: extra `key=value` settings, applied last (they win).
        use_class_archive: in local mode, map Spark's classes from the archive
            `make install` wrote (`class_archive_path`), if there is one. A
            `spark.driver.extraJavaOptions` in `spark_conf` replaces it too.
        spark_log_level: what the driver's Spark logs to the console (one of
            `LOG_LEVELS`); errors only by default, so that a run prints our
            progress and report, not Spark's launch notices.
        spark_ui: where the driver's web UI listens (one of `SPARK_UI`): `local`,
            the loopback interface only (reach it through an ssh tunnel), `off`,
            or `open`, every interface (Spark's own default). Its links that
            kill stages are off unless `spark_conf` turns them on.
    """

    spark_master: str = "local[*]"
    app_name: str = "dlrm-preproc"
    driver_memory: str | None = None
    executor_memory: str | None = None
    local_dir: str | None = None
    shuffle_partitions: int | None = None
    gpu: bool = False
    rapids_jar: str | None = None
    gpu_discovery_script: str | None = None
    gpu_pinned_memory: str = "2g"
    spark_conf: tuple[tuple[str, str], ...] = ()
    use_class_archive: bool = True
    spark_log_level: str = "error"
    spark_ui: str = SPARK_UI[0]

    @property
    def is_local(self) -> bool:
        return self.spark_master == "local" or self.spark_master.startswith("local[")


def parse_conf_items(
    items: list[str] | tuple[str, ...], flag: str = "--spark_conf"
) -> tuple[tuple[str, str], ...]:
    """`key=value` strings as pairs; the error names `flag` and the item."""
    pairs = []
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise PreprocessingError(f"{flag}: expected key=value, got {item!r}")
        pairs.append((key.strip(), value.strip()))
    return tuple(pairs)


def worker_pythonpath(code_root: Path = CODE_ROOT) -> str | None:
    """What Spark's Python workers (the parser, the binary writers) need on
    PYTHONPATH to import preproc as the driver did: the checkout it runs from
    (in local mode, or on a cluster that sees the checkout on a shared file
    system), or None when preproc is installed: the workers' interpreter
    (PYSPARK_PYTHON) finds it in its own site-packages, and another
    interpreter's site-packages must not come first on a worker's path."""
    installed = {Path(p).resolve() for p in (*site.getsitepackages(), site.getusersitepackages())}
    return None if code_root.resolve() in installed else str(code_root)


def _check_settings(settings: SparkSettings) -> None:
    """Raises PreprocessingError naming the first flag whose value is invalid."""
    if not settings.spark_master:
        raise PreprocessingError("--spark_master: expected a Spark master URL, got ''")
    for flag in ("driver_memory", "executor_memory", "gpu_pinned_memory"):
        value = getattr(settings, flag)
        if value is not None and not _MEMORY.match(value):
            raise PreprocessingError(f"--{flag}: expected a size such as 512m or 4g, got {value!r}")
    if settings.spark_log_level not in LOG_LEVELS:
        raise PreprocessingError(
            f"--spark_log_level: expected one of {', '.join(LOG_LEVELS)}, got "
            f"{settings.spark_log_level!r}"
        )
    if settings.spark_ui not in SPARK_UI:
        raise PreprocessingError(
            f"--spark_ui: expected one of {', '.join(SPARK_UI)}, got {settings.spark_ui!r}"
        )
    if settings.shuffle_partitions is not None and settings.shuffle_partitions < 1:
        raise PreprocessingError(
            f"--shuffle_partitions: expected a positive int, got {settings.shuffle_partitions}"
        )


def spark_conf(settings: SparkSettings) -> dict[str, str]:
    """The Spark configuration for `settings`.

    Raises:
        PreprocessingError: naming the flag whose value is invalid, e.g. `--gpu`
            without `--rapids_jar`.
    """
    _check_settings(settings)
    conf = {
        "spark.master": settings.spark_master,
        "spark.app.name": settings.app_name,
        # Our own progress lines replace Spark's console bar (which garbles logs).
        "spark.ui.showConsoleProgress": "false",
        # Whoever reaches the UI could kill the job's stages from it.
        "spark.ui.killEnabled": "false",
        "spark.ui.enabled": "false" if settings.spark_ui == "off" else "true",
        "spark.sql.adaptive.enabled": "true",
        # The parsed rows have 40+ columns; keeps Spark from warning about plan strings.
        "spark.sql.debug.maxToStringFields": "256",
        # Rows of 40+ columns make generated methods larger than HotSpot compiles by
        # default (8000 bytes of bytecode); compiling them anyway is 20-30% faster here.
        "spark.driver.extraJavaOptions": _driver_options(settings),
        "spark.executor.extraJavaOptions": JIT_OPTIONS,
        # Rows per Arrow batch handed to the Python workers (Spark's default: 10,000):
        # fewer, larger calls into pyarrow, and the writers' vocabulary lookups
        # build their hash tables once per batch.
        "spark.sql.execution.arrow.maxRecordsPerBatch": str(ARROW_BATCH_ROWS),
    }
    worker_path = worker_pythonpath()
    if worker_path is not None:
        conf["spark.executorEnv.PYTHONPATH"] = worker_path
    if settings.driver_memory is not None:
        conf["spark.driver.memory"] = settings.driver_memory
    if settings.executor_memory is not None:
        conf["spark.executor.memory"] = settings.executor_memory
    if settings.local_dir is not None:
        conf["spark.local.dir"] = settings.local_dir
    if settings.shuffle_partitions is not None:
        conf["spark.sql.shuffle.partitions"] = str(settings.shuffle_partitions)
    if settings.gpu:
        conf.update(_rapids_conf(settings))
    elif settings.rapids_jar is not None:
        raise PreprocessingError("--rapids_jar: given without --gpu; expected both or neither")
    conf.update(dict(settings.spark_conf))
    return conf


def _rapids_conf(settings: SparkSettings) -> dict[str, str]:
    """The RAPIDS Accelerator settings: plugin, jar, GPU resources, pinned memory."""
    if settings.rapids_jar is None:
        raise PreprocessingError(
            "--gpu: the RAPIDS Accelerator jar is required; expected --rapids_jar "
            "PATH/rapids-4-spark_2.12-<version>.jar (download it from Maven Central, "
            "com.nvidia:rapids-4-spark_2.12, a version built for Spark 3.5)"
        )
    jar = Path(settings.rapids_jar)
    if not jar.is_file() or jar.suffix != ".jar":
        raise PreprocessingError(
            f"--rapids_jar: expected an existing .jar file, got {settings.rapids_jar!r}"
        )
    conf = {
        "spark.plugins": RAPIDS_PLUGIN_CLASS,
        "spark.jars": str(jar.resolve()),
        "spark.rapids.sql.enabled": "true",
        "spark.rapids.memory.pinnedPool.size": settings.gpu_pinned_memory,
        "spark.rapids.sql.concurrentGpuTasks": "2",
        # Bigger input splits keep the GPU busy; log what stays on the CPU.
        "spark.sql.files.maxPartitionBytes": "512m",
        "spark.rapids.sql.explain": "NOT_ON_GPU",
    }
    if settings.is_local:
        # Local mode has no resource scheduling: the driver JVM is the executor, and
        # its local[N] threads all run tasks (concurrentGpuTasks of them on the GPU).
        # No GPU task amount here: Spark 3.5 then refuses to start ("No executor
        # resource configs were specified for the following task configs: gpu"),
        # and with executor and driver GPU amounts added its tasks never start.
        conf["spark.driver.extraClassPath"] = str(jar.resolve())
        return conf
    if settings.gpu_discovery_script is not None:
        script = Path(settings.gpu_discovery_script)
        if not script.is_file():
            raise PreprocessingError(
                f"--gpu_discovery_script: expected an existing file, got {str(script)!r}"
            )
        conf["spark.executor.resource.gpu.discoveryScript"] = str(script.resolve())
    # One GPU per executor (the RAPIDS Accelerator supports no other mapping), shared
    # by all of its concurrent tasks: the RAPIDS guide recommends a task GPU amount of
    # 1/{executor core count} ("Spark GPU Scheduling Overview",
    # docs.nvidia.com/spark-rapids/user-guide/24.02/getting-started/overview.html;
    # "Number of Tasks per Executor", nvidia.github.io/spark-rapids/docs/tuning-guide.html).
    # A task amount of 1 lets one task at a time hold the GPU, so the Python stages
    # (parser, writers) of that executor run one after another.
    # An amount given with --spark_conf is the user's choice (it is applied last).
    conf["spark.executor.resource.gpu.amount"] = "1"
    extra = dict(settings.spark_conf)
    if "spark.task.resource.gpu.amount" not in extra:
        slots = _executor_task_slots(settings.spark_master, extra)
        conf["spark.task.resource.gpu.amount"] = _task_gpu_amount(slots)
    return conf


def _executor_task_slots(master: str, extra: dict[str, str]) -> int:
    """How many tasks one executor runs at once: spark.executor.cores over
    spark.task.cpus, both from --spark_conf.

    spark.executor.cores is required: Spark's own default differs by cluster
    manager (1 on YARN and Kubernetes, all of a worker's cores on a standalone
    cluster), so no default fits all: assuming 1 serialises the tasks, a guess
    larger than a node's cores leaves the executor unlaunched and the job waiting.
    """
    if "spark.executor.cores" not in extra:
        raise PreprocessingError(
            f"--gpu with --spark_master {master}: expected --spark_conf "
            "spark.executor.cores=N, the CPU cores of each executor (one executor per "
            "GPU; its N tasks share the GPU, spark.task.resource.gpu.amount=1/N), "
            "e.g. the node's cores divided by its GPUs"
        )
    cores = _positive_int(extra, "spark.executor.cores")
    task_cpus = _positive_int(extra, "spark.task.cpus", "1")
    if task_cpus > cores:
        raise PreprocessingError(
            f"--spark_conf spark.task.cpus: expected at most spark.executor.cores ({cores}), "
            f"got {task_cpus}"
        )
    return cores // task_cpus


def _positive_int(extra: dict[str, str], key: str, default: str | None = None) -> int:
    value = extra.get(key, default)
    if value is None or not value.isdigit() or int(value) < 1:
        raise PreprocessingError(f"--spark_conf {key}: expected a positive int, got {value!r}")
    return int(value)


def _task_gpu_amount(slots: int) -> str:
    """spark.task.resource.gpu.amount for `slots` tasks per GPU, written so that
    Spark's floor(1 / amount) gives back `slots`: rounded down to six decimals
    (0.166666 for 6; "0.1667", rounded to nearest, makes Spark run 5)."""
    return str(math.floor(1_000_000 / slots) / 1_000_000) if slots > 1 else "1"


def class_archive_path() -> Path:
    """Where `make install` writes the class archive: in the running virtual
    environment, whose pyspark jars it was made from."""
    return Path(sys.prefix) / CLASS_ARCHIVE_NAME


def _driver_options(settings: SparkSettings) -> str:
    """The driver JVM's options: its logging, and in local mode the throughput
    collector and, when there is one, the class archive (not with RAPIDS, whose
    jar changes the class path the archive was made for)."""
    logging = (
        f"-Dlog4j2.configurationFile={LOG_CONFIG} -Ddlrm.spark.log_level={settings.spark_log_level}"
    )
    if not settings.is_local:
        return f"{JIT_OPTIONS} {logging}"
    archive = class_archive_path()
    if settings.use_class_archive and not settings.gpu and archive.is_file():
        return (
            f"{LOCAL_DRIVER_OPTIONS} -XX:SharedArchiveFile={archive} {CLASS_ARCHIVE_OPTIONS} "
            f"{logging}"
        )
    return f"{LOCAL_DRIVER_OPTIONS} {logging}"


def start_spark(settings: SparkSettings, console: Console = print_to_stderr) -> SparkSession:
    """A SparkSession configured by `settings` (validated first, before the JVM starts)."""
    conf = spark_conf(settings)
    from pyspark.sql import SparkSession

    if settings.is_local:
        # The Python workers run on this machine: give them this interpreter (it has
        # the project's packages, pyarrow among them) unless PYSPARK_PYTHON says
        # otherwise. Spark's default is whichever `python3` is first on PATH.
        os.environ.setdefault("PYSPARK_PYTHON", sys.executable)

    builder = SparkSession.builder
    start = time.monotonic()
    with _ui_environment(settings, conf) as driver:
        for key, value in {**driver, **conf}.items():
            builder = builder.config(key, value)
        spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel(settings.spark_log_level.upper())
    console(
        f"[preproc] Spark {spark.version} started in {time.monotonic() - start:.1f} s "
        f"(master {conf['spark.master']}, parallelism {spark.sparkContext.defaultParallelism})"
    )
    console(_ui_line(settings, spark.sparkContext.uiWebUrl))
    return spark


@contextlib.contextmanager
def _ui_environment(settings: SparkSettings, conf: dict[str, str]) -> Iterator[dict[str, str]]:
    """While the driver's JVM starts: with `--spark_ui local`, SPARK_LOCAL_IP is the
    loopback address, the one setting Spark's UI binds to (it listens on every
    interface otherwise). In local mode that is all Spark needs to reach; on a
    cluster the executors must still reach the driver, so unless `--spark_conf`
    says where, the driver is given the address it would otherwise have had
    (yielded: settings that `conf` overrides)."""
    if settings.spark_ui != "local" or "SPARK_LOCAL_IP" in os.environ:
        yield {}
        return
    driver = {}
    if not settings.is_local and "spark.driver.host" not in conf:
        address = _routable_address()
        driver = {"spark.driver.host": address, "spark.driver.bindAddress": address}
    os.environ["SPARK_LOCAL_IP"] = "127.0.0.1"
    try:
        yield driver
    finally:
        del os.environ["SPARK_LOCAL_IP"]


def _routable_address() -> str:
    """The address Spark gives a driver by default: the host name's, or, when that
    is a loopback address, the first other one of an interface."""
    import psutil

    try:
        address = socket.gethostbyname(socket.gethostname())
    except OSError:
        address = "127.0.0.1"
    if not address.startswith("127."):
        return address
    for interface in psutil.net_if_addrs().values():
        for entry in interface:
            if entry.family == socket.AF_INET and not entry.address.startswith("127."):
                return str(entry.address)
    return address


def _ui_line(settings: SparkSettings, url: str | None) -> str:
    if url is None or settings.spark_ui == "off":
        return "[preproc] Spark UI off (--spark_ui local or open turns it on)"
    if settings.spark_ui == "open":
        return f"[preproc] Spark UI at {url}, on every interface (--spark_ui open)"
    port = url.rsplit(":", 1)[-1]
    return (
        f"[preproc] Spark UI at http://127.0.0.1:{port}, this machine only; from yours: "
        f"ssh -L {port}:127.0.0.1:{port} {socket.gethostname()}, then http://localhost:{port}"
    )


@contextlib.contextmanager
def spark_progress(
    spark: SparkSession, label: str, console: Console, interval: float = 10.0
) -> Iterator[None]:
    """Prints the running Spark stages' task counts every `interval` seconds while
    the body runs, and names the body's Spark jobs `label` (Spark UI)."""
    context = spark.sparkContext
    context.setJobDescription(label)
    stop = threading.Event()
    start = time.monotonic()

    def report() -> None:
        tracker = context.statusTracker()
        while not stop.wait(interval):
            parts = []
            for stage_id in sorted(tracker.getActiveStageIds()):
                info = tracker.getStageInfo(stage_id)
                if info is not None:
                    parts.append(
                        f"Spark stage {stage_id}: {info.numCompletedTasks}/{info.numTasks} "
                        f"tasks ({info.numActiveTasks} running)"
                    )
            running = "; ".join(parts) if parts else "driver work"
            console(f"[preproc] {label}: {time.monotonic() - start:,.0f} s, {running}")

    thread = threading.Thread(target=report, name=f"progress-{label}", daemon=True)
    if interval > 0:
        thread.start()
    try:
        yield
    finally:
        stop.set()
        if thread.is_alive():
            thread.join()
        context.setJobDescription(None)  # type: ignore[arg-type]
