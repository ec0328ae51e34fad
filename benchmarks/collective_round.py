"""What one round of collectives costs beyond its bytes: `dlrm-plan`'s
`collective_overhead_us` on this machine.

    python benchmarks/collective_round.py [--np 2] [--cycles_ms 3,1] [--ops 300]
        [--output results.json]

Under `horovodrun --gloo -np N` on localhost, each rank runs a one-value allreduce
and a one-value alltoall (each in a `tf.function`, as the training step calls them)
`--ops` times in a row, each waiting for the last, and rank 0 prints the mean time
of one. A value this small crosses in microseconds: what is left is Horovod's, a
collective taken up at its background thread's next cycle (`HOROVOD_CYCLE_TIME`;
3 ms is the CPU path's default, `dlrm.distributed.collectives.CPU_DEFAULTS`, 1 ms
Horovod's) and negotiated among the ranks before it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

from benchmarks.common import integers, parser_for, run_checked, save, work_directory
from harness.processes import horovodrun

WARMUP = 20


def rank_worker(ops: int, output: Path) -> None:
    """One rank: times `ops` allreduces, then `ops` alltoalls; rank 0 writes the
    mean seconds of each to `output`."""
    import horovod.tensorflow as hvd
    import tensorflow as tf

    from dlrm.distributed.collectives import set_horovod_defaults

    set_horovod_defaults()
    hvd.init()
    value = tf.constant([1.0])

    @tf.function
    def allreduce(x: tf.Tensor) -> tf.Tensor:
        return hvd.allreduce(x, op=hvd.Sum, name="round_allreduce")

    @tf.function
    def alltoall(x: tf.Tensor) -> tf.Tensor:
        return hvd.alltoall(tf.tile(x, [hvd.size()]), name="round_alltoall")

    seconds = {}
    for name, collective in (("allreduce", allreduce), ("alltoall", alltoall)):
        for _ in range(WARMUP):
            collective(value).numpy()
        start = time.perf_counter()
        for _ in range(ops):
            collective(value).numpy()
        seconds[name] = (time.perf_counter() - start) / ops
    if hvd.rank() == 0:
        output.write_text(json.dumps(seconds))


def main() -> int:
    parser = parser_for(__doc__)
    parser.add_argument("--np", type=int, default=2)
    parser.add_argument("--cycles_ms", type=integers, default=[3, 1])
    parser.add_argument("--ops", type=int, default=300)
    parser.add_argument("--output", type=Path, help="also write the figures as JSON")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # one rank
    args = parser.parse_args()
    if args.worker:
        rank_worker(args.ops, args.worker)
        return 0
    if args.np < 2:
        parser.error(f"--np: expected 2 or more ranks, got {args.np}")
    results = {}
    print(f"{'cycle ms':>8} {'allreduce ms':>12} {'alltoall ms':>11}   ({args.np} ranks)")
    with work_directory("collective_round_") as work:
        for cycle in args.cycles_ms:
            output = work / f"cycle_{cycle}.json"
            command = [horovodrun(), "--gloo", "-np", str(args.np), "-H", f"localhost:{args.np}"]
            command += [sys.executable, __file__, f"--ops={args.ops}", f"--worker={output}"]
            run_checked(command, env={"HOROVOD_CYCLE_TIME": str(cycle)})
            seconds = json.loads(output.read_text())
            results[f"{cycle} ms"] = seconds
            print(
                f"{cycle:>8} {1e3 * seconds['allreduce']:>12.2f} "
                f"{1e3 * seconds['alltoall']:>11.2f}",
                flush=True,
            )
    if args.output:
        save(results, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
