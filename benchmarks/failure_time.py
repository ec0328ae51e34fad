"""How long every rank takes to stop when one rank fails to save or restore a
checkpoint of at least 2 GiB, and the peak memory of restoring it on another
number of ranks.

    python benchmarks/failure_time.py [--rows 2097152] [--dir PARENT] [--json PATH]

Under `horovodrun --gloo -np 2`, `main.py` trains a model whose largest table is
--rows x 128 float32 (2,097,152 rows: 1 GiB, plus 1 GiB of Adagrad slot: a 2 GiB
checkpoint; the planner slices it by columns over both ranks). Then:

1. `save`: the same run, but rank 1's disk "fills up" as it starts writing its
   shards (`harness/scripts/fail_on_rank.py`, the fault the tests
   inject); rank 0 still writes its half (1 GiB) before it learns of the failure;
2. `restore`: a run resuming from the 2 GiB checkpoint in which rank 1's first
   read fails; rank 0 restores its half first;
3. `reshard`: `--mode eval` on one process from the 2-rank checkpoint (the whole
   table assembled from both column shards): peak RSS against the table's size.

For 1 and 2 it reports the seconds from the injected failure (a timestamp the
failing rank prints) to the end of `horovodrun`, against Horovod's stall
shutdown (900 s), which a rank left waiting in a collective would hit.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.common import (
    REPO,
    add_output_flags,
    child_env,
    parser_for,
    save,
    work_directory,
)
from dataloading.synthetic import generate_split_binary
from harness.processes import on_ranks

DIM = 128
FLAGS = ["--optimizer=adagrad", "--learning_rate=0.05", "--warmup_steps=0", "--decay_start_step=0"]
FLAGS += [f"--embedding_dim={DIM}", f"--bottom_mlp_dims=16,{DIM}", "--top_mlp_dims=16,1"]
FLAGS += ["--batch_size=1024", "--max_steps=2", "--evals_per_epoch=0"]
FAIL_ON_RANK = "harness/scripts/fail_on_rank.py"


def two_ranks(*args: str) -> list[str]:
    return on_ranks(2, [sys.executable, *args])


def timed_run(command: list[str], log: Path) -> tuple[int, float, str]:
    """Return code, the time it ended (epoch seconds) and the output."""
    with log.open("w") as sink:
        result = subprocess.run(
            command, cwd=REPO, env=child_env(), stdout=sink, stderr=subprocess.STDOUT
        )
    return result.returncode, time.time(), log.read_text()


def injected_at(output: str) -> float:
    found = re.search(r"injected failure at ([\d.]+)", output)
    if found is None:
        raise SystemExit(f"no injected failure in the output:\n{output[-3000:]}")
    return float(found.group(1))


def peak_rss_gib(command: list[str], log: Path) -> tuple[int, float]:
    """Runs `command` under GNU time; its return code and peak RSS in GiB."""
    code, _, output = timed_run(["/usr/bin/time", "-f", "maxrss_kib %M", *command], log)
    found = re.findall(r"maxrss_kib (\d+)", output)
    return code, int(found[-1]) / 2**20 if found else float("nan")


def main() -> None:
    parser = parser_for(__doc__)
    parser.add_argument("--rows", type=int, default=2_097_152)
    add_output_flags(parser)
    args = parser.parse_args()
    with work_directory("failure_time_", args.dir) as work:
        figures = measure(work, args.rows)
    print(f"checkpoint: {figures['checkpoint_gib']:.2f} GiB ({args.rows:,} x {DIM} table)")
    print(f"{'case':<10} {'rc':>4} {'seconds to stop after the failure':>36}")
    for case in ("save", "restore"):
        entry = figures[case]
        print(f"{case:<10} {entry['returncode']:>4} {entry['seconds_to_stop']:>36.1f}")
    reshard = figures["reshard"]
    print(
        f"reshard (1 process from 2 ranks): peak RSS {reshard['peak_rss_gib']:.2f} GiB for a "
        f"{reshard['table_gib']:.2f} GiB table (rc {reshard['returncode']})"
    )
    if args.json:
        save(figures, args.json, indent=1)


def measure(work: Path, rows: int) -> dict[str, Any]:
    dataset = work / "data"
    split_rows = {"train": 20_000, "test": 2_048}
    generate_split_binary(dataset, (rows, 1000, 50), 4, rows=split_rows, seed=1)
    data = f"--dataset_path={dataset}"
    run_dir = work / "run"
    code, _, output = timed_run(
        two_ranks("main.py", data, *FLAGS, f"--save_checkpoint_path={run_dir}"),
        work / "train.log",
    )
    if code != 0:
        raise SystemExit(f"the training run failed:\n{output[-3000:]}")
    step = sorted(run_dir.glob("step_*"))[-1]
    size = sum(p.stat().st_size for p in step.rglob("*") if p.is_file())
    figures: dict[str, Any] = {"checkpoint_gib": size / 2**30, "rows": rows}
    restore = [f"--restore_checkpoint_path={step}"]
    cases = {
        "save": [FAIL_ON_RANK, "1", "save", "0", data, *FLAGS],
        "restore": [FAIL_ON_RANK, "1", "restore", "0", data, *FLAGS, *restore],
    }
    for case, command in cases.items():
        save_to = f"--save_checkpoint_path={work / case}"
        code, ended, output = timed_run(two_ranks(*command, save_to), work / f"{case}.log")
        figures[case] = {"returncode": code, "seconds_to_stop": ended - injected_at(output)}
    command = [sys.executable, "main.py", data, *FLAGS, "--mode=eval", *restore]
    code, rss = peak_rss_gib(command, work / "reshard.log")
    figures["reshard"] = {
        "returncode": code,
        "peak_rss_gib": rss,
        "table_gib": rows * DIM * 4 / 2**30,
    }
    return figures


if __name__ == "__main__":
    main()
