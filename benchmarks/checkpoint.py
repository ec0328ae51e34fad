"""Restoring a checkpoint on another number of ranks: peak memory and verification time.

    python benchmarks/checkpoint.py [--gib 2] [--dir PARENT] [--chunk_mib 64] [--json PATH]

Writes a checkpoint with one float32 table of about --gib GiB ([rows, 128]) as two
column shards, as 2 ranks write it (in row blocks, from memory maps, so writing
needs no table-sized buffer). Then, each in a fresh process so that its peak RSS is
its own, restores with `Checkpoint.restore_table_slice` into a preallocated array
the slice that rank 0 holds under:

- `row_wise_3`: rows [0, ceil(R / 3)) of 3 ranks, all columns: a resharding
  restore that reads part of both shard files (and verifies both, in full);
- `column_wise_2`: columns [0, 64) of 2 ranks, the layout it was written with:
  reads, and verifies, one of the two shard files.

For each it reports the peak RSS (ru_maxrss) and its increase over the RSS once
the target array is allocated and touched, the time to open the checkpoint and
restore the slice (verifying what it reads on first use), the time to verify just
the files that rank reads, and the time of `verify()` of every file. The restored
values are checked. numpy only (no TensorFlow). Everything is written in a new
directory under --dir (default: the system's temporary directory), deleted at the end.
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

import numpy as np

from benchmarks.common import (
    add_output_flags,
    last_json_line,
    parser_for,
    run_checked,
    save,
    work_directory,
)
from dlrm.checkpoint.reader import Checkpoint
from dlrm.checkpoint.writer import CheckpointWriter
from dlrm.embedding.shard import ShardingKind, TableShard

DIM = 128
BLOCK_ROWS = 1 << 17  # rows generated, or checked, at a time (32-64 MiB of float32)


def expected_values(rows: tuple[int, int], columns: tuple[int, int]) -> np.ndarray:
    """Table values that float32 holds exactly: (r mod 2^16) * 128 + c < 2^24."""
    row_part = (np.arange(*rows, dtype=np.int64) % 65536) * DIM
    return (row_part[:, None] + np.arange(*columns, dtype=np.int64)[None, :]).astype(np.float32)


def write_checkpoint(root: Path, rows: int, work: Path) -> tuple[Path, float]:
    """Two column shards written by 'ranks' 0 and 1; returns the directory and seconds."""
    start = time.perf_counter()
    writers = [CheckpointWriter(root, 1), CheckpointWriter(root, 1, create=False)]
    writers[0].add_dense({"trainer/step": np.asarray(1, np.int64)})
    half = DIM // 2
    for rank, writer in enumerate(writers):
        shard = TableShard(
            0, ShardingKind.COLUMN_WISE, rank, (0, rows), (rank * half, (rank + 1) * half)
        )
        source = work / f"source_{rank}.npy"
        values = np.lib.format.open_memmap(source, mode="w+", dtype=np.float32, shape=(rows, half))
        for block in range(0, rows, BLOCK_ROWS):
            stop = min(block + BLOCK_ROWS, rows)
            values[block:stop] = expected_values((block, stop), shard.columns)
        values.flush()
        writer.add_table_shard(shard, (rows, DIM), values, {})
        del values
        source.unlink()
    path = writers[0].commit({}, gathered=[writer.contents() for writer in writers])
    return path, time.perf_counter() - start


def resident_bytes() -> int:
    """The current RSS, from /proc/self/statm."""
    pages = int(Path("/proc/self/statm").read_text().split()[1])
    return pages * resource.getpagesize()


def peak_resident_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def restore(
    path: Path, rows: tuple[int, int], columns: tuple[int, int], chunk_bytes: int
) -> dict[str, Any]:
    """Runs in a fresh process: what one rank does, measured."""
    target = np.empty((rows[1] - rows[0], columns[1] - columns[0]), np.float32)
    target.fill(0)  # touch every page, as a variable's memory is
    rss_allocated = resident_bytes()
    peak_allocated = peak_resident_bytes()

    def assign(offset: int, chunk: np.ndarray) -> None:
        target[offset : offset + len(chunk)] = chunk

    start = time.perf_counter()
    checkpoint = Checkpoint(path)
    opened = time.perf_counter()
    checkpoint.restore_table_slice(0, rows, columns, assign, block_bytes=chunk_bytes)
    restored = time.perf_counter()
    peak = peak_resident_bytes()

    files = sorted(checkpoint.verified_files)
    sizes = {name: int(entry["bytes"]) for name, entry in checkpoint.manifest["files"].items()}
    verify_start = time.perf_counter()
    Checkpoint(path).verify(files)
    verify_rank = time.perf_counter() - verify_start
    verify_start = time.perf_counter()
    Checkpoint(path).verify()
    verify_all = time.perf_counter() - verify_start

    for block in range(rows[0], rows[1], BLOCK_ROWS):
        stop = min(block + BLOCK_ROWS, rows[1])
        if not np.array_equal(
            target[block - rows[0] : stop - rows[0]], expected_values((block, stop), columns)
        ):
            raise AssertionError(f"restored rows [{block}, {stop}) differ from what was written")
    return {
        "rows": list(rows),
        "columns": list(columns),
        "target_bytes": target.nbytes,
        "chunk_bytes": chunk_bytes,
        "files_read": files,
        "bytes_verified_by_rank": sum(sizes[name] for name in files),
        "rss_after_allocating_target_bytes": rss_allocated,
        "peak_rss_after_allocating_target_bytes": peak_allocated,
        "peak_rss_bytes": peak,
        "peak_rss_increase_bytes": peak - rss_allocated,
        "open_seconds": opened - start,
        "open_and_restore_seconds": restored - start,
        "verify_rank_files_seconds": verify_rank,
        "verify_all_files_seconds": verify_all,
    }


def run_child(job: dict[str, Any]) -> dict[str, Any]:
    """Runs `job` in a fresh process of this script. Writing happens in a child
    too: ru_maxrss survives fork and exec, so the parent stays small."""
    return last_json_line(run_checked([sys.executable, __file__, "--job", json.dumps(job)]))


def child_job(job: dict[str, Any]) -> dict[str, Any]:
    """What a child process does: write the checkpoint, or restore a slice of it."""
    if job["task"] == "write":
        path, seconds = write_checkpoint(Path(job["root"]), job["rows"], Path(job["work"]))
        return {"path": str(path), "seconds": seconds}
    rows, columns = tuple(job["rows"]), tuple(job["columns"])
    return restore(Path(job["path"]), rows, columns, job["chunk"])


def measure(work: Path, rows: int, chunk_bytes: int) -> dict[str, Any]:
    """Writes the checkpoint, then restores each scenario's slice, each in a child."""
    print(f"writing a [{rows}, {DIM}] float32 table as 2 column shards under {work}")
    job = {"task": "write", "root": str(work / "checkpoints"), "rows": rows, "work": str(work)}
    written = run_child(job)
    path = Path(written["path"])
    scenarios = {
        "row_wise_3": ((0, math.ceil(rows / 3)), (0, DIM)),
        "column_wise_2": ((0, rows), (0, DIM // 2)),
    }
    return {
        "table_shape": [rows, DIM],
        "checkpoint_bytes": sum(f.stat().st_size for f in path.rglob("*") if f.is_file()),
        "write_seconds": written["seconds"],
        "chunk_bytes": chunk_bytes,
        "scenarios": {
            name: run_child(
                {"task": "restore", "path": str(path), "rows": slice_rows}
                | {"columns": slice_columns, "chunk": chunk_bytes}
            )
            for name, (slice_rows, slice_columns) in scenarios.items()
        },
    }


def gib(count: float) -> str:
    return f"{count / 2**30:.2f} GiB"


def mib(count: float) -> str:
    return f"{count / 2**20:.0f} MiB"


# The table's lines: a label and each scenario's cell.
LINES = [
    ("rank 0 holds", lambda r: "rows [{}, {}) x cols [{}, {})".format(*r["rows"], *r["columns"])),
    ("target array", lambda r: gib(r["target_bytes"])),
    ("shard files read", lambda r: f"{len(r['files_read'])} of 2"),
    ("bytes verified by the rank", lambda r: gib(r["bytes_verified_by_rank"])),
    ("RSS after allocating target", lambda r: gib(r["rss_after_allocating_target_bytes"])),
    ("peak RSS before restoring", lambda r: gib(r["peak_rss_after_allocating_target_bytes"])),
    ("peak RSS (ru_maxrss)", lambda r: gib(r["peak_rss_bytes"])),
    ("peak RSS increase", lambda r: mib(r["peak_rss_increase_bytes"])),
    ("open (manifest only)", lambda r: f"{1000 * r['open_seconds']:.1f} ms"),
    ("open + restore (verifies)", lambda r: f"{r['open_and_restore_seconds']:.2f} s"),
    ("verify the rank's files", lambda r: f"{r['verify_rank_files_seconds']:.2f} s"),
    ("verify() every file", lambda r: f"{r['verify_all_files_seconds']:.2f} s"),
]


def print_figures(figures: dict[str, Any]) -> None:
    rows, _ = figures["table_shape"]
    print(
        f"checkpoint: {gib(figures['checkpoint_bytes'])} (table [{rows}, {DIM}] float32, 2 "
        f"column shards), written in {figures['write_seconds']:.1f} s with checksums; "
        f"restore chunk {mib(figures['chunk_bytes'])}"
    )
    results = figures["scenarios"]
    names = list(results)
    width = max(len(label) for label, _ in LINES)
    widths = [max(len(name), *(len(fmt(results[name])) for _, fmt in LINES)) for name in names]
    print(f"{'':{width}}  " + "  ".join(f"{n:>{w}}" for n, w in zip(names, widths, strict=True)))
    for label, fmt in LINES:
        cells = [f"{fmt(results[n]):>{w}}" for n, w in zip(names, widths, strict=True)]
        print(f"{label:{width}}  " + "  ".join(cells))


def main() -> None:
    parser = parser_for(__doc__)
    parser.add_argument("--gib", type=float, default=2.0, help="table size in GiB (float32)")
    parser.add_argument("--chunk_mib", type=float, default=64.0, help="restore chunk size")
    add_output_flags(parser)
    parser.add_argument("--job", help=argparse.SUPPRESS)  # what a child process does
    args = parser.parse_args()
    if args.job:
        print(json.dumps(child_job(json.loads(args.job))))
        return
    rows = math.ceil(args.gib * 2**30 / (DIM * 4))
    with work_directory("dlrm_checkpoint_benchmark_", args.dir) as work:
        figures = measure(work, rows, int(args.chunk_mib * 2**20))
    print_figures(figures)
    if args.json:
        save(figures, args.json, indent=1)


if __name__ == "__main__":
    main()
