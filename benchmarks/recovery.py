"""How long an elastic run takes to continue after a host fails: from the failure
to the first step on the hosts that are left.

    sudo python benchmarks/recovery.py [--failures kill,link] [--gloo_timeout 10]
        [--steps 400] [--dir PARENT] [--json PATH]

Builds three "hosts" on this machine (network namespaces with their own address,
hostname and sshd: `harness.netns`, root needed), and for each
failure launches `main.py` on them under `horovodrun --gloo --host-discovery-script`
(one rank per host, a checkpoint every 20 steps), waits for the checkpoint at step
40 and 5 more steps, then fails node3 (it stays listed, but horovodrun does not
take a failed host back without --blacklist-cooldown-range):

- `kill`: its rank is killed (a host that loses power; the kernel closes its
  connections);
- `link`: its link goes down (nothing closes; the survivors notice it after
  HOROVOD_GLOO_TIMEOUT_SECONDS, --gloo_timeout).

For each it reports, from the metrics log (`dlrm.app.elastic`): `detect_s`, from the
failure to the moment the last survivor saw its collective fail; `continue_s`, from
there to the first step of the new world (the world formed, the session built again,
the checkpoint restored); and their sum, `total_s`. The model has 8 tables of up to
200,000 x 16 and 2 ranks' worth of Adagrad state: a checkpoint of about 30 MB.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.common import add_output_flags, parser_for, save, work_directory
from dataloading.synthetic import generate_split_binary
from harness.elastic_job import ElasticJob
from harness.netns import NetnsCluster, install_reason

HOSTS = ("node1", "node2", "node3")
CARDINALITIES = (200_000, 100_000, 50_000, 10_000, 1_000, 100, 30, 7)
EVERY = 20
FAILURES = ("kill", "link")


def flags(steps: int) -> list[str]:
    flags = ["--batch_size=3072"]  # divides by 3 and 2 ranks
    flags += ["--optimizer=adagrad", "--learning_rate=0.05", "--embedding_dim=16"]
    flags += ["--bottom_mlp_dims=64,16", "--top_mlp_dims=64,1", "--print_freq=5"]
    flags += ["--evals_per_epoch=0", f"--max_steps={steps}", f"--checkpoint_every_steps={EVERY}"]
    return flags


def measure(
    cluster: NetnsCluster, failure: str, dataset: Path, work: Path, args: argparse.Namespace
) -> dict[str, Any]:
    job = ElasticJob(cluster, work / failure, dataset, flags(args.steps), HOSTS, args.gloo_timeout)
    job.start(3, 2)
    try:
        job.wait_for_step(2 * EVERY + 5, "node3")
        if failure == "kill":
            failed_at = job.kill_ranks("node3")
        else:
            cluster.link("node3", up=False)
            failed_at = time.time()
        returncode = job.wait()  # node3 failed: it does not join again (no cooldown range)
    finally:
        if failure == "link":
            cluster.link("node3", up=True)
        job.kill_ranks("node3")
    if returncode != 0:
        raise RuntimeError(f"{failure}: horovodrun exited {returncode}:\n{job.output()}")
    recovered = job.records("elastic_recovered")
    if not recovered:
        raise RuntimeError(f"{failure}: no elastic_recovered record:\n{job.output()}")
    first_step = recovered[0]["time"]
    continue_s = recovered[0]["seconds"]
    worlds = job.records("summary")[-1]["elastic"]["worlds"]
    return {
        "detect_s": round(first_step - continue_s - failed_at, 2),
        "continue_s": round(continue_s, 2),
        "total_s": round(first_step - failed_at, 2),
        "worlds": worlds,
    }


def main(argv: list[str] | None = None) -> int:
    parser = parser_for(__doc__)
    parser.add_argument("--failures", default=",".join(FAILURES))
    parser.add_argument("--gloo_timeout", type=int, default=10)
    parser.add_argument("--steps", type=int, default=400)
    add_output_flags(parser)
    args = parser.parse_args(argv)
    failures = [f for f in args.failures.split(",") if f]
    unknown = sorted(set(failures) - set(FAILURES))
    if unknown:
        parser.error(f"--failures: unknown {unknown}; expected some of {list(FAILURES)}")
    reason = install_reason()
    if reason is not None:
        print(f"recovery: not measured ({reason})", file=sys.stderr)
        return 1
    with work_directory("recovery.", args.dir) as work:
        dataset = work / "data"
        rows = {"train": 3072 * (args.steps + 10), "test": 3072}
        generate_split_binary(dataset, CARDINALITIES, 13, rows=rows, seed=5)
        results: dict[str, Any] = {"gloo_timeout_s": args.gloo_timeout, "hosts": len(HOSTS)}
        with NetnsCluster(work / "cluster", hosts=3, tag="recovery") as cluster:
            for failure in failures:
                results[failure] = figures = measure(cluster, failure, dataset, work, args)
                print(
                    f"{failure}: first step on 2 ranks {figures['total_s']:.1f} s after the "
                    f"failure (noticed after {figures['detect_s']:.1f} s, then "
                    f"{figures['continue_s']:.1f} s to continue)",
                    flush=True,
                )
        if args.json:
            save(results, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
