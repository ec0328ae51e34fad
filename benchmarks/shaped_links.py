"""Step time on simulated hosts joined by links of real speed, against `dlrm-plan`.

    sudo python benchmarks/shaped_links.py [--hosts 2,3] [--gbit 1,10]
        [--batch_sizes 6144,24576] [--steps 8] [--warmup 3] [--output results.json]

For each number of hosts it builds that many "hosts" on this machine (network
namespaces with their own address, hostname and sshd: `harness.netns`, root
needed), one rank each; for each link speed it limits every host's link to it in
both directions (`tc tbf`: `NetnsCluster.shape`) and measures what the link then
does (TCP throughput in one direction, and the round trip of a small message);
for each batch size it trains the default fp32 model on a synthetic Criteo-shaped
dataset (`benchmarks/train.py`'s rank worker under `horovodrun --gloo`, Gloo over
the hosts' links) and measures

- the step (the slowest rank's),
- the time in it in which a rank runs no op, waiting on its collectives
  (exposed; a profiler trace of each rank: `benchmarks/collective_time.py`),
- the time in which some collective was transferring data (executing; Horovod's
  timeline);

then asks the dry run (`python -m dlrm.planning`, the same dataset and flags) for
the same world, with the device's figures measured on this machine
(`dlrm.planning.probe.local_device`) divided among the ranks that share its CPUs,
and the links' speed and latency as measured, and prints both side by side with
the error of each: the step, its communication (every exchange term of the dry
run, against the executing time) and its compute (dense compute and lookups,
against the step times the share of the traced steps in which some op ran).

Every "host" shares this machine's CPUs: each rank runs as many TensorFlow threads
as its share of them, the dry run is told so (each rank gets its share of the
compute), and the kernel's copies through the shaped links take CPU time from
training, which no term of the model holds.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script from anywhere

from benchmarks.collective_time import timeline_seconds
from benchmarks.common import REPO, child_env, integers, parser_for, save, work_directory
from benchmarks.train import per_step, worker_command
from dataloading.synthetic import generate_split_binary
from dlrm.planning.devices import DeviceSpec
from harness.netns import INTERFACE, NetnsCluster, install_reason
from harness.processes import horovodrun

# The device-table entry the dry run is given: this machine's share per rank.
DEVICE = "netns-host"
# The dry run's terms, as its JSON names them, by what they are measured against.
COMPUTE_TERMS = ("dense_compute_s", "lookups_update_s")
EXCHANGE_TERMS = (
    "alltoall_ids_s",
    "alltoall_vectors_s",
    "alltoall_gradients_s",
    "dense_allreduce_s",
    "replicated_gradients_s",
)

# Run on a host: receives and discards (throughput), or echoes one byte (latency).
_SERVER = """
import socket, sys
server = socket.create_server(("0.0.0.0", int(sys.argv[1])))
print("ready", flush=True)
for mode in ("bulk", "echo"):
    connection, _ = server.accept()
    connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    while True:
        data = connection.recv(1 << 20 if mode == "bulk" else 1)
        if not data:
            break
        if mode == "echo":
            connection.sendall(data)
    connection.close()
"""
# Run on another: sends for `seconds`, then times `round_trips` one-byte round trips.
_CLIENT = """
import json, socket, sys, time
host, port = sys.argv[1], int(sys.argv[2])
seconds, round_trips = float(sys.argv[3]), int(sys.argv[4])
block = bytes(1 << 20)
with socket.create_connection((host, port)) as bulk:
    start = time.perf_counter(); sent = 0
    while time.perf_counter() - start < seconds:
        bulk.sendall(block); sent += len(block)
    bulk.shutdown(socket.SHUT_WR); bulk.recv(1)
    elapsed = time.perf_counter() - start
with socket.create_connection((host, port)) as echo:
    echo.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(20):
        echo.sendall(b"x"); echo.recv(1)
    start = time.perf_counter()
    for _ in range(round_trips):
        echo.sendall(b"x"); echo.recv(1)
    round_trip = (time.perf_counter() - start) / round_trips
print(json.dumps({"gbit_s": 8 * sent / elapsed / 1e9, "latency_us": 1e6 * round_trip / 2}))
"""


def measure_link(cluster: NetnsCluster, seconds: float = 3.0) -> dict[str, float]:
    """What node1's link to node2 does: TCP throughput (Gbit/s) and half a small
    message's round trip (us)."""
    port = "5201"
    server = cluster.popen(
        "node2", [sys.executable, "-c", _SERVER, port], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None
        if server.stdout.readline().strip() != "ready":
            raise RuntimeError("the link probe's server on node2 did not start")
        result = cluster.run(
            "node1",
            [sys.executable, "-c", _CLIENT, "node2", port, str(seconds), "2000"],
            timeout=120,
        )
        if result.returncode != 0:
            raise RuntimeError(f"the link probe failed: {result.stderr[-2000:]}")
        return json.loads(result.stdout)
    finally:
        server.kill()
        server.wait()


def measure_training(
    cluster: NetnsCluster,
    dataset: Path,
    batch_size: int,
    args: argparse.Namespace,
    work: Path,
    train_flags: Sequence[str] = (),
) -> dict[str, float]:
    """The step on one rank per host of the default model (or of dlrm-train's
    `train_flags`), and its collectives' time."""
    hosts = ",".join(f"{host.name}:1" for host in cluster.members)
    output, timeline = work / "ranks.json", work / "timeline.json"
    timeline.unlink(missing_ok=True)
    worker = worker_command(
        dataset, batch_size, args.steps, args.warmup, output, train_flags=train_flags
    )
    command = [horovodrun(), "--gloo", "-np", str(len(cluster.members)), "-H", hosts]
    command += ["--network-interface", INTERFACE, *worker]
    # Each rank is alone on its "host", so it would size TensorFlow's pool to every
    # CPU of the machine, as would the others: their threads would take turns on
    # the cores. Each gets its share instead, as ranks sharing one host do.
    threads = str(max(1, len(os.sched_getaffinity(0)) // len(cluster.members)))
    env = child_env({"HOROVOD_TIMELINE": str(timeline), "TF_NUM_INTRAOP_THREADS": threads})
    result = cluster.run("node1", command, timeout=3600, env=env, cwd=REPO)
    if result.returncode != 0:
        raise RuntimeError(f"training on {hosts} failed:\n{result.stderr[-3000:]}")
    ranks = json.loads(output.read_text())
    # The timeline holds the timed steps and the profiled ones after them.
    executing, _ = timeline_seconds(timeline, 2 * args.steps, "embedding_vectors")
    times = per_step(ranks, args.steps)
    return {
        "step_s": times["step"],
        "exposed_s": times["exposed"],
        # Of the traced steps themselves: the timed ones ran apart, without the profiler.
        "exposed_share": times["exposed_share"],
        "executing_s": executing / 2 / args.steps,
    }


def host_share(local: DeviceSpec, ranks: int, link: dict[str, float]) -> DeviceSpec:
    """One of `ranks` ranks sharing this machine (`local`, a CPU server: its share of
    the compute, memory and bandwidth, `DeviceSpec.per_rank`), each a host of its own
    behind `link`. It stays a CPU server (of one rank), so the dry run cuts its batch
    into chunks as the rank does."""
    return dataclasses.replace(
        local.per_rank(ranks),
        name=DEVICE,
        inter_host_gbit_s=link["gbit_s"],
        inter_host_latency_us=link["latency_us"],
        source=f"this machine's measured figures / {ranks} ranks; links measured",
    )


def predict(
    dataset: Path,
    batch_size: int,
    hosts: int,
    device: DeviceSpec,
    work: Path,
    train_flags: Sequence[str] = (),
) -> dict[str, Any]:
    """The dry run's figures for this world (`python -m dlrm.planning`), of the
    default model or of dlrm-train's `train_flags`."""
    table, output = work / "devices.json", work / "plan.json"
    entry = {k: v for k, v in dataclasses.asdict(device).items() if k != "name"}
    table.write_text(json.dumps({DEVICE: entry}))
    command = [sys.executable, "-m", "dlrm.planning", *train_flags, f"--dataset_path={dataset}"]
    command += [f"--batch_size={batch_size}", f"--hosts={hosts}", "--ranks_per_host=1"]
    command += [f"--device_table={table}", f"--device={DEVICE}", f"--json={output}"]
    result = subprocess.run(command, capture_output=True, text=True, env=child_env(), cwd=REPO)
    if result.returncode != 0:
        raise RuntimeError(f"the dry run failed:\n{result.stdout}{result.stderr[-3000:]}")
    plan = json.loads(output.read_text())
    step = plan["step_time_per_rank"][plan["slowest_rank"]]
    return {
        "step_s": step["total_s"],
        "compute_s": sum(step[term] for term in COMPUTE_TERMS),
        "exchange_s": sum(step[term] for term in EXCHANGE_TERMS),
        "terms": step,
    }


def compare(measured: dict[str, float], predicted: dict[str, Any]) -> dict[str, float]:
    """Each prediction's error against what it is measured by (predicted / measured - 1)."""
    pairs = {
        "step": (predicted["step_s"], measured["step_s"]),
        "exchange": (predicted["exchange_s"], measured["executing_s"]),
        "compute": (predicted["compute_s"], busy_seconds(measured)),
    }
    return {name: p / m - 1 for name, (p, m) in pairs.items()}


def busy_seconds(measured: dict[str, float]) -> float:
    """The step's time in which some op ran: the step times the share of the traced
    steps in which one did. (The exposed seconds come from the traced steps, which
    the profiler slows; where nearly the whole step waits, they can exceed the timed
    step, so the step less them would not be a time.)"""
    return measured["step_s"] * (1 - measured["exposed_share"])


def print_row(row: dict[str, Any]) -> None:
    measured, predicted, error = row["measured"], row["predicted"], row["error"]
    link = row["link"]
    print(
        f"{row['hosts']:>5} {row['gbit_s']:>5g} {link['gbit_s']:>6.2f} "
        f"{link['latency_us']:>5.0f} {row['batch_size']:>6} "
        f"{1e3 * measured['step_s']:>7.0f} {1e3 * predicted['step_s']:>7.0f} "
        f"{error['step']:>+6.0%} "
        f"{1e3 * measured['executing_s']:>7.0f} {1e3 * predicted['exchange_s']:>7.0f} "
        f"{error['exchange']:>+6.0%} "
        f"{1e3 * busy_seconds(measured):>7.0f} "
        f"{1e3 * predicted['compute_s']:>7.0f} {error['compute']:>+6.0%}",
        flush=True,
    )


def parse_args() -> argparse.Namespace:
    parser = parser_for(__doc__)
    parser.add_argument("--hosts", type=integers, default=[2, 3])
    parser.add_argument("--gbit", type=lambda t: [float(x) for x in t.split(",")], default=[1, 10])
    parser.add_argument("--batch_sizes", type=integers, default=[6144, 24576])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--output", type=Path, help="also write the figures as JSON")
    args = parser.parse_args()
    for batch in args.batch_sizes:
        for hosts in args.hosts:
            if batch % hosts:
                parser.error(f"--batch_sizes {batch}: must divide by every --hosts ({hosts})")
    if min(args.hosts) < 2:
        parser.error(f"--hosts: expected 2 or more each, got {args.hosts}")
    reason = install_reason()
    if reason is not None:
        parser.error(reason)
    return args


def main() -> int:
    args = parse_args()
    # Stopped, it still deletes its namespaces (NetnsCluster's exit).
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    from dlrm.planning.probe import local_device  # imports TensorFlow

    local = local_device()  # measured once: matmul, copy and runtime probes
    local_figures = dataclasses.asdict(local)
    print(
        f"this machine ({os.cpu_count()} CPUs, shared by every host): "
        f"{1e3 * local.fp32_tflops:.0f} GFLOP/s float32 matmul, "
        f"{local.memory_bandwidth_gb_s:.1f} GB/s copy"
    )
    print(
        "default model, fp32, one rank per host; ms a step, measured and predicted; "
        "exchange: Horovod's executing time against every exchange term; compute: the "
        "step times its share not exposed against dense compute + lookups"
    )
    print(
        f"{'hosts':>5} {'Gbit':>5} {'TCP':>6} {'us':>5} {'batch':>6} "
        f"{'step':>7} {'pred':>7} {'err':>6} {'exch':>7} {'pred':>7} {'err':>6} "
        f"{'compute':>7} {'pred':>7} {'err':>6}"
    )
    rows: list[dict[str, Any]] = []
    with work_directory("shaped_links_") as work:
        dataset = work / "data"
        samples = max(args.batch_sizes) * (args.steps + args.warmup)
        generate_split_binary(dataset, num_numerical=13, rows={"train": samples, "test": 1})
        for hosts in args.hosts:
            with NetnsCluster(work / f"cluster{hosts}", hosts=hosts) as cluster:
                for gbit in args.gbit:
                    cluster.shape(gbit)
                    link = measure_link(cluster)
                    device = host_share(local, hosts, link)
                    for batch in args.batch_sizes:
                        measured = measure_training(cluster, dataset, batch, args, work)
                        predicted = predict(dataset, batch, hosts, device, work)
                        row = {
                            "hosts": hosts,
                            "gbit_s": gbit,
                            "link": link,
                            "batch_size": batch,
                            "measured": measured,
                            "predicted": predicted,
                            "error": compare(measured, predicted),
                        }
                        rows.append(row)
                        print_row(row)
                        if args.output:
                            save({"local_device": local_figures, "runs": rows}, args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main())
