"""The benchmark suite (`make bench`): this project against plain TensorFlow, in one run.

    python benchmarks/suite.py [--batch_sizes 8192,65536] [--variants fp32,amp,xla,amp+xla]
        [--ranks 1,2] [--optimizers adagrad,adam] [--steps 8] [--repeats 1]
        [--preproc_rows 1000000,3000000] [--quick]
        [--output benchmarks/results.json] [--plot docs/bench_batch_size.png]

Measures, each in its own process (so that its peak memory is its own), on a
synthetic Criteo-shaped dataset with the default model (13 numerical features,
26 tables x 100,000 x 128, bottom 512-256-128, top 1024-1024-512-256-1, SGD):

- training: `main.py` end to end (loader, trainer, the final evaluation) under
  each precision/XLA variant, batch size and rank count (`horovodrun --gloo`
  for 2), with SGD, and the plain TensorFlow loop of `benchmarks/plain_tf.py` (no project
  code) with the same model and batch, run right after it, with their ratio;
  samples/s is the median over `main.py`'s per-step progress records after the
  first (the first holds tracing and compilation); with `--repeats N` each row
  runs ours and the plain loop in turn N times and reports the medians and the
  median ratio of the pairs (`alternated`);
- the other optimizers (`--optimizers`, Adagrad and Adam; their embedding rows
  updated by the same fused kernel as SGD's): samples/s on one process at the
  smallest batch, per variant, against SGD's row of the same run;
- the achieved GFLOP/s of each (dense part, `train.dense_training_flops`) next
  to the machine's matmul peak measured in this run (`benchmarks/targets.py`:
  the best of TensorFlow and NumPy at 2048^3 and 4096^3);
- the other optimizers on 2 ranks too, where `--ranks` has 2;
- where the machine has 16 cores: one process on 2 of them and on 16, at the
  largest batch, fp32 and `--amp` (`benchmarks/cores.py`);
- the scaled-down MLPerf DLRM-DCNv2 (`mlperf_dcnv2_small.flags`: cross
  interaction, multi-hot, Adam, batch 4096), ours against the plain loop
  written the same plain way, fp32 and `--amp`;
- 2 ranks: the share of the step in which a rank runs no op, waiting on its
  collectives, fp32 and `--amp` (a profiler trace of each rank), and the shares
  in which collectives execute and are in flight (Horovod's timeline;
  `benchmarks/collective_time.py`);
- inference: `main.py --mode inference`, samples/s and p50/p99 batch latency;
- the loader alone: samples/s of one rank reading the training split;
- what a checkpoint costs: `benchmarks/checkpoint_pause.py` at 2 GiB of tables
  (0.25 with `--quick`), the pause and its share of training time at a checkpoint
  every 10, 30 and 60 minutes;
- recovery after a host fails: `benchmarks/recovery.py` on three network-namespace
  hosts (root only; skipped with `--quick`), from node3's rank killed or its link
  down to the first step on the other two under Horovod Elastic;
- preprocessing: `benchmarks/preproc.py` (Spark local mode, a generated click
  log of each size in `--preproc_rows`), rows/s per stage and in all; twice per
  size in one Spark session, so that the cost in rows (rows/s at the largest log
  over rows/s at the smallest) is given both for a run of its own and for a later
  run without the session's warm-up (`cost_in_rows`); the first runs' time split
  into a fixed part and a part per line, with the most fixed part at which the
  cost would be linear within 10 % (`fixed_cost`); and, in a new Spark session
  of its own, what its first and later empty jobs of Python tasks and of JVM
  tasks cost (`benchmarks/spark_floor.py`): a part of that fixed cost that no
  Spark pipeline avoids;
- the peak memory of each: the largest sum of RSS over the process and its
  children (Spark's JVM, horovodrun's ranks), sampled every 0.1 s, or the
  kernel's high-water mark of its largest process if higher (`run_measured`).

Prints one table, then each performance target against its goal and the
peak (`docs/performance.md#targets`: met, NOT MET, or n/a with why), writes the
figures as JSON (`--output`) and a plot of
samples/s against batch size, ours and plain, fp32 and bf16 (`--plot`).
`--quick` measures batch 8192, fp32 and `--amp`, one rank and a 200,000-line
log: a few minutes instead of about an hour on 2 cores (fp32 and `--amp` alone,
without preprocessing, took 38 minutes; the 3M-line log, generated and run
twice, takes about 5).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from benchmarks.process_tree import tree_memory  # noqa: E402 (after the path)
from benchmarks.targets import evaluate, machine_peaks, print_targets  # noqa: E402

TABLES = 26
ROWS_PER_TABLE = 100_000
# Issue 14's target for preprocessing: rows/s at 3M lines within 10 % of rows/s at 1M.
COST_IN_ROWS_TOLERANCE = 0.10
VARIANTS = {"fp32": (False, False), "amp": (True, False), "xla": (False, True)}
VARIANTS["amp+xla"] = (True, True)


# ------------------------------------------------------------ measurement


def child_env() -> dict[str, str]:
    """The environment of a measured child: this checkout first on its path
    (before the caller's PYTHONPATH, which stays), TensorFlow's C++ logs off."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, TF_CPP_MIN_LOG_LEVEL="2")


# Sets the CPU affinity given as argv[1], then becomes the command that follows
# (what `taskset -c` does, without needing util-linux).
_ON_CPUS = (
    "import os, sys; os.sched_setaffinity(0, map(int, sys.argv[1].split(','))); "
    "os.execvp(sys.argv[2], sys.argv[2:])"
)


def on_cpus(cpus: Sequence[int], command: list[str]) -> list[str]:
    """`command` confined to `cpus`, and all it starts with it (unchanged for
    none). TensorFlow, oneDNN and OpenBLAS size their thread pools by the CPUs
    a process may use."""
    if not cpus:
        return command
    return [sys.executable, "-c", _ON_CPUS, ",".join(map(str, cpus)), *command]


def run_measured(
    command: list[str], timeout: float = 3600, cpus: Sequence[int] = ()
) -> tuple[str, int]:
    """Runs `command` (on `cpus` alone if given); returns (stdout, peak RSS
    bytes). Raises RuntimeError with the output's tail if it fails.

    The peak is the larger of two lower bounds of the true one: the largest sum
    of RSS over the process tree, sampled every 0.1 s (it counts horovodrun's
    ranks and Spark's JVM together, but misses peaks shorter than a sample), and
    the kernel's high-water mark of the largest single process in the tree
    (`tree_memory` reads both at each sample), which for a one-process run
    such as `main.py` on one rank is the peak itself, short ones included
    (unless in the last 0.1 s before it exits). Sampled alone, the plain loop's
    bf16 peak at batch 8192 read 2.32 GiB in one suite run and 2.27 in the next."""
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        process = subprocess.Popen(
            on_cpus(cpus, command), stdout=out, stderr=err, env=child_env(), cwd=ROOT
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
        raise RuntimeError(
            f"{' '.join(command[:4])} ... failed ({process.returncode}):\n"
            f"{stdout[-2000:]}\n{stderr[-3000:]}"
        )
    return stdout, peak


def records(log_path: Path, event: str) -> list[dict[str, Any]]:
    lines = log_path.read_text().splitlines() if log_path.exists() else []
    return [r for r in map(json.loads, lines) if r.get("event") == event]


def main_py(
    dataset: Path, work: Path, ranks: int, *flags: str, cpus: Sequence[int] = ()
) -> tuple[Path, int]:
    """Runs main.py (under horovodrun for ranks > 1), on `cpus` alone if given;
    returns (its log, peak RSS)."""
    log = work / f"log_{time.monotonic_ns()}.jsonl"
    command = [sys.executable, str(ROOT / "main.py"), f"--dataset_path={dataset}"]
    command += [f"--log_path={log}", *flags]
    if ranks > 1:
        horovodrun = str(Path(sys.executable).parent / "horovodrun")
        command = [horovodrun, "--gloo", "-np", str(ranks), "-H", f"localhost:{ranks}", *command]
    _, peak = run_measured(command, cpus=cpus)
    return log, peak


def progress_rate(log: Path, peak: int) -> dict[str, Any]:
    """main.py's samples/s: the median of its progress records after the first
    (which holds tracing), with the run's peak RSS."""
    rates = [r["samples_per_second"] for r in records(log, "train")][1:]
    if not rates:
        raise RuntimeError(f"main.py wrote no progress records to {log}")
    return {"samples_per_second": statistics.median(rates), "peak_rss_bytes": peak}


def plain_rate(*flags: str, cpus: Sequence[int] = ()) -> dict[str, Any]:
    """`benchmarks/plain_tf.py` run with `flags` (on `cpus` alone if given): its
    samples/s and peak RSS."""
    command = [sys.executable, str(ROOT / "benchmarks" / "plain_tf.py"), *flags]
    stdout, peak = run_measured(command, cpus=cpus)
    result = json.loads(stdout.strip().splitlines()[-1])
    return {"samples_per_second": result["samples_per_second"], "peak_rss_bytes": peak}


# A learning rate per optimizer that trains the synthetic data without diverging.
LEARNING_RATES = {"sgd": 0.5, "adagrad": 0.1, "adam": 0.01}


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
    amp, xla = VARIANTS[variant]
    log, peak = main_py(
        dataset,
        work,
        ranks,
        f"--batch_size={batch}",
        f"--max_steps={steps + 1}",
        "--print_freq=1",
        f"--optimizer={optimizer}",
        f"--learning_rate={LEARNING_RATES[optimizer]}",
        "--warmup_steps=0",
        "--decay_start_step=0",
        f"--amp={str(amp).lower()}",
        f"--xla={str(xla).lower()}",
        cpus=cpus,
    )
    return progress_rate(log, peak)


def alternated(
    ours: Callable[[], dict[str, Any]],
    plain: Callable[[], dict[str, Any]] | None,
    repeats: int,
) -> dict[str, Any]:
    """Runs `ours` and then `plain` (if any), `repeats` times in turn; returns the
    row's figures: each side's median samples/s and largest peak, and the
    median of the pairs' ratios. One pair of runs moves by about 5 % (fp32 at
    batch 8192: one suite run read 1.15, four pairs right after it 1.20-1.25)."""
    if repeats < 1:
        raise ValueError(f"repeats: expected at least 1, got {repeats}")
    pairs = [(ours(), plain() if plain else None) for _ in range(repeats)]

    def summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
        rates = [run["samples_per_second"] for run in runs]
        return {
            "samples_per_second": statistics.median(rates),
            "peak_rss_bytes": max(run["peak_rss_bytes"] for run in runs),
            "runs_samples_per_second": rates,
        }

    row: dict[str, Any] = {"ours": summary([o for o, _ in pairs])}
    if plain:
        row["plain"] = summary([p for _, p in pairs if p is not None])
        row["ratio"] = statistics.median(
            o["samples_per_second"] / p["samples_per_second"] for o, p in pairs if p is not None
        )
    return row


def optimizer_rows(
    training: list[dict[str, Any]],
    optimizers: list[str],
    dataset: Path,
    work: Path,
    batch: int,
    steps: int,
) -> list[dict[str, Any]]:
    """Each of `optimizers` at `batch`, for every variant and rank count that has
    an SGD row at that batch: samples/s and the share of SGD's (`of_sgd`)."""
    rows: list[dict[str, Any]] = []
    for sgd in training:
        if sgd["batch_size"] != batch:
            continue
        ranks = sgd["ranks"]
        for optimizer in optimizers:
            ours = train_ours(dataset, work, batch, sgd["variant"], ranks, steps, optimizer)
            of_sgd = ours["samples_per_second"] / sgd["ours"]["samples_per_second"]
            rows.append(
                {"optimizer": optimizer, "variant": sgd["variant"], "batch_size": batch}
                | {"ranks": ranks}
                | ours
                | {"of_sgd": of_sgd}
            )
            print(
                f"training {sgd['variant']} batch {batch} ranks {ranks} {optimizer}: "
                f"{ours['samples_per_second']:,.0f} samples/s, {of_sgd:.2f} of SGD's",
                flush=True,
            )
    return rows


# The scaled-down MLPerf DLRM-DCNv2, and the plain loop's flag for each of its
# flags: the plain loop runs the model, optimizer and batch the flagfile sets.
DCNV2_FLAGFILE = "mlperf_dcnv2_small.flags"
DCNV2_PLAIN_FLAGS = {
    "interaction": "interaction",
    "embedding_dim": "embedding_dim",
    "bottom_mlp_dims": "bottom",
    "top_mlp_dims": "top",
    "num_cross_layers": "cross_layers",
    "cross_layer_projection_dim": "projection",
    "optimizer": "optimizer",
    "learning_rate": "learning_rate",
    "batch_size": "batch_size",
}


def dcnv2_flags() -> dict[str, str]:
    """The packaged DLRM-DCNv2 flagfile's settings, by flag name."""
    from dlrm.app.flags import PACKAGED_FLAGFILES

    lines = (PACKAGED_FLAGFILES / DCNV2_FLAGFILE).read_text().splitlines()
    pairs = (line.strip().removeprefix("--").split("=", 1) for line in lines)
    return {pair[0]: pair[1] for pair in pairs if len(pair) == 2 and not pair[0].startswith("#")}


DCNV2_BATCH = int(dcnv2_flags()["batch_size"])


def mflop_per_sample() -> float:
    """The default model's dense MFLOP per training sample."""
    from benchmarks.train import dense_training_flops
    from dlrm.model.config import ModelConfig

    return dense_training_flops(ModelConfig(13, (ROWS_PER_TABLE,) * TABLES, (1,) * TABLES)) / 1e6


def default_dataset(work: Path, batch: int, steps: int) -> Path:
    """A synthetic dataset of the default model's shape in `work`: `steps` + 2
    batches to train on, one to test."""
    from dataloading.synthetic import generate_split_binary

    dataset = work / "data"
    print(f"generating {batch * (steps + 2):,} synthetic rows ...", flush=True)
    generate_split_binary(
        dataset,
        cardinalities=[ROWS_PER_TABLE] * TABLES,
        rows={"train": batch * (steps + 2), "test": batch},
        seed=0,
    )
    return dataset


def dcnv2_dataset(work: Path, steps: int) -> Path:
    """A synthetic dataset of the small DLRM-DCNv2's shape (multi-hot)."""
    from dataloading.synthetic import SHAPES, generate_split_binary

    cardinalities, hotness = SHAPES["mlperf_dcnv2_small"]
    dataset = work / "dcnv2"
    generate_split_binary(
        dataset,
        cardinalities=cardinalities,
        hotness=hotness,
        rows={"train": DCNV2_BATCH * (steps + 2), "test": DCNV2_BATCH},
        seed=0,
    )
    return dataset


def train_ours_dcnv2(dataset: Path, work: Path, variant: str, steps: int) -> dict[str, Any]:
    amp, xla = VARIANTS[variant]
    log, peak = main_py(
        dataset,
        work,
        1,
        f"--flagfile={DCNV2_FLAGFILE}",
        f"--max_steps={steps + 1}",
        "--print_freq=1",
        "--evals_per_epoch=0",
        f"--amp={str(amp).lower()}",
        f"--xla={str(xla).lower()}",
    )
    return progress_rate(log, peak)


def train_plain_dcnv2(variant: str, steps: int) -> dict[str, Any]:
    from dataloading.synthetic import SHAPES

    cardinalities, hotness = SHAPES["mlperf_dcnv2_small"]
    assert hotness is not None
    amp, xla = VARIANTS[variant]
    settings = dcnv2_flags()
    flags = [f"--{plain}={settings[ours]}" for ours, plain in DCNV2_PLAIN_FLAGS.items()]
    flags += [f"--steps={steps}", "--warmup=1"]
    flags += [f"--cardinalities={','.join(map(str, cardinalities))}"]
    flags += [f"--hotness={','.join(map(str, hotness))}"]
    return plain_rate(*flags, *["--amp"] * amp, *["--xla"] * xla)


def train_plain(batch: int, variant: str, steps: int, cpus: Sequence[int] = ()) -> dict[str, Any]:
    amp, xla = VARIANTS[variant]
    flags = [f"--batch_size={batch}", f"--steps={steps}", "--warmup=1"]
    return plain_rate(*flags, *["--amp"] * amp, *["--xla"] * xla, cpus=cpus)


def collective_shares(dataset: Path, work: Path, batch: int, steps: int) -> dict[str, Any]:
    """What the collectives cost 2 ranks' step, fp32 and --amp
    (`benchmarks/collective_time.py`, through `benchmarks/train.py`)."""
    from benchmarks.train import measure_ranks, per_step

    shares = {}
    for variant in ("fp32", "amp"):
        result = measure_ranks(dataset, 2, batch, steps, 2, work, amp=variant == "amp")
        times = per_step(result, steps)
        step = times["step"]
        shares[variant] = {
            "batch_size": batch,
            "step_seconds": step,
            "dense_chunk_rows": result["dense_chunk_rows"],
            "exposed_seconds_per_step": times["exposed"],
            "share": times["exposed_share"],
            "per_rank_share": times["per_rank_share"],
            "executing_seconds_per_step": times["executing"],
            "executing_share": times["executing"] / step,
            "in_flight_seconds_per_step": times["in_flight"],
            "in_flight_share": times["in_flight"] / step,
        }
        print(
            f"2 ranks {variant}: waiting on collectives {times['exposed_share']:.0%} of the "
            f"step, executing them {times['executing'] / step:.0%}",
            flush=True,
        )
    return shares


def inference(dataset: Path, work: Path, batch: int) -> dict[str, Any]:
    log, peak = main_py(
        dataset,
        work,
        1,
        "--mode=inference",
        f"--valid_batch_size={batch}",
        "--max_steps=30",
        "--benchmark_warmup_steps=3",
        "--print_freq=1000",
    )
    summary = records(log, "summary")[-1]
    keys = ("samples_per_second", "latency_p50_ms", "latency_p99_ms")
    return {**{k: summary[k] for k in keys}, "peak_rss_bytes": peak}


def loader(dataset: Path, batch: int) -> dict[str, Any]:
    command = [sys.executable, __file__, "--worker_loader", str(dataset), str(batch)]
    stdout, peak = run_measured(command)
    return {**json.loads(stdout.strip().splitlines()[-1]), "peak_rss_bytes": peak}


def loader_worker(dataset: Path, batch: int) -> None:
    from benchmarks.loader import measure
    from dataloading.split_binary import ShardSpec, SplitBinaryDataset
    from feature_spec import FeatureSpec

    spec = FeatureSpec.load(dataset / "feature_spec.yaml")
    samples_per_second, _ = measure(SplitBinaryDataset(spec, "train", ShardSpec(batch)), 3)
    print(json.dumps({"samples_per_second": samples_per_second}))


def preprocessing(rows: int, work: Path) -> dict[str, Any]:
    """`benchmarks/preproc.py` on a log of `rows` lines, the pipeline run twice in one
    Spark session: the first run's figures, the second's under `later_runs`."""
    output = work / "preproc.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "preproc.py"), f"--rows={rows}"]
    # 2g: the setting docs/preprocessing.md gives for this machine (4g is no faster).
    command += ["--frequency_threshold=3", "--driver_memory=2g", "--runs=2", f"--json={output}"]
    run_measured(command)  # its peak would count the log's generation too
    return json.loads(output.read_text())  # peaks of the pipeline's processes, per stage


def cost_in_rows(by_rows: dict[str, dict[str, Any]]) -> dict[str, float]:
    """How rows/s changes with the log's size: rows/s at the largest log over rows/s
    at the smallest, for the first run of a Spark session (`first_run`: what a
    user's run costs) and for the last one (`later_run`: without the session's
    warm-up). 1.0 is cost linear in the rows; above 1, a fixed cost that the larger
    log spreads over more rows. Empty with fewer than two sizes."""
    if len(by_rows) < 2:
        return {}
    sizes = sorted(by_rows, key=int)
    small, large = by_rows[sizes[0]], by_rows[sizes[-1]]
    ratios = {"first_run": large["rows_per_second"] / small["rows_per_second"]}
    if small.get("later_runs") and large.get("later_runs"):
        ratios["later_run"] = (
            large["later_runs"][-1]["rows_per_second"] / small["later_runs"][-1]["rows_per_second"]
        )
    return ratios


def fixed_cost(by_rows: dict[str, dict[str, Any]]) -> dict[str, float]:
    """The first runs' time as a straight line through the smallest and the largest
    log: `fixed_seconds` apart from the lines plus `seconds_per_million_lines`; and
    `allowed_fixed_seconds`, the most fixed cost at which rows/s at the largest log
    would be within `COST_IN_ROWS_TOLERANCE` of rows/s at the smallest, at that cost
    per line (absent where the sizes are too close for any fixed cost to matter).
    Empty with fewer than two sizes."""
    if len(by_rows) < 2:
        return {}
    sizes = sorted(by_rows, key=int)
    # The lines each log has (the size asked for is rounded to whole days).
    small, large = by_rows[sizes[0]]["rows"], by_rows[sizes[-1]]["rows"]
    small_seconds = small / by_rows[sizes[0]]["rows_per_second"]
    large_seconds = large / by_rows[sizes[-1]]["rows_per_second"]
    per_line = (large_seconds - small_seconds) / (large - small)
    fit = {
        "fixed_seconds": small_seconds - per_line * small,
        "seconds_per_million_lines": per_line * 1e6,
    }
    # rows/s at n is n / (F + a n); the ratio large over small is at most 1 + tol
    # while F (large - (1 + tol) small) <= a small large tol.
    tolerance = COST_IN_ROWS_TOLERANCE
    spread = large - (1 + tolerance) * small
    if spread > 0:
        fit["allowed_fixed_seconds"] = per_line * small * large * tolerance / spread
    return fit


def spark_floor(work: Path) -> dict[str, dict[str, Any]]:
    """`benchmarks/spark_floor.py`, each kind of task in a new Spark session of its
    own: what the first and later empty jobs of Python tasks, and of JVM tasks,
    cost."""
    figures = {}
    for tasks in ("python", "jvm"):
        output = work / f"spark_floor_{tasks}.json"
        script = str(ROOT / "benchmarks" / "spark_floor.py")
        run_measured([sys.executable, script, f"--tasks={tasks}", f"--json={output}"])
        figures[tasks] = json.loads(output.read_text())
    return figures


def recovery(work: Path) -> dict[str, Any]:
    """`benchmarks/recovery.py`: seconds from a host's failure to the first step on
    the hosts left, under Horovod Elastic; needs root (network namespaces)."""
    if os.geteuid() != 0:
        return {"skipped": "needs root (network namespaces)"}
    output = work / "recovery.json"
    script = str(ROOT / "benchmarks" / "recovery.py")
    run_measured([sys.executable, script, f"--dir={work}", f"--json={output}"])
    figures: dict[str, Any] = json.loads(output.read_text())
    return figures


def checkpoint_pause(work: Path, gib_size: float) -> dict[str, Any]:
    """`benchmarks/checkpoint_pause.py`: the pause a checkpoint of about `gib_size`
    GiB costs a one-process run, and its share of training time."""
    output = work / "checkpoint_pause.json"
    script = str(ROOT / "benchmarks" / "checkpoint_pause.py")
    command = [sys.executable, script, f"--gib={gib_size}", f"--dir={work}", f"--json={output}"]
    run_measured(command)
    figures: dict[str, Any] = json.loads(output.read_text())
    return figures


# ------------------------------------------------------------------ report


def gib(value: float) -> str:
    return f"{value / 2**30:.2f}"


def print_table(results: dict[str, Any]) -> None:
    peaks = results["matmul_gflops"]
    print(
        f"\nmatmul peak in this run: float32 {peaks['float32']:.0f} GFLOP/s, "
        f"bfloat16 {peaks['bfloat16']:.0f} GFLOP/s; dense part "
        f"{results['mflop_per_sample']:.2f} MFLOP per training sample"
    )
    header = (
        f"{'training':<9}{'batch':>7}{'ranks':>6}{'ours/s':>9}{'plain/s':>9}{'ratio':>7}"
        f"{'ours GF/s':>10}{'plain GF/s':>11}{'matmul':>7}{'ours GiB':>9}{'plain GiB':>10}"
    )
    print(header)
    for row in results["training"]:
        plain = row.get("plain")
        peak = peaks["bfloat16" if VARIANTS[row["variant"]][0] else "float32"]
        gflops = row["ours"]["samples_per_second"] * results["mflop_per_sample"] / 1e3
        cells = [
            f"{row['variant']:<9}{row['batch_size']:>7}{row['ranks']:>6}",
            f"{row['ours']['samples_per_second']:>9,.0f}",
            f"{plain['samples_per_second']:>9,.0f}" if plain else f"{'-':>9}",
            f"{row['ratio']:>7.2f}" if plain else f"{'-':>7}",
            f"{gflops:>10.0f}",
            f"{plain['samples_per_second'] * results['mflop_per_sample'] / 1e3:>11.0f}"
            if plain
            else f"{'-':>11}",
            f"{peak:>7.0f}",
            f"{gib(row['ours']['peak_rss_bytes']):>9}",
            f"{gib(plain['peak_rss_bytes']):>10}" if plain else f"{'-':>10}",
        ]
        print("".join(cells))
    for row in results.get("optimizers", []):
        ranks = row.get("ranks", 1)
        print(
            f"{row['optimizer']} {row['variant']} batch {row['batch_size']}, "
            f"{'one process' if ranks == 1 else f'{ranks} ranks'}: "
            f"{row['samples_per_second']:,.0f} samples/s, {row['of_sgd']:.2f} of SGD's"
        )
    for variant, row in results.get("dcnv2", {}).items():
        print(
            f"DLRM-DCNv2 (small, {DCNV2_FLAGFILE}) {variant} batch {DCNV2_BATCH}: ours "
            f"{row['ours']['samples_per_second']:,.0f} samples/s, plain "
            f"{row['plain']['samples_per_second']:,.0f}, ratio {row['ratio']:.2f}"
        )
    for variant, row in results.get("collectives", {}).items():
        print(
            f"2 ranks {variant} batch {row['batch_size']}: waiting on collectives "
            f"{row['share']:.0%} of the step ({1000 * row['exposed_seconds_per_step']:.0f} of "
            f"{1000 * row['step_seconds']:.0f} ms, no op running; ranks "
            + ", ".join(f"{share:.0%}" for share in row["per_rank_share"])
            + f"), executing them {row['executing_share']:.0%} "
            f"({1000 * row['executing_seconds_per_step']:.0f} ms), in flight "
            f"{row['in_flight_share']:.0%} (Horovod timeline)"
        )
    for name, row in results.get("inference", {}).items():
        print(
            f"inference batch {name}: {row['samples_per_second']:,.0f} samples/s, "
            f"p50 {row['latency_p50_ms']:.1f} ms, p99 {row['latency_p99_ms']:.1f} ms, "
            f"peak {gib(row['peak_rss_bytes'])} GiB"
        )
    if "loader" in results:
        row = results["loader"]
        print(
            f"loader batch {row['batch_size']}: {row['samples_per_second']:,.0f} samples/s, "
            f"peak {gib(row['peak_rss_bytes'])} GiB"
        )
    for row in results.get("preprocessing_by_rows", {}).values():
        stages = ", ".join(
            f"{name} {stage['rows_per_second']:,.0f} rows/s peak {gib(stage['peak_rss_bytes'])} GiB"
            for name, stage in row["stages"].items()
        )
        later = "".join(
            f"; run {number} in the same session {run['rows_per_second']:,.0f} rows/s"
            for number, run in enumerate(row.get("later_runs", []), 2)
        )
        print(
            f"preprocessing {row['rows']:,} lines: {row['rows_per_second']:,.0f} rows/s, "
            f"peak {gib(row['peak_rss_bytes'])} GiB over all processes ({stages}){later}"
        )
    cost = results.get("preprocessing_cost_in_rows", {})
    if cost:
        sizes = sorted(results["preprocessing_by_rows"], key=int)
        later = f", {cost['later_run']:.2f} in the later run" if "later_run" in cost else ""
        print(
            f"preprocessing rows/s at {int(sizes[-1]):,} lines over rows/s at "
            f"{int(sizes[0]):,}: {cost['first_run']:.2f} in a session's first run{later} "
            f"(1.00: cost linear in the rows)"
        )
    fit = results.get("preprocessing_fixed_cost", {})
    if fit:
        allowed = fit.get("allowed_fixed_seconds")
        within = (
            f"; within {COST_IN_ROWS_TOLERANCE:.0%} needs at most {allowed:.1f} s of it"
            if allowed is not None
            else ""
        )
        print(
            f"preprocessing first runs: {fit['fixed_seconds']:.1f} s apart from the lines + "
            f"{fit['seconds_per_million_lines']:.1f} s per million lines{within}"
        )
    pause = results.get("checkpoint_pause")
    if pause:
        shares = " / ".join(f"{share:.2%}" for share in pause["share_of_training"].values())
        print(
            f"a {pause['checkpoint_gib']:.2f} GiB checkpoint pauses training "
            f"{pause['median_pause_s']:.1f} s ({pause['gib_per_s']:.2f} GiB/s), "
            f"{pause['pause_in_steps']:.1f} steps; {shares} of training time at one every "
            "10 / 30 / 60 min"
        )
    found = results.get("recovery")
    if found and "skipped" in found:
        print(f"recovery after a host fails: not measured ({found['skipped']})")
    elif found:
        print(
            f"recovery after a host fails ({found['hosts']} hosts, elastic): first step on "
            f"the others {found['kill']['total_s']:.1f} s after its rank was killed, "
            f"{found['link']['total_s']:.1f} s after its link went down "
            f"(HOROVOD_GLOO_TIMEOUT_SECONDS={found['gloo_timeout_s']})"
        )
    for kind, floor in results.get("spark_floor", {}).items():
        first, *later = floor["job_seconds"]
        print(
            f"a new Spark session's first empty job of {kind} tasks: {first:.2f} s, later "
            f"ones {statistics.median(later):.2f} s (start-up {floor['startup_seconds']:.1f} s "
            f"apart)"
        )


def save(results: dict[str, Any], path: Path) -> None:
    """Writes the figures so far, replacing the file whole."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(results, indent=2) + "\n")
    partial.replace(path)


def plot_packages() -> Path:
    """Where `make install` puts matplotlib (requirements-plot.txt): beside the venv's
    packages, not among them, since Keras imports it with TensorFlow whenever it can."""
    return Path(sys.prefix) / "plot-packages"


def plot(results: dict[str, Any], path: Path) -> None:
    packages = str(plot_packages())
    if packages not in sys.path:
        sys.path.append(packages)  # after site-packages: numpy is the venv's
    try:
        import matplotlib
    except ImportError as error:
        raise SystemExit(
            f"no matplotlib to draw {path} with: `make install` (WITH_DEV=1) puts it in "
            f"{packages} ({error})"
        ) from None

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6.4, 4.2))
    lines = (("fp32", "fp32", "tab:blue"), ("amp", "bf16 (--amp)", "tab:red"))
    for variant, label, color in lines:
        rows = [r for r in results["training"] if r["variant"] == variant and r["ranks"] == 1]
        rows.sort(key=lambda r: r["batch_size"])
        if not rows:
            continue
        batches = [r["batch_size"] for r in rows]
        ours = [r["ours"]["samples_per_second"] for r in rows]
        axes.plot(batches, ours, "o-", color=color, label=f"ours {label}")
        if all(r.get("plain") for r in rows):
            plain = [r["plain"]["samples_per_second"] for r in rows]
            axes.plot(batches, plain, "s--", color=color, label=f"plain TF {label}")
    axes.set_xscale("log", base=2)
    axes.set_xlabel("global batch size")
    axes.set_ylabel("training samples/s (1 process)")
    axes.set_title(f"Default DLRM, {results['machine']}")
    axes.grid(True, alpha=0.3)
    axes.legend()
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)


# -------------------------------------------------------------------- main


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch_sizes", help="default 8192,65536")
    parser.add_argument("--variants", help=f"default {','.join(VARIANTS)}")
    parser.add_argument("--ranks", help="default 1,2")
    parser.add_argument(
        "--optimizers",
        default="adagrad,adam",
        help="optimizers measured besides SGD, one process at the smallest batch ('': none)",
    )
    parser.add_argument("--steps", type=int, default=8, help="timed training steps per run")
    parser.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="training runs per row, ours and the plain loop in turn; medians (default 1)",
    )
    parser.add_argument(
        "--preproc_rows",
        help="log sizes in lines, comma-separated (default 1000000,3000000); 0: skip",
    )
    parser.add_argument("--quick", action="store_true", help="a smaller suite (see above)")
    parser.add_argument("--output", type=Path, default=ROOT / "benchmarks" / "results.json")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "bench_batch_size.png")
    parser.add_argument("--worker_loader", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker_loader:
        loader_worker(Path(args.worker_loader[0]), int(args.worker_loader[1]))
        return 0
    defaults = {
        "batch_sizes": "8192" if args.quick else "8192,65536",
        "variants": "fp32,amp" if args.quick else ",".join(VARIANTS),
        "ranks": "1" if args.quick else "1,2",
        "preproc_rows": "200000" if args.quick else "1000000,3000000",
    }
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)

    def integers(flag: str) -> list[int]:
        text = getattr(args, flag)
        try:
            return [int(item) for item in text.split(",") if item]
        except ValueError:
            parser.error(f"--{flag}: expected comma-separated integers, got {text!r}")

    batches, ranks, preproc_rows = (integers(f) for f in ("batch_sizes", "ranks", "preproc_rows"))
    if any(r < 0 for r in preproc_rows) or (0 in preproc_rows and len(preproc_rows) > 1):
        parser.error(
            f"--preproc_rows: expected positive sizes, or 0 alone, got {args.preproc_rows!r}"
        )
    preproc_rows = sorted(set(preproc_rows) - {0})
    variants = [v for v in args.variants.split(",") if v]
    optimizers = [o for o in args.optimizers.split(",") if o]
    if set(optimizers) - set(LEARNING_RATES) - {"sgd"} or "sgd" in optimizers:
        parser.error(f"--optimizers: expected some of adagrad, adam, got {args.optimizers!r}")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        parser.error(f"--variants: unknown {unknown}; expected some of {list(VARIANTS)}")
    if args.repeats < 1:
        parser.error(f"--repeats: expected at least 1, got {args.repeats}")
    bad = [b for b in batches for r in ranks if b <= 0 or r <= 0 or b % r]
    if bad:
        parser.error(f"--batch_sizes {bad}: each must be positive and divide by every --ranks")

    cpu = platform.processor() or platform.machine()
    print("the machine's matmul peak ...", flush=True)
    peaks = machine_peaks()
    results: dict[str, Any] = {
        "machine": f"{os.cpu_count()} CPUs {cpu}",
        "peaks": peaks,
        "matmul_gflops": {name: peaks[name]["peak"] for name in ("float32", "bfloat16")},
        "mflop_per_sample": mflop_per_sample(),
        "training": [],
    }
    print(f"matmul GFLOP/s in this run: {results['matmul_gflops']}", flush=True)
    with tempfile.TemporaryDirectory() as directory:
        work = Path(directory)
        dataset = default_dataset(work, max(batches), args.steps)
        for batch in batches:
            for variant in variants:
                for rank_count in ranks:
                    row: dict[str, Any] = {
                        "variant": variant,
                        "batch_size": batch,
                        "ranks": rank_count,
                        "repeats": args.repeats,
                        **alternated(
                            partial(
                                train_ours, dataset, work, batch, variant, rank_count, args.steps
                            ),
                            # The plain loop is one process.
                            partial(train_plain, batch, variant, args.steps)
                            if rank_count == 1
                            else None,
                            args.repeats,
                        ),
                    }
                    ours = row["ours"]
                    results["training"].append(row)
                    save(results, args.output)  # a suite cut short keeps what it measured
                    ratio = f", ratio {row['ratio']:.2f}" if "ratio" in row else ""
                    print(
                        f"training {variant} batch {batch} ranks {rank_count}: "
                        f"{ours['samples_per_second']:,.0f} samples/s{ratio}",
                        flush=True,
                    )
        if len(os.sched_getaffinity(0)) >= 16:
            from benchmarks.cores import measure as measure_cores

            results["cores"] = measure_cores(
                dataset,
                work,
                (2, 16),
                [max(batches)],
                [v for v in variants if v in ("fp32", "amp")],
                args.steps,
                False,
                results["mflop_per_sample"],
            )
            save(results, args.output)
        results["optimizers"] = optimizer_rows(
            results["training"], optimizers, dataset, work, min(batches), args.steps
        )
        save(results, args.output)
        dcnv2 = dcnv2_dataset(work, args.steps)
        results["dcnv2"] = {}
        for variant in (v for v in variants if v in ("fp32", "amp")):
            results["dcnv2"][variant] = alternated(
                partial(train_ours_dcnv2, dcnv2, work, variant, args.steps),
                partial(train_plain_dcnv2, variant, args.steps),
                args.repeats,
            )
            print(
                f"DLRM-DCNv2 (small) {variant}: ratio {results['dcnv2'][variant]['ratio']:.2f}",
                flush=True,
            )
            save(results, args.output)
        if any(r > 1 for r in ranks):
            results["collectives"] = collective_shares(dataset, work, min(batches), args.steps)
        results["inference"] = {str(b): inference(dataset, work, b) for b in batches}
        results["loader"] = {"batch_size": max(batches), **loader(dataset, max(batches))}
        save(results, args.output)
        print("checkpoint pause ...", flush=True)
        results["checkpoint_pause"] = checkpoint_pause(work, 0.25 if args.quick else 2.0)
        save(results, args.output)
        if not args.quick:
            print("recovery after a host fails ...", flush=True)
            results["recovery"] = recovery(work)
            save(results, args.output)
        if preproc_rows:
            by_rows: dict[str, dict[str, Any]] = {}
            results["preprocessing_by_rows"] = by_rows
            for rows in preproc_rows:
                print(f"preprocessing {rows:,} lines ...", flush=True)
                by_rows[str(rows)] = preprocessing(rows, work)
                results["preprocessing_cost_in_rows"] = cost_in_rows(by_rows)
                results["preprocessing_fixed_cost"] = fixed_cost(by_rows)
                save(results, args.output)
            print("Spark's first jobs ...", flush=True)
            results["spark_floor"] = spark_floor(work)
            save(results, args.output)
    results["targets"] = evaluate(results)
    print_table(results)
    print_targets(results["targets"], results["peaks"])
    save(results, args.output)
    plot(results, args.plot)
    print(f"\nwrote {args.output} and {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
