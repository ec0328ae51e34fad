"""Training throughput of the default DLRM on this machine, per precision/XLA setting.

    python benchmarks/train.py [--batch_size 8192] [--steps 12] [--warmup 3]
        [--variants fp32,amp,xla,amp+xla] [--interactions dot,cross] [--np N]
        [--output results.json]

Generates a synthetic Criteo-shaped dataset (13 numerical, 26 tables) in a
temporary directory, builds the default model (bottom 512-256-128, embedding
dim 128, top 1024-1024-512-256-1, SGD) exactly as `main.py` does, with the dot
interaction and with the default DCNv2 cross network (3 layers, projection
512, as MLPerf's DLRM-DCNv2), and times
`--steps` training steps after `--warmup` untimed ones (tracing, XLA
compilation). Prints samples/s and the achieved GFLOP/s of the dense part
next to the machine's matmul GFLOP/s, measured in the same run, so the figures
say how far from the hardware's peak a step runs.

With `--np N` it then runs the fp32 model hybrid-parallel under
`horovodrun --gloo -np N` (and as one process, for comparison) and prints
samples/s per rank count with what the collectives cost a step
(`benchmarks/collective_time.py`): the time in it in which a rank ran no op,
waiting on them (exposed; a profiler trace of each rank), and the time in which
some collective was executing or in flight (Horovod's timeline).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere
os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")

import tensorflow as tf

from benchmarks.collective_time import exposed, idle_seconds, timeline_seconds
from benchmarks.common import (
    VARIANTS,
    parser_for,
    run_checked,
    save,
    variants,
    work_directory,
)
from dataloading.split_binary import ShardSpec, SplitBinaryDataset
from dataloading.synthetic import generate_split_binary
from dlrm.app.assembly import AssembledRun, assemble_run, model_config_for
from dlrm.app.config import RunConfig
from dlrm.app.reporting import MetricsLog
from dlrm.distributed.collectives import Collectives, create_collectives
from dlrm.model.config import dense_training_flops
from dlrm.train import precision
from dlrm.train.trainer import REQUESTS, Trainer
from feature_spec import FeatureSpec
from harness.processes import on_ranks

# The matmul whose best speed the achieved GFLOP/s are set against.
PEAK_SIZE = 2048
PEAK_REPEATS = 6


def matmul_gflops(dtype: tf.DType) -> float:
    """Best GFLOP/s of a 2048^3 matmul in `dtype`, the peak the figures are set against."""
    return precision.matmul_gflops(dtype, size=PEAK_SIZE, repeats=PEAK_REPEATS)


def assembled_trainer(
    config: RunConfig, collectives: Collectives | None = None
) -> tuple[AssembledRun, Trainer]:
    """The run `main.py` assembles for `config` (its messages discarded), and its trainer."""
    assembled = assemble_run(config, MetricsLog(None, None, console=io.StringIO()), collectives)
    assert assembled.trainer is not None  # mode "train" has one
    return assembled, assembled.trainer


def time_variant(
    dataset: Path,
    batch_size: int,
    amp: bool,
    xla: bool,
    steps: int,
    warmup: int,
    interaction: str = "dot",
) -> tuple[float, float]:
    """(samples/s, final loss) of `steps` timed steps of the default model."""
    settings = {"batch_size": batch_size, "amp": amp, "xla": xla, "interaction": interaction}
    config = RunConfig(dataset_path=str(dataset), **settings)
    assembled, trainer = assembled_trainer(config)
    data = SplitBinaryDataset(assembled.spec, "train", ShardSpec(batch_size))
    batches = list(data.to_tf_dataset().take(steps + warmup))
    for batch in batches[:warmup]:
        trainer.train_step(batch).numpy()
    start = time.perf_counter()
    loss = None
    for batch in batches[warmup:]:
        loss = trainer.train_step(batch)
    final = float(loss.numpy()) if loss is not None else float("nan")
    elapsed = time.perf_counter() - start
    return steps * batch_size / elapsed, final


def worker_config(
    dataset: Path, batch_size: int, amp: bool, train_flags: Sequence[str] = ()
) -> RunConfig:
    """The worker's run: the default model, or dlrm-train's `train_flags` (a
    flagfile among them) with the dataset, batch size and precision given."""
    if not train_flags:
        return RunConfig(dataset_path=str(dataset), batch_size=batch_size, amp=amp)
    from absl import flags

    from dlrm.app.flags import config_from_flags, resolve_flagfiles

    argv = [*resolve_flagfiles(train_flags), f"--dataset_path={dataset}"]
    argv += [f"--batch_size={batch_size}", *["--amp"] * amp]
    flags.FLAGS.unparse_flags()
    flags.FLAGS(["worker", *argv])
    return config_from_flags()


def train_steps(trainer: Trainer, batches: Sequence[Any], then: Any = None) -> None:
    """A step of each batch, each naming the one after it (the last, `then`), as
    main.py's loop does: where the ids cross between the ranks, the next batch's
    then cross during this step (`Trainer.train_step_agreeing`)."""
    for position, batch in enumerate(batches):
        following = batches[position + 1] if position + 1 < len(batches) else then
        trainer.train_step_agreeing(batch, [False] * len(REQUESTS), following)[0].numpy()


def rank_worker(
    dataset: Path,
    batch_size: int,
    steps: int,
    warmup: int,
    output: Path,
    amp: bool = False,
    train_flags: Sequence[str] = (),
) -> None:
    """One rank of the `--np` measurement (under horovodrun, or alone): times
    `steps` training steps, then traces as many with the TensorFlow profiler for
    the time in them in which the rank ran no op (`collective_time.idle_seconds`);
    rank 0 writes every rank's figures to `output` as JSON."""
    collectives = create_collectives()
    config = worker_config(dataset, batch_size, amp, train_flags)
    assembled, trainer = assembled_trainer(config, collectives)
    data = SplitBinaryDataset(assembled.spec, "train", assembled.shard(batch_size))
    batches = list(data.to_tf_dataset().take(steps + warmup))
    timed = batches[warmup:]
    # Each step names the next, across the barriers too: a timed step's ids never
    # cross alone, as none of a long run's do but its first. (Where no ids cross,
    # naming one changes nothing.)
    train_steps(trainer, batches[:warmup], then=timed[0])
    collectives.barrier()
    start = time.perf_counter()
    train_steps(trainer, timed, then=timed[0])
    elapsed = time.perf_counter() - start
    trace = output.parent / f"{output.stem}_profile_rank{collectives.rank}"
    collectives.barrier()
    tf.profiler.experimental.start(str(trace))
    # The last step names a batch too, so that every traced step runs the step the
    # timed ones ran, not a step function traced anew.
    train_steps(trainer, timed, then=timed[0])
    tf.profiler.experimental.stop()
    idle, traced, traced_steps = idle_seconds(trace)
    mine = {
        "seconds": elapsed,
        "idle_seconds": idle,
        "traced_seconds": traced,
        "traced_steps": traced_steps,
        "cpus": list(collectives.bound_cpus) if collectives.bound_cpus else None,
    }
    ranks = collectives.allgather_object(mine, name="benchmark_ranks")
    if collectives.rank == 0:
        plan = assembled.plan.to_dict() if assembled.plan is not None else None
        result = {
            "world_size": collectives.world_size,
            "ranks": ranks,
            "plan": plan,
            "dense_chunk_rows": trainer.dense_chunk_rows,
        }
        output.write_text(json.dumps(result) + "\n")


def worker_command(
    dataset: Path,
    batch_size: int,
    steps: int,
    warmup: int,
    output: Path,
    amp: bool = False,
    train_flags: Sequence[str] = (),
) -> list[str]:
    """One rank of the `--np` measurement (`rank_worker`) as a command."""
    flags = [f"--batch_size={batch_size}", f"--steps={steps}", f"--warmup={warmup}"]
    flags += [f"--output={output}", *["--amp"] * amp]
    flags += [f"--train_flag={flag}" for flag in train_flags]
    return [sys.executable, str(Path(__file__).resolve()), f"--worker={dataset}", *flags]


def measure_ranks(
    dataset: Path,
    world_size: int,
    batch_size: int,
    steps: int,
    warmup: int,
    work: Path,
    amp: bool = False,
) -> dict:
    """Runs `rank_worker` on `world_size` processes (one plain process for 1);
    adds the seconds the timed steps' collectives spent executing and in flight,
    from the Horovod timeline (`collective_time.timeline_seconds`)."""
    output = work / f"ranks_{world_size}.json"
    timeline = work / f"timeline_{world_size}.json"
    command = worker_command(dataset, batch_size, steps, warmup, output, amp)
    env = {"HOROVOD_TIMELINE": str(timeline)} if world_size > 1 else {}
    run_checked(on_ranks(world_size, command), env=env)
    figures = json.loads(output.read_text())
    figures["executing_seconds"] = figures["in_flight_seconds"] = 0.0
    if world_size > 1:
        # A step's first collective is its first chunk's vectors' alltoall; the
        # timeline also holds the profiled steps after the timed ones.
        executing, in_flight = timeline_seconds(timeline, 2 * steps, "embedding_vectors")
        figures["executing_seconds"] = executing / 2
        figures["in_flight_seconds"] = in_flight / 2
    return figures


def per_step(result: dict, steps: int) -> dict[str, Any]:
    """Seconds per step from `measure_ranks`' result: the slowest rank's step,
    the ranks' mean time in it without any op running (exposed collectives; its
    share, and each rank's), and the collectives' time executing and in flight
    (Horovod's timeline; 0 where there is none)."""
    ranks = result["ranks"]
    waiting = exposed(ranks)
    return {
        "step": max(r["seconds"] for r in ranks) / steps,
        "exposed": waiting["seconds"],
        "exposed_share": waiting["share"],
        "per_rank_share": waiting["per_rank_share"],
        "executing": result.get("executing_seconds", 0.0) / steps,
        "in_flight": result.get("in_flight_seconds", 0.0) / steps,
    }


def parse_args() -> argparse.Namespace:
    parser = parser_for(__doc__)
    parser.add_argument("--batch_size", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--variants", type=variants, default=",".join(VARIANTS))
    parser.add_argument(
        "--interactions", default="dot,cross", help="dot, cross or both (default: both)"
    )
    parser.add_argument(
        "--np",
        type=int,
        default=0,
        help="also compare 1 and N ranks under horovodrun (fp32), with the collectives' share",
    )
    parser.add_argument("--output", type=Path, help="also write the results as JSON")
    parser.add_argument("--worker", type=Path, help=argparse.SUPPRESS)  # one rank of --np
    parser.add_argument("--amp", action="store_true", help=argparse.SUPPRESS)  # of --worker
    # Of --worker: a dlrm-train flag of the model to train instead of the default.
    parser.add_argument("--train_flag", action="append", default=[], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.np == 1 or args.np < 0:
        parser.error(f"--np: expected 0 (off) or >= 2 ranks, got {args.np}")
    if args.np and args.batch_size % args.np:
        parser.error(f"--batch_size {args.batch_size}: must divide by --np {args.np}")
    interactions = [i for i in args.interactions.split(",") if i]
    if not interactions or any(i not in ("dot", "cross") for i in interactions):
        parser.error(f"--interactions: expected dot, cross or both, got {args.interactions!r}")
    args.interactions = interactions
    return args


def main() -> int:
    args = parse_args()
    if args.worker:
        rank_worker(
            args.worker,
            args.batch_size,
            args.steps,
            args.warmup,
            args.output,
            args.amp,
            args.train_flag,
        )
        return 0
    peaks = {"float32": matmul_gflops(tf.float32), "bfloat16": matmul_gflops(tf.bfloat16)}
    print(
        f"matmul 2048^3 on this machine: float32 {peaks['float32']:.1f} GFLOP/s, "
        f"bfloat16 {peaks['bfloat16']:.1f} GFLOP/s ({os.cpu_count()} CPUs)"
    )
    results: dict[str, Any] = {"batch_size": args.batch_size}
    results |= {f"matmul_gflops_{name}": gflops for name, gflops in peaks.items()}
    results["variants"] = {}
    with work_directory("bench_train_") as work:
        dataset = work / "data"
        rows = args.batch_size * (args.steps + args.warmup)
        generate_split_binary(dataset, num_numerical=13, rows={"train": rows, "test": 1}, seed=0)
        flops = flops_per_interaction(dataset, args)
        results["mflop_per_sample"] = {k: v / 1e6 for k, v in flops.items()}
        results["variants"] = time_variants(dataset, args, flops, peaks)
        if args.np:
            results["ranks"] = compare_ranks(dataset, args, work)
    if args.output:
        save(results, args.output)
    return 0


def flops_per_interaction(dataset: Path, args: argparse.Namespace) -> dict[str, float]:
    """Prints and returns the dense FLOP per sample of each interaction's model."""
    spec = FeatureSpec.load(dataset / "feature_spec.yaml")
    flops = {}
    for interaction in args.interactions:
        # The model main.py builds with the default flags and this interaction.
        config = RunConfig(dataset_path=str(dataset), interaction=interaction)
        flops[interaction] = dense_training_flops(model_config_for(spec, config))
        print(
            f"default model, {interaction} interaction, {len(spec.cardinalities)} tables, "
            f"batch {args.batch_size}: {flops[interaction] / 1e6:.2f} MFLOP per sample per "
            "training step (dense part)"
        )
    return flops


def time_variants(
    dataset: Path, args: argparse.Namespace, flops: dict[str, float], peaks: dict[str, float]
) -> dict[str, dict[str, float]]:
    """Prints and returns samples/s, GFLOP/s and the loss per variant and interaction."""
    print(
        f"{'variant':<8} {'interaction':<11} {'samples/s':>11} {'GFLOP/s':>8} "
        f"{'of matmul':>9} {'loss':>8}"
    )
    figures = {}
    for name in args.variants:
        for interaction in args.interactions:
            amp, xla = VARIANTS[name]
            samples_per_second, loss = time_variant(
                dataset, args.batch_size, amp, xla, args.steps, args.warmup, interaction
            )
            achieved = samples_per_second * flops[interaction] / 1e9
            peak = peaks["bfloat16" if amp else "float32"]
            print(
                f"{name:<8} {interaction:<11} {samples_per_second:>11,.0f} {achieved:>8.1f} "
                f"{achieved / peak:>8.0%} {loss:>8.4f}",
                flush=True,
            )
            key = name if interaction == "dot" else f"{name}/cross"
            figures[key] = {
                "samples_per_second": samples_per_second,
                "gflops": achieved,
                "loss": loss,
            }
    return figures


def compare_ranks(dataset: Path, args: argparse.Namespace, work: Path) -> dict:
    """Prints and returns samples/s and what the collectives cost, for 1 and --np ranks."""
    print(
        f"\nhybrid parallel, fp32, global batch {args.batch_size}, {args.steps} timed steps "
        f"(horovodrun --gloo on localhost, {os.cpu_count()} CPUs shared by all ranks)"
    )
    print(
        f"{'ranks':>5} {'samples/s':>11} {'step ms':>8} {'exposed ms':>11} {'share':>6}"
        f" {'executing ms':>13} {'in flight ms':>13}  plan"
    )
    figures = {}
    for world_size in (1, args.np):
        result = measure_ranks(dataset, world_size, args.batch_size, args.steps, args.warmup, work)
        times = per_step(result, args.steps)
        kinds = dict(Counter(table["kind"] for table in (result["plan"] or {}).get("tables", [])))
        plan = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())) or "-"
        step = times["step"]
        print(
            f"{world_size:>5} {args.batch_size / step:>11,.0f} {1000 * step:>8.1f} "
            f"{1000 * times['exposed']:>11.1f} {times['exposed_share']:>6.0%} "
            f"{1000 * times['executing']:>13.1f} {1000 * times['in_flight']:>13.1f}  {plan}",
            flush=True,
        )
        figures[str(world_size)] = {
            "samples_per_second": args.batch_size / step,
            "step_seconds": step,
            "exposed_seconds_per_step": times["exposed"],
            "exposed_share": times["exposed_share"],
            "executing_seconds_per_step": times["executing"],
            "in_flight_seconds_per_step": times["in_flight"],
            "per_rank": result["ranks"],
            "plan_kinds": kinds,
        }
    return figures


if __name__ == "__main__":
    sys.exit(main())
