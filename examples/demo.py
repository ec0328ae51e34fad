"""`make demo`: the whole product end to end on a generated click log.

    python examples/demo.py [--output_dir demo_output] [--days 3] [--rows_per_day 340000]
        [--ranks 2] [--frequency_threshold 3] [--batch_size 8192]

Stages, each printed with its progress and timing:

1. write a Criteo-format click log (`dlrm-synthetic clicklog`): tab-separated day
   files with missing values, negative counts and short rows, labelled by a
   hidden teacher model so that there is something to learn;
2. preprocess it with Spark in local mode (`dlrm-preprocess`): the last day is
   the test split, the others the train split;
3. train hybrid-parallel under `horovodrun --gloo -np 2` on localhost
   (`dlrm-train`): embedding tables sharded over the ranks, exact AUC on the test
   day, a checkpoint;
4. export a SavedModel from that checkpoint on one process, and score two test
   rows with it;

Each command is printed as a user would type it, with the installed commands
that `make install` puts in the venv. Then a summary: rows, the sharding plan,
samples/s, AUC, and where the outputs are. It exits non-zero when a stage fails
or the test AUC is not above `--min_auc` (0.6): a demo whose model learned
nothing is a failure. A previous demo run in the same directory is replaced; a
directory that this script did not write is refused.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from dlrm.app import records

REPO = Path(__file__).resolve().parents[1]
MARKER = ".dlrm-demo"  # marks a directory this script owns and may replace

# A model sized for 2 CPU cores: small MLPs, 16-wide embeddings. Tables of at most
# 1,024 rows are replicated, larger ones placed whole on one rank, those above 8,192
# rows sliced by columns over the ranks, so the demo shows hybrid parallelism at work
# (the thresholds count elements: rows x 16).
TRAIN_FLAGS = [
    "--optimizer=adam",
    "--learning_rate=0.01",
    "--data_parallel_threshold=16384",
    "--column_slice_threshold=131072",
    "--warmup_steps=0",
    "--decay_start_step=0",
    "--embedding_dim=16",
    "--bottom_mlp_dims=64,16",
    "--top_mlp_dims=128,64,1",
    "--epochs=1",
    "--evals_per_epoch=1",
    "--print_freq=10",
]


class DemoError(RuntimeError):
    """A stage failed; the message says which and how to look closer."""


def stage(number: int, title: str) -> float:
    print(f"\n=== [{number}/4] {title}", flush=True)
    return time.perf_counter()


# The installed commands (`make install` puts them beside this interpreter).
BIN = Path(sys.executable).parent


def run(command: list[str], what: str) -> None:
    """Runs `command` (its first word an installed command), its output streaming
    to the console; the command is shown as a user would type it."""
    executable = BIN / command[0]
    if not executable.exists():
        raise DemoError(f"{executable} is missing: run `make install` first")
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    print("$ " + " ".join(command), flush=True)
    result = subprocess.run([str(executable), *command[1:]], env=env, check=False)
    if result.returncode != 0:
        raise DemoError(f"{what} failed with exit code {result.returncode} (output above)")


def prepare(output: Path) -> None:
    """Makes `output` an empty directory owned by the demo."""
    if output.exists():
        if not (output / MARKER).exists():
            raise DemoError(
                f"{output} exists and was not written by the demo; choose another "
                "--output_dir or remove it yourself"
            )
        shutil.rmtree(output)
    output.mkdir(parents=True)
    (output / MARKER).write_text("written by examples/demo.py; replaced by the next demo run\n")


def last_record(log: Path, event: str) -> dict[str, Any]:
    """The run's last `event` record (`dlrm.app.records`); DemoError when it has none."""
    try:
        return records.last_record(log, event)
    except ValueError as error:
        raise DemoError(str(error)) from error


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", type=Path, default=REPO / "demo_output")
    parser.add_argument("--days", type=int, default=3, help="day files; the last is the test day")
    parser.add_argument("--rows_per_day", type=int, default=340_000)
    parser.add_argument("--ranks", type=int, default=2, help="horovodrun -np")
    parser.add_argument("--frequency_threshold", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=8192, help="global training batch")
    parser.add_argument(
        "--min_auc",
        type=float,
        default=0.6,
        help="fail when the test AUC is not above this (the model did not learn)",
    )
    args = parser.parse_args(argv)
    if args.days < 2:
        parser.error(f"--days: expected >= 2 (train days + the test day), got {args.days}")
    if args.ranks < 1:
        parser.error(f"--ranks: expected >= 1, got {args.ranks}")
    output = args.output_dir.resolve()
    raw, dataset, run_dir = output / "raw", output / "dataset", output / "run"
    saved_model = output / "saved_model"
    started = time.perf_counter()
    timings = {}
    try:
        prepare(output)

        start = stage(1, f"click log: {args.days} days x {args.rows_per_day:,} rows")
        run(
            [
                "dlrm-synthetic",
                "clicklog",
                f"--output_dir={raw}",
                f"--days={args.days}",
                f"--rows_per_day={args.rows_per_day}",
            ],
            "writing the click log",
        )
        timings["click log"] = time.perf_counter() - start

        start = stage(2, "Spark preprocessing (local mode)")
        last = args.days - 1
        run(
            [
                "dlrm-preprocess",
                f"--input_dir={raw}",
                f"--output_dir={dataset}",
                f"--train_days=0-{last - 1}" if last > 1 else "--train_days=0",
                f"--test_days={last}",
                f"--frequency_threshold={args.frequency_threshold}",
            ],
            "preprocessing",
        )
        timings["preprocessing"] = time.perf_counter() - start

        start = stage(3, f"hybrid-parallel training on {args.ranks} ranks (horovodrun --gloo)")
        command = [
            "dlrm-train",
            f"--dataset_path={dataset}",
            f"--save_checkpoint_path={run_dir}",
            f"--batch_size={args.batch_size}",
            *TRAIN_FLAGS,
        ]
        if args.ranks > 1:
            hosts = f"localhost:{args.ranks}"
            command = ["horovodrun", "--gloo", "-np", str(args.ranks), "-H", hosts, *command]
        run(command, "training")
        timings["training"] = time.perf_counter() - start

        start = stage(4, "export a SavedModel from the checkpoint (one process)")
        run(
            [
                "dlrm-train",
                "--mode=export",
                f"--restore_checkpoint_path={run_dir}",
                f"--saved_model_output_path={saved_model}",
            ],
            "export",
        )
        scores = score_with_saved_model(saved_model, dataset)
        timings["export"] = time.perf_counter() - start
    except DemoError as error:
        print(f"\ndemo: {error}", file=sys.stderr)
        return 1
    auc = print_summary(output, dataset, run_dir, saved_model, scores, timings, started)
    if not auc > args.min_auc:
        print(
            f"\ndemo: the test AUC {auc:.4f} is not above --min_auc {args.min_auc}: the model "
            "did not learn what the click log's teacher knows (about 0.85 is reachable)",
            file=sys.stderr,
        )
        return 1
    return 0


def score_with_saved_model(saved_model: Path, dataset: Path) -> list[float]:
    """Loads the SavedModel in a fresh process and scores the first two test rows,
    as a serving system would (the signature takes numerical + categorical ids)."""
    program = f"""
import json, sys
import numpy as np, tensorflow as tf
from feature_spec import FeatureSpec, TEST_MAPPING
from dataloading.split_binary import ShardSpec, SplitBinaryDataset
spec = FeatureSpec.load({str(dataset)!r})
batch = next(iter(SplitBinaryDataset(spec, TEST_MAPPING, ShardSpec(2)).to_tf_dataset()))
serve = tf.saved_model.load({str(saved_model)!r}).signatures["serving_default"]
out = serve(numerical=batch.numerical, categorical=batch.categorical)
print(json.dumps([float(x) for x in np.ravel(next(iter(out.values())).numpy())]))
"""
    env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
    result = subprocess.run(
        [sys.executable, "-c", program], env=env, capture_output=True, text=True, check=False
    )
    if result.returncode != 0:
        raise DemoError(f"scoring with the SavedModel failed:\n{result.stderr[-2000:]}")
    scores = json.loads(result.stdout.strip().splitlines()[-1])
    print(f"SavedModel scores of the first two test rows: {', '.join(f'{s:.4f}' for s in scores)}")
    return scores


def print_summary(
    output: Path,
    dataset: Path,
    run_dir: Path,
    saved_model: Path,
    scores: list[float],
    timings: dict[str, float],
    started: float,
) -> float:
    """Prints what the demo did and where its outputs are; returns the test AUC."""
    report = json.loads((dataset / "report.json").read_text())
    summary = last_record(run_dir / "metrics.jsonl", "summary")
    plan_file = run_dir / "sharding_plan.json"
    plan = "one process, no sharding"
    if plan_file.exists():
        kinds: dict[str, int] = {}
        for table in json.loads(plan_file.read_text())["tables"]:
            kinds[table["kind"]] = kinds.get(table["kind"], 0) + 1
        plan = ", ".join(f"{n} tables {k}" for k, n in sorted(kinds.items()))
    splits = report["splits"]
    rows_text = ", ".join(
        f"{split} {values['rows']:,} ({100 * values['positive_rate']:.1f}% clicks)"
        for split, values in splits.items()
    )
    rows_text += f"; {len(report['categorical'])} categorical, {len(report['numerical'])} "
    rows_text += f"numerical features; {report['malformed_total']:,} malformed lines skipped"
    lines = [
        ("rows", rows_text),
        ("ranks", f"{summary['world_size']} (horovodrun --gloo, localhost)"),
        ("sharding plan", plan),
        (
            "training",
            f"{summary['steps']} steps, {summary['train_samples_per_second']:,.0f} samples/s",
        ),
        (
            "test AUC",
            f"{summary['auc']:.4f} (logloss {summary['logloss']:.4f}, {summary['samples']:,} rows)",
        ),
        ("SavedModel", f"{saved_model} (scores {', '.join(f'{s:.3f}' for s in scores)})"),
        ("checkpoint", str(summary["checkpoint"])),
        ("metrics log", str(run_dir / "metrics.jsonl")),
        ("dataset", f"{dataset} (feature_spec.yaml, report.json)"),
        ("stage times", ", ".join(f"{k} {v:.0f} s" for k, v in timings.items())),
        ("total", f"{time.perf_counter() - started:.0f} s"),
    ]
    width = max(len(k) for k, _ in lines)
    print(f"\n=== demo finished: outputs in {output}")
    for key, value in lines:
        print(f"  {key:<{width}}  {value}")
    return float(summary["auc"])


if __name__ == "__main__":
    sys.exit(main())
