"""The benchmark suite (`make bench`): this project against plain TensorFlow, in one run.

    python benchmarks/suite.py [--batch_sizes 8192,65536] [--variants fp32,amp,xla,amp+xla]
        [--ranks 1,2] [--optimizers adagrad,adam] [--steps 8] [--repeats 1]
        [--preproc_rows 1000000,3000000] [--quick]
        [--output benchmarks/results.json] [--plot docs/bench_batch_size.png]

Measures, each in its own process (so that its peak memory is its own:
`common.run_measured`), on a synthetic Criteo-shaped dataset with the default
model (13 numerical features, 26 tables x 100,000 x 128, bottom 512-256-128, top
1024-1024-512-256-1, SGD), the steps of `MEASUREMENTS` in turn:

- training: `main.py` end to end (loader, trainer, the final evaluation) under
  each precision/XLA variant, batch size and rank count (`horovodrun --gloo`
  for 2), and the plain TensorFlow loop of `benchmarks/plain_tf.py` (no project
  code) with the same model and batch, run right after it, with their ratio
  (`alternated`), and the achieved GFLOP/s of each (dense part,
  `dlrm.model.config.dense_training_flops`) next to the machine's matmul peak measured in
  this run (`benchmarks/targets.py`);
- where the machine has 16 cores: one process on 2 of them and on 16
  (`benchmarks/cores.py`);
- the other optimizers (`--optimizers`, Adagrad and Adam; their embedding rows
  updated by the same fused kernel as SGD's) against SGD's row of the same run;
- the scaled-down MLPerf DLRM-DCNv2 (`mlperf_dcnv2_small.flags`: cross
  interaction, multi-hot, Adam, batch 4096), ours against the plain loop;
- 2 ranks: the share of the step in which a rank waits on its collectives, and
  those in which they execute and are in flight (`benchmarks/collective_time.py`);
- inference (samples/s, p50/p99 batch latency) and the loader alone;
- what a checkpoint costs (`benchmarks/checkpoint_pause.py`);
- recovery after a host fails (`benchmarks/recovery.py`; root only);
- preprocessing (`benchmarks/preproc.py`, Spark local mode): rows/s per stage
  and in all at each log size, twice in one Spark session, so that the cost in
  rows (`cost_in_rows`) is given both for a run of its own and for a later run
  without the session's warm-up, the first runs' time as a fixed part and a part
  per line (`fixed_cost`), and what a new Spark session's first jobs cost doing
  nothing (`benchmarks/spark_floor.py`): a part of that fixed cost that no Spark
  pipeline avoids.

Prints one table, then each performance target against its goal and the peak
(`docs/performance.md#targets`: met, NOT MET, or n/a with why), writes the
figures as JSON (`--output`, after every measurement) and a plot of samples/s
against batch size, ours and plain, fp32 and bf16 (`--plot`). `--quick`
measures batch 8192, fp32 and `--amp`, one rank, a 0.25 GiB checkpoint and a
200,000-line log, without recovery: a few minutes instead of about an hour on 2
cores (fp32 and `--amp` alone, without preprocessing, took 38 minutes; the
3M-line log, generated and run twice, takes about 5).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import statistics
import sys
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from benchmarks import cores
from benchmarks.common import (
    LEARNING_RATES,
    REPO,
    VARIANTS,
    default_dataset,
    integers,
    last_json_line,
    main_py,
    mflop_per_sample,
    parser_for,
    plain_rate,
    progress_rate,
    run_measured,
    save,
    train_ours,
    train_plain,
    variant_flags,
    variants,
    work_directory,
)
from benchmarks.common import child_env as child_env  # for tests/unit/test_bench_cores.py
from benchmarks.targets import COST_IN_ROWS_TOLERANCE, evaluate, machine_peaks, print_targets
from dataloading.synthetic import SHAPES, generate_split_binary
from dlrm.app.records import last_record


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The suite's settings, `--quick`'s defaults applied and every value checked."""
    parser = parser_for(__doc__)
    parser.add_argument("--batch_sizes", type=integers, help="default 8192,65536")
    parser.add_argument("--variants", type=variants, help=f"default {','.join(VARIANTS)}")
    parser.add_argument("--ranks", type=integers, help="default 1,2")
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
        type=integers,
        help="log sizes in lines, comma-separated (default 1000000,3000000); 0: skip",
    )
    parser.add_argument("--quick", action="store_true", help="a smaller suite (see above)")
    parser.add_argument("--output", type=Path, default=REPO / "benchmarks" / "results.json")
    parser.add_argument("--plot", type=Path, default=REPO / "docs" / "bench_batch_size.png")
    parser.add_argument("--worker_loader", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    quick = {"batch_sizes": [8192], "variants": ["fp32", "amp"], "ranks": [1]}
    quick["preproc_rows"] = [200_000]
    full = {"batch_sizes": [8192, 65536], "variants": list(VARIANTS), "ranks": [1, 2]}
    full["preproc_rows"] = [1_000_000, 3_000_000]
    for name, value in (quick if args.quick else full).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    rows = args.preproc_rows
    if any(r < 0 for r in rows) or (0 in rows and len(rows) > 1):
        parser.error(f"--preproc_rows: expected positive sizes, or 0 alone, got {rows}")
    optimizers = set(args.optimizers.split(",")) - {""}
    if optimizers - set(LEARNING_RATES) - {"sgd"} or "sgd" in optimizers:
        parser.error(f"--optimizers: expected some of adagrad, adam, got {args.optimizers!r}")
    if args.repeats < 1:
        parser.error(f"--repeats: expected at least 1, got {args.repeats}")
    bad = [b for b in args.batch_sizes for r in args.ranks if b <= 0 or r <= 0 or b % r]
    if bad:
        parser.error(f"--batch_sizes {bad}: each must be positive and divide by every --ranks")
    args.preproc_rows = sorted(set(args.preproc_rows) - {0})
    args.optimizers = [o for o in args.optimizers.split(",") if o]
    return args


# ------------------------------------------------------------ measurement


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


def machine_figures() -> dict[str, Any]:
    """The results' start: the machine, its matmul peaks, the model's MFLOP."""
    print("the machine's matmul peak ...", flush=True)
    peaks = machine_peaks()
    results: dict[str, Any] = {
        "machine": f"{os.cpu_count()} CPUs {platform.processor() or platform.machine()}",
        "peaks": peaks,
        "matmul_gflops": {name: peaks[name]["peak"] for name in ("float32", "bfloat16")},
        "mflop_per_sample": mflop_per_sample(),
        "training": [],
    }
    print(f"matmul GFLOP/s in this run: {results['matmul_gflops']}", flush=True)
    return results


@dataclasses.dataclass
class SuiteRun:
    """What each measurement step reads, and the results it adds its figures to."""

    args: argparse.Namespace
    work: Path
    dataset: Path
    results: dict[str, Any]

    def save(self) -> None:
        """Writes the figures so far: a suite cut short keeps what it measured."""
        save(self.results, self.args.output)


def measure_training(suite: SuiteRun) -> None:
    """Ours and the plain loop at every batch size, variant and rank count."""
    args = suite.args
    for batch in args.batch_sizes:
        for variant in args.variants:
            for ranks in args.ranks:
                setting = (batch, variant, ranks, args.steps)
                ours = partial(train_ours, suite.dataset, suite.work, *setting)
                # The plain loop is one process.
                plain = partial(train_plain, batch, variant, args.steps) if ranks == 1 else None
                row = {"variant": variant, "batch_size": batch, "ranks": ranks}
                row |= {"repeats": args.repeats} | alternated(ours, plain, args.repeats)
                suite.results["training"].append(row)
                suite.save()
                ratio = f", ratio {row['ratio']:.2f}" if "ratio" in row else ""
                print(
                    f"training {variant} batch {batch} ranks {ranks}: "
                    f"{row['ours']['samples_per_second']:,.0f} samples/s{ratio}",
                    flush=True,
                )


def measure_cores(suite: SuiteRun) -> None:
    """Where the machine has 16 cores: one process on 2 of them and on 16."""
    if len(os.sched_getaffinity(0)) < 16:
        return
    args = suite.args
    variants = [v for v in args.variants if v in ("fp32", "amp")]
    counts, batches, mflop = (2, 16), [max(args.batch_sizes)], suite.results["mflop_per_sample"]
    suite.results["cores"] = cores.measure(
        suite.dataset, suite.work, counts, batches, variants, args.steps, False, mflop
    )


def measure_optimizers(suite: SuiteRun) -> None:
    """Each of `--optimizers` at the smallest batch, for every variant and rank
    count that has an SGD row at that batch: samples/s and the share of SGD's
    (`of_sgd`)."""
    batch, steps = min(suite.args.batch_sizes), suite.args.steps
    rows: list[dict[str, Any]] = []
    suite.results["optimizers"] = rows
    for sgd in (row for row in suite.results["training"] if row["batch_size"] == batch):
        variant, ranks = sgd["variant"], sgd["ranks"]
        for optimizer in suite.args.optimizers:
            ours = train_ours(suite.dataset, suite.work, batch, variant, ranks, steps, optimizer)
            of_sgd = ours["samples_per_second"] / sgd["ours"]["samples_per_second"]
            rows.append(
                {"optimizer": optimizer, "variant": variant, "batch_size": batch, "ranks": ranks}
                | ours
                | {"of_sgd": of_sgd}
            )
            print(
                f"training {variant} batch {batch} ranks {ranks} {optimizer}: "
                f"{ours['samples_per_second']:,.0f} samples/s, {of_sgd:.2f} of SGD's",
                flush=True,
            )


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


def dcnv2_dataset(work: Path, steps: int) -> Path:
    """A synthetic dataset of the small DLRM-DCNv2's shape (multi-hot)."""
    cardinalities, hotness = SHAPES["mlperf_dcnv2_small"]
    rows = {"train": DCNV2_BATCH * (steps + 2), "test": DCNV2_BATCH}
    generate_split_binary(work / "dcnv2", cardinalities, hotness=hotness, rows=rows, seed=0)
    return work / "dcnv2"


def train_ours_dcnv2(dataset: Path, work: Path, variant: str, steps: int) -> dict[str, Any]:
    """main.py with the DLRM-DCNv2 flagfile, `steps` timed steps after one."""
    flags = [f"--flagfile={DCNV2_FLAGFILE}", f"--max_steps={steps + 1}", "--print_freq=1"]
    flags += ["--evals_per_epoch=0", *variant_flags(variant)]
    return progress_rate(*main_py(dataset, work, 1, *flags))


def train_plain_dcnv2(variant: str, steps: int) -> dict[str, Any]:
    """The plain loop written as the DLRM-DCNv2 flagfile sets the model."""
    cardinalities, hotness = SHAPES["mlperf_dcnv2_small"]
    assert hotness is not None
    settings = dcnv2_flags()
    flags = [f"--{plain}={settings[ours]}" for ours, plain in DCNV2_PLAIN_FLAGS.items()]
    flags += [f"--steps={steps}", "--warmup=1"]
    flags += [f"--cardinalities={','.join(map(str, cardinalities))}"]
    flags += [f"--hotness={','.join(map(str, hotness))}"]
    return plain_rate(*flags, *variant_flags(variant, plain=True))


def measure_dcnv2(suite: SuiteRun) -> None:
    """The small DLRM-DCNv2, ours against the plain loop, fp32 and --amp."""
    steps = suite.args.steps
    dataset = dcnv2_dataset(suite.work, steps)
    suite.results["dcnv2"] = figures = {}
    for variant in (v for v in suite.args.variants if v in ("fp32", "amp")):
        figures[variant] = alternated(
            partial(train_ours_dcnv2, dataset, suite.work, variant, steps),
            partial(train_plain_dcnv2, variant, steps),
            suite.args.repeats,
        )
        print(f"DLRM-DCNv2 (small) {variant}: ratio {figures[variant]['ratio']:.2f}", flush=True)
        suite.save()


def measure_collectives(suite: SuiteRun) -> None:
    """Where `--ranks` has more than one: what the collectives cost 2 ranks' step,
    fp32 and --amp (`benchmarks/collective_time.py`, through `benchmarks/train.py`)."""
    from benchmarks.train import measure_ranks, per_step

    if all(r == 1 for r in suite.args.ranks):
        return
    batch, steps = min(suite.args.batch_sizes), suite.args.steps
    suite.results["collectives"] = shares = {}
    for variant in ("fp32", "amp"):
        result = measure_ranks(suite.dataset, 2, batch, steps, 2, suite.work, variant == "amp")
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


def measure_inference(suite: SuiteRun) -> None:
    """`main.py --mode inference` at each batch size: samples/s and batch latency."""
    keys = ("samples_per_second", "latency_p50_ms", "latency_p99_ms")
    suite.results["inference"] = figures = {}
    for batch in suite.args.batch_sizes:
        flags = ["--mode=inference", f"--valid_batch_size={batch}", "--max_steps=30"]
        flags += ["--benchmark_warmup_steps=3", "--print_freq=1000"]
        log, peak = main_py(suite.dataset, suite.work, 1, *flags)
        summary = last_record(log, "summary")
        figures[str(batch)] = {key: summary[key] for key in keys} | {"peak_rss_bytes": peak}


def measure_loader(suite: SuiteRun) -> None:
    """The loader alone (`loader_worker`, in a process of its own) at the largest batch."""
    batch = max(suite.args.batch_sizes)
    command = [sys.executable, __file__, "--worker_loader", str(suite.dataset), str(batch)]
    stdout, peak = run_measured(command)
    figures = {"batch_size": batch, **last_json_line(stdout), "peak_rss_bytes": peak}
    suite.results["loader"] = figures


def loader_worker(dataset: Path, batch: int) -> None:
    """Prints one rank's loader samples/s on `dataset`'s training split."""
    from benchmarks.loader import measure
    from dataloading.split_binary import ShardSpec, SplitBinaryDataset
    from feature_spec import FeatureSpec

    spec = FeatureSpec.load(dataset / "feature_spec.yaml")
    samples_per_second, _ = measure(SplitBinaryDataset(spec, "train", ShardSpec(batch)), 3)
    print(json.dumps({"samples_per_second": samples_per_second}))


def script_figures(work: Path, script: str, *flags: str) -> dict[str, Any]:
    """`benchmarks/<script>` run with `flags`: the figures it writes to `--json`."""
    output = work / f"{Path(script).stem}.json"
    run_measured([sys.executable, str(REPO / "benchmarks" / script), *flags, f"--json={output}"])
    return json.loads(output.read_text())


def measure_checkpoint_pause(suite: SuiteRun) -> None:
    """The pause a checkpoint of 2 GiB of tables (0.25 with --quick) costs a
    one-process run, and its share of training time."""
    print("checkpoint pause ...", flush=True)
    flags = [f"--gib={0.25 if suite.args.quick else 2.0}", f"--dir={suite.work}"]
    suite.results["checkpoint_pause"] = script_figures(suite.work, "checkpoint_pause.py", *flags)


def measure_recovery(suite: SuiteRun) -> None:
    """Not with --quick: the seconds from a host's failure to the first step on
    the hosts left, under Horovod Elastic; needs root (network namespaces)."""
    if suite.args.quick:
        return
    print("recovery after a host fails ...", flush=True)
    if os.geteuid() != 0:
        suite.results["recovery"] = {"skipped": "needs root (network namespaces)"}
    else:
        suite.results["recovery"] = script_figures(suite.work, "recovery.py", f"--dir={suite.work}")


def measure_preprocessing(suite: SuiteRun) -> None:
    """`benchmarks/preproc.py` on a log of each size, the pipeline run twice in
    one Spark session (the second run's figures under `later_runs`), and how
    rows/s changes with the size; then what a new Spark session's first and
    later empty jobs cost, of Python tasks and of JVM tasks, each kind in a
    session of its own (`benchmarks/spark_floor.py`)."""
    if not suite.args.preproc_rows:
        return
    suite.results["preprocessing_by_rows"] = by_rows = {}
    # 2g: the setting docs/preprocessing.md gives for this machine (4g is no faster).
    flags = ["--frequency_threshold=3", "--driver_memory=2g", "--runs=2"]
    for rows in suite.args.preproc_rows:
        print(f"preprocessing {rows:,} lines ...", flush=True)
        # Its figures hold the pipeline's peaks; run_measured's counts the log's generation.
        by_rows[str(rows)] = script_figures(suite.work, "preproc.py", f"--rows={rows}", *flags)
        suite.results["preprocessing_cost_in_rows"] = cost_in_rows(by_rows)
        suite.results["preprocessing_fixed_cost"] = fixed_cost(by_rows)
        suite.save()
    print("Spark's first jobs ...", flush=True)
    suite.results["spark_floor"] = {
        tasks: script_figures(suite.work, "spark_floor.py", f"--tasks={tasks}")
        for tasks in ("python", "jvm")
    }


MEASUREMENTS = (
    measure_training,
    measure_cores,
    measure_optimizers,
    measure_dcnv2,
    measure_collectives,
    measure_inference,
    measure_loader,
    measure_checkpoint_pause,
    measure_recovery,
    measure_preprocessing,
)


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


# ------------------------------------------------------------------ report


def gib(value: float) -> str:
    return f"{value / 2**30:.2f}"


def print_table(results: dict[str, Any]) -> None:
    """Every figure measured, one section after another."""
    for section in (
        print_training,
        print_optimizers,
        print_dcnv2,
        print_collectives,
        print_inference,
        print_preprocessing,
        print_checkpoint_pause,
        print_recovery,
        print_spark_floor,
    ):
        section(results)


def print_training(results: dict[str, Any]) -> None:
    peaks = results["matmul_gflops"]
    mflop = results["mflop_per_sample"]
    print(
        f"\nmatmul peak in this run: float32 {peaks['float32']:.0f} GFLOP/s, "
        f"bfloat16 {peaks['bfloat16']:.0f} GFLOP/s; dense part {mflop:.2f} MFLOP per "
        "training sample"
    )
    print(
        f"{'training':<9}{'batch':>7}{'ranks':>6}{'ours/s':>9}{'plain/s':>9}{'ratio':>7}"
        f"{'ours GF/s':>10}{'plain GF/s':>11}{'matmul':>7}{'ours GiB':>9}{'plain GiB':>10}"
    )
    for row in results["training"]:
        plain = row.get("plain")
        peak = peaks["bfloat16" if VARIANTS[row["variant"]][0] else "float32"]
        cells = [
            f"{row['variant']:<9}{row['batch_size']:>7}{row['ranks']:>6}",
            f"{row['ours']['samples_per_second']:>9,.0f}",
            f"{plain['samples_per_second']:>9,.0f}" if plain else f"{'-':>9}",
            f"{row['ratio']:>7.2f}" if plain else f"{'-':>7}",
            f"{row['ours']['samples_per_second'] * mflop / 1e3:>10.0f}",
            f"{plain['samples_per_second'] * mflop / 1e3:>11.0f}" if plain else f"{'-':>11}",
            f"{peak:>7.0f}",
            f"{gib(row['ours']['peak_rss_bytes']):>9}",
            f"{gib(plain['peak_rss_bytes']):>10}" if plain else f"{'-':>10}",
        ]
        print("".join(cells))


def print_optimizers(results: dict[str, Any]) -> None:
    for row in results.get("optimizers", []):
        ranks = row.get("ranks", 1)
        print(
            f"{row['optimizer']} {row['variant']} batch {row['batch_size']}, "
            f"{'one process' if ranks == 1 else f'{ranks} ranks'}: "
            f"{row['samples_per_second']:,.0f} samples/s, {row['of_sgd']:.2f} of SGD's"
        )


def print_dcnv2(results: dict[str, Any]) -> None:
    for variant, row in results.get("dcnv2", {}).items():
        print(
            f"DLRM-DCNv2 (small, {DCNV2_FLAGFILE}) {variant} batch {DCNV2_BATCH}: ours "
            f"{row['ours']['samples_per_second']:,.0f} samples/s, plain "
            f"{row['plain']['samples_per_second']:,.0f}, ratio {row['ratio']:.2f}"
        )


def print_collectives(results: dict[str, Any]) -> None:
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


def print_inference(results: dict[str, Any]) -> None:
    """Inference per batch size, then the loader alone."""
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


def print_preprocessing(results: dict[str, Any]) -> None:
    """Each log size, then how rows/s changes with it, then the fit."""
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


def print_checkpoint_pause(results: dict[str, Any]) -> None:
    pause = results.get("checkpoint_pause")
    if pause:
        shares = " / ".join(f"{share:.2%}" for share in pause["share_of_training"].values())
        print(
            f"a {pause['checkpoint_gib']:.2f} GiB checkpoint pauses training "
            f"{pause['median_pause_s']:.1f} s ({pause['gib_per_s']:.2f} GiB/s), "
            f"{pause['pause_in_steps']:.1f} steps; {shares} of training time at one every "
            "10 / 30 / 60 min"
        )


def print_recovery(results: dict[str, Any]) -> None:
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


def print_spark_floor(results: dict[str, Any]) -> None:
    for kind, floor in results.get("spark_floor", {}).items():
        first, *later = floor["job_seconds"]
        print(
            f"a new Spark session's first empty job of {kind} tasks: {first:.2f} s, later "
            f"ones {statistics.median(later):.2f} s (start-up {floor['startup_seconds']:.1f} s "
            f"apart)"
        )


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


def main() -> int:
    args = parse_args()
    if args.worker_loader:
        loader_worker(Path(args.worker_loader[0]), int(args.worker_loader[1]))
        return 0
    results = machine_figures()
    with work_directory("bench_suite_") as work:
        dataset = default_dataset(work, max(args.batch_sizes), args.steps)
        suite = SuiteRun(args, work, dataset, results)
        for measure in MEASUREMENTS:
            measure(suite)
            suite.save()
    results["targets"] = evaluate(results)
    print_table(results)
    print_targets(results["targets"], results["peaks"])
    save(results, args.output)
    plot(results, args.plot)
    print(f"\nwrote {args.output} and {args.plot}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
