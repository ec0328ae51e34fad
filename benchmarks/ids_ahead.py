"""What exchanging the next batch's ids during this step gains, on shaped links.

    sudo python benchmarks/ids_ahead.py [--hosts 2] [--gbit 1,10] [--batch_size 4096]
        [--repeats 3] [--steps 8] [--warmup 3] [--output results.json]

Under `--input_mode data_parallel` each rank reads every table's ids of its own
rows, and an alltoall sends each rank the ids of the tables it holds. With
`--exchange_ids_ahead` (the default) that alltoall of the next batch runs during
this step's dense part; with `--noexchange_ids_ahead` each step starts with its own.
The results are the same bit for bit (tests/integration/test_id_exchange_ahead.py);
this measures the time.

The model is MLPerf's DLRM-DCNv2 scaled down (`dlrm/flagfiles/mlperf_dcnv2_small.flags`:
width 16, MLPerf's multi-hot sizes, 214 ids a row) with every table sharded
(`--data_parallel_threshold=0`), so that the ids a rank sends (856 bytes a row) are
half the bytes of its vectors: the case where the id exchange weighs most. (In the
default model, one id a table against 128-wide vectors, they are under 1 % of the
exchange.) On the simulated hosts of `shaped_links.py` (one rank each, links shaped
by `tc tbf`, root needed) it trains both ways in turn, `--repeats` times each,
the order alternating, and prints each pair's steps and their ratio, beside what
the dry run predicts for both (`python -m dlrm.planning`, this machine's measured
figures shared among the hosts).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.common import integers, parser_for, save, work_directory
from benchmarks.shaped_links import host_share, measure_link, measure_training, predict
from dataloading.synthetic import generate_split_binary
from feature_spec import CRITEO_1TB_MLPERF_CARDINALITIES, MLPERF_DCNV2_MULTI_HOT_SIZES
from harness.netns import NetnsCluster, install_reason

FLAGS = (
    "--flagfile=dlrm/flagfiles/mlperf_dcnv2_small.flags",
    "--input_mode=data_parallel",
    "--data_parallel_threshold=0",
)
MODES = {"ahead": "--exchange_ids_ahead", "own": "--noexchange_ids_ahead"}
TABLE_ROWS = 2_000  # the flagfile's dataset's tables


def parse_args() -> argparse.Namespace:
    parser = parser_for(__doc__)
    parser.add_argument("--hosts", type=integers, default=[2])
    parser.add_argument("--gbit", type=lambda t: [float(x) for x in t.split(",")], default=[1, 10])
    parser.add_argument("--batch_size", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--output", type=Path, help="also write the figures as JSON")
    args = parser.parse_args()
    for hosts in args.hosts:
        if hosts < 2 or args.batch_size % hosts:
            parser.error(f"--hosts {hosts}: expected 2 or more that divide --batch_size")
    if args.repeats < 1:
        parser.error(f"--repeats: expected 1 or more, got {args.repeats}")
    reason = install_reason()
    if reason is not None:
        parser.error(reason)
    return args


def main() -> int:
    args = parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # the namespaces go too
    from dlrm.planning.probe import local_device  # imports TensorFlow

    local = local_device()
    print(
        f"DCNv2 small, every table sharded, --input_mode data_parallel, batch "
        f"{args.batch_size}, one rank per host ({os.cpu_count()} CPUs shared); ms a step "
        "(the slowest rank's) with the ids exchanged ahead and in their own step"
    )
    print(
        f"{'hosts':>5} {'Gbit':>5} {'TCP':>6} {'pair':>4} {'ahead':>7} {'own':>7} "
        f"{'own/ahead':>9} {'exposed a/o':>13}"
    )
    runs: list[dict[str, Any]] = []
    with work_directory("ids_ahead_") as work:
        dataset = work / "data"
        generate_split_binary(
            dataset,
            [min(rows, TABLE_ROWS) for rows in CRITEO_1TB_MLPERF_CARDINALITIES],
            num_numerical=13,
            rows={"train": args.batch_size * (args.steps + args.warmup), "test": 1},
            hotness=MLPERF_DCNV2_MULTI_HOT_SIZES,
        )
        for hosts in args.hosts:
            with NetnsCluster(work / f"cluster{hosts}", hosts=hosts) as cluster:
                for gbit in args.gbit:
                    cluster.shape(gbit)
                    link = measure_link(cluster)
                    device = host_share(local, hosts, link)
                    predicted = {
                        mode: predict(dataset, args.batch_size, hosts, device, work, (*FLAGS, flag))
                        for mode, flag in MODES.items()
                    }
                    pairs = []
                    for repeat in range(args.repeats):
                        order = list(MODES) if repeat % 2 == 0 else list(reversed(MODES))
                        measured = {
                            mode: measure_training(
                                cluster, dataset, args.batch_size, args, work, (*FLAGS, MODES[mode])
                            )
                            for mode in order
                        }
                        pairs.append(measured)
                        ahead, own = measured["ahead"], measured["own"]
                        print(
                            f"{hosts:>5} {gbit:>5g} {link['gbit_s']:>6.2f} {repeat + 1:>4} "
                            f"{1e3 * ahead['step_s']:>7.1f} {1e3 * own['step_s']:>7.1f} "
                            f"{own['step_s'] / ahead['step_s']:>9.3f} "
                            f"{1e3 * ahead['exposed_s']:>6.1f}/{1e3 * own['exposed_s']:<6.1f}",
                            flush=True,
                        )
                    run = summarize(hosts, gbit, link, pairs, predicted)
                    runs.append(run)
                    print_summary(run)
                    if args.output:
                        save({"local_device": dataclasses.asdict(local), "runs": runs}, args.output)
    return 0


def summarize(
    hosts: int,
    gbit: float,
    link: dict[str, float],
    pairs: list[dict[str, dict[str, float]]],
    predicted: dict[str, dict[str, Any]],
) -> dict[str, Any]:
    """One world's pairs: the median step each way and of the pairs' ratios, and
    the dry run's steps and its ids' term each way."""
    ratios = [pair["own"]["step_s"] / pair["ahead"]["step_s"] for pair in pairs]
    steps = {mode: statistics.median(p[mode]["step_s"] for p in pairs) for mode in MODES}
    return {
        "hosts": hosts,
        "gbit_s": gbit,
        "link": link,
        "pairs": pairs,
        "median_step_s": steps,
        "median_ratio": statistics.median(ratios),
        "measured_saving_s": steps["own"] - steps["ahead"],
        "predicted_step_s": {mode: predicted[mode]["step_s"] for mode in MODES},
        "predicted_saving_s": predicted["own"]["step_s"] - predicted["ahead"]["step_s"],
        "predicted_ids_s": predicted["own"]["terms"]["alltoall_ids_s"],
        "predicted": predicted,
    }


def print_summary(run: dict[str, Any]) -> None:
    steps, predicted = run["median_step_s"], run["predicted_step_s"]
    print(
        f"      median: ahead {1e3 * steps['ahead']:.1f} ms, own {1e3 * steps['own']:.1f} ms, "
        f"own/ahead {run['median_ratio']:.3f} (saved {1e3 * run['measured_saving_s']:.1f} ms); "
        f"predicted: ahead {1e3 * predicted['ahead']:.1f}, own {1e3 * predicted['own']:.1f} "
        f"(the ids' alltoall {1e3 * run['predicted_ids_s']:.1f} ms, saved "
        f"{1e3 * run['predicted_saving_s']:.1f} ms)",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
