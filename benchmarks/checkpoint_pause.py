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

import argparse
import itertools
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run as a script from anywhere

TABLES = 26
DIM = 128
BATCH = 8192
GIB = 1 << 30


def measure(gib: float, ranks: int, steps: int, every: int, work: Path) -> dict[str, Any]:
    from dataloading.synthetic import generate_split_binary

    rows_per_table = int(gib * GIB / (TABLES * DIM * 4))
    dataset, run = work / "data", work / "run"
    print(f"generating {TABLES} tables of {rows_per_table:,} rows ...", flush=True)
    generate_split_binary(
        dataset,
        cardinalities=[rows_per_table] * TABLES,
        rows={"train": BATCH * (steps + 1), "test": BATCH},
        seed=0,
    )
    command = [sys.executable, str(ROOT / "main.py")]
    if ranks > 1:
        horovodrun = str(Path(sys.executable).parent / "horovodrun")
        command = [horovodrun, "--gloo", "-np", str(ranks), "-H", f"localhost:{ranks}", *command]
    flags = [
        f"--dataset_path={dataset}",
        f"--save_checkpoint_path={run}",
        f"--batch_size={BATCH}",
        f"--max_steps={steps}",
        f"--checkpoint_every_steps={every}",
        "--keep_checkpoints=1",
        "--evals_per_epoch=0",
        "--print_freq=1",
        "--optimizer=sgd",
    ]
    print(f"training {steps} steps, a checkpoint every {every} ...", flush=True)
    subprocess.run([*command, *flags], check=True, cwd=ROOT)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    checkpoints = [r for r in records if r["event"] == "checkpoint"]
    saved = {r["step"] for r in checkpoints}
    train = [r for r in records if r["event"] == "train"]
    # A step's time from consecutive progress records; the first steps compile, and
    # an interval that holds a checkpoint is not a step's.
    step_times = [
        b["time"] - a["time"]
        for a, b in itertools.pairwise(train)
        if a["step"] >= 3 and a["step"] not in saved
    ]
    size = sum(f.stat().st_size for f in run.glob("step_*/**/*") if f.is_file())
    pauses = [r["seconds"] for r in checkpoints[:-1]]  # the last one is the run's end
    pause = statistics.median(pauses)
    return {
        "ranks": ranks,
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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=2.0, help="the tables' size (default 2)")
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=10, help="steps between checkpoints")
    parser.add_argument("--dir", type=Path, default=None, help="where to write (default: tmp)")
    parser.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = parser.parse_args()
    if args.steps < 2 * args.every:
        parser.error("--steps: expected at least two checkpoints' worth (2 x --every)")
    work = Path(tempfile.mkdtemp(prefix="checkpoint_pause.", dir=args.dir))
    try:
        figures = measure(args.gib, args.ranks, args.steps, args.every, work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(
        f"checkpoint {figures['checkpoint_gib']:.2f} GiB on {figures['ranks']} rank(s): "
        f"pause {figures['median_pause_s']:.1f} s ({figures['gib_per_s']:.2f} GiB/s), "
        f"{figures['pause_in_steps']:.1f} steps of {figures['median_step_s']:.2f} s; share of "
        "training time at a checkpoint every 10 / 30 / 60 min: "
        + " / ".join(f"{share:.2%}" for share in figures["share_of_training"].values()),
        flush=True,
    )
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
