"""What the benchmark scripts share: flags, work directories, the default dataset,
child processes (started as the tests start theirs, `harness.processes`; on
given CPUs, their peak memory measured), figures written as JSON, and training
samples/s, each in a process of its own: ours (`main.py` on one process or ranks;
the median of its progress records after the first, which holds tracing and
compilation, read with `dlrm.app.records`) and the plain TensorFlow loop's."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import psutil

from benchmarks.process_tree import tree_memory
from dataloading.synthetic import generate_split_binary
from dlrm.app.records import read_records
from dlrm.model.config import ModelConfig, dense_training_flops
from harness.processes import REPO, main_py_command, process_env, run

# Precision and compilation settings by name: (--amp, --xla).
VARIANTS = {"fp32": (False, False), "amp": (True, False), "xla": (False, True)}
VARIANTS["amp+xla"] = (True, True)
TABLES, ROWS_PER_TABLE = 26, 100_000  # the default model's tables
TIMEOUT_S = 3600  # a run that takes longer has hung


def parser_for(doc: str | None) -> argparse.ArgumentParser:
    """A script's parser, described by the first paragraph of its docstring."""
    return argparse.ArgumentParser(description=(doc or "").split("\n\n")[0])


def integers(text: str) -> list[int]:
    """Comma-separated integers (an argparse type)."""
    try:
        return [int(item) for item in text.split(",") if item]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers, got {text!r}") from None


def variants(text: str) -> list[str]:
    """Comma-separated names of `VARIANTS`, at least one (an argparse type)."""
    names = [name for name in text.split(",") if name]
    if not names or any(name not in VARIANTS for name in names):
        raise argparse.ArgumentTypeError(f"expected some of {list(VARIANTS)}, got {text!r}")
    return names


def add_output_flags(parser: argparse.ArgumentParser) -> None:
    """`--dir`, the parent of the work directory, and `--json`, for the figures."""
    parser.add_argument("--dir", type=Path, help="where to write (default: a temporary directory)")
    parser.add_argument("--json", type=Path, help="also write the figures here")


@contextmanager
def work_directory(prefix: str, parent: Path | None = None) -> Iterator[Path]:
    """A new directory under `parent` (default: the system's temporary
    directory), deleted with all it holds at the end."""
    if parent is not None:
        parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


def default_dataset(work: Path, batch: int, steps: int) -> Path:
    """A synthetic dataset of the default model's shape in `work`: `steps` + 2
    batches to train on, one to test."""
    print(f"generating {batch * (steps + 2):,} synthetic rows ...", flush=True)
    rows = {"train": batch * (steps + 2), "test": batch}
    generate_split_binary(work / "data", [ROWS_PER_TABLE] * TABLES, rows=rows, seed=0)
    return work / "data"


def save(results: Mapping[str, Any] | list[Any], path: Path, indent: int = 2) -> None:
    """Writes the figures as JSON, replacing the file whole (a run cut short
    keeps what it wrote last)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(results, indent=indent) + "\n")
    partial.replace(path)


def last_json_line(stdout: str) -> Any:
    """The figures a child printed as the last line of its output."""
    return json.loads(stdout.strip().splitlines()[-1])


def child_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a child: `process_env`'s, with `extra`, this checkout
    first on its path (before the caller's PYTHONPATH, which stays), and
    TensorFlow's C++ logs off."""
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return process_env({"PYTHONPATH": path, "TF_CPP_MIN_LOG_LEVEL": "2", **(extra or {})})


# Sets the CPU affinity given as argv[1], then becomes the command that follows
# (what `taskset -c` does, without needing util-linux).
_ON_CPUS = (
    "import os, sys; os.sched_setaffinity(0, map(int, sys.argv[1].split(','))); "
    "os.execvp(sys.argv[2], sys.argv[2:])"
)


def cpu_model() -> str | None:
    """The CPU's model name as /proc/cpuinfo gives it, or None where it gives none."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def on_cpus(cpus: Sequence[int], command: list[str]) -> list[str]:
    """`command` confined to `cpus`, and all it starts with it (unchanged for
    none). TensorFlow, oneDNN and OpenBLAS size their thread pools by the CPUs
    a process may use."""
    if not cpus:
        return command
    return [sys.executable, "-c", _ON_CPUS, ",".join(map(str, cpus)), *command]


def _failed(command: list[str], returncode: int, stdout: str, stderr: str) -> RuntimeError:
    return RuntimeError(
        f"{' '.join(command[:4])} ... failed ({returncode}):\n{stdout[-2000:]}\n{stderr[-3000:]}"
    )


def run_checked(
    command: list[str], timeout: float = TIMEOUT_S, env: Mapping[str, str] | None = None
) -> str:
    """Runs `command` from the repo root in `child_env(env)`; its stdout.
    Raises RuntimeError with the output's tail if it fails."""
    done = run(command, timeout, child_env(env))
    if done.returncode != 0:
        raise _failed(command, done.returncode, done.stdout, done.stderr)
    return done.stdout


def run_measured(
    command: list[str], timeout: float = TIMEOUT_S, cpus: Sequence[int] = ()
) -> tuple[str, int]:
    """Runs `command` (on `cpus` alone if given); returns (stdout, peak RSS
    bytes). Raises RuntimeError with the output's tail if it fails.

    The peak is the larger of two lower bounds of the true one: the largest sum
    of RSS over the process tree, sampled every 0.1 s (it counts horovodrun's
    ranks and Spark's JVM together, but misses peaks shorter than a sample), and
    the kernel's high-water mark of the largest single process in the tree
    (`tree_memory` reads both at each sample), which for a one-process run
    such as `main.py` on one rank is the peak itself, short ones included
    (unless in the last 0.1 s before it exits)."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen(
            on_cpus(cpus, command), stdout=out, stderr=err, env=child_env(), cwd=REPO
        )
        root = psutil.Process(process.pid)
        peak = 0
        deadline = time.monotonic() + timeout
        while process.poll() is None:
            if time.monotonic() > deadline:
                process.kill()
                break
            peak = max(peak, *tree_memory(root))
            time.sleep(0.1)
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    if process.returncode != 0:
        raise _failed(command, process.returncode, stdout, stderr)
    return stdout, peak


def main_py(
    dataset: Path, work: Path, ranks: int, *flags: str, cpus: Sequence[int] = ()
) -> tuple[Path, int]:
    """Runs main.py on `dataset` (under horovodrun for ranks > 1), on `cpus`
    alone if given; returns (its metrics log, in `work`; peak RSS)."""
    log = work / f"log_{time.monotonic_ns()}.jsonl"
    command = main_py_command(ranks, f"--dataset_path={dataset}", f"--log_path={log}", *flags)
    return log, run_measured(command, cpus=cpus)[1]


# A learning rate per optimizer that trains the synthetic data without diverging.
LEARNING_RATES = {"sgd": 0.5, "adagrad": 0.1, "adam": 0.01}


def variant_flags(variant: str, plain: bool = False) -> list[str]:
    """A variant's precision and compilation as main.py's flags, or the plain loop's."""
    amp, xla = VARIANTS[variant]
    if plain:
        return [*["--amp"] * amp, *["--xla"] * xla]
    return [f"--amp={str(amp).lower()}", f"--xla={str(xla).lower()}"]


def progress_rate(log: Path, peak: int) -> dict[str, Any]:
    """main.py's samples/s: the median of its progress records after the first
    (which holds tracing), with the run's peak RSS."""
    rates = [r["samples_per_second"] for r in read_records(log, "train")][1:]
    if not rates:
        raise RuntimeError(f"main.py wrote no progress records to {log}")
    return {"samples_per_second": statistics.median(rates), "peak_rss_bytes": peak}


def plain_rate(*flags: str, cpus: Sequence[int] = ()) -> dict[str, Any]:
    """`benchmarks/plain_tf.py` run with `flags` (on `cpus` alone if given): its
    samples/s and peak RSS."""
    command = [sys.executable, str(REPO / "benchmarks" / "plain_tf.py"), *flags]
    stdout, peak = run_measured(command, cpus=cpus)
    rate = last_json_line(stdout)["samples_per_second"]
    return {"samples_per_second": rate, "peak_rss_bytes": peak}


def train_ours(
    dataset: Path,
    work: Path,
    batch: int,
    variant: str,
    ranks: int,
    steps: int,
    optimizer: str = "sgd",
    cpus: Sequence[int] = (),
) -> dict[str, Any]:
    """main.py training `steps` timed steps (and one first) on `ranks`."""
    flags = [f"--batch_size={batch}", f"--max_steps={steps + 1}", "--print_freq=1"]
    flags += [f"--optimizer={optimizer}", f"--learning_rate={LEARNING_RATES[optimizer]}"]
    flags += ["--warmup_steps=0", "--decay_start_step=0", *variant_flags(variant)]
    return progress_rate(*main_py(dataset, work, ranks, *flags, cpus=cpus))


def train_plain(batch: int, variant: str, steps: int, cpus: Sequence[int] = ()) -> dict[str, Any]:
    """The plain loop with the default model, `steps` timed steps after one."""
    flags = [f"--batch_size={batch}", f"--steps={steps}", "--warmup=1"]
    return plain_rate(*flags, *variant_flags(variant, plain=True), cpus=cpus)


def mflop_per_sample() -> float:
    """The default model's dense MFLOP per training sample."""
    return dense_training_flops(ModelConfig(13, (ROWS_PER_TABLE,) * TABLES, (1,) * TABLES)) / 1e6
