"""What a checkpoint costs a training run: the pause, at a model of about --gib GiB.

    python benchmarks/checkpoint_pause.py [--gib 2] [--ranks 1] [--steps 30]
        [--every 10] [--dir PARENT] [--json PATH]

Trains `dlrm-train` on a synthetic dataset whose 26 tables of width 128 hold about
--gib GiB of float32 (SGD: no optimizer slots, so the checkpoint is the model), with
`--checkpoint_every_steps --every` and a progress record after every step. From the
metrics log it reports the checkpoint's size, the seconds each checkpoint took (the
`checkpoint` records: the training loop waits for them), the median step time
without a checkpoint, and the share of training time the pauses would take at a
checkpoint every 10, 30 and 60 minutes. Everything is written in a new directory
under --dir (default: the system's temporary directory), deleted at the end.
"""

from __future__ import annotations

import itertools
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.common import (
    REPO,
    TABLES,
    add_output_flags,
    child_env,
    parser_for,
    save,
    work_directory,
)
from dataloading.synthetic import generate_split_binary
from dlrm.app.records import read_records
from harness.processes import main_py_command

DIM = 128
BATCH = 8192
GIB = 1 << 30


def measure(gib: float, ranks: int, steps: int, every: int, work: Path) -> dict[str, Any]:
    """Trains with a checkpoint every `every` steps; the figures of its metrics log."""
    rows_per_table = int(gib * GIB / (TABLES * DIM * 4))
    dataset, run = work / "data", work / "run"
    print(f"generating {TABLES} tables of {rows_per_table:,} rows ...", flush=True)
    rows = {"train": BATCH * (steps + 1), "test": BATCH}
    generate_split_binary(dataset, [rows_per_table] * TABLES, rows=rows, seed=0)
    flags = [f"--dataset_path={dataset}", f"--save_checkpoint_path={run}"]
    flags += [f"--batch_size={BATCH}", f"--max_steps={steps}", f"--checkpoint_every_steps={every}"]
    flags += ["--keep_checkpoints=1", "--evals_per_epoch=0", "--print_freq=1", "--optimizer=sgd"]
    print(f"training {steps} steps, a checkpoint every {every} ...", flush=True)
    subprocess.run(main_py_command(ranks, *flags), check=True, cwd=REPO, env=child_env())
    size = sum(f.stat().st_size for f in run.glob("step_*/**/*") if f.is_file())
    return {"ranks": ranks} | pauses(run / "metrics.jsonl", size)


def pauses(log: Path, size: int) -> dict[str, Any]:
    """The checkpoints' pauses in the metrics log at `log`, against its step time."""
    checkpoints = read_records(log, "checkpoint")
    saved = {r["step"] for r in checkpoints}
    train = read_records(log, "train")
    # A step's time from consecutive progress records; the first steps compile, and
    # an interval that holds a checkpoint is not a step's.
    step_times = [
        b["time"] - a["time"]
        for a, b in itertools.pairwise(train)
        if a["step"] >= 3 and a["step"] not in saved
    ]
    pauses = [r["seconds"] for r in checkpoints[:-1]]  # the last one is the run's end
    pause = statistics.median(pauses)
    return {
        "checkpoint_gib": size / GIB,
        "checkpoint_seconds": pauses,
        "median_pause_s": pause,
        "gib_per_s": size / GIB / pause,
        "median_step_s": statistics.median(step_times),
        "pause_in_steps": pause / statistics.median(step_times),
        "share_of_training": {
            f"every_{minutes}_min": pause / (minutes * 60 + pause) for minutes in (10, 30, 60)
        },
    }


def main() -> int:
    parser = parser_for(__doc__)
    parser.add_argument("--gib", type=float, default=2.0, help="the tables' size (default 2)")
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=10, help="steps between checkpoints")
    add_output_flags(parser)
    args = parser.parse_args()
    if args.steps < 2 * args.every:
        parser.error("--steps: expected at least two checkpoints' worth (2 x --every)")
    with work_directory("checkpoint_pause.", args.dir) as work:
        figures = measure(args.gib, args.ranks, args.steps, args.every, work)
    print(
        f"checkpoint {figures['checkpoint_gib']:.2f} GiB on {figures['ranks']} rank(s): "
        f"pause {figures['median_pause_s']:.1f} s ({figures['gib_per_s']:.2f} GiB/s), "
        f"{figures['pause_in_steps']:.1f} steps of {figures['median_step_s']:.2f} s; share of "
        "training time at a checkpoint every 10 / 30 / 60 min: "
        + " / ".join(f"{share:.2%}" for share in figures["share_of_training"].values()),
        flush=True,
    )
    if args.json:
        save(figures, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
