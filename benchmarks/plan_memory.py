"""The dry run's predicted peak memory per rank against the peak RSS each rank of a
real run reaches, on 1, 2 and 4 ranks of this machine.

    python benchmarks/plan_memory.py [--ranks 1,2,4] [--output PATH] [--dir DIR]

Two models, each on a synthetic dataset whose tables and optimizer slots are a large
part of a rank's memory, so that the comparison checks the memory model rather than
TensorFlow's own footprint:

- `default`: the default model at the size `tests/integration/test_dry_run_memory.py`
  checks (`TABLES`, `FLAGS`: four tables of 1,000,000 rows at width 64, two small
  ones, Adagrad, batch 4096);
- `dcnv2`: `dlrm/flagfiles/mlperf_dcnv2_small.flags` (width 16, Adam, batch 4096)
  on MLPerf DLRM-DCNv2's multi-hot sizes over the Criteo 1TB tables capped at
  `DCNV2_TABLE_ROWS` rows (13.1 M rows: 2.5 GB of tables and Adam's two slots).

Per model and number of ranks N: `python -m dlrm.planning ... --hosts 1
--ranks_per_host N --device local --json` predicts every rank's peak, then `main.py`
trains `STEPS` steps without evaluation (one process for N = 1, else `horovodrun
--gloo` on localhost, as the tests launch it). The measured peak of a rank is the
kernel's high-water mark of its resident memory (`VmHWM` of its `main.py` process,
found by HOROVOD_RANK), read every 0.1 s while it runs: the summary record holds
rank 0's peak alone (`peak_memory_bytes`, from getrusage), kept in the figures as a
check on rank 0's.

Prints per rank: the predicted peak, the measured one, the error (predicted /
measured - 1) and the share of the prediction that is tables and optimizer slots.
With `--output`, writes the figures as JSON, every term of each prediction included.
The datasets and logs are written under `--dir` (default: the system's temporary
directory) and deleted at the end.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import psutil

from benchmarks.common import (
    child_env,
    cpu_model,
    integers,
    parser_for,
    run_checked,
    save,
    work_directory,
)
from benchmarks.process_tree import high_water_mark
from dlrm.app.records import last_record
from feature_spec import CRITEO_1TB_MLPERF_CARDINALITIES, MLPERF_DCNV2_MULTI_HOT_SIZES
from harness.processes import REPO, main_py_command

# The default model at a size whose tables (four of 1,000,000 x 64, and two small,
# replicated ones) and Adagrad's accumulators outweigh TensorFlow's own footprint;
# tests/integration/test_dry_run_memory.py holds the model to its error on them.
TABLES = (1_000_000, 1_000_000, 1_000_000, 1_000_000, 50, 7)
FLAGS = (
    "--embedding_dim=64",
    "--bottom_mlp_dims=512,256,64",
    "--batch_size=4096",
    "--optimizer=adagrad",
    "--learning_rate=0.01",
    "--warmup_steps=0",
    "--decay_start_step=0",
)
STEPS = 3  # the peak is reached by the second step; the third shows it holds
BATCH = 4096  # both models' (the test's flags and the flagfile's)
DCNV2_TABLE_ROWS = 2_000_000
DCNV2_FLAGFILE = "--flagfile=dlrm/flagfiles/mlperf_dcnv2_small.flags"
TIMEOUT_S = 900  # a step of either model takes seconds: longer has hung
SAMPLE_S = 0.1


@dataclasses.dataclass(frozen=True)
class Model:
    """A model of the comparison: its training flags and its dataset's tables."""

    name: str
    flags: tuple[str, ...]
    cardinalities: tuple[int, ...]
    hotness: tuple[int, ...] | None = None  # None: one id per row everywhere


MODELS = (
    Model("default", FLAGS, TABLES),
    Model(
        "dcnv2",
        (DCNV2_FLAGFILE,),
        tuple(min(rows, DCNV2_TABLE_ROWS) for rows in CRITEO_1TB_MLPERF_CARDINALITIES),
        MLPERF_DCNV2_MULTI_HOT_SIZES,
    ),
)
# After each model's flags: a short run without evaluation.
RUN_FLAGS = (f"--max_steps={STEPS}", "--evals_per_epoch=0", "--print_freq=1")


def build_dataset(model: Model, work: Path) -> Path:
    """`model`'s synthetic dataset in `work`: `STEPS` + 1 batches to train on, one to
    test. Written by a child process, so that this one stays small."""
    path = work / f"data_{model.name}"
    command = [sys.executable, "-m", "dataloading.synthetic", f"--output_dir={path}"]
    command += [f"--train_rows={BATCH * (STEPS + 1)}", f"--test_rows={BATCH}", "--seed=5"]
    command.append(f"--cardinalities={','.join(map(str, model.cardinalities))}")
    if model.hotness is not None:
        command.append(f"--hotness={','.join(map(str, model.hotness))}")
    run_checked(command, timeout=TIMEOUT_S)
    return path


def predict(model: Model, data: Path, ranks: int, work: Path) -> list[dict[str, Any]]:
    """The dry run's `memory_per_rank` for `ranks` ranks of one host of this machine."""
    output = work / f"plan_{model.name}_{ranks}.json"
    command = [sys.executable, "-m", "dlrm.planning", *model.flags, *RUN_FLAGS]
    command.append(f"--dataset_path={data}")
    command += ["--hosts=1", f"--ranks_per_host={ranks}", "--device=local", f"--json={output}"]
    run_checked(command, timeout=TIMEOUT_S)
    memory: list[dict[str, Any]] = json.loads(output.read_text())["memory_per_rank"]
    return memory


def train(model: Model, data: Path, ranks: int, work: Path) -> dict[str, Any]:
    """main.py on `ranks` ranks: every rank's peak RSS and rank 0's summary record."""
    log = work / f"metrics_{model.name}_{ranks}.jsonl"
    flags = [*model.flags, *RUN_FLAGS, f"--dataset_path={data}", f"--log_path={log}"]
    started = time.perf_counter()
    peaks = rank_peaks(main_py_command(ranks, *flags), ranks)
    summary = last_record(log, "summary")
    return {
        "peak_rss_bytes": peaks,
        "summary_peak_memory_bytes": summary["peak_memory_bytes"],
        "summary_peak_memory_of": summary["peak_memory_of"],
        "wall_s": time.perf_counter() - started,
    }


def rank_peaks(command: list[str], ranks: int) -> list[int]:
    """Runs `command` from the repo root; the peak RSS of each rank's main.py process
    (VmHWM, read every `SAMPLE_S`: a rise in the last sample before a rank exits
    is missed). RuntimeError with the output's tail if it fails or a rank is not
    found."""
    # The output goes to a file: a pipe not read while the ranks run could fill and
    # stop them.
    with (
        tempfile.TemporaryFile("w+") as output,
        subprocess.Popen(
            command, cwd=REPO, env=child_env(), stdout=output, stderr=subprocess.STDOUT
        ) as process,
    ):
        root = psutil.Process(process.pid)
        pids: dict[int, int] = {}  # pid -> rank
        peaks = [0] * ranks
        deadline = time.monotonic() + TIMEOUT_S
        while process.poll() is None and time.monotonic() < deadline:
            if len(pids) < ranks:
                pids.update(_ranks_started(root, ranks))
            for pid, rank in pids.items():
                peaks[rank] = max(peaks[rank], high_water_mark(pid))
            time.sleep(SAMPLE_S)
        if process.poll() is None:
            process.kill()
        process.wait()
        output.seek(0)
        tail = output.read()[-3000:]
    if process.returncode != 0 or 0 in peaks:
        found = f"peaks {peaks}" if process.returncode == 0 else f"exit {process.returncode}"
        raise RuntimeError(f"{' '.join(command[:6])} ... ({found}):\n{tail}")
    return peaks


def _ranks_started(root: psutil.Process, ranks: int) -> dict[int, int]:
    """{pid: rank} of the main.py processes started so far: `root` itself for one
    rank, else horovodrun's children by their HOROVOD_RANK."""
    if ranks == 1:
        return {root.pid: 0}
    found = {}
    with contextlib.suppress(psutil.Error):
        for member in root.children(recursive=True):
            with contextlib.suppress(psutil.Error):
                rank = member.environ().get("HOROVOD_RANK")
                if rank is not None and "main.py" in member.cmdline():
                    found[member.pid] = int(rank)
    return found


def compare(
    model: Model, ranks: int, predicted: list[dict[str, Any]], measured: dict[str, Any]
) -> list[dict[str, Any]]:
    """One row per rank: its prediction (every term), its measured peak, the error."""
    rows = []
    for rank, (terms, peak) in enumerate(zip(predicted, measured["peak_rss_bytes"], strict=True)):
        rows.append(
            {
                "model": model.name,
                "ranks": ranks,
                "rank": rank,
                "predicted_bytes": terms["peak"],
                "measured_bytes": peak,
                "error": terms["peak"] / peak - 1,
                "tables_share": (terms["tables"] + terms["optimizer_slots"]) / terms["peak"],
                "predicted_terms": terms,
            }
        )
    return rows


def print_table(rows: Sequence[dict[str, Any]]) -> None:
    print(
        f"\n{'model':<8} {'ranks':>5} {'rank':>4} {'predicted':>15} {'measured RSS':>15} "
        f"{'error':>7} {'tables':>7}"
    )
    for row in rows:
        print(
            f"{row['model']:<8} {row['ranks']:>5} {row['rank']:>4} "
            f"{row['predicted_bytes']:>15,} {row['measured_bytes']:>15,} "
            f"{row['error']:>+7.1%} {row['tables_share']:>7.0%}"
        )


def main() -> int:
    parser = parser_for(__doc__)
    parser.add_argument("--ranks", type=integers, default=[1, 2, 4], help="e.g. 1,2,4")
    parser.add_argument("--output", type=Path, help="where to write the figures as JSON")
    parser.add_argument("--dir", type=Path, help="where to work (default: a temporary directory)")
    args = parser.parse_args()
    if not args.ranks or min(args.ranks) < 1:
        parser.error(f"--ranks: expected positive integers, got {args.ranks}")
    results: dict[str, Any] = {
        "cpu": cpu_model(),
        "cpus": os.cpu_count(),
        "steps": STEPS,
        "runs": [],
        "rows": [],
    }
    started = time.perf_counter()
    with work_directory("plan_memory_", args.dir) as work:
        for model in MODELS:
            print(f"== {model.name}: generating its dataset ...", flush=True)
            data = build_dataset(model, work)
            for ranks in args.ranks:
                print(f"  {ranks} rank(s): dry run, then {STEPS} steps of main.py ...", flush=True)
                predicted = predict(model, data, ranks, work)
                measured = train(model, data, ranks, work)
                results["runs"].append({"model": model.name, "ranks": ranks, **measured})
                results["rows"] += compare(model, ranks, predicted, measured)
                results["wall_s"] = time.perf_counter() - started
                if args.output:
                    save(results, args.output)
        print_table(results["rows"])
        for run in results["runs"]:
            check = run["summary_peak_memory_bytes"] / run["peak_rss_bytes"][0] - 1
            print(
                f"{run['model']} on {run['ranks']}: rank 0's summary reports "
                f"{run['summary_peak_memory_bytes']:,} B ({run['summary_peak_memory_of']}, "
                f"{check:+.1%} from the sampled peak)"
            )
    written = f"; wrote {args.output}" if args.output else ""
    print(f"\n{time.perf_counter() - started:.0f} s{written}")
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except (RuntimeError, subprocess.SubprocessError) as error:
        print(f"plan_memory: {error}", file=sys.stderr)
        sys.exit(1)
