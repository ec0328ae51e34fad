"""`make demo-incremental`: day-by-day training as production runs it, on a click log
whose click model drifts (new ids appear, old ones fade).

    python examples/incremental_demo.py [--output_dir demo_incremental] [--cycles 3]
        [--rows_per_day 250000] [--drift 0.3] [--ranks 2]

Day 0 trains a model from scratch. Then each cycle c = 1, 2, ... is what a
production pipeline runs when day c's logs arrive:

1. preprocess day c (test: day c + 1) with `--vocabulary_from` the day before's
   dataset: old values keep their ids, new ones are appended;
2. train on day c only, warm-started from yesterday's checkpoint (`--warm_start`):
   the tables grow to the new cardinalities;
3. evaluate on day c + 1 (the next day: what the model will serve);
4. export a SavedModel.

Beside it, for comparison: a model retrained from scratch on days 0..c (its own
vocabulary), and the day-0 model never updated, evaluated on the same next day
(its tables grow to the new vocabulary on restore; new ids get fresh rows). The
summary prints each cycle's next-day AUC and training time of the three. Exit
status: 0, 1 when a stage failed, 3 when the incremental model fell behind (below
the model not updated, or more than 0.005 below the one retrained from scratch).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from demo import REPO, TRAIN_FLAGS, DemoError, last_record, prepare, run

BEHIND = 3  # the exit status when the incremental model fell behind


class Day:
    """Commands of one demo run, timed."""

    def __init__(self, args: argparse.Namespace, output: Path) -> None:
        self.args = args
        self.raw = output / "raw"
        self.data = output / "data"
        self.runs = output / "runs"

    def preprocess(
        self, name: str, train: str, test: int, vocabulary_from: Path | None
    ) -> tuple[Path, float]:
        """Preprocesses days `train` (test: day `test`) into data/<name>; returns the
        dataset and the wall time."""
        dataset = self.data / name
        start = time.perf_counter()
        command = [
            "dlrm-preprocess",
            f"--input_dir={self.raw}",
            f"--output_dir={dataset}",
            f"--train_days={train}",
            f"--test_days={test}",
            f"--frequency_threshold={self.args.frequency_threshold}",
        ]
        if vocabulary_from is not None:
            command.append(f"--vocabulary_from={vocabulary_from}")
        run(command, f"preprocessing {name}")
        return dataset, time.perf_counter() - start

    def train(
        self, name: str, dataset: Path, warm_from: Path | None
    ) -> tuple[dict[str, Any], float]:
        """Trains into runs/<name>; returns its summary record and wall time."""
        run_dir = self.runs / name
        command = [
            "dlrm-train",
            f"--dataset_path={dataset}",
            f"--save_checkpoint_path={run_dir}",
            f"--batch_size={self.args.batch_size}",
            *TRAIN_FLAGS,
        ]
        if warm_from is not None:
            # Yesterday's weights, optimizer state and place in the learning-rate
            # schedule (the default, said here for the reader).
            command += [
                f"--restore_checkpoint_path={warm_from}",
                "--warm_start",
                "--schedule_from=checkpoint",
            ]
        if self.args.ranks > 1:
            hosts = f"localhost:{self.args.ranks}"
            command = ["horovodrun", "--gloo", "-np", str(self.args.ranks), "-H", hosts, *command]
        start = time.perf_counter()
        run(command, f"training {name}")
        return last_record(run_dir / "metrics.jsonl", "summary"), time.perf_counter() - start

    def evaluate(self, name: str, dataset: Path, checkpoint: Path) -> dict[str, Any]:
        log = self.runs / f"{name}.jsonl"
        run(
            [
                "dlrm-train",
                "--mode=eval",
                f"--dataset_path={dataset}",
                f"--restore_checkpoint_path={checkpoint}",
                f"--log_path={log}",
                *TRAIN_FLAGS,  # the architecture, which a restore checks
            ],
            f"evaluating {name}",
        )
        return last_record(log, "summary")

    def export(self, name: str, checkpoint: Path) -> None:
        run(
            [
                "dlrm-train",
                "--mode=export",
                f"--restore_checkpoint_path={checkpoint}",
                f"--saved_model_output_path={self.runs / name}",
            ],
            f"exporting {name}",
        )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", type=Path, default=REPO / "demo_incremental")
    parser.add_argument("--cycles", type=int, default=3, help="days after day 0")
    parser.add_argument("--rows_per_day", type=int, default=250_000)
    parser.add_argument("--drift", type=float, default=0.3, help="dlrm-synthetic clicklog --drift")
    parser.add_argument("--ranks", type=int, default=2, help="horovodrun -np")
    parser.add_argument("--frequency_threshold", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=4096, help="global training batch")
    args = parser.parse_args(argv)
    if args.cycles < 1:
        parser.error(f"--cycles: expected >= 1, got {args.cycles}")
    output = args.output_dir.resolve()
    day = Day(args, output)
    rows: list[dict[str, Any]] = []
    started = time.perf_counter()
    try:
        prepare(output)
        days = args.cycles + 2  # day 0, the cycles' days, and the last one's next day
        print(f"\n=== click log: {days} days x {args.rows_per_day:,} rows, drift {args.drift}")
        run(
            [
                "dlrm-synthetic",
                "clicklog",
                f"--output_dir={day.raw}",
                f"--days={days}",
                f"--rows_per_day={args.rows_per_day}",
                f"--drift={args.drift}",
            ],
            "writing the click log",
        )
        print("\n=== day 0: the first model, from scratch")
        dataset, prep = day.preprocess("day_0", "0", 1, None)
        first, train = day.train("incremental_0", dataset, None)
        first_checkpoint = Path(first["checkpoint"])
        rows.append({"day": 0, "incremental": (first["auc"], prep, train)})
        checkpoint = first_checkpoint
        for cycle in range(1, args.cycles + 1):
            print(f"\n=== cycle {cycle}: day {cycle} arrives; the next day ({cycle + 1}) tests")
            dataset, prep = day.preprocess(f"day_{cycle}", str(cycle), cycle + 1, dataset)
            incremental, train = day.train(f"incremental_{cycle}", dataset, checkpoint)
            checkpoint = Path(incremental["checkpoint"])
            day.export(f"saved_model_{cycle}", checkpoint)
            stale = day.evaluate(f"stale_{cycle}", dataset, first_checkpoint)
            days_so_far = f"0-{cycle}"
            all_days, scratch_prep = day.preprocess(
                f"days_{days_so_far}", days_so_far, cycle + 1, None
            )
            scratch, scratch_train = day.train(f"scratch_{cycle}", all_days, None)
            rows.append(
                {
                    "day": cycle,
                    "incremental": (incremental["auc"], prep, train),
                    "scratch": (scratch["auc"], scratch_prep, scratch_train),
                    "stale": (stale["auc"],),
                }
            )
    except DemoError as error:
        print(f"\ndemo: {error}", file=sys.stderr)
        return 1
    return print_summary(rows, output, time.perf_counter() - started)


def print_summary(rows: list[dict[str, Any]], output: Path, seconds: float) -> int:
    """The table of next-day AUCs; returns BEHIND when the incremental model falls
    behind the stale one, or more than 0.005 behind the one retrained from scratch."""

    def cell(value: tuple[float, ...] | None) -> str:
        if value is None:
            return "-"
        if len(value) == 1:
            return f"{value[0]:.4f}"
        auc, prep, train = value
        return f"{auc:.4f} ({prep:.0f} + {train:.0f} s)"

    print(f"\n=== demo finished in {seconds:.0f} s: outputs in {output}")
    print(
        "next-day AUC (wall seconds preprocessing + training) of models trained on day d, "
        "tested on day d + 1"
    )
    header = ("day", "incremental", "from scratch, days 0..d", "day-0 model, not updated")
    print(f"  {header[0]:<4} {header[1]:<24} {header[2]:<26} {header[3]}")
    behind = []
    for row in rows:
        print(
            f"  {row['day']:<4} {cell(row['incremental']):<24} {cell(row.get('scratch')):<26} "
            f"{cell(row.get('stale'))}"
        )
        if "scratch" not in row:
            continue
        incremental, scratch, stale = row["incremental"][0], row["scratch"][0], row["stale"][0]
        if incremental < stale:
            behind.append(f"day {row['day']}: below the model not updated ({stale:.4f})")
        if incremental < scratch - 0.005:
            behind.append(f"day {row['day']}: more than 0.005 below from scratch ({scratch:.4f})")
    if behind:
        print("demo: the incremental model fell behind: " + "; ".join(behind), file=sys.stderr)
        return BEHIND
    print("the incremental model is at least the stale one's and within 0.005 of from scratch")
    return 0


if __name__ == "__main__":
    sys.exit(main())
