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
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PYTHON = sys.executable
FLAGS = [
    "--optimizer=adam",
    "--learning_rate=0.01",
    "--warmup_steps=0",
    "--decay_start_step=0",
    "--embedding_dim=16",
    "--bottom_mlp_dims=64,16",
    "--top_mlp_dims=128,64,1",
    "--epochs=1",
    "--evals_per_epoch=1",
    "--batch_size=4096",
    "--print_freq=1000",
]


def run(command: list[str]) -> float:
    start = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        sys.exit(f"failed: {' '.join(command)}\n{result.stdout[-2000:]}{result.stderr[-2000:]}")
    return time.perf_counter() - start


def measure(args: argparse.Namespace, buckets: int, raw: Path, work: Path) -> dict[str, Any]:
    dataset, run_dir = work / f"data_{buckets}", work / f"run_{buckets}"
    last = args.days - 1
    preprocess = run(
        [
            PYTHON,
            "-m",
            "preproc.criteo",
            f"--input_dir={raw}",
            f"--output_dir={dataset}",
            f"--train_days=0-{last - 1}",
            f"--test_days={last}",
            f"--frequency_threshold={args.frequency_threshold}",
            f"--oov_buckets={buckets}",
        ]
    )
    train = run(
        [
            PYTHON,
            "main.py",
            f"--dataset_path={dataset}",
            f"--save_checkpoint_path={run_dir}",
            *FLAGS,
        ]
    )
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    summary = [r for r in records if r["event"] == "summary"][-1]
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--buckets", default="0,100,1000")
    parser.add_argument("--days", type=int, default=4)
    parser.add_argument("--rows_per_day", type=int, default=100_000)
    parser.add_argument("--drift", type=float, default=0.3)
    parser.add_argument("--frequency_threshold", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="oov_buckets_", dir=args.dir))
    try:
        raw = work / "raw"
        run(
            [
                PYTHON,
                "-m",
                "dataloading.criteo_tsv",
                f"--output_dir={raw}",
                f"--days={args.days}",
                f"--rows_per_day={args.rows_per_day}",
                f"--drift={args.drift}",
            ]
        )
        results = [measure(args, int(k), raw, work) for k in args.buckets.split(",")]
    finally:
        shutil.rmtree(work, ignore_errors=True)
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
