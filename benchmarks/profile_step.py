"""Where a training step's time goes: a TensorFlow profiler trace, summed per op.

    python benchmarks/profile_step.py [--batch_size 8192] [--amp] [--xla] [--steps 3]
        [--top 25] [--trace_dir DIR] [--dense_chunk_rows 8192]

Assembles the default model (13 numerical features, 26 tables x 100,000 x 128,
bottom 512-256-128, top 1024-1024-512-256-1, SGD) and its `Trainer` as `main.py`
does on one process (`dlrm.app.assembly.assemble_run`, on a synthetic dataset of
that shape), feeds it one batch of uniformly random ids, runs a few steps
untraced, then traces `--steps` steps with `tf.profiler` and prints the ops with
the most time, summed over TensorFlow's compute threads and averaged per step,
with their share of all op time, and the same grouped by part of the model. The
trace stays in `--trace_dir` for TensorBoard's profile plugin.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import numpy as np
import tensorflow as tf

from benchmarks.collective_time import newest_trace
from benchmarks.common import ROWS_PER_TABLE, TABLES, parser_for, work_directory
from benchmarks.train import assembled_trainer
from dataloading.split_binary import Batch
from dataloading.synthetic import generate_split_binary
from dlrm.app.config import RunConfig
from dlrm.train.config import DEFAULT_CPU_DENSE_CHUNK_ROWS
from dlrm.train.trainer import Trainer

# Parts of the model, by the first of these words in an op's name (the
# interaction's backward ops are named outside its layer: its batched products
# and scatter are the only ones of their kind in the step).
PARTS = (
    ("interaction", "dot_interaction"),
    ("interaction", "DlrmDotInteraction"),
    ("interaction", "BatchMatMul"),
    ("interaction", "ScatterNd"),
    ("top MLP", "top_mlp"),
    ("bottom MLP", "bottom_mlp"),
    ("finite checks", "IsFinite"),
    ("lookup stack/unstack", "stack"),
    ("embedding gather/update", "Gather"),
    ("embedding gather/update", "Scatter"),
)


def part_of(name: str) -> str:
    for part, word in PARTS:
        if word in name:
            return part
    return "other"


def op_times(trace_dir: Path, steps: int) -> collections.Counter[str]:
    """Milliseconds per step of each op, summed over TensorFlow's compute threads."""
    _, space = newest_trace(trace_dir)
    times: collections.Counter[str] = collections.Counter()
    for plane in space.planes:
        for line in plane.lines:
            if not line.name.startswith("tf_Compute"):
                continue
            for event in line.events:
                name = plane.event_metadata[event.metadata_id].name
                if ":" not in name or "::" in name:  # executor scopes, not ops
                    continue
                times[name] += event.duration_ps / 1e9 / steps
    return times


def parse_args() -> argparse.Namespace:
    parser = parser_for(__doc__)
    parser.add_argument("--batch_size", type=int, default=8192)
    parser.add_argument("--amp", action="store_true")
    parser.add_argument("--xla", action="store_true")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument("--trace_dir", type=Path)
    parser.add_argument(
        "--use_kernels",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the project's CPU kernels, as main.py runs (default: on; under --xla all "
        "but the interaction's)",
    )
    parser.add_argument(
        "--dense_chunk_rows",
        type=int,
        default=DEFAULT_CPU_DENSE_CHUNK_ROWS,
        help="rows the dense part runs at a time, as main.py on CPUs (0: the whole batch)",
    )
    return parser.parse_args()


def default_trainer(args: argparse.Namespace, work: Path) -> Trainer:
    """The default model's trainer, as main.py assembles it with these settings
    (SGD at a constant learning rate of 0.1) for a dataset of its shape."""
    dataset = work / "data"
    generate_split_binary(dataset, [ROWS_PER_TABLE] * TABLES, rows={"train": 1}, seed=0)
    flags = ("batch_size", "amp", "xla", "use_kernels", "dense_chunk_rows")
    settings = {flag: getattr(args, flag) for flag in flags}  # RunConfig's fields
    config = RunConfig(dataset_path=str(dataset), learning_rate=0.1, warmup_steps=0, **settings)
    return assembled_trainer(config)[1]


def traced_step_ms(trainer: Trainer, batch: int, steps: int, trace_dir: Path) -> float:
    """Milliseconds per step of `steps` steps traced into `trace_dir`, after 3
    untraced, each on the same batch of uniformly random features, ids and labels."""
    rng = np.random.default_rng(0)
    data = Batch(
        tf.constant(rng.random((batch, 13), np.float32)),
        tf.constant(rng.integers(0, ROWS_PER_TABLE, (batch, TABLES), np.int32)),
        tf.constant(rng.integers(0, 2, (batch, 1)).astype(np.float32)),
        tf.ones([batch, 1]),
    )
    for _ in range(3):
        trainer.train_step(data).numpy()
    tf.profiler.experimental.start(str(trace_dir))
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_step(data).numpy()
    step_ms = (time.perf_counter() - start) / steps * 1000
    tf.profiler.experimental.stop()
    return step_ms


def print_times(times: collections.Counter[str], step_ms: float, batch: int, top: int) -> None:
    """The step's rate, then op time per part of the model, then the `top` ops."""
    total = sum(times.values())
    print(
        f"step {step_ms:,.0f} ms traced ({batch / step_ms * 1000:,.0f} samples/s); "
        f"op time summed over threads {total:,.0f} ms per step"
    )
    parts: collections.Counter[str] = collections.Counter()
    for name, ms in times.items():
        parts[part_of(name)] += ms
    for part, ms in parts.most_common():
        print(f"{ms:9.1f} ms {ms / total:6.1%}  {part}")
    print()
    for name, ms in times.most_common(top):
        print(f"{ms:9.1f} ms {ms / total:6.1%}  {name[-110:]}")


def main() -> int:
    args = parse_args()
    trace_dir = args.trace_dir or Path(tempfile.mkdtemp(prefix="dlrm_profile_"))
    with work_directory("profile_step_") as work:
        trainer = default_trainer(args, work)
        step_ms = traced_step_ms(trainer, args.batch_size, args.steps, trace_dir)
    print_times(op_times(trace_dir, args.steps), step_ms, args.batch_size, args.top)
    print(f"\ntrace: {trace_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
