"""Loader throughput: samples/s of one rank reading a 26-table dataset from page cache.

    python benchmarks/loader.py [--dataset_path DIR] [--rows 4000000]
        [--global_batch_size 65536] [--world_size 1] [--input_mode model_parallel]

Without --dataset_path, a synthetic Criteo-shaped dataset (13 numerical, 26
tables) is generated in a temporary directory first. Files are read once before
timing so that the figure is the page-cache rate, not the disk's.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

from dataloading.split_binary import InputMode, ShardSpec, SplitBinaryDataset
from dataloading.synthetic import generate_split_binary
from feature_spec import FeatureSpec


def warm_page_cache(spec: FeatureSpec, mapping: str) -> int:
    files = spec.files(mapping)
    total = 0
    for path in [files.label, files.numerical, *files.categorical.values()]:
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dataset_path", type=Path)
    parser.add_argument("--rows", type=int, default=4_000_000)
    parser.add_argument("--global_batch_size", type=int, default=65536)
    parser.add_argument("--world_size", type=int, default=1)
    parser.add_argument(
        "--input_mode", choices=[m.value for m in InputMode], default=InputMode.MODEL_PARALLEL.value
    )
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        path = args.dataset_path
        if path is None:
            path = Path(tmp) / "bench"
            print(f"generating {args.rows:,} rows x 26 tables in {path} ...", flush=True)
            generate_split_binary(path, rows={"train": args.rows}, seed=0)
        spec = FeatureSpec.load(path)
        size = warm_page_cache(spec, "train")
        tables = len(spec.categorical_features)
        mode = InputMode(args.input_mode)
        local_tables = (
            tuple(range(0, tables, args.world_size)) if mode == InputMode.MODEL_PARALLEL else None
        )
        shard = ShardSpec(args.global_batch_size, 0, args.world_size, local_tables, mode)
        dataset = SplitBinaryDataset(spec, "train", shard)
        rate, batches = measure(dataset, args.epochs)
        read_tables = len(dataset.tables)
        print(
            f"loader: {rate:,.0f} samples/s  ({rate / 1e6:.2f} M samples/s; rank 0 of "
            f"{args.world_size}, {mode.value} input, {read_tables}/{tables} tables, global batch "
            f"{args.global_batch_size}, {batches} batches/epoch, {size / 2**20:,.0f} MiB in "
            f"page cache, {os.cpu_count()} CPUs, TensorFlow {tf.__version__}, "
            f"numpy {np.__version__})"
        )


if __name__ == "__main__":
    main()
