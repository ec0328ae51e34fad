"""What `--oov_buckets K` does to AUC on held-out days of a drifting click log.

    python benchmarks/oov_buckets.py [--buckets 0,100,1000] [--days 4]
        [--rows_per_day 100000] [--drift 0.3] [--frequency_threshold 3] [--dir PARENT]

Writes a click log (`dlrm-synthetic clicklog --drift`), preprocesses it once per K
(train: every day but the last, test: the last day, the same threshold), trains the
same model on one process for one epoch, and prints per K the test AUC, logloss,
the ids in all tables, and the wall times. Everything is written in a new directory
under --dir (default: the system's temporary directory), deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.common import REPO, parser_for, run_checked, work_directory
from dlrm.app.records import last_record

FLAGS = ["--optimizer=adam", "--learning_rate=0.01", "--warmup_steps=0", "--decay_start_step=0"]
FLAGS += ["--embedding_dim=16", "--bottom_mlp_dims=64,16", "--top_mlp_dims=128,64,1"]
FLAGS += ["--epochs=1", "--evals_per_epoch=1", "--batch_size=4096", "--print_freq=1000"]


def seconds_of(*command: str) -> float:
    """Runs `command` (a python module or script and its flags); its wall seconds."""
    start = time.perf_counter()
    run_checked([sys.executable, *command])
    return time.perf_counter() - start


def measure(args: argparse.Namespace, buckets: int, raw: Path, work: Path) -> dict[str, Any]:
    dataset, run_dir = work / f"data_{buckets}", work / f"run_{buckets}"
    last = args.days - 1
    flags = [f"--input_dir={raw}", f"--output_dir={dataset}", f"--train_days=0-{last - 1}"]
    flags += [f"--test_days={last}", f"--frequency_threshold={args.frequency_threshold}"]
    preprocess = seconds_of("-m", "preproc.criteo", *flags, f"--oov_buckets={buckets}")
    flags = [f"--dataset_path={dataset}", f"--save_checkpoint_path={run_dir}", *FLAGS]
    train = seconds_of(str(REPO / "main.py"), *flags)
    summary = last_record(run_dir / "metrics.jsonl", "summary")
    report = json.loads((dataset / "report.json").read_text())
    return {
        "oov_buckets": buckets,
        "auc": summary["auc"],
        "logloss": summary["logloss"],
        "cardinality": sum(c["cardinality"] for c in report["categorical"]),
        "preprocess_s": preprocess,
        "train_s": train,
    }


def main() -> int:
    parser = parser_for(__doc__)
    parser.add_argument("--buckets", default="0,100,1000")
    parser.add_argument("--days", type=int, default=4)
    parser.add_argument("--rows_per_day", type=int, default=100_000)
    parser.add_argument("--drift", type=float, default=0.3)
    parser.add_argument("--frequency_threshold", type=int, default=3)
    parser.add_argument("--dir", type=Path, help="where to write (default: a temporary directory)")
    args = parser.parse_args()
    with work_directory("oov_buckets_", args.dir) as work:
        raw = work / "raw"
        log = [f"--days={args.days}", f"--rows_per_day={args.rows_per_day}"]
        seconds_of(
            "-m", "dataloading.criteo_tsv", f"--output_dir={raw}", *log, f"--drift={args.drift}"
        )
        results = [measure(args, int(k), raw, work) for k in args.buckets.split(",")]
    print(
        f"{args.days - 1} train days, test day {args.days - 1}, {args.rows_per_day:,} rows a "
        f"day, drift {args.drift}, threshold {args.frequency_threshold}, one process"
    )
    print(f"{'K':>6} {'AUC':>7} {'logloss':>8} {'ids':>9} {'prep s':>7} {'train s':>8}")
    for r in results:
        print(
            f"{r['oov_buckets']:>6} {r['auc']:>7.4f} {r['logloss']:>8.4f} {r['cardinality']:>9,} "
            f"{r['preprocess_s']:>7.0f} {r['train_s']:>8.0f}"
        )
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
