"""Two ranks on one host against one rank on each of two hosts, per training step.

    sudo python benchmarks/multi_host.py [--batch_size 8192] [--steps 12] [--warmup 3]
        [--output results.json]

Builds two "hosts" on this machine (network namespaces with their own address,
hostname and sshd: `harness.netns`, root needed), generates a
synthetic Criteo-shaped dataset, and times the default fp32 model's training
steps (`benchmarks/train.py`'s rank worker: then as many steps traced by the
profiler, for the time in them in which a rank runs no op, waiting on its
collectives) under

- `horovodrun --gloo -np 2 -H node1:2`: both ranks on node1, Gloo over loopback;
- `horovodrun --gloo -np 2 -H node1:1,node2:1 --network-interface eth0`: one rank
  per host, rank 1 started over ssh, Gloo over the hosts' link (veth pairs and a
  bridge).

Prints samples/s, step time, and the time waiting on collectives and its share
for each.
Both "hosts" share this machine's CPUs and memory, and their link is the
kernel's: the comparison isolates the cost of the launch and network path a real
cluster adds in software, not that of a physical network.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.common import REPO, child_env, parser_for, save, work_directory
from benchmarks.train import per_step, worker_command
from dataloading.synthetic import generate_split_binary
from harness.netns import INTERFACE, NetnsCluster, install_reason
from harness.processes import horovodrun

LAYOUTS = {
    "1 host x 2 ranks": ["-H", "node1:2"],
    "2 hosts x 1 rank": ["-H", "node1:1,node2:1", "--network-interface", INTERFACE],
}


def measure(
    cluster: NetnsCluster, layout: list[str], dataset: Path, args: argparse.Namespace, out: Path
) -> dict:
    worker = worker_command(dataset, args.batch_size, args.steps, args.warmup, out)
    command = [horovodrun(), "--gloo", "-np", "2", *layout, *worker]
    result = cluster.run("node1", command, timeout=1800, env=child_env(), cwd=REPO)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(layout)} failed:\n{result.stderr[-3000:]}")
    times = per_step(json.loads(out.read_text()), args.steps)
    return {
        "samples_per_second": args.batch_size / times["step"],
        "step_seconds": times["step"],
        "exposed_seconds_per_step": times["exposed"],
        "exposed_share": times["exposed_share"],
    }


def main() -> int:
    parser = parser_for(__doc__)
    parser.add_argument("--batch_size", type=int, default=8192)
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--output", type=Path, help="also write the figures as JSON")
    args = parser.parse_args()
    reason = install_reason()
    if reason is not None:
        parser.error(reason)
    results = {}
    with work_directory("multi_host_") as work:
        dataset = work / "data"
        rows = args.batch_size * (args.steps + args.warmup)
        generate_split_binary(dataset, num_numerical=13, rows={"train": rows, "test": 1}, seed=0)
        print(
            f"default model, fp32, global batch {args.batch_size}, {args.steps} timed steps, "
            f"2 ranks ({os.cpu_count()} CPUs shared by both hosts)"
        )
        print(f"{'layout':<18} {'samples/s':>10} {'step ms':>8} {'waiting ms':>11} {'share':>6}")
        with NetnsCluster(work / "cluster") as cluster:
            for name, layout in LAYOUTS.items():
                figures = measure(cluster, layout, dataset, args, work / f"{len(results)}.json")
                results[name] = figures
                print(
                    f"{name:<18} {figures['samples_per_second']:>10,.0f} "
                    f"{1000 * figures['step_seconds']:>8.1f} "
                    f"{1000 * figures['exposed_seconds_per_step']:>11.1f} "
                    f"{figures['exposed_share']:>6.0%}",
                    flush=True,
                )
    if args.output:
        save(results, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
