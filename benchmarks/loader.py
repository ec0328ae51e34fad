"""Loader throughput: samples/s of one rank reading a 26-table dataset from page cache.

    python benchmarks/loader.py [--dataset_path DIR] [--rows 4000000]
        [--global_batch_size 65536] [--world_size 1] [--input_mode model_parallel]
        [--check_batch_sizes 8192,65536] [--train_steps N]
        [--multi_hot_rows 400000] [--multi_hot_batch_size 8192]

Without --dataset_path, a synthetic Criteo-shaped dataset (13 numerical, 26
tables) is generated in a temporary directory first. Files are read once before
timing so that the figure is the page-cache rate, not the disk's.

Also prints the cost of the per-batch id check (ids in [0, cardinality)): loader
samples/s with the check on and off, the check's own time per global batch (every
table, every row of the batch: the sum over ranks) for each of
`--check_batch_sizes`, and that time as a share of a training step of the default
fp32 model at batch 8192. The step is measured over `--train_steps` steps (by
default 5 on generated data; 0, the default with --dataset_path, whose tables may
be too big to build here, compares with the reference 9,300 samples/s instead).

Then compares multi-hot reading on two generated datasets of `--multi_hot_rows`
rows and 26 tables: every table with 8 ids per row (fixed hotness, `[B, 8]`
per table), and every table with a variable number, 0 to 16 (8 on average),
read as ragged ids (values plus offsets).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

from benchmarks.common import integers, parser_for, work_directory
from dataloading.files import SplitBinaryFiles, check_id_rows
from dataloading.split_binary import InputMode, ShardSpec, SplitBinaryDataset
from dataloading.synthetic import generate_split_binary
from feature_spec import FeatureSpec

# fp32 training samples/s of the default model at batch 8192 on the project's
# 2-core reference machine, for when no step is measured.
REFERENCE_TRAIN_SAMPLES_PER_SECOND = 9300.0
STEP_BATCH_SIZE = 8192


MULTI_HOT_TABLES = 26
MULTI_HOT_IDS = 8  # per row and table: fixed, or the mean of 0 to 2 x this


def warm_page_cache(spec: FeatureSpec, mapping: str) -> int:
    files = spec.files(mapping)
    total = 0
    paths = [files.label, files.numerical, *files.categorical.values(), *files.offsets.values()]
    for path in paths:
        if path is not None:
            total += len(path.read_bytes())
    return total


def measure(dataset: SplitBinaryDataset, epochs: int) -> tuple[float, int]:
    """Best samples/s over `epochs` passes (global-batch samples, as a trainer counts)."""
    tf_dataset = dataset.to_tf_dataset()
    best = 0.0
    for _ in range(epochs):
        start = time.perf_counter()
        batches = 0
        for _batch in tf_dataset:
            batches += 1
        elapsed = time.perf_counter() - start
        best = max(best, batches * dataset.shard.global_batch_size / elapsed)
    return best, batches


def time_id_check(
    spec: FeatureSpec,
    mapping: str,
    batch_size: int,
    tables: tuple[int, ...] | None = None,
    batches: int = 8,
) -> float:
    """Median seconds of the per-batch id check of `batch_size` rows of `tables`
    (default: every table, what all ranks together spend on a global batch)."""
    files = SplitBinaryFiles.open(spec, mapping)
    categorical = spec.categorical_features
    tables = tuple(range(len(categorical))) if tables is None else tables
    maps = {t: files.categorical[categorical[t].name].memmap() for t in tables}
    times = []
    for index in range(max(1, min(batches, files.rows // batch_size))):
        start = index * batch_size
        # In memory, as read_batch has them when it checks.
        columns = {t: np.array(m[start : start + batch_size]) for t, m in maps.items()}
        for _ in range(5):
            begin = time.perf_counter()
            for t, column in columns.items():
                feature = categorical[t]
                check_id_rows(column, start, files.categorical[feature.name], feature, t)
            times.append(time.perf_counter() - begin)
    return float(np.median(times))


def compare_multi_hot(directory: Path, rows: int, batch_size: int, epochs: int) -> None:
    """Prints loader samples/s and ids/s for fixed and variable-length multi-hot."""
    cardinalities = (100_000,) * MULTI_HOT_TABLES
    shapes = {"fixed": MULTI_HOT_IDS, "variable-length": 0}
    rates = {}
    for name, hotness in shapes.items():
        path = directory / name
        print(f"generating {rows:,} rows x {MULTI_HOT_TABLES} {name} tables ...", flush=True)
        shape = {
            "hotness": (hotness,) * MULTI_HOT_TABLES,
            "max_variable_hotness": 2 * MULTI_HOT_IDS,
        }
        generate_split_binary(path, cardinalities, rows={"train": rows}, seed=0, **shape)
        spec = FeatureSpec.load(path)
        warm_page_cache(spec, "train")
        files = SplitBinaryFiles.open(spec, "train")
        ids = sum(f.rows * int(np.prod(f.row_shape)) for f in files.categorical.values())
        dataset = SplitBinaryDataset(spec, "train", ShardSpec(batch_size))
        rate, _ = measure(dataset, epochs)
        rates[name] = rate
        print(
            f"loader, {name} multi-hot ({ids / rows:.1f} ids per row over {MULTI_HOT_TABLES} "
            f"tables, batch {batch_size}): {rate:,.0f} samples/s = "
            f"{rate * ids / rows / 1e6:,.1f} M ids/s"
        )
    print(
        f"variable-length / fixed: {rates['variable-length'] / rates['fixed']:.2f} "
        f"(samples/s, same mean ids per row)"
    )


def parse_args() -> argparse.Namespace:
    parser = parser_for(__doc__)
    parser.add_argument("--dataset_path", type=Path)
    parser.add_argument("--rows", type=int, default=4_000_000)
    parser.add_argument("--global_batch_size", type=int, default=65536)
    parser.add_argument("--world_size", type=int, default=1)
    parser.add_argument(
        "--input_mode", choices=[m.value for m in InputMode], default=InputMode.MODEL_PARALLEL.value
    )
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument(
        "--check_batch_sizes",
        type=integers,
        default=[8192, 65536],
        help="global batch sizes at which to time the id check alone",
    )
    parser.add_argument(
        "--train_steps",
        type=int,
        help="training steps timed to compare the id check with (0: compare with the "
        "reference 9,300 samples/s); default 5 on generated data, 0 with --dataset_path",
    )
    parser.add_argument("--multi_hot_rows", type=int, default=400_000, help="0: skip")
    parser.add_argument("--multi_hot_batch_size", type=int, default=8192)
    args = parser.parse_args()
    if args.train_steps is None:
        args.train_steps = 0 if args.dataset_path is not None else 5
    return args


def main() -> None:
    args = parse_args()
    with work_directory("bench_loader_") as work:
        path = args.dataset_path
        if path is None:
            path = work / "bench"
            print(f"generating {args.rows:,} rows x 26 tables in {path} ...", flush=True)
            generate_split_binary(path, rows={"train": args.rows}, seed=0)
        spec = FeatureSpec.load(path)
        tables = len(spec.categorical_features)
        mode = InputMode(args.input_mode)
        local_tables = (
            tuple(range(0, tables, args.world_size)) if mode == InputMode.MODEL_PARALLEL else None
        )
        shard = ShardSpec(args.global_batch_size, 0, args.world_size, local_tables, mode)
        rates = compare_id_check(spec, shard, args.epochs)
        # The check's own time is a steadier figure than the on/off difference of two
        # throughputs, which varies with the machine's load.
        check_seconds = time_id_check(spec, "train", args.global_batch_size, local_tables)
        loader_seconds = args.global_batch_size / rates[True]
        print(
            f"loader without the id check: {rates[False]:,.0f} samples/s (on/off difference "
            f"{100 * (1 - rates[True] / rates[False]):+.1f} %); the check alone takes "
            f"{check_seconds * 1e3:.3f} ms of the loader's {loader_seconds * 1e3:.1f} ms per "
            f"batch ({100 * check_seconds / loader_seconds:.1f} %)"
        )
        steps = training_steps(path, args.train_steps)
        for batch_size in args.check_batch_sizes:
            print_id_check_share(spec, batch_size, steps)
        if args.multi_hot_rows > 0:
            compare_multi_hot(work, args.multi_hot_rows, args.multi_hot_batch_size, args.epochs)


def compare_id_check(spec: FeatureSpec, shard: ShardSpec, epochs: int) -> dict[bool, float]:
    """Prints the loader's samples/s with the id check; returns it with the
    check on (True) and off (False)."""
    size = warm_page_cache(spec, "train")
    datasets = {
        check: SplitBinaryDataset(spec, "train", shard, check_batch_ids=check)
        for check in (True, False)
    }
    rates = dict.fromkeys(datasets, 0.0)
    for _ in range(epochs):  # alternated, so that both see the same machine load
        for check, dataset in datasets.items():
            epoch_rate, batches = measure(dataset, 1)
            rates[check] = max(rates[check], epoch_rate)
    rate = rates[True]
    print(
        f"loader: {rate:,.0f} samples/s  ({rate / 1e6:.2f} M samples/s; rank 0 of "
        f"{shard.world_size}, {shard.input_mode.value} input, {len(dataset.tables)}/"
        f"{len(spec.categorical_features)} tables, global batch {shard.global_batch_size}, "
        f"{batches} batches/epoch, {size / 2**20:,.0f} MiB in page cache, {os.cpu_count()} "
        f"CPUs, TensorFlow {tf.__version__}, numpy {np.__version__})"
    )
    return rates


def training_steps(path: Path, train_steps: int) -> dict[str, float]:
    """Prints and returns the seconds of a training step at STEP_BATCH_SIZE: the
    reference's, and one measured here over `train_steps` steps (if any)."""
    from benchmarks.train import time_variant

    steps = {"reference": STEP_BATCH_SIZE / REFERENCE_TRAIN_SAMPLES_PER_SECOND}
    if train_steps > 0:
        rate, _ = time_variant(path, STEP_BATCH_SIZE, False, False, train_steps, warmup=2)
        steps["measured"] = STEP_BATCH_SIZE / rate
    print(
        f"training step (default model, fp32, batch {STEP_BATCH_SIZE}): "
        + "; ".join(
            f"{name} {seconds * 1e3:,.0f} ms ({STEP_BATCH_SIZE / seconds:,.0f} samples/s)"
            for name, seconds in steps.items()
        )
        + (f" (measured over {train_steps} steps)" if train_steps > 0 else "")
    )
    return steps


def print_id_check_share(spec: FeatureSpec, batch_size: int, steps: dict[str, float]) -> None:
    """The id check's time on every table at `batch_size`, as a share of each step."""
    seconds = time_id_check(spec, "train", batch_size)
    # A step's time grows about linearly with the batch at these sizes.
    scale = batch_size / STEP_BATCH_SIZE
    shares = ", ".join(
        f"{100 * seconds / (step * scale):.2g} % of a {name} step" for name, step in steps.items()
    )
    print(
        f"id check, {len(spec.categorical_features)} tables x {batch_size:,} rows: "
        f"{seconds * 1e3:.3f} ms per global batch = {shares}"
        + ("" if scale == 1 else " (step scaled linearly to this batch)")
    )


if __name__ == "__main__":
    main()
